"""Recovery: crashes at real seams in a child process, then what the parent finds live, byte for byte."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import attrs
import pytest

from persistence.journal import INCOMPLETE, JOURNAL_NAME, parse_journal_file, publish_journal
from persistence.recovery import RecoveryAction, hold_state_dir, recover
from persistence.statedir import (
    AlreadyServed,
    RecoveryError,
    StateBusy,
    StateError,
    UnusableStateDir,
    encode_document,
)
from persistence.statelocks import acquire_serving, exclusive_use, release_use
from tests.persistence.state_helpers import (
    SESSIONS,
    fill,
    fingerprint,
    labels,
    live_databases,
    make_db,
    new_snapshot,
    old_generation,
    quarantine_dir,
    residue,
    run_child,
    small_disk,
    snapshot_databases,
)


@attrs.frozen
class Scene:
    state_dir: Path
    snapshot: Path
    before: dict[str, bytes]


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    state_dir = tmp_path / "state"
    old_generation(state_dir)
    return Scene(state_dir=state_dir, snapshot=new_snapshot(tmp_path), before=fingerprint(state_dir))


def crash(scene: Scene, scenario: str, code: int) -> None:
    child = run_child(scenario, scene.snapshot, scene.state_dir)
    assert child.returncode == code, child.stderr
    assert residue(scene.state_dir), "the child died before leaving anything for recovery"


def assert_old_generation_back(scene: Scene) -> None:
    assert fingerprint(scene.state_dir) == scene.before
    assert labels(scene.state_dir / "tasks.db") == ["old-0", "old-1", "old-2"]


# -- crashes at the rename seam ---------------------------------------------------------------


def test_crash_after_first_quarantine_recovers_byte_identical_old_generation_with_sidecars(scene: Scene) -> None:
    crash(scene, "after-quarantine", 71)
    assert len(os.listdir(quarantine_dir(scene.state_dir))) == 1  # exactly one file moved aside

    outcome = recover(scene.state_dir)

    assert outcome.action is RecoveryAction.ROLLED_BACK
    assert_old_generation_back(scene)
    assert {"runtime.db-wal", "runtime.db-shm", "incidents.db-journal"} <= scene.before.keys()


def test_a_restore_killed_midway_on_a_disk_that_then_filled_is_rolled_back_all_the_same(tmp_path: Path) -> None:
    # Rolling back publishes a journal saying so: on a full disk there was no room for it, and
    # every process that started on the directory failed on it until space was freed.
    snapshot = new_snapshot(tmp_path)
    with small_disk(tmp_path / "small", "2m") as small:
        state_dir = small / "state"
        live_databases(state_dir)
        before = fingerprint(state_dir)
        killed = run_child("after-quarantine", snapshot, state_dir)
        assert killed.returncode == 71, killed.stderr
        fill(small)

        outcome = recover(state_dir)
        after = fingerprint(state_dir)

    assert outcome.action is RecoveryAction.ROLLED_BACK
    assert after == before


def test_crash_after_committed_is_published_keeps_new_generation(scene: Scene) -> None:
    crash(scene, "after-committed", 72)
    assert json.loads((scene.state_dir / JOURNAL_NAME).read_text())["phase"] == "committed"

    outcome = recover(scene.state_dir)

    assert outcome.action is RecoveryAction.ROLLED_FORWARD
    assert fingerprint(scene.state_dir) == snapshot_databases(scene.snapshot)
    assert labels(scene.state_dir / "runtime.db") == [f"new-{i}" for i in range(5)]


def test_crash_just_before_committed_is_published_recovers_old_generation(scene: Scene) -> None:
    crash(scene, "before-committed", 74)
    live = fingerprint(scene.state_dir)
    assert {name: live[name] for name in snapshot_databases(scene.snapshot)} == snapshot_databases(scene.snapshot)

    assert recover(scene.state_dir).action is RecoveryAction.ROLLED_BACK
    assert_old_generation_back(scene)


def test_crash_just_before_rolling_back_is_published_recovers_old_generation(scene: Scene) -> None:
    crash(scene, "before-rolling-back", 75)
    assert json.loads((scene.state_dir / JOURNAL_NAME).read_text())["phase"] == "prepared"

    assert recover(scene.state_dir).action is RecoveryAction.ROLLED_BACK
    assert_old_generation_back(scene)


def test_crash_before_first_journal_rename_adopts_the_journal_and_keeps_old_generation(scene: Scene) -> None:
    crash(scene, "before-first-journal", 76)
    assert not (scene.state_dir / JOURNAL_NAME).exists()

    assert recover(scene.state_dir).action is RecoveryAction.ROLLED_BACK
    assert_old_generation_back(scene)


def test_crash_while_staging_before_any_journal_is_discarded_and_old_generation_kept(scene: Scene) -> None:
    crash(scene, "while-staging", 77)
    assert not [name for name in residue(scene.state_dir) if name.endswith(".tmp")]  # no journal yet

    assert recover(scene.state_dir).action is RecoveryAction.DISCARDED
    assert residue(scene.state_dir) == []
    assert_old_generation_back(scene)


def test_torn_unpublished_journal_is_discarded_and_old_generation_kept(scene: Scene) -> None:
    crash(scene, "before-first-journal", 76)
    (temp,) = (scene.state_dir / name for name in residue(scene.state_dir) if name.endswith(".tmp"))
    temp.write_bytes(temp.read_bytes()[:40])  # what a crash in the middle of writing it leaves

    assert recover(scene.state_dir).action is RecoveryAction.DISCARDED
    assert_old_generation_back(scene)


def test_unpublished_journal_whose_staging_was_being_removed_is_discarded(scene: Scene) -> None:
    crash(scene, "before-first-journal", 76)
    staging = scene.state_dir / next(name for name in residue(scene.state_dir) if name.startswith(".restore-staged."))
    (staging / "memory.db").unlink()  # a failed restore unwinding its staging, then killed

    assert recover(scene.state_dir).action is RecoveryAction.DISCARDED
    assert_old_generation_back(scene)


def test_unpublished_journal_is_refused_when_live_state_is_not_its_old_generation(scene: Scene) -> None:
    crash(scene, "before-first-journal", 76)
    (scene.state_dir / "obsolete.db").unlink()
    left = fingerprint(scene.state_dir)

    with pytest.raises(RecoveryError, match="differs from the old generation recorded in"):
        recover(scene.state_dir)
    assert fingerprint(scene.state_dir) == left


def test_recovery_fails_closed_when_a_quarantined_file_was_deleted_by_hand(scene: Scene) -> None:
    crash(scene, "after-quarantine", 71)
    quarantine = quarantine_dir(scene.state_dir)
    (quarantine / "incidents.db").unlink()
    left = fingerprint(scene.state_dir)

    with pytest.raises(RecoveryError, match=r"missing byte-identical old evidence for incidents\.db"):
        recover(scene.state_dir)

    assert fingerprint(scene.state_dir) == left  # journal and evidence stay for the operator
    assert (scene.state_dir / JOURNAL_NAME).exists()


def test_recovery_fails_closed_on_live_evidence_matching_neither_generation(scene: Scene) -> None:
    crash(scene, "before-committed", 74)
    make_db(scene.state_dir / "stranger.db", None, "stranger")
    left = fingerprint(scene.state_dir)

    with pytest.raises(RecoveryError, match=r"outside both recorded generations: stranger\.db"):
        recover(scene.state_dir)

    assert fingerprint(scene.state_dir) == left


def test_rollback_resumes_after_some_old_files_were_already_put_back(scene: Scene) -> None:
    crash(scene, "before-committed", 74)
    prepared = parse_journal_file(scene.state_dir / JOURNAL_NAME)
    publish_journal(scene.state_dir, prepared.with_phase("rolling_back"), rename=os.replace)  # a rollback's first step
    quarantine = quarantine_dir(scene.state_dir)
    (scene.state_dir / "tasks.db").unlink()  # what a rollback that died midway leaves:
    os.replace(quarantine / "tasks.db", scene.state_dir / "tasks.db")  # one new file gone, one old one back

    assert recover(scene.state_dir).action is RecoveryAction.ROLLED_BACK
    assert_old_generation_back(scene)


# -- the journal and residue, planted by hand -------------------------------------------------


def test_recover_treats_a_missing_state_dir_as_first_boot_and_creates_nothing(tmp_path: Path) -> None:
    assert recover(tmp_path / "state").action is RecoveryAction.FIRST_BOOT
    assert not (tmp_path / "state").exists()


def test_recover_refuses_a_state_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("not a directory")
    with pytest.raises(UnusableStateDir) as caught:
        recover(tmp_path / "state")
    assert str(caught.value) == f"the state directory {tmp_path / 'state'} cannot be used: it is a file, not a directory; choose one this user can create, or make files in"


def test_recover_leaves_a_clean_state_dir_as_it_is(tmp_path: Path) -> None:
    make_db(tmp_path / "runtime.db", SESSIONS, "only")
    before = fingerprint(tmp_path)
    assert recover(tmp_path).action is RecoveryAction.CLEAN
    assert fingerprint(tmp_path) == before


def test_recover_refuses_planted_incomplete_journal_and_keeps_it_until_removed(tmp_path: Path) -> None:
    journal = tmp_path / JOURNAL_NAME
    journal.write_text('{"phase":"prepared"}')

    with pytest.raises(RecoveryError) as caught:
        recover(tmp_path)

    assert str(caught.value).startswith(f"{INCOMPLETE} Missing: format_version, new_inventory, old_inventory,")
    assert f"staging_dir, transaction_id. Recovery left {tmp_path} as it was." in str(caught.value)
    assert journal.read_text() == '{"phase":"prepared"}'
    journal.unlink()
    assert recover(tmp_path).action is RecoveryAction.CLEAN


def valid_journal() -> dict[str, object]:
    txid = "0123456789abcdef0123456789abcdef"
    entry = {"filename": "runtime.db", "sha256": "a" * 64, "size_bytes": 8192}
    return {
        "format_version": 1,
        "transaction_id": txid,
        "phase": "prepared",
        "staging_dir": f".restore-staged.{txid}",
        "quarantine_dir": f".restore-quarantine.{txid}",
        "old_inventory": [dict(entry, filename="runtime.db-wal")],
        "new_inventory": [entry],
    }


def edited(**changes: object) -> dict[str, object]:
    return {**valid_journal(), **changes}


def without(field: str) -> dict[str, object]:
    return {key: value for key, value in valid_journal().items() if key != field}


def entry_with(**changes: object) -> list[dict[str, object]]:
    return [{"filename": "x.db", "sha256": "a" * 64, "size_bytes": 8192, **changes}]


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (without("old_inventory"), f"{INCOMPLETE} Missing: old_inventory."),
        (edited(published=True), f"{INCOMPLETE} Unknown: published."),
        (edited(format_version=2), "Restore journal format 2 was written by a newer Keel build; this build supports format 1."),
        (edited(format_version=0), "Unsupported restore journal format 0; this build supports format 1."),
        (edited(format_version=1.0), "Unsupported restore journal format 1.0"),
        (edited(transaction_id="not-hex"), "Restore journal has an invalid transaction id."),
        (edited(phase="half-done"), "Restore journal has an invalid phase: 'half-done'"),
        (edited(phase=["prepared"]), "Restore journal has an invalid phase: ['prepared']"),
        (edited(staging_dir="../elsewhere"), "Restore journal has an invalid staging directory."),
        (edited(quarantine_dir=".restore-quarantine.x"), "Restore journal has an invalid quarantine directory."),
        (edited(new_inventory=[]), "Restore journal has an invalid new inventory."),
        (edited(new_inventory=[{"filename": "runtime.db"}]), "Restore journal has incomplete new file evidence."),
        (edited(new_inventory=entry_with(filename="../x.db")), "Restore journal has an unsafe new filename: '../x.db'"),
        (edited(new_inventory=entry_with(filename="x.db-wal")), "Restore journal has an unsafe new filename: 'x.db-wal'"),
        (edited(new_inventory=entry_with() * 2), "Restore journal repeats the new filename: x.db"),
        (edited(new_inventory=entry_with(sha256="A" * 64)), "Restore journal has an invalid new SHA-256 for x.db."),
        (edited(new_inventory=entry_with(size_bytes=-1)), "Restore journal has an invalid new size for x.db."),
        (edited(new_inventory=entry_with(size_bytes=True)), "Restore journal has an invalid new size for x.db."),
    ],
)
def test_recover_refuses_an_invalid_journal_and_leaves_it_in_place(
    tmp_path: Path, document: dict[str, object], message: str
) -> None:
    journal = tmp_path / JOURNAL_NAME
    journal.write_bytes(encode_document(document))

    with pytest.raises(RecoveryError) as caught:
        recover(tmp_path)

    assert str(caught.value).startswith(message)
    assert journal.read_bytes() == encode_document(document)


def test_recover_refuses_a_torn_durable_journal(tmp_path: Path) -> None:
    (tmp_path / JOURNAL_NAME).write_bytes(encode_document(valid_journal())[:30])
    with pytest.raises(RecoveryError, match="is not a JSON document"):
        recover(tmp_path)
    assert (tmp_path / JOURNAL_NAME).exists()


def test_recover_refuses_a_journal_nested_deeper_than_can_be_read(tmp_path: Path) -> None:
    (tmp_path / JOURNAL_NAME).write_bytes(b"[" * 100_000)
    with pytest.raises(RecoveryError, match="is not a JSON document"):
        recover(tmp_path)
    assert (tmp_path / JOURNAL_NAME).exists()


def test_recover_refuses_a_journal_that_is_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "elsewhere.json").write_bytes(encode_document(valid_journal()))
    (tmp_path / JOURNAL_NAME).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(RecoveryError, match="Restore journal must be a regular file"):
        recover(tmp_path)


def test_recover_refuses_residue_the_journal_does_not_own(tmp_path: Path) -> None:
    (tmp_path / JOURNAL_NAME).write_bytes(encode_document(valid_journal()))
    (tmp_path / ".restore-staged.ffffffffffffffffffffffffffffffff").mkdir()
    with pytest.raises(RecoveryError, match=r"does not own this residue: \.restore-staged\.f{32}"):
        recover(tmp_path)
    assert (tmp_path / JOURNAL_NAME).exists()


def test_recover_refuses_residue_without_a_journal(tmp_path: Path) -> None:
    # A quarantine that holds a file, and no journal: something live was moved aside unrecorded.
    quarantine = tmp_path / ".restore-quarantine.0123456789abcdef0123456789abcdef"
    quarantine.mkdir()
    (quarantine / "tasks.db").write_bytes(b"moved aside")
    with pytest.raises(RecoveryError, match="without a durable journal"):
        recover(tmp_path)
    assert residue(tmp_path) == [".restore-quarantine.0123456789abcdef0123456789abcdef"]


def test_recover_refuses_the_staging_of_two_restores_without_a_journal(tmp_path: Path) -> None:
    for txid in ("0" * 32, "1" * 32):
        (tmp_path / f".restore-staged.{txid}").mkdir()
    with pytest.raises(RecoveryError, match="without a durable journal"):
        recover(tmp_path)
    assert len(residue(tmp_path)) == 2


def test_recover_refuses_an_unpublished_journal_whose_quarantine_is_not_empty(scene: Scene) -> None:
    crash(scene, "before-first-journal", 76)
    quarantine = quarantine_dir(scene.state_dir)
    os.replace(scene.state_dir / "tasks.db", quarantine / "tasks.db")

    with pytest.raises(RecoveryError, match="no journal was ever published"):
        recover(scene.state_dir)
    assert (quarantine / "tasks.db").exists()


def test_recover_with_residue_refuses_while_a_process_serves_the_state_dir(scene: Scene) -> None:
    crash(scene, "after-quarantine", 71)
    held = hold_state_dir_unchecked(scene.state_dir)
    try:
        with pytest.raises(StateBusy, match="in use by a running process; stop it first"):
            recover(scene.state_dir)
    finally:
        os.close(held)
    assert recover(scene.state_dir).action is RecoveryAction.ROLLED_BACK


def hold_state_dir_unchecked(state_dir: Path) -> int:
    """A shared hold on ``.keel.lock`` taken without recovery, as a server from before the crash would have."""
    fd = os.open(state_dir / ".keel.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


# -- the server's hold --------------------------------------------------------------------------


def test_hold_state_dir_recovers_creates_the_directory_and_keeps_restore_out(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with hold_state_dir(state_dir) as first, hold_state_dir(state_dir) as second:
        assert first.outcome.action is RecoveryAction.FIRST_BOOT
        assert second.outcome.action is RecoveryAction.CLEAN
        with pytest.raises(StateBusy), exclusive_use(state_dir):
            pass
        first.release()
        with pytest.raises(StateBusy), exclusive_use(state_dir):
            pass
    with exclusive_use(state_dir):
        pass


def test_a_state_directory_that_cannot_be_made_is_refused_by_name_and_with_what_to_do() -> None:
    where = Path("/proc/keel-state")  # /proc takes no new directories, whoever asks
    with pytest.raises(StateError) as caught:
        hold_state_dir(where)
    assert str(caught.value) == (
        f"the state directory {where} cannot be used: no directory can be made in /proc (its file system takes no new"
        " directories), so it cannot be created; choose one this user can create, or make files in"
    )


def test_one_server_holds_a_state_directory_and_a_second_is_told_so(tmp_path: Path) -> None:
    first = acquire_serving(tmp_path)
    try:
        with pytest.raises(AlreadyServed, match="another Keel server is serving the state directory"):
            acquire_serving(tmp_path)
        with hold_state_dir(tmp_path):  # other users of the live state (a snapshot, say) are not refused
            pass
    finally:
        release_use(first)
    release_use(acquire_serving(tmp_path))  # free again once the first server is gone


def test_hold_state_dir_refuses_planted_incomplete_journal(tmp_path: Path) -> None:
    (tmp_path / JOURNAL_NAME).write_text('{"phase":"prepared"}')
    incomplete = r"^Restore journal is incomplete or has unsupported fields\. Missing: .*\. Recovery left .* as it was\."
    with pytest.raises(RecoveryError, match=incomplete):
        hold_state_dir(tmp_path)
    with exclusive_use(tmp_path):
        pass  # the refusal left no lock behind
