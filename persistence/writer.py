"""The group-commit writer: the writes that many tasks queue, committed one transaction a batch."""

from __future__ import annotations

import collections
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import attrs
import outcome
import trio

from persistence.errors import DatabaseGone, StoreClosed
from persistence.sqlite import SqlitePool, begin_immediate, damaged

T = TypeVar("T")
W = TypeVar("W", bound="WriterBacked")


class BatchHooks(Protocol):
    """Called in the pool's thread around every batch of writes.

    A batch's writes first run on what the hooks know, with the transaction not yet begun: the
    first write that calls into the database begins it (``begin``). If none did,
    ``commit_alone`` writes what they left to write in one statement that commits itself."""

    def start(self, *, careful: bool) -> None:
        """Before the batch's writes run; ``careful`` when each write of this run of the batch
        has a savepoint of its own (its transaction is begun first)."""

    def begin(self, conn: sqlite3.Connection) -> bool:
        """Right after BEGIN IMMEDIATE, holding the database's write lock: whether what the
        hooks knew still holds (if not, it is forgotten, and writes that ran on it run again)."""

    def commit_alone(self, conn: sqlite3.Connection) -> bool:
        """With no transaction begun: write what the batch's writes left to write in one
        statement that commits itself, provided what the hooks know still holds. False when
        nothing was written: it did not hold, or the writes are too many for one statement."""

    def finish(self, conn: sqlite3.Connection) -> None:
        """Right before COMMIT, after every write of the batch."""

    def abort(self) -> None:
        """After a ROLLBACK of the whole batch, or a run of it that is to run again."""

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
    __slots__ = ("items", "done", "urgent")

    def __init__(self, *, urgent: bool = False) -> None:
        self.items: list[_Item] = []
        self.done = trio.Event()
        self.urgent = urgent

    def failed(self, error: BaseException) -> None:
        for item in self.items:
            item.error = error

    def fail(self, error: BaseException) -> None:  # in the Trio thread
        self.failed(error)
        self.done.set()


