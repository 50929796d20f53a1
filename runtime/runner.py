"""The runner owns every run: one cancel scope per task, turn locks, durable task states.

HTTP handlers call ``send``, ``wait_settled``, ``cancel``, ``get``, ``list_tasks`` and
``subscribe``; the runs themselves live in the runner's nursery, never in a request's, so a
client that goes away ends only its own subscription.

Here: the runner's life (start, drain, stop), a new task's intake, and each run from its start
to its stored end. What a run does in between, its task's turn, is ``runtime/agent_turn.py``'s;
a message to a task that exists ``runtime/steering.py``'s, the order of a conversation's turns
``runtime/turns.py``'s, what clients read of a task ``runtime/reads.py``'s, and how a run or a
CancelTask ends a task ``runtime/endings.py``'s.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager

import attrs
import trio

import persistence.errors as store_errors
from persistence.api import SessionStore, TaskStore
from persistence.locks import TurnLocks
from persistence.transcript import Message as Transcribed
from protocol import (
    END_LEFT_FOR_NEXT,
    InvalidParams,
    ListTasksParams,
    ListTasksResult,
    Message,
    PushNotificationNotSupported,
    SendMessageParams,
    Task,
    TaskNotFound,
    TaskState,
    TaskStatus,
    UnsupportedOperation,
)
from protocol.errors import quoted
from runtime.agent import AgentSpec, Model
from runtime.agent_turn import TurnTaker, orphan_outcome
from runtime.endings import CANCELED, SHUT_DOWN, Outcome, cancel_task, keeping_answer, settle, unless_settled
from runtime.reachable import Catalog, ModelWait
from runtime.reads import Reads
from runtime.resent import check_same
from runtime.steering import Steering
from runtime.tasks import (
    STORED_VERSION,
    LiveTask,
    StreamItem,
    dated_after,
    decode,
    encode,
    new_id,
    readable_text,
    refuse_oversize,
    status_ms,
    status_time,
)
from runtime.turns import Turns

logger = logging.getLogger(__name__)

ANONYMOUS = "anonymous"  # the owner of every task until requests carry an identity
# A final state the store refused is tried again after 1 s, then twice as long each time, at most 30 s apart.
END_RETRY_FIRST_S = 1.0
END_RETRY_MAX_S = 30.0
NAMED_A_LINE = 20  # task ids a log line of the shutdown names


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
    # Asked, by a run resuming a task a dead process left, whether the model server can be
    # reached yet (see runtime/reachable.py); without it such a run does not wait.
    catalog: Catalog | None = attrs.field(default=None, kw_only=True)
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None)
    _live: dict[str, LiveTask] = attrs.field(init=False, factory=dict)
    # Contexts minted by send() whose first turn has not begun: no transcript is stored for
    # them yet, so that turn need not read one. The task id is the task that minted it.
    _fresh: dict[str, str] = attrs.field(init=False, factory=dict)
    _turns: Turns = attrs.field(init=False)  # which runs hold or wait for each conversation's turn
    _taker: TurnTaker = attrs.field(init=False)  # what each run does: its task's turn
    _steering: Steering = attrs.field(init=False)  # the messages sent to a task that exists
    _reads: Reads = attrs.field(init=False)  # the tasks as clients read them
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

    def __attrs_post_init__(self) -> None:
        self._turns = Turns(self.sessions)
        endpoint = self.config.model_endpoint
        wait = None if self.catalog is None else ModelWait(self.catalog, self._stopping, endpoint=endpoint)
        self._taker = TurnTaker(
            self.sessions, self.tasks, self.model, self.agent, self._turns, self._fresh, model_endpoint=endpoint, model_wait=wait
        )
        self._steering = Steering(self.sessions, self.tasks, self._live, self._turns, self._stopping.is_set)
        self._reads = Reads(self.tasks, self._live)

    async def run(self, *, task_status: trio.TaskStatus[Runner] = trio.TASK_STATUS_IGNORED) -> None:
        """Deal with what a dead process left, serve until ``stop()``, then drain.

        Draining gives runs ``drain_timeout_s`` to finish, then cancels them; each writes its
        terminal state before this returns. A send taken before ``stop()`` whose task is written
        during the drain is drained with the others; written after it, its run is cancelled.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                dated_after(await self.tasks.newest_status_ms())  # before any status is given
                await self._adopt_orphans()
                task_status.started(self)
                await self._stopping.wait()
                await self._drain_runs()
                self._nursery = None  # here, before the nursery closes to new tasks: see _start
        finally:
            self._nursery = None
            self._stopped.set()

    async def _drain_runs(self) -> None:
        """Wait for the runs, and the sends whose task is being written, until there are none or
        ``drain_timeout_s`` has passed (no wait once hurried); then cancel the runs left, and
        give up on the sends' writes after ``cleanup_timeout_s`` more."""
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
            logger.info("shutting down: every task that was running has ended")
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

    def _say_cut(self, why: str) -> None:
        # Named, every one (NAMED_A_LINE a line): the runs the shutdown cancels, not those already
        # over (their end being written) or cancelled by a CancelTask (whose CANCELED stands).
        left = sorted(task_id for task_id, live in self._live.items() if not live.turn_over and not live.scope.cancel_called)
        for first in range(0, len(left), NAMED_A_LINE):
            more = " (continued)" if first else ""
            named = ", ".join(left[first : first + NAMED_A_LINE])
            logger.warning("shutting down: %d task(s) %s%s: %s", len(left), why, more, named)

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
            return await self._steering.to_existing(owner, message.task_id, params)
        if message.context_id:
            receipt = await self.sessions.steer_receipt(message.context_id, message.message_id)
            if receipt is not None:  # a steer sent again, without its task's id: it starts nothing
                return await self._steering.steered_before(owner, params, receipt)
        text = readable_text(message)
        if self._stopping.is_set():
            # Sent again as the server drains (its answer lost, say): the task it started is
            # given back. Only a message that would start a task is refused.
            started = await self.tasks.started_by(owner, message.message_id)
            if started is not None:
                return await self._sent_before(owner, message, started)
            raise UnsupportedOperation(STOPPING)
        task_id = new_id()
        refuse_oversize(Transcribed(role="user", text=text, turn_id=task_id), self.sessions.max_event_bytes)
        context_id = message.context_id or new_id()
        message = attrs.evolve(message, task_id=task_id, context_id=context_id)
        task = Task(
            id=task_id, context_id=context_id, status=TaskStatus(state=TaskState.SUBMITTED, timestamp=status_time()),
            history=(message,), metadata=params.metadata,
        )  # fmt: skip
        return await self._take(owner, task, params)

    async def _take(self, owner: str, task: Task, params: SendMessageParams) -> Task:
        """The new ``task``, once stored SUBMITTED and its run started; or, if its message started
        a task before (sent twice at once), that task."""
        # Written, and its run started, by a task of the runner's: a client that disconnects
        # cancels this request, but the write it queued lands all the same (a queued write is
        # not withdrawn), and a task stored SUBMITTED must have its run, however long the write.
        if self._nursery is None:  # the runner is not running (not yet, or no longer)
            raise UnsupportedOperation(STOPPING)
        created: list[Task | Exception | str] = []  # what came of it: a task id when the message was taken before
        done, left = trio.Event(), trio.Event()  # left: no one waits for what comes of it (its client went)
        self._sending.enter()  # from now: the drain waits for this write (up to its bound)
        self._nursery.start_soon(self._create, owner, task, params, created, done, left, name=f"send {task.id}")
        try:
            await done.wait()
        finally:
            if not done.is_set():
                left.set()
        if not created:  # given up on as the server stopped: it may land yet, and the next process run it
            raise UnsupportedOperation(
                f"the server is shutting down and could not confirm task {task.id!r}; send the same message again"
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

    def _live_task(self, owner: str, task: Task, version: int) -> LiveTask:
        return LiveTask(owner=owner, task=task, version=version, write_timeout_s=self.config.cleanup_timeout_s)

    # -- reads (runtime/reads.py) and cancels (runtime/endings.py) ---------------------------------

    async def get(self, owner: str, task_id: str) -> Task:
        """The task as it stands: with the answer so far while a run of this process writes it."""
        return await self._reads.get(owner, task_id)

    async def list_tasks(self, owner: str, params: ListTasksParams) -> ListTasksResult:
        """One page of the owner's tasks, as ListTasks asks for it: each with its answer so far while a run
        of this process writes it. Raises InvalidParams for a page token this server did not give."""
        return await self._reads.list_tasks(owner, params)

    async def cancel(self, owner: str, task_id: str) -> Task:
        """Cancel the task's scope, write it CANCELED and return it as persisted. Raises
        TaskNotFound, or TaskNotCancelable when it is terminal, or became so (its run's end was
        written first) before the cancel could be.

        The response waits for that one write, not for the run to unwind: the run, cancelled,
        saves the answer it was streaming (marked partial) and releases the session's turn lock
        in the runner's nursery, so the conversation's next turn starts after that save."""
        return await cancel_task(self.tasks, self._live, owner, task_id)

    def subscribe(self, owner: str, task_id: str) -> AbstractAsyncContextManager[trio.MemoryReceiveChannel[StreamItem]]:
        """Events of one task: first the task as persisted, then what happens to it, ending when
        it settles or, cut short, with a StreamCut. Leaving the block ends only this subscription."""
        return self._reads.subscribe(owner, task_id)

    async def wait_settled(self, owner: str, task_id: str) -> Task:
        """Block until the task is terminal or interrupted, and return it as persisted. Raises
        EndNotStored if the run ended but its final state could not be written."""
        task, _ = await self._reads.wait_settled(owner, task_id)
        return task

    async def wait_settled_encoded(self, owner: str, task_id: str) -> tuple[Task, str | None]:
        """``wait_settled``, with the task's JSON (STORED_VERSION) when its run here stored it,
        for an answer that carries the task as stored: encoded once, not once more to answer."""
        return await self._reads.wait_settled(owner, task_id)

    # -- runs -------------------------------------------------------------------------------------

    def _start(self, live: LiveTask) -> bool:
        """Start the task's run in the runner's nursery; False if the runner has stopped."""
        if self._nursery is None:  # a send's task written as the runner stopped: the next process runs it
            logger.warning("task %s was taken as the server stopped; the next process to start runs it", live.task.id)
            return False
        self._live[live.task.id] = live
        if self._idle.is_set():
            self._idle = trio.Event()
        if self._drained:  # after the drain: recorded CANCELED, and named, like the runs the drain cut
            logger.warning("shutting down: task %s, taken as the drain ended, is canceled", live.task.id)
            live.scope.cancel()
        self._nursery.start_soon(self._execute, live, name=f"task {live.task.id}")
        return True

    async def _execute(self, live: LiveTask) -> None:
        final: Outcome | None = None
        try:
            with live.scope:
                final = await self._taker.take(live)
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
                        await self._settle_steers(live)
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
                        "task %s: its final state is not stored; the next process to start takes it up (AGENT_ORPHANS): %s",
                        live.task.id, store_errors.told_before(exc) or exc,
                    )  # fmt: skip
                    live.close(end_stored=False, why=END_LEFT_FOR_NEXT)
                    return False
                if live.end_stored:  # the first failure: said once, to the log and to whoever waits
                    logger.error(
                        "task %s: its final state could not be stored, and is tried again until it is: %s",
                        live.task.id, store_errors.told_before(exc) or exc,
                    )  # fmt: skip
                    live.close(end_stored=False)
            delay = min(max(2 * delay, END_RETRY_FIRST_S), END_RETRY_MAX_S)
            with trio.move_on_after(delay):
                await self._stopping.wait()

    async def _settle_steers(self, live: LiveTask) -> None:
        """For a run whose end is stored: record in its task's history the steers stored for it
        that are not there yet (their record failed), and forget those it never took (it was
        canceled or failed first): no run ever will, and the task's history keeps them. Bounded
        and shielded, like the end's write; a steer not recorded is left to the next process, and
        one not dropped to the conversation's next turn, which drops it too."""
        with trio.move_on_after(self.config.cleanup_timeout_s, shield=True):
            await self._steering.record_pending(context_id=live.task.context_id, task_id=live.task.id)
            try:
                await self.sessions.drop_steers(live.task.context_id, task_id=live.task.id)
            except (store_errors.StoreError, TimeoutError) as exc:
                said = store_errors.told_before(exc) or exc
                logger.warning("task %s: the steers its run never took could not be dropped: %s", live.task.id, said)

    async def _adopt_orphans(self) -> None:
        """Tasks a dead process left SUBMITTED or WORKING are resumed or failed, never left
        hanging. Those of one context take their turns in the order they would have (Turns.line_up)."""
        # First, the steers a dead process stored and never recorded in their tasks (it died
        # between the two writes): in the history of the task taken up, and of one that ended.
        await self._steering.record_pending()
        # Every one read before any starts: one that cannot be read (UnreadableTask, naming it)
        # stops the start with no run begun, rather than cancel the runs begun before it.
        orphans = [(record, decode(record)) for record in await self.tasks.unfinished()]  # oldest first
        if self.config.orphans == "resume":
            await self._turns.line_up(task for _, task in orphans)
        for record, task in orphans:
            live = self._live_task(record.owner, task, record.version)
            if self.config.orphans == "resume":
                logger.info("resuming task %s left %s by a process that stopped", task.id, task.status.state.value)
                live.steered = True  # the process that stopped may have stored steers for it
                live.resuming = True
                self._start(live)
                continue
            await live.persist(self.tasks, await orphan_outcome(self.sessions, task, live))

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


