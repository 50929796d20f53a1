"""A message sent to a task that exists: a steer for its run, or a message added to its history.

The runner hands here every message that names its task (``taskId``), and a steer sent again
without it; a message that starts a task stays with the runner. Apart from the runner because
steering reads the runs (``live``) and the conversations' turns (``turns``) but changes neither:
it stores the steer for the session, records the message in the task, or says why it cannot.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from contextlib import nullcontext

import attrs

import persistence.errors as store_errors
from persistence.api import PendingSteer, SessionStore, SteerReceipt, TaskStore
from persistence.locks import holding
from protocol import (
    ContextMismatch,
    InvalidParams,
    Message,
    ProtocolError,
    SendMessageParams,
    Task,
    TaskIsTerminal,
    TaskNotFound,
    UnsupportedOperation,
)
from protocol.errors import quoted
from runtime.agent.steers import steer_message
from runtime.resent import as_sent, check_receipt, check_same, sent_with_other_content, with_message
from runtime.tasks import STORED_VERSION, LiveTask, encode, load, readable_text, refuse_oversize, status_ms
from runtime.turns import Turns

logger = logging.getLogger(__name__)

HISTORY_WRITE_ATTEMPTS = 5
# The most messages a task takes after the one that started it. The task is stored whole at each
# one, and sent whole to each reader: unbounded, one client's steers (a megabyte each) made every
# next steer rewrite the task anew, a write and an encoding on the event loop growing with each.
MAX_STEERS = 32


@attrs.define(eq=False)
class Steering:
    """Messages for the tasks of ``tasks``: ``live`` is the runner's runs, by task id, read as it
    changes (a run may end while a message for it is being taken)."""

    sessions: SessionStore
    tasks: TaskStore
    live: Mapping[str, LiveTask]
    turns: Turns
    stopping: Callable[[], bool] = lambda: False  # whether the server is shutting down (and takes no new task)

    async def to_existing(self, owner: str, task_id: str, params: SendMessageParams) -> Task:
        """The task ``params.message`` names, with that message: a steer for its run while it
        works, recorded in its history either way; that task as it stands for a message it took
        before. Raises TaskNotFound, ContextMismatch, TaskIsTerminal, or InvalidParams and
        UnsupportedOperation saying why the message is not taken and what to send instead."""
        # Its run, looked up before the task is read: one that ends while it is read is still
        # known for what it is, a run that takes no more steers, not taken for no run at all.
        running = self.live.get(task_id)
        task, version = await load(self.tasks, owner, task_id)
        message = params.message
        if message.context_id and message.context_id != task.context_id:
            raise ContextMismatch(message.context_id, task_id, task.context_id)
        # A message this task already took (sent again, its answer lost): the task as it
        # stands, and no second steer.
        live = self.live.get(task_id) or running
        current = live.task if live is not None and live.owner == owner else task
        for taken in current.history:
            if taken.message_id == message.message_id:
                return check_same(message, taken, current, f"went to task {task_id!r}")
        started = await self.tasks.started_by(owner, message.message_id)
        if started is not None:  # another task's first message (this one's is in its history)
            raise InvalidParams(
                "message.messageId",
                problem=f"{quoted(message.message_id)} was sent before, and started task {started!r}; "
                "a new message needs a new messageId",
            )
        message = attrs.evolve(message, context_id=task.context_id)
        # Whether the run can still take a steer is decided, and the steer stored, holding the
        # run's gate: a steer is either stored before the run's last look for steers, or refused.
        async with holding(live.steers.lock) if live is not None else nullcontext():
            return await self._steer(owner, task, version, message, live)

    async def steered_before(self, owner: str, params: SendMessageParams, receipt: SteerReceipt) -> Task:
        """The task a message went to as a steer, for that message sent again: as if sent with
        its taskId, so that one its task never recorded (that write failed) is recorded now."""
        message = params.message
        sent_before = InvalidParams(
            "message.messageId",
            problem=f"{quoted(message.message_id)} was sent before, as a steer in context {message.context_id!r}; "
            "a new message needs a new messageId",
        )
        if receipt.task_id is None:
            raise sent_before
        if not receipt.same(as_sent(message)):
            raise sent_with_other_content(message, f"went to task {receipt.task_id!r}")
        again = attrs.evolve(params, message=attrs.evolve(message, task_id=receipt.task_id))
        try:
            return await self.to_existing(owner, receipt.task_id, again)
        except TaskNotFound:
            raise sent_before from None

    async def record_pending(self, *, context_id: str | None = None, task_id: str | None = None) -> None:
        """Record in its task's history each steer stored but not known to be recorded there (its
        process died between the two writes, or the second failed and its client never sent it
        again), those of ``context_id`` and ``task_id`` where given; then forget what was stored
        for that. A steer that cannot be recorded now is logged, and left for the next call."""
        try:
            pending = await self.sessions.pending_steers(session_id=context_id, task_id=task_id)
        except (store_errors.StoreError, TimeoutError) as exc:
            said = store_errors.told_before(exc) or exc
            logger.warning("the steers stored and not yet in their tasks' histories could not be read: %s", said)
            return
        recorded: dict[str, list[str]] = {}  # message ids, by context: marked in one write each
        for steer in pending:
            try:
                await self._record(steer)
            except (store_errors.StoreError, TimeoutError, ProtocolError, ValueError, KeyError) as exc:
                logger.warning(
                    "task %s: the steer %r stored for it in context %s is not yet in its history: %s",
                    steer.task_id, steer.message_id, steer.session_id, store_errors.told_before(exc) or exc,
                )  # fmt: skip
            else:
                recorded.setdefault(steer.session_id, []).append(steer.message_id)
        for session_id, message_ids in recorded.items():
            try:
                await self.sessions.steers_recorded(session_id, message_ids)
            except (store_errors.StoreError, TimeoutError) as exc:  # recorded again, as a no-op, by the next call
                said = store_errors.told_before(exc) or exc
                logger.warning("context %s: the steers its tasks have recorded could not be marked so: %s", session_id, said)

    async def _record(self, steer: PendingSteer) -> None:
        if steer.task_id is None:
            return
        # A task is stored whole (33 messages of 1 MiB at most): its run's, if it has one, is not
        # read back and decoded for each of its steers, nor a steer it holds already decoded.
        live = self.live.get(steer.task_id)
        if live is not None and any(taken.message_id == steer.message_id for taken in live.task.history):
            return
        stored = json.loads(steer.record)
        owner, message = stored["owner"], Message.from_json(stored["message"], STORED_VERSION)
        if live is not None and live.owner == owner:
            await self._add_to_history(owner, live.task, live.version, message)
            return
        try:
            task, version = await load(self.tasks, owner, steer.task_id)
        except TaskNotFound:  # its task is gone (a state directory put together by hand): nowhere to record it
            return
        await self._add_to_history(owner, task, version, message)

    async def _steer(self, owner: str, task: Task, version: int, message: Message, live: LiveTask | None) -> Task:
        refusal = self._refusal(task, live)
        if refusal is not None:
            receipt = await self.sessions.steer_receipt(task.context_id, message.message_id)
            if receipt is not None:
                # Left as a steer while the task worked, but its record in the task failed (a
                # full disk, or the process died between the two writes): recorded now.
                check_receipt(receipt, message, task.id)
                return await self._add_to_history(owner, task, version, message)
            raise refusal
        text = readable_text(message)
        refuse_oversize(steer_message(text), self.sessions.max_event_bytes)
        # A message to a working task is a steer: stored for the session, taken exactly once
        # before the run's next model request, wherever that run is. Stored with its message id,
        # so that sent again after its record in the task failed (or its process died between
        # the two writes, or while the first send was still writing), it is recorded without
        # steering the run a second time. Stored with the message too, until its task records
        # it: a record that fails, or a process that dies first, leaves it to record_pending.
        if live is not None:
            live.steered = True  # from before the write: a run cancelled during it still forgets the steer
        left = await self.sessions.add_steer(
            task.context_id, text, message_id=message.message_id, task_id=task.id, sent_as=as_sent(message),
            record=_to_record(owner, message),
        )  # fmt: skip
        if not left:
            receipt = await self.sessions.steer_receipt(task.context_id, message.message_id)
            if receipt is not None:
                check_receipt(receipt, message, task.id)
        return await self._add_to_history(owner, task, version, message)

    def _refusal(self, task: Task, live: LiveTask | None) -> ProtocolError | None:
        """Why the task takes no steer now, and what to send instead; None if it takes one."""
        task_id = task.id
        state = task.status.state
        if state.is_terminal:
            return TaskIsTerminal(task_id, state.value, "take a message", instead=self._next_task(task.context_id))
        taken = len((task if live is None else live.task).history) - 1  # after the first message
        if taken >= MAX_STEERS:
            why = f"has taken {taken} messages after its first, as many as a task takes"
            return UnsupportedOperation(f"task {task_id!r} {why}; {self._next_task(task.context_id)}")
        if live is None:
            return None
        if live.scope.cancel_called:  # the task as read may predate the cancel: its run asks the model nothing more
            why = "takes no more messages: it has been canceled"
            return UnsupportedOperation(f"task {task_id!r} {why}; {self._next_task(task.context_id)}")
        if live.turn_over or live.steers.closed:  # its end not yet written, or its last answer on its way
            why = "takes no more messages: its run is giving, or has given, its last answer"
            return UnsupportedOperation(f"task {task_id!r} {why}; {self._next_task(task.context_id)}")
        if live.resuming:
            return UnsupportedOperation(
                f"task {task_id!r} is being taken up again after a restart of the server, which has yet to read where its"
                " run stopped; send this message again in a moment"
            )
        ahead = self.turns.ahead_of(live)
        if ahead is None:
            return None
        # Stored now, it would be taken by the first look of the run ahead, and dropped there as
        # another task's steer: this task's run would never see it. The run ahead is named to
        # steer instead only while it takes steers.
        waits = f"task {task_id!r} has not started: it waits while task {ahead.task.id!r}"
        again = "send this message again once the task is working"
        if ahead.scope.cancel_called:  # still ending (a tool slow to stop, say)
            return UnsupportedOperation(f"{waits}, which has been canceled, lets its conversation's turn go; {again}")
        if ahead.turn_over or ahead.steers.closed:
            return UnsupportedOperation(f"{waits} gives its last answer; {again}")
        return UnsupportedOperation(f"{waits} has its conversation's turn; {again}, or send it to that task to steer it")

    def _next_task(self, context_id: str) -> str:
        """Where a message a task does not take is to go: to the conversation's next task, which
        a server shutting down does not start."""
        if self.stopping():
            return (
                "the server is shutting down and takes no new tasks; once the server that replaces it is up, send this"
                f" message there without a taskId, with contextId {context_id!r}, to start the conversation's next task"
            )
        return f"send this message without a taskId, with contextId {context_id!r}, to start the conversation's next task"

    async def _add_to_history(self, owner: str, task: Task, version: int, message: Message) -> Task:
        """Record a steering message in the task's history, whoever writes the task meanwhile.

        The steer itself is already stored: if the run ended in between, it is recorded on this
        task alone (a later task's run does not take a steer left for another task).
        """
        for _ in range(HISTORY_WRITE_ATTEMPTS):
            live = self.live.get(task.id)
            if live is not None:
                return await live.persist(self.tasks, lambda current: with_message(current, message))
            updated = with_message(task, message)
            if updated is task:
                return task
            try:
                await self.tasks.update(
                    owner, task.id, state=task.status.state.wire_name(STORED_VERSION), task_json=encode(updated),
                    expected_version=version, updated_at_ms=status_ms(updated),
                )  # fmt: skip
                return updated
            except store_errors.VersionConflict:
                task, version = await load(self.tasks, owner, task.id)
        raise UnsupportedOperation(f"task {task.id!r} kept changing while a message was added; send it again")


def _to_record(owner: str, message: Message) -> str:
    """What a steer's task is to record of it (see Steering.record_pending)."""
    stored = {"owner": owner, "message": message.to_json(STORED_VERSION)}
    return json.dumps(stored, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
