"""The SQLite task store (``tasks.db``): one row per A2A task, versioned and owner-scoped."""

from __future__ import annotations

import base64
import json
import sqlite3
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Self

import attrs

from persistence.api import TaskPage, TaskRecord
from persistence.errors import (
    InvalidPage, MessageTaken, PageOfOtherListing, TaskExists, TaskNotFound, UnreadableTask, VersionConflict,
)
from persistence.sessions import now_ms
from persistence.sqlite import Schema, SqlitePool, execute_ddl
from persistence.validate import MAX_INTEGER, check_integer, check_task, check_task_write, lone_surrogate
from persistence.writer import WriterBacked, running

MAX_PAGE_SIZE = 100
# What one page's tasks may hold as stored: a task can hold 33 messages of 1 MiB, so a page of 100
# read whole could be gigabytes. A page ends early past it, with a token for the next.
MAX_PAGE_CHARS = 8 << 20
UNFINISHED_STATES = ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")


def _v1(conn: sqlite3.Connection) -> None:
    execute_ddl(
        conn,
        """
        CREATE TABLE tasks (
            id TEXT PRIMARY KEY,
            context_id TEXT NOT NULL,
            owner TEXT NOT NULL,
            state TEXT NOT NULL,
            version INTEGER NOT NULL,
            created_at_ms INTEGER NOT NULL,
            updated_at_ms INTEGER NOT NULL,
            task TEXT NOT NULL                      -- the task's JSON
        );
        CREATE INDEX tasks_owner_recent ON tasks (owner, updated_at_ms DESC, id DESC);
        CREATE INDEX tasks_context ON tasks (context_id);
        CREATE INDEX tasks_state ON tasks (state);
        """,
    )


def _v2(conn: sqlite3.Connection) -> None:
    # The id of the message that started a task: a client that sends it again (its answer lost
    # to a broken connection or a crash) gets the same task back instead of a second run. Tasks
    # from before have none.
    execute_ddl(
        conn,
        """
        ALTER TABLE tasks ADD COLUMN message_id TEXT;
        CREATE UNIQUE INDEX tasks_by_message ON tasks (owner, message_id) WHERE message_id IS NOT NULL;
        """,
    )


def _v3(conn: sqlite3.Connection) -> None:
    # A listing by context or by state reads that page's rows, and counts them, in an index of
    # its own, however many other tasks there are: on the owner's index alone it walked every
    # task of the owner, holding up every task write behind it in the database's one thread.
    # Tasks left unfinished, which a start looks for, are an index of their own, as small as
    # they are few. (The literals are UNFINISHED_STATES: a partial index is used only by a query
    # that repeats them.) How many tasks each owner has in each state is kept as they are
    # written, by triggers in the same transaction: a listing's total with no filter but the
    # state is read, not counted. (An index an operator dropped is not the schema's to miss.)
    execute_ddl(
        conn,
        """
        DROP INDEX IF EXISTS tasks_context;
        DROP INDEX IF EXISTS tasks_state;
        CREATE INDEX tasks_context_recent ON tasks (owner, context_id, updated_at_ms DESC, id DESC);
        CREATE INDEX tasks_state_recent ON tasks (owner, state, updated_at_ms DESC, id DESC);
        CREATE INDEX tasks_unfinished ON tasks (created_at_ms, id)
            WHERE state IN ('TASK_STATE_SUBMITTED', 'TASK_STATE_WORKING');
        CREATE TABLE task_counts (
            owner TEXT NOT NULL,
            state TEXT NOT NULL,
            tasks INTEGER NOT NULL,
            PRIMARY KEY (owner, state)
        ) WITHOUT ROWID;
        INSERT INTO task_counts (owner, state, tasks) SELECT owner, state, count(*) FROM tasks GROUP BY owner, state;
        CREATE TRIGGER task_counted AFTER INSERT ON tasks BEGIN
            INSERT INTO task_counts (owner, state, tasks) VALUES (new.owner, new.state, 1)
                ON CONFLICT (owner, state) DO UPDATE SET tasks = tasks + 1;
        END;
        CREATE TRIGGER task_counted_again AFTER UPDATE OF state ON tasks WHEN old.state IS NOT new.state BEGIN
            UPDATE task_counts SET tasks = tasks - 1 WHERE owner = old.owner AND state = old.state;
            INSERT INTO task_counts (owner, state, tasks) VALUES (new.owner, new.state, 1)
                ON CONFLICT (owner, state) DO UPDATE SET tasks = tasks + 1;
        END;
        CREATE TRIGGER task_uncounted AFTER DELETE ON tasks BEGIN
            UPDATE task_counts SET tasks = tasks - 1 WHERE owner = old.owner AND state = old.state;
        END;
        """,
    )


