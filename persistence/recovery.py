"""Recovery of an interrupted restore: the first thing every process that reads or publishes state runs.

After any crash the state directory comes back on exactly one generation. A ``committed`` journal
is rolled forward; a ``prepared`` or ``rolling_back`` one is rolled back to the old generation,
verified by SHA-256 rather than by name; a journal written but never published is adopted, or
discarded when it was torn before it could say anything, as is a restore killed while staging,
before it wrote a journal at all (nothing live was moved yet). Anything else (residue the journal does
not own, evidence that matches neither generation, a journal with missing or extra fields) raises
RecoveryError and leaves the journal and the evidence where they are, for the operator.

Recovery reads the directory's entries and, when a restore left residue, the journal and the
hashes of the files it names. It never opens a database: a database damaged some other way (a
file that is not SQLite, say) is not its to find, and a directory with no database at all has
nothing to recover.
"""

from __future__ import annotations

import enum
import os
from contextlib import ExitStack
from pathlib import Path

import attrs

from persistence.journal import (
    JOURNAL_NAME,
    QUARANTINE_PREFIX,
    STAGING_PREFIX,
    TEMP_NAME,
    TRANSACTION_ID,
    Journal,
    NewerJournal,
    UnreadableJournal,
    parse_journal_file,
    publish_journal,
    temp_name,
)
from persistence.rollback import (
    RollbackPlan,
    by_name,
    check_roll_forward,
    cleanup,
    dir_evidence,
    discard_unpublished,
    execute_rollback,
    plan_rollback,
)
from persistence.statedir import (
    RESIDUE_PREFIX,
    RecoveryError,
    fsync_dir,
    list_state_dir,
    live_inventory,
    make_state_dir,
    require_directory,
    try_state_dir,
)
from persistence.statelocks import acquire_use, exclusive_use, generation_lock, release_use


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
            RecoveryAction.FIRST_BOOT: "no state directory yet: nothing to recover",
            RecoveryAction.CLEAN: "nothing to recover: no restore was interrupted",
            RecoveryAction.ROLLED_FORWARD: f"finished restore {txid}: the databases it restored are live",
            RecoveryAction.ROLLED_BACK: f"rolled back restore {txid}: the databases from before it are live again, byte for byte",
            RecoveryAction.DISCARDED: f"discarded restore {txid}, which had not begun to replace the live databases",
        }[self.action]


