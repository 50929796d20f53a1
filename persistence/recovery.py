"""Recovery of an interrupted restore: the first thing every process that reads or publishes state runs.

After any crash the state directory comes back on exactly one generation. A ``committed`` journal
is rolled forward; a ``prepared`` or ``rolling_back`` one is rolled back to the old generation,
verified by SHA-256 rather than by name; a journal written but never published is adopted, or
discarded when it was torn before it could say anything. Anything else (residue the journal does
not own, evidence that matches neither generation, a journal with missing or extra fields) raises
RecoveryError and leaves the journal and the evidence where they are, for the operator.
"""

from __future__ import annotations

import enum
import os
import stat
from contextlib import ExitStack
from pathlib import Path

import attrs

from persistence.journal import (
    JOURNAL_NAME,
    QUARANTINE_PREFIX,
    STAGING_PREFIX,
    TEMP_NAME,
    Journal,
    Rename,
    UnreadableJournal,
    parse_journal_file,
    publish_journal,
    temp_name,
)
from persistence.statedir import (
    DIR_MODE,
    RESIDUE_PREFIX,
    FileEvidence,
    RecoveryError,
    acquire_use,
    exclusive_use,
    file_evidence,
    fsync_dir,
    generation_lock,
    live_inventory,
    release_use,
)


class RecoveryAction(enum.Enum):
    FIRST_BOOT = "first_boot"
    CLEAN = "clean"
    ROLLED_FORWARD = "rolled_forward"
    ROLLED_BACK = "rolled_back"
    DISCARDED = "discarded"


@attrs.frozen
class RecoveryOutcome:
    action: RecoveryAction
    transaction_id: str | None = None

    def __str__(self) -> str:
        txid = self.transaction_id
        return {
            RecoveryAction.FIRST_BOOT: "no state directory yet: a clean first boot",
            RecoveryAction.CLEAN: "one complete generation is live; nothing to recover",
            RecoveryAction.ROLLED_FORWARD: f"finished restore {txid}: the restored generation is live",
            RecoveryAction.ROLLED_BACK: f"rolled back restore {txid}: the previous generation is live, byte for byte",
            RecoveryAction.DISCARDED: f"discarded restore {txid}, which never began to replace live state",
        }[self.action]


def recover(state_dir: Path) -> RecoveryOutcome:
    """Bring the state directory back to one complete generation, or refuse.

    Blocks while another process holds the generation lock (a snapshot, restore or recovery in
    progress). A missing directory is a clean first boot and is not created. Raises RecoveryError
    when the directory cannot be accounted for, and StateBusy when there is something to recover
    but a running process holds the directory.
    """
    if not os.path.lexists(state_dir):
        return RecoveryOutcome(RecoveryAction.FIRST_BOOT)
    if not state_dir.is_dir() or state_dir.is_symlink():
        raise RecoveryError(f"the state directory {state_dir} is not a directory")
    with generation_lock(state_dir):
        return recover_locked(state_dir, exclusive_held=False)


@attrs.define(eq=False)
class HeldStateDir:
    """A state directory this process serves: recovered, created, and held by a shared lock.

    While it is held, restore and reset refuse (other servers may hold it too). ``release()``
    (or leaving the ``with`` block) lets go; it is idempotent.
    """

    path: Path
    outcome: RecoveryOutcome
    _fd: int | None = attrs.field(alias="fd")

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            release_use(fd)

    def __enter__(self) -> HeldStateDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def hold_state_dir(state_dir: Path) -> HeldStateDir:
    """Startup steps 1 and 2 for a process that serves state: recover, create the directory, hold it.

    Blocking (run it in a thread from async code): it waits while a snapshot, restore or
    recovery holds the generation lock. Raises RecoveryError when the directory cannot be
    accounted for (the process must exit non-zero, never serve), and StateBusy when a restore or
    reset holds it exclusively.
    """
    outcome = recover(state_dir)
    state_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    with generation_lock(state_dir):
        # A restore may have run between recover() and this lock; check again while nothing can.
        again = recover_locked(state_dir, exclusive_held=False)
        fd = acquire_use(state_dir, exclusive=False)
    if again.action is not RecoveryAction.CLEAN:
        outcome = again
    return HeldStateDir(path=state_dir, outcome=outcome, fd=fd)


def recover_locked(state_dir: Path, *, exclusive_held: bool) -> RecoveryOutcome:
    """``recover`` for a caller that already holds the generation lock (and maybe ``.keel.lock``)."""
    residue = sorted(name for name in os.listdir(state_dir) if name.startswith(RESIDUE_PREFIX))
    if not residue:
        return RecoveryOutcome(RecoveryAction.CLEAN)
    with ExitStack() as stack:
        if not exclusive_held:
            stack.enter_context(exclusive_use(state_dir))  # never change files under a running server
        if JOURNAL_NAME not in residue:
            return _recover_unpublished(state_dir, residue)
        return _recover_journal(state_dir, parse_journal_file(state_dir / JOURNAL_NAME), residue)