@attrs.define(eq=False)
class GroupCommitWriter:
    """Commits the writes that many tasks queue in one transaction per batch.

    ``await writer.submit(fn, *args)`` returns ``fn(conn, *args)``'s result once the batch
    holding it is durable, or raises what ``fn`` raised (only its own writes are undone). A
    batch is what was queued while the previous one committed, up to ``max_batch`` writes. A
    submitter cancelled while it waits does not withdraw its write.

    The bound keeps two batches going under load: one commits while the event loop hands back
    the one before and its writers queue the next. With 64 writers appending at once, batches
    of 32 commit about a third more appends a second than batches of all 64 on a 2-core
    machine, where the one batch and its hand-back took turns.

    The pool's thread takes the batches itself: a write queued while the writer is idle posts
    a flush to the pool, and a flush that leaves writes queued posts the next one, so a write
    waits for no Trio task to be scheduled before it is committed, and its submitter is woken
    straight from the thread's hand-back. Under load every such wait is a full round of the
    Trio scheduler. ``run()`` owns the writer's lifetime: start it with
    ``await nursery.start(writer.run)``; it returns after ``aclose()`` once the writes queued
    are committed, and if it is cancelled instead, the writes not yet taken fail StoreClosed.
    """

    pool: SqlitePool
    hooks: BatchHooks | None = None
    max_batch: int = 32
    # Batches not yet taken by the pool's thread, and whether a flush is posted or running:
    # shared with that thread, under the lock.
    _queue: collections.deque[_Batch] = attrs.field(init=False, factory=collections.deque)
    _flushing: bool = attrs.field(init=False, default=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _token: trio.lowlevel.TrioToken | None = attrs.field(init=False, default=None)
    _closed: bool = attrs.field(init=False, default=False)
    _drained: trio.Event = attrs.field(init=False, factory=trio.Event)  # closed, and nothing left
    _stopped: trio.Event = attrs.field(init=False, factory=trio.Event)
    batches: int = attrs.field(init=False, default=0)
    # The batch the pool's thread takes next, and how many writes it held when the file was
    # checked for it: touched in that thread alone.
    _checked: tuple[_Batch, int] | None = attrs.field(init=False, default=None)

    async def run(self, *, task_status: trio.TaskStatus[GroupCommitWriter] = trio.TASK_STATUS_IGNORED) -> None:
        """Take writes until aclose(), then return once they are committed; if cancelled, the
        writes not yet taken by the pool's thread fail with StoreClosed."""
        self._token = trio.lowlevel.current_trio_token()
        task_status.started(self)
        try:
            await self._drained.wait()
        finally:
            self._closed = True
            self._fail_queued(StoreClosed(str(self.pool.path)))
            self._stopped.set()

    async def submit(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        """Run ``fn(conn, *args)`` in the next batch; return its result once that is durable.

        ``urgent``: committed next, ahead of the writes queued before it (behind only the batch
        already committing), in a batch that holds urgent writes alone: for the one write a
        client waits on while the writer is busy. Two writes of one thing must not be in
        flight at once either way, since an urgent one may overtake the other."""
        if self._closed:
            raise StoreClosed(str(self.pool.path))
        if self._token is None:
            raise RuntimeError("The store's writer is not running; start it with `await nursery.start(store.run)`.")
        item = _Item(fn, args)
        with self._lock:
            batch = self._open_batch(urgent)
            batch.items.append(item)
            post, self._flushing = not self._flushing, True
        if post:
            self.pool.post(self._flush, token=self._token, then=self._flushed)
        await batch.done.wait()
        if item.error is not None:
            if isinstance(item.error, sqlite3.Error):  # one write's own failure, in careful mode
                raise self.pool.failure(item.error) from item.error
            raise item.error
        return item.result  # type: ignore[no-any-return]  # fn's result, set in the pool's thread

    def _open_batch(self, urgent: bool) -> _Batch:  # under the lock
        """The batch a write joins: the newest one, or for an urgent write the urgent batch at
        the front; a new one when that is full or of the other kind."""
        queue = self._queue
        batch = (queue[0] if urgent else queue[-1]) if queue else None
        if batch is None or batch.urgent != urgent or len(batch.items) >= self.max_batch:
            batch = _Batch(urgent=urgent)
            if urgent:
                queue.appendleft(batch)
            else:
                queue.append(batch)
        return batch

    def _flush(self, conn: sqlite3.Connection) -> _Batch | None:  # in the pool's thread
        """Commit the oldest batch; post the next flush if more are queued.

        A write is committed only once the file and its -wal were found in place after it was
        submitted (a write to a file deleted under the server is lost): by a check as its batch
        is taken, or by one the flush before made for it. Under load that one is made right
        after a commit, when the event loop is likely idle; made as the batch is taken, each of
        its stats would wait for the GIL while the event loop hands back the batch before."""
        with self._lock:
            batch = self._queue.popleft() if self._queue else None
            checked = batch is not None and self._checked == (batch, len(batch.items))
        self._checked = None
        committed = False
        if batch is not None:
            try:
                if not checked:
                    self._check_file(conn)
                _commit_batch(conn, batch.items, self.hooks)
                committed = True
            except sqlite3.Error as exc:  # named for the file, as the pool names its own calls' errors
                batch.failed(self.pool.failure(exc))
            except BaseException as exc:  # even SystemExit from a write: its batch fails, the writer goes on
                batch.failed(exc)
        following = None
        with self._lock:
            self._flushing = bool(self._queue)
            if self._flushing:
                assert self._token is not None
                self.pool.post(self._flush, token=self._token, then=self._flushed)
                following = (self._queue[0], len(self._queue[0].items))  # its writes submitted so far
        if committed and following is not None:
            try:
                self.pool.check_file()
            except DatabaseGone:
                pass  # checked again as it is taken, and failed then
            else:
                self._checked = following
        return batch

    def _check_file(self, conn: sqlite3.Connection) -> None:
        """Raise DatabaseGone if the file, or its -wal, is no longer at its path: a write to a
        file deleted under the server is lost. Two stats."""
        try:
            self.pool.check_file()
        except DatabaseGone as gone:
            if gone.log:  # what the removed -wal holds, acknowledged, goes into the file, durable there
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            raise

    def _flushed(self, result: outcome.Outcome[_Batch | None]) -> None:  # in the Trio thread
        try:
            batch = result.unwrap()
        except Exception as exc:  # the pool closed under the writer: nothing more will be written
            self._flushing = False  # the flush never ran, so it posted no other
            self._fail_queued(exc)
            batch = None
        if batch is not None:
            self.batches += 1
            batch.done.set()
        if self._closed and not self._flushing:
            self._drained.set()

    def _fail_queued(self, error: BaseException) -> None:  # in the Trio thread
        """Fail every batch the pool's thread has not taken."""
        with self._lock:
            left = list(self._queue)
            self._queue.clear()
        for batch in left:
            batch.fail(error)

    async def aclose(self) -> None:
        """Stop taking writes; those already queued are still committed before run() returns."""
        self._closed = True
        if not self._flushing:
            self._drained.set()
        await trio.lowlevel.checkpoint()

    async def wait_stopped(self) -> None:
        """Wait until run() has committed what was queued and returned (at once if never run)."""
        if self._token is not None:
            await self._stopped.wait()


def _commit_batch(conn: sqlite3.Connection, batch: list[_Item], hooks: BatchHooks | None) -> None:
    """Commit a batch in one transaction.

    The fast path runs every write without savepoints. If one raises (or the writes the hooks
    deferred to the end of the batch do), the whole transaction is rolled back and the batch
    runs again with a savepoint around each write, so that only the failing write is undone. A
    write is a function of the database alone, so running it again after a rollback is safe.

    Once SQLite finds a page damaged it fails every statement left in that transaction, its
    COMMIT too, savepoints or not: a batch that fails so runs again with each write in a
    transaction of its own, so that only the writes that reach the damage fail.
    """
    try:
        try:
            _transaction(conn, batch, hooks, careful=False)
        except _ItemFailed:
            _transaction(conn, batch, hooks, careful=True)
    except sqlite3.Error as exc:
        if len(batch) == 1 or not damaged(exc):
            raise
        for item in batch:
            item.error = None  # what the batch's run said of it, after the damage, was not its own
            try:
                _transaction(conn, [item], hooks, careful=True)
            except BaseException as own:  # as a batch that fails whole: the write fails, the writer goes on
                item.error = own


class _ItemFailed(Exception):
    pass


def _transaction(conn: sqlite3.Connection, batch: list[_Item], hooks: BatchHooks | None, *, careful: bool) -> None:
    if hooks is not None and not careful:
        deferred = _Deferred(conn, hooks)
        try:
            if _run_deferred(conn, deferred, batch, hooks):
                return
        except BaseException:
            _undo(conn, hooks)
            raise
        _undo(conn, hooks)  # what the hooks knew was out of date: run the batch again, on the database
    begin_immediate(conn)
    try:
        if hooks is not None:
            hooks.start(careful=careful)
            hooks.begin(conn)
        for item in batch:
            if careful:
                if not _run_with_savepoint(conn, item) and hooks is not None:
                    hooks.item_failed()
                continue
            try:
                item.result = item.fn(conn, *item.args)
            except BaseException as exc:  # SystemExit too: run again carefully, it fails its own write alone
                raise _ItemFailed from exc
        if hooks is not None:
            _finish(hooks, conn, careful=careful)
        conn.commit()
    except BaseException:
        _undo(conn, hooks)
        raise


def _run_deferred(conn: sqlite3.Connection, deferred: _Deferred, batch: list[_Item], hooks: BatchHooks) -> bool:
    """Run the batch's writes on what the hooks know, and commit them; False if that was out of
    date (nothing is committed then).

    Most batches (appends and saves to sessions the writer knows) then make one call into SQLite
    where a transaction makes four or more, and each call lets go of the GIL and must take it
    back, which under load is a wait for the event loop: with the calls spared, the next batch
    commits while the event loop hands back the last."""
    hooks.start(careful=False)
    for item in batch:
        try:
            item.result = item.fn(deferred, *item.args)
        except BaseException as exc:
            if deferred.failed is not None:  # BEGIN failed: the batch fails, as it did before any write
                raise deferred.failed from None
            if deferred.stale:
                return False
            raise _ItemFailed from exc
    if deferred.failed is not None or deferred.stale:  # a write caught what its call raised
        return deferred.begin()  # raises what BEGIN raised, or returns False
    if not deferred.begun:
        try:
            if hooks.commit_alone(conn):
                return True
        except sqlite3.OperationalError:  # the database's (locked, full, ...): the batch fails
            raise
        except Exception as exc:  # one write's events failed the statement: find it carefully
            raise _ItemFailed from exc
        if not deferred.begin():
            return False
    _finish(hooks, conn, careful=False)
    conn.commit()
    return True


def _finish(hooks: BatchHooks, conn: sqlite3.Connection, *, careful: bool) -> None:
    try:
        hooks.finish(conn)
    except Exception as exc:
        if careful:
            raise
        # Writes the hooks deferred to the end of the batch failed together: run the
        # batch again carefully, where each write does its own inside its savepoint.
        raise _ItemFailed from exc


def _undo(conn: sqlite3.Connection, hooks: BatchHooks | None) -> None:
    if conn.in_transaction:
        conn.rollback()
    if hooks is not None:
        hooks.abort()


class _Deferred:
    """The connection as a batch's writes see it before its transaction is begun: the first
    write that calls into it begins the transaction. If the hooks then find that what they knew
    is out of date (the writes before it ran on it), the call raises, and the batch runs again.
    A write calls ``execute`` and ``executemany`` only."""

    __slots__ = ("_conn", "_hooks", "begun", "stale", "failed")

    def __init__(self, conn: sqlite3.Connection, hooks: BatchHooks) -> None:
        self._conn = conn
        self._hooks = hooks
        self.begun = False
        self.stale = False
        self.failed: BaseException | None = None  # what beginning raised, raised again by every later call

    def begin(self) -> bool:
        """Begin the transaction if it is not; whether what the hooks knew still held."""
        if self.failed is not None:
            raise self.failed
        if not self.begun:
            try:
                begin_immediate(self._conn)
                self.begun = True
                self.stale = not self._hooks.begin(self._conn)
            except BaseException as exc:
                self.failed = exc
                raise
        return not self.stale

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if not self.begin():
            raise _Stale
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, params: Any) -> sqlite3.Cursor:
        if not self.begin():
            raise _Stale
        return self._conn.executemany(sql, params)


class _Stale(Exception):
    pass


def _run_with_savepoint(conn: sqlite3.Connection, item: _Item) -> bool:
    conn.execute("SAVEPOINT item")
    try:
        item.result = item.fn(conn, *item.args)
    except BaseException as exc:  # the pool's thread: no Cancelled here, and no KeyboardInterrupt
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
        """Commit what is queued, stop the writer and close the file. Later calls raise StoreClosed.

        Its caller bounds it (and shields it, if it must run in a cancelled scope): a write
        waiting on a stalled disk, or on another program's lock, would hold it past any bound
        of its own. Cancelled, the file is still closed by the pool's thread once it gets there."""
        try:
            await self._writer.aclose()
            await self._writer.wait_stopped()
        finally:
            await self.pool.aclose()


@asynccontextmanager
async def running(store: W) -> AsyncIterator[W]:
    """Run ``store``'s writer in a nursery owned by this context; close the store on exit.

    An error raised in the block comes out of it as itself, not inside the nursery's exception
    group, so that a caller's ``except`` around the block (a ModelError, say) catches it."""
    raised: Exception | None = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            try:
                yield store
            except Exception as exc:  # the block's own; Cancelled and KeyboardInterrupt go on through the nursery
                raised = exc
            finally:
                await store.aclose()
    finally:
        await store.pool.aclose()
    if raised is not None:
        raise raised
