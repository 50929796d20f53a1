"""What `check`, `serve`, `state snapshot` and `state restore` make of a database whose tables are
not those of its schema's version, each a real process on real files: what one takes, none of the
others refuses, and what serve refuses, the others refuse in its words."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest

from fake_model import FakeModel
from persistence.manifest import FORMAT_VERSION, MANIFEST_NAME, MARKER_NAME, DatabaseEntry, Manifest, inspect_database
from persistence.schema import SchemaIdentity, read_identity
from persistence.sessions import SESSIONS_SCHEMA
from persistence.statedir import encode_document, file_evidence
from persistence.tasks import TASKS_SCHEMA
from tests.e2e.harness import keel_process, run_serve_to_exit, run_to_exit
from tests.e2e.test_upgrades import check
from tests.persistence.state_helpers import fingerprint, labels, live_databases, make_db

STAMP = "20260102T030405Z"
TASKS_NOW = f"keel.tasks@{TASKS_SCHEMA.version}"
BY_HAND = "(made by another program, or by hand)"


async def keel(*args: str) -> subprocess.CompletedProcess[str]:
    return await run_to_exit([sys.executable, "-m", "runtime", *args])


def execute(path: Path, sql: str) -> None:
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(sql)


def identity(path: Path) -> SchemaIdentity | None:
    with closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as conn:
        return read_identity(conn)


def as_served(directory: Path, label: str) -> None:
    """runtime.db and tasks.db with the tables of this build's schemas, and rows saying which they are."""
    make_db(directory / "runtime.db", SchemaIdentity(SESSIONS_SCHEMA.name, SESSIONS_SCHEMA.version), label)
    make_db(directory / "tasks.db", SchemaIdentity(TASKS_SCHEMA.name, TASKS_SCHEMA.version), label)


def column_added(directory: Path) -> None:
    execute(directory / "tasks.db", "ALTER TABLE tasks ADD COLUMN priority INTEGER")


def table_missing(directory: Path) -> None:
    execute(directory / "runtime.db", "DROP TABLE steer_receipts")


def files_swapped(directory: Path) -> None:
    shutil.copyfile(directory / "tasks.db", directory / "runtime.db")


def index_in_the_way(directory: Path) -> None:
    """An older tasks.db, which serve brings up to date, holding an index by a name its upgrade makes."""
    (directory / "tasks.db").unlink()
    make_db(directory / "tasks.db", SchemaIdentity(TASKS_SCHEMA.name, 2), "older")
    execute(directory / "tasks.db", "CREATE INDEX tasks_unfinished ON tasks (owner)")


Fault = Callable[[Path], None]
FAULTS = pytest.mark.parametrize(
    ("fault", "name", "words"),
    [
        pytest.param(
            column_added, "tasks.db", f"has column tasks.priority, which {TASKS_NOW} does not have", id="column-added"
        ),
        pytest.param(
            table_missing, "runtime.db", "has an incomplete keel.sessions schema (missing table steer_receipts)",
            id="table-missing",
        ),
        pytest.param(files_swapped, "runtime.db", "is a keel.tasks database, not keel.sessions", id="files-swapped"),
        pytest.param(
            index_in_the_way, "tasks.db", f"holds index tasks_unfinished {BY_HAND}, which {TASKS_NOW} makes",
            id="index-in-the-way",
        ),
    ],
)


def published_by_an_earlier_build(source: Path, snapshot: Path) -> Path:
    """A snapshot of ``source``'s databases as a build that did not check their tables published it."""
    snapshot.mkdir(parents=True)
    entries = []
    for path in sorted(source.glob("*.db")):
        shutil.copyfile(path, snapshot / path.name)
        evidence = file_evidence(snapshot / path.name)
        schema = inspect_database(snapshot / path.name)
        entries.append(DatabaseEntry(path.name, evidence.sha256, evidence.size_bytes, schema))
    manifest = encode_document(Manifest("2026-01-02T03:04:05.000Z", "keel", "earlier", tuple(entries)).to_json())
    (snapshot / MANIFEST_NAME).write_bytes(manifest)
    marker = {"format_version": FORMAT_VERSION, "manifest_sha256": hashlib.sha256(manifest).hexdigest()}
    (snapshot / MARKER_NAME).write_bytes(encode_document(marker))
    return snapshot


@FAULTS
async def test_state_restore_refuses_a_snapshot_holding_a_database_serve_refuses_and_changes_nothing(
    tmp_path: Path, fake_model: FakeModel, fault: Fault, name: str, words: str
) -> None:
    state, source = tmp_path / "state", tmp_path / "source"
    live_databases(state)
    as_served(source, "snapshotted")
    fault(source)
    snapshot = published_by_an_earlier_build(source, tmp_path / "backups" / STAMP)
    before = fingerprint(state)

    restored = await keel("state", "restore", str(snapshot), "--state-dir", str(state))

    assert restored.returncode == 1, restored.stdout
    assert f"error: Snapshot database {snapshot / name} {words}" in restored.stderr, restored.stderr
    assert f"nothing in {state} was changed: restore another snapshot" in restored.stderr
    assert fingerprint(state) == before
    assert labels(state / "tasks.db") == ["live-0", "live-1", "live-2"]
    # What it would have served from: refused by serve, in the same words.
    served = await run_serve_to_exit(source, fake_model.base_url)
    assert served.returncode == 1 and f"error: {source / name}: {words}" in served.stderr, served.stderr


