"""Per-key exclusive turns within one process, costing nothing for keys nobody holds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio


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
            async with lock:
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
