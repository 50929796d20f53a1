"""The SQLite session store (``runtime.db``): sessions, their events, state and steers.

The schema and the store are here; the transactions its writer runs, and what the writer's
connection knows of each session (``SessionLengths``), are ``persistence.sessionwrites``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Self

import attrs

from persistence.api import DEFAULT_APP_NAME, Event, PendingSteer, SteerReceipt
from persistence.locks import TurnLocks
from persistence.sessionwrites import (
    SessionLengths,
    add_steer_txn,
    append_txn,
    drop_steers_txn,
    ensure_txn,
    events_txn,
    length_txn,
    messages_txn,
    now_ms,
    pending_steers_txn,
    save_and_take_txn,
    save_txn,
    steers_recorded_txn,
    take_steers_txn,
)
from persistence.sqlite import Schema, SqlitePool, execute_ddl
from persistence.writer import WriterBacked, running
from persistence.transcript import Message
from persistence.validate import (
    MAX_EVENT_BYTES,
    MAX_INTEGER,
    check_integer,
    check_name,
    check_session_id,
    check_steer_params,
    checked_append,
    lone_surrogate,
)
from persistence.errors import naming_session


def _v1(conn: sqlite3.Connection) -> None:
    execute_ddl(
        conn,
        """
        CREATE TABLE sessions (
            session_id TEXT PRIMARY KEY,
            app_name TEXT NOT NULL,
            user_id TEXT NOT NULL,
            state TEXT NOT NULL DEFAULT '{}',
            created_at_ms INTEGER NOT NULL,
            updated_at_ms INTEGER NOT NULL
        );
        CREATE TABLE events (
            session_id TEXT NOT NULL REFERENCES sessions (session_id),
            seq INTEGER NOT NULL,
            author TEXT NOT NULL,
            created_at_ms INTEGER NOT NULL,
            content TEXT NOT NULL,                  -- stored byte for byte as given
            PRIMARY KEY (session_id, seq)
        );
        CREATE TABLE app_states (
            app_name TEXT PRIMARY KEY, state TEXT NOT NULL, updated_at_ms INTEGER NOT NULL
        );
        CREATE TABLE user_states (
            app_name TEXT NOT NULL, user_id TEXT NOT NULL, state TEXT NOT NULL, updated_at_ms INTEGER NOT NULL,
            PRIMARY KEY (app_name, user_id)
        );
        CREATE TABLE steers (
            id INTEGER PRIMARY KEY AUTOINCREMENT,   -- AUTOINCREMENT: ids never reused, so order is arrival
            session_id TEXT NOT NULL,
            text TEXT NOT NULL,
            created_at_ms INTEGER NOT NULL
        );
        CREATE INDEX steers_by_session ON steers (session_id, id);
        """
    )


def _v2(conn: sqlite3.Connection) -> None:
    # The message ids of the steers a session was left, kept after the steers are taken: a
    # client that sends a steer again (its answer lost, or its task's record of it not stored)
    # must not steer the run twice.
    execute_ddl(
        conn,
        """
        CREATE TABLE steer_receipts (
            session_id TEXT NOT NULL,
            message_id TEXT NOT NULL,
            task_id TEXT,                           -- the task it was sent to, if given
            sent_sha256 TEXT NOT NULL,              -- of the message as sent: a resend, or another message?
            created_at_ms INTEGER NOT NULL,
            PRIMARY KEY (session_id, message_id)
        ) WITHOUT ROWID;
        """,
    )


def _v3(conn: sqlite3.Connection) -> None:
    # The task each steer was left for, if any: only that task's run takes it. A steer pending
    # from before is matched to its receipt, written with it (same session, same millisecond),
    # where exactly one task's receipt matches.
    execute_ddl(
        conn,
        """
        ALTER TABLE steers ADD COLUMN task_id TEXT;
        UPDATE steers SET task_id = (
            SELECT min(r.task_id) FROM steer_receipts AS r
            WHERE r.session_id = steers.session_id AND r.created_at_ms = steers.created_at_ms AND r.task_id IS NOT NULL
            HAVING count(DISTINCT r.task_id) = 1
        );
        """,
    )


def _v4(conn: sqlite3.Connection) -> None:
    # What is still to be recorded of a steer in its task's history (the message as the task
    # keeps it), written with its receipt and forgotten once that record is stored: tasks.db is
    # another file, and a process that dies between the two writes leaves it to the next.
    execute_ddl(
        conn,
        """
        ALTER TABLE steer_receipts ADD COLUMN record TEXT;
        CREATE INDEX steer_receipts_pending ON steer_receipts (created_at_ms) WHERE record IS NOT NULL;
        """,
    )


SESSIONS_SCHEMA = Schema(name="keel.sessions", migrations=(_v1, _v2, _v3, _v4))


@attrs.define(eq=False)
class SqliteSessionStore(WriterBacked):
    """Sessions in one SQLite file. Writes go through a group-commit writer.

    Open with ``await SqliteSessionStore.open(path)``, then start its writer with
    ``await nursery.start(store.run)``; or use ``open_session_store(path)``.
    """

    max_event_bytes: int = attrs.field(default=MAX_EVENT_BYTES, kw_only=True)
    _locks: TurnLocks = attrs.field(init=False, factory=TurnLocks)
    _lengths: SessionLengths = attrs.field(init=False, factory=SessionLengths)

    def _batch_hooks(self) -> SessionLengths:
        return self._lengths

    @classmethod
    async def open(cls, path: Path, *, synchronous: str = "FULL", max_event_bytes: int = MAX_EVENT_BYTES) -> Self:
        pool = await SqlitePool.open(path, SESSIONS_SCHEMA, synchronous=synchronous)
        return cls(pool=pool, max_event_bytes=max_event_bytes)

    async def create_session(self, session_id: str, *, app_name: str = DEFAULT_APP_NAME, user_id: str = "") -> None:
        """Create the session if it does not exist; creating an existing one changes nothing."""
        check_session_id(session_id)
        check_name("app name", app_name)
        check_name("user id", user_id)
        await self._writer.submit(ensure_txn, session_id, app_name, user_id, now_ms())

    async def append(
        self, session_id: str, contents: Sequence[str], *, at: int | None = None, author: str = "agent"
    ) -> int:
        contents = checked_append(session_id, contents, max_bytes=self.max_event_bytes, author=author)
        with naming_session(session_id, given=len(contents)):
            return await self._writer.submit(append_txn, self._lengths, session_id, contents, at, author)

    async def save(self, session_id: str, messages: Sequence[Message]) -> None:
        check_session_id(session_id)
        # No copy of the transcript: it is read inside this call, against what the writer knows
        # of the session (so a save costs about the same at ten messages as at ten thousand).
        with naming_session(session_id, given=len(messages)):
            await self._writer.submit(save_txn, self._lengths, session_id, messages, self.max_event_bytes)

    async def events(self, session_id: str, *, after: int = -1) -> list[Event]:
        check_integer(after, f"the seq after which events of session {session_id!r} are read", minimum=-MAX_INTEGER - 1)
        rows = await self.pool.run(events_txn, session_id, after)
        return [Event(seq=seq, author=author, created_at_ms=at, content=content) for seq, author, at, content in rows]

    async def length(self, session_id: str) -> int:
        return await self.pool.run(length_txn, session_id)

    async def messages(self, session_id: str) -> list[Message]:
        return await self.pool.run(messages_txn, self._lengths, session_id)

    async def save_and_take_steers(
        self,
        session_id: str,
        messages: Sequence[Message],
        *,
        placed: Callable[[str], Message] | None = None,
        for_task: str | None = None,
    ) -> list[str]:
        check_session_id(session_id)
        with naming_session(session_id, given=len(messages)):
            return await self._writer.submit(
                save_and_take_txn, self._lengths, session_id, messages, self.max_event_bytes, placed, for_task
            )

    async def add_steer(
        self,
        session_id: str,
        text: str,
        *,
        message_id: str | None = None,
        task_id: str | None = None,
        sent_as: str | None = None,
        record: str | None = None,
    ) -> bool:
        check_steer_params(session_id, text, message_id, task_id, record)
        receipt = SteerReceipt.of(text, task_id=task_id, sent_as=sent_as)
        return await self._writer.submit(add_steer_txn, self._lengths, session_id, text, message_id, receipt, record)

    async def steer_receipt(self, session_id: str, message_id: str) -> SteerReceipt | None:
        if lone_surrogate(session_id) or lone_surrogate(message_id):  # never stored
            return None
        row = await self.pool.run(
            lambda conn: conn.execute(
                "SELECT task_id, sent_sha256 FROM steer_receipts WHERE session_id = ? AND message_id = ?", (session_id, message_id)
            ).fetchone()
        )
        return None if row is None else SteerReceipt(task_id=row[0], sent_sha256=row[1])

    async def pending_steers(self, *, session_id: str | None = None, task_id: str | None = None) -> list[PendingSteer]:
        if any(name is not None and lone_surrogate(name) for name in (session_id, task_id)):  # never stored
            return []
        rows = await self.pool.run(pending_steers_txn, session_id, task_id)
        return [PendingSteer(session_id=row[0], message_id=row[1], task_id=row[2], record=row[3]) for row in rows]

    async def steers_recorded(self, session_id: str, message_ids: Sequence[str]) -> None:
        ids = [message_id for message_id in message_ids if not lone_surrogate(message_id)]
        if ids and not lone_surrogate(session_id):
            await self._writer.submit(steers_recorded_txn, session_id, ids)

    async def take_steers(self, session_id: str, *, for_task: str | None = None) -> list[str]:
        return await self._writer.submit(take_steers_txn, self._lengths, session_id, for_task)

    async def drop_steers(self, session_id: str, *, task_id: str) -> None:
        await self._writer.submit(drop_steers_txn, session_id, task_id)

    def turn_lock(self, session_id: str) -> AbstractAsyncContextManager[None]:
        return self._locks.hold(session_id)

    def turn_locks_held(self) -> int:
        """How many sessions have a turn held or waited for in this process."""
        return len(self._locks)

    async def get_state(self, session_id: str) -> dict[str, object]:
        return await self._read_json("SELECT state FROM sessions WHERE session_id = ?", (session_id,))

    async def set_state(self, session_id: str, state: dict[str, object]) -> None:
        check_session_id(session_id)
        text = json.dumps(state, sort_keys=True)  # raises TypeError before anything is written

        def txn(conn: sqlite3.Connection) -> None:
            now = now_ms()
            ensure_txn(conn, session_id, DEFAULT_APP_NAME, "", now)
            conn.execute("UPDATE sessions SET state = ?, updated_at_ms = ? WHERE session_id = ?", (text, now, session_id))

        await self._writer.submit(txn)

    async def get_app_state(self, app_name: str) -> dict[str, object]:
        return await self._read_json("SELECT state FROM app_states WHERE app_name = ?", (app_name,))

    async def set_app_state(self, app_name: str, state: dict[str, object]) -> None:
        check_name("app name", app_name)
        await self._write_json(
            "INSERT INTO app_states (app_name, state, updated_at_ms) VALUES (?, ?, ?)"
            " ON CONFLICT (app_name) DO UPDATE SET state = excluded.state, updated_at_ms = excluded.updated_at_ms",
            (app_name,),
            state,
        )

    async def get_user_state(self, app_name: str, user_id: str) -> dict[str, object]:
        return await self._read_json("SELECT state FROM user_states WHERE app_name = ? AND user_id = ?", (app_name, user_id))

    async def set_user_state(self, app_name: str, user_id: str, state: dict[str, object]) -> None:
        check_name("app name", app_name)
        check_name("user id", user_id)
        await self._write_json(
            "INSERT INTO user_states (app_name, user_id, state, updated_at_ms) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (app_name, user_id) DO UPDATE SET state = excluded.state, updated_at_ms = excluded.updated_at_ms",
            (app_name, user_id),
            state,
        )

    async def _read_json(self, sql: str, key: tuple[str, ...]) -> dict[str, object]:
        row = await self.pool.run(lambda conn: None if any(map(lone_surrogate, key)) else conn.execute(sql, key).fetchone())
        return {} if row is None else dict(json.loads(row[0]))

    async def _write_json(self, sql: str, key: tuple[str, ...], state: dict[str, object]) -> None:
        text = json.dumps(state, sort_keys=True)
        await self._writer.submit(lambda conn: conn.execute(sql, (*key, text, now_ms())))



@asynccontextmanager
async def open_session_store(path: Path, **options: Any) -> AsyncIterator[SqliteSessionStore]:
    """A session store over the SQLite file at ``path`` (created with its schema if absent), its
    writer running in a nursery owned by this context; closed, what it wrote durable, when the
    block is left. ``options``: those of ``SqliteSessionStore.open`` (``synchronous``, "FULL" by
    default; ``max_event_bytes``). An error raised in the block comes out as itself."""
    async with running(await SqliteSessionStore.open(path, **options)) as store:
        yield store
