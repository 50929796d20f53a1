"""Putting a generation back, or finishing one: the moves recovery and restore share.

Every decision is made on evidence (SHA-256 and size), never on a file's name alone, and every
check runs before the first file moves, so a refusal leaves the journal and the evidence in place.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import attrs

from persistence.journal import JOURNAL_NAME, QUARANTINE_PREFIX, STAGING_PREFIX, Journal, Rename, temp_name
from persistence.statedir import FileEvidence, RecoveryError, file_evidence, fsync_dir, live_inventory


def dir_evidence(path: Path) -> dict[str, FileEvidence]:
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


def by_name(inventory: tuple[FileEvidence, ...]) -> dict[str, FileEvidence]:
    return {evidence.filename: evidence for evidence in inventory}


@attrs.frozen
class RollbackPlan:
    remove: tuple[str, ...]  # live files that are the new generation's
    put_back: tuple[str, ...]  # quarantined files of the old generation


def plan_rollback(state_dir: Path, journal: Journal) -> RollbackPlan:
    """Verify that the old generation can be put back byte for byte; raises before anything moves."""
    old, new = by_name(journal.old_inventory), by_name(journal.new_inventory)
    quarantined = dir_evidence(state_dir / journal.quarantine_dir)
    live = by_name(live_inventory(state_dir))
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


def check_roll_forward(state_dir: Path, journal: Journal) -> None:
    """Check, changing nothing, that a committed restore can be finished: the new generation must
    be live exactly (what is left to do is ``cleanup``); raises RecoveryError."""
    if staged := dir_evidence(state_dir / journal.staging_dir):
        raise RecoveryError(
            f"Restore recovery found staged files after the commit: {', '.join(staged)}; refusing to guess."
        )
    old = by_name(journal.old_inventory)
    for name, evidence in dir_evidence(state_dir / journal.quarantine_dir).items():
        if old.get(name) != evidence:
            raise RecoveryError(f"Restore recovery cannot match quarantined evidence for {name} to the old generation.")
    assert_live(state_dir, journal.new_inventory, "committed")


def assert_live(state_dir: Path, expected: tuple[FileEvidence, ...], which: str) -> None:
    """The live generation must be exactly ``expected``: the same names, the same bytes."""
    live = by_name(live_inventory(state_dir))
    want = by_name(expected)
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
