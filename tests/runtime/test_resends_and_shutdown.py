"""A message sent again without its task's id, and what a shutdown says of the runs it cuts:
over real HTTP and real SQLite, or the runner alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from fake_model import Reply

from persistence.api import TaskRecord
from persistence.memory import MemorySessionStore, MemoryTaskStore
from persistence.sessions import SqliteSessionStore
from protocol import Message, Role, SendMessageParams, Task, TaskNotCancelable, TaskState, TextPart, UnsupportedOperation
from runtime.agent import AgentSpec
from runtime.runner import ANONYMOUS, Runner, RunnerConfig
from runtime.tasks import decode, new_id
from tests.runtime.agent_support import Answer, ScriptedModel, runner_over_files
from tests.runtime.served import DEADLINE_S, GATE_CALL, Served, fill_tasks_disk, free_tasks_disk, message

V1 = "1.0"


@pytest.mark.parametrize("when", ["while it works", "after it ended"])
async def test_a_steer_not_recorded_in_its_task_is_recorded_when_sent_again_without_its_task_id(
    keel: Served, when: str
) -> None:
    # The steer is stored for the conversation, then its task's history write fails (a full
    # disk; or the process dies between the two writes). Sent again with its taskId it is
    # recorded; sent again without it (in its contextId) it must be too, not answered with a
    # task whose history never shows it (the model took it all the same).
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done, as asked.")]
    task = await keel.send("Fix checkout", blocking=False)
    await keel.gate.wait_entered()
    fill_tasks_disk(keel.state_dir, for_text="staging runbook")
    steer = message("Use the staging runbook", V1, taskId=task["id"])
    error = await keel.error("SendMessage", {"message": steer, "configuration": {"returnImmediately": True}})
    assert error["code"] == -32603, error
    free_tasks_disk(keel.state_dir)
    if when == "after it ended":
        keel.gate.opened.set()
        with trio.fail_after(DEADLINE_S):
            assert (await keel.runner.wait_settled(ANONYMOUS, task["id"])).status.state.value == "completed"
    resent = {key: value for key, value in steer.items() if key != "taskId"} | {"contextId": task["contextId"]}
    again = (await keel.result("SendMessage", {"message": resent, "configuration": {"returnImmediately": True}}))["task"]
    assert again["id"] == task["id"]
    assert steer["messageId"] in [m["messageId"] for m in again.get("history", [])], "the steer is not in its task's history"
    keel.gate.opened.set()
    with trio.fail_after(DEADLINE_S):
        settled = await keel.runner.wait_settled(ANONYMOUS, task["id"])
    assert steer["messageId"] in [m.message_id for m in settled.history]


@attrs.define(eq=False)
class HeldCompletion(MemoryTaskStore):
    """A task store whose COMPLETED writes land only once ``release`` is set."""

    entered: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)

    async def update(self, owner: str, task_id: str, **fields: Any) -> TaskRecord:
        if fields["state"] == "TASK_STATE_COMPLETED":
            self.entered.set()
            await self.release.wait()
        return await super().update(owner, task_id, **fields)


async def test_a_cancel_that_the_runs_completion_was_written_before_is_not_cancelable() -> None:
    # The run's COMPLETED is being written when CancelTask comes: it stands, and the cancel is
    # answered as one a moment later would be, not with the completed task as if canceled.
    tasks = HeldCompletion()
    runner = Runner(MemorySessionStore(), tasks, ScriptedModel([Answer("Rolled back.")]), AgentSpec())
    question = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Roll back the deploy"),))
    refused: list[TaskNotCancelable] = []

    async def cancel(task_id: str) -> None:
        with pytest.raises(TaskNotCancelable) as raised:
            await runner.cancel(ANONYMOUS, task_id)
        refused.append(raised.value)

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            task = await runner.send(ANONYMOUS, SendMessageParams(message=question))
            await tasks.entered.wait()
            nursery.start_soon(cancel, task.id)
            await trio.testing.wait_all_tasks_blocked()  # the cancel waits for the write under way
            tasks.release.set()
            await runner.wait_settled(ANONYMOUS, task.id)
            runner.stop()
    [error] = refused
    assert task.id in error.message and "completed" in error.message
    assert decode(await tasks.get(ANONYMOUS, task.id)).status.state is TaskState.COMPLETED


async def test_the_drains_log_line_does_not_call_a_task_whose_run_had_ended_canceled(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # The run has answered; its COMPLETED is being written (a busy writer) when the drain's time
    # is up. The shutdown cancels nothing of it, and it ends COMPLETED: the log must not name it
    # among the tasks "canceled" for not finishing in time.
    tasks = HeldCompletion()
    runner = Runner(
        MemorySessionStore(), tasks, ScriptedModel([Answer("Rolled back.")]), AgentSpec(),
        RunnerConfig(drain_timeout_s=0.5, cleanup_timeout_s=5.0),
    )  # fmt: skip
    question = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Roll back the deploy"),))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        task = await runner.send(ANONYMOUS, SendMessageParams(message=question))
        with trio.fail_after(DEADLINE_S):
            await tasks.entered.wait()
        runner.stop()
        await trio.sleep(1.0)  # the drain's 0.5 s are up; the write is still within its 5 s bound
        tasks.release.set()
        with trio.fail_after(DEADLINE_S):
            await runner.wait_stopped()
    assert decode(await tasks.get(ANONYMOUS, task.id)).status.state is TaskState.COMPLETED
    said = [r.getMessage() for r in caplog.records if "are canceled" in r.getMessage()]
    assert not any(task.id in line for line in said), said


@attrs.define(eq=False)
class HeldCreation(MemoryTaskStore):
    """A task store whose new tasks land only once ``release`` is set (a slow disk)."""

    entered: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)

    async def create(self, owner: str, **fields: Any) -> TaskRecord:
        self.entered.set()
        await self.release.wait()
        return await super().create(owner, **fields)


async def test_a_task_written_once_the_drain_is_over_is_named_among_those_the_shutdown_cancels(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A send taken before the shutdown whose task lands only after the drain's time is up: its
    # run is cancelled as it starts and the task recorded CANCELED, as the drain's are. The log
    # must name it with them, as it names every task the shutdown cancels.
    tasks = HeldCreation()
    runner = Runner(MemorySessionStore(), tasks, ScriptedModel([]), AgentSpec(), RunnerConfig(drain_timeout_s=0.5))
    question = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Roll back the deploy"),))
    sent: list[Task] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)

        async def send() -> None:
            sent.append(await runner.send(ANONYMOUS, SendMessageParams(message=question)))

        nursery.start_soon(send)
        with trio.fail_after(DEADLINE_S):
            await tasks.entered.wait()
        runner.stop()
        await trio.sleep(1.0)  # the drain's 0.5 s are up; the write is within the 5 s it is given after
        tasks.release.set()
        with trio.fail_after(DEADLINE_S):
            await runner.wait_stopped()
    [task] = sent
    ended = decode(await tasks.get(ANONYMOUS, task.id))
    assert ended.status.state is TaskState.CANCELED
    said = [r.getMessage() for r in caplog.records if "shutting down" in r.getMessage()]
    assert any(task.id in line and "canceled" in line for line in said), said


async def test_runs_cut_short_by_a_second_signal_say_the_server_shut_down(autojump_clock: trio.testing.MockClock) -> None:
    # serve's answer to a second SIGTERM/SIGINT is to cancel the server's nursery, the runner's
    # with it, during the drain. Those runs are cancelled by the shutdown as surely as the ones
    # the drain's timeout cuts; they must not read as a client's CancelTask.
    tasks = MemoryTaskStore()
    runner = Runner(
        MemorySessionStore(), tasks, ScriptedModel([Answer("Rolling back the deploy now.", hold=trio.Event())]),
        AgentSpec(), RunnerConfig(drain_timeout_s=60.0),
    )  # fmt: skip
    question = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Roll back the deploy"),))
    with trio.CancelScope() as server:
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            task = await runner.send(ANONYMOUS, SendMessageParams(message=question))
            with trio.fail_after(DEADLINE_S):
                while decode(await tasks.get(ANONYMOUS, task.id)).status.state is not TaskState.WORKING:
                    await trio.sleep(0.01)
            runner.stop()  # the first signal: the drain begins
            await trio.sleep(1.0)
            server.cancel()  # the second: stopping now
    ended = decode(await tasks.get(ANONYMOUS, task.id))
    assert ended.status.state is TaskState.CANCELED
    assert ended.status.message is not None
    said = ended.status.message.parts[0].text  # type: ignore[union-attr]
    assert "the server shut down before it finished" in said, said


@attrs.define(eq=False)
class SteerHeld:
    """A session store that stores a steer only once ``release`` is set: a steer in flight."""

    store: SqliteSessionStore
    entered: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def add_steer(self, session_id: str, text: str, **options: Any) -> bool:
        self.entered.set()
        await self.release.wait()
        return await self.store.add_steer(session_id, text, **options)


async def test_a_steer_sent_again_without_its_task_id_while_it_is_still_being_taken_starts_nothing(
    tmp_path: Path,
) -> None:
    # Each copy looked for the other's record before either was written: the steer went to its
    # task, and the copy without the taskId started a task of its own with the same messageId.
    answered = trio.Event()
    model = ScriptedModel([
        Answer("Rolled back.", hold=answered), Answer("Rolled back staging too."),
        Answer("Rolled back staging."),  # for the task the copy must not start
    ])  # fmt: skip
    question = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Roll back the deploy"),))
    answers: dict[str, Task] = {}
    with trio.fail_after(DEADLINE_S):
        async with runner_over_files(tmp_path, model, SteerHeld) as (runner, sessions, tasks):
            task = await runner.send(ANONYMOUS, SendMessageParams(message=question))
            steer = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("and staging"),), task_id=task.id)
            again = attrs.evolve(steer, task_id=None, context_id=task.context_id)

            async def send(name: str, message: Message) -> None:
                answers[name] = await runner.send(ANONYMOUS, SendMessageParams(message=message))

            async with trio.open_nursery() as sending:
                sending.start_soon(send, "steer", steer)
                await sessions.entered.wait()
                sending.start_soon(send, "again", again)
                await trio.testing.wait_all_tasks_blocked()
                sessions.release.set()
            answered.set()
            done = await runner.wait_settled(ANONYMOUS, task.id)
            listed = await tasks.list(ANONYMOUS)
    assert answers["steer"].id == answers["again"].id == task.id
    assert listed.total_size == 1, "the message started a task of its own"
    assert [m.message_id for m in done.history].count(steer.message_id) == 1
    assert done.status.state is TaskState.COMPLETED


async def test_a_message_sent_again_during_the_drain_gets_its_task_back_and_a_new_one_is_refused(tmp_path: Path) -> None:
    # A client whose answer was lost sends its message again as the server drains: the task it
    # started is there to give back. Only a message that would start a new task is refused.
    hold = trio.Event()
    model = ScriptedModel([Answer("Rolling back the deploy now.", hold=hold)])
    question = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Roll back the deploy"),))
    async with runner_over_files(tmp_path, model, lambda store: store) as (runner, _, tasks):
        task = await runner.send(ANONYMOUS, SendMessageParams(message=question))
        with trio.fail_after(DEADLINE_S):
            while decode(await tasks.get(ANONYMOUS, task.id)).status.state is not TaskState.WORKING:
                await trio.sleep(0.01)
        runner.stop()  # the drain begins; the run goes on

        again = await runner.send(ANONYMOUS, SendMessageParams(message=question))
        with pytest.raises(UnsupportedOperation, match="shutting down and takes no new tasks"):
            await runner.send(ANONYMOUS, SendMessageParams(message=attrs.evolve(question, message_id=new_id())))
        hold.set()
    assert (again.id, again.status.state) == (task.id, TaskState.WORKING)


@pytest.mark.parametrize("refused_for", ["its task has ended", "its task has been canceled"])
async def test_a_message_refused_during_the_drain_is_not_told_to_start_a_task_the_server_refuses(
    tmp_path: Path, refused_for: str
) -> None:
    # As the server drains it takes no new task. A message to a task that takes no more messages
    # is then told to go to the server that replaces this one, not to start the conversation's
    # next task here, which would be refused in turn.
    hold = trio.Event()
    model = ScriptedModel([Answer("The deploy is rolled back."), Answer("Checking the logs now.", hold=hold)])
    first = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Roll back the deploy"),))
    async with runner_over_files(tmp_path, model, lambda store: store) as (runner, _, tasks):
        ended = await runner.send(ANONYMOUS, SendMessageParams(message=first))
        with trio.fail_after(DEADLINE_S):
            ended = await runner.wait_settled(ANONYMOUS, ended.id)
        second = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Check the logs"),), context_id=ended.context_id)
        working = await runner.send(ANONYMOUS, SendMessageParams(message=second))
        with trio.fail_after(DEADLINE_S):
            while decode(await tasks.get(ANONYMOUS, working.id)).status.state is not TaskState.WORKING:
                await trio.sleep(0.01)
        target = ended
        if refused_for == "its task has been canceled":
            await runner.cancel(ANONYMOUS, working.id)
            target = working
        runner.stop()  # the drain begins
        steer = Message(
            message_id=new_id(), role=Role.USER, parts=(TextPart("Also the cache"),), task_id=target.id,
            context_id=ended.context_id,
        )  # fmt: skip
        with pytest.raises(UnsupportedOperation) as refused:
            await runner.send(ANONYMOUS, SendMessageParams(message=steer))
        hold.set()
    said = str(refused.value)
    assert target.id in said
    assert "shutting down" in said and "once the server that replaces it is up" in said, said
