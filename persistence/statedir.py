"""The state directory: its names, its errors, durable file operations, and the checks that it can be used.

A *generation* is the set of live state files: every visible ``*.db`` in the directory plus the
``-wal``/``-shm``/``-journal`` sidecars SQLite keeps next to them. Everything a restore leaves
behind while it works starts with ``.restore-``; the lock files start with ``.keel`` and are never
part of a generation or of the residue. The three locks they hold are ``persistence.statelocks``.

A directory that cannot be used (not a directory, or one the file system will not let Keel make
its files in) is refused with UnusableStateDir, saying why in plain words, never an errno: the
words are ``persistence.refusals``, which the checks here raise with.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import sqlite3
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from persistence.errors import StoreError
from persistence.refusals import SYMLINK, WORKING_DIRECTORY_GONE, cannot_create, not_a_directory, not_under, refusal, unreachable
from persistence.schema import KEEL_SCHEMA_PREFIX, read_identity

USE_LOCK_NAME = ".keel.lock"
SERVE_LOCK_NAME = ".keel-serve.lock"
GENERATION_LOCK_NAME = ".keel-generation.lock"
LOCK_NAMES = (USE_LOCK_NAME, GENERATION_LOCK_NAME, SERVE_LOCK_NAME)
PROBE_PREFIX = ".keel-check-"  # what trying a directory makes, for as long as it takes to remove it
RESIDUE_PREFIX = ".restore-"
SIDECAR_SUFFIXES = ("-wal", "-shm", "-journal")
DIR_MODE = 0o750
DOCUMENT_MODE = 0o644
PRIVATE_MODE = 0o600
_CHUNK_BYTES = 1 << 20
MIN_FREE_BYTES = 16 << 20  # less free in the state directory and a turn may not be stored: one can write a few MiB

# Bare, visible names of the kind Keel gives its databases; anything else is refused rather
# than escaped, so a manifest or journal can never name a path outside its directory.
_DB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.db")


class StateError(StoreError):
    """Base class for snapshot, restore, recovery and state-lock failures."""


class StateBusy(StateError):
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        super().__init__(f"the state directory {state_dir} is in use by a running process; stop it first")


class AlreadyServed(StateError):
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        super().__init__(
            f"another Keel server is serving the state directory {state_dir}; stop it first, or give this one"
            " another --state-dir (a state directory has one server at a time)"
        )


CHOOSE_ANOTHER = "choose one this user can create, or make files in"


class UnusableStateDir(StateError):
    """The state directory cannot be used: ``why`` says so in plain words (also shown alone by ``check``)."""

    def __init__(self, state_dir: Path, why: str, fix: str | None = CHOOSE_ANOTHER) -> None:
        self.state_dir = state_dir
        self.why = why
        super().__init__(f"the state directory {state_dir} cannot be used: {why}" + ("" if fix is None else f"; {fix}"))


class NotAStateDir(StateError):
    """A directory given as the state directory that holds nothing of Keel's."""

    def __init__(self, state_dir: Path, others: Sequence[str] = (), *, locks: bool = False) -> None:
        """``others``: the names of other programs' databases it holds; ``locks``: whether it
        holds Keel's lock files too (a serve or a snapshot refused there makes them)."""
        self.state_dir = state_dir
        if not others:
            held = "it holds none of Keel's lock files, databases or restore residue"
        else:
            named = ", ".join(others)
            held = f"it holds another program's {'database' if len(others) == 1 else 'databases'} ({named}) and "
            held += "of Keel's only lock files, which a serve or snapshot refused there leaves" if locks else "nothing of Keel's"
        super().__init__(
            f"{state_dir} is not a Keel state directory: {held}, so reset removed nothing from it; check that"
            " --state-dir (or AGENT_STATE_DIR) names the state directory"
        )


class SnapshotError(StateError):
    """A snapshot could not be written, or is not fit to restore; live state was not touched."""


class RestoreError(StateError):
    """A restore failed after it began; the previous generation was put back."""