def _recover_journal(state_dir: Path, journal: Journal, residue: list[str]) -> RecoveryOutcome:
    if unowned := [name for name in residue if name not in journal.owned_names]:
        raise RecoveryError(
            f"Restore journal in {state_dir} does not own this residue: {', '.join(unowned)}; "
            "recovery cannot account for it, so everything is left in place for the operator"
        )
    # An owned temp is a phase update that was made durable but never published: the durable
    # journal stays authoritative, and the temp is replaced or removed by the steps below.
    if journal.phase == "committed":
        roll_forward(state_dir, journal)
        return RecoveryOutcome(RecoveryAction.ROLLED_FORWARD, journal.transaction_id)
    plan = plan_rollback(state_dir, journal)
    if journal.phase == "prepared":
        _check_prepared_evidence(state_dir, journal)
        journal = journal.with_phase("rolling_back")
        publish_journal(state_dir, journal, rename=os.replace)
    execute_rollback(state_dir, journal, plan, rename=os.replace)
    return RecoveryOutcome(RecoveryAction.ROLLED_BACK, journal.transaction_id)


def _recover_unpublished(state_dir: Path, residue: list[str]) -> RecoveryOutcome:
    """Residue without a durable journal: only a restore that died before publishing its first
    journal leaves that, and it had not yet moved anything live. A complete initial journal with
    complete staging is adopted (then rolled back like any prepared one); a torn one, or one whose
    staging was already being removed, is discarded."""
    temps = [match for name in residue if (match := TEMP_NAME.fullmatch(name))]
    if len(temps) != 1:
        raise RecoveryError(
            f"Restore residue exists in {state_dir} without a durable journal: {', '.join(residue)}; "
            "recovery cannot tell which generation is real, so it is left in place for the operator"
        )
    txid = temps[0].group(1)
    expected = {temp_name(txid), STAGING_PREFIX + txid, QUARANTINE_PREFIX + txid}
    if not set(residue) <= expected:
        raise RecoveryError(
            f"The unpublished restore journal in {state_dir} does not own its exact residue: "
            f"expected {sorted(expected)}, found {residue}"
        )
    if _dir_evidence(state_dir / (QUARANTINE_PREFIX + txid)):
        raise RecoveryError(
            f"Restore residue in {state_dir} shows the old generation being moved aside, but no journal "
            "was ever published; recovery refuses to guess"
        )
    temp = state_dir / temp_name(txid)
    try:
        journal = parse_journal_file(temp)
    except UnreadableJournal:
        discard_unpublished(state_dir, txid)  # torn while being written: nothing live was touched
        return RecoveryOutcome(RecoveryAction.DISCARDED, txid)
    if journal.transaction_id != txid or journal.phase != "prepared":
        raise RecoveryError(
            f"An unpublished restore journal must record the prepared phase of its own transaction: {temp}"
        )
    if set(live_inventory(state_dir)) != set(journal.old_inventory):
        raise RecoveryError(
            f"Live state in {state_dir} differs from the old generation recorded in {temp}; recovery refuses to guess"
        )
    staged = _dir_evidence(state_dir / journal.staging_dir)
    if staged != _by_name(journal.new_inventory) or not (state_dir / journal.quarantine_dir).is_dir():
        # Its staging was already being taken apart (a failed restore unwinding); live state is
        # verified to be the old generation, so there is nothing to roll back.
        discard_unpublished(state_dir, txid)
        return RecoveryOutcome(RecoveryAction.DISCARDED, txid)
    os.replace(temp, state_dir / JOURNAL_NAME)  # adopt it, so a crash from here on is an ordinary rollback
    fsync_dir(state_dir)
    return _recover_journal(state_dir, journal, sorted(set(residue) - {temp.name} | {JOURNAL_NAME}))


