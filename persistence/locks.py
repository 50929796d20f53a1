"""Per-key exclusive turns within one process, costing nothing for keys nobody holds."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import attrs
import trio


def holding(lock: trio.Lock) -> AbstractAsyncContextManager[None]:
    """``async with lock``, except that a free lock is taken at once: ``trio.Lock`` always
    passes through the scheduler first, which under load is a whole round of every runnable
    task, on every request. A lock that is held is waited for as usual, in turn; a caller whose
    scope is cancelled is stopped here either way, as at ``trio.Lock``."""
    return _Holding(lock)


class _Holding:
    # A class rather than an @asynccontextmanager: it is entered several times a request, and a
    # generator's context manager costs a few times as much to make, enter and leave.
    __slots__ = ("_lock",)

    def __init__(self, lock: trio.Lock) -> None:
        self._lock = lock

    async def __aenter__(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self._lock.release()


@attrs.define(eq=False)
class TurnLocks:
    """A reference-counted ``trio.Lock`` per key: an entry lives only while someone holds or
    waits for it, and different keys never wait on each other."""

    _entries: dict[str, tuple[trio.Lock, int]] = attrs.field(init=False, factory=dict)

    def hold(self, key: str) -> AbstractAsyncContextManager[None]:
        return _Turn(self._entries, key)

    def __len__(self) -> int:
        """How many keys are held or waited for."""
        return len(self._entries)


class _Turn:
    """One hold of a key's lock (see TurnLocks.hold): counted while it waits and while it holds."""

    __slots__ = ("_entries", "_key", "_lock")

    def __init__(self, entries: dict[str, tuple[trio.Lock, int]], key: str) -> None:
        self._entries = entries
        self._key = key

    async def __aenter__(self) -> None:
        lock, refs = self._entries.get(self._key, (None, 0))
        if lock is None:
            lock = trio.Lock()
        self._entries[self._key] = (lock, refs + 1)
        self._lock = lock
        try:
            await _Holding(lock).__aenter__()
        except BaseException:  # cancelled while it waited: it holds nothing, and is no longer counted
            self._leave()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        lock, refs = self._entries[self._key]
        if refs == 1:
            del self._entries[self._key]
        else:
            self._entries[self._key] = (lock, refs - 1)
