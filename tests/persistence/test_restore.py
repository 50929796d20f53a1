"""Restore: validation before any mutation, the exact new generation, rollback, and the locks."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from persistence.journal import JOURNAL_NAME, QUARANTINE_PREFIX
from persistence.recovery import hold_state_dir
from persistence.restore import reset_state, restore_snapshot
from persistence.schema import SchemaIdentity
from persistence.statedir import (
    GENERATION_LOCK_NAME,
    LOCK_NAMES,
    NotAStateDir,
    RestoreError,
    SnapshotError,
    StateBusy,
    encode_document,
)
from persistence.statelocks import acquire_serving, release_use
from tests.persistence.state_helpers import (
    CHILD_TIMEOUT_S,
    another_users,
    fill,
    fingerprint,
    finish_child,
    labels,
    live_databases,
    make_damaged_db,
    make_db,
    new_snapshot,
    old_generation,
    residue,
    run_child,
    small_disk,
    snapshot_databases,
    start_child,
    wait_for_line,
)


def test_restore_publishes_exactly_the_snapshot_and_drops_old_files_and_sidecars(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    umask = os.umask(0o022)  # a usual umask: what it lets through, the databases' copies must not
    try:
        old_generation(state_dir)
        snapshot = new_snapshot(tmp_path)
        result = restore_snapshot(snapshot, state_dir)
    finally:
        os.umask(umask)

    assert fingerprint(state_dir) == snapshot_databases(snapshot)  # no obsolete.db, no old -wal/-shm/-journal
    assert result.restored == ("memory.db", "runtime.db", "tasks.db")
    assert "runtime.db-wal" in result.replaced and "incidents.db-journal" in result.replaced
    assert labels(state_dir / "tasks.db") == ["new-0", "new-1", "new-2", "new-3"]
    for path in [*snapshot.glob("*.db"), *state_dir.glob("*.db")]:  # conversations: their owner's alone
        assert os.stat(path).st_mode & 0o777 == 0o600, path


def test_restore_run_as_root_leaves_files_the_state_directorys_owner_can_open(tmp_path: Path) -> None:
    # `sudo keel state restore` for a server that runs as its own user: copies made as root, 0600,
    # would leave that server unable to open its own databases, or to take its locks.
    state_dir = tmp_path / "state"
    old_generation(state_dir)
    snapshot = new_snapshot(tmp_path)
    owner = another_users(state_dir)
    restore_snapshot(snapshot, state_dir)

    owners = {path.name: (path.stat().st_uid, path.stat().st_gid) for path in state_dir.iterdir()}
    assert set(owners) >= {"runtime.db", "tasks.db", GENERATION_LOCK_NAME}
    assert set(owners.values()) == {owner}, owners


def owners_under(top: Path) -> dict[str, tuple[int, int]]:
    """The owner and group of ``top`` and of everything under it, by path relative to ``top``'s parent."""
    found = [top, *(Path(here) / name for here, dirs, files in os.walk(top) for name in (*dirs, *files))]
    return {str(path.relative_to(top.parent)): (path.lstat().st_uid, path.lstat().st_gid) for path in found}


def test_restore_run_as_root_into_a_missing_state_directory_leaves_it_to_the_owner_of_the_directory_above(
    tmp_path: Path,
) -> None:
    # `sudo keel state restore` onto a new machine, or after the state directory was removed: the
    # directory it makes is root's, 0750, and the server, run as its own user, cannot open it.
    home = tmp_path / "home"
    home.mkdir()
    owner = another_users(home)
    restore_snapshot(new_snapshot(tmp_path), home / "keel" / "state")

    owners = owners_under(home / "keel")
    assert {"keel", "keel/state", "keel/state/tasks.db", f"keel/state/{GENERATION_LOCK_NAME}"} <= set(owners)
    assert set(owners.values()) == {owner}, owners


def test_a_restore_run_as_root_and_killed_midway_leaves_what_it_made_to_the_state_directorys_owner(tmp_path: Path) -> None:
    # The server, run as its own user, recovers the directory as it starts: it must read the journal
    # and remove the staging and quarantine directories the killed restore left.
    state_dir = tmp_path / "state"
    old_generation(state_dir)
    owner = another_users(state_dir, with_contents=True)
    killed = run_child("after-quarantine", new_snapshot(tmp_path), state_dir)
    assert killed.returncode == 71, killed.stderr

    owners = owners_under(state_dir)
    quarantine = [f"state/{name}" for name in os.listdir(state_dir) if name.startswith(QUARANTINE_PREFIX)]
    assert {f"state/{JOURNAL_NAME}", *quarantine} <= set(owners) and quarantine
    assert set(owners.values()) == {owner}, owners


