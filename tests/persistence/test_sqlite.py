"""The SQLite pool, the group-commit writer, schemas, and what survives a SIGKILL."""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
from contextlib import closing
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from persistence.errors import (
    DatabaseBusy, DatabaseDamaged, DatabaseFailed, SchemaError, StoreClosed, TranscriptConflict, UnreadableSession,
)
from persistence.schema import SchemaIdentity, read_identity, write_identity_txn
from persistence.session import Session
from persistence.sessions import SESSIONS_SCHEMA, SqliteSessionStore, open_session_store
from persistence.sqlite import Schema, SqlitePool, connect, inspect, log_size, transaction
from persistence.writer import GroupCommitWriter
from persistence.tasks import TASKS_SCHEMA, open_task_store
from persistence.transcript import Message

from runtime.runner import ANONYMOUS
from tests.e2e.test_damaged_databases import flip, left_to_run, page_holding
from tests.persistence import crash_writer
from tests.persistence.state_helpers import another_users, small_disk


def pragma(path: Path, name: str) -> object:
    with sqlite3.connect(path) as conn:
        return conn.execute(f"PRAGMA {name}").fetchone()[0]


async def sqlite_steps(pool: SqlitePool, call: Callable[[], Awaitable[object]]) -> int:
    """How many steps of SQLite's virtual machine (in tens) the pool's connection takes while
    ``call`` runs: a count of the work a call does that does not depend on the machine's speed."""
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return 0  # go on

    await pool.run(lambda conn: conn.set_progress_handler(count, 10))
    try:
        await call()
    finally:
        await pool.run(lambda conn: conn.set_progress_handler(None, 10))
    return counted[0]