@FAULTS
async def test_state_snapshot_refuses_a_database_serve_refuses_publishing_nothing_and_check_says_the_same(
    tmp_path: Path, fault: Fault, name: str, words: str
) -> None:
    state, backups = tmp_path / "state", tmp_path / "backups"
    as_served(state, "live")
    fault(state)
    before = fingerprint(state)

    taken = await keel("state", "snapshot", "--state-dir", str(state), "--backup-root", str(backups), "--timestamp", STAMP)

    assert taken.returncode == 1, taken.stdout
    assert f"error: {state / name} cannot be snapshotted as it is: it {words}" in taken.stderr, taken.stderr
    assert "no snapshot was written" in taken.stderr and "Traceback" not in taken.stderr
    assert os.listdir(backups) == []  # no snapshot, no staging, no claim on the root
    assert fingerprint(state) == before
    checked = await check(state)
    assert checked.returncode == 1 and f"{state / name}: {words}" in checked.stderr, checked.stderr


@pytest.mark.parametrize(
    ("made", "named", "fix"),
    [
        ("CREATE INDEX tasks_unfinished ON tasks (owner)", "index tasks_unfinished", "DROP INDEX tasks_unfinished"),
        # SQLite's names ignore case: this one is in the way all the same.
        ("CREATE INDEX Tasks_Unfinished ON tasks (owner)", "index Tasks_Unfinished", "DROP INDEX Tasks_Unfinished"),
        ("CREATE TABLE task_counts (n INTEGER)", "table task_counts", "ALTER TABLE task_counts RENAME TO"),
        ("CREATE TRIGGER task_counted AFTER DELETE ON tasks BEGIN SELECT 1; END", "trigger task_counted", "DROP TRIGGER"),
    ],
)
async def test_check_refuses_an_older_database_holding_a_name_its_upgrade_makes_saying_which_and_what_to_do(
    tmp_path: Path, made: str, named: str, fix: str
) -> None:
    state = tmp_path / "state"
    make_db(state / "tasks.db", SchemaIdentity(TASKS_SCHEMA.name, 2), "older")
    execute(state / "tasks.db", made)

    checked = await check(state)

    assert checked.returncode == 1, checked.stdout
    assert f"{state / 'tasks.db'}: holds {named} {BY_HAND}, which {TASKS_NOW} makes for its own" in checked.stderr, checked.stderr
    assert f"Give it another name ({fix}" in checked.stderr


async def test_serve_refuses_an_older_database_holding_an_index_its_upgrade_makes_and_brings_nothing_up_to_date(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    make_db(state / "runtime.db", SchemaIdentity(SESSIONS_SCHEMA.name, 3), "older")
    make_db(state / "tasks.db", SchemaIdentity(TASKS_SCHEMA.name, 2), "older")
    execute(state / "tasks.db", "CREATE INDEX tasks_unfinished ON tasks (owner)")

    refused = await run_serve_to_exit(state, fake_model.base_url)

    assert refused.returncode == 1
    refusal = f"error: {state / 'tasks.db'}: holds index tasks_unfinished {BY_HAND}, which {TASKS_NOW} makes for its own"
    assert refusal in refused.stderr, refused.stderr
    assert "OperationalError" not in refused.stderr and "DROP INDEX tasks_unfinished" in refused.stderr
    assert identity(state / "runtime.db") == SchemaIdentity(SESSIONS_SCHEMA.name, 3)  # refused before either is opened
    # Done as it says, the directory is checked and served.
    execute(state / "tasks.db", "DROP INDEX tasks_unfinished")
    execute(state / "tasks.db", "CREATE INDEX my_unfinished ON tasks (owner)")
    assert (await check(state)).returncode == 0
    async with keel_process(state, fake_model.base_url) as served:
        assert await served.terminate() == 0
    assert identity(state / "tasks.db") == SchemaIdentity(TASKS_SCHEMA.name, TASKS_SCHEMA.version)


async def test_another_programs_table_and_index_beside_keels_are_checked_snapshotted_restored_and_served(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state, restored = tmp_path / "state", tmp_path / "restored"
    make_db(state / "runtime.db", SchemaIdentity(SESSIONS_SCHEMA.name, 3), "older")
    make_db(state / "tasks.db", SchemaIdentity(TASKS_SCHEMA.name, 2), "older")
    execute(state / "tasks.db", "CREATE INDEX ops_by_context ON tasks (context_id, state)")
    execute(state / "tasks.db", "CREATE TABLE _litestream_seq (id INTEGER PRIMARY KEY, seq INTEGER)")
    assert (await check(state)).returncode == 0

    taken = await keel("state", "snapshot", "--state-dir", str(state), "--backup-root", str(tmp_path / "backups"))
    assert taken.returncode == 0, taken.stderr
    put_back = await keel("state", "restore", taken.stdout.strip(), "--state-dir", str(restored))
    assert put_back.returncode == 0, put_back.stderr

    checked = await check(restored)
    assert checked.returncode == 0 and f"tasks.db holds keel.tasks@2; serve brings it up to {TASKS_NOW}" in checked.stdout
    async with keel_process(restored, fake_model.base_url) as served:
        assert await served.terminate() == 0
    assert labels(restored / "tasks.db") == ["older-0", "older-1", "older-2"]