TASKS_SCHEMA = Schema(name="keel.tasks", migrations=(_v1, _v2, _v3))

_COLUMNS = "id, context_id, owner, state, version, created_at_ms, updated_at_ms, task"
# What a read takes, the JSON as its bytes, decoded here: a byte of it damaged (no longer UTF-8) is
# then that task's alone to fail, named, rather than SQLite's error for the whole read, quoting it.
_READ = "id, context_id, owner, state, version, created_at_ms, updated_at_ms, CAST(task AS BLOB)"


def record_from_row(row: tuple[Any, ...]) -> TaskRecord:
    id_, context_id, owner, state, version, created, updated, task = row
    try:
        task_json = task.decode()
    except UnicodeDecodeError as exc:
        raise UnreadableTask(id_, f"its JSON is not UTF-8: byte {exc.start} of it is damaged") from None
    return TaskRecord(
        id=id_, context_id=context_id, owner=owner, state=state, version=int(version),
        created_at_ms=int(created), updated_at_ms=int(updated), task_json=task_json,
    )  # fmt: skip


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or not 1 <= page_size <= MAX_PAGE_SIZE:
        raise InvalidPage(f"page size must be between 1 and {MAX_PAGE_SIZE} inclusive, got {page_size!r}")


def check_listing_time(updated_after_ms: int | None) -> None:
    if updated_after_ms is not None:
        check_integer(updated_after_ms, "the time (ms) tasks are listed after", minimum=-MAX_INTEGER - 1)


# What a listing is filtered by, as ``list`` takes them: a page token carries them, and is refused
# with any others (the page after a task of another listing would be silently wrong).
FILTERS = ("context_id", "state", "updated_after_ms")
Filters = tuple[str | None, str | None, int | None]


@attrs.frozen
class PageStart:
    """Where the page a token asks for starts: after the task ``after`` (its status time and id)
    that ended the page before. ``total`` is the listing's ``total_size`` as its first page counted
    it, given again for every later page: counted at each, the tasks after a status time were
    counted whole once a page, and walking a listing's pages took time with the square of their
    number. None in a token of an earlier build, which carries none: counted again then."""

    after: tuple[int, str]
    total: int | None


def encode_page_token(record: TaskRecord, filters: Filters, total: int) -> str:
    raw = json.dumps([record.updated_at_ms, record.id, *filters, total], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def take_page(
    records: Iterable[TaskRecord], page_size: int, filters: Filters, total: int
) -> tuple[tuple[TaskRecord, ...], str]:
    """The first of ``records`` that make a page, and the token of the next page ("" if none): at
    most ``page_size`` of them, and no more once their JSON passes MAX_PAGE_CHARS (at least one).
    ``records`` is read one at a time, and only up to the first one not taken. ``total`` is the
    listing's total, which the token carries to the next page."""
    taken: list[TaskRecord] = []
    chars = 0
    for record in records:
        chars += len(record.task_json)
        if len(taken) == page_size or (taken and chars > MAX_PAGE_CHARS):
            return tuple(taken), encode_page_token(taken[-1], filters, total)
        taken.append(record)
    return tuple(taken), ""


def decode_page_token(token: str, filters: Filters) -> PageStart:
    """Where the page of ``token`` starts; InvalidPage for a token not made here, and
    PageOfOtherListing for one made for a listing with other ``filters``. A token of an earlier
    build carries no filters, and is taken with those it comes with; nor a total, which is then
    counted again."""
    try:
        fields = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        if type(fields) is not list or len(fields) not in (2, 2 + len(FILTERS), 3 + len(FILTERS)):
            raise ValueError
        updated, task_id, *given = fields
        given, counted = given[: len(FILTERS)], given[len(FILTERS) :]  # counted: [the listing's total], in this build's
        if counted and (type(counted[0]) is not int or not 0 <= counted[0] < 2**63):
            raise ValueError
        # A token is only ever made here, but a client can send anything: a time that SQLite
        # cannot hold as an integer would fail the query, not name the token.
        if type(updated) is not int or not 0 <= updated < 2**63 or type(task_id) is not str or lone_surrogate(task_id):
            raise ValueError
        if given and not (all(type(text) in (str, type(None)) for text in given[:2]) and type(given[2]) in (int, type(None))):
            raise ValueError
    except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nested deeper than JSON is read
        raise InvalidPage(
            f"page token {token[:40]!r} is malformed; pass the nextPageToken of the previous page, or none for the first"
        ) from exc
    if given and tuple(given) != filters:
        raise PageOfOtherListing(token, [name for name, was, now in zip(FILTERS, given, filters) if was != now])
    return PageStart(after=(updated, task_id), total=counted[0] if counted else None)


def _create_txn(conn: sqlite3.Connection, record: TaskRecord, message_id: str | None) -> TaskRecord:
    try:
        conn.execute(
            f"INSERT INTO tasks ({_COLUMNS}, message_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (record.id, record.context_id, record.owner, record.state, record.version,
             record.created_at_ms, record.updated_at_ms, record.task_json, message_id),
        )  # fmt: skip
    except sqlite3.IntegrityError as exc:
        found = conn.execute(
            "SELECT id FROM tasks WHERE owner = ? AND message_id = ?", (record.owner, message_id)
        ).fetchone()
        if found is not None:
            raise MessageTaken(str(message_id), found[0]) from exc
        if conn.execute("SELECT 1 FROM tasks WHERE id = ?", (record.id,)).fetchone() is not None:
            raise TaskExists(record.id) from exc
        raise  # not a key taken: the database's own failure (DatabaseFailed, for the writer)
    return record