def test_restore_into_a_missing_state_dir_creates_it(tmp_path: Path) -> None:
    snapshot = new_snapshot(tmp_path)
    restore_snapshot(snapshot, tmp_path / "fresh" / "state")
    assert fingerprint(tmp_path / "fresh" / "state") == snapshot_databases(snapshot)


# -- every snapshot check runs before live state is touched ----------------------------------


def rewrite_manifest(snapshot: Path, edit: Callable[[dict[str, object]], None]) -> None:
    """Edit the manifest and sign it again, so the check after the signature is the one that fires."""
    manifest = json.loads((snapshot / "manifest.json").read_bytes())
    edit(manifest)
    data = encode_document(manifest)
    (snapshot / "manifest.json").write_bytes(data)
    marker = {"format_version": 1, "manifest_sha256": hashlib.sha256(data).hexdigest()}
    (snapshot / ".complete").write_bytes(encode_document(marker))


def entry(manifest: dict[str, object], name: str) -> dict[str, object]:
    databases = manifest["databases"]
    assert isinstance(databases, list)
    (found,) = (item for item in databases if item["filename"] == name)
    assert isinstance(found, dict)
    return found


def hide(snapshot: Path) -> Path:
    return snapshot.rename(snapshot.with_name("." + snapshot.name))


def drop_marker(snapshot: Path) -> Path:
    (snapshot / ".complete").unlink()
    return snapshot


def touch_manifest(snapshot: Path) -> Path:
    (snapshot / "manifest.json").write_bytes((snapshot / "manifest.json").read_bytes() + b" ")
    return snapshot


def edit_manifest(edit: Callable[[dict[str, object]], None]) -> Callable[[Path], Path]:
    def damage(snapshot: Path) -> Path:
        rewrite_manifest(snapshot, edit)
        return snapshot

    return damage


def future_marker(snapshot: Path) -> Path:
    marker = json.loads((snapshot / ".complete").read_bytes())
    (snapshot / ".complete").write_bytes(encode_document({**marker, "format_version": 2}))
    return snapshot


def flip_a_byte(snapshot: Path) -> Path:
    data = bytearray((snapshot / "tasks.db").read_bytes())
    data[-1] ^= 0xFF
    (snapshot / "tasks.db").write_bytes(bytes(data))
    return snapshot


def swap_in(make: Callable[[Path], None]) -> Callable[[Path], Path]:
    """Replace memory.db with another database and record its true hash and size."""

    def damage(snapshot: Path) -> Path:
        (snapshot / "memory.db").unlink()
        make(snapshot / "memory.db")
        data = (snapshot / "memory.db").read_bytes()

        def edit(manifest: dict[str, object]) -> None:
            entry(manifest, "memory.db").update(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))

        rewrite_manifest(snapshot, edit)
        return snapshot

    return damage


def remove_db(snapshot: Path) -> Path:
    (snapshot / "memory.db").unlink()
    return snapshot


def add_db(snapshot: Path) -> Path:
    shutil.copy(snapshot / "memory.db", snapshot / "extra.db")
    return snapshot


def future_schema(path: Path) -> None:
    make_db(path, SchemaIdentity("keel.sessions", 99), "future")


def duplicate(manifest: dict[str, object]) -> None:
    databases = manifest["databases"]
    assert isinstance(databases, list)
    databases.append(dict(databases[0]))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (hide, "is hidden, so it was never published"),
        (drop_marker, "is incomplete: it has no completion marker (.complete)"),
        (touch_manifest, "Snapshot manifest hash does not match .complete"),
        (future_marker, "uses snapshot format 2; this build reads format 1"),
        (edit_manifest(lambda m: m.update(format_version=2)), "uses snapshot format 2; this build reads format 1"),
        (edit_manifest(lambda m: m.update(comment="x")), "is not valid: the manifest has fields"),
        (
            edit_manifest(lambda m: entry(m, "tasks.db").update(filename="../tasks.db")),
            "unsafe database filename: '../tasks.db'",
        ),
        (edit_manifest(duplicate), "repeats the database filename memory.db"),
        (edit_manifest(lambda m: entry(m, "tasks.db").update(size_bytes=1)), "the manifest says 1"),
        (flip_a_byte, "tasks.db does not match its SHA-256 in the manifest"),
        (swap_in(make_damaged_db), "memory.db failed its integrity check: row 1 missing from index"),
        (swap_in(future_schema), "has schema keel.sessions@99, which this build cannot use"),
        (remove_db, "is missing memory.db, which its manifest lists"),
        (add_db, "holds extra.db, which its manifest does not list"),
    ],
)
def test_restore_refuses_a_bad_snapshot_before_touching_live_state(
    tmp_path: Path, damage: Callable[[Path], Path], message: str
) -> None:
    state_dir = tmp_path / "state"
    make_db(state_dir / "tasks.db", None, "live")
    before = sorted(os.listdir(state_dir)), fingerprint(state_dir)
    snapshot = damage(new_snapshot(tmp_path))

    with pytest.raises(SnapshotError) as caught:
        restore_snapshot(snapshot, state_dir)

    assert message in str(caught.value)
    assert str(snapshot) in str(caught.value)  # which snapshot, whichever of its files is at fault
    assert str(caught.value).endswith(f"; nothing in {state_dir} was changed: restore another snapshot")
    assert (sorted(os.listdir(state_dir)), fingerprint(state_dir)) == before  # not even a lock file


