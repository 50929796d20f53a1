"""One task's turn: the agent loop run on its conversation, to the outcome the runner stores.

Apart from the runner, which owns when a run starts and how its end is stored: this is what a run
does in between. It reads the conversation, sees how far a process that stopped got with this
turn (answered, overtaken by a later turn, or to be asked again from the step in flight), and runs
the loop with WORKING durable before the model is asked. A task that process left, with
``AGENT_ORPHANS=fail``, is settled here too, from what its turn holds.
"""

from __future__ import annotations

import logging

import attrs
import trio

from persistence.api import SessionStore, TaskStore
from persistence.errors import StoreError, is_damage, told_before
from persistence.locks import holding
from persistence.session import Session
from persistence.transcript import Message as Transcribed
from protocol import Task, TaskState
from runtime.agent import AgentError, AgentRun, AgentSpec, BudgetExhausted, MaxStepsReached, Model
from runtime.agent.errors import SEND_AGAIN_WHEN_BACK, UNTIL_RESTORED
from runtime.agent.loop import answered
from runtime.endings import OVERTAKEN, SHUT_DOWN, Outcome, Working, answer_streamer, completed, settle, turn_of
from runtime.models import ModelError, ModelTimeout
from runtime.reachable import ModelWait
from runtime.tasks import LiveTask, message_text
from runtime.turns import Turns

logger = logging.getLogger(__name__)


@attrs.frozen
class TurnTaker:
    """Takes a task's turn (``take``), for the runner's runs."""

    sessions: SessionStore
    tasks: TaskStore
    model: Model
    agent: AgentSpec
    turns: Turns
    # Contexts the runner minted for a task whose first turn has not begun (by context: the
    # task's id): nothing is stored for them yet, so that turn need not read the conversation.
    fresh: dict[str, str]
    model_endpoint: str = ""  # where the model is served, for the log (no credentials)
    # A resumed run's wait for the model server, if there is one: see runtime/reachable.py.
    model_wait: ModelWait | None = None

    async def take(self, live: LiveTask) -> Outcome:
        """One turn on the task's session: the agent loop, WORKING durable before the model is
        called, then the outcome (COMPLETED or FAILED) for the runner to store; CANCELED for a
        resumed run still waiting for its model server as the server shuts down."""
        task = live.task
        session = Session.open(task.context_id, self.sessions, task_id=task.id)
        async with self.turns.taking(live):
            # The first turn of a context minted for this task has nothing stored to read. (Only
            # the reply to this task's send names that context, and this run takes the lock in
            # its first step, long before another request could: no other turn comes first.)
            fresh = self.fresh.pop(task.context_id, None) == task.id
            try:
                messages = [] if fresh else await session.messages()
            except StoreError as exc:  # a damaged row, or a failing disk: said so, in one line, as a failed save is
                unreadable = ConversationUnreadable(task.context_id, damaged=is_damage(exc))
                unreadable.__cause__ = exc
                self._say_failed(task, unreadable)
                return settle(TaskState.FAILED, _failed(unreadable))
            turn, overtaken = turn_of(messages, task.id)
            resuming = live.resuming
            if resuming:  # steers were refused until now: one taken for a turn already over would ride no request
                async with holding(live.steers.lock):
                    live.resuming = False
                    live.steers.closed = bool(turn) and (answered(turn) or overtaken)
            if not turn:
                # The turn's first run, or its process died before the question was saved.
                messages.append(Transcribed(role="user", text=message_text(task.history[0]), turn_id=task.id))
            elif answered(turn):
                # Its process died after the answer was saved but before the task said so.
                return completed(live, turn[-1].text)
            elif overtaken:
                # Its run ended unanswered (it failed, say) and that end was never stored; the
                # conversation has gone on since. Asked now, the model would answer the later turn.
                return settle(TaskState.FAILED, OVERTAKEN)
            # Otherwise a resumed run continues from the transcript as saved: the step in flight
            # when the process died is done again (see AgentRun._ask), once the model server can
            # be reached. Meanwhile the task stays as it was, and steers sent to it ride that step.
            if resuming and self.model_wait is not None and not await self.model_wait.until_reachable(task.id):
                return SHUT_DOWN  # the server shuts down first
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
                    if isinstance(exc, (BudgetExhausted, MaxStepsReached)):  # the model was still calling tools
                        live.drop_answer()
                    return settle(TaskState.FAILED, _failed(exc))
        return completed(live, result.output)

    def _say_failed(self, task: Task, exc: AgentError | ModelError) -> None:
        """One line: a model that failed is the operator's to look at, named with where it is
        served and what it said; a turn the agent ended (its budget spent, say) is not; storage
        found damaged is said in the store's words, which name it and what to do (a damaged file
        once, the first time a request or a run met it)."""
        about = f"task {task.id} (context {task.context_id}) failed: {exc}"
        cause = exc.__cause__
        if cause is not None and is_damage(cause):  # what is damaged, and what to do, is the store's to say
            # A damaged file in full once, as the surface says it; in a few words after.
            logger.error("task %s (context %s) failed: %s", task.id, task.context_id, told_before(cause) or cause)
        elif isinstance(exc, ModelError):
            where = f"; the model server is {self.model_endpoint}" if self.model_endpoint else ""
            said = f"; it said: {exc.detail}" if exc.detail else ""
            if isinstance(exc, ModelTimeout) and not exc.connecting:  # a silence the operator bounds
                said += f"; AGENT_MODEL_TIMEOUT_S (--model-timeout-s) is {exc.timeout_s:g}s: raise it for a slow model"
            logger.warning("%s%s%s", about, where, said)
        elif cause is None:
            logger.info("%s", about)
        else:  # a store failure: what it said is for the log alone
            logger.warning("%s, from %r", about, cause)


