"""Restore a snapshot over the state directory through the journal, and reset the directory.

Writers must be stopped: restore and reset take ``.keel.lock`` exclusively without waiting and
refuse while any process serves the directory. The whole snapshot is validated before anything
live is touched. Then, under the generation lock:

1. stage the new generation in ``.restore-staged.<txid>/`` (each copy fsynced and re-hashed);
2. publish the ``prepared`` journal (temp file, fsync, directory fsync, rename, directory fsync), and
   write the ``committed`` one's temp file, so that no step from here on needs room on the disk;
3. quarantine the old generation file by file, sidecars included, into ``.restore-quarantine.<txid>/``,
   fsyncing both directories after each move;
4. publish the staged databases the same way, and verify the live inventory exactly;
5. publish the ``committed`` journal (a rename); remove staging and quarantine, and the journal last.

A failure before a live file moves removes the journal, then the staging; after that and before
step 5 the journal moves to ``rolling_back`` (in the room the ``committed`` temp held) and the old
generation is put back byte for byte; after step 5 the new
generation stays and recovery finishes the clean-up. A crash anywhere is recovery's to finish.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from pathlib import Path

import attrs

from persistence.journal import JOURNAL_NAME, QUARANTINE_PREFIX, STAGING_PREFIX, Journal, Rename, new_transaction_id
from persistence.journal import publish_journal, stage_journal, temp_name
from persistence.manifest import Manifest, read_snapshot
from persistence.recovery import recover_locked
from persistence.refusals import refusal
from persistence.rollback import assert_live, cleanup, discard_unpublished, roll_back
from persistence.statedir import (
    LOCK_NAMES,
    PRIVATE_MODE,
    FileEvidence,
    NotAStateDir,
    RestoreError,
    SnapshotError,
    StateError,
    fsync_dir,
    holds_keel_state,
    list_state_dir,
    live_inventory,
    make_fresh_dir,
    make_state_dir,
    other_programs_databases,
    owned_as_directory,
    require_directory,
    write_all,
)
from persistence.statelocks import exclusive_use, generation_lock

_CHUNK_BYTES = 1 << 20


@attrs.frozen
class RestoreResult:
    transaction_id: str
    restored: tuple[str, ...]  # the databases now live
    replaced: tuple[str, ...]  # the previous generation's files, sidecars included


def restore_snapshot(snapshot_dir: Path, state_dir: Path, *, rename: Rename = os.replace) -> RestoreResult:
    """Replace the live generation with the snapshot's, all or nothing.

    Blocking; waits while another process snapshots, restores or recovers this directory.
    ``rename`` is the one seam every move goes through (crash tests replace it). Raises
    SnapshotError (nothing touched) for a snapshot that fails validation or is the state directory
    itself, UnusableStateDir for a state directory that cannot be used (saying why), StateBusy
    while a process serves the directory, RecoveryError when an earlier restore cannot be
    accounted for, and RestoreError when the restore failed and the previous generation was put back.
    """
    # Read where it is, once: a link (a ``latest`` kept beside the snapshots) or a ``..`` names the
    # snapshot it leads to, which is validated and copied whatever the link comes to name meanwhile.
    snapshot_dir = Path(os.path.realpath(snapshot_dir))
    if Path(os.path.realpath(state_dir)) == snapshot_dir:  # a server started there would write the snapshot
        raise SnapshotError(
            f"the state directory {state_dir} is the snapshot {snapshot_dir}; give --state-dir (or AGENT_STATE_DIR)"
            " the state directory to restore it into"
        )
    try:
        manifest = read_snapshot(snapshot_dir)
    except SnapshotError as exc:
        raise SnapshotError(f"{exc}; nothing in {state_dir} was changed: restore another snapshot") from exc
    make_state_dir(state_dir)
    with generation_lock(state_dir), exclusive_use(state_dir):
        recover_locked(state_dir, exclusive_held=True)
        return _Restore(snapshot_dir=snapshot_dir, state_dir=state_dir, manifest=manifest, rename=rename).run()


@attrs.define(eq=False)
class _Restore:
    snapshot_dir: Path
    state_dir: Path
    manifest: Manifest
    rename: Rename
    transaction_id: str = attrs.field(init=False, factory=new_transaction_id)
    journal: Journal | None = attrs.field(init=False, default=None)  # the durable one, once published
    moved: bool = attrs.field(init=False, default=False)  # whether a live file may have moved

    def run(self) -> RestoreResult:
        staging = self.state_dir / (STAGING_PREFIX + self.transaction_id)
        quarantine = self.state_dir / (QUARANTINE_PREFIX + self.transaction_id)
        try:
            make_fresh_dir(staging)
            make_fresh_dir(quarantine)
            fsync_dir(self.state_dir)
            new = self._stage(staging)
            old = live_inventory(self.state_dir)
            self._publish_journal(Journal(self.transaction_id, "prepared", old, new))
            # Written before anything live moves, so that committing takes no room on a disk that
            # fills meanwhile, and rolling back gets the room this file holds (stage_journal frees it).
            committed = Journal(self.transaction_id, "committed", old, new)
            commit = stage_journal(self.state_dir, committed)
            for evidence in old:
                self._move(self.state_dir / evidence.filename, quarantine / evidence.filename)
            for evidence in new:
                self._move(staging / evidence.filename, self.state_dir / evidence.filename)
            assert_live(self.state_dir, new, "new")
            self._publish_staged(commit, committed)
        except BaseException as exc:
            self._unwind()
            as_they_were = self.journal is None or self.journal.phase == "rolling_back"
            if as_they_were and isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise RestoreError(
                    f"restoring {self.snapshot_dir} failed: the state directory {self.state_dir} has no room for its"
                    f" databases ({refusal(exc, 'files', self.state_dir)}), and the live databases are as they were;"
                    " free space on its disk and restore again"
                ) from exc
            if self.journal is not None and self.journal.phase == "rolling_back" and isinstance(exc, Exception):
                raise RestoreError(
                    f"restoring {self.snapshot_dir} failed and the previous generation is live again, "
                    f"byte for byte: {exc}"
                ) from exc
            raise
        cleanup(self.state_dir, committed)
        return RestoreResult(
            transaction_id=self.transaction_id,
            restored=tuple(e.filename for e in new),
            replaced=tuple(e.filename for e in old),
        )

    def _publish_journal(self, journal: Journal) -> None:
        self._publish_staged(stage_journal(self.state_dir, journal), journal)

    def _publish_staged(self, temp: Path, journal: Journal) -> None:
        self.rename(temp, self.state_dir / JOURNAL_NAME)
        self.journal = journal  # durable from here on, whatever happens to the fsync below
        fsync_dir(self.state_dir)

    def _move(self, source: Path, target: Path) -> None:
        self.moved = True
        self.rename(source, target)
        fsync_dir(source.parent)
        fsync_dir(target.parent)

    def _unwind(self) -> None:
        """Undo what a failed restore did; a committed restore is left for recovery to finish."""
        if self.journal is not None and self.journal.phase == "prepared" and not self.moved:
            # Nothing live has moved: the journal goes, with no room needed to say so, before what
            # it explains (a crash between the two leaves the staging that recovery discards).
            (self.state_dir / temp_name(self.transaction_id)).unlink(missing_ok=True)
            (self.state_dir / JOURNAL_NAME).unlink()
            fsync_dir(self.state_dir)
            self.journal = None
        if self.journal is None:
            discard_unpublished(self.state_dir, self.transaction_id)
        elif self.journal.phase == "prepared":
            rolling_back = self.journal.with_phase("rolling_back")
            publish_journal(self.state_dir, rolling_back, rename=self.rename)
            self.journal = rolling_back
            roll_back(self.state_dir, rolling_back, rename=self.rename)

    def _stage(self, staging: Path) -> tuple[FileEvidence, ...]:
        staged = []
        for entry in self.manifest.databases:
            evidence = _copy_durably(self.snapshot_dir / entry.filename, staging / entry.filename, self.state_dir)
            if evidence != FileEvidence(entry.filename, entry.sha256, entry.size_bytes):
                raise RestoreError(
                    f"Snapshot database {entry.filename} changed while it was being staged; live state was not touched"
                )
            staged.append(evidence)
        fsync_dir(staging)
        return tuple(staged)


def _copy_durably(source: Path, target: Path, state_dir: Path) -> FileEvidence:
    """Copy a regular file to a new path, owned as ``state_dir`` is, hashing what was written, and fsync it."""
    digest = hashlib.sha256()
    size = 0
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_MODE)
        try:
            owned_as_directory(dst, state_dir)
            while chunk := os.read(src, _CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
                write_all(dst, chunk)
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return FileEvidence(filename=target.name, sha256=digest.hexdigest(), size_bytes=size)


def reset_state(state_dir: Path) -> list[str]:
    """Throw the runtime state away: every entry of the directory but its lock files, the journal last.

    Blocking on the generation lock; raises StateBusy while any process serves the directory.
    Returns the names removed. Unlike recovery it needs no journal to make sense of residue,
    because no generation survives it; the directory itself stays, with every lock file (one
    removed while another process has it open, or is about to open it, is a lock lost).

    A directory that is missing or empty is left as it is (no lock file is made in it). One that
    holds something, but nothing of Keel's, is refused with NotAStateDir and left as it is too: a
    mistyped path must not empty a directory of someone's files. Keel's are databases that carry
    a Keel schema identity, a restore's residue, and its lock files (what uses a directory as a
    state directory makes them) where no other program's database lies beside them: a serve or a
    snapshot refused on another program's directory leaves them there. A directory that holds
    Keel's and other files is emptied of all.
    """
    if not os.path.lexists(state_dir):
        return []
    require_directory(state_dir)
    present = list_state_dir(state_dir)
    if not present:
        return []
    if not holds_keel_state(state_dir, present):
        others = other_programs_databases(state_dir, present)
        raise NotAStateDir(state_dir, others, locks=any(name in LOCK_NAMES for name in present))
    with generation_lock(state_dir), exclusive_use(state_dir):
        names = [name for name in list_state_dir(state_dir) if name not in LOCK_NAMES]
        names.sort(key=lambda name: (name == JOURNAL_NAME, name))
        for done, name in enumerate(names):
            if name == JOURNAL_NAME:
                fsync_dir(state_dir)  # everything the journal explains is durably gone before it goes
            try:
                _remove(state_dir / name)
            except OSError as exc:
                raise ResetStopped(state_dir, name, names[:done], exc) from exc
        fsync_dir(state_dir)
    return names


class ResetStopped(StateError):
    """A reset that removed some of the state directory and could not remove the rest."""

    def __init__(self, state_dir: Path, name: str, removed: list[str], error: OSError) -> None:
        self.state_dir = state_dir
        stopped = f"state reset of {state_dir} stopped at {name}, which could not be removed ({error.strerror or error})"
        if not removed:
            super().__init__(f"{stopped}, before it had removed anything; fix what stopped it and run state reset again")
            return
        super().__init__(
            f"{stopped}, after it had removed {', '.join(removed)}; the rest is still there. Do not serve the directory"
            " half reset: fix what stopped it and run state reset again"
        )


def _remove(path: Path) -> None:
    """Remove a file or a directory tree; one already gone is fine (what `check` or `state recover`
    makes to try the directory removes itself at once)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