def _dir_evidence(path: Path) -> dict[str, FileEvidence]:
    """The evidence of every file in a staging or quarantine directory; absent means empty."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return {}
    if not stat.S_ISDIR(info.st_mode):
        raise RecoveryError(f"Restore residue {path} must be a directory; recovery refuses to guess")
    try:
        return {name: file_evidence(path / name) for name in sorted(os.listdir(path))}
    except (OSError, ValueError) as exc:
        raise RecoveryError(
            f"Restore recovery cannot verify the evidence in {path} ({exc}); refusing to guess"
        ) from exc


def _by_name(inventory: tuple[FileEvidence, ...]) -> dict[str, FileEvidence]:
    return {evidence.filename: evidence for evidence in inventory}


def _check_prepared_evidence(state_dir: Path, journal: Journal) -> None:
    """A prepared journal promises a complete staging and a quarantine directory; check both."""
    for name in (journal.staging_dir, journal.quarantine_dir):
        if not (state_dir / name).is_dir():
            raise RecoveryError(
                f"Restore recovery is missing {name}, which the prepared journal records; refusing to guess."
            )
    new = _by_name(journal.new_inventory)
    staged = _dir_evidence(state_dir / journal.staging_dir)
    for name, evidence in staged.items():
        if new.get(name) != evidence:
            raise RecoveryError(f"Restore recovery cannot match staged evidence for {name} to the new generation.")
    live = _by_name(live_inventory(state_dir))
    for name, evidence in new.items():
        if staged.get(name) != evidence and live.get(name) != evidence:
            raise RecoveryError(f"Restore recovery is missing prepared new evidence for {name}.")


@attrs.frozen
class RollbackPlan:
    remove: tuple[str, ...]  # live files that are the new generation's
    put_back: tuple[str, ...]  # quarantined files of the old generation


def plan_rollback(state_dir: Path, journal: Journal) -> RollbackPlan:
    """Verify that the old generation can be put back byte for byte; raises before anything moves."""
    old, new = _by_name(journal.old_inventory), _by_name(journal.new_inventory)
    quarantined = _dir_evidence(state_dir / journal.quarantine_dir)
    live = _by_name(live_inventory(state_dir))
    remove = []
    for name, evidence in live.items():
        if old.get(name) == evidence and name not in quarantined:
            continue  # never moved aside
        if new.get(name) != evidence:
            raise RecoveryError(
                f"Restore recovery found live state outside both recorded generations: {name}; refusing to remove it."
            )
        remove.append(name)
    for name, evidence in quarantined.items():
        if old.get(name) != evidence:
            raise RecoveryError(f"Restore recovery cannot match quarantined evidence for {name} to the old generation.")
    for name, evidence in old.items():
        if name not in quarantined and live.get(name) != evidence:
            raise RecoveryError(f"Restore recovery is missing byte-identical old evidence for {name}.")
    return RollbackPlan(remove=tuple(remove), put_back=tuple(quarantined))


def execute_rollback(state_dir: Path, journal: Journal, plan: RollbackPlan, *, rename: Rename) -> None:
    """Remove the new files, move the old ones back (fsyncing both directories each time), verify, clean up."""
    for name in plan.remove:
        (state_dir / name).unlink()
        fsync_dir(state_dir)
    quarantine = state_dir / journal.quarantine_dir
    for name in plan.put_back:
        rename(quarantine / name, state_dir / name)
        fsync_dir(quarantine)
        fsync_dir(state_dir)
    assert_live(state_dir, journal.old_inventory, "old")
    cleanup(state_dir, journal)


def roll_back(state_dir: Path, journal: Journal, *, rename: Rename) -> None:
    execute_rollback(state_dir, journal, plan_rollback(state_dir, journal), rename=rename)


def roll_forward(state_dir: Path, journal: Journal) -> None:
    """Finish a committed restore: the new generation must be live exactly; then clean up."""
    if staged := _dir_evidence(state_dir / journal.staging_dir):
        raise RecoveryError(
            f"Restore recovery found staged files after the commit: {', '.join(staged)}; refusing to guess."
        )
    old = _by_name(journal.old_inventory)
    for name, evidence in _dir_evidence(state_dir / journal.quarantine_dir).items():
        if old.get(name) != evidence:
            raise RecoveryError(f"Restore recovery cannot match quarantined evidence for {name} to the old generation.")
    assert_live(state_dir, journal.new_inventory, "committed")
    cleanup(state_dir, journal)


def assert_live(state_dir: Path, expected: tuple[FileEvidence, ...], which: str) -> None:
    """The live generation must be exactly ``expected``: the same names, the same bytes."""
    live = _by_name(live_inventory(state_dir))
    want = _by_name(expected)
    problems = [f"missing {name}" for name in sorted(want.keys() - live.keys())]
    problems += [f"unexpected {name}" for name in sorted(live.keys() - want.keys())]
    problems += [f"changed {name}" for name in sorted(want.keys() & live.keys()) if want[name] != live[name]]
    if problems:
        raise RecoveryError(f"Restore {which} generation inventory mismatch in {state_dir}: {', '.join(problems)}")


def _remove_dir(path: Path) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        for name in os.listdir(path):
            (path / name).unlink()
        path.rmdir()
    else:
        path.unlink()


def discard_unpublished(state_dir: Path, transaction_id: str) -> None:
    """Remove a transaction that never published a journal; its temp goes last."""
    _remove_dir(state_dir / (STAGING_PREFIX + transaction_id))
    _remove_dir(state_dir / (QUARANTINE_PREFIX + transaction_id))
    fsync_dir(state_dir)
    (state_dir / temp_name(transaction_id)).unlink(missing_ok=True)
    fsync_dir(state_dir)


def cleanup(state_dir: Path, journal: Journal) -> None:
    """Remove staging, quarantine and any temp, then (durably) the journal, last."""
    _remove_dir(state_dir / journal.staging_dir)
    _remove_dir(state_dir / journal.quarantine_dir)
    (state_dir / temp_name(journal.transaction_id)).unlink(missing_ok=True)
    fsync_dir(state_dir)
    (state_dir / JOURNAL_NAME).unlink(missing_ok=True)
    fsync_dir(state_dir)
