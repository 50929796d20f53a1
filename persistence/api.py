"""The store contracts every backend keeps (SQLite, in-memory, and later PostgreSQL).

``persistence.storetest.run_contract`` holds each backend to them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import attrs

from persistence.transcript import Message

DEFAULT_APP_NAME = "keel"


@attrs.frozen
class Event:
    """One stored event: its position in the session (0-based), author, time and content."""

    seq: int
    author: str
    created_at_ms: int
    content: str


@attrs.frozen
class SteerReceipt:
    """What a session store keeps of a steer left with a message id, after the steer is taken."""

    task_id: str | None  # the task it was sent to, if it was given
    sent_sha256: str  # of the message as it was sent (its text, unless add_steer was told otherwise), UTF-8

    @classmethod
    def of(cls, text: str, *, task_id: str | None, sent_as: str | None) -> SteerReceipt:
        """The receipt of a steer left with ``text``, sent as ``sent_as`` (by default the text)."""
        return cls(task_id=task_id, sent_sha256=steer_digest(text if sent_as is None else sent_as))

    def same(self, sent_as: str) -> bool:
        """Whether a message sent as ``sent_as`` is the one this steer came in."""
        return self.sent_sha256 == steer_digest(sent_as)


@attrs.frozen
class PendingSteer:
    """A steer left with a ``record`` (see ``SessionStore.add_steer``) not yet marked recorded."""

    session_id: str
    message_id: str
    task_id: str | None
    record: str  # as add_steer was given it


def steer_digest(sent_as: str) -> str:
    return hashlib.sha256(sent_as.encode("utf-8", "surrogatepass")).hexdigest()


class SessionStore(Protocol):
    """Sessions, their ordered append-only events, state, and pending steers."""

    max_event_bytes: int
    """The largest event the store takes, in bytes as stored (a message's ``to_json``, UTF-8)."""

    async def append(
        self, session_id: str, contents: Sequence[str], *, at: int | None = None, author: str = "agent"
    ) -> int:
        """Append events at the end of the session; returns the first one's seq once all are durable.

        Each content must be JSON text and is stored byte for byte. Raises InvalidEvent (nothing
        written) for bad content; with ``at``, TranscriptConflict unless the session holds
        exactly ``at`` events (an optimistic check for a single writer).
        """

    async def events(self, session_id: str, *, after: int = -1) -> list[Event]:
        """The session's events with seq > after, in order; an unknown session has none."""

    async def length(self, session_id: str) -> int: ...

    async def create_session(self, session_id: str, *, app_name: str = DEFAULT_APP_NAME, user_id: str = "") -> None:
        """Create the session if it does not exist (concurrent first uses create one)."""

    async def save(self, session_id: str, messages: Sequence[Message]) -> None:
        """Store a transcript that extends the stored one, writing only the new messages."""

    async def messages(self, session_id: str) -> list[Message]: ...

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
        """Leave a steer for the session's next model request; True once it is durable. With
        ``message_id`` a receipt is kept too (with ``task_id``, and a digest of ``sent_as``, the
        message as its client sent it, by default the text), and a steer left before with that
        id (taken since or not) is not left again: nothing is stored and the answer is False
        (see ``steer_receipt`` for what was left). With ``message_id``, ``record`` is what the
        caller has still to record of the steer elsewhere (its task's history): kept with the
        receipt, in the same step, until ``steers_recorded`` says it is recorded, so that a
        process that dies in between leaves it to the next (``pending_steers``)."""

    async def steer_receipt(self, session_id: str, message_id: str) -> SteerReceipt | None:
        """The receipt of the steer left for the session with this message id, if one was."""

    async def pending_steers(self, *, session_id: str | None = None, task_id: str | None = None) -> list[PendingSteer]:
        """The steers left with a ``record`` that no ``steers_recorded`` has marked, oldest first:
        those of ``session_id`` and left for ``task_id``, where given."""

    async def steers_recorded(self, session_id: str, message_ids: Sequence[str]) -> None:
        """Mark the steers of the session left with these message ids as recorded (their
        ``record`` is forgotten; their receipts are kept). Unknown ids are ignored."""

    async def take_steers(self, session_id: str, *, for_task: str | None = None) -> list[str]:
        """Hand out every waiting steer exactly once, oldest first, and forget them.

        With ``for_task`` (the task whose run takes them), a steer left for another task
        (``add_steer``'s ``task_id``) is forgotten without being handed out: a session has one
        run at a time, so that task's run has ended without taking it, and its task's record
        is where it stays. It is never applied to a later task's question."""

    async def drop_steers(self, session_id: str, *, task_id: str) -> None:
        """Forget the steers left for ``task_id`` (``add_steer``'s ``task_id``) that no run took,
        without handing them out: that task's run has ended, its end stored, so none ever will,
        and its task's record is where they stay. The steers left for no task or for another
        task, and every receipt, are kept."""

    async def save_and_take_steers(
        self,
        session_id: str,
        messages: Sequence[Message],
        *,
        placed: Callable[[str], Message] | None = None,
        for_task: str | None = None,
    ) -> list[str]:
        """``save`` then ``take_steers`` as one step (one transaction where there are any): a
        save that fails takes nothing, so the steers wait for the next taker. With ``placed``,
        each steer taken is saved too, as the message ``placed`` makes of it, after ``messages``
        and in the same step: a steer is never taken without being kept. ``for_task`` as for
        ``take_steers``."""

    def turn_lock(self, session_id: str) -> AbstractAsyncContextManager[None]:
        """Exclusive turn on one session; different sessions never wait on each other."""

    def turn_locks_held(self) -> int:
        """How many sessions have a turn held or waited for; idle sessions cost nothing."""

    async def get_state(self, session_id: str) -> dict[str, object]: ...

    async def set_state(self, session_id: str, state: dict[str, object]) -> None: ...

    async def aclose(self) -> None: ...


@attrs.frozen
class TaskRecord:
    """One A2A task as stored: indexed columns beside the task's JSON."""

    id: str
    context_id: str
    owner: str
    state: str
    version: int
    created_at_ms: int
    updated_at_ms: int
    task_json: str


@attrs.frozen
class TaskPage:
    records: tuple[TaskRecord, ...]
    next_page_token: str  # "" on the last page
    total_size: int


class TaskStore(Protocol):
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
        """A new task at version 1. ``message_id``: the id of the message that starts it, which
        starts no other task of this owner (MessageTaken names the one it did start).
        ``updated_at_ms``: the time of its state (its status timestamp), which ``list`` orders
        and filters by, and of its making, which ``unfinished`` orders by; now, by default."""
        ...

    async def get(self, owner: str, task_id: str) -> TaskRecord: ...

    async def started_by(self, owner: str, message_id: str) -> str | None:
        """The id of the owner's task that the message with this id started, if one did."""
        ...

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
        """Replace the task's state and JSON, checking ``expected_version`` unless None.
        ``urgent``: the write a client is waiting on (a cancel) goes ahead of writes queued for
        the same commit, where the store has such a queue. ``updated_at_ms`` as for ``create``."""
        ...

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
        """The owner's tasks matching the filters, the most recent status first, a page at a time.
        ``total_size`` is how many matched as the listing's first page was read: its later pages
        (``page_token``) give that count again rather than count once more."""
        ...

    async def unfinished(self) -> Sequence[TaskRecord]:
        """Every owner's SUBMITTED or WORKING tasks, oldest first: what a dead process left running."""
        ...

    async def newest_status_ms(self) -> int | None:
        """The latest ``updated_at_ms`` of any owner's task (its status time); None with no tasks."""
        ...

    async def aclose(self) -> None: ...