class RecoveryError(StateError):
    """Recovery cannot account for the state directory; the evidence is left in place."""


@attrs.frozen
class FileEvidence:
    """What a file was, byte for byte: its name, SHA-256 and size."""

    filename: str
    sha256: str
    size_bytes: int


def is_db_name(name: str) -> bool:
    return _DB_NAME.fullmatch(name) is not None


def is_state_file_name(name: str) -> bool:
    """A database or one of its SQLite sidecars (``x.db-wal``, ``x.db-shm``, ``x.db-journal``)."""
    for suffix in SIDECAR_SUFFIXES:
        if name.endswith(suffix):
            return is_db_name(name[: -len(suffix)])
    return is_db_name(name)


def file_evidence(path: Path) -> FileEvidence:
    """Hash a regular file; a symlink or anything else is refused, never followed."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateError(f"{path} must be a regular file")
        digest = hashlib.sha256()
        while chunk := os.read(fd, _CHUNK_BYTES):
            digest.update(chunk)
        return FileEvidence(filename=path.name, sha256=digest.hexdigest(), size_bytes=info.st_size)
    finally:
        os.close(fd)


def live_files(state_dir: Path) -> list[str]:
    """The names of the live generation's files, sorted; a symlinked or odd entry is refused."""
    names = sorted(name for name in os.listdir(state_dir) if is_state_file_name(name))
    for name in names:
        if not stat.S_ISREG(os.lstat(state_dir / name).st_mode):
            raise StateError(f"state file {state_dir / name} must be a regular file, not a link or directory")
    return names


def live_inventory(state_dir: Path) -> tuple[FileEvidence, ...]:
    return tuple(file_evidence(state_dir / name) for name in live_files(state_dir))


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``, however many writes that takes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def owned_as_directory(file: int | Path, directory: Path) -> None:
    """Give ``file`` (a descriptor or a path), made in ``directory`` by root, to the directory's
    owner. An operator may run a state command as root (`sudo`) for a server that runs as a user of
    its own: a database, a lock or a snapshot left to root, readable by its owner alone, would keep
    that server from opening it, or its user from snapshotting or restoring again. (SQLite does the
    same with the files it makes beside a database.) Where root may not give files away (a
    container's root, to an owner outside its user namespace), the file is left as it is."""
    if os.geteuid() != 0 or (os.fstat(file) if isinstance(file, int) else os.lstat(file)).st_uid != 0:
        return
    owner = os.stat(directory)
    if owner.st_uid != 0:
        try:
            os.chown(file, owner.st_uid, owner.st_gid, follow_symlinks=isinstance(file, int))
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EINVAL):
                raise