# -- failures after the journal is durable roll back ------------------------------------------


def failing_second_publish(error: BaseException) -> Callable[[Path, Path], None]:
    published = []

    def rename(source: Path, target: Path) -> None:
        if source.parent.name.startswith(".restore-staged."):
            published.append(source.name)
            if len(published) == 2:
                raise error
        os.replace(source, target)

    return rename


def test_restore_rolls_back_the_complete_generation_after_a_publication_failure(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    old_generation(state_dir)
    before = fingerprint(state_dir)

    with pytest.raises(RestoreError, match="the previous generation is live again, byte for byte: disk full"):
        restore_snapshot(new_snapshot(tmp_path), state_dir, rename=failing_second_publish(OSError("disk full")))

    assert fingerprint(state_dir) == before
    assert residue(state_dir) == []


def live_and_filling(small: Path, filled: str) -> tuple[Path, Callable[[Path, Path], None]]:
    """A state directory on ``small``, and a rename seam that fills the disk once the restore has
    published its journal (``prepared``) or moved the first database aside (``moved aside``);
    ``moved aside, then refused`` also has the next move refused, as a full disk refuses a
    directory that must grow."""
    state_dir = small / "state"
    live_databases(state_dir)

    def rename(source: Path, target: Path) -> None:
        if os.path.exists(small / "filler") and filled.endswith("refused") and target.parent.name.startswith(seam):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(source))
        os.replace(source, target)
        into = target.name if filled == "prepared" else target.parent.name
        if not os.path.exists(small / "filler") and into.startswith(seam):
            fill(small)

    seam = ".restore-journal.json" if filled == "prepared" else ".restore-quarantine."
    return state_dir, rename


@pytest.mark.parametrize("filled", ["prepared", "moved aside, then refused"])
def test_restore_on_a_disk_that_fills_midway_puts_the_live_databases_back_and_says_so(tmp_path: Path, filled: str) -> None:
    snapshot = new_snapshot(tmp_path)
    with small_disk(tmp_path / "small", "2m") as small:
        state_dir, rename = live_and_filling(small, filled)
        before = fingerprint(state_dir)

        with pytest.raises(RestoreError) as raised:
            restore_snapshot(snapshot, state_dir, rename=rename)
        after = fingerprint(state_dir)

    assert str(raised.value) == (
        f"restoring {snapshot} failed: the state directory {state_dir} has no room for its databases (its file system"
        " is full), and the live databases are as they were; free space on its disk and restore again"
    )
    assert after == before  # no journal left for the next process to find, and no copy


def test_restore_on_a_disk_that_fills_once_the_live_databases_move_finishes(tmp_path: Path) -> None:
    snapshot = new_snapshot(tmp_path)
    with small_disk(tmp_path / "small", "2m") as small:
        state_dir, rename = live_and_filling(small, "moved aside")

        result = restore_snapshot(snapshot, state_dir, rename=rename)
        after = fingerprint(state_dir)

    assert result.restored == ("memory.db", "runtime.db", "tasks.db")
    assert after == snapshot_databases(snapshot)


