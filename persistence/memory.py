"""In-memory stores with the same behaviour as the SQLite ones, for one process's lifetime.

Contents are kept as the stored text (JSON), never as the caller's objects, so nothing the
caller holds is aliased by the store.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import trio

from persistence.api import DEFAULT_APP_NAME, Event, PendingSteer, SteerReceipt, TaskPage, TaskRecord
from persistence.errors import (
    MessageTaken,
    StoreClosed,
    TaskExists,
    TaskNotFound,
    TranscriptConflict,
    VersionConflict,
    naming_session,
)
from persistence.locks import TurnLocks
from persistence.sessions import now_ms
from persistence.tasks import UNFINISHED_STATES, check_listing_time, check_page_size, decode_page_token, take_page
from persistence.transcript import Message
from persistence.validate import (
    MAX_EVENT_BYTES,
    MAX_INTEGER,
    check_integer,
    check_name,
    check_session_id,
    check_steer_params,
    check_task,
    check_task_write,
    checked_append,
    decode_messages,
    plan_save,
)


@attrs.define(eq=False)
class _Closable:
    _closed: bool = attrs.field(init=False, default=False)

    async def _enter(self) -> None:
        """Every call is a checkpoint, and none works on a closed store."""
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise StoreClosed(f"the in-memory {type(self).__name__}")

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        """Nothing to run: writes are immediate. Kept so callers treat every backend alike."""
        task_status.started(self)

    async def aclose(self) -> None:
        self._closed = True


@attrs.define(eq=False)
class MemorySessionData:
    """What a MemorySessionStore holds; two stores over one of these behave like two processes."""

    events: dict[str, list[Event]] = attrs.field(factory=dict)
    states: dict[tuple[str, ...], str] = attrs.field(factory=dict)  # by ("session", id), ("app", name), ("user", app, id)
    steers: dict[str, list[tuple[str, str | None]]] = attrs.field(factory=dict)  # (text, the task it was left for)
    steer_receipts: dict[tuple[str, str], SteerReceipt] = attrs.field(factory=dict)  # by (session id, message id)
    pending: dict[tuple[str, str], PendingSteer] = attrs.field(factory=dict)  # likewise, oldest first
    verified: dict[str, list[Message]] = attrs.field(factory=dict)  # a session's first events, as the messages saved
    locks: TurnLocks = attrs.field(factory=TurnLocks)


@attrs.define(eq=False)
class MemorySessionStore(_Closable):
    data: MemorySessionData = attrs.field(factory=MemorySessionData)
    max_event_bytes: int = attrs.field(default=MAX_EVENT_BYTES, kw_only=True)

    def turn_locks_held(self) -> int:
        return len(self.data.locks)

    async def create_session(self, session_id: str, *, app_name: str = DEFAULT_APP_NAME, user_id: str = "") -> None:
        check_session_id(session_id)
        check_name("app name", app_name)
        check_name("user id", user_id)
        await self._enter()
        self.data.events.setdefault(session_id, [])

    def _extend(self, session_id: str, contents: Sequence[str], author: str) -> int:
        events = self.data.events.setdefault(session_id, [])
        start, now = len(events), now_ms()
        events.extend(Event(seq=start + i, author=author, created_at_ms=now, content=c) for i, c in enumerate(contents))
        return start

    async def append(
        self, session_id: str, contents: Sequence[str], *, at: int | None = None, author: str = "agent"
    ) -> int:
        contents = checked_append(session_id, contents, max_bytes=self.max_event_bytes, author=author)
        with naming_session(session_id, given=len(contents)):
            await self._enter()
        length = len(self.data.events.get(session_id, ()))
        if at is not None and at != length:
            raise TranscriptConflict(session_id, f"an append at position {at} does not follow the {length} stored events")
        return self._extend(session_id, contents, author)

    async def save(self, session_id: str, messages: Sequence[Message]) -> None:
        check_session_id(session_id)
        with naming_session(session_id, given=len(messages)):
            await self._enter()
        self._save_now(session_id, messages)

    def _save_now(self, session_id: str, messages: Sequence[Message]) -> None:
        events = self.data.events.get(session_id, [])
        contents = plan_save(
            session_id,
            messages,
            stored=len(events),
            verified=self.data.verified.setdefault(session_id, []),
            stored_from=lambda start: [event.content for event in events[start:]],
            max_bytes=self.max_event_bytes,
        )
        self._extend(session_id, contents, "agent")

    async def events(self, session_id: str, *, after: int = -1) -> list[Event]:
        check_integer(after, f"the seq after which events of session {session_id!r} are read", minimum=-MAX_INTEGER - 1)
        await self._enter()
        return list(self.data.events.get(session_id, ())[max(after + 1, 0) :])

    async def length(self, session_id: str) -> int:
        await self._enter()
        return len(self.data.events.get(session_id, ()))

    async def messages(self, session_id: str) -> list[Message]:
        return decode_messages(session_id, [event.content for event in await self.events(session_id)])

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
        await self._enter()
        if message_id is not None:
            if (session_id, message_id) in self.data.steer_receipts:
                return False
            self.data.steer_receipts[session_id, message_id] = SteerReceipt.of(text, task_id=task_id, sent_as=sent_as)
            if record is not None:
                self.data.pending[session_id, message_id] = PendingSteer(session_id, message_id, task_id, record)
        self.data.steers.setdefault(session_id, []).append((text, task_id))
        return True

    async def steer_receipt(self, session_id: str, message_id: str) -> SteerReceipt | None:
        await self._enter()
        return self.data.steer_receipts.get((session_id, message_id))

    async def pending_steers(self, *, session_id: str | None = None, task_id: str | None = None) -> list[PendingSteer]:
        await self._enter()
        return [
            steer
            for steer in self.data.pending.values()
            if session_id in (None, steer.session_id) and task_id in (None, steer.task_id)
        ]

    async def steers_recorded(self, session_id: str, message_ids: Sequence[str]) -> None:
        await self._enter()
        for message_id in message_ids:
            self.data.pending.pop((session_id, message_id), None)

    async def take_steers(self, session_id: str, *, for_task: str | None = None) -> list[str]:
        await self._enter()
        return _for(self.data.steers.pop(session_id, []), for_task)

    async def drop_steers(self, session_id: str, *, task_id: str) -> None:
        await self._enter()
        kept = [(text, left_for) for text, left_for in self.data.steers.get(session_id, []) if left_for != task_id]
        if kept:
            self.data.steers[session_id] = kept
        else:
            self.data.steers.pop(session_id, None)

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
            await self._enter()
        waiting = _for(self.data.steers.get(session_id, []), for_task)
        if placed is not None and waiting:
            messages = [*messages, *map(placed, waiting)]
        self._save_now(session_id, messages)  # raises before anything is taken
        self.data.steers.pop(session_id, None)
        return waiting

    def turn_lock(self, session_id: str) -> AbstractAsyncContextManager[None]:
        return self.data.locks.hold(session_id)

    async def _get(self, key: tuple[str, ...]) -> dict[str, object]:
        await self._enter()
        return dict(json.loads(self.data.states.get(key, "{}")))

    async def _set(self, key: tuple[str, ...], state: dict[str, object]) -> None:
        text = json.dumps(state, sort_keys=True)
        await self._enter()
        self.data.states[key] = text

    async def get_state(self, session_id: str) -> dict[str, object]:
        return await self._get(("session", session_id))

    async def set_state(self, session_id: str, state: dict[str, object]) -> None:
        check_session_id(session_id)
        await self._set(("session", session_id), state)
        self.data.events.setdefault(session_id, [])

    async def get_app_state(self, app_name: str) -> dict[str, object]:
        return await self._get(("app", app_name))

    async def set_app_state(self, app_name: str, state: dict[str, object]) -> None:
        check_name("app name", app_name)
        await self._set(("app", app_name), state)

    async def get_user_state(self, app_name: str, user_id: str) -> dict[str, object]:
        return await self._get(("user", app_name, user_id))

    async def set_user_state(self, app_name: str, user_id: str, state: dict[str, object]) -> None:
        check_name("app name", app_name)
        check_name("user id", user_id)
        await self._set(("user", app_name, user_id), state)


def _for(waiting: list[tuple[str, str | None]], task_id: str | None) -> list[str]:
    """The texts of the steers ``task_id``'s run takes (see SessionStore.take_steers)."""
    return [text for text, left_for in waiting if task_id is None or left_for is None or left_for == task_id]


