"""The runner owns every run: one cancel scope per task, turn locks, durable task states.

HTTP handlers call ``send``, ``wait_settled``, ``cancel``, ``get``, ``list_tasks`` and
``subscribe``; the runs themselves live in the runner's nursery, never in a request's, so a
client that goes away ends only its own subscription.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext

import attrs
import trio

import persistence.errors as store_errors
from persistence.api import SessionStore, SteerReceipt, TaskStore
from persistence.locks import TurnLocks
from persistence.session import Session
from persistence.transcript import Message as Transcribed
from protocol import (
    DEFAULT_PAGE_SIZE,
    END_LEFT_FOR_NEXT,
    ContextMismatch,
    EndNotStored,
    InvalidParams,
    ListTasksParams,
    ListTasksResult,
    Message,
    PushNotificationNotSupported,
    SendMessageParams,
    StreamCut,
    Task,
    TaskIsTerminal,
    TaskNotCancelable,
    TaskNotFound,
    TaskState,
    TaskStatus,
    UnsupportedOperation,
    trim_history,
)
from protocol.errors import quoted
from runtime.agent import AgentError, AgentRun, AgentSpec, Model
from runtime.agent.steers import steer_message
from runtime.endings import (
    CANCELED,
    OVERTAKEN,
    SHUT_DOWN,
    Outcome,
    Working,
    answer_streamer,
    answered,
    keeping_answer,
    settle,
    turn_of,
    unless_settled,
)
from runtime.models import ModelError
from runtime.resent import as_sent, check_receipt, check_same, sent_with_other_content, with_message
from runtime.tasks import (
    STORED_VERSION,
    LiveTask,
    StreamItem,
    agent_message,
    answer_artifact,
    decode,
    encode,
    epoch_ms_up,
    load,
    message_text,
    new_id,
    now,
    readable_text,
    status_ms,
    with_status,
)

logger = logging.getLogger(__name__)

ANONYMOUS = "anonymous"  # the owner of every task until requests carry an identity
HISTORY_WRITE_ATTEMPTS = 5
# A final state the store refused is tried again after 1 s, then twice as long each time, at most 30 s apart.
END_RETRY_FIRST_S = 1.0
END_RETRY_MAX_S = 30.0


STOPPING = "the server is shutting down and takes no new tasks; send it again once the server that replaces it is up"


@attrs.frozen
class RunnerStatistics:
    running: int  # tasks with a run in this process
    subscribers: int  # open subscriptions to those tasks (streams, resubscriptions)


@attrs.frozen
class RunnerConfig:
    orphans: str = "resume"  # or "fail": what to do with tasks a dead process left unfinished
    drain_timeout_s: float = 10.0
    cleanup_timeout_s: float = 5.0
    model_endpoint: str = ""  # where the model is served, for the log (no credentials): ModelConfig.endpoint


@attrs.define(eq=False)
class Runner:
    """Start it with ``runner = await nursery.start(Runner(...).run)``; stop it with ``stop()``."""

    sessions: SessionStore
    tasks: TaskStore
    model: Model
    agent: AgentSpec
    config: RunnerConfig = RunnerConfig()
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None)
    _live: dict[str, LiveTask] = attrs.field(init=False, factory=dict)
    # Contexts minted by send() whose first turn has not begun: no transcript is stored for
    # them yet, so that turn need not read one. The task id is the task that minted it.
    _fresh: dict[str, str] = attrs.field(init=False, factory=dict)
    # Tasks resumed at startup, by id: the event set once the task before it on its context has
    # queued for the turn lock, and the one this task sets when it has. So the turns of one
    # context are taken in the order their tasks were created, as they would have been.
    _in_line: dict[str, tuple[trio.Event | None, trio.Event]] = attrs.field(init=False, factory=dict)
    # Each conversation's runs that hold or wait for its turn, in the order they queued for it
    # (the turn lock's order: first come, first served). The first holds the turn, or is being
    # handed it: a run handed the turn goes on only at the scheduler's next pass, after the one
    # before it has let go.
    _turns: dict[str, list[LiveTask]] = attrs.field(init=False, factory=dict)
    _message_turns: TurnLocks = attrs.field(init=False, factory=TurnLocks)  # by messageId: see send
    _stopping: trio.Event = attrs.field(init=False, factory=trio.Event)
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)  # set while no run is live
    # Sends past the stopping check whose task row is still being written: the drain waits for
    # them, and runs they start once it is over are cancelled at once.
    _sending: _Count = attrs.field(init=False, factory=lambda: _Count())
    _drained: bool = attrs.field(init=False, default=False)
    _abandoned: bool = attrs.field(init=False, default=False)  # see abandon()
    _stopped: trio.Event = attrs.field(init=False, factory=trio.Event)
    _drain: trio.CancelScope | None = attrs.field(init=False, default=None)  # the drain's wait, once begun
    _creating: set[trio.CancelScope] = attrs.field(init=False, factory=set)  # sends' task writes under way
    _hurried: bool = attrs.field(init=False, default=False)  # see hurry()

    async def run(self, *, task_status: trio.TaskStatus[Runner] = trio.TASK_STATUS_IGNORED) -> None:
        """Deal with what a dead process left, serve until ``stop()``, then drain.

        Draining gives runs ``drain_timeout_s`` to finish, then cancels them; each writes its
        terminal state before this returns. A send taken before ``stop()`` whose task is written
        during the drain is drained with the others; written after it, its run is cancelled.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self._adopt_orphans()
                task_status.started(self)
                await self._stopping.wait()
                running = len(self._live)
                try:
                    with trio.move_on_after(self.config.drain_timeout_s) as self._drain:
                        if self._hurried:
                            self._drain.cancel()
                        while self._live or self._sending.count:
                            await (self._idle.wait() if self._live else self._sending.wait_none())
                except trio.Cancelled:  # the runner itself cancelled (a third signal)
                    if not self._abandoned:
                        self._say_cut("are canceled at once, the drain cut short")
                    raise
                self._drained = True
                if running and not self._live:
                    logger.info("shutting down: every task running finished")
                if self._hurried:
                    self._say_cut("are canceled at once, the drain cut short")
                else:
                    self._say_cut(f"did not finish within {self.config.drain_timeout_s:g} s and are canceled")
                for live in list(self._live.values()):
                    live.scope.cancel()
                # Bounded: a send's task write that has not landed by then is given up on (its
                # client told to send again); if it lands after all, it is left SUBMITTED for the
                # next process to take up (see _start).
                with trio.move_on_after(self.config.cleanup_timeout_s):
                    await self._sending.wait_none()
                for scope in list(self._creating):
                    scope.cancel()
                self._nursery = None  # here, before the nursery closes to new tasks: see _start
        finally:
            self._nursery = None
            self._stopped.set()

    def _say_cut(self, why: str) -> None:
        # Named: the runs the shutdown cancels, not those already over (their end being written)
        # or cancelled by a CancelTask (whose CANCELED stands).
        left = sorted(task_id for task_id, live in self._live.items() if not live.turn_over and not live.scope.cancel_called)
        if left:
            named = ", ".join(left[:20]) + (", ..." if len(left) > 20 else "")
            logger.warning("shutting down: %d task(s) %s: %s", len(left), why, named)

    def stop(self) -> None:
        """Refuse new work and start draining (see ``run``)."""
        self._stopping.set()

    def hurry(self) -> None:
        """Stop, and end the drain now (a second signal): the runs still going are cancelled at
        once, each still writing its end, so that the clients waiting on them are answered."""
        self._hurried = True
        self._stopping.set()
        if self._drain is not None:
            self._drain.cancel()

    def abandon(self) -> None:
        """Stop at once, and leave every task as it stands on disk for the next process to take
        up: for a start that failed after the runner had taken up what a dead process left, so
        that a server that never served neither finishes those tasks nor settles them."""
        self._abandoned = True
        self._stopping.set()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def statistics(self) -> RunnerStatistics:
        live = list(self._live.values())
        return RunnerStatistics(running=len(live), subscribers=sum(task.subscribers for task in live))

    # -- requests ---------------------------------------------------------------------------------

    async def send(self, owner: str, params: SendMessageParams) -> Task:
        """A new task (SUBMITTED, durable before this returns), or a steer for a working one; for
        a message sent before (the same messageId), the task it went to, and nothing new."""
        if params.configuration.push_notification_config is not None:
            # The card says there are none: a webhook taken and never called would be worse.
            raise PushNotificationNotSupported()
        # One message is taken one send at a time. A steer is known by its receipt in runtime.db
        # and a task's first message by its row in tasks.db: the same message sent twice at once,
        # once as a steer and once without its taskId, would find neither record in time, and go
        # both ways. The second send waits, and finds what the first left.
        async with self._message_turns.hold(params.message.message_id):
            return await self._send(owner, params)

    async def _send(self, owner: str, params: SendMessageParams) -> Task:
        message = params.message
        if message.task_id:
            return await self._to_existing(owner, message.task_id, params)
        if message.context_id:
            receipt = await self.sessions.steer_receipt(message.context_id, message.message_id)
            if receipt is not None:  # a steer sent again, without its task's id: it starts nothing
                return await self._steered_before(owner, params, receipt)
        text = readable_text(message)
        if self._stopping.is_set():
            # Sent again as the server drains (its answer lost, say): the task it started is
            # given back. Only a message that would start a task is refused.
            started = await self.tasks.started_by(owner, message.message_id)
            if started is not None:
                return await self._sent_before(owner, message, started)
            raise UnsupportedOperation(STOPPING)
        task_id = new_id()
        self._refuse_oversize(Transcribed(role="user", text=text, turn_id=task_id))
        context_id = message.context_id or new_id()
        message = attrs.evolve(message, task_id=task_id, context_id=context_id)
        task = Task(
            id=task_id, context_id=context_id, status=TaskStatus(state=TaskState.SUBMITTED, timestamp=now()),
            history=(message,), metadata=params.metadata,
        )  # fmt: skip
        # Written, and its run started, by a task of the runner's: a client that disconnects
        # cancels this request, but the write it queued lands all the same (a queued write is
        # not withdrawn), and a task stored SUBMITTED must have its run, however long the write.
        if self._nursery is None:  # the runner is not running (not yet, or no longer)
            raise UnsupportedOperation(STOPPING)
        created: list[Task | Exception | str] = []  # what came of it: a task id when the message was taken before
        done, left = trio.Event(), trio.Event()  # left: no one waits for what comes of it (its client went)
        self._sending.enter()  # from now: the drain waits for this write (up to its bound)
        self._nursery.start_soon(self._create, owner, task, params, created, done, left, name=f"send {task_id}")
        try:
            await done.wait()
        finally:
            if not done.is_set():
                left.set()
        if not created:  # given up on as the server stopped: it may land yet, and the next process run it
            raise UnsupportedOperation(
                f"the server is shutting down and could not confirm task {task_id!r}; send the same message again"
                " (the same messageId) once the server that replaces it is up: it is taken once"
            )
        if isinstance(created[0], str):
            return await self._sent_before(owner, params.message, created[0])
        if isinstance(created[0], Exception):
            raise created[0]
        return created[0]

    async def _create(
        self,
        owner: str,
        task: Task,
        params: SendMessageParams,
        created: list[Task | Exception | str],
        done: trio.Event,
        left: trio.Event,
    ) -> None:
        """Write a new task SUBMITTED and start its run; what came of it goes to ``created``, and
        a failure to the log only once its sender has ``left`` (who raises it logs it)."""
        try:
            with trio.CancelScope() as scope:  # cancelled by the drain, once it gives up on sends
                self._creating.add(scope)
                try:
                    record = await self.tasks.create(
                        owner, task_id=task.id, context_id=task.context_id,
                        state=TaskState.SUBMITTED.wire_name(STORED_VERSION), task_json=encode(task),
                        message_id=task.history[0].message_id, updated_at_ms=status_ms(task),
                    )  # fmt: skip
                    started = self._start(self._live_task(owner, task, record.version))
                finally:
                    self._creating.discard(scope)
                    self._sending.leave()
                if started and task.context_id != params.message.context_id:  # minted here (read when the run begins)
                    self._fresh[task.context_id] = task.id
                created.append(task)
        except store_errors.MessageTaken as taken:
            created.append(taken.task_id)
        except Exception as exc:  # the client is told, if it is still there; else the log has it
            if left.is_set():
                logger.warning("new task %s was not taken: %s", task.id, exc)
            created.append(exc)
        finally:
            done.set()

    async def _sent_before(self, owner: str, message: Message, task_id: str) -> Task:
        """The task a message already started: a client sending it again (its answer lost to a
        broken connection, or to a crash of the process that took it) gets that task back, as it
        stands, and no second run. The same id with other words is a mistake, said as such."""
        task = await self.get(owner, task_id)
        where = f"started task {task_id!r}"
        if message.context_id not in (None, "", task.context_id):
            raise InvalidParams(
                "message.messageId",
                problem=f"{quoted(message.message_id)} was sent before, in context {task.context_id!r}, and {where}; "
                "a new message needs a new messageId",
            )
        return check_same(message, task.history[0], task, where)

    async def _steered_before(self, owner: str, params: SendMessageParams, receipt: SteerReceipt) -> Task:
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
            return await self._to_existing(owner, receipt.task_id, again)
        except TaskNotFound:
            raise sent_before from None

    def _refuse_oversize(self, message: Transcribed) -> None:
        """A message the conversation could not hold is refused before anything of it is stored:
        taken, its task would only fail when the run first saved the transcript."""
        limit = self.sessions.max_event_bytes
        size = message.oversize(limit)
        if size is not None:
            raise InvalidParams(
                "message.parts",
                problem=f"come to {size} bytes as the conversation keeps them (text parts as they are, data parts as JSON), "
                f"more than the {limit} one message may hold; send less in one message",
            )

    def _live_task(self, owner: str, task: Task, version: int) -> LiveTask:
        return LiveTask(owner=owner, task=task, version=version, write_timeout_s=self.config.cleanup_timeout_s)

    async def _to_existing(self, owner: str, task_id: str, params: SendMessageParams) -> Task:
        # Its run, looked up before the task is read: one that ends while it is read is still
        # known for what it is, a run that takes no more steers, not taken for no run at all.
        running = self._live.get(task_id)
        task, version = await load(self.tasks, owner, task_id)
        message = params.message
        if message.context_id and message.context_id != task.context_id:
            raise ContextMismatch(message.context_id, task_id, task.context_id)
        # A message this task already took (sent again, its answer lost): the task as it
        # stands, and no second steer.
        live = self._live.get(task_id) or running
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
        async with live.steers.lock if live is not None else nullcontext():
            return await self._steer(owner, task, version, message, live)

    async def _steer(self, owner: str, task: Task, version: int, message: Message, live: LiveTask | None) -> Task:
        task_id = task.id
        state = task.status.state
        # Its run can take no more steers (its end not yet written, or its last answer on its way).
        ending = live is not None and (live.turn_over or live.steers.closed) and not state.is_terminal
        resuming = live is not None and live.resuming and not state.is_terminal
        ahead = None if state.is_terminal or live is None or ending else self._turn_ahead(live)
        if state.is_terminal or ending or resuming or ahead is not None:
            receipt = await self.sessions.steer_receipt(task.context_id, message.message_id)
            if receipt is not None:
                # Left as a steer while the task worked, but its record in the task failed (a
                # full disk, or the process died between the two writes): recorded now.
                check_receipt(receipt, message, task_id)
                return await self._add_to_history(owner, task, version, message)
        if state.is_terminal:
            raise TaskIsTerminal(
                task_id, state.value, "take a message",
                instead=f"send it without a taskId, with contextId {task.context_id!r}, to start the conversation's next task",
            )  # fmt: skip
        if ending:
            raise UnsupportedOperation(
                f"task {task_id!r} takes no more messages: its run is giving, or has given, its last answer; send this"
                " message without a taskId, in the same contextId, to start the conversation's next task"
            )
        if resuming:
            raise UnsupportedOperation(
                f"task {task_id!r} is being taken up again after a restart of the server, which has yet to read where its"
                " run stopped; send this message again in a moment"
            )
        if ahead is not None:
            # Stored now, it would be taken by the first look of the run ahead, and dropped there
            # as another task's steer: this task's run would never see it.
            raise UnsupportedOperation(
                f"task {task_id!r} has not started: it waits while task {ahead.task.id!r} has its conversation's turn; "
                "send this message again once the task is working, or send it to that task to steer it"
            )
        text = readable_text(message)
        self._refuse_oversize(steer_message(text))
        # A message to a working task is a steer: stored for the session, taken exactly once
        # before the run's next model request, wherever that run is. Stored with its message id,
        # so that sent again after its record in the task failed (or its process died between
        # the two writes, or while the first send was still writing), it is recorded without
        # steering the run a second time.
        if live is not None:
            live.steered = True  # from before the write: a run cancelled during it still forgets the steer
        left = await self.sessions.add_steer(
            task.context_id, text, message_id=message.message_id, task_id=task_id, sent_as=as_sent(message)
        )
        if not left:
            receipt = await self.sessions.steer_receipt(task.context_id, message.message_id)
            if receipt is not None:
                check_receipt(receipt, message, task_id)
        return await self._add_to_history(owner, task, version, message)

    async def _add_to_history(self, owner: str, task: Task, version: int, message: Message) -> Task:
        """Record a steering message in the task's history, whoever writes the task meanwhile.

        The steer itself is already stored: if the run ended in between, it is recorded on this
        task alone (a later task's run does not take a steer left for another task).
        """
        for _ in range(HISTORY_WRITE_ATTEMPTS):
            live = self._live.get(task.id)
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

    async def get(self, owner: str, task_id: str) -> Task:
        """The task as it stands: with the answer so far while a run of this process writes it."""
        live = self._live.get(task_id)
        if live is not None and live.owner == owner:
            return live.as_seen()
        task, _ = await load(self.tasks, owner, task_id)
        return task

    def _with_answer_so_far(self, task: Task) -> Task:
        """``task`` with what the streams have of its answer so far, for a client that polls,
        while a run of this process works on it and has stored no answer yet."""
        live = self._live.get(task.id)
        return task if live is None else live.as_seen(task)

    async def list_tasks(self, owner: str, params: ListTasksParams) -> ListTasksResult:
        after = params.status_timestamp_after
        try:
            page = await self.tasks.list(
                owner,
                context_id=params.context_id,
                state=None if params.status is None else params.status.wire_name(STORED_VERSION),
                # At or after (a2a.proto ListTasksRequest.status_timestamp_after: "greater than or
                # equal"): a status time in whole milliseconds is at or after ``after`` exactly when
                # it is after the millisecond before ``after`` rounded up to its millisecond.
                updated_after_ms=None if after is None else epoch_ms_up(after) - 1,
                page_size=params.page_size or DEFAULT_PAGE_SIZE,
                page_token=params.page_token or "",
            )
        except store_errors.InvalidPage as exc:  # the page size was checked with the request
            problem = "is not a token this server gave; pass the nextPageToken of the previous page, or none for the first"
            raise InvalidParams("pageToken", problem=problem) from exc
        tasks = []
        for record in page.records:
            task = self._with_answer_so_far(decode(record))
            if params.history_length is not None:
                task = trim_history(task, params.history_length, STORED_VERSION)
            if not params.include_artifacts:
                task = attrs.evolve(task, artifacts=())
            tasks.append(task)
        return ListTasksResult(
            tasks=tasks, next_page_token=page.next_page_token, page_size=params.page_size or DEFAULT_PAGE_SIZE,
            total_size=page.total_size,
        )

    async def cancel(self, owner: str, task_id: str) -> Task:
        """Cancel the task's scope, write it CANCELED and return it as persisted. Raises
        TaskNotFound, or TaskNotCancelable when it is terminal, or became so (its run's end was
        written first) before the cancel could be.

        The response waits for that one write, not for the run to unwind: the run, cancelled,
        saves the answer it was streaming (marked partial) and releases the session's turn lock
        in the runner's nursery, so the conversation's next turn starts after that save."""
        live = self._live.get(task_id)
        if live is None or live.owner != owner:
            task, version = await load(self.tasks, owner, task_id)
            if task.status.state.is_terminal:
                raise TaskNotCancelable(task_id, task.status.state.value)
            live = self._live.get(task_id)  # the load may have raced with the run's end
            if live is None:
                return await self._cancel_stored(owner, task, version)
        live.scope.cancel()
        # What the run streams until it next checkpoints is sent to no one: the answer kept with
        # CANCELED is what the subscribers have.
        live.freeze_answer()
        # Urgent: under load the writer is busy, and this write is what the client waits on.
        task = await live.persist(self.tasks, unless_settled(keeping_answer(live, CANCELED)), urgent=True)
        if task.status.state.is_terminal and task.status.state is not TaskState.CANCELED:
            raise TaskNotCancelable(task_id, task.status.state.value)  # as a cancel a moment later is
        return task

    async def _cancel_stored(self, owner: str, task: Task, version: int) -> Task:
        """Settle a task no run of this process holds (its process died, or it ended just now)."""
        canceled = CANCELED(task)
        try:
            await self.tasks.update(
                owner, task.id, state=TaskState.CANCELED.wire_name(STORED_VERSION), task_json=encode(canceled),
                expected_version=version, urgent=True, updated_at_ms=status_ms(canceled),
            )  # fmt: skip
        except store_errors.VersionConflict:
            # It changed after it was read (a run that has just ended wrote it): judge it again.
            return await self.cancel(owner, task.id)
        return canceled

    @asynccontextmanager
    async def subscribe(self, owner: str, task_id: str) -> AsyncIterator[trio.MemoryReceiveChannel[StreamItem]]:
        """Events of one task: first the task as persisted, then what happens to it, ending when
        it settles or, cut short, with a StreamCut. Leaving the block ends only this subscription."""
        live = self._live.get(task_id)
        if live is None or live.owner != owner:
            task, _ = await load(self.tasks, owner, task_id)
            send, receive = trio.open_memory_channel[StreamItem](2)
            send.send_nowait(task)
            if not task.status.state.ends_stream:  # not settled, and not run here
                why = (
                    "no run of it is in this server (it was left for the next server to resume), and a stream"
                    " follows only the runs of the server serving it; poll GetTask to see it end"
                )
                send.send_nowait(StreamCut(task_id, why))
            send.close()
            with receive:
                yield receive
            return
        receive = live.subscribe()
        try:
            yield receive
        finally:
            live.unsubscribe(receive)

    async def wait_settled(self, owner: str, task_id: str) -> Task:
        """Block until the task is terminal or interrupted, and return it as persisted. Raises
        EndNotStored if the run ended but its final state could not be written."""
        live = self._live.get(task_id)
        if live is None or live.owner != owner:
            return await self.get(owner, task_id)
        await live.settled.wait()
        if not live.end_stored:
            raise EndNotStored(task_id, live.end_not_stored)
        # The run's snapshot is what its last write stored (LiveTask changes it only once that
        # write is durable), so it is not read back: a store read and a decode less per blocking
        # send, about a seventh of its CPU in scripts/bench/a2a.py.
        return live.task

    # -- runs -------------------------------------------------------------------------------------

    def _start(self, live: LiveTask) -> bool:
        """Start the task's run in the runner's nursery; False if the runner has stopped."""
        if self._nursery is None:  # a send's task written as the runner stopped: the next process runs it
            logger.warning("task %s was taken as the server stopped; the next process to start runs it", live.task.id)
            return False
        self._live[live.task.id] = live
        if self._idle.is_set():
            self._idle = trio.Event()
        if self._drained:  # after the drain: recorded CANCELED, like the runs the drain cut
            live.scope.cancel()
        self._nursery.start_soon(self._execute, live, name=f"task {live.task.id}")
        return True

    async def _execute(self, live: LiveTask) -> None:
        final: Outcome | None = None
        try:
            with live.scope:
                final = await self._turn(live)
        except Exception:
            logger.exception("task %s failed inside the runner", live.task.id)
            final = settle(TaskState.FAILED, "The task failed with an internal error.")
        finally:
            if final is None and self._cut_from_outside(live):  # left as stored, for the next process
                live.close(end_stored=False, why=END_LEFT_FOR_NEXT)
            else:
                if final is None:  # cancelled: by CancelTask, or by shutdown (after the drain, or cutting it short)
                    final = SHUT_DOWN if self._stopping.is_set() else CANCELED
                if await self._store_end(live, keeping_answer(live, final)):
                    live.close()
                    if live.steered:
                        await self._drop_untaken_steers(live)
            if self._fresh.get(live.task.context_id) == live.task.id:  # ended before its turn began
                del self._fresh[live.task.context_id]
            del self._live[live.task.id]
            if not self._live:
                self._idle.set()

    def _cut_from_outside(self, live: LiveTask) -> bool:
        """Whether a run that did not finish was stopped by neither a CancelTask nor this runner's
        stop (its drain, or a third signal after it): by abandon(), or by a cancellation of the
        scope the runner runs in before anything told it to stop. The latter is a start given up
        on, whose abandon() the same cancellation reaches only after this run's end: its task
        is not the run's to settle, but the next process's to take up, as after a crash."""
        return self._abandoned or not (self._stopping.is_set() or live.scope.cancel_called)

    async def _store_end(self, live: LiveTask, final: Outcome) -> bool:
        """Write the run's final state. If the store fails (a full disk, say), subscribers and a
        blocking send are told at once, and the write is tried again, less and less often, until
        it is stored or the runner stops; the next process then adopts the task (_adopt_orphans).
        Returns whether it is stored."""
        delay = 0.0
        while True:
            try:
                # Shielded and bounded inside; a CancelTask may have written the end already.
                await live.persist(self.tasks, unless_settled(final))
                if delay:
                    logger.info("task %s: its final state is stored now", live.task.id)
                return True
            except (store_errors.StoreError, TimeoutError, TaskNotFound) as exc:
                if self._stopping.is_set():  # not tried again: said so, to the log and to whoever waits
                    logger.warning(
                        "task %s: its final state is not stored; the next process to start resumes it: %s", live.task.id, exc
                    )
                    live.close(end_stored=False, why=END_LEFT_FOR_NEXT)
                    return False
                if live.end_stored:  # the first failure: said once, to the log and to whoever waits
                    logger.error("task %s: its final state could not be stored, and is tried again until it is: %s", live.task.id, exc)
                    live.close(end_stored=False)
            delay = min(max(2 * delay, END_RETRY_FIRST_S), END_RETRY_MAX_S)
            with trio.move_on_after(delay):
                await self._stopping.wait()

    async def _drop_untaken_steers(self, live: LiveTask) -> None:
        """Forget the steers stored for a run whose end is stored, if it never took them (it was
        canceled or failed first): no run ever will, and the task's history keeps them. Bounded
        and shielded, like the end's write; one that fails leaves them to the conversation's next
        turn, which drops them too."""
        with trio.move_on_after(self.config.cleanup_timeout_s, shield=True):
            try:
                await self.sessions.drop_steers(live.task.context_id, task_id=live.task.id)
            except (store_errors.StoreError, TimeoutError) as exc:
                logger.warning("task %s: the steers its run never took could not be dropped: %s", live.task.id, exc)

    async def _turn(self, live: LiveTask) -> Outcome:
        """One turn on the task's session: the agent loop, WORKING durable before the model is
        called, then the outcome (COMPLETED or FAILED) for ``_execute`` to persist."""
        task = live.task
        session = Session.open(task.context_id, self.sessions, task_id=task.id)
        await self._wait_in_line(task.id)
        async with self._taking_turn(live):
            # The first turn of a context minted for this task has nothing stored to read. (Only
            # the reply to this task's send names that context, and this run takes the lock in
            # its first step, long before another request could: no other turn comes first.)
            fresh = self._fresh.pop(task.context_id, None) == task.id
            messages = [] if fresh else await session.messages()
            turn, overtaken = turn_of(messages, task.id)
            if live.resuming:  # steers were refused until now: one taken for a turn already over would ride no request
                async with live.steers.lock:
                    live.resuming = False
                    live.steers.closed = bool(turn) and (answered(turn) or overtaken)
            if not turn:
                # The turn's first run, or its process died before the question was saved.
                messages.append(Transcribed(role="user", text=message_text(task.history[0]), turn_id=task.id))
            elif answered(turn):
                # Its process died after the answer was saved but before the task said so.
                return self._completed(live, turn[-1].text)
            elif overtaken:
                # Its run ended unanswered (it failed, say) and that end was never stored; the
                # conversation has gone on since. Asked now, the model would answer the later turn.
                return settle(TaskState.FAILED, OVERTAKEN)
            # Otherwise a resumed run continues from the transcript as saved: the step in flight
            # when the process died is done again (see AgentRun._ask).
            #
            # WORKING goes to tasks.db while the loop saves the transcript to runtime.db; the
            # model is asked once both are durable. The nursery is this turn's, and lives no
            # longer than the loop.
            working = Working(live, self.tasks)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(working.write)
                run = AgentRun(
                    self.model, self.agent, messages, session=session, on_event=answer_streamer(live), ready=working.wait,
                    gate=live.steers, calls_made=sum(message.role == "assistant" for message in turn),
                )  # fmt: skip
                try:
                    result = await run.run()
                except (AgentError, ModelError) as exc:
                    self._say_failed(task, exc)
                    return settle(TaskState.FAILED, f"The task failed: {exc}")
        return self._completed(live, result.output)

    def _say_failed(self, task: Task, exc: AgentError | ModelError) -> None:
        """One line: a model that failed is the operator's to look at, named with where it is
        served and what it said; a turn the agent ended (its budget spent, say) is not."""
        about = f"task {task.id} (context {task.context_id}) failed: {exc}"
        if isinstance(exc, ModelError):
            where = f"; the model server is {self.config.model_endpoint}" if self.config.model_endpoint else ""
            said = f"; it said: {exc.detail}" if exc.detail else ""
            logger.warning("%s%s%s", about, where, said)
        elif exc.__cause__ is None:
            logger.info("%s", about)
        else:  # a store failure: what it said is for the log alone
            logger.warning("%s, from %r", about, exc.__cause__)

    @asynccontextmanager
    async def _taking_turn(self, live: LiveTask) -> AsyncIterator[None]:
        """The turn of the task's conversation: one task's run at a time, the others waiting."""
        context_id = live.task.context_id
        line = self._turns.setdefault(context_id, [])
        line.append(live)  # in the step that queues for the lock, so the line keeps the lock's order
        try:
            async with self.sessions.turn_lock(context_id):
                try:
                    yield
                finally:
                    live.turn_over = True
        finally:
            line.remove(live)  # in the step that lets the lock go (or gives up waiting for it)
            if not line:
                del self._turns[context_id]

    def _turn_ahead(self, live: LiveTask) -> LiveTask | None:
        """The task of this process whose run has its conversation's turn, or is being handed
        it, while ``live``'s run waits (or has not yet queued) for it; None if it is ``live``'s
        turn, or no run holds or waits for it."""
        line = self._turns.get(live.task.context_id)
        return line[0] if line and line[0] is not live else None

    def _completed(self, live: LiveTask, output: str) -> Outcome:
        task = live.task
        answer = agent_message(task, output)
        artifact = answer_artifact(output)
        live.finish_answer(output)

        def complete(current: Task) -> Task:
            done = attrs.evolve(current, history=(*current.history, answer), artifacts=(artifact,))
            return with_status(done, TaskState.COMPLETED, answer)

        return complete

    async def _wait_in_line(self, task_id: str) -> None:
        """For a task resumed at startup: wait until the one before it on its context has queued
        for the turn lock. Then this one queues, in the same step as it returns (taking a lock
        does not pass through the scheduler before it queues), so the next one queues behind."""
        line = self._in_line.pop(task_id, None)
        if line is None:
            return
        ahead, queued = line
        try:
            if ahead is not None:
                await ahead.wait()
        finally:
            queued.set()  # cancelled while waiting too: the tasks behind it must not wait forever

    async def _adopt_orphans(self) -> None:
        """Tasks a dead process left SUBMITTED or WORKING are resumed or failed, never left
        hanging. Those of one context take their turns in the order they were created."""
        last_in_line: dict[str, trio.Event] = {}
        # Every one read before any starts: one that cannot be read (UnreadableTask, naming it)
        # stops the start with no run begun, rather than cancel the runs begun before it.
        orphans = [(record, decode(record)) for record in await self.tasks.unfinished()]  # oldest first
        for record, task in orphans:
            live = self._live_task(record.owner, task, record.version)
            if self.config.orphans == "resume":
                logger.info("resuming task %s left %s by a process that stopped", task.id, task.status.state.value)
                live.steered = True  # the process that stopped may have stored steers for it
                live.resuming = True
                queued = trio.Event()
                self._in_line[task.id] = (last_in_line.get(task.context_id), queued)
                last_in_line[task.context_id] = queued
                self._start(live)
                continue
            logger.info("failing task %s left %s by a process that stopped (orphans: fail)", task.id, task.status.state.value)
            reason = "The process running this task stopped before it finished; send the message again, with a new messageId."
            await live.persist(self.tasks, settle(TaskState.FAILED, reason))


@attrs.define(eq=False)
class _Count:
    """How many of something are under way, and a wait for none to be."""

    count: int = 0
    _none: trio.Event = attrs.field(init=False, factory=trio.Event)

    def enter(self) -> None:
        if not self.count and self._none.is_set():
            self._none = trio.Event()
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if not self.count:
            self._none.set()

    async def wait_none(self) -> None:
        while self.count:
            await self._none.wait()