def _update_txn(
    conn: sqlite3.Connection, owner: str, task_id: str, state: str, task_json: str, expected: int | None, at: int | None
) -> TaskRecord:
    # One statement, the version check in its WHERE: the old task (it grows with its history) is
    # never read back, and the pool's thread makes one round through the driver, not two.
    updated = now_ms() if at is None else at
    check, params = ("", ()) if expected is None else (" AND version = ?", (expected,))
    rows = conn.execute(
        "UPDATE tasks SET state = ?, version = version + 1, updated_at_ms = ?, task = ? WHERE id = ? AND owner = ?"
        f"{check} RETURNING context_id, version, created_at_ms",
        (state, updated, task_json, task_id, owner, *params),
    ).fetchall()
    if not rows:
        found = conn.execute("SELECT version FROM tasks WHERE id = ? AND owner = ?", (task_id, owner)).fetchone()
        if found is None or expected is None:  # without a version to match, only a missing row updates nothing
            raise TaskNotFound(task_id)
        raise VersionConflict(task_id, expected, int(found[0]))
    ((context_id, version, created),) = rows
    return TaskRecord(
        id=task_id, context_id=context_id, owner=owner, state=state, version=int(version),
        created_at_ms=int(created), updated_at_ms=updated, task_json=task_json,
    )  # fmt: skip


def _list_txn(
    conn: sqlite3.Connection, owner: str, listing: Filters, page_size: int, start: PageStart | None
) -> TaskPage:
    filters = dict(zip(("context_id", "state", "updated_at_ms"), listing))  # by column
    where = ["owner = :owner"]
    params: dict[str, Any] = {"owner": owner, "limit": page_size + 1}
    for column, op in (("context_id", "="), ("state", "="), ("updated_at_ms", ">")):
        if filters.get(column) is not None:
            # Given a context, its index is the one to read (a context's tasks are few, a
            # state's may be most): the unary + keeps the planner off the state's.
            term = "+state" if column == "state" and filters.get("context_id") is not None else column
            where.append(f"{term} {op} :{column}")
            params[column] = filters[column]
    if start is not None and start.total is not None:  # the listing's, as its first page counted it
        total = start.total
    elif filters.get("context_id") is None and filters.get("updated_at_ms") is None:  # kept, not counted
        by_state = " AND state = :state" if filters.get("state") is not None else ""
        (total,) = conn.execute(f"SELECT coalesce(sum(tasks), 0) FROM task_counts WHERE owner = :owner{by_state}", params).fetchone()
    else:  # a context's tasks, or those after a time: counted in the index that finds them
        (total,) = conn.execute(f"SELECT count(*) FROM tasks WHERE {' AND '.join(where)}", params).fetchone()
    if start is not None:
        # Keyset pagination: rows strictly after the last one of the previous page.
        where.append("(updated_at_ms < :after_ms OR (updated_at_ms = :after_ms AND id < :after_id))")
        params["after_ms"], params["after_id"] = start.after
    rows = conn.execute(
        f"SELECT {_READ} FROM tasks WHERE {' AND '.join(where)} ORDER BY updated_at_ms DESC, id DESC LIMIT :limit",
        params,
    )
    try:  # read row by row: a page may end before its page size
        records, token = take_page(map(record_from_row, rows), page_size, listing, int(total))
    finally:
        rows.close()
    return TaskPage(records=records, next_page_token=token, total_size=int(total))