def recover(state_dir: Path) -> RecoveryOutcome:
    """Bring the state directory back to one complete generation, or refuse.

    A missing directory is a clean first boot and is not created. A directory with no restore
    residue has nothing to recover, and is left as it is (no lock file is made in it): a restore
    makes its residue before it touches a live file and removes its journal last, so none is
    unfinished there, whatever runs now. Otherwise blocks while another process holds the
    generation lock (a snapshot, restore or recovery in progress). Raises UnusableStateDir for a
    path that is not a directory or whose entries cannot be read, RecoveryError when the
    directory cannot be accounted for, and StateBusy when there is something to recover but a
    running process holds the directory.
    """
    if not os.path.lexists(state_dir):
        return RecoveryOutcome(RecoveryAction.FIRST_BOOT)
    require_directory(state_dir)
    if not _residue(state_dir):
        return RecoveryOutcome(RecoveryAction.CLEAN)
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
    accounted for (the process must exit non-zero, never serve), UnusableStateDir when it cannot
    be used (not a directory, or one that cannot be created or where no file can be made), and
    StateBusy when a restore or reset holds it exclusively.
    """
    outcome = recover(state_dir)
    make_state_dir(state_dir)
    # One made read-only since a server last used it holds its lock files and databases: only
    # trying tells that SQLite could make no journal beside them, as check tries.
    try_state_dir(state_dir)
    with generation_lock(state_dir):
        # A restore may have run between recover() and this lock; check again while nothing can.
        again = recover_locked(state_dir, exclusive_held=False)
        fd = acquire_use(state_dir, exclusive=False)
    if again.action is not RecoveryAction.CLEAN:
        outcome = again
    return HeldStateDir(path=state_dir, outcome=outcome, fd=fd)


def recover_locked(state_dir: Path, *, exclusive_held: bool) -> RecoveryOutcome:
    """``recover`` for a caller that already holds the generation lock (and maybe ``.keel.lock``)."""
    residue = _residue(state_dir)
    if not residue:
        return RecoveryOutcome(RecoveryAction.CLEAN)
    with ExitStack() as stack:
        if not exclusive_held:
            stack.enter_context(exclusive_use(state_dir))  # never change files under a running server
        try:
            if JOURNAL_NAME not in residue:
                return _recover_unpublished(state_dir, residue)
            return _recover_journal(state_dir, parse_journal_file(state_dir / JOURNAL_NAME), residue)
        except RecoveryError as exc:
            raise _with_ways_out(exc, state_dir) from exc


def _with_ways_out(exc: RecoveryError, state_dir: Path) -> RecoveryError:
    said = str(exc)
    # A newer build finishes what it began: emptying the directory would lose what it can keep.
    if isinstance(exc, NewerJournal):
        return RecoveryError(f"{said} Recovery left {state_dir} as it was.")
    return type(exc)(f"{said}{' ' if said.endswith('.') else '. '}{ways_out(state_dir)}")


def ways_out(state_dir: Path) -> str:
    """What an operator can do with a state directory that recovery cannot account for."""
    return (
        f"Recovery left {state_dir} as it was. To serve from it again, empty it (python -m runtime state reset)"
        " and then, to bring back what a snapshot holds, python -m runtime state restore SNAPSHOT"
    )


def check_recoverable(state_dir: Path) -> None:
    """Raise RecoveryError, as ``recover`` would, when it could not account for the state directory
    (``state_dir``); change nothing. Blocking: waits while a snapshot, restore or recovery holds
    the generation lock, which it takes only where a restore left residue."""
    if not os.path.lexists(state_dir) or not _residue(state_dir):
        return
    with generation_lock(state_dir, reading=True):
        residue = _residue(state_dir)
        try:
            if JOURNAL_NAME in residue:
                _plan_journal(state_dir, parse_journal_file(state_dir / JOURNAL_NAME), residue)
            elif (journal := _read_unpublished(state_dir, residue)[1]) is not None:
                _plan_journal(state_dir, journal, _adopted(residue, journal))
        except RecoveryError as exc:
            raise _with_ways_out(exc, state_dir) from exc


def _recover_journal(state_dir: Path, journal: Journal, residue: list[str]) -> RecoveryOutcome:
    plan = _plan_journal(state_dir, journal, residue)
    if plan is None:
        cleanup(state_dir, journal)
        return RecoveryOutcome(RecoveryAction.ROLLED_FORWARD, journal.transaction_id)
    if journal.phase == "prepared":
        journal = journal.with_phase("rolling_back")
        publish_journal(state_dir, journal, rename=os.replace)
    execute_rollback(state_dir, journal, plan, rename=os.replace)
    return RecoveryOutcome(RecoveryAction.ROLLED_BACK, journal.transaction_id)


def _plan_journal(state_dir: Path, journal: Journal, residue: list[str]) -> RollbackPlan | None:
    """Check, changing nothing, that ``journal`` accounts for the directory: the rollback to do,
    or None when its (committed) restore is to be finished. Raises RecoveryError."""
    if unowned := [name for name in residue if name not in journal.owned_names]:
        raise RecoveryError(
            f"Restore journal in {state_dir} does not own this residue: {', '.join(unowned)}; "
            "recovery cannot account for it, so everything is left in place for the operator"
        )
    # An owned temp is a phase update that was made durable but never published: the durable
    # journal stays authoritative, and the temp is replaced or removed by the steps that follow.
    if journal.phase == "committed":
        check_roll_forward(state_dir, journal)
        return None
    plan = plan_rollback(state_dir, journal)
    if journal.phase == "prepared":
        _check_prepared_evidence(state_dir, journal)
    return plan


def _residue(state_dir: Path) -> list[str]:
    """What a restore leaves in the directory while it works, sorted."""
    return sorted(name for name in list_state_dir(state_dir) if name.startswith(RESIDUE_PREFIX))


def _staged_only(residue: list[str]) -> str | None:
    """The transaction whose staging and quarantine directories are all of ``residue``, if the
    residue is just that: a restore's before it wrote its journal."""
    transactions = set()
    for name in residue:
        prefix = next((p for p in (STAGING_PREFIX, QUARANTINE_PREFIX) if name.startswith(p)), None)
        if prefix is None or not TRANSACTION_ID.fullmatch(name.removeprefix(prefix)):
            return None
        transactions.add(name.removeprefix(prefix))
    return transactions.pop() if len(transactions) == 1 else None


