"""``python -m runtime state ...`` through real subprocesses on real state directories."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.persistence.state_helpers import (
    CHILD_TIMEOUT_S,
    SESSIONS,
    TASKS,
    fingerprint,
    finish_child,
    grow,
    in_wal_mode,
    labels,
    live_databases,
    make_db,
    new_snapshot,
    old_generation,
    run_child,
    small_disk,
    snapshot_databases,
    start_child,
    wait_for_line,
)

INCOMPLETE = (
    "Restore journal is incomplete or has unsupported fields. Missing: format_version, new_inventory, old_inventory,"
    " quarantine_dir, staging_dir, transaction_id."
)


def keel(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("AGENT_STATE_DIR", "AGENT_BACKUP_ROOT")}
    return subprocess.run(
        [sys.executable, "-m", "runtime", *args],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )


def live_state(cwd: Path) -> Path:
    state = cwd / ".state"
    make_db(state / "runtime.db", SESSIONS, "snapshotted")
    make_db(state / "tasks.db", TASKS, "snapshotted")
    return state


def test_state_snapshot_then_restore_round_trips_with_default_paths(tmp_path: Path) -> None:
    state = live_state(tmp_path)

    snapshot = keel(tmp_path, "state", "snapshot", "--timestamp", "20260102T030405Z")
    assert snapshot.returncode == 0, snapshot.stderr
    path = Path(snapshot.stdout.strip())
    assert path == tmp_path / ".state-backups" / "20260102T030405Z"  # a sibling, never inside the state dir
    (state / "tasks.db").unlink()
    make_db(state / "tasks.db", TASKS, "changed")

    restore = keel(tmp_path, "state", "restore", str(path))

    assert restore.returncode == 0, restore.stderr
    assert "restored runtime.db, tasks.db" in restore.stdout
    assert fingerprint(state) == snapshot_databases(path)
    assert labels(state / "tasks.db") == ["snapshotted-0", "snapshotted-1", "snapshotted-2"]


def test_state_commands_read_the_state_dir_and_backup_root_from_the_environment(tmp_path: Path) -> None:
    state = tmp_path / "elsewhere" / "state"
    make_db(state / "tasks.db", TASKS, "env")
    env = {"AGENT_STATE_DIR": str(state), "AGENT_BACKUP_ROOT": str(tmp_path / "vault")}

    result = keel(tmp_path, "state", "snapshot", "--timestamp", "20260102T030405Z", **env)

    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == tmp_path / "vault" / "20260102T030405Z"
    empty = keel(tmp_path, "state", "recover", AGENT_STATE_DIR="")
    assert empty.returncode == 1
    assert "AGENT_STATE_DIR must not be empty; unset the variable to use its default" in empty.stderr


def test_a_state_command_refuses_a_mistyped_agent_variable_before_it_touches_the_default_state_dir(
    tmp_path: Path,
) -> None:
    state = live_state(tmp_path)
    meant = tmp_path / "elsewhere"
    before = contents(state)

    for command in (["reset"], ["snapshot"], ["recover"], ["restore", str(tmp_path / "any")]):
        result = keel(tmp_path, "state", *command, AGENT_STATE_DIRR=str(meant))

        assert result.returncode == 1, command
        assert result.stderr.strip() == (
            "error: the configuration has problems:\n"
            "  - AGENT_STATE_DIRR is not a setting Keel knows; did you mean AGENT_STATE_DIR?"
        ), command
        assert result.stdout == ""
    assert contents(state) == before  # the .state it would have taken instead is as it was
    assert not (tmp_path / ".state-backups").exists()


@pytest.mark.parametrize("flag", ["--state-dir", "--backup-root"])
def test_a_state_command_refuses_an_empty_directory_flag_as_it_refuses_an_empty_variable(tmp_path: Path, flag: str) -> None:
    state = live_state(tmp_path)
    before = contents(tmp_path)
    # "" must not mean "here": the state directory itself for a reset, beside it for snapshots.
    cwd, command = (tmp_path, ["snapshot", flag, ""]) if flag == "--backup-root" else (state, ["reset", flag, ""])

    result = keel(cwd, "state", *command)

    assert result.returncode == 1
    assert result.stderr.strip() == f"error: {flag} must not be empty; leave it out to use its default"
    assert contents(tmp_path) == before


@pytest.mark.parametrize("variable", ["AGENT_STATE_DIR", "AGENT_BACKUP_ROOT"])
def test_a_state_command_refuses_a_directory_read_from_a_file_with_its_newline_as_serve_does(
    tmp_path: Path, variable: str
) -> None:
    # A secret mounted as a file keeps its newline: snapshots went to (and restores read) a
    # directory whose name ends in one, beside the directory meant.
    state = live_state(tmp_path)
    before = contents(tmp_path)
    given = f"{state if variable == 'AGENT_STATE_DIR' else tmp_path / 'backups'}\n"

    result = keel(tmp_path, "state", "snapshot", **{variable: given})

    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: {variable}={given!r} is not valid: it starts or ends with white space (a file read with its newline?); remove it"
    )
    assert contents(tmp_path) == before


def test_a_state_command_refuses_a_state_directory_starting_with_a_tilde_no_shell_expanded(tmp_path: Path) -> None:
    live_state(tmp_path)
    before = contents(tmp_path)

    result = keel(tmp_path, "state", "snapshot", AGENT_STATE_DIR="~/state")

    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: AGENT_STATE_DIR='~/state' is not valid: it starts with '~', which only a shell expands, to a home"
        " directory; give the whole path"
    )
    assert contents(tmp_path) == before


def test_state_commands_refuse_a_planted_incomplete_journal_until_it_is_removed(tmp_path: Path) -> None:
    state = live_state(tmp_path)
    journal = state / ".restore-journal.json"
    journal.write_text('{"phase":"prepared"}')

    for command in (["recover"], ["snapshot"], ["restore", str(tmp_path / "any")]):
        refused = keel(tmp_path, "state", *command, "--state-dir", str(state))
        assert refused.returncode == 1, command
        if command[0] != "restore":  # restore validates its snapshot first, and this one is absent
            assert refused.stderr.strip().startswith(f"error: {INCOMPLETE} Recovery left {state} as it was.")
    assert journal.read_text() == '{"phase":"prepared"}'

    journal.unlink()
    recovered = keel(tmp_path, "state", "recover", "--state-dir", str(state))
    assert recovered.returncode == 0, recovered.stderr
    assert "nothing to recover" in recovered.stdout


def test_state_restore_refuses_a_planted_incomplete_journal_with_a_valid_snapshot(tmp_path: Path) -> None:
    state = live_state(tmp_path)
    snapshot = new_snapshot(tmp_path)
    (state / ".restore-journal.json").write_text('{"phase":"prepared"}')
    before = fingerprint(state)

    refused = keel(tmp_path, "state", "restore", str(snapshot), "--state-dir", str(state))

    assert refused.returncode == 1
    assert refused.stderr.strip().startswith(f"error: {INCOMPLETE} Recovery left {state} as it was.")
    assert fingerprint(state) == before


def test_state_restore_and_reset_refuse_while_a_process_holds_the_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    old_generation(state)
    snapshot = new_snapshot(tmp_path)
    before = fingerprint(state)

    holder = start_child("hold", snapshot, state)
    try:
        wait_for_line(holder, "held")
        for command in (["restore", str(snapshot)], ["reset"]):
            refused = keel(tmp_path, "state", *command, "--state-dir", str(state))
            assert refused.returncode == 1
            assert f"the state directory {state} is in use by a running process; stop it first" in refused.stderr
        assert fingerprint(state) == before
        running = keel(tmp_path, "state", "snapshot", "--state-dir", str(state), "--backup-root", str(tmp_path / "b"))
        assert running.returncode == 0, running.stderr  # a snapshot may run beside a server
    finally:
        code, _, err = finish_child(holder)
    assert code == 0, err

    reset = keel(tmp_path, "state", "reset", "--state-dir", str(state))
    assert reset.returncode == 0, reset.stderr
    assert fingerprint(state) == {}


def test_state_recover_rolls_back_a_restore_killed_mid_quarantine(tmp_path: Path) -> None:
    state = tmp_path / "state"
    old_generation(state)
    before = fingerprint(state)
    snapshot = new_snapshot(tmp_path)
    assert run_child("after-quarantine", snapshot, state).returncode == 71

    recovered = keel(tmp_path, "state", "recover", "--state-dir", str(state))

    assert recovered.returncode == 0, recovered.stderr
    assert "rolled back restore" in recovered.stdout
    assert fingerprint(state) == before


def test_a_state_directory_recovery_cannot_account_for_is_named_with_the_ways_out_and_they_work(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    old_generation(state)
    snapshot = new_snapshot(tmp_path)
    assert run_child("after-quarantine", snapshot, state).returncode == 71
    [quarantine] = state.glob(".restore-quarantine.*")
    for moved in quarantine.iterdir():  # the evidence of the old generation, lost (removed by hand, say)
        moved.unlink()

    for refused in (keel(tmp_path, "state", "recover", "--state-dir", str(state)), keel(tmp_path, "serve", "--state-dir", str(state), "--port", "0")):
        assert refused.returncode == 1
        [said] = refused.stderr.strip().splitlines()
        assert said.startswith("error: Restore recovery is missing byte-identical old evidence for ")
        assert f"Recovery left {state} as it was" in said
        assert "python -m runtime state reset" in said and "python -m runtime state restore SNAPSHOT" in said

    assert keel(tmp_path, "state", "reset", "--state-dir", str(state)).returncode == 0
    restored = keel(tmp_path, "state", "restore", str(snapshot), "--state-dir", str(state))
    assert restored.returncode == 0, restored.stderr
    assert fingerprint(state) == snapshot_databases(snapshot)


def test_state_restore_reports_a_damaged_snapshot_and_changes_nothing(tmp_path: Path) -> None:
    state = live_state(tmp_path)
    snapshot = new_snapshot(tmp_path)
    (snapshot / "manifest.json").write_bytes((snapshot / "manifest.json").read_bytes() + b"\n")
    before = fingerprint(state)

    refused = keel(tmp_path, "state", "restore", str(snapshot))

    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        f"error: Snapshot manifest hash does not match .complete: {snapshot}; nothing in .state was changed: restore"
        " another snapshot"
    )
    assert fingerprint(state) == before


def test_state_restore_reads_a_snapshot_named_through_a_link_or_from_inside_it(tmp_path: Path) -> None:
    state = live_state(tmp_path)
    snapshot = Path(keel(tmp_path, "state", "snapshot", "--timestamp", "20260102T030405Z").stdout.strip())
    (snapshot.parent / "latest").symlink_to(snapshot.name)  # what an operator keeps beside the snapshots
    (snapshot / "notes").mkdir()

    through_link = keel(tmp_path, "state", "restore", ".state-backups/latest")
    from_inside = keel(snapshot / "notes", "state", "restore", "..", "--state-dir", "../../../.state")

    assert (through_link.returncode, through_link.stderr) == (0, "")
    assert (from_inside.returncode, from_inside.stderr) == (0, "")
    assert fingerprint(state) == snapshot_databases(snapshot)


def test_state_restore_refuses_a_snapshot_given_as_its_own_state_directory(tmp_path: Path) -> None:
    # It was restored onto itself: lock files were made beside its manifest, and a server started
    # there would have written its databases, leaving no snapshot to go back to.
    live_state(tmp_path)
    snapshot = Path(keel(tmp_path, "state", "snapshot", "--timestamp", "20260102T030405Z").stdout.strip())
    before = sorted(os.listdir(snapshot))

    refused = keel(snapshot, "state", "restore", ".", "--state-dir", ".")

    assert refused.returncode == 1
    assert refused.stderr == (
        f"error: the state directory . is the snapshot {snapshot}; give --state-dir (or AGENT_STATE_DIR) the state"
        " directory to restore it into\n"
    )
    assert sorted(os.listdir(snapshot)) == before


def test_state_restore_refuses_an_empty_snapshot_rather_than_read_the_current_directory(tmp_path: Path) -> None:
    live_state(tmp_path)

    refused = keel(tmp_path, "state", "restore", "")

    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        "error: SNAPSHOT must not be empty; give the snapshot directory that state snapshot printed"
    )


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda root: root.write_bytes(b""), "it is a file, not a directory"),
        (lambda root: root.symlink_to(root.name), "it cannot be reached (Too many levels of symbolic links)"),
        (lambda root: root.symlink_to("nowhere"), "it is a symbolic link to nothing, not a directory"),
    ],
    ids=["a-file", "a-link-to-itself", "a-link-to-nothing"],
)
def test_state_snapshot_says_why_a_backup_root_cannot_be_used(tmp_path: Path, make: Callable[[Path], object], why: str) -> None:
    live_state(tmp_path)
    make(tmp_path / "vault")

    refused = keel(tmp_path, "state", "snapshot", "--backup-root", "vault")

    assert refused.returncode == 1
    assert refused.stderr == (
        f"error: the backup root vault cannot be used: {why}; give --backup-root (or AGENT_BACKUP_ROOT) a directory this user"
        " may write in\n"
    )
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("made", [True, False], ids=["there", "to-be-made"])
def test_state_snapshot_onto_a_read_only_backup_root_says_so_and_what_to_do(tmp_path: Path, made: bool) -> None:
    live_state(tmp_path)
    with small_disk(tmp_path / "ro", "1m") as disk:
        (disk / "vault").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        refused = keel(tmp_path, "state", "snapshot", "--backup-root", "ro/vault" if made else "ro/vault/keel")

    read_only = "its file system is read-only"
    why = read_only if made else f"no directory can be made in {disk / 'vault'} ({read_only}), so it cannot be created"
    assert refused.returncode == 1
    assert refused.stderr == (
        f"error: the backup root {'ro/vault' if made else 'ro/vault/keel'} cannot be used: {why};"
        " give --backup-root (or AGENT_BACKUP_ROOT) a directory this user may write in\n"
    )


def test_state_help_says_reset_deletes_all_the_directory_holds_without_asking(tmp_path: Path) -> None:
    # It said "remove all runtime state": not that files of other programs there go too.
    said = " ".join(keel(tmp_path, "state", "--help").stdout.split())
    assert "reset delete everything in the state directory but its lock files, Keel's or not, without asking" in said


def test_a_backup_root_keeps_the_snapshots_of_one_state_directory(tmp_path: Path) -> None:
    first, second = live_state(tmp_path / "one"), live_state(tmp_path / "two")
    shared = str(tmp_path / "backups")
    made = keel(tmp_path, "state", "snapshot", "--state-dir", str(first), "--backup-root", shared, "--keep", "1",
                "--timestamp", "20260102T030405Z")  # fmt: skip
    assert made.returncode == 0, made.stderr
    kept = Path(made.stdout.strip())

    refused = keel(tmp_path, "state", "snapshot", "--state-dir", str(second), "--backup-root", shared, "--keep", "1")

    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        f"error: the backup root {shared} holds the snapshots of another state directory, {os.path.realpath(first)}:"
        " give each state directory a backup root of its own (--backup-root or AGENT_BACKUP_ROOT), or, if"
        f" {os.path.realpath(first)} was moved to {second}, remove {shared}/.keel-snapshots-of"
    )
    assert kept.is_dir()  # not pruned by the other directory's snapshot
    assert sorted(os.listdir(shared)) == [".keel-snapshots-of", kept.name]
    named_otherwise = str(tmp_path / "one" / ".." / "one" / ".state")
    again = keel(tmp_path, "state", "snapshot", "--state-dir", named_otherwise, "--backup-root", shared,
                 "--timestamp", "20260102T030406Z")  # fmt: skip
    assert again.returncode == 0, again.stderr  # the same directory, however it is named


def test_state_snapshot_refuses_a_taken_timestamp(tmp_path: Path) -> None:
    live_state(tmp_path)
    assert keel(tmp_path, "state", "snapshot", "--timestamp", "20260102T030405Z").returncode == 0
    again = keel(tmp_path, "state", "snapshot", "--timestamp", "20260102T030405Z")
    assert again.returncode == 1
    assert again.stderr == (
        f"error: a snapshot named 20260102T030405Z already exists in {tmp_path / '.state-backups'};"
        " snapshots are never overwritten: give another --timestamp, or, with none, take it again a second later\n"
    )


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        ("0", "must be at least 1, got 0"),
        ("many", "must be a whole number in the digits 0-9, got 'many'"),
        ("1_0", "must be a whole number in the digits 0-9, got '1_0'"),  # Python's int() reads 10
        ("\u0661", "must be a whole number in the digits 0-9, got '\u0661'"),  # an Arabic-Indic 1
    ],
)
def test_state_snapshot_rejects_a_bad_keep(tmp_path: Path, keep: str, message: str) -> None:
    result = keel(tmp_path, "state", "snapshot", "--keep", keep)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / ".state-backups").exists()


def test_a_state_command_the_file_system_refuses_says_why_without_a_traceback(tmp_path: Path) -> None:
    live_state(tmp_path)
    (tmp_path / "a-file").write_text("not a directory")
    result = keel(tmp_path, "state", "snapshot", "--backup-root", str(tmp_path / "a-file" / "backups"))
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    assert "a-file" in result.stderr and "Not a directory" in result.stderr and "Errno" not in result.stderr


NOTHING_TO_RECOVER = "nothing to recover: no restore was interrupted"
NO_DATABASES = "it holds no databases (a server started on it begins with no tasks or conversations)"


@pytest.mark.parametrize(
    ("command", "said"),
    [("recover", f"{NOTHING_TO_RECOVER}; {NO_DATABASES}"), ("reset", "nothing to remove")],
)
def test_state_recover_or_reset_of_an_empty_directory_says_so_and_makes_nothing_there(
    tmp_path: Path, command: str, said: str
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()

    result = keel(tmp_path, "state", command, "--state-dir", str(empty))

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{empty}: {said}"
    assert list(empty.iterdir()) == []  # not even a lock file


def test_state_recover_after_a_reset_says_the_databases_are_gone(tmp_path: Path) -> None:
    live_state(tmp_path)
    reset = keel(tmp_path, "state", "reset")
    assert reset.returncode == 0, reset.stderr

    result = keel(tmp_path, "state", "recover")

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f".state: {NOTHING_TO_RECOVER}; {NO_DATABASES}"


def test_state_recover_says_it_does_not_check_what_the_databases_hold(tmp_path: Path) -> None:
    state = live_state(tmp_path)
    (state / "tasks.db").write_bytes(b"not a database\n" * 512)

    result = keel(tmp_path, "state", "recover")

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f".state: {NOTHING_TO_RECOVER}; its databases (runtime.db, tasks.db) were not opened: what they hold is not checked"
    )
    snapshot = keel(tmp_path, "state", "snapshot")  # what does open them finds the damage
    assert snapshot.returncode == 1 and "tasks.db" in snapshot.stderr, snapshot.stderr


# -- a directory that is not a state directory, or that cannot be used ----------------------------

AS_ROOT = os.geteuid() == 0  # root passes permission checks: what refuses it is the file system itself
NO_NEW_FILES = f"no file can be made in it ({'its file system takes no new files' if AS_ROOT else 'this user may not write in it'})"
NOT_IN_PROC = (
    f"no directory can be made in /proc ({'its file system takes no new directories' if AS_ROOT else 'this user may not write in it'}),"
    " so it cannot be created"
)
CHOOSE = "choose one this user can create, or make files in"
LOCK_FILES = {".keel.lock", ".keel-generation.lock", ".keel-serve.lock"}


def contents(directory: Path) -> dict[str, bytes]:
    """Every path under ``directory``, lock files included, with the bytes of each file."""
    return {str(p.relative_to(directory)): b"" if p.is_dir() else p.read_bytes() for p in sorted(directory.rglob("*"))}


def users_documents(directory: Path) -> None:
    (directory / "docs").mkdir(parents=True)
    (directory / "docs" / "thesis.txt").write_text("important\n")
    (directory / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a photo")
    make_db(directory / "tasks.db", None, "another program's")  # a SQLite file, but not Keel's


def test_state_reset_refuses_a_directory_that_holds_nothing_of_keels_and_removes_nothing(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    users_documents(scratch)
    before = contents(scratch)

    result = keel(tmp_path, "state", "reset", "--state-dir", "scratch")

    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: scratch is not a Keel state directory: it holds another program's database (tasks.db) and nothing of"
        " Keel's, so reset removed nothing from it; check that --state-dir (or AGENT_STATE_DIR) names the state directory"
    )
    assert contents(scratch) == before  # not a file removed, and no lock file made
    (scratch / "tasks.db").unlink()

    result = keel(tmp_path, "state", "reset", "--state-dir", "scratch")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: scratch is not a Keel state directory: it holds none of Keel's lock files, databases or restore"
        " residue, so reset removed nothing from it; check that --state-dir (or AGENT_STATE_DIR) names the state directory"
    )


def test_a_snapshot_and_a_reset_of_a_mistyped_state_directory_leave_it_as_it_was(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    users_documents(scratch)
    (scratch / "tasks.db").unlink()  # no databases at all: what snapshot refuses
    before = contents(scratch)

    snapshot = keel(tmp_path, "state", "snapshot", "--state-dir", "scratch")
    assert snapshot.returncode == 1
    assert snapshot.stderr.strip() == "error: the state directory scratch holds no databases; there is nothing to snapshot"
    assert contents(scratch) == before  # no lock file left behind for a reset to take for Keel's

    reset = keel(tmp_path, "state", "reset", "--state-dir", "scratch")
    assert reset.returncode == 1 and "is not a Keel state directory" in reset.stderr
    assert contents(scratch) == before


def test_a_reset_stopped_midway_says_what_it_removed_what_is_left_and_what_to_do(tmp_path: Path) -> None:
    state = live_state(tmp_path)
    stuck = state / "tasks.db"
    made_immutable = subprocess.run(["chattr", "+i", str(stuck)], capture_output=True, text=True)
    assert made_immutable.returncode == 0, f"chattr +i failed (run the suite as root on ext4): {made_immutable.stderr}"
    try:
        result = keel(tmp_path, "state", "reset")
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: state reset of .state stopped at tasks.db, which could not be removed (Operation not permitted),"
        " after it had removed runtime.db; the rest is still there. Do not serve the directory half reset:"
        " fix what stopped it and run state reset again"
    )
    assert sorted(os.listdir(state)) == [".keel-generation.lock", ".keel.lock", "tasks.db"]
    again = keel(tmp_path, "state", "reset")
    assert (again.returncode, again.stdout.strip()) == (0, ".state: removed tasks.db")


def test_state_reset_takes_keel_databases_copied_in_by_hand_for_a_state_directory(tmp_path: Path) -> None:
    copied = tmp_path / "copied"
    make_db(copied / "runtime.db", SESSIONS, "copied")
    make_db(copied / "tasks.db", TASKS, "copied")  # no lock file: only the databases say whose they are

    result = keel(tmp_path, "state", "reset", "--state-dir", str(copied))

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{copied}: removed runtime.db, tasks.db"
    assert {p.name for p in copied.iterdir()} == {".keel.lock", ".keel-generation.lock"}


@pytest.mark.parametrize("command", ["snapshot", "restore", "recover", "reset"])
def test_every_state_command_says_a_device_given_as_the_state_directory_is_not_a_directory(
    tmp_path: Path, command: str
) -> None:
    args = ["restore", str(new_snapshot(tmp_path))] if command == "restore" else [command]

    result = keel(tmp_path, "state", *args, "--state-dir", "/dev/null")

    assert result.returncode == 1
    assert result.stderr.strip() == f"error: the state directory /dev/null cannot be used: it is a device, not a directory; {CHOOSE}"


def test_state_restore_into_a_directory_no_file_can_be_made_in_says_which_and_why(tmp_path: Path) -> None:
    result = keel(tmp_path, "state", "restore", str(new_snapshot(tmp_path)), "--state-dir", "/proc")

    assert result.returncode == 1
    assert result.stderr.strip() == f"error: the state directory /proc cannot be used: {NO_NEW_FILES}; {CHOOSE}"


def test_state_snapshot_whose_lock_file_is_not_a_file_names_it_without_an_errno(tmp_path: Path) -> None:
    state = live_state(tmp_path)
    (state / ".keel-generation.lock").mkdir()

    result = keel(tmp_path, "state", "snapshot")

    assert result.returncode == 1
    assert result.stderr.strip() == f"error: the state lock {Path('.state') / '.keel-generation.lock'} must be a regular file"


def test_every_state_command_refuses_a_symbolic_link_given_as_the_state_directory_as_serve_does(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    said = "error: the state directory link cannot be used: it is a symbolic link; give the directory it points to"

    for args in (["recover"], ["snapshot"], ["reset"], ["restore", str(new_snapshot(tmp_path))]):
        result = keel(tmp_path, "state", *args, "--state-dir", "link")
        assert (result.returncode, result.stderr.strip()) == (1, said), args
    assert list((tmp_path / "real").iterdir()) == []


def test_state_recover_promises_a_server_only_a_directory_one_could_use(tmp_path: Path) -> None:
    proc = keel(tmp_path, "state", "recover", "--state-dir", "/proc")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        f"/proc: {NOTHING_TO_RECOVER}; it holds no databases, and a server started by this user could not use it: {NO_NEW_FILES}"
    )

    under_proc = keel(tmp_path, "state", "recover", "--state-dir", "/proc/keelstate")
    assert under_proc.returncode == 0, under_proc.stderr
    assert under_proc.stdout.strip() == (
        "/proc/keelstate: no state directory yet: nothing to recover; a server started by this user could not use it: "
        + NOT_IN_PROC
    )

    fresh = keel(tmp_path, "state", "recover", "--state-dir", "new/state")
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.strip() == "new/state: no state directory yet: nothing to recover (serve creates it)"
    assert not (tmp_path / "new").exists()  # what was tried was made and removed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".keel-check-")]


# -- a state directory no one may write in, and disks that fill ----------------------------------


@contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` and its files as on a read-only copy (a backup volume): writable by no one,
    root included (chattr +i: root passes every permission check)."""
    entries = [directory, *directory.iterdir()]
    for entry in entries:
        entry.chmod(0o555 if entry.is_dir() else 0o444)
    made_immutable = subprocess.run(["chattr", "+i", *map(str, entries)], capture_output=True, text=True)
    assert made_immutable.returncode == 0, f"chattr +i failed (run the suite as root on ext4): {made_immutable.stderr}"
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, entries)], check=True)
        directory.chmod(0o750)