def test_restore_interrupted_by_keyboard_interrupt_rolls_back_and_reraises_it(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    old_generation(state_dir)
    before = fingerprint(state_dir)

    with pytest.raises(KeyboardInterrupt):
        restore_snapshot(new_snapshot(tmp_path), state_dir, rename=failing_second_publish(KeyboardInterrupt()))

    assert fingerprint(state_dir) == before


def test_restore_failing_before_its_journal_leaves_no_residue(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    old_generation(state_dir)
    before = fingerprint(state_dir)

    def no_journal(source: Path, target: Path) -> None:
        raise OSError("cannot publish the journal")

    with pytest.raises(OSError, match="cannot publish the journal"):
        restore_snapshot(new_snapshot(tmp_path), state_dir, rename=no_journal)

    assert fingerprint(state_dir) == before
    assert residue(state_dir) == []


# -- locks ------------------------------------------------------------------------------------


def test_restore_and_reset_refuse_while_a_process_holds_the_state_dir(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    old_generation(state_dir)
    before = fingerprint(state_dir)
    snapshot = new_snapshot(tmp_path)

    with hold_state_dir(state_dir):
        busy = f"the state directory {state_dir} is in use by a running process; stop it first"
        with pytest.raises(StateBusy, match=busy):
            restore_snapshot(snapshot, state_dir)
        with pytest.raises(StateBusy):
            reset_state(state_dir)

    assert fingerprint(state_dir) == before
    restore_snapshot(snapshot, state_dir)
    assert fingerprint(state_dir) == snapshot_databases(snapshot)


def test_reset_removes_every_generation_and_residue_but_keeps_every_lock_file(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    old_generation(state_dir)
    with hold_state_dir(state_dir):
        release_use(acquire_serving(state_dir))  # a server's three lock files, as one leaves them
    locks = {name: os.stat(state_dir / name).st_ino for name in LOCK_NAMES}
    (state_dir / ".restore-journal.json").write_text('{"phase":"prepared"}')
    (state_dir / ".restore-staged.0123456789abcdef0123456789abcdef").mkdir()

    removed = reset_state(state_dir)

    assert removed[-1] == ".restore-journal.json"
    assert fingerprint(state_dir) == {}
    assert {name: os.stat(state_dir / name).st_ino for name in os.listdir(state_dir)} == locks  # the same files
    assert reset_state(tmp_path / "never-created") == []


def test_reset_leaves_a_directory_holding_nothing_of_keels_as_it_is(tmp_path: Path) -> None:
    mistyped = tmp_path / "documents"
    (mistyped / "notes").mkdir(parents=True)
    (mistyped / "notes" / "thesis.txt").write_text("important\n")
    make_db(mistyped / "tasks.db", SchemaIdentity("todo.app", 1), "mine")  # a database, but another program's
    (mistyped / ".restore").write_text("a name close to a restore's, but not one")
    before = {p.name: p.stat().st_ino for p in mistyped.iterdir()}

    with pytest.raises(NotAStateDir, match=f"^{mistyped} is not a Keel state directory: "):
        reset_state(mistyped)

    assert {p.name: p.stat().st_ino for p in mistyped.iterdir()} == before
    assert (mistyped / "notes" / "thesis.txt").read_text() == "important\n"
    (tmp_path / "empty").mkdir()
    assert reset_state(tmp_path / "empty") == []
    assert list((tmp_path / "empty").iterdir()) == []  # nothing removed, and no lock file made


def blocked_on(lock: Path, pid: int) -> bool:
    """Whether ``pid`` is queued for an flock on ``lock`` (a ``->`` line in /proc/locks)."""
    inode = f":{os.stat(lock).st_ino} "
    lines = Path("/proc/locks").read_text().splitlines()
    return any("->" in line and " FLOCK " in f" {line} " and f" {pid} " in line and inode in line for line in lines)


def test_concurrent_restores_from_two_processes_are_serialized_by_the_lock(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    old_generation(state_dir)
    first_snapshot = new_snapshot(tmp_path, stamp="20260102T030405Z", label="first")
    second_snapshot = new_snapshot(tmp_path, stamp="20260102T030406Z", label="second")

    first = start_child("pause-after-quarantine", first_snapshot, state_dir)
    try:
        wait_for_line(first, "paused")  # the first restore holds the lock, one file quarantined
        during_first = fingerprint(state_dir)
        second = start_child("restore", second_snapshot, state_dir)
        lock = state_dir / GENERATION_LOCK_NAME
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not blocked_on(lock, second.pid) and second.poll() is None and time.monotonic() < deadline:
            pass
        assert blocked_on(lock, second.pid), "the second restore is not waiting for the generation lock"
        assert fingerprint(state_dir) == during_first  # and, waiting, it has written nothing
    finally:
        code, _, err = finish_child(first)
    assert code == 0, err
    code, _, err = finish_child(second)
    assert code == 0, err
    assert fingerprint(state_dir) == snapshot_databases(second_snapshot)
    assert labels(state_dir / "tasks.db") == [f"second-{i}" for i in range(4)]