@attrs.define(eq=False)
class SqliteTaskStore(WriterBacked):
    """A2A tasks in one SQLite file; writes through a group-commit writer.

    Another owner's task is indistinguishable from a missing one: every call is owner-scoped.
    """

    @classmethod
    async def open(cls, path: Path, *, synchronous: str = "FULL") -> Self:
        return cls(pool=await SqlitePool.open(path, TASKS_SCHEMA, synchronous=synchronous))

    async def create(
        self,
        owner: str,
        *,
        task_id: str,
        context_id: str,
        state: str,
        task_json: str,
        message_id: str | None = None,
        updated_at_ms: int | None = None,
    ) -> TaskRecord:
        check_task(task_id, context_id=context_id, owner=owner, state=state, task_json=task_json, message_id=message_id or "")
        check_task_write(task_id, updated_at_ms=updated_at_ms)
        at = now_ms() if updated_at_ms is None else updated_at_ms  # its first status: when it was made
        record = TaskRecord(
            id=task_id, context_id=context_id, owner=owner, state=state, version=1,
            created_at_ms=at, updated_at_ms=at, task_json=task_json,
        )  # fmt: skip
        return await self._writer.submit(_create_txn, record, message_id)

    async def get(self, owner: str, task_id: str) -> TaskRecord:
        if lone_surrogate(task_id) or lone_surrogate(owner):  # no such text is ever stored
            raise TaskNotFound(task_id)
        row = await self.pool.run(
            lambda conn: conn.execute(f"SELECT {_READ} FROM tasks WHERE id = ? AND owner = ?", (task_id, owner)).fetchone()
        )
        if row is None:
            raise TaskNotFound(task_id)
        return record_from_row(row)

    async def started_by(self, owner: str, message_id: str) -> str | None:
        if lone_surrogate(message_id) or lone_surrogate(owner):  # no such text is ever stored
            return None
        row = await self.pool.run(
            lambda conn: conn.execute(
                "SELECT id FROM tasks WHERE owner = ? AND message_id = ?", (owner, message_id)
            ).fetchone()
        )
        return None if row is None else str(row[0])

    async def update(
        self,
        owner: str,
        task_id: str,
        *,
        state: str,
        task_json: str,
        expected_version: int | None,
        urgent: bool = False,
        updated_at_ms: int | None = None,
    ) -> TaskRecord:
        check_task(task_id, owner=owner, state=state, task_json=task_json)
        check_task_write(task_id, expected_version=expected_version, updated_at_ms=updated_at_ms)
        return await self._writer.submit(
            _update_txn, owner, task_id, state, task_json, expected_version, updated_at_ms, urgent=urgent
        )

    async def list(
        self,
        owner: str,
        *,
        context_id: str | None = None,
        state: str | None = None,
        updated_after_ms: int | None = None,
        page_size: int = 50,
        page_token: str = "",
    ) -> TaskPage:
        check_page_size(page_size)
        check_listing_time(updated_after_ms)
        filters = (context_id, state, updated_after_ms)
        start = decode_page_token(page_token, filters) if page_token else None
        if any(lone_surrogate(text) for text in (owner, context_id or "", state or "")):
            return TaskPage(records=(), next_page_token="", total_size=0)  # no such text is ever stored
        # One read transaction, so the count and the page agree.
        return await self.pool.run(_read_txn, _list_txn, owner, filters, page_size, start)

    async def unfinished(self) -> Sequence[TaskRecord]:
        """Every owner's SUBMITTED or WORKING tasks, oldest first: what a dead process left running."""
        rows = await self.pool.run(lambda conn: conn.execute(_UNFINISHED).fetchall())
        return [record_from_row(row) for row in rows]

    async def newest_status_ms(self) -> int | None:
        """The latest status time of any owner's task: the newest of each owner's, each the first
        row of the owner's index, rather than a walk of every task."""
        return await self.pool.run(lambda conn: conn.execute(_NEWEST).fetchone()[0])


# Written out, not bound: the index of unfinished tasks serves only a query whose WHERE is its own.
_UNFINISHED = (
    f"SELECT {_READ} FROM tasks WHERE state IN ({', '.join(repr(state) for state in UNFINISHED_STATES)})"
    " ORDER BY created_at_ms, id"
)


_NEWEST = (
    "SELECT max((SELECT updated_at_ms FROM tasks WHERE owner = owners.owner ORDER BY updated_at_ms DESC, id DESC LIMIT 1))"
    " FROM (SELECT DISTINCT owner FROM task_counts) AS owners"
)


def _read_txn(conn: sqlite3.Connection, fn: Any, *args: Any) -> Any:
    conn.execute("BEGIN")
    try:
        return fn(conn, *args)
    finally:
        conn.execute("COMMIT")


@asynccontextmanager
async def open_task_store(path: Path, **options: Any) -> AsyncIterator[SqliteTaskStore]:
    """A task store whose writer runs in a nursery owned by this context."""
    async with running(await SqliteTaskStore.open(path, **options)) as store:
        yield store