def write_new_file(path: Path, data: bytes, *, mode: int = DOCUMENT_MODE) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it; the caller fsyncs the directory."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        owned_as_directory(fd, path.parent)
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_document(document: dict[str, object]) -> bytes:
    """The pinned encoding of manifests, markers and journals: sorted keys, two-space indent,
    ASCII only (non-ASCII as ``\\uXXXX``), one trailing newline; so a hash over it is stable."""
    return (json.dumps(document, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def decode_document(data: bytes) -> dict[str, object]:
    """Parse a state document strictly; raises ValueError saying why it cannot be used.

    Refuses invalid UTF-8, duplicate keys, NaN/Infinity, trailing content and a top level that is
    not an object.
    """
    text = data.decode("utf-8")  # UnicodeDecodeError is a ValueError

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice")
        return dict(pairs)

    def no_constants(name: str) -> object:
        raise ValueError(f"{name} is not a number")

    try:
        document = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except RecursionError:
        raise ValueError("it is nested deeper than can be read") from None
    if not isinstance(document, dict):
        raise ValueError("the top level is not a JSON object")
    return document


def free_bytes(directory: Path) -> int:
    """The bytes this user may still write on the file system of ``directory``."""
    usage = os.statvfs(directory)
    return usage.f_bavail * usage.f_frsize


def nearly_full(free: int, min_free: int) -> str:
    """Why a state directory with ``free`` bytes free, under ``min_free``, cannot be served from,
    in the words ``/healthz`` and ``check`` use: an empty file can still be made on a full disk,
    a turn cannot be stored."""
    return (
        f"nearly full: {free} bytes free, under the {min_free} a turn may need;"
        " free space on its disk, or give the server a state directory on one with room"
    )


def too_full(directory: Path) -> str | None:
    """Why the state directory ``directory`` (or, not yet there, where it would be created: its
    nearest existing parent) has too little room to serve from, or None."""
    free = free_bytes(directory)
    return nearly_full(free, MIN_FREE_BYTES) if free < MIN_FREE_BYTES else None


def nearest_existing(path: Path) -> Path:
    """``path`` made absolute, or the nearest of its parents that exists. Raises OSError when a
    parent cannot be searched, or a name is too long: the path cannot be reached."""
    absolute = path.absolute()
    for candidate in (absolute, *absolute.parents):
        try:
            os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue
        return candidate
    return Path(absolute.anchor)


def _nearest_reachable(state_dir: Path) -> Path:
    try:
        return nearest_existing(state_dir)
    except OSError as exc:
        why = unreachable(state_dir, exc)
        raise UnusableStateDir(state_dir, why, None if why == WORKING_DIRECTORY_GONE else CHOOSE_ANOTHER) from None


def make_state_dir(state_dir: Path) -> None:
    """Create the state directory and its parents unless it exists; raises UnusableStateDir
    saying why when it is not a directory or cannot be created."""
    if os.path.lexists(state_dir):
        require_directory(state_dir)
    try:
        make_dirs(state_dir)
    except OSError as exc:
        existing = _nearest_reachable(state_dir)
        if not os.path.isdir(existing):
            raise UnusableStateDir(state_dir, not_under(existing)) from exc
        raise UnusableStateDir(state_dir, cannot_create(existing, refusal(exc, "directories", existing))) from exc


def make_dirs(path: Path) -> None:
    """Make the directory ``path`` unless it is there, and each missing parent, every one with
    DIR_MODE (less what the umask takes away). Not ``mkdir -p``, whose parents get what the umask
    leaves of 0777: under a umask of 000, directories any user may write in, and so replace what
    they hold (the state directory, with every conversation). Each is owned as the directory it is
    made in is (see owned_as_directory). Raises OSError as os.mkdir does."""
    try:
        make_fresh_dir(path)
    except FileNotFoundError:
        if path.parent == path:
            raise
        make_dirs(path.parent)
        try:
            make_fresh_dir(path)
        except FileExistsError:  # made meanwhile by another process
            if not path.is_dir():
                raise
    except OSError:
        if not path.is_dir():
            raise


def require_directory(state_dir: Path) -> None:
    """Refuse a state directory that exists but is not a directory (UnusableStateDir)."""
    try:
        why = not_a_directory(state_dir)
    except OSError as exc:
        raise UnusableStateDir(state_dir, f"it cannot be reached ({exc.strerror or exc})") from exc
    if why is not None:
        raise UnusableStateDir(state_dir, why, None if why == SYMLINK else CHOOSE_ANOTHER)


def list_state_dir(state_dir: Path) -> list[str]:
    """The names in the state directory; UnusableStateDir when they cannot be read."""
    try:
        return os.listdir(state_dir)
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            require_directory(state_dir)
        why = "this user may not read it" if exc.errno in (errno.EACCES, errno.EPERM) else exc.strerror or str(exc)
        raise UnusableStateDir(state_dir, f"its entries cannot be read ({why})") from exc


def try_state_dir(state_dir: Path) -> None:
    """What serve will do, tried, leaving nothing behind: make a file in the directory or, when it
    does not exist yet, a directory in the nearest one that does, where serve would create it.
    Permissions do not tell (root passes every check, and /proc takes no new file whoever asks).
    Raises UnusableStateDir saying why not; what was made is removed at once."""
    existing = _nearest_reachable(state_dir)
    if existing == state_dir.absolute():
        require_directory(state_dir)
        try:
            fd, made = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=existing)
        except OSError as exc:
            raise UnusableStateDir(state_dir, f"no file can be made in it ({refusal(exc, 'files', existing)})") from None
        os.close(fd)
        _remove_probe(state_dir, made, os.unlink)
        return
    if not os.path.isdir(existing):
        raise UnusableStateDir(state_dir, not_under(existing))
    try:
        made = tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=existing)
    except OSError as exc:
        raise UnusableStateDir(state_dir, cannot_create(existing, refusal(exc, "directories", existing))) from None
    _remove_probe(state_dir, made, os.rmdir)


