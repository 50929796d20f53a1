"""The SQLite session store (``runtime.db``): sessions, their events, state and steers."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Self

import attrs
import trio

from persistence.api import DEFAULT_APP_NAME, Event, PendingSteer, SteerReceipt
from persistence.locks import TurnLocks
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
    decode_messages,
    lone_surrogate,
    plan_save,
)
from persistence.errors import TranscriptConflict, naming_session


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


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _ensure_txn(conn: sqlite3.Connection, session_id: str, app_name: str, user_id: str, now: int) -> int:
    """Create the session if it is new (concurrent first uses create one row); return its length."""
    created = conn.execute(
        "INSERT INTO sessions (session_id, app_name, user_id, created_at_ms, updated_at_ms) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT (session_id) DO NOTHING",
        (session_id, app_name, user_id, now, now),
    ).rowcount
    # A session created just now has no events (each event's row refers to its session's).
    return 0 if created else _length_txn(conn, session_id)


def _length_txn(conn: sqlite3.Connection, session_id: str) -> int:
    if lone_surrogate(session_id):  # never stored: refused on the way in (and unbindable)
        return 0
    # One seek in the primary key's index: a session's length is where its events end.
    (length,) = conn.execute(
        "SELECT coalesce(max(seq) + 1, 0) FROM events WHERE session_id = ?", (session_id,)
    ).fetchone()
    return int(length)


@attrs.define(eq=False)
class SessionLengths:
    """What the writer's connection knows of each session it wrote: its length, the messages its
    events hold (the objects the saves were given), and whether it has steers waiting. An append
    is then one INSERT, and a save (which checks that it extends what is stored, and takes the
    steers) reads nothing back.

    Batch hooks of the group-commit writer; touched only in the pool's thread. What is known is
    trusted only while no other connection has committed (``PRAGMA data_version`` changes when
    one has: another process's steer, say). In a batch's fast path the events are inserted
    together, before COMMIT. Every statement spared is several calls into SQLite spared, each
    of which lets go of the GIL and must take it back, which under load is a wait.
    """

    data_version: int | None = None
    known: dict[str, int] = attrs.field(factory=dict)
    # The first events of a session, as messages a save was given and found (or made) them to be.
    verified: dict[str, list[Message]] = attrs.field(factory=dict)
    no_steers: set[str] = attrs.field(factory=set)  # sessions with no steer waiting
    max_known: int = 10_000  # then forgotten: a cache, not a record of every session ever written
    max_verified_chars: int = 64 << 20  # likewise once the messages kept come to this many characters stored
    verified_chars: int = 0
    rows: list[tuple[str, int, str, int, str]] = attrs.field(factory=list)  # events not yet inserted
    careful: bool = False  # a savepoint per write: insert at once, inside it
    now: int = 0

    def begin(self, conn: sqlite3.Connection, *, careful: bool) -> None:
        (version,) = conn.execute("PRAGMA data_version").fetchone()
        if (
            version != self.data_version
            or len(self.known) > self.max_known
            or len(self.no_steers) > self.max_known
            or self.verified_chars > self.max_verified_chars
        ):
            self.forget()
            self.data_version = version
        self.rows.clear()
        self.careful = careful
        self.now = now_ms()

    def flush(self, conn: sqlite3.Connection) -> None:
        """Insert the events queued so far; before anything reads the events table."""
        if self.rows:
            # Taken off the queue first: rows whose insert fails belong to the write that fails
            # (careful mode undoes it alone), and must not be sent again with the next one's.
            rows, self.rows = self.rows, []
            conn.executemany(_INSERT_EVENT, rows)

    def finish(self, conn: sqlite3.Connection) -> None:
        self.flush(conn)

    def abort(self) -> None:
        self.data_version = None
        self.forget()
        self.rows.clear()

    def item_failed(self) -> None:
        # The failed write may have created a session row, or taken positions or steers, that
        # its savepoint undid; in careful mode the tables themselves are accurate, so ask them.
        self.forget()

    def forget(self) -> None:
        self.known.clear()
        self.verified.clear()
        self.verified_chars = 0
        self.no_steers.clear()

    def length(self, conn: sqlite3.Connection, session_id: str) -> int:
        length = self.known.get(session_id)
        if length is None:
            length = self.known[session_id] = _ensure_txn(conn, session_id, DEFAULT_APP_NAME, "", self.now)
        return length

    def insert(self, conn: sqlite3.Connection, session_id: str, at: int, author: str, contents: Sequence[str]) -> None:
        """Write events at positions at, at+1, ...: queued for one INSERT of the whole batch, or
        at once in careful mode."""
        self.rows.extend((session_id, at + i, author, self.now, content) for i, content in enumerate(contents))
        if self.careful:
            self.flush(conn)
        self.known[session_id] = at + len(contents)

    def verified_prefix(self, session_id: str, stored: int) -> list[Message]:
        """The messages known to be the session's first events (of ``stored``, from ``length()``)."""
        verified = self.verified.get(session_id)
        if verified is None or len(verified) > stored:
            verified = self.verified[session_id] = []
        return verified

    def stored_from(self, conn: sqlite3.Connection, session_id: str, start: int) -> list[str]:
        """The contents of the session's events from position ``start`` on."""
        self.flush(conn)
        contents = [
            content
            for (content,) in conn.execute(
                "SELECT content FROM events WHERE session_id = ? AND seq >= ? ORDER BY seq", (session_id, start)
            )
        ]
        self.verified_chars += sum(map(len, contents))
        return contents

    def written(self, contents: Sequence[str]) -> None:
        """``contents`` were just written, and their messages kept (by ``plan_save``)."""
        self.verified_chars += sum(map(len, contents))


_INSERT_EVENT = "INSERT INTO events (session_id, seq, author, created_at_ms, content) VALUES (?, ?, ?, ?, ?)"


def _append_txn(
    conn: sqlite3.Connection, lengths: SessionLengths, session_id: str, contents: Sequence[str], at: int | None, author: str
) -> int:
    start = lengths.length(conn, session_id)
    if at is not None and start != at:
        raise TranscriptConflict(session_id, f"an append at position {at} does not follow the {start} stored events")
    lengths.insert(conn, session_id, start, author, contents)
    return start


def _save_txn(
    conn: sqlite3.Connection, lengths: SessionLengths, session_id: str, messages: Sequence[Message], max_bytes: int
) -> None:
    stored = lengths.length(conn, session_id)
    contents = plan_save(
        session_id,
        messages,
        stored=stored,
        verified=lengths.verified_prefix(session_id, stored),
        stored_from=lambda start: lengths.stored_from(conn, session_id, start),
        max_bytes=max_bytes,
    )
    if contents:
        lengths.insert(conn, session_id, stored, "agent", contents)
        lengths.written(contents)


def _take_steers_txn(
    conn: sqlite3.Connection, lengths: SessionLengths, session_id: str, for_task: str | None = None
) -> list[str]:
    if session_id in lengths.no_steers or lone_surrogate(session_id):
        return []
    rows = conn.execute("SELECT id, text, task_id FROM steers WHERE session_id = ? ORDER BY id", (session_id,)).fetchall()
    if rows:
        conn.execute("DELETE FROM steers WHERE session_id = ? AND id <= ?", (session_id, rows[-1][0]))
    lengths.no_steers.add(session_id)
    return [text for _, text, task_id in rows if for_task is None or task_id is None or task_id == for_task]


def _drop_steers_txn(conn: sqlite3.Connection, session_id: str, task_id: str) -> None:
    if not (lone_surrogate(session_id) or lone_surrogate(task_id)):  # never stored
        conn.execute("DELETE FROM steers WHERE session_id = ? AND task_id = ?", (session_id, task_id))


def _add_steer_txn(
    conn: sqlite3.Connection,
    lengths: SessionLengths,
    session_id: str,
    text: str,
    message_id: str | None,
    receipt: SteerReceipt,
    record: str | None,
) -> bool:
    now = now_ms()
    if message_id is not None and not conn.execute(
        "INSERT INTO steer_receipts (session_id, message_id, task_id, sent_sha256, created_at_ms, record)"
        " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        (session_id, message_id, receipt.task_id, receipt.sent_sha256, now, record),
    ).rowcount:
        return False
    conn.execute(
        "INSERT INTO steers (session_id, text, task_id, created_at_ms) VALUES (?, ?, ?, ?)",
        (session_id, text, receipt.task_id, now),
    )
    lengths.no_steers.discard(session_id)
    return True


def _steers_recorded_txn(conn: sqlite3.Connection, session_id: str, message_ids: Sequence[str]) -> None:
    conn.executemany(
        "UPDATE steer_receipts SET record = NULL WHERE session_id = ? AND message_id = ?",
        [(session_id, message_id) for message_id in message_ids],
    )


def _save_and_take_txn(
    conn: sqlite3.Connection,
    lengths: SessionLengths,
    session_id: str,
    messages: Sequence[Message],
    max_bytes: int,
    placed: Callable[[str], Message] | None,
    for_task: str | None,
) -> list[str]:
    # Taken first, to be saved with the transcript; a save that fails undoes the take with it.
    taken = _take_steers_txn(conn, lengths, session_id, for_task)
    if placed is not None and taken:
        messages = [*messages, *map(placed, taken)]
    _save_txn(conn, lengths, session_id, messages, max_bytes)
    return taken


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
        await self._writer.submit(_ensure_txn, session_id, app_name, user_id, now_ms())

    async def append(
        self, session_id: str, contents: Sequence[str], *, at: int | None = None, author: str = "agent"
    ) -> int:
        contents = checked_append(session_id, contents, max_bytes=self.max_event_bytes, author=author)
        with naming_session(session_id, given=len(contents)):
            return await self._writer.submit(_append_txn, self._lengths, session_id, contents, at, author)

    async def save(self, session_id: str, messages: Sequence[Message]) -> None:
        check_session_id(session_id)
        # No copy of the transcript: it is read inside this call, against what the writer knows
        # of the session (so a save costs about the same at ten messages as at ten thousand).
        with naming_session(session_id, given=len(messages)):
            await self._writer.submit(_save_txn, self._lengths, session_id, messages, self.max_event_bytes)

    async def events(self, session_id: str, *, after: int = -1) -> list[Event]:
        check_integer(after, f"the seq after which events of session {session_id!r} are read", minimum=-MAX_INTEGER - 1)
        rows = await self.pool.run(
            lambda conn: []
            if lone_surrogate(session_id)
            else conn.execute(
                "SELECT seq, author, created_at_ms, content FROM events WHERE session_id = ? AND seq > ? ORDER BY seq",
                (session_id, after),
            ).fetchall()
        )
        return [Event(seq=seq, author=author, created_at_ms=at, content=content) for seq, author, at, content in rows]

    async def length(self, session_id: str) -> int:
        return await self.pool.run(_length_txn, session_id)

    async def messages(self, session_id: str) -> list[Message]:
        return decode_messages(session_id, [event.content for event in await self.events(session_id)])

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
                _save_and_take_txn, self._lengths, session_id, messages, self.max_event_bytes, placed, for_task
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
        return await self._writer.submit(_add_steer_txn, self._lengths, session_id, text, message_id, receipt, record)

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
        rows = await self.pool.run(
            lambda conn: conn.execute(
                "SELECT session_id, message_id, task_id, record FROM steer_receipts WHERE record IS NOT NULL"
                " AND (?1 IS NULL OR session_id = ?1) AND (?2 IS NULL OR task_id = ?2) ORDER BY created_at_ms, message_id",
                (session_id, task_id),
            ).fetchall()
        )
        return [PendingSteer(session_id=row[0], message_id=row[1], task_id=row[2], record=row[3]) for row in rows]

    async def steers_recorded(self, session_id: str, message_ids: Sequence[str]) -> None:
        ids = [message_id for message_id in message_ids if not lone_surrogate(message_id)]
        if ids and not lone_surrogate(session_id):
            await self._writer.submit(_steers_recorded_txn, session_id, ids)

    async def take_steers(self, session_id: str, *, for_task: str | None = None) -> list[str]:
        return await self._writer.submit(_take_steers_txn, self._lengths, session_id, for_task)

    async def drop_steers(self, session_id: str, *, task_id: str) -> None:
        await self._writer.submit(_drop_steers_txn, session_id, task_id)

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
            _ensure_txn(conn, session_id, DEFAULT_APP_NAME, "", now)
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
    """A session store whose writer runs in a nursery owned by this context."""
    async with running(await SqliteSessionStore.open(path, **options)) as store:
        yield store
