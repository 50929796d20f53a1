"""The group-commit writer: the writes that many tasks queue, committed one transaction a batch."""

from __future__ import annotations

import collections
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import attrs
import trio

from persistence.errors import DatabaseFailed, StoreClosed
from persistence.sqlite import SqlitePool

T = TypeVar("T")
W = TypeVar("W", bound="WriterBacked")


class BatchHooks(Protocol):
    """Called in the pool's thread around every batch transaction."""

    def begin(self, conn: sqlite3.Connection, *, careful: bool) -> None:
        """Right after BEGIN IMMEDIATE, holding the database's write lock; ``careful`` when each
        write of this run of the batch has a savepoint of its own."""

    def finish(self, conn: sqlite3.Connection) -> None:
        """Right before COMMIT, after every write of the batch."""

    def abort(self) -> None:
        """After a ROLLBACK of the whole batch."""

    def item_failed(self) -> None:
        """After one write was rolled back to its savepoint."""


class _Item:
    __slots__ = ("fn", "args", "result", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.result: Any = None
        self.error: BaseException | None = None


class _Batch:
    __slots__ = ("items", "done")

    def __init__(self) -> None:
        self.items: list[_Item] = []
        self.done = trio.Event()


@attrs.define(eq=False)
class GroupCommitWriter:
    """Commits the writes that many tasks queue in one transaction per batch.

    ``await writer.submit(fn, *args)`` returns ``fn(conn, *args)``'s result once the batch
    holding it is durable, or raises what ``fn`` raised (only its own writes are undone). A
    batch is what was queued while the previous one committed, up to ``max_batch`` writes; a
    bounded batch lets the next one fill while this one is committing. Start the writer with
    ``await nursery.start(writer.run)``; a submitter cancelled while it waits does not withdraw
    its write.
    """

    pool: SqlitePool
    hooks: BatchHooks | None = None
    max_batch: int = 1024
    _queue: collections.deque[_Batch] = attrs.field(init=False, factory=collections.deque)
    _wakeup: trio.Event = attrs.field(init=False, factory=trio.Event)
    _started: bool = attrs.field(init=False, default=False)
    _closed: bool = attrs.field(init=False, default=False)
    _stopped: trio.Event = attrs.field(init=False, factory=trio.Event)
    batches: int = attrs.field(init=False, default=0)

    async def run(self, *, task_status: trio.TaskStatus[GroupCommitWriter] = trio.TASK_STATUS_IGNORED) -> None:
        """Commit batches until aclose(); writes still queued when cancelled fail with StoreClosed."""
        self._started = True
        task_status.started(self)
        try:
            while True:
                if not self._queue:
                    if self._closed:
                        return
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
                    continue
                batch = self._queue.popleft()
                try:
                    await self.pool.run(_commit_batch, batch.items, self.hooks)
                except Exception as exc:
                    for item in batch.items:
                        item.error = exc
                except BaseException:  # cancelled before the batch reached the thread: nothing written
                    for item in batch.items:
                        item.error = StoreClosed(str(self.pool.path))
                    raise
                finally:
                    self.batches += 1
                    batch.done.set()
        finally:
            self._closed = True
            for batch in self._queue:
                for item in batch.items:
                    item.error = StoreClosed(str(self.pool.path))
                batch.done.set()
            self._stopped.set()

    async def submit(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise StoreClosed(str(self.pool.path))
        if not self._started:
            raise RuntimeError("The store's writer is not running; start it with `await nursery.start(store.run)`.")
        if not self._queue or len(self._queue[-1].items) >= self.max_batch:
            self._queue.append(_Batch())
        batch = self._queue[-1]
        item = _Item(fn, args)
        batch.items.append(item)
        self._wakeup.set()
        await batch.done.wait()
        if item.error is not None:
            if isinstance(item.error, sqlite3.Error):  # one write's own failure, in careful mode
                raise DatabaseFailed(self.pool.path, item.error) from item.error
            raise item.error
        return item.result  # type: ignore[no-any-return]  # fn's result, set in the pool's thread

    async def aclose(self) -> None:
        """Stop taking writes; those already queued are still committed before run() returns."""
        self._closed = True
        self._wakeup.set()
        await trio.lowlevel.checkpoint()

    async def wait_stopped(self) -> None:
        """Wait until run() has committed what was queued and returned (at once if never run)."""
        if self._started:
            await self._stopped.wait()


def _commit_batch(conn: sqlite3.Connection, batch: list[_Item], hooks: BatchHooks | None) -> None:
    """Commit a batch in one transaction.

    The fast path runs every write without savepoints. If one raises, the whole transaction is
    rolled back and the batch runs again with a savepoint around each write, so that only the
    failing write is undone. A write is a function of the database alone, so running it again
    after a rollback is safe.
    """
    try:
        _transaction(conn, batch, hooks, careful=False)
    except _ItemFailed:
        _transaction(conn, batch, hooks, careful=True)


class _ItemFailed(Exception):
    pass


def _transaction(conn: sqlite3.Connection, batch: list[_Item], hooks: BatchHooks | None, *, careful: bool) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        if hooks is not None:
            hooks.begin(conn, careful=careful)
        for item in batch:
            if careful:
                if not _run_with_savepoint(conn, item) and hooks is not None:
                    hooks.item_failed()
                continue
            try:
                item.result = item.fn(conn, *item.args)
            except Exception as exc:
                raise _ItemFailed from exc
        if hooks is not None:
            hooks.finish(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if hooks is not None:
            hooks.abort()
        raise


def _run_with_savepoint(conn: sqlite3.Connection, item: _Item) -> bool:
    conn.execute("SAVEPOINT item")
    try:
        item.result = item.fn(conn, *item.args)
    except Exception as exc:
        conn.execute("ROLLBACK TO item")
        item.error = exc
    conn.execute("RELEASE item")
    return item.error is None


@attrs.define(eq=False)
class WriterBacked:
    """A store over one pool whose writes go through a group-commit writer it owns."""

    pool: SqlitePool
    _writer: GroupCommitWriter = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._writer = GroupCommitWriter(self.pool, self._batch_hooks())

    def _batch_hooks(self) -> BatchHooks | None:
        return None

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the group-commit writer until aclose(). Start it with ``await nursery.start(store.run)``."""
        await self._writer.run(task_status=task_status)

    @property
    def batches(self) -> int:
        """How many write transactions the writer has committed (or tried to)."""
        return self._writer.batches

    async def aclose(self) -> None:
        """Commit what is queued, stop the writer and close the file. Later calls raise StoreClosed."""
        await self._writer.aclose()
        with trio.move_on_after(10, shield=True):
            await self._writer.wait_stopped()
        await self.pool.aclose()


@asynccontextmanager
async def running(store: W) -> AsyncIterator[W]:
    """Run ``store``'s writer in a nursery owned by this context; close the store on exit."""
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            try:
                yield store
            finally:
                await store.aclose()
    finally:
        await store.pool.aclose()