def _remove_probe(state_dir: Path, made: str, remove: Callable[[str], None]) -> None:
    try:
        remove(made)
    except FileNotFoundError:
        pass  # a reset running meanwhile removed it first
    except OSError as exc:  # an append-only directory, say: it takes entries and lets none go
        why = "the directory lets nothing be removed" if exc.errno in (errno.EACCES, errno.EPERM) else exc.strerror or str(exc)
        raise UnusableStateDir(state_dir, f"what was made to try it, {made}, cannot be removed ({why}); remove it by hand") from None


WRITE_IT = "run the server as a user who may write {it}, or make {it} writable by this one"


def require_writable(state_dir: Path, names: Sequence[str]) -> None:
    """Refuse, with UnusableStateDir, the files among ``names`` in ``state_dir`` (those that are
    there) that this user may not read and write: a server would read them, say it is ready, and
    fail every request that stores something. Their permissions tell, and for root, whom they do
    not bind, the file system (a read-only one, an immutable file)."""
    refused = [name for name in names if os.path.lexists(state_dir / name) and not os.access(state_dir / name, os.R_OK | os.W_OK)]
    if not refused:
        return
    it = "it" if len(refused) == 1 else "them"
    if os.statvfs(state_dir).f_flag & os.ST_RDONLY:
        why = "its file system is read-only"
    else:
        why = f"not even root may write {it}" if os.geteuid() == 0 else f"this user may not read and write {it}"
    raise UnusableStateDir(state_dir, f"{', '.join(refused)} in it cannot be written ({why})", WRITE_IT.format(it=it))


def holds_keel_state(state_dir: Path, names: list[str]) -> bool:
    """Whether ``names`` (what ``state_dir`` holds) are Keel's: restore residue or a database
    carrying a Keel schema identity, or Keel's lock files beside no database of another program.
    Lock files alone do not tell: serve makes them before it refuses another program's database,
    and snapshot before it copies one (a name alone does not tell either: ``tasks.db`` could be
    anyone's)."""
    if any(name.startswith(RESIDUE_PREFIX) for name in names):
        return True
    owners = [_database_owner(state_dir / name) for name in names if is_db_name(name)]
    if "keel" in owners:
        return True
    return any(name in LOCK_NAMES for name in names) and "other" not in owners


def other_programs_databases(state_dir: Path, names: list[str]) -> list[str]:
    """Which of ``names`` (what ``state_dir`` holds) are SQLite databases of another program."""
    return [name for name in names if is_db_name(name) and _database_owner(state_dir / name) == "other"]


def _database_owner(path: Path) -> str:
    """"keel" for a SQLite database carrying a Keel schema identity, "other" for one holding
    tables but no Keel identity, "unknown" for an empty or unreadable file. Read as an immutable
    file: nothing is made beside it (no -wal, no -shm), whoever's it is."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return "unknown"
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
        try:
            identity = read_identity(conn)
            tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        finally:
            conn.close()
    except (sqlite3.Error, OSError):
        return "unknown"
    if identity is not None and identity.name.startswith(KEEL_SCHEMA_PREFIX):
        return "keel"
    return "other" if tables else "unknown"


def make_fresh_dir(path: Path) -> None:
    """Create a directory that must not exist yet (a staging or quarantine directory), owned as
    the directory it is made in is (see owned_as_directory)."""
    os.mkdir(path, DIR_MODE)
    owned_as_directory(path, path.parent)
