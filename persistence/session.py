"""An addressed session: every call carries the id it was opened with."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from persistence.api import SessionStore
from persistence.errors import naming_session
from persistence.transcript import Message


@attrs.frozen
class Session:
    """A conversation in a SessionStore. Open it with ``Session.open(id, store)``."""

    id: str
    store: SessionStore
    task_id: str | None = None
    """The task whose run this handle serves: steers left for another task are not its to take."""

    @classmethod
    def open(cls, session_id: str, store: SessionStore | None, *, task_id: str | None = None) -> Session:
        if not session_id:
            raise ValueError("a session needs an id; an empty one would collect every conversation in a single bucket")
        if store is None:
            raise ValueError("a session needs a store; persistence.memory.MemorySessionStore lives as long as the process")
        return cls(id=session_id, store=store, task_id=task_id)

    @property
    def max_message_bytes(self) -> int:
        """The largest message the store takes, in bytes as stored (``Message.stored_bytes``)."""
        return self.store.max_event_bytes

    async def save(self, messages: Sequence[Message]) -> None:
        """Persist a transcript that extends the stored one; only the new messages are written."""
        with naming_session(self.id, given=len(messages)):
            await self.store.save(self.id, messages)

    async def messages(self) -> list[Message]:
        """The transcript as stored, in order: what a run continuing the conversation is given,
        with the new messages after it. An unknown session has none."""
        with naming_session(self.id):
            return await self.store.messages(self.id)

    async def steer(self, text: str, *, message_id: str | None = None) -> bool:
        """Leave a steer for whichever run of this session makes the next model request. With
        ``message_id``, one left before with that id is not left again (and the answer is False)."""
        with naming_session(self.id):
            return await self.store.add_steer(self.id, text, message_id=message_id)

    async def take_steers(self) -> list[str]:
        """Hand out the steers waiting for this handle's runs, each once, oldest first (the loop
        takes them itself, with its saves)."""
        with naming_session(self.id):
            return await self.store.take_steers(self.id, for_task=self.task_id)

    async def save_and_take_steers(
        self, messages: Sequence[Message], *, placed: Callable[[str], Message] | None = None
    ) -> list[str]:
        """Save, then take the steers waiting (saved after ``messages`` as ``placed`` makes
        them, if given), as one step: a failed save takes nothing."""
        with naming_session(self.id, given=len(messages)):
            return await self.store.save_and_take_steers(self.id, messages, placed=placed, for_task=self.task_id)