class ConversationUnreadable(AgentError):
    """The conversation a turn continues could not be read from runtime.db, so its run stops
    before the model is asked: asked without it, the model would answer out of context."""

    def __init__(self, context_id: str, *, damaged: bool = False) -> None:
        self.context_id = context_id
        if damaged:  # no outage that passes: until it is restored, every turn of it fails so
            super().__init__(
                f"the conversation of context {context_id!r} is damaged in the server's storage, so the run stopped before"
                f" calling the model; its turns fail so {UNTIL_RESTORED}: send the message without the contextId to start"
                " a new conversation"
            )
        else:
            super().__init__(
                f"the conversation of context {context_id!r} could not be read from the server's storage, so the run"
                f" stopped before calling the model; {SEND_AGAIN_WHEN_BACK}, or without the contextId to start a new"
                " conversation"
            )


def _failed(exc: AgentError | ModelError) -> str:
    """What a turn that failed tells its client: why, and, when its model server failed in a way
    that may pass (down, overloaded, failing one answer), that the message may be sent again."""
    if isinstance(exc, ModelError) and exc.may_pass:
        return f"The task failed: {exc}; this may pass: send the message again, with a new messageId, in a little while"
    return f"The task failed: {exc}"


async def orphan_outcome(sessions: SessionStore, task: Task, live: LiveTask) -> Outcome:
    """What ``AGENT_ORPHANS=fail`` makes of an orphan: FAILED, unless its process stored the
    turn's answer before it stopped. That answer is in the conversation the model reads next,
    so the task says so (COMPLETED, without asking the model anything), rather than tell
    its client there was none."""
    reason = "The process running this task stopped before it finished; send the message again, with a new messageId."
    try:
        messages = await Session.open(task.context_id, sessions).messages()
    except StoreError as exc:  # a damaged conversation fails its own orphan, and keeps no other from ending
        logger.warning(
            "failing task %s left %s by a process that stopped (orphans: fail); its conversation, context %s, could"
            " not be read to find whether its answer was stored: %s",
            task.id, task.status.state.value, task.context_id, told_before(exc) or exc,
        )  # fmt: skip
        return settle(TaskState.FAILED, reason)
    turn, _ = turn_of(messages, task.id)
    if turn and answered(turn):
        logger.info("completing task %s left %s by a process that stopped: its answer was stored", task.id, task.status.state.value)
        return completed(live, turn[-1].text)
    logger.info("failing task %s left %s by a process that stopped (orphans: fail)", task.id, task.status.state.value)
    return settle(TaskState.FAILED, reason)