@pytest.mark.parametrize("locks", [True, False], ids=["with-its-lock-files", "without-lock-files"])
def test_state_snapshot_of_a_state_directory_no_one_may_write_in_takes_what_it_holds(tmp_path: Path, locks: bool) -> None:
    state = live_state(tmp_path)
    for database in ("runtime.db", "tasks.db"):
        in_wal_mode(state / database)  # as Keel keeps them: reading one in place needs a -wal and -shm beside it
    if locks:  # what a server made there before the copy was taken
        for name in LOCK_FILES:
            (state / name).touch(mode=0o600)
    before = contents(state)

    with read_only(state):
        result = keel(tmp_path, "state", "snapshot", "--backup-root", str(tmp_path / "vault"))
        after = contents(state)

    assert result.returncode == 0, result.stderr
    assert after == before  # nothing made in it, nothing changed
    snapshot = Path(result.stdout.strip())
    assert snapshot_databases(snapshot).keys() == {"runtime.db", "tasks.db"}
    restored = keel(tmp_path, "state", "restore", str(snapshot), "--state-dir", "restored")
    assert restored.returncode == 0, restored.stderr
    assert labels(tmp_path / "restored" / "tasks.db") == ["snapshotted-0", "snapshotted-1", "snapshotted-2"]


def test_state_snapshot_onto_a_full_disk_names_the_backup_root_and_publishes_nothing(tmp_path: Path) -> None:
    state = live_state(tmp_path)
    grow(state / "tasks.db", 2 << 20)
    with small_disk(tmp_path / "small", "1m") as small:
        result = keel(tmp_path, "state", "snapshot", "--backup-root", str(small / "vault"))
        left = sorted(path.name for path in (small / "vault").iterdir())

    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: the backup root {small / 'vault'} has no room for a snapshot of {Path('.state')} (its file system is full),"
        " so none was written; free space on its disk, or give --backup-root (or AGENT_BACKUP_ROOT) a directory on one"
        " with room"
    )
    assert left == []  # what was copied before the disk filled is gone