def _recover_unpublished(state_dir: Path, residue: list[str]) -> RecoveryOutcome:
    """Residue without a durable journal: only a restore that died before publishing its first
    journal leaves that, and it had not yet moved anything live. A complete initial journal with
    complete staging is adopted (then rolled back like any prepared one); a torn one, or one whose
    staging was already being removed, is discarded; so is the staging of a restore that died
    before it wrote any journal, its quarantine still empty."""
    txid, journal = _read_unpublished(state_dir, residue)
    if journal is None:
        discard_unpublished(state_dir, txid)
        return RecoveryOutcome(RecoveryAction.DISCARDED, txid)
    os.replace(state_dir / temp_name(txid), state_dir / JOURNAL_NAME)  # adopted: a crash from here on is an ordinary rollback
    fsync_dir(state_dir)
    return _recover_journal(state_dir, journal, _adopted(residue, journal))


def _adopted(residue: list[str], journal: Journal) -> list[str]:
    return sorted(set(residue) - {temp_name(journal.transaction_id)} | {JOURNAL_NAME})


def _read_unpublished(state_dir: Path, residue: list[str]) -> tuple[str, Journal | None]:
    """What ``_recover_unpublished`` is to do, found changing nothing: the transaction, and its
    journal to adopt, or None when it is to be discarded. Raises RecoveryError."""
    temps = [match for name in residue if (match := TEMP_NAME.fullmatch(name))]
    only_staged = _staged_only(residue)
    if not temps and only_staged is not None and not dir_evidence(state_dir / (QUARANTINE_PREFIX + only_staged)):
        # Killed while it copied the snapshot in (the longest step of a restore), or while a
        # restore that failed then was removing that copy: what its own unwinding does, done now.
        return only_staged, None
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
    if dir_evidence(state_dir / (QUARANTINE_PREFIX + txid)):
        raise RecoveryError(
            f"Restore residue in {state_dir} shows the old generation being moved aside, but no journal "
            "was ever published; recovery refuses to guess"
        )
    temp = state_dir / temp_name(txid)
    try:
        journal = parse_journal_file(temp)
    except UnreadableJournal:
        return txid, None  # torn while being written: nothing live was touched
    if journal.transaction_id != txid or journal.phase != "prepared":
        raise RecoveryError(
            f"An unpublished restore journal must record the prepared phase of its own transaction: {temp}"
        )
    if set(live_inventory(state_dir)) != set(journal.old_inventory):
        raise RecoveryError(
            f"Live state in {state_dir} differs from the old generation recorded in {temp}; recovery refuses to guess"
        )
    staged = dir_evidence(state_dir / journal.staging_dir)
    if staged != by_name(journal.new_inventory) or not (state_dir / journal.quarantine_dir).is_dir():
        # Its staging was already being taken apart (a failed restore unwinding); live state is
        # verified to be the old generation, so there is nothing to roll back.
        return txid, None
    return txid, journal


def _check_prepared_evidence(state_dir: Path, journal: Journal) -> None:
    """A prepared journal promises a complete staging and a quarantine directory; check both."""
    for name in (journal.staging_dir, journal.quarantine_dir):
        if not (state_dir / name).is_dir():
            raise RecoveryError(
                f"Restore recovery is missing {name}, which the prepared journal records; refusing to guess."
            )
    new = by_name(journal.new_inventory)
    staged = dir_evidence(state_dir / journal.staging_dir)
    for name, evidence in staged.items():
        if new.get(name) != evidence:
            raise RecoveryError(f"Restore recovery cannot match staged evidence for {name} to the new generation.")
    live = by_name(live_inventory(state_dir))
    for name, evidence in new.items():
        if staged.get(name) != evidence and live.get(name) != evidence:
            raise RecoveryError(f"Restore recovery is missing prepared new evidence for {name}.")