async def test_sqlite_pool_uses_wal_full_sync_foreign_keys_and_a_busy_timeout(tmp_path: Path) -> None:
    async with open_session_store(tmp_path / "runtime.db") as store:
        settings = await store.pool.run(
            lambda conn: [conn.execute(f"PRAGMA {name}").fetchone()[0] for name in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")]
        )
    assert settings == ["wal", 2, 1, 5000]  # synchronous 2 = FULL


async def test_a_database_and_the_files_sqlite_makes_beside_it_are_their_owners_alone(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a usual umask: what it lets through, Keel's files must not
    try:
        async with open_session_store(tmp_path / "runtime.db") as store:
            await store.save("s", [Message(role="user", text="what the conversation said")])
            for name in ("runtime.db", "runtime.db-wal", "runtime.db-shm"):
                assert os.stat(tmp_path / name).st_mode & 0o777 == 0o600, name
            # As a build that did not keep them private left them: each is narrowed when opened.
            for name in ("runtime.db", "runtime.db-wal"):
                os.chmod(tmp_path / name, 0o644)
            async with open_session_store(tmp_path / "runtime.db") as again:
                assert await again.length("s") == 1
                for name in ("runtime.db", "runtime.db-wal", "runtime.db-shm"):
                    assert os.stat(tmp_path / name).st_mode & 0o777 == 0o600, name
    finally:
        os.umask(old)


async def test_a_database_made_by_root_in_another_users_directory_is_that_users(tmp_path: Path) -> None:
    # serve started once as root (`sudo`) in the directory of a server that runs as its own user.
    owner = another_users(tmp_path)
    async with open_session_store(tmp_path / "runtime.db") as store:
        await store.save("s", [Message(role="user", text="what the conversation said")])
        owners = {name: (os.stat(tmp_path / name).st_uid, os.stat(tmp_path / name).st_gid) for name in os.listdir(tmp_path)}
    assert set(owners) == {"runtime.db", "runtime.db-wal", "runtime.db-shm"}
    assert set(owners.values()) == {owner}, owners


def test_a_transaction_commits_its_writes_and_rolls_back_on_error_and_never_nests(tmp_path: Path) -> None:
    conn = connect(tmp_path / "t.db")
    conn.execute("CREATE TABLE t (v INTEGER)")
    transaction(conn, lambda c: c.execute("INSERT INTO t VALUES (1)"))
    with pytest.raises(ZeroDivisionError):
        transaction(conn, lambda c: (c.execute("INSERT INTO t VALUES (2)"), 1 / 0))
    assert not conn.in_transaction
    conn.execute("BEGIN")
    conn.execute("INSERT INTO t VALUES (3)")
    with pytest.raises(RuntimeError, match="already open"):  # not committed behind the caller's back
        transaction(conn, lambda c: None)
    conn.rollback()
    conn.close()
    check = sqlite3.connect(tmp_path / "t.db")
    assert check.execute("SELECT v FROM t").fetchall() == [(1,)]
    check.close()


async def test_what_the_writer_knows_of_a_session_is_dropped_when_another_connection_writes(tmp_path: Path) -> None:
    from persistence.errors import TranscriptConflict

    question, answer = Message(role="user", text="Which region?"), Message(role="assistant", text="eu-west-1.")
    async with open_session_store(tmp_path / "runtime.db") as here, open_session_store(tmp_path / "runtime.db") as there:
        assert await here.save_and_take_steers("s", [question, answer]) == []  # now known: 2 events, no steers
        await there.save("s", [question, answer, Message(role="user", text="And the rollback?")])
        await there.add_steer("s", "check the canary first")
        # Had ``here`` trusted what it knew, its answer would still be the last event stored.
        with pytest.raises(TranscriptConflict, match="message 2 differs"):
            await here.save_and_take_steers("s", [question, answer, answer, Message(role="user", text="Then?")])
        assert await here.take_steers("s") == ["check the canary first"]
        assert [m.text for m in await here.messages("s")] == ["Which region?", "eu-west-1.", "And the rollback?"]
        # Nor does a read trust what it knew once another connection has written since.
        await there.save("s", [question, answer, Message(role="user", text="And the rollback?"), answer])
        assert [m.text for m in await here.messages("s")] == ["Which region?", "eu-west-1.", "And the rollback?", "eu-west-1."]
        with closing(sqlite3.connect(tmp_path / "runtime.db")) as other, other:  # a message another program wrote again
            again = Message(role="assistant", text="us-east-2.").to_json()
            other.execute("UPDATE events SET content = ? WHERE session_id = 's' AND seq = 1", (again,))
        assert [m.text for m in await here.messages("s")] == ["Which region?", "us-east-2.", "And the rollback?", "eu-west-1."]


async def test_group_commit_puts_concurrent_appends_in_few_transactions(tmp_path: Path) -> None:
    async with open_session_store(tmp_path / "runtime.db") as store:
        before = store.batches
        async with trio.open_nursery() as nursery:
            for k in range(64):
                nursery.start_soon(store.append, f"s{k}", ['{"n":1}'])
        assert store.batches - before < 64 / 4, f"{store.batches - before} transactions for 64 appends"
        assert sum([await store.length(f"s{k}") for k in range(64)]) == 64


async def test_group_commit_a_failing_write_does_not_undo_the_rest_of_its_batch(tmp_path: Path) -> None:
    async with open_session_store(tmp_path / "runtime.db") as store:
        outcomes: dict[str, str] = {}

        async def append(session_id: str, at: int | None) -> None:
            try:
                await store.append(session_id, ['{"n":1}'], at=at)
                outcomes[session_id] = "ok"
            except Exception as exc:
                outcomes[session_id] = type(exc).__name__

        async with trio.open_nursery() as nursery:
            for k in range(10):
                nursery.start_soon(append, f"s{k}", 5 if k == 3 else None)
        assert outcomes.pop("s3") == "TranscriptConflict"
        assert set(outcomes.values()) == {"ok"}
        assert [await store.length(f"s{k}") for k in range(10)] == [1, 1, 1, 0, 1, 1, 1, 1, 1, 1]


async def test_group_commit_a_batch_failing_only_as_it_ends_is_run_again_carefully_and_loses_nothing(tmp_path: Path) -> None:
    # The session store defers a batch's event rows to one INSERT before COMMIT. Put a row where
    # the store believes s3 ends, behind its back (on its own connection, so nothing tells it):
    # the batch then fails only in that last INSERT. Run again write by write, after what the
    # store knew was dropped, every append lands, s3's after the row it did not know of.
    async with open_session_store(tmp_path / "runtime.db") as store:
        for k in range(10):
            await store.append(f"s{k}", ['{"n":0}'])

        def sneak(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO events (session_id, seq, author, created_at_ms, content) VALUES ('s3', 1, 'x', 0, '{}')")

        await store.pool.run(functools.partial(transaction, fn=sneak))
        positions: dict[str, int] = {}

        async def append(session_id: str) -> None:
            positions[session_id] = await store.append(session_id, ['{"n":1}'])

        before = store.batches
        async with trio.open_nursery() as nursery:
            for k in range(10):
                nursery.start_soon(append, f"s{k}")
        assert store.batches - before < 10, "the appends were not batched, so this tested nothing"
        assert positions == {f"s{k}": 2 if k == 3 else 1 for k in range(10)}
        assert [await store.length(f"s{k}") for k in range(10)] == [3 if k == 3 else 2 for k in range(10)]


@pytest.mark.parametrize("known", [False, True], ids=["new sessions", "sessions the writer knows"])
async def test_group_commit_an_insert_that_fails_fails_its_own_write_alone(tmp_path: Path, known: bool) -> None:
    # SQLite refuses s3's events (a trigger standing in for whatever makes one insert fail): the
    # batch fails as it ends, and run again write by write, only s3's append fails with it. Of
    # sessions the writer knows, the batch's events are one statement that commits itself.
    path = tmp_path / "runtime.db"
    async with open_session_store(path) as store:
        if known:
            for k in range(10):
                await store.append(f"s{k}", ['{"n":0}'])
        with closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute(
                "CREATE TRIGGER refuse_s3 BEFORE INSERT ON events WHEN NEW.session_id = 's3'"
                " BEGIN SELECT RAISE(ABORT, 'refused'); END"
            )
        before = store.batches
        outcomes = await in_one_batch(store.pool, *[functools.partial(store.append, f"s{k}", ['{"n":1}']) for k in range(10)])
        assert store.batches - before == 1
        assert type(outcomes.pop(3)).__name__ == "DatabaseFailed"
        assert outcomes == [int(known)] * 9
        assert [await store.length(f"s{k}") for k in range(10)] == [int(known) + (k != 3) for k in range(10)]


async def in_one_batch(pool: SqlitePool, *writes: Callable[[], Awaitable[object]]) -> list[object]:
    """Make ``writes`` while the pool's thread is held, each queued before the next is made, so
    that the writer takes them as one batch, in that order; what each returned or raised."""
    holding, release = threading.Event(), threading.Event()
    results: list[object] = [None] * len(writes)

    def hold(conn: sqlite3.Connection) -> None:
        holding.set()
        release.wait(10)

    async def make(k: int) -> None:
        try:
            results[k] = await writes[k]()
        except Exception as exc:
            results[k] = exc

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.run, hold)
            await trio.to_thread.run_sync(holding.wait)
            for k in range(len(writes)):
                nursery.start_soon(make, k)
                await trio.testing.wait_all_tasks_blocked()  # queued
            release.set()
    return results


async def statements_of(pool: SqlitePool, call: Callable[[], Awaitable[object]]) -> list[str]:
    """The statements the pool's connection runs while ``call`` runs (not those SQLite runs
    inside one of them)."""
    seen: list[str] = []
    await pool.run(lambda conn: conn.set_trace_callback(seen.append))
    try:
        await call()
    finally:
        await pool.run(lambda conn: conn.set_trace_callback(None))
    return [statement.split(" ", 2)[0] for statement in seen if not statement.startswith("--")]


async def test_a_batch_of_writes_to_sessions_the_writer_knows_is_one_statement_that_commits_itself(tmp_path: Path) -> None:
    # Each call into SQLite lets go of the GIL and takes it back, and under load each take waits
    # for the event loop: a transaction's BEGIN, its check, its INSERT and its COMMIT were four
    # such waits where one does.
    path = tmp_path / "runtime.db"
    question = Message(role="user", text="Which region?")
    async with open_session_store(path) as store:
        for k in range(10):
            await store.append(f"s{k}", ['{"n":0}'])
        await store.save_and_take_steers("conversation", [question])
        writes: list[Callable[[], Awaitable[object]]] = [
            functools.partial(store.append, f"s{k}", ['{"n":1}', '{"n":2}']) for k in range(10)
        ]
        writes.append(functools.partial(store.save_and_take_steers, "conversation", [question, Message(role="assistant", text="eu-west-1.")]))
        results: list[object] = []

        async def batch() -> None:
            results.extend(await in_one_batch(store.pool, *writes))

        assert await statements_of(store.pool, batch) == ["INSERT"]
        assert results == [1] * 10 + [[]]
    with closing(sqlite3.connect(path)) as conn:  # committed, and read so by another connection
        rows = conn.execute("SELECT session_id, seq, content FROM events WHERE seq > 0 ORDER BY session_id, seq").fetchall()
    assert rows[0] == ("conversation", 1, Message(role="assistant", text="eu-west-1.").to_json())
    assert rows[1:] == [(f"s{k}", n, f'{{"n":{n}}}') for k in range(10) for n in (1, 2)]


async def test_a_batch_with_more_events_than_one_statement_takes_is_one_transaction(tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    async with open_session_store(path) as store:
        await store.append("s", ['{"n":0}'])
        await store.append("t", ['{"n":0}'])
        writes = [
            functools.partial(store.append, "s", [f'{{"n":{n}}}' for n in range(1, 301)]),
            functools.partial(store.append, "t", ['{"n":1}']),
        ]
        results: list[object] = []

        async def batch() -> None:
            results.extend(await in_one_batch(store.pool, *writes))

        statements = await statements_of(store.pool, batch)
        assert [name for name, _ in itertools.groupby(statements)] == ["BEGIN", "PRAGMA", "INSERT", "COMMIT"]
        assert results == [1, 1]
        assert [await store.length(name) for name in ("s", "t")] == [301, 2]
        assert [event.content for event in await store.events("s", after=298)] == ['{"n":299}', '{"n":300}']


@pytest.mark.parametrize("found_by", ["its statement", "its first read"])
async def test_a_batch_run_on_what_the_writer_knew_runs_again_when_another_connection_has_written(
    tmp_path: Path, found_by: str
) -> None:
    # ``here`` knows s as one event long; ``there`` appends to it. Here's next batch runs on what
    # it knows, and finds out as its one statement is refused, or as a write of the batch that
    # must read (a new session's) begins the transaction: either way the batch runs again on
    # what is stored, and every append lands after the other connection's.
    path = tmp_path / "runtime.db"
    async with open_session_store(path) as here, open_session_store(path) as there:
        await here.append("s", ['"here 0"'])
        await here.append("t", ['"here 0"'])
        await there.append("s", ['"there 1"'])
        second = "t" if found_by == "its statement" else "new"
        writes = [functools.partial(here.append, "s", ['"here"']), functools.partial(here.append, second, ['"here"'])]
        writes.append(functools.partial(here.append, "s", ['"here again"']))
        before = here.batches
        results = await in_one_batch(here.pool, *writes)
        assert here.batches - before == 1
        assert results == [2, 1 if second == "t" else 0, 3]
        assert [event.content for event in await there.events("s")] == ['"here 0"', '"there 1"', '"here"', '"here again"']
        assert await there.length(second) == (2 if second == "t" else 1)


async def test_a_batchs_one_statement_waits_for_another_programs_write_lock_as_a_transaction_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The statement takes the write lock as it starts, as BEGIN IMMEDIATE does: it waits for
    # another program's lock up to the busy timeout, and past it its batch fails once (run again
    # write by write, each would have waited as long again).
    monkeypatch.setattr("persistence.sqlite.BUSY_TIMEOUT_MS", 300)
    path = tmp_path / "runtime.db"
    async with open_session_store(path) as store:
        await store.append("s", ['{"n":0}'])
        started = threading.Event()

        def traced(statement: str) -> None:
            if statement.startswith("INSERT"):
                started.set()

        await store.pool.run(lambda conn: conn.set_trace_callback(traced))
        with closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.append, "s", ['{"n":1}'])
                await trio.to_thread.run_sync(started.wait, 10)  # the statement waits on the lock...
                other.execute("COMMIT")  # ...which is let go: the append is made

            async def refused() -> None:
                with pytest.raises(DatabaseFailed, match="database is locked"):
                    await store.append("s", ['{"n":2}'])

            other.execute("BEGIN IMMEDIATE")
            try:
                assert await statements_of(store.pool, refused) == ["INSERT"]
            finally:
                other.execute("ROLLBACK")
        assert [event.content for event in await store.events("s")] == ['{"n":0}', '{"n":1}']


async def test_a_write_queued_behind_a_batch_that_found_its_file_gone_is_not_made(tmp_path: Path) -> None:
    # The file is checked once per batch: as the batch is taken, or, under load, right after the
    # batch before it commits. Here the file goes while that batch commits: the check made after
    # it finds it gone, and the write behind it is refused, not made into a file no one reads.
    path = tmp_path / "runtime.db"
    pool = await SqlitePool.open(path, SESSIONS_SCHEMA)
    writer = GroupCommitWriter(pool, max_batch=2)

    def write(conn: sqlite3.Connection, name: str, then: Callable[[], object] = lambda: None) -> None:
        conn.execute("INSERT INTO app_states VALUES (?, '{}', 0)", (name,))
        then()

    moved = tmp_path / "moved.db"
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            results = await in_one_batch(
                pool,
                functools.partial(writer.submit, write, "first", functools.partial(path.rename, moved)),
                functools.partial(writer.submit, write, "second"),
                functools.partial(writer.submit, write, "behind"),
            )
            assert results[:2] == [None, None]  # made while the file was being moved: as any check would miss it
            assert type(results[2]).__name__ == "DatabaseGone"
            moved.rename(path)
            await writer.submit(write, "later")
            await writer.aclose()
    finally:
        await pool.aclose()
    with closing(sqlite3.connect(path)) as conn:
        assert sorted(row[0] for row in conn.execute("SELECT app_name FROM app_states")) == ["first", "later", "second"]


async def test_group_commit_writer_must_be_started_before_use(tmp_path: Path) -> None:
    store = await SqliteSessionStore.open(tmp_path / "runtime.db")
    try:
        with pytest.raises(RuntimeError, match=r"nursery\.start\(store\.run\)"):
            await store.append("s", ["{}"])
    finally:
        await store.aclose()


async def test_group_commit_writes_queued_before_close_are_committed(tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    pool = await SqlitePool.open(path, SESSIONS_SCHEMA)
    writer = GroupCommitWriter(pool)
    done: list[int] = []

    async def write(n: int) -> None:
        await writer.submit(lambda conn: conn.execute("INSERT INTO app_states VALUES (?, '{}', 0)", (f"app{n}",)))
        done.append(n)

    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        for n in range(20):
            nursery.start_soon(write, n)
        await trio.testing.wait_all_tasks_blocked()
        await writer.aclose()
    await pool.aclose()
    assert sorted(done) == list(range(20))
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM app_states").fetchone()[0] == 20


async def test_a_write_that_raises_systemexit_fails_alone_and_the_writer_goes_on(tmp_path: Path) -> None:
    pool = await SqlitePool.open(tmp_path / "runtime.db", SESSIONS_SCHEMA)
    writer = GroupCommitWriter(pool)
    committing, release = threading.Event(), threading.Event()

    def holds(conn: sqlite3.Connection) -> None:  # keeps the pool's thread busy while the next batch fills
        committing.set()
        release.wait(10)

    def exits(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO app_states VALUES ('lost', '{}', 0)")
        raise SystemExit(3)

    def writes(conn: sqlite3.Connection, name: str) -> int:
        return conn.execute("INSERT INTO app_states VALUES (?, '{}', 0)", (name,)).rowcount

    results: dict[str, object] = {}

    async def submit(name: str, fn: Any, *args: Any) -> None:
        try:
            results[name] = await writer.submit(fn, *args)
        except BaseException as exc:  # SystemExit is what one of them should get
            results[name] = type(exc).__name__

    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        with trio.fail_after(10):
            nursery.start_soon(writer.submit, holds)
            await trio.to_thread.run_sync(committing.wait)
            nursery.start_soon(submit, "before", writes, "before")
            nursery.start_soon(submit, "exits", exits)
            nursery.start_soon(submit, "after", writes, "after")
            await trio.testing.wait_all_tasks_blocked()  # all three queued, in one batch
            release.set()
            while len(results) < 3:
                await trio.sleep(0.01)
            assert results == {"before": 1, "exits": "SystemExit", "after": 1}  # the others' writes are kept
            assert await writer.submit(writes, "later") == 1  # and the writer goes on
        await writer.aclose()
    await pool.aclose()
    with closing(sqlite3.connect(tmp_path / "runtime.db")) as conn:
        assert sorted(row[0] for row in conn.execute("SELECT app_name FROM app_states")) == ["after", "before", "later"]


async def test_a_damaged_file_is_the_first_to_log_once_whichever_thread_or_request_asks(tmp_path: Path) -> None:
    # Requests and runs meet the damage at once, in the pool's thread and in Trio's, and one
    # failure can reach several of them: exactly one of them logs it in full.
    path = tmp_path / "tasks.db"
    oldest = await left_to_run(path, 150)
    flip(path, page_holding(path, oldest, "tasks_state_recent"), 0, 12)
    pool = await SqlitePool.open(path, TASKS_SCHEMA)
    try:
        by_state = "SELECT count(*) FROM tasks INDEXED BY tasks_state_recent WHERE owner = 'anonymous'"
        with pytest.raises(DatabaseDamaged) as found:
            await pool.run(lambda conn: conn.execute(by_state).fetchall())
        assert isinstance(found.value.__cause__, sqlite3.DatabaseError)
        failures = [found.value, found.value]  # one failure, told to two requests
        for _ in range(6):  # and others, made in this thread
            failure = pool.failure(found.value.__cause__)
            assert isinstance(failure, DatabaseDamaged)
            failures.append(failure)
        together = threading.Barrier(len(failures))
        firsts: list[bool] = []

        def ask(failure: DatabaseDamaged) -> bool:
            together.wait(10)
            return failure.first()

        async def asks(failure: DatabaseDamaged) -> None:
            firsts.append(await trio.to_thread.run_sync(ask, failure))

        async with trio.open_nursery() as nursery:
            for failure in failures:
                nursery.start_soon(asks, failure)
        assert firsts.count(True) == 1, firsts
        with pytest.raises(DatabaseDamaged) as checked:  # readiness says it is damaged, and logs nothing
            await trio.to_thread.run_sync(pool.check_sound)
        assert not checked.value.first()
    finally:
        await pool.aclose()


async def test_a_write_that_meets_a_damaged_page_fails_alone_in_its_batch(tmp_path: Path) -> None:
    # SQLite fails every statement after one found a page damaged, to the end of its transaction,
    # its COMMIT too: a batch run as one would fail the sound writes queued with a damaged one.
    path = tmp_path / "tasks.db"
    oldest = await left_to_run(path, 150)
    with closing(sqlite3.connect(path)) as conn:
        by_age = [row[0] for row in conn.execute("SELECT id FROM tasks ORDER BY updated_at_ms")]
    newest, next_newest = by_age[-1], by_age[-2]
    damaged = page_holding(path, oldest, "tasks_state_recent")  # where a task's entry by state is
    assert damaged != page_holding(path, newest, "tasks_state_recent")
    flip(path, damaged, 0, 12)

    async with open_task_store(path) as tasks:
        committing, release = threading.Event(), threading.Event()

        def holds(conn: sqlite3.Connection) -> None:  # keeps the pool's thread busy while the next batch fills
            committing.set()
            release.wait(10)

        results: dict[str, object] = {}

        records = {task_id: await tasks.get(ANONYMOUS, task_id) for task_id in (newest, oldest, next_newest)}

        async def cancel(task_id: str) -> None:
            record = records[task_id]
            try:
                await tasks.update(
                    ANONYMOUS, task_id, state="TASK_STATE_CANCELED", task_json=record.task_json,
                    expected_version=record.version, updated_at_ms=2_000_000,
                )  # fmt: skip
                results[task_id] = "stored"
            except DatabaseDamaged:
                results[task_id] = "damaged"

        async with trio.open_nursery() as nursery:
            with trio.fail_after(10):
                nursery.start_soon(tasks.pool.run, holds)
                await trio.to_thread.run_sync(committing.wait)
                for task_id in (newest, oldest, next_newest):
                    nursery.start_soon(cancel, task_id)
                await trio.testing.wait_all_tasks_blocked()  # all three queued, in one batch
                release.set()
                while len(results) < 3:
                    await trio.sleep(0.01)
        assert results == {newest: "stored", oldest: "damaged", next_newest: "stored"}
        for task_id in (newest, next_newest):
            assert (await tasks.get(ANONYMOUS, task_id)).state == "TASK_STATE_CANCELED"


async def test_an_urgent_write_is_committed_next_ahead_of_the_writes_queued_before_it(tmp_path: Path) -> None:
    pool = await SqlitePool.open(tmp_path / "runtime.db", SESSIONS_SCHEMA)
    writer = GroupCommitWriter(pool)
    committing, release = threading.Event(), threading.Event()
    written: list[str] = []  # in the pool's thread, in the order the writes ran

    def write(conn: sqlite3.Connection, name: str) -> None:
        if name == "in flight":  # holds its batch's transaction open, as a slow commit does
            committing.set()
            release.wait(10)
        conn.execute("INSERT INTO app_states VALUES (?, '{}', 0)", (name,))
        written.append(name)

    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        nursery.start_soon(writer.submit, write, "in flight")
        await trio.to_thread.run_sync(committing.wait, 10)
        for n in range(3):
            nursery.start_soon(writer.submit, write, f"queued {n}")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(functools.partial(writer.submit, write, "urgent", urgent=True))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(writer.submit, write, "queued after")  # joins the queued, not the urgent
        await trio.testing.wait_all_tasks_blocked()
        before = writer.batches
        release.set()
        await writer.aclose()  # run() returns once the queued writes are committed
    await pool.aclose()
    assert written[:2] == ["in flight", "urgent"]
    assert sorted(written[2:5]) == ["queued 0", "queued 1", "queued 2"] and written[5:] == ["queued after"]
    assert writer.batches - before == 3  # the one in flight, the urgent one alone, then the rest


async def test_a_pools_calls_run_one_at_a_time_in_its_own_thread_in_the_order_made(tmp_path: Path) -> None:
    pool = await SqlitePool.open(tmp_path / "runtime.db", SESSIONS_SCHEMA)
    seen: list[tuple[int, str]] = []
    running = 0

    def call(_conn: sqlite3.Connection, n: int) -> int:
        nonlocal running
        running += 1
        assert running == 1, "two calls ran at once"
        seen.append((n, threading.current_thread().name))
        running -= 1
        return n * n

    results: dict[int, int] = {}

    async def one(n: int) -> None:
        results[n] = await pool.run(call, n)

    try:
        async with trio.open_nursery() as nursery:
            for n in range(50):
                nursery.start_soon(one, n)
                await trio.lowlevel.checkpoint()  # so that the calls are made in this order
    finally:
        await pool.aclose()
    assert results == {n: n * n for n in range(50)}
    assert [n for n, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"sqlite runtime.db"}
    assert threading.current_thread().name not in {name for _, name in seen}
    assert not [t for t in threading.enumerate() if t.name == "sqlite runtime.db"], "the pool's thread outlived aclose()"


async def test_a_pool_call_once_queued_finishes_and_the_cancellation_comes_after(tmp_path: Path) -> None:
    pool = await SqlitePool.open(tmp_path / "runtime.db", SESSIONS_SCHEMA)
    started, release = threading.Event(), threading.Event()

    def slow_insert(conn: sqlite3.Connection) -> None:
        started.set()
        release.wait(10)
        conn.execute("INSERT INTO app_states VALUES ('slow', '{}', 0)")

    try:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_started() -> None:
                    await trio.to_thread.run_sync(started.wait, 10)
                    scope.cancel()
                    with trio.CancelScope(shield=True):  # this task is in the cancelled scope too
                        await trio.testing.wait_all_tasks_blocked()
                    release.set()

                nursery.start_soon(cancel_when_started)
                await pool.run(slow_insert)  # returns: the call ran whole ...
                await trio.lowlevel.checkpoint()  # ... and the cancellation lands at the next checkpoint
                pytest.fail("the cancellation was lost")
        assert scope.cancelled_caught
        with trio.CancelScope() as scope:
            scope.cancel()
            await pool.run(lambda conn: conn.execute("INSERT INTO app_states VALUES ('never', '{}', 0)"))
        names = await pool.run(lambda conn: [r[0] for r in conn.execute("SELECT app_name FROM app_states")])
    finally:
        await pool.aclose()
    assert names == ["slow"]  # the queued call ran whole; the one cancelled before queueing never ran


async def test_a_bound_on_closing_a_pool_holds_while_a_call_is_stalled_and_the_thread_closes_later(
    tmp_path: Path,
) -> None:
    pool = await SqlitePool.open(tmp_path / "runtime.db", SESSIONS_SCHEMA)
    started, release = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []

    def stalled_write(conn: sqlite3.Connection) -> None:  # a disk that stopped answering
        threads.append(threading.current_thread())  # the pool's: it may have ended by the time the test looks
        started.set()
        release.wait(10)
        conn.execute("INSERT INTO app_states VALUES ('stalled', '{}', 0)")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.run, stalled_write)
        await trio.to_thread.run_sync(started.wait, 10)
        with trio.move_on_after(0.2, shield=True) as bound:  # as the server bounds each store's close
            await pool.aclose()
        assert bound.cancelled_caught, "aclose() waited past its bound for the stalled call"
        release.set()  # the disk answers: the call finishes, and the thread closes the file after it
    [thread] = threads
    await trio.to_thread.run_sync(thread.join, 10)
    assert not thread.is_alive()
    with closing(sqlite3.connect(tmp_path / "runtime.db")) as conn:
        assert conn.execute("SELECT app_name FROM app_states").fetchall() == [("stalled",)]


async def test_a_bound_on_closing_a_pool_that_never_ran_a_call_holds_while_its_close_is_stalled(tmp_path: Path) -> None:
    # An idle server's runtime.db: no request used it, so its pool has no thread yet. Closing the
    # last connection checkpoints the WAL into the file, as much disk work as any write.
    path = tmp_path / "runtime.db"
    started, release, closed = threading.Event(), threading.Event(), threading.Event()

    class StalledClose(sqlite3.Connection):
        def close(self) -> None:  # a disk that stopped answering
            started.set()
            release.wait(10)
            super().close()
            closed.set()

    pool = SqlitePool(path=path, conn=sqlite3.connect(path, factory=StalledClose, check_same_thread=False))
    start = trio.current_time()
    with trio.move_on_after(0.2, shield=True) as bound:  # as the server bounds each store's close
        await pool.aclose()
    assert bound.cancelled_caught and trio.current_time() - start < 2, "aclose() waited past its bound for the stalled close"
    assert started.is_set()
    release.set()  # the disk answers: the file is closed all the same
    assert await trio.to_thread.run_sync(closed.wait, 10)


async def test_a_pool_closed_in_a_scope_already_cancelled_still_closes_its_file(tmp_path: Path) -> None:
    # A shutdown whose bound ran out before this store's turn: the file must not be left open,
    # with the pool marked closed so that no later close does it either.
    path = tmp_path / "runtime.db"
    closed = threading.Event()

    class NotedClose(sqlite3.Connection):
        def close(self) -> None:
            super().close()
            closed.set()

    pool = SqlitePool(path=path, conn=sqlite3.connect(path, factory=NotedClose, check_same_thread=False))
    with trio.CancelScope() as scope:
        scope.cancel()
        await pool.aclose()
    await pool.aclose()  # closed already: returns at once
    assert await trio.to_thread.run_sync(closed.wait, 10), "the connection was never closed"


async def test_a_database_file_removed_under_its_store_takes_no_writes_until_it_is_put_back(tmp_path: Path) -> None:
    from persistence.errors import DatabaseGone

    path = tmp_path / "runtime.db"
    async with open_session_store(path) as store:
        await store.append("s", ['{"n":1}'])
        path.rename(tmp_path / "moved.db")  # as a state directory deleted or replaced under the server
        with pytest.raises(DatabaseGone, match=r"runtime\.db: the database file was removed or replaced"):
            await store.append("s", ['{"n":2}'])
        (tmp_path / "moved.db").rename(path)
        await store.append("s", ['{"n":3}'])
        assert [event.content for event in await store.events("s")] == ['{"n":1}', '{"n":3}']


async def test_a_log_removed_under_its_store_takes_no_writes(tmp_path: Path) -> None:
    from persistence.errors import DatabaseGone

    path = tmp_path / "runtime.db"
    async with open_session_store(path) as store:
        await store.append("s", ['{"n":1}'])
        (tmp_path / "runtime.db-wal").rename(tmp_path / "moved.db-wal")  # SQLite would go on writing to it
        for n in (2, 3):  # every write, not only the first after it went
            with pytest.raises(DatabaseGone, match=r"runtime\.db-wal: the database's write-ahead log was removed or replaced"):
                await store.append("s", [f'{{"n":{n}}}'])
    with closing(sqlite3.connect(path)) as conn:
        assert [row[0] for row in conn.execute("SELECT content FROM events")] == ['{"n":1}']


def held_on(*paths: Path) -> list[str]:
    """Which of ``paths`` this process holds ``O_PATH`` descriptors on (not SQLite's own, which
    read and write), as the kernel names them: one name per descriptor (Linux)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
            flags = Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0]
        except OSError:  # the listing's own descriptor, closed since
            continue
        if name in map(str, paths) and int(flags, 8) & os.O_PATH:
            names.append(name)
    return sorted(names)


async def test_a_store_checks_its_files_for_each_write_without_asking_for_their_attributes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stat of the -wal makes the next write to it stamp its times at fine grain (Linux 6.13
    # on): an inode update for every commit. The check reads the names of descriptors held on
    # the files instead, and finds a file moved away and put back all the same. (On Linux, as
    # the suite runs: the check other platforms make is the next test's.)
    path = tmp_path / "runtime.db"
    log = tmp_path / "runtime.db-wal"
    stats: list[str] = []
    real_stat = os.stat

    def stat(target: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        stats.append(os.fsdecode(target) if isinstance(target, (str, bytes, os.PathLike)) else f"fd {target}")
        return real_stat(target, *args, **kwargs)

    async with open_session_store(path) as store:
        assert held_on(path, log) == [str(path), str(log)]  # while the store is open
        monkeypatch.setattr(os, "stat", stat)
        for n in range(3):
            await store.append("s", [f'{{"n":{n}}}'])
        assert not [target for target in stats if target in (str(path), str(log))], stats
        log.rename(tmp_path / "moved.db-wal")
        with pytest.raises(DatabaseFailed, match=r"runtime\.db-wal: the database's write-ahead log was removed or replaced"):
            await store.append("s", ['{"n":3}'])
        (tmp_path / "moved.db-wal").rename(log)
        await store.append("s", ['{"n":4}'])
        monkeypatch.undo()
    assert held_on(path, log) == []  # released as the store closed
    with pytest.raises(StoreClosed):  # a probe after that says so, not that the files went
        store.pool.check_sound()
    with closing(sqlite3.connect(path)) as conn:
        assert [row[0] for row in conn.execute("SELECT content FROM events")] == [f'{{"n":{n}}}' for n in (0, 1, 2, 4)]


async def test_a_probe_whose_pool_closes_under_it_says_it_closed_not_that_the_files_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The readiness probe checks from a worker thread while a shutdown may be closing the stores:
    # the close releases the descriptors the check reads, and files opened next take their numbers.
    from persistence.sqlite import _Watch

    pool = await SqlitePool.open(tmp_path / "runtime.db", SESSIONS_SCHEMA)
    real_there = _Watch.there
    taken: list[int] = []

    def there(watch: _Watch) -> bool:
        if not taken:  # the first file checked: the pool closes, and other files take the numbers it freed
            trio.from_thread.run(pool.aclose)
            taken.extend(os.open(tmp_path / f"other-{n}", os.O_CREAT | os.O_RDONLY) for n in range(4))
        return real_there(watch)

    monkeypatch.setattr(_Watch, "there", there)
    try:
        with pytest.raises(StoreClosed, match=r"runtime\.db"):
            await trio.to_thread.run_sync(pool.check_sound)
    finally:
        for fd in taken:
            os.close(fd)
        await pool.aclose()


def log_size_of(path: Path) -> int:
    with closing(sqlite3.connect(path)) as conn:
        return log_size(conn)


async def test_a_new_databases_log_is_written_out_so_that_commits_do_not_grow_it(tmp_path: Path) -> None:
    # A commit that grows the -wal syncs its size too: twice the time of one written over
    # what is there. The pool writes the -wal out to the size a checkpoint starts it over at;
    # what is committed into it survives a crash (the files copied while the store is open, as
    # a SIGKILL leaves them), the zeros past it never read as frames.
    path = tmp_path / "runtime.db"
    log = tmp_path / "runtime.db-wal"
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    async with open_session_store(path) as store:
        written_out = log.stat().st_size
        assert written_out == log_size_of(path) > 4_000_000
        for n in range(200):
            await store.append("s", [f'{{"n":{n}}}'])
        assert log.stat().st_size == written_out
        for name in (path.name, log.name):
            (crashed / name).write_bytes((tmp_path / name).read_bytes())
    async with open_session_store(crashed / "runtime.db") as store:
        assert [event.content for event in await store.events("s")] == [f'{{"n":{n}}}' for n in range(200)]
    with closing(sqlite3.connect(crashed / "runtime.db")) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


async def test_a_disk_without_room_to_spare_is_not_filled_with_a_logs_zeros(tmp_path: Path) -> None:
    with small_disk(tmp_path / "small", "2m") as small:
        path = small / "runtime.db"
        async with open_session_store(path) as store:
            assert (small / "runtime.db-wal").stat().st_size < 100_000 < log_size_of(path)
            await store.append("s", ['{"n":0}'])
            assert [event.content for event in await store.events("s")] == ['{"n":0}']


async def test_zeros_a_disk_could_not_take_after_all_are_cut_off_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The room is read before writing, and another program may take it meanwhile: the disk
    # reads as roomy here, and fills midway. The -wal is cut back to where it was, and the
    # store writes into the room that leaves.
    real_fstatvfs = os.fstatvfs

    def roomy(fd: int) -> os.statvfs_result:
        found = real_fstatvfs(fd)
        return os.statvfs_result((*found[:4], 1 << 40, *found[5:]))  # f_bavail: a terabyte

    with small_disk(tmp_path / "small", "2m") as small:
        path = small / "runtime.db"
        monkeypatch.setattr(os, "fstatvfs", roomy)
        async with open_session_store(path) as store:
            monkeypatch.undo()
            assert (small / "runtime.db-wal").stat().st_size < 100_000
            await store.append("s", ['{"n":0}'])
            assert [event.content for event in await store.events("s")] == ['{"n":0}']


async def test_where_no_descriptor_is_named_a_store_compares_its_files_at_their_paths(tmp_path: Path) -> None:
    # The check other platforms make: the device and inode at each path, against those opened.
    from persistence.errors import DatabaseGone
    from persistence.sqlite import _Watch

    path = tmp_path / "runtime.db"
    log = tmp_path / "runtime.db-wal"
    async with open_session_store(path):
        pass  # made with its schema
    conn = connect(path)
    watched = tuple(
        _Watch(os.fspath(name), is_log, (found.st_dev, found.st_ino))
        for name, is_log, found in zip((path, log), (False, True), map(os.stat, (path, log)), strict=True)
    )
    pool = SqlitePool(path=path, conn=conn, watched=watched)

    def write(conn: sqlite3.Connection) -> None:
        with conn:
            conn.execute("INSERT INTO app_states VALUES ('a', '{}', 0)")

    async def check() -> None:
        await trio.to_thread.run_sync(pool.check_file)

    try:
        await pool.run(write)
        await check()
        path.rename(tmp_path / "moved.db")
        with pytest.raises(DatabaseGone, match=r"runtime\.db: the database file was removed or replaced"):
            await check()
        (tmp_path / "moved.db").rename(path)
        await check()
        log.unlink()
        with pytest.raises(DatabaseGone, match=r"runtime\.db-wal: the database's write-ahead log was removed or replaced"):
            await check()
    finally:
        await pool.aclose()


async def append_waiting(store: SqliteSessionStore) -> None:
    """An append that waits on another program's lock; what becomes of it is not this test's."""
    from persistence.errors import DatabaseFailed, StoreClosed

    try:
        await store.append("s", ['{"n":1}'])
    except (DatabaseFailed, StoreClosed):
        pass


async def test_a_bound_on_closing_a_store_holds_while_another_program_holds_its_database(tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    store = await SqliteSessionStore.open(path)
    with closing(sqlite3.connect(path, isolation_level=None)) as other:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            other.execute("BEGIN IMMEDIATE")  # another program's write transaction, held
            nursery.start_soon(append_waiting, store)  # waits on it (busy timeout)
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            with trio.move_on_after(0.2, shield=True) as bound:  # as the server bounds each store's close
                await store.aclose()
            assert bound.cancelled_caught and trio.current_time() - start < 2, "aclose() waited past its bound"
            other.execute("ROLLBACK")
            nursery.cancel_scope.cancel()


async def test_a_closed_pool_refuses_calls_and_fails_those_queued_behind_the_close(tmp_path: Path) -> None:
    from persistence.errors import StoreClosed

    pool = await SqlitePool.open(tmp_path / "runtime.db", SESSIONS_SCHEMA)
    outcomes: list[str] = []

    async def call() -> None:
        try:
            await pool.run(lambda conn: conn.execute("SELECT 1").fetchone())
            outcomes.append("ran")
        except StoreClosed as exc:
            assert "runtime.db" in str(exc)
            outcomes.append("closed")

    async with trio.open_nursery() as nursery:
        await pool.run(lambda conn: None)  # the thread is running
        for _ in range(5):
            nursery.start_soon(call)
        await trio.testing.wait_all_tasks_blocked()
        await pool.aclose()
    assert outcomes.count("ran") + outcomes.count("closed") == 5
    with pytest.raises(StoreClosed, match="runtime.db"):
        await pool.run(lambda conn: None)


async def test_a_cancelled_writer_never_acknowledges_a_write_it_did_not_make(tmp_path: Path) -> None:
    """Cancelling the writer's scope at every point of a busy moment: each write either returned
    (and its row is on disk) or raised StoreClosed (and it is not)."""
    from persistence.errors import StoreClosed

    path = tmp_path / "runtime.db"
    acknowledged: set[str] = set()
    refused: set[str] = set()
    for trial in range(30):
        pool = await SqlitePool.open(path, SESSIONS_SCHEMA)
        writer = GroupCommitWriter(pool)

        async def write(name: str, writer: GroupCommitWriter = writer) -> None:
            try:
                await writer.submit(lambda conn: conn.execute("INSERT INTO app_states VALUES (?, '{}', 0)", (name,)))
                acknowledged.add(name)
            except StoreClosed:
                refused.add(name)

        writer_scope = trio.CancelScope()

        async def run_writer(*, task_status: trio.TaskStatus[GroupCommitWriter], writer: GroupCommitWriter = writer, scope: trio.CancelScope = writer_scope) -> None:
            with scope:
                await writer.run(task_status=task_status)

        async with trio.open_nursery() as nursery:
            await nursery.start(run_writer)
            for n in range(8):
                nursery.start_soon(write, f"{trial}-{n}")
            for _ in range(trial % 6):
                await trio.lowlevel.checkpoint()
            writer_scope.cancel()
        await pool.aclose()
    with sqlite3.connect(path) as conn:
        on_disk = {row[0] for row in conn.execute("SELECT app_name FROM app_states")}
    assert acknowledged <= on_disk, f"acknowledged but never written: {sorted(acknowledged - on_disk)}"
    assert not (refused & on_disk)
    assert acknowledged | refused == {f"{t}-{n}" for t in range(30) for n in range(8)}


async def test_a_writer_whose_pool_was_closed_fails_its_writes_and_never_hangs(tmp_path: Path) -> None:
    from persistence.errors import StoreClosed

    pool = await SqlitePool.open(tmp_path / "runtime.db", SESSIONS_SCHEMA)
    writer = GroupCommitWriter(pool)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        await writer.submit(lambda conn: conn.execute("INSERT INTO app_states VALUES ('before', '{}', 0)"))
        await pool.aclose()  # under the writer, which still takes writes
        with trio.fail_after(10):
            for _ in range(2):  # the second write finds the writer idle again, not stuck
                with pytest.raises(StoreClosed, match="runtime.db"):
                    await writer.submit(lambda conn: conn.execute("INSERT INTO app_states VALUES ('after', '{}', 0)"))
        await writer.aclose()
    with sqlite3.connect(tmp_path / "runtime.db") as conn:
        assert [row[0] for row in conn.execute("SELECT app_name FROM app_states")] == ["before"]


async def test_the_writers_cache_of_session_lengths_stays_bounded(tmp_path: Path) -> None:
    async with open_session_store(tmp_path / "runtime.db") as store:
        store._lengths.max_known = 20
        for k in range(100):
            await store.append(f"s{k}", ['{"n":1}'])
            assert len(store._lengths.known) <= 21
        await store.append("s3", ['{"n":2}'])  # forgotten, so read again from the table
        assert [e.seq for e in await store.events("s3")] == [0, 1]


async def test_the_writers_cache_of_saved_messages_stays_bounded_in_characters(tmp_path: Path) -> None:
    # It keeps the messages each session's saves were given, to check that a save extends them
    # without reading them back.
    async with open_session_store(tmp_path / "runtime.db") as store:
        store._lengths.max_verified_chars = 10_000
        for k in range(50):
            await store.save(f"s{k}", [Message(role="user", text="q"), Message(role="assistant", text="x" * 1_000)])
            assert store._lengths.verified_chars <= 10_000 + 1_100
            kept = [m for messages in store._lengths.verified.values() for m in messages]
            assert store._lengths.verified_chars == sum(len(m.to_json()) for m in kept)
        # Forgotten or not, a save is checked against what is stored, and extends it.
        question, follow_up = Message(role="user", text="q"), Message(role="user", text="z")
        for k in range(50):
            with pytest.raises(TranscriptConflict):
                await store.save(f"s{k}", [question, Message(role="assistant", text="y"), follow_up])
            await store.save(f"s{k}", [question, Message(role="assistant", text="x" * 1_000), follow_up])
            assert len(await store.messages(f"s{k}")) == 3


async def test_a_transcript_outlives_the_store_that_wrote_it(tmp_path: Path) -> None:
    transcript = [Message(role="user", text="q"), Message(role="assistant", text="a")]
    async with open_session_store(tmp_path / "runtime.db") as store:
        await Session.open("conv", store).save(transcript)
        await Session.open("conv", store).steer("later")
    async with open_session_store(tmp_path / "runtime.db") as store:
        session = Session.open("conv", store)
        assert await session.messages() == transcript
        assert await session.take_steers() == ["later"]


def test_session_open_refuses_an_empty_id_and_a_missing_store() -> None:
    with pytest.raises(ValueError, match="needs an id"):
        Session.open("", None)
    with pytest.raises(ValueError, match="needs a store"):
        Session.open("conv", None)


async def test_a_tasks_database_of_the_first_schema_is_brought_to_the_current_one_and_keeps_its_tasks(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tasks.db"
    first = Schema(name=TASKS_SCHEMA.name, migrations=TASKS_SCHEMA.migrations[:1])
    with closing(connect(path)) as conn:
        transaction(conn, first.migrations[0])
        transaction(conn, write_identity_txn, SchemaIdentity(first.name, 1))
        conn.execute(
            "INSERT INTO tasks (id, context_id, owner, state, version, created_at_ms, updated_at_ms, task)"
            " VALUES ('old', 'c', 'alice', 'TASK_STATE_COMPLETED', 3, 1, 2, '{}')"
        )
    async with open_task_store(path) as store:
        assert (await store.get("alice", "old")).version == 3
        await store.create("alice", task_id="new", context_id="c", state="TASK_STATE_SUBMITTED", task_json="{}", message_id="m1")
        # The tasks from before are counted among the new ones, as listings total them.
        totals = [(await store.list("alice", state=state)).total_size for state in (None, "TASK_STATE_COMPLETED", "TASK_STATE_SUBMITTED")]
        assert totals == [2, 1, 1]
    with closing(sqlite3.connect(path)) as conn:
        assert read_identity(conn) == SchemaIdentity("keel.tasks", TASKS_SCHEMA.version)
        assert conn.execute("SELECT id, message_id FROM tasks ORDER BY id").fetchall() == [("new", "m1"), ("old", None)]
        indexes = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}
    assert indexes == {"tasks_owner_recent", "tasks_by_message", "tasks_context_recent", "tasks_state_recent", "tasks_unfinished"}


async def test_steers_pending_in_a_second_schema_database_keep_the_task_they_were_sent_to(tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    with closing(connect(path)) as conn:
        for migration in SESSIONS_SCHEMA.migrations[:2]:
            transaction(conn, migration)
        transaction(conn, write_identity_txn, SchemaIdentity(SESSIONS_SCHEMA.name, 2))
        for text, message_id, task_id, at in (
            ("for t1", "m1", "t1", 5), ("for no task", "m2", None, 6), ("left by hand", None, None, 7),
        ):  # fmt: skip
            conn.execute("INSERT INTO steers (session_id, text, created_at_ms) VALUES ('conv', ?, ?)", (text, at))
            if message_id is not None:
                conn.execute(
                    "INSERT INTO steer_receipts (session_id, message_id, task_id, sent_sha256, created_at_ms)"
                    " VALUES ('conv', ?, ?, 'x', ?)",
                    (message_id, task_id, at),
                )
    async with open_session_store(path) as store:
        assert await store.take_steers("conv", for_task="t2") == ["for no task", "left by hand"]  # t1's stays t1's


async def test_a_sessions_database_of_the_first_schema_keeps_its_steers_and_learns_their_message_ids(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runtime.db"
    with closing(connect(path)) as conn:
        transaction(conn, SESSIONS_SCHEMA.migrations[0])
        transaction(conn, write_identity_txn, SchemaIdentity(SESSIONS_SCHEMA.name, 1))
        conn.execute("INSERT INTO steers (session_id, text, created_at_ms) VALUES ('conv', 'left before the upgrade', 1)")
    async with open_session_store(path) as store:
        assert await store.add_steer("conv", "sent once", message_id="m1", task_id="t1") is True
        assert await store.add_steer("conv", "sent once", message_id="m1") is False
        assert await store.take_steers("conv") == ["left before the upgrade", "sent once"]
    with closing(sqlite3.connect(path)) as conn:
        assert read_identity(conn) == SchemaIdentity("keel.sessions", SESSIONS_SCHEMA.version)


async def test_reopening_an_existing_database_is_idempotent(tmp_path: Path) -> None:
    for n in range(3):
        async with open_task_store(tmp_path / "tasks.db") as store:
            await store.create("o", task_id=f"t{n}", context_id="c", state="TASK_STATE_SUBMITTED", task_json="{}")
    async with open_task_store(tmp_path / "tasks.db") as store:
        assert (await store.list("o")).total_size == 3


def make_foreign(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE something (x)")


def make_newer(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        write_identity_txn(conn, SchemaIdentity("keel.tasks", 99))


def make_other_schema(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        write_identity_txn(conn, SchemaIdentity("keel.sessions", 1))


def make_incomplete(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        write_identity_txn(conn, SchemaIdentity("keel.tasks", 1))


def make_current(path: Path, *changes: str) -> None:
    """A tasks.db of the current schema, as this build makes it, then changed by ``changes`` (SQL)."""
    with closing(connect(path)) as conn:
        for migration in TASKS_SCHEMA.migrations:
            transaction(conn, migration)
        transaction(conn, write_identity_txn, SchemaIdentity(TASKS_SCHEMA.name, TASKS_SCHEMA.version))
        for change in changes:
            conn.execute(change)


def make_without_a_column(path: Path) -> None:
    # Every task write names message_id: a server that opened this failed every message it was sent.
    make_current(path, "DROP INDEX tasks_by_message", "ALTER TABLE tasks DROP COLUMN message_id")


def make_with_another_column(path: Path) -> None:
    # A column no write of this build fills: NOT NULL, it failed every new task.
    make_current(path, "ALTER TABLE tasks ADD COLUMN priority INTEGER NOT NULL DEFAULT 0")


def make_with_a_column_renamed(path: Path) -> None:
    # Missing one column and with one it does not know: both are named, so that a rename can be
    # told for what it is, and undone, rather than the file moved aside with every task in it.
    make_current(path, "ALTER TABLE tasks RENAME COLUMN message_id TO msg_id")


def make_without_an_index_of_its_own(path: Path) -> None:
    # The unique index that makes a message start one task: without it, a message sent again
    # after its answer was lost would start a second run.
    make_current(path, "DROP INDEX tasks_by_message")


def make_without_a_trigger_of_its_own(path: Path) -> None:
    # The counts ListTasks reads its totalSize from would go wrong from the next task on.
    make_current(path, "DROP TRIGGER task_counted")


def make_garbage(path: Path) -> None:
    path.write_bytes(b"this is not a database, it is a text file " * 100)


REFUSALS = [
    (make_foreign, "no Keel schema identity", "Move the file aside"),
    (make_newer, f"keel.tasks@99 but this build supports keel.tasks@{TASKS_SCHEMA.version}", "Upgrade Keel, or restore a snapshot"),
    (make_other_schema, "is a keel.sessions database, not keel.tasks", "Point the state directory"),
    (make_incomplete, "incomplete keel.tasks schema", "Restore a good snapshot"),
    (make_garbage, "cannot be read as a database", "Restore a good snapshot"),
    (make_without_a_column, "incomplete keel.tasks schema (missing column tasks.message_id)", "Restore a good snapshot"),
    (make_with_another_column, "has column tasks.priority, which keel.tasks@3 does not have", "Remove what was added"),
    (
        make_without_an_index_of_its_own,
        "is missing index tasks_by_message of its keel.tasks schema",
        "Make it again (CREATE UNIQUE INDEX tasks_by_message ON tasks (owner, message_id) WHERE message_id IS NOT NULL)",
    ),
    (make_without_a_trigger_of_its_own, "is missing trigger task_counted of its keel.tasks schema", "CREATE TRIGGER task_counted"),
    (
        make_with_a_column_renamed,
        "missing column tasks.message_id, and has column tasks.msg_id, which keel.tasks@3 does not have",
        "Undo what was changed (ALTER TABLE ... RENAME COLUMN, ... DROP COLUMN)",
    ),
]


@pytest.mark.parametrize(("make", "words", "fix"), REFUSALS, ids=[r[0].__name__ for r in REFUSALS])
async def test_opening_an_unusable_database_names_the_file_and_the_fix_and_changes_nothing(
    tmp_path: Path, make: object, words: str, fix: str
) -> None:
    path = tmp_path / "tasks.db"
    make(path)  # type: ignore[operator]
    before = path.read_bytes()
    with pytest.raises(SchemaError) as caught:
        inspect(path, TASKS_SCHEMA)
    assert str(path) in str(caught.value) and words in str(caught.value)
    with pytest.raises(SchemaError, match=re.escape(words)):
        await SqlitePool.open(path, TASKS_SCHEMA)
    assert path.read_bytes() == before
    assert fix in str(caught.value)


async def test_what_sqlite_or_an_operator_adds_beside_the_tables_does_not_make_a_database_unusable(tmp_path: Path) -> None:
    # ANALYZE's statistics (sqlite_stat1), an index or a trigger an operator added, a table of
    # their own (Litestream, replicating the file, keeps two): the tables and their columns are
    # still the schema's own, and every write of this build fits them.
    path = tmp_path / "tasks.db"
    make_current(
        path, "CREATE INDEX by_created ON tasks (created_at_ms)", "CREATE TRIGGER noted AFTER INSERT ON tasks BEGIN SELECT 1; END",
        "CREATE TABLE _litestream_seq (id INTEGER PRIMARY KEY, seq INTEGER)", "CREATE TABLE _litestream_lock (id INTEGER)",
    )  # fmt: skip
    async with open_task_store(path) as store:
        await store.create("o", task_id="t", context_id="c", state="TASK_STATE_SUBMITTED", task_json="{}")
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("ANALYZE")
    inspect(path, TASKS_SCHEMA)
    async with open_task_store(path) as store:
        assert (await store.list("o")).total_size == 1


def test_preflight_inspection_of_a_missing_file_creates_nothing(tmp_path: Path) -> None:
    inspect(tmp_path / "tasks.db", TASKS_SCHEMA)
    assert list(tmp_path.iterdir()) == []


async def test_every_append_acknowledged_before_a_sigkill_survives_untorn(tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    acked: set[tuple[int, int]] = set()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with trio.fail_after(60):
        process = await trio.lowlevel.open_process(
            [sys.executable, crash_writer.__file__, str(path)], stdout=subprocess.PIPE, env=env
        )
        try:
            buffer = b""
            assert process.stdout is not None
            while len(acked) < 400:
                chunk = await process.stdout.receive_some()
                assert chunk, f"the writer exited early with {await process.wait()}"
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                acked.update(tuple(map(int, line.split())) for line in lines)  # type: ignore[misc]
        finally:
            process.kill()  # SIGKILL, mid-append: the writers never stop on their own
            await process.wait()
    assert process.returncode == -9
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    async with open_session_store(path) as store:
        stored: dict[int, list[int]] = {}
        for s in range(4):
            events = await store.events(f"session-{s}")
            assert [e.seq for e in events] == list(range(len(events)))
            for event in events:
                body = json.loads(event.content)
                assert event.content == crash_writer.content(body["k"], body["i"])
                stored.setdefault(body["k"], []).append(body["i"])
    for k, order in stored.items():
        assert order == list(range(len(order))), f"writer {k}'s events are out of order or have a gap"
    missing = {(k, i) for k, i in acked if i >= len(stored.get(k, []))}
    assert not missing, f"{len(missing)} acknowledged appends are gone"


async def test_a_failing_database_is_a_store_error_that_names_the_file(tmp_path: Path) -> None:
    from persistence.errors import DatabaseFailed

    path = tmp_path / "runtime.db"
    async with open_session_store(path) as store:
        await store.append("s", ['{"n":1}'])
        # Another connection holds the write lock past the busy timeout: a real SQLite failure.
        blocker = sqlite3.connect(path, timeout=0, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            await store.pool.run(lambda conn: conn.execute("PRAGMA busy_timeout = 50"))
            with pytest.raises(DatabaseFailed) as caught:
                await store.append("s", ['{"n":2}'])
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert str(path) in str(caught.value) and "locked" in str(caught.value)
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        assert [e.content for e in await store.events("s")] == ['{"n":1}']


def test_an_sqlite_too_old_for_keel_is_refused_with_the_versions_named() -> None:
    from persistence.sqlite import check_sqlite_version

    check_sqlite_version()  # the one this Python links
    with pytest.raises(RuntimeError, match=r"needs SQLite 3\.35\.0 or newer; .* uses 3\.31\.1"):
        check_sqlite_version((3, 31, 1))


async def test_a_database_another_program_holds_is_called_busy_not_damaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("persistence.sqlite.BUSY_TIMEOUT_MS", 200)  # how long a lock is waited for
    path = tmp_path / "runtime.db"
    async with open_session_store(path) as store:
        await store.append("s", ['{"kept":true}'])
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_WRITE_LOCK, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(DatabaseBusy) as raised:
            await SqliteSessionStore.open(path)
    finally:
        holder.communicate("", timeout=30)  # lets go
    message = str(raised.value)
    assert str(path) in message and "another program is holding the database" in message
    assert "move the file aside" not in message
    async with open_session_store(path) as store:  # and once it has let go, nothing was wrong
        assert [e.content for e in await store.events("s")] == ['{"kept":true}']


HOLD_THE_WRITE_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()
"""


LISTINGS: list[dict[str, Any]] = [
    {"context_id": "mine"},
    {"state": "TASK_STATE_WORKING"},
    {"context_id": "mine", "state": "TASK_STATE_WORKING"},
    {"context_id": "mine", "page_size": 2},  # and the second page, by its token
    {"page_size": 2},  # every task of the owner: the newest, and how many there are
]


async def test_listings_and_finding_unfinished_tasks_read_no_more_among_thousands_of_other_tasks(
    tmp_path: Path,
) -> None:
    # The task store's one thread runs its reads between its writes: a listing that walked
    # every task of the owner held up every task write behind it, longer as the file grew.
    # What SQLite does for each is counted in its own steps (a progress handler), not timed.
    path = tmp_path / "tasks.db"
    async with open_task_store(path) as store:
        for n in range(3):
            await store.create("alice", task_id=f"mine-{n}", context_id="mine", state="TASK_STATE_WORKING", task_json="{}")

        def steps(call: Any) -> Awaitable[int]:
            return sqlite_steps(store.pool, call)

        async def listings() -> list[int]:
            counts = []
            for filters in LISTINGS:
                first = await store.list("alice", **filters)
                assert [r.id for r in first.records][:2] == ["mine-2", "mine-1"], filters
                counts.append(await steps(lambda filters=filters: store.list("alice", **filters)))
                if first.next_page_token:
                    token = first.next_page_token
                    counts.append(await steps(lambda filters=filters: store.list("alice", **filters, page_token=token)))
            counts.append(await steps(store.unfinished))
            return counts

        alone = await listings()
        with closing(sqlite3.connect(path)) as other, other:  # another writer's finished tasks, written at once
            other.executemany(
                "INSERT INTO tasks (id, context_id, owner, state, version, created_at_ms, updated_at_ms, task)"
                " VALUES (?, ?, 'alice', 'TASK_STATE_COMPLETED', 1, ?, ?, '{}')",
                ((f"other-{n}", f"ctx-{n % 500}", n, n) for n in range(5000)),
            )
        among_others = await listings()
        totals = [(await store.list("alice", **filters)).total_size for filters in LISTINGS]
        completed = await store.list("alice", state="TASK_STATE_COMPLETED", page_size=1)
        with_completed = await steps(lambda: store.list("alice", state="TASK_STATE_COMPLETED", page_size=1))
    assert all(after <= 2 * before + 5 for before, after in zip(alone, among_others, strict=True)), (alone, among_others)
    assert totals == [3, 3, 3, 3, 5003]
    assert completed.total_size == 5000 and with_completed <= 2 * alone[0] + 5, with_completed


async def test_the_later_pages_of_a_listing_after_a_time_do_not_count_its_tasks_again(tmp_path: Path) -> None:
    # Counted at every page, the tasks after a status time were walked whole once a page: the
    # pages of a listing of n tasks took time with n squared, in the thread every task write waits for.
    path = tmp_path / "tasks.db"
    async with open_task_store(path) as store:
        with closing(sqlite3.connect(path)) as other, other:
            other.executemany(
                "INSERT INTO tasks (id, context_id, owner, state, version, created_at_ms, updated_at_ms, task)"
                " VALUES (?, ?, 'alice', 'TASK_STATE_COMPLETED', 1, ?, ?, '{}')",
                ((f"t-{n:05}", f"ctx-{n}", 10 + n, 10 + n) for n in range(5000)),
            )
        first_page = await store.list("alice", updated_after_ms=0, page_size=10)
        first = await sqlite_steps(store.pool, lambda: store.list("alice", updated_after_ms=0, page_size=10))
        token = first_page.next_page_token
        second_page = await store.list("alice", updated_after_ms=0, page_size=10, page_token=token)
        second = await sqlite_steps(store.pool, lambda: store.list("alice", updated_after_ms=0, page_size=10, page_token=token))
    assert first_page.total_size == second_page.total_size == 5000
    assert [r.id for r in second_page.records] == [f"t-{n:05}" for n in range(4989, 4979, -1)]
    assert second * 10 < first, (first, second)


def _damage(path: Path, text: bytes) -> None:
    """Flip a byte in the middle of the one place ``text`` is stored in the database ``path`` (closed,
    its -wal checkpointed into it): it is no longer UTF-8, and every page is sound."""
    data = bytearray(path.read_bytes())
    assert data.count(text) == 1
    data[data.index(text) + len(text) // 2] ^= 0xFF
    path.write_bytes(data)


async def test_a_session_whose_stored_text_is_no_longer_utf8_is_named_unreadable_without_quoting_it(tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    async with open_session_store(path) as store:
        for session in ("damaged", "sound"):
            await store.save(session, [Message(role="user", text=f"{session} question " + "q" * 60)])
            await store.add_steer(session, f"{session} steer " + "s" * 60, message_id=f"{session}-steer", record="{}")
            await store.add_steer(session, "recorded", message_id=f"{session}-record", record=f'"{session} record {"r" * 60}"')
    for stored in (b"question " + b"q" * 20, b"steer " + b"s" * 20, b"record " + b"r" * 20):
        _damage(path, b"damaged " + stored)

    async with open_session_store(path) as store:
        reads = {
            "its message 0 is not UTF-8": lambda: store.messages("damaged"),
            # A save reads back what its writer does not know to be there (nothing, once opened).
            "its message 0 is not UTF-8: byte": lambda: store.save("damaged", [Message(role="user", text="other")]),
            "its steer 1 is not UTF-8": lambda: store.take_steers("damaged"),
            "the record of its steer 'damaged-record' is not UTF-8": lambda: store.pending_steers(session_id="damaged"),
        }
        for said, read in reads.items():
            with pytest.raises(UnreadableSession) as raised:
                await read()
            assert f"session 'damaged' in runtime.db cannot be read ({said}" in str(raised.value)
            assert "state restore" in str(raised.value) and "qqqq" not in str(raised.value)
        assert [message.text for message in await store.messages("sound")] == ["sound question " + "q" * 60]
        assert await store.take_steers("sound") == ["sound steer " + "s" * 60, "recorded"]
        assert [steer.message_id for steer in await store.pending_steers(session_id="sound")] == ["sound-steer", "sound-record"]


async def test_a_turn_reads_only_the_messages_of_its_conversation_that_its_store_has_not_seen(tmp_path: Path) -> None:
    # Every turn reads its conversation whole, for the model. Read back from its rows and decoded
    # each time, a turn of a conversation twice as long cost twice as much before the model was
    # asked, though the store had been given every one of those messages by the saves before it.
    # What SQLite does for a turn (its read, its two saves) is counted in its steps, not timed.
    async with open_session_store(tmp_path / "runtime.db") as store:

        async def turn(session_id: str, k: int) -> list[Message]:
            messages = await store.messages(session_id)
            messages.append(Message(role="user", text=f"question {k}", turn_id=f"task-{k}"))
            await store.save(session_id, messages)
            messages.append(Message(role="assistant", text=f"answer {k}"))
            await store.save(session_id, messages)
            return messages

        said: dict[str, list[Message]] = {}  # the transcript each conversation's last turn left

        async def steps_of_a_turn(session_id: str, k: int) -> int:
            async def one() -> None:
                said[session_id] = await turn(session_id, k)

            return await sqlite_steps(store.pool, one)

        steps = {}
        for length in (200, 400):
            session_id = f"conversation of {length}"
            earlier = [
                Message(role="user", text=f"question {k}", turn_id=f"task-{k}")
                if k % 2 == 0
                else Message(role="assistant", text=f"answer {k}")
                for k in range(length)
            ]
            await store.save(session_id, earlier)
            await turn(session_id, length)  # the turn before
            steps[length] = await steps_of_a_turn(session_id, length + 1)
        assert steps[400] < steps[200] * 1.2, steps
        assert [len(transcript) for transcript in said.values()] == [204, 404]
        for session_id, transcript in said.items():
            assert await store.messages(session_id) == transcript
    # What a turn reads is what is stored, as a store that has seen none of it reads it too.
    async with open_session_store(tmp_path / "runtime.db") as store:
        for session_id, transcript in said.items():
            assert await store.messages(session_id) == transcript


async def test_a_conversation_larger_than_the_writers_cache_leaves_the_others_known(tmp_path: Path) -> None:
    # The writer's connection keeps the messages each session's saves were given, up to so many
    # characters, and forgot them all once past it: a conversation larger than that alone came
    # back at its next save, past it again, so every batch forgot every session, and each save of
    # every other conversation read its whole transcript back. Counted in SQLite's steps, not timed.
    async with open_session_store(tmp_path / "runtime.db") as store:
        store._lengths.max_verified_chars = 50_000
        small = [Message(role="user", text=f"question {k}") for k in range(300)]
        big = [Message(role="user", text="x" * 20_000) for _ in range(4)]  # 80,000 characters alone
        await store.save("small", small)
        await store.save("big", big)

        def steps_of(call: Callable[[], Awaitable[object]]) -> Awaitable[int]:
            return sqlite_steps(store.pool, call)

        steps = []
        for k in range(3):
            big.append(Message(role="assistant", text=f"answer {k}"))
            await store.save("big", big)
            small.append(Message(role="assistant", text=f"answer {k}"))
            steps.append(await steps_of(lambda: store.save("small", small)))
        alone = await steps_of(lambda: store.save("small", [*small, Message(role="user", text="and then?")]))
        assert max(steps) < 2 * alone, (steps, alone)
        assert [len(await store.messages(name)) for name in ("small", "big")] == [304, 7]
