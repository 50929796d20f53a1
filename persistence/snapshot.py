"""Consistent, self-verifying snapshots of the state directory, written while a server may run.

Each visible ``*.db`` is copied through SQLite's backup API (never its ``-wal``/``-shm`` files),
in a read transaction begun, for all of them, before the first is copied: the copies are of one
moment. Each copy is switched out of WAL mode and checked with ``PRAGMA integrity_check``, and the
snapshot staged in a hidden ``.incomplete-<stamp>.*`` directory under the backup root. It is
published by one rename to ``<root>/<stamp>`` once its manifest and ``.complete`` marker are durable.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from datetime import datetime, timedelta, timezone
from pathlib import Path

from persistence.databases import SCHEMAS, check_servable, check_together
from persistence.errors import RESTORE_FIX, SchemaError, StoreError
from persistence.manifest import FORMAT_VERSION, MANIFEST_NAME, MARKER_NAME, DatabaseEntry, Manifest, check_supported
from persistence.recovery import recover, recover_locked
from persistence.refusals import cannot_create, not_a_directory_to_use, refusal, write_refused
from persistence.schema import read_identity
from persistence.sqlite import create_private, damaged, immutable_uri
from persistence.statedir import (
    DIR_MODE,
    PRIVATE_MODE,
    SnapshotError,
    encode_document,
    file_evidence,
    fsync_dir,
    holds_keel_state,
    is_db_name,
    make_dirs,
    nearest_existing,
    owned_as_directory,
    write_new_file,
)
from persistence.statelocks import generation_lock, in_use, written_by_no_one

APPLICATION = "keel"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
STAMP = re.compile(r"\d{8}T\d{6}Z")
BUSY_TIMEOUT_MS = 30_000  # a writer's transaction may hold the database briefly; wait for it


def stamp_for(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime(STAMP_FORMAT)


def _is_stamp(text: str) -> bool:
    """Whether ``text`` is a stamp of a time there is (not month 13, say)."""
    if not STAMP.fullmatch(text):
        return False
    try:
        moment = datetime.strptime(text, STAMP_FORMAT).replace(tzinfo=timezone.utc)
    except ValueError:
        return False
    return stamp_for(moment) == text


def create_snapshot(
    state_dir: Path, backup_root: Path, *, keep: int, app_version: str, stamp: str | None = None
) -> Path:
    """Snapshot every database in ``state_dir`` into ``<backup_root>/<stamp>`` and return that path.

    Blocking. Runs recovery first; holds the generation lock while it copies, so a restore waits
    (a server keeps running). Keeps the newest ``keep`` complete snapshots. Raises SnapshotError
    (nothing published) for a missing or empty state directory, a backup root inside it (or not a
    directory, or one this user may not write in), a stamp that is taken or being written by
    another process, or a database that fails its check; RecoveryError when the state directory
    cannot be accounted for.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}; a snapshot that is pruned at once protects nothing")
    now = datetime.now(timezone.utc)
    if stamp is not None and not _is_stamp(stamp):  # an empty one too: it is not taken for now
        raise SnapshotError(f"snapshot timestamp {stamp!r} must be a UTC time written like 20260131T235959Z")
    recover(state_dir)
    if not state_dir.is_dir():
        raise SnapshotError(f"the state directory {state_dir} does not exist; there is nothing to snapshot")
    if why := not_a_directory_to_use(backup_root):
        raise _unusable_backup_root(backup_root, why)
    if Path(os.path.realpath(backup_root)).is_relative_to(os.path.realpath(state_dir)):
        raise SnapshotError(
            f"the backup root {backup_root} is inside the state directory {state_dir}; choose one outside it"
        )
    # Refused before the lock, which would leave its file in a directory not Keel's (and make it Keel's to reset).
    _database_names(state_dir)
    if not holds_keel_state(state_dir, os.listdir(state_dir)):
        raise SnapshotError(
            f"{state_dir} is not a Keel state directory: none of its databases carries a Keel schema identity;"
            " check that --state-dir (or AGENT_STATE_DIR) names the state directory"
        )
    with generation_lock(state_dir, reading=True):  # none where no one may write: nothing there can change
        recover_locked(state_dir, exclusive_held=False)
        names = _database_names(state_dir)
        _make_backup_root(backup_root)
        _refuse_anothers(backup_root, state_dir)
        _remove_abandoned(backup_root)
        stamp = _stamp_at(backup_root, now) if stamp is None else stamp
        # A server that holds the directory may not have opened its databases yet: none is then
        # a file no one will change (see _read_together), whatever is beside it.
        immutable = written_by_no_one(state_dir) or not in_use(state_dir)
        with _claim_stamp(backup_root, stamp):
            target = _write_snapshot(state_dir, backup_root, stamp, names, app_version, now, immutable=immutable)
    prune_snapshots(backup_root, keep=keep, keeping=target)
    return target


