"""Snapshots: consistent copies of live databases, a signed manifest, one publishing rename, retention."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import sqlite3
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from persistence import snapshot as snapshot_module
from persistence.manifest import read_snapshot
from persistence.recovery import hold_state_dir
from persistence.schema import SchemaIdentity
from persistence.snapshot import OWNER_NAME, complete_snapshots, create_snapshot, stamp_for
from persistence.statedir import RecoveryError, SnapshotError
from tests.persistence.state_helpers import another_users, in_wal_mode, labels, live_databases, make_damaged_db, make_db


STAMP = "20260102T030405Z"


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    live_databases(state)
    make_db(state / "foreign.db", None, "live")
    return state


def snap(state_dir: Path, stamp: str | None = STAMP, *, keep: int = 7) -> Path:
    return create_snapshot(state_dir, state_dir.parent / "backups", keep=keep, app_version="1.2.3", stamp=stamp)


def test_snapshot_records_a_signed_manifest_of_hashed_checked_databases(state_dir: Path) -> None:
    snapshot = snap(state_dir)

    manifest_bytes = (snapshot / "manifest.json").read_bytes()
    marker = json.loads((snapshot / ".complete").read_bytes())
    manifest = json.loads(manifest_bytes)
    assert marker == {"format_version": 1, "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
    assert manifest["format_version"] == 1 and manifest["created_at"].endswith("Z")
    assert manifest["source"] == {"application": "keel", "version": "1.2.3"}
    by_name = {entry["filename"]: entry for entry in manifest["databases"]}
    assert by_name["runtime.db"]["schema"] == {"name": "keel.sessions", "version": 1}
    assert by_name["tasks.db"]["schema"] == {"name": "keel.tasks", "version": 1}
    assert by_name["foreign.db"]["schema"] is None
    for name, entry in by_name.items():
        data = (snapshot / name).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["size_bytes"] == len(data)
        assert data[18:20] == b"\x01\x01"  # rollback-journal mode: the copy needs no -wal to be read
    assert sorted(os.listdir(snapshot)) == [".complete", "foreign.db", "manifest.json", "runtime.db", "tasks.db"]
    assert {name: stat.S_IMODE(os.stat(snapshot / name).st_mode) for name in os.listdir(snapshot)} == dict.fromkeys(
        os.listdir(snapshot), 0o600
    )  # readable by their owner alone, the manifest and its marker too
    assert {entry.filename for entry in read_snapshot(snapshot).databases} == set(by_name)  # it validates
    assert sorted(os.listdir(snapshot.parent)) == [OWNER_NAME, STAMP]  # no staging and no stamp claim left behind


def test_a_snapshot_taken_as_root_belongs_to_the_backup_roots_owner(state_dir: Path) -> None:
    # `sudo keel state snapshot` for a server that runs as its own user: left to root, 0600, the
    # snapshot could not be restored by that user, nor pruned by the user's next snapshot.
    backups = state_dir.parent / "backups"
    backups.mkdir()
    owner = another_users(backups)
    snapshot = snap(state_dir)

    made = [Path(top) / name for top, dirs, files in os.walk(backups) for name in (*dirs, *files)]
    assert snapshot in made and backups / OWNER_NAME in made and snapshot / "tasks.db" in made
    assert {path: (path.lstat().st_uid, path.lstat().st_gid) for path in made} == dict.fromkeys(made, owner)


def test_the_lock_a_snapshot_taken_as_root_holds_on_its_stamp_belongs_to_the_backup_roots_owner(tmp_path: Path) -> None:
    # Left by a snapshot killed midway, a lock of root's, 0600, would keep the user's next
    # snapshot from taking it to clear what the dead one left.
    owner = another_users(tmp_path)
    with snapshot_module._stamp_lock(tmp_path, STAMP) as held:
        lock = tmp_path / f".snapshot-{STAMP}.lock"
        assert held and (lock.stat().st_uid, lock.stat().st_gid) == owner


def test_a_snapshot_taken_as_root_into_a_missing_backup_root_leaves_it_to_the_owner_of_the_directory_above(
    state_dir: Path,
) -> None:
    # The first `sudo keel state snapshot` into a backup root not made yet: made as root, 0750, the
    # backup root would keep the user the server runs as from restoring or pruning what it holds.
    home = state_dir.parent / "home"
    home.mkdir()
    owner = another_users(home)
    snapshot = create_snapshot(state_dir, home / "backups" / "keel", keep=7, app_version="1.2.3", stamp=STAMP)

    made = [home / "backups", *(Path(top) / name for top, dirs, files in os.walk(home / "backups") for name in (*dirs, *files))]
    assert snapshot in made and snapshot / "tasks.db" in made
    assert {path: (path.lstat().st_uid, path.lstat().st_gid) for path in made} == dict.fromkeys(made, owner)


def test_snapshot_copies_committed_rows_while_a_writer_is_mid_transaction(state_dir: Path) -> None:
    writer = sqlite3.connect(state_dir / "tasks.db", isolation_level=None)
    try:
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute("PRAGMA wal_autocheckpoint=0")  # committed rows stay in the -wal
        writer.execute("INSERT INTO items (label) VALUES ('committed-in-wal')")
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO items (label) VALUES ('uncommitted')")
        assert (state_dir / "tasks.db-wal").stat().st_size > 0

        snapshot = snap(state_dir)
    finally:
        writer.close()

    assert labels(snapshot / "tasks.db") == ["live-0", "live-1", "live-2", "committed-in-wal"]
    assert not [name for name in os.listdir(snapshot) if name.endswith(("-wal", "-shm", "-journal"))]


def test_snapshot_refuses_a_timestamp_that_already_exists(state_dir: Path) -> None:
    first = snap(state_dir)
    before = (first / "manifest.json").read_bytes()
    with pytest.raises(SnapshotError, match=f"a snapshot named {STAMP} already exists"):
        snap(state_dir)
    assert (first / "manifest.json").read_bytes() == before


def test_snapshot_refuses_a_timestamp_another_process_is_writing(state_dir: Path) -> None:
    root = state_dir.parent / "backups"
    root.mkdir()
    # flock locks belong to open file descriptions, so this descriptor conflicts exactly as
    # another process's would.
    fd = os.open(root / f".snapshot-{STAMP}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(SnapshotError, match=f"another process is writing snapshot {STAMP}"):
            snap(state_dir)
    finally:
        os.close(fd)
    assert not (root / STAMP).exists()
    assert snap(state_dir) == root / STAMP


def test_snapshot_retention_keeps_the_newest_complete_snapshots_only(state_dir: Path) -> None:
    root = state_dir.parent / "backups"
    unfinished = root / "20250101T000000Z"
    unfinished.mkdir(parents=True)  # no .complete: not a snapshot, never counted or pruned
    for second in range(4):
        snap(state_dir, f"20260102T03040{second}Z", keep=2)
    assert [path.name for path in complete_snapshots(root)] == ["20260102T030402Z", "20260102T030403Z"]
    assert unfinished.is_dir()


def test_snapshot_retention_never_prunes_the_snapshot_just_written(state_dir: Path) -> None:
    # A stamp older than those kept: given by hand, or the clock stepped back.
    root = state_dir.parent / "backups"
    newer = snap(state_dir, "20260101T000000Z", keep=1)
    older = snap(state_dir, "20250101T000000Z", keep=1)
    assert complete_snapshots(root) == [older]
    assert read_snapshot(older).databases  # whole, and valid
    assert not newer.exists()


def test_snapshots_taken_after_the_clock_stepped_back_are_the_newest_that_retention_keeps(state_dir: Path) -> None:
    # Two taken while the clock read two hours later than it does now (set back since: an NTP
    # step, or a VM's clock put right).
    root = state_dir.parent / "backups"
    ahead = datetime.now(timezone.utc) + timedelta(hours=2)
    before_the_step = [snap(state_dir, stamp_for(ahead + timedelta(seconds=s)), keep=2) for s in range(2)]
    after_the_step = snap(state_dir, None, keep=2)
    assert complete_snapshots(root) == [before_the_step[1], after_the_step]  # named after those before it
    last = snap(state_dir, None, keep=2)
    assert complete_snapshots(root) == [after_the_step, last]  # the two taken last are those kept
    taken_at = datetime.fromisoformat(json.loads((last / "manifest.json").read_bytes())["created_at"])
    assert taken_at < ahead  # its manifest says when it was taken, by the clock


# A snapshot writer ended where a kill -9 would end it: its copies made, its manifest not yet.
KILLED_MIDWAY = """
import os, sys
from pathlib import Path
import persistence.snapshot as snapshot
snapshot.write_new_file = lambda *args, **kwargs: os._exit(137)
snapshot.create_snapshot(Path(sys.argv[1]), Path(sys.argv[2]), keep=7, app_version="1", stamp=sys.argv[3])
"""


def test_what_a_snapshot_killed_midway_left_is_removed_by_the_next_one(state_dir: Path) -> None:
    root = state_dir.parent / "backups"
    killed = subprocess.run([sys.executable, "-c", KILLED_MIDWAY, state_dir, root, "20260101T000000Z"], check=False)
    assert killed.returncode == 137
    left = sorted(os.listdir(root))
    assert left[0].startswith(".incomplete-20260101T000000Z.") and left[1:] == [".snapshot-20260101T000000Z.lock"]
    assert "runtime.db" in os.listdir(root / left[0])  # a copy of the conversations, left behind
    # Another writer, alive, is in the middle of its own: what it has is left alone.
    busy = root / ".incomplete-20260101T000001Z.abcd1234"
    busy.mkdir()
    fd = os.open(root / ".snapshot-20260101T000001Z.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        snapshot = snap(state_dir, "20260101T000002Z")
        assert sorted(os.listdir(root)) == [busy.name, OWNER_NAME, ".snapshot-20260101T000001Z.lock", snapshot.name]
    finally:
        os.close(fd)


def test_snapshot_refuses_a_database_that_fails_its_integrity_check(state_dir: Path) -> None:
    make_damaged_db(state_dir / "broken.db")
    found = r"broken\.db is damaged \(SQLite's integrity check of it found: row 1 missing from index"
    with pytest.raises(SnapshotError, match=found) as refused:
        snap(state_dir)
    assert "so no snapshot of it was written. Restore a good snapshot" in str(refused.value)
    assert os.listdir(state_dir.parent / "backups") == []


def test_snapshot_refuses_a_schema_this_build_cannot_use(state_dir: Path) -> None:
    make_db(state_dir / "future.db", SchemaIdentity("keel.tasks", 7), "future")
    with pytest.raises(SnapshotError, match="has schema keel.tasks@7, which this build cannot use"):
        snap(state_dir)


def test_snapshot_refuses_a_missing_or_empty_state_dir(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="does not exist"):
        snap(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SnapshotError, match="holds no databases"):
        snap(tmp_path / "empty")


def test_snapshot_refuses_a_backup_root_inside_the_state_dir(state_dir: Path) -> None:
    with pytest.raises(SnapshotError, match="is inside the state directory"):
        create_snapshot(state_dir, state_dir / "backups", keep=1, app_version="1", stamp=STAMP)
    assert not (state_dir / "backups").exists()


def test_snapshot_runs_recovery_first_and_refuses_unaccountable_state(state_dir: Path) -> None:
    (state_dir / ".restore-journal.json").write_text('{"phase":"prepared"}')
    incomplete = r"^Restore journal is incomplete or has unsupported fields\. Missing: .*\. Recovery left .* as it was\."
    with pytest.raises(RecoveryError, match=incomplete):
        snap(state_dir)
    assert not (state_dir.parent / "backups").exists()


@pytest.mark.parametrize("stamp", ["../escape", "20301399T000000Z", "20260230T120000Z", "20260131T246000Z"])
def test_snapshot_refuses_a_malformed_timestamp(state_dir: Path, stamp: str) -> None:
    with pytest.raises(SnapshotError, match="must be a UTC time written like 20260131T235959Z"):
        snap(state_dir, stamp)


def test_a_snapshot_holds_every_database_as_it_was_at_one_moment(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A server writes to both databases while a snapshot copies them, one after the other. A write
    # committed after the snapshot began is in none of its copies: a task restored as completed
    # must not be missing its answer from the conversation copied before it.
    server = {name: sqlite3.connect(state_dir / name, isolation_level=None) for name in ("runtime.db", "tasks.db")}
    copy = snapshot_module._copy_database

    def a_write_while_copying(*args: Any, **kwargs: Any) -> Any:
        copied = copy(*args, **kwargs)
        if Path(args[0]).name == "runtime.db":
            server["tasks.db"].execute("INSERT INTO items (label) VALUES ('written-while-copying')")
        return copied

    monkeypatch.setattr(snapshot_module, "_copy_database", a_write_while_copying)
    try:
        for conn in server.values():
            conn.execute("PRAGMA journal_mode=WAL")  # as the server keeps them, open throughout
        snapshot = snap(state_dir)
    finally:
        for conn in server.values():
            conn.close()

    assert labels(state_dir / "tasks.db")[-1] == "written-while-copying"
    assert labels(snapshot / "tasks.db") == ["live-0", "live-1", "live-2"]


def test_a_snapshot_taken_as_a_server_starts_holds_every_database_as_it_was_at_one_moment(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server holds the state directory before it opens its databases. A snapshot that began
    # then, finding no -wal beside them, read them as files no one would change: the server's
    # first writes, checkpointed into tasks.db after runtime.db was copied, were in its copy.
    for name in ("runtime.db", "tasks.db"):
        in_wal_mode(state_dir / name)  # as a stopped server leaves them: no -wal, no -shm
    copy = snapshot_module._copy_database

    def the_server_writes_meanwhile(*args: Any, **kwargs: Any) -> Any:
        copied = copy(*args, **kwargs)
        if Path(args[0]).name == "runtime.db":
            server = sqlite3.connect(state_dir / "tasks.db", isolation_level=None)
            try:
                server.execute("INSERT INTO items (label) VALUES ('written-after-the-snapshot-began')")
                server.execute("PRAGMA wal_checkpoint(PASSIVE)")  # what a growing WAL has it do
            finally:
                server.close()
        return copied

    monkeypatch.setattr(snapshot_module, "_copy_database", the_server_writes_meanwhile)
    with hold_state_dir(state_dir):  # the server's first steps: it opens its databases next
        snapshot = snap(state_dir)

    assert labels(state_dir / "tasks.db")[-1] == "written-after-the-snapshot-began"
    assert labels(snapshot / "tasks.db") == ["live-0", "live-1", "live-2"]