def test_state_restore_onto_a_full_disk_names_the_state_directory_and_changes_nothing(tmp_path: Path) -> None:
    snapshot = new_snapshot(tmp_path)
    with small_disk(tmp_path / "small", "1m") as small:
        state = small / "state"
        live_databases(state)
        before = fingerprint(state)
        grow(snapshot.parent.parent / "source-20260102T030405Z" / "memory.db", 2 << 20)
        big = keel(tmp_path, "state", "snapshot", "--state-dir", "source-20260102T030405Z", "--timestamp", "20260103T000000Z")
        assert big.returncode == 0, big.stderr

        result = keel(tmp_path, "state", "restore", big.stdout.strip(), "--state-dir", str(state))
        after = fingerprint(state)

    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: restoring {big.stdout.strip()} failed: the state directory {state} has no room for its databases"
        " (its file system is full), and the live databases are as they were; free space on its disk and restore again"
    )
    assert after == before


def test_state_snapshot_refuses_an_empty_timestamp_rather_than_taking_it_for_now(tmp_path: Path) -> None:
    live_state(tmp_path)
    result = keel(tmp_path, "state", "snapshot", "--timestamp", "")
    assert result.returncode == 1
    assert "snapshot timestamp '' must be a UTC time written like 20260131T235959Z" in result.stderr
    assert not (tmp_path / ".state-backups").exists() or not list((tmp_path / ".state-backups").iterdir())
