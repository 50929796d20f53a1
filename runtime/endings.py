"""How a run ends its task, how a CancelTask ends it, and what of its turn the transcript holds.

An ``Outcome`` is applied to the task as it stands when the end is written (``LiveTask.persist``),
never to a copy read before: a run's end and a CancelTask race, and whichever is written first
stands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import trio

import persistence.errors as store_errors
from persistence.api import TaskStore
from persistence.transcript import Message as Transcribed
from protocol import Task, TaskNotCancelable, TaskState
from runtime.agent import AgentError, AgentEvent, StepStarted, TextDelta
from runtime.agent.errors import SEND_AGAIN_WHEN_BACK, UNTIL_RESTORED
from runtime.tasks import STORED_VERSION, LiveTask, agent_message, answer_artifact, encode, load, status_ms, with_status

Outcome = Callable[[Task], Task]
"""How a run ends, applied to the task as it stands when the end is written (see LiveTask.persist)."""


def settle(state: TaskState, text: str) -> Outcome:
    return lambda current: with_status(current, state, agent_message(current, text))


def completed(live: LiveTask, output: str) -> Outcome:
    """The run's answer, ``output``, as its end: the task COMPLETED, with the answer as its last
    message and its answer artifact. The subscribers are sent the whole answer now
    (``LiveTask.finish_answer``), before the end is written."""
    task = live.task
    answer = agent_message(task, output)
    artifact = answer_artifact(output)
    live.finish_answer(output)

    def complete(current: Task) -> Task:
        done = attrs.evolve(current, history=(*current.history, answer), artifacts=(artifact,))
        return with_status(done, TaskState.COMPLETED, answer)

    return complete


def keeping_answer(live: LiveTask, outcome: Outcome) -> Outcome:
    """``outcome``, keeping as the task's answer artifact what its subscribers were sent of the
    answer, when it ends before a whole answer is stored (canceled, failed): so what a stream
    put together and what GetTask says agree, as in the reference."""

    def change(current: Task) -> Task:
        ended = outcome(current)
        streamed = live.streamed_answer()
        if ended is current or ended.artifacts or streamed is None:
            return ended
        return attrs.evolve(ended, artifacts=(streamed,))

    return change


def unless_settled(outcome: Outcome) -> Outcome:
    """``outcome``, unless the task is terminal already (then nothing is written): a run's end
    and a CancelTask race, and whichever is written first stands."""
    return lambda current: current if current.status.state.is_terminal else outcome(current)


CANCELED = settle(TaskState.CANCELED, "The task was canceled.")
SHUT_DOWN = settle(
    TaskState.CANCELED,
    "The task was canceled: the server shut down before it finished. Send the message again, with a new"
    " messageId, once the server is back.",
)
OVERTAKEN = (
    "The process running this task stopped before it finished, and its conversation has gone on since;"
    " send the message again, with a new messageId, to ask it after what was said since."
)
# A run's WORKING, unless a CancelTask came first: the run finds out at its next checkpoint, but
# it may have been inside a read that a cancellation waits for.
WORKING = unless_settled(lambda current: with_status(current, TaskState.WORKING))


async def cancel_task(tasks: TaskStore, runs: Mapping[str, LiveTask], owner: str, task_id: str) -> Task:
    """CancelTask (see ``Runner.cancel``): the task's run, if ``runs`` has it, is cancelled and
    writes CANCELED; a task no run of this process holds is written CANCELED as stored."""
    live = runs.get(task_id)
    if live is None or live.owner != owner:
        task, version = await load(tasks, owner, task_id)
        if task.status.state.is_terminal:
            raise TaskNotCancelable(task_id, task.status.state.value)
        live = runs.get(task_id)  # the load may have raced with the run's end
        if live is None:
            return await _cancel_stored(tasks, runs, owner, task, version)
    live.scope.cancel()
    # What the run streams until it next checkpoints is sent to no one: the answer kept with
    # CANCELED is what the subscribers have.
    live.freeze_answer()
    # Urgent: under load the writer is busy, and this write is what the client waits on.
    task = await live.persist(tasks, unless_settled(keeping_answer(live, CANCELED)), urgent=True)
    if task.status.state.is_terminal and task.status.state is not TaskState.CANCELED:
        raise TaskNotCancelable(task_id, task.status.state.value)  # as a cancel a moment later is
    return task


async def _cancel_stored(tasks: TaskStore, runs: Mapping[str, LiveTask], owner: str, task: Task, version: int) -> Task:
    """Settle a task no run of this process holds (its process died, or it ended just now)."""
    canceled = CANCELED(task)
    try:
        await tasks.update(
            owner, task.id, state=TaskState.CANCELED.wire_name(STORED_VERSION), task_json=encode(canceled),
            expected_version=version, urgent=True, updated_at_ms=status_ms(canceled),
        )  # fmt: skip
    except store_errors.VersionConflict:
        # It changed after it was read (a run that has just ended wrote it): judge it again.
        return await cancel_task(tasks, runs, owner, task.id)
    return canceled


def turn_of(messages: list[Transcribed], task_id: str) -> tuple[list[Transcribed], bool]:
    """The task's turn in the transcript: from the question it saved up to the next turn's
    question, empty if its question was never saved; and whether a later turn follows it (one
    can, when the end of this one's run could not be stored: it is taken up at the next start)."""
    for start in range(len(messages) - 1, -1, -1):
        if messages[start].turn_id == task_id:
            end = start + 1
            while end < len(messages) and not messages[end].turn_id:
                end += 1
            return messages[start:end], end < len(messages)
    return [], False


@attrs.define(eq=False)
class Working:
    """The task's WORKING state, written alongside the loop's first save; the loop's first model
    request waits for it (``AgentRun.ready``), and a write that failed fails the run there."""

    live: LiveTask
    tasks: TaskStore
    _done: trio.Event = attrs.field(init=False, factory=trio.Event)
    _error: Exception | None = attrs.field(init=False, default=None)

    async def write(self) -> None:
        try:
            await self.live.persist(self.tasks, WORKING)
        except Exception as exc:  # handed to the run, which fails with it (see wait)
            self._error = exc
        finally:
            self._done.set()

    async def wait(self) -> None:
        await self._done.wait()
        if self._error is not None:
            raise WorkingNotStored(self.live.task.id, damaged=store_errors.is_damage(self._error)) from self._error


class WorkingNotStored(AgentError):
    """The task's WORKING state could not be stored, so its run stops before the model is asked."""

    def __init__(self, task_id: str, *, damaged: bool = False) -> None:
        self.task_id = task_id
        if damaged:  # no outage that passes: the storage stays so until it is restored
            super().__init__(
                f"task {task_id!r} could not be stored as working: the server's storage is damaged where it is kept, so"
                f" the run stopped before calling the model; sending the message again fails so {UNTIL_RESTORED}"
            )
        else:
            super().__init__(
                f"task {task_id!r} could not be stored as working, so the run stopped before calling the model;"
                f" {SEND_AGAIN_WHEN_BACK}"
            )


def answer_streamer(live: LiveTask) -> Callable[[AgentEvent], None]:
    """The model's text, streamed to the task's subscribers as pieces of its answer artifact."""

    def on_event(event: AgentEvent) -> None:
        if isinstance(event, TextDelta) and event.text:
            live.stream_answer(event.text)
        elif isinstance(event, StepStarted):
            live.next_request()

    return on_event
