"""What another build of Keel left on disk: a restore journal or a snapshot of a newer format is
refused saying which build can finish it, and nothing is changed; a migration of an older
database killed midway leaves it as the older build wrote it."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

import pytest
import trio

from persistence.journal import JOURNAL_NAME
from persistence.recovery import check_recoverable, recover
from persistence.restore import restore_snapshot
from persistence.schema import SchemaIdentity, read_identity
from persistence.snapshot import create_snapshot
from persistence.sqlite import inspect
from persistence.statedir import RecoveryError, SnapshotError, decode_document, encode_document
from persistence.tasks import TASKS_SCHEMA, open_task_store
from tests.persistence.older_builds import make_older, store_task
from tests.persistence.state_helpers import fingerprint
from tests.persistence.test_recovery import edited


def test_a_journal_a_newer_build_wrote_says_to_finish_with_that_build_and_not_to_empty_the_directory(tmp_path: Path) -> None:
    journal = tmp_path / JOURNAL_NAME
    # A newer format, with a field this build has never heard of.
    journal.write_bytes(encode_document(edited(format_version=2, checkpoint="after-quarantine")))
    before = fingerprint(tmp_path)
    for attempt in (recover, check_recoverable):
        with pytest.raises(RecoveryError) as caught:
            attempt(tmp_path)
        said = str(caught.value)
        assert "format 2" in said and "newer Keel build" in said and str(tmp_path) in said, said
        assert "state reset" not in said, said  # the build that wrote it can finish it: nothing is lost
    assert fingerprint(tmp_path) == before


def test_a_journal_with_fields_this_build_does_not_know_names_them(tmp_path: Path) -> None:
    document = {key: value for key, value in edited(published=True).items() if key != "quarantine_dir"}
    (tmp_path / JOURNAL_NAME).write_bytes(encode_document(document))
    with pytest.raises(RecoveryError) as caught:
        recover(tmp_path)
    assert "Unknown: published" in str(caught.value) and "Missing: quarantine_dir" in str(caught.value)


def test_a_snapshot_of_a_newer_format_says_which_build_restores_it(tmp_path: Path) -> None:
    source = tmp_path / "source"
    make_older(source / "tasks.db", "keel.tasks", 2)
    snapshot = create_snapshot(source, tmp_path / "backups", keep=3, app_version="test", stamp="20260102T030405Z")
    manifest = {**decode_document((snapshot / "manifest.json").read_bytes()), "format_version": 2, "encryption": None}
    manifest_bytes = encode_document(manifest)
    (snapshot / "manifest.json").write_bytes(manifest_bytes)
    marker = {"format_version": 2, "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
    (snapshot / ".complete").write_bytes(encode_document(marker))
    state_dir = tmp_path / "state"
    make_older(state_dir / "tasks.db", "keel.tasks", 1)
    before = fingerprint(state_dir)
    with pytest.raises(SnapshotError) as caught:
        restore_snapshot(snapshot, state_dir)
    said = str(caught.value)
    assert "format 2" in said and "newer Keel build" in said and str(snapshot) in said, said
    assert fingerprint(state_dir) == before


# Opens a database of an older schema with this build (argv: its path, and the schema as
# module:name), killed (SIGKILL) inside its migration, after the last step's DDL has run but before
# its transaction commits.
MIGRATION_KILLED = """
import importlib, os, signal, sys, trio
from pathlib import Path
from persistence.sqlite import SqlitePool

module, name = sys.argv[2].split(":")
schema = getattr(importlib.import_module(module), name)
*steps, last = schema.migrations

def killed(conn):
    last(conn)
    os.kill(os.getpid(), signal.SIGKILL)

trio.run(SqlitePool.open, Path(sys.argv[1]), type(schema)(schema.name, (*steps, killed)))
"""


async def kill_in_last_migration(path: Path, schema: str) -> None:
    """Open ``path`` with this build in a child process killed in its last migration's transaction."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with trio.fail_after(30):
        child = await trio.run_process([sys.executable, "-c", MIGRATION_KILLED, str(path), schema], env=env, check=False)
    assert child.returncode == -signal.SIGKILL


async def test_a_migration_killed_midway_leaves_the_older_schema_whole_and_the_next_open_finishes_it(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    make_older(path, "keel.tasks", 1)
    store_task(path, "old", "c", "TASK_STATE_COMPLETED", "{}")
    await kill_in_last_migration(path, "persistence.tasks:TASKS_SCHEMA")
    with closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as conn:
        assert read_identity(conn) == SchemaIdentity("keel.tasks", 1)
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'task_counts'").fetchall() == []
    inspect(path, TASKS_SCHEMA)  # what check and serve's preflight read
    async with open_task_store(path) as store:
        assert (await store.list("anonymous", state="TASK_STATE_COMPLETED")).total_size == 1
    with closing(sqlite3.connect(path)) as conn:
        assert read_identity(conn) == SchemaIdentity("keel.tasks", TASKS_SCHEMA.version)


async def test_an_older_tasks_db_without_an_index_it_had_is_brought_up_to_date(tmp_path: Path) -> None:
    # Indexes are not the schema's to refuse (an operator may drop one, or add one): check and
    # serve's preflight accept such a file, so its migration must not fail on it either.
    path = tmp_path / "tasks.db"
    make_older(path, "keel.tasks", 2)
    store_task(path, "old", "c", "TASK_STATE_COMPLETED", "{}")
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("DROP INDEX tasks_context")
        conn.execute("DROP INDEX tasks_state")
    inspect(path, TASKS_SCHEMA)
    async with open_task_store(path) as store:
        assert (await store.list("anonymous", context_id="c")).total_size == 1
    with closing(sqlite3.connect(path)) as conn:
        assert read_identity(conn) == SchemaIdentity("keel.tasks", TASKS_SCHEMA.version)