def _stamp_at(backup_root: Path, now: datetime) -> str:
    """The stamp of a snapshot taken ``now``: its second, or, while the clock is behind the newest
    snapshot's (set back since it was taken), the second after that one's. Pruning keeps the newest
    by name, which must then be those taken last, not those taken before the clock stepped back."""
    stamp = stamp_for(now)
    newest = max((path.name for path in complete_snapshots(backup_root) if _is_stamp(path.name)), default=stamp)
    if newest > stamp:
        with suppress(OverflowError):  # a clock once set to the last second of 9999
            stamp = stamp_for(datetime.strptime(newest, STAMP_FORMAT).replace(tzinfo=timezone.utc) + timedelta(seconds=1))
    return stamp


def _unusable_backup_root(backup_root: Path, why: str) -> SnapshotError:
    return SnapshotError(
        f"the backup root {backup_root} cannot be used: {why}; give --backup-root (or AGENT_BACKUP_ROOT)"
        " a directory this user may write in"
    )


def _make_backup_root(backup_root: Path) -> None:
    """Make the backup root unless it is there; refuse one that no snapshot can be written in."""
    try:
        make_dirs(backup_root)
    except OSError as exc:
        existing = nearest_existing(backup_root)
        raise _unusable_backup_root(backup_root, cannot_create(existing, refusal(exc, "directories", existing))) from exc
    if why := write_refused(backup_root):
        raise _unusable_backup_root(backup_root, why)


OWNER_NAME = ".keel-snapshots-of"


def _refuse_anothers(backup_root: Path, state_dir: Path) -> None:
    """Refuse a backup root that holds another state directory's snapshots.

    Pruning keeps the newest snapshots in a backup root: in a root two state directories shared,
    each would prune the other's, and the newest snapshot there, restored, could put one
    directory's state in the other. The first snapshot published in a root names its state
    directory (the path with every link resolved) in OWNER_NAME (_claim_backup_root); a root
    made before there was one is claimed as it stands."""
    if theirs := anothers_backup_root(backup_root, state_dir):
        raise SnapshotError(
            f"the backup root {backup_root} holds the snapshots of another state directory, {theirs}: give each state"
            f" directory a backup root of its own (--backup-root or AGENT_BACKUP_ROOT), or, if {theirs} was moved"
            f" to {state_dir}, remove {backup_root / OWNER_NAME}"
        )


def anothers_backup_root(backup_root: Path, state_dir: Path) -> str | None:
    """The state directory other than ``state_dir`` whose snapshots ``backup_root`` holds, if any.
    Raises SnapshotError when the file that names it cannot be read."""
    owner = backup_root / OWNER_NAME
    try:
        theirs = os.fsdecode(owner.read_bytes()).removesuffix("\n")  # a path as the file system spells it
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise SnapshotError(f"{owner} cannot be read ({exc}); it names the state directory whose snapshots are there") from exc
    return None if theirs == os.path.realpath(state_dir) else theirs


def _claim_backup_root(backup_root: Path, state_dir: Path, staging: Path) -> None:
    """Name ``state_dir`` as the one whose snapshots ``backup_root`` holds, unless one is named;
    then refuse the root if that is another. Just before a snapshot is published, so that a
    snapshot that fails leaves no claim, and made in ``staging`` first, which a failure removes."""
    if not os.path.lexists(backup_root / OWNER_NAME):
        claim = staging / OWNER_NAME
        write_new_file(claim, os.fsencode(f"{os.path.realpath(state_dir)}\n"), mode=PRIVATE_MODE)
        owned_as_directory(claim, backup_root)
        try:
            os.link(claim, backup_root / OWNER_NAME)  # whole, and never over a claim made meanwhile
        except FileExistsError:
            pass
        claim.unlink()
    _refuse_anothers(backup_root, state_dir)


def _database_names(state_dir: Path) -> list[str]:
    names = sorted(name for name in os.listdir(state_dir) if name.endswith(".db") and not name.startswith("."))
    if not names:
        raise SnapshotError(f"the state directory {state_dir} holds no databases; there is nothing to snapshot")
    for name in names:
        if not is_db_name(name):
            raise SnapshotError(
                f"{state_dir / name}: a snapshot only carries databases with plain names (letters, digits, . _ -)"
            )
        if not (state_dir / name).is_file() or (state_dir / name).is_symlink():
            raise SnapshotError(f"{state_dir / name} must be a regular file to be snapshotted")
    return names