@attrs.define(eq=False)
class MemoryTaskStore(_Closable):
    """Tasks in a dict; pass another store's ``tasks`` and ``started_by_message`` to share them, as two
    processes would."""

    tasks: dict[str, TaskRecord] = attrs.field(factory=dict)
    started_by_message: dict[tuple[str, str], str] = attrs.field(factory=dict)  # (owner, first message id) -> task id

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
        await self._enter()
        if message_id is not None and (owner, message_id) in self.started_by_message:
            raise MessageTaken(message_id, self.started_by_message[owner, message_id])
        if task_id in self.tasks:
            raise TaskExists(task_id)
        if message_id is not None:
            self.started_by_message[owner, message_id] = task_id
        at = now_ms() if updated_at_ms is None else updated_at_ms  # its first status: when it was made
        record = TaskRecord(
            id=task_id, context_id=context_id, owner=owner, state=state, version=1,
            created_at_ms=at, updated_at_ms=at, task_json=task_json,
        )  # fmt: skip
        self.tasks[task_id] = record
        return record

    async def started_by(self, owner: str, message_id: str) -> str | None:
        await self._enter()
        return self.started_by_message.get((owner, message_id))

    async def get(self, owner: str, task_id: str) -> TaskRecord:
        await self._enter()
        record = self.tasks.get(task_id)
        if record is None or record.owner != owner:
            raise TaskNotFound(task_id)
        return record

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
        current = await self.get(owner, task_id)
        if expected_version is not None and expected_version != current.version:
            raise VersionConflict(task_id, expected_version, current.version)
        at = now_ms() if updated_at_ms is None else updated_at_ms
        new = attrs.evolve(current, state=state, task_json=task_json, version=current.version + 1, updated_at_ms=at)
        self.tasks[task_id] = new
        return new

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
        await self._enter()
        matching = sorted(
            (
                r
                for r in self.tasks.values()
                if r.owner == owner
                and (context_id is None or r.context_id == context_id)
                and (state is None or r.state == state)
                and (updated_after_ms is None or r.updated_at_ms > updated_after_ms)
            ),
            key=lambda r: (r.updated_at_ms, r.id),
            reverse=True,
        )
        rest = [r for r in matching if start is None or (r.updated_at_ms, r.id) < start.after]
        total = len(matching) if start is None or start.total is None else start.total  # the listing's (see PageStart)
        records, token = take_page(rest, page_size, filters, total)
        return TaskPage(records=records, next_page_token=token, total_size=total)

    async def unfinished(self) -> Sequence[TaskRecord]:
        await self._enter()
        return sorted((r for r in self.tasks.values() if r.state in UNFINISHED_STATES), key=lambda r: (r.created_at_ms, r.id))

    async def newest_status_ms(self) -> int | None:
        await self._enter()
        return max((record.updated_at_ms for record in self.tasks.values()), default=None)
