"""Per-key exclusive turns within one process, costing nothing for keys nobody holds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio


@asynccontextmanager
async def holding(lock: trio.Lock) -> AsyncIterator[None]:
    """``async with lock``, except that a free lock is taken at once: ``trio.Lock`` always
    passes through the scheduler first, which under load is a whole round of every runnable
    task, on every request. A lock that is held is waited for as usual, in turn."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()
    try:
        yield
    finally:
        lock.release()


@attrs.define(eq=False)
class TurnLocks:
    """A reference-counted ``trio.Lock`` per key: an entry lives only while someone holds or
    waits for it, and different keys never wait on each other."""

    _entries: dict[str, tuple[trio.Lock, int]] = attrs.field(init=False, factory=dict)

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, refs = self._entries.get(key, (None, 0))
        if lock is None:
            lock = trio.Lock()
        self._entries[key] = (lock, refs + 1)
        try:
            async with holding(lock):
                yield
        finally:
            lock_now, refs_now = self._entries[key]
            if refs_now == 1:
                del self._entries[key]
            else:
                self._entries[key] = (lock_now, refs_now - 1)

    def __len__(self) -> int:
        """How many keys are held or waited for."""
        return len(self._entries)