@contextmanager
def _stamp_lock(backup_root: Path, stamp: str) -> Iterator[bool]:
    """Hold ``.snapshot-<stamp>.lock`` for the block, yielding True; False if a live process holds it.

    An flock, released by the kernel if this process dies; the file is unlinked while still
    locked, so a claimant that opened the old inode re-checks and retries.
    """
    path = backup_root / f".snapshot-{stamp}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_MODE)
        owned_as_directory(fd, backup_root)  # a snapshot killed meanwhile leaves it to the next
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous owner unlinked it after we opened it; claim the new file
    try:
        yield True
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


@contextmanager
def _claim_stamp(backup_root: Path, stamp: str) -> Iterator[None]:
    """Own ``stamp`` in ``backup_root`` for as long as the snapshot is being written."""
    with _stamp_lock(backup_root, stamp) as held:
        if not held:
            raise SnapshotError(f"another process is writing snapshot {stamp} in {backup_root}")
        if os.path.lexists(backup_root / stamp):
            raise SnapshotError(
                f"a snapshot named {stamp} already exists in {backup_root}; snapshots are never overwritten:"
                " give another --timestamp, or, with none, take it again a second later"
            )
        yield


_ABANDONED = re.compile(r"\.incomplete-(\d{8}T\d{6}Z)\..+|\.snapshot-(\d{8}T\d{6}Z)\.lock")


def _remove_abandoned(backup_root: Path) -> None:
    """Remove what snapshot writers that died left (``kill -9``, a power cut): their staging
    directories, which hold full copies of the databases, and their lock files; a stamp that a
    live writer holds is left alone."""
    stamps = {found[1] or found[2] for found in map(_ABANDONED.fullmatch, os.listdir(backup_root)) if found}
    for stamp in sorted(stamps):
        with _stamp_lock(backup_root, stamp) as held:
            if held:
                for stale in backup_root.glob(f".incomplete-{stamp}.*"):
                    shutil.rmtree(stale, ignore_errors=True)


def _write_snapshot(
    state_dir: Path, backup_root: Path, stamp: str, names: list[str], app_version: str, now: datetime, *, immutable: bool
) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=f".incomplete-{stamp}.", dir=backup_root))
    try:
        os.chmod(staging, DIR_MODE)
        for name in names:
            # Read with the -wal beside it, a database is checkpointed as the copy's source closes:
            # one the -wal of another makes unservable (copied in over its own) is refused first,
            # read only, so that the file stays as it is, for its operator to restore.
            if os.path.lexists(state_dir / f"{name}-wal"):
                _check_servable(state_dir / name, state_dir / name)
        with _read_together(state_dir, names, immutable=immutable) as sources:
            entries = tuple(_copy_database(state_dir / name, src, staging / name) for name, src in zip(names, sources))
        _check_together(state_dir, staging, entries)
        manifest = Manifest(
            created_at=now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            application=APPLICATION,
            version=app_version,
            databases=entries,
        )
        manifest_bytes = encode_document(manifest.to_json())
        write_new_file(staging / MANIFEST_NAME, manifest_bytes, mode=PRIVATE_MODE)
        marker = {"format_version": FORMAT_VERSION, "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
        write_new_file(staging / MARKER_NAME, encode_document(marker), mode=PRIVATE_MODE)
        _claim_backup_root(backup_root, state_dir, staging)
        for made in (*staging.iterdir(), staging):
            owned_as_directory(made, backup_root)
        fsync_dir(staging)
        target = backup_root / stamp
        os.rename(staging, target)  # the one rename that publishes it; the stamp claim keeps target free
        fsync_dir(backup_root)
        return target
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SnapshotError(
                f"the backup root {backup_root} has no room for a snapshot of {state_dir}"
                f" ({refusal(exc, 'files', backup_root)}), so none was written; free space on its disk, or give"
                " --backup-root (or AGENT_BACKUP_ROOT) a directory on one with room"
            ) from exc
        raise


@contextmanager
def _read_together(state_dir: Path, names: list[str], *, immutable: bool) -> Iterator[list[sqlite3.Connection]]:
    """A connection to each database, each in a read transaction begun before any is copied: the
    copies hold the databases as they were at one moment (a few microseconds wide), however long
    copying the first takes while a server writes. ``immutable``: no server holds the directory,
    and under the generation lock none can start meanwhile (or no one may write in it): a database
    with no ``-wal`` beside it is then read as an immutable file, so nothing is made beside it, and
    a read-only copy of a state directory can be read."""
    with ExitStack() as stack:
        sources = []
        for name in names:
            source = state_dir / name
            try:
                uri = immutable_uri(source) if immutable else None
                src = sqlite3.connect(uri or source, uri=uri is not None, timeout=BUSY_TIMEOUT_MS / 1000)
                stack.callback(src.close)
                src.execute("BEGIN")
                src.execute("SELECT count(*) FROM sqlite_master").fetchone()  # the read transaction starts here
            except sqlite3.Error as exc:
                raise _not_copied(source, exc) from exc
            sources.append(src)
        yield sources


def _copy_database(source: Path, src: sqlite3.Connection, copy: Path) -> DatabaseEntry:
    """Copy one database (``src``, in its read transaction) consistently, check the copy, and
    describe it for the manifest."""
    try:
        create_private(copy)  # what it holds is the conversations: its owner's alone, as the live files are
        dst = sqlite3.connect(copy)
        try:
            src.backup(dst)  # one step, in src's read transaction, so the copy is consistent
            # The copy inherits WAL mode from the header; a snapshot file must stand alone.
            dst.execute("PRAGMA journal_mode=DELETE")
            problems = [row[0] for row in dst.execute("PRAGMA integrity_check(10)")]
            if problems != ["ok"]:
                raise SnapshotError(
                    f"{source} is damaged (SQLite's integrity check of it found: {'; '.join(map(str, problems))}), so no"
                    f" snapshot of it was written. {RESTORE_FIX}"
                )
            identity = read_identity(dst)
        finally:
            dst.close()
    except sqlite3.Error as exc:
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL:  # the copy's disk: the source is read
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(copy)) from exc
        raise _not_copied(source, exc) from exc
    check_supported(f"{source}", identity, fix="snapshot it with a build that supports it")
    _check_servable(source, copy)
    with open(copy, "rb+") as handle:
        os.fsync(handle.fileno())
    evidence = file_evidence(copy)
    return DatabaseEntry(filename=copy.name, sha256=evidence.sha256, size_bytes=evidence.size_bytes, schema=identity)


def _not_copied(source: Path, exc: sqlite3.Error) -> SnapshotError:
    """Why the database ``source`` could not be copied: it is damaged, or SQLite failed to read it."""
    if damaged(exc):
        return SnapshotError(
            f"{source} is damaged (it cannot be read as a database), so no snapshot of it was written. {RESTORE_FIX}"
        )
    return SnapshotError(f"{source} could not be copied: {exc}")


def _check_servable(source: Path, copy: Path) -> None:
    """Refuse a copy that serve would refuse to open as its source (a snapshot is to be restored
    and served), naming the source: what is wrong with it, and what to do, is so."""
    try:
        check_servable(copy, source.name)
    except SchemaError as exc:
        raise SnapshotError(
            f"{source} cannot be snapshotted as it is: it {exc.reason}. A server refuses it so, as it would a snapshot"
            f" of it restored: no snapshot was written. {exc.fix}"
        ) from exc
    except StoreError as exc:  # SQLite failed to read the copy
        raise SnapshotError(f"{source} could not be copied: {exc.__cause__ or exc}") from exc


def _check_together(state_dir: Path, staging: Path, entries: tuple[DatabaseEntry, ...]) -> None:
    """Refuse the copies, as serve refuses the databases, when one is missing or empty beside one
    that holds state: restored, such a snapshot would be refused, and kept, it would take the
    place of one taken before the loss."""
    found = {entry.filename: 0 if entry.schema is None else entry.schema.version for entry in entries}
    try:
        check_together(state_dir, {name: found.get(name, 0) for name in SCHEMAS}, read_in=staging)
    except SchemaError as exc:
        raise SnapshotError(
            f"{exc.path} cannot be snapshotted as it is: it {exc.reason}. A server refuses it so, as it would a snapshot"
            f" of it restored: no snapshot was written. {exc.fix}"
        ) from exc


def complete_snapshots(backup_root: Path) -> list[Path]:
    """Published snapshots (visible, stamp-named, with a ``.complete`` marker), oldest first."""
    try:
        names = os.listdir(backup_root)
    except FileNotFoundError:
        return []
    found = [backup_root / name for name in names if STAMP.fullmatch(name)]
    return sorted(path for path in found if path.is_dir() and (path / MARKER_NAME).is_file())


def prune_snapshots(backup_root: Path, *, keep: int, keeping: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` complete snapshots; anything else is left alone.

    ``keeping`` (the snapshot just written) is one of those kept even if its stamp is older than
    the others' (given by hand, or the clock stepped back): its path was reported as a backup."""
    others = [path for path in complete_snapshots(backup_root) if path != keeping]
    expired = others[: max(0, len(others) - (keep - 1 if keeping is not None else keep))]
    for path in expired:
        try:
            shutil.rmtree(path)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # another process pruned it first
                raise
    if expired:
        fsync_dir(backup_root)
    return expired
