"""A task write that outlives its bound (another program holding tasks.db, a slow disk) and lands
after all, and a stored task that cannot be read: what the runner makes of them."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import attrs
import outcome
import pytest
import trio
import trio.testing
from fake_model import FakeModel, Reply

from persistence.api import TaskRecord
from persistence.errors import UnreadableTask
from persistence.memory import MemorySessionStore, MemoryTaskStore
from persistence.sessions import open_session_store
from persistence.tasks import open_task_store
from protocol import Message, Role, SendMessageParams, Task, TaskState, TaskStatus, TextPart
from runtime.agent import AgentSpec
from runtime.runner import ANONYMOUS, Runner, RunnerConfig
from runtime.tasks import decode, encode, new_id
from tests.runtime.agent_support import Answer, ScriptedModel
from tests.runtime.served import DEADLINE_S, GATE_CALL, message, serve_keel
from tests.runtime.test_state_cli import keel

WRITE_BOUND_S = 0.3  # RunnerConfig.cleanup_timeout_s: how long a task write may take


@attrs.define(eq=False)
class LateLanding(MemoryTaskStore):
    """A task store whose held writes land only once ``release`` is set, and land then even if
    the writer has stopped waiting for them, as a group-commit writer's queued write does."""

    nursery: trio.Nursery | None = None
    release: trio.Event = attrs.field(factory=trio.Event)
    held_state: str | None = None  # writes of this state are held
    _hold_next: bool = False

    def hold_next(self) -> None:
        self._hold_next = True

    async def update(self, owner: str, task_id: str, **fields: Any) -> TaskRecord:
        write = MemoryTaskStore.update
        held = self._hold_next or fields["state"] == self.held_state
        if not held or self.release.is_set():
            return await write(self, owner, task_id, **fields)
        self._hold_next = False
        landed = trio.Event()
        result: list[outcome.Outcome[TaskRecord]] = []

        async def land() -> None:
            await self.release.wait()
            result.append(await outcome.acapture(write, self, owner, task_id, **fields))
            landed.set()

        assert self.nursery is not None
        self.nursery.start_soon(land)
        await landed.wait()
        return result[0].unwrap()


def ask(text: str, task_id: str | None = None) -> SendMessageParams:
    return SendMessageParams(message=Message(message_id=new_id(), role=Role.USER, parts=(TextPart(text),), task_id=task_id))


async def stored(tasks: MemoryTaskStore, task_id: str) -> tuple[Task, int]:
    record = await tasks.get(ANONYMOUS, task_id)
    return decode(record), record.version


async def until_stored(tasks: MemoryTaskStore, task_id: str, *, state: TaskState | None = None, after: int = 0) -> Task:
    with trio.fail_after(DEADLINE_S):
        while True:
            task, version = await stored(tasks, task_id)
            if version > after and (state is None or task.status.state is state):
                return task
            await trio.sleep(0.01)


async def test_a_steer_whose_write_landed_after_its_bound_does_not_fail_the_writes_after_it() -> None:
    async with trio.open_nursery() as nursery:
        tasks = LateLanding(nursery=nursery)
        model = ScriptedModel([Answer("Rolling back the deploy now.", hold=trio.Event())])
        runner = Runner(MemorySessionStore(), tasks, model, AgentSpec(), RunnerConfig(cleanup_timeout_s=WRITE_BOUND_S))
        await nursery.start(runner.run)
        task = await runner.send(ANONYMOUS, ask("Roll back the deploy"))
        await until_stored(tasks, task.id, state=TaskState.WORKING)
        _, version = await stored(tasks, task.id)

        tasks.hold_next()  # the steer's write waits on the disk past its bound
        with pytest.raises(TimeoutError, match=task.id):
            await runner.send(ANONYMOUS, ask("Check the logs too", task_id=task.id))
        tasks.release.set()
        await until_stored(tasks, task.id, after=version)  # and then lands

        await runner.send(ANONYMOUS, ask("And the metrics", task_id=task.id))
        canceled = await runner.cancel(ANONYMOUS, task.id)
        assert canceled.status.state is TaskState.CANCELED
        ended, _ = await stored(tasks, task.id)
        assert ended.status.state is TaskState.CANCELED
        said = [message.parts[0].text for message in ended.history]  # type: ignore[union-attr]
        assert said == ["Roll back the deploy", "Check the logs too", "And the metrics"]
        runner.stop()


async def test_a_working_state_that_cannot_be_stored_fails_the_run_saying_so() -> None:
    async with trio.open_nursery() as nursery:
        tasks = LateLanding(nursery=nursery, held_state="TASK_STATE_WORKING")
        model = ScriptedModel([Answer("Never asked for.")])
        runner = Runner(MemorySessionStore(), tasks, model, AgentSpec(), RunnerConfig(cleanup_timeout_s=WRITE_BOUND_S))
        await nursery.start(runner.run)
        task = await runner.send(ANONYMOUS, ask("Roll back the deploy"))
        with trio.fail_after(DEADLINE_S):
            ended = await runner.wait_settled(ANONYMOUS, task.id)
        tasks.release.set()  # the WORKING write lands late, behind the end: refused as stale
        assert ended.status.state is TaskState.FAILED
        said = ended.status.message.parts[0].text  # type: ignore[union-attr]
        assert said == (
            f"The task failed: task {task.id!r} could not be stored as working, so the run stopped before calling the model;"
            " send the message again, with a new messageId, once the server's storage is back"
        )
        assert not model.requests
        assert (await stored(tasks, task.id))[0].status.state is TaskState.FAILED
        runner.stop()


def working_record(tasks_json: str | None = None) -> tuple[str, str, str]:
    """A task id, its context and its stored JSON: a WORKING task, or ``tasks_json`` as given."""
    task_id, context_id = new_id(), new_id()
    question = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Roll back the deploy"),), task_id=task_id)
    task = Task(id=task_id, context_id=context_id, status=TaskStatus(state=TaskState.WORKING), history=(question,))
    return task_id, context_id, encode(task) if tasks_json is None else tasks_json


async def left_working(path: Path, *task_jsons: str | None) -> list[str]:
    """tasks.db as a process killed mid-turn leaves it, with one WORKING task per JSON given."""
    ids = []
    async with open_task_store(path) as tasks:
        for task_json in task_jsons:
            task_id, context_id, text = working_record(task_json)
            await tasks.create(ANONYMOUS, task_id=task_id, context_id=context_id, state="TASK_STATE_WORKING", task_json=text)
            ids.append(task_id)
    return ids


@pytest.mark.parametrize("damage", ["{not json", json.dumps({"id": "x", "contextId": "y"})])
async def test_an_unfinished_task_that_cannot_be_read_stops_the_start_before_any_run_begins(
    tmp_path: Path, damage: str
) -> None:
    good, bad = await left_working(tmp_path / "tasks.db", None, damage)
    async with open_task_store(tmp_path / "tasks.db") as tasks:
        runner = Runner(MemorySessionStore(), tasks, ScriptedModel([Answer("Rolled back.")]), AgentSpec())
        with pytest.raises(BaseExceptionGroup) as refused:
            async with trio.open_nursery() as nursery:
                await nursery.start(runner.run)
        assert refused.group_contains(UnreadableTask, match=f"^task {bad!r} in tasks.db cannot be read")
        for task_id in (good, bad):  # the one before it was not begun, and so not canceled either
            assert (await tasks.get(ANONYMOUS, task_id)).state == "TASK_STATE_WORKING"


async def test_serve_names_the_unfinished_task_it_cannot_read_and_exits(tmp_path: Path) -> None:
    (tmp_path / ".state").mkdir()
    async with open_session_store(tmp_path / ".state" / "runtime.db"):  # beside it, as a server leaves it
        pass
    (_good, bad) = await left_working(tmp_path / ".state" / "tasks.db", None, "{not json")

    result = await trio.to_thread.run_sync(lambda: keel(tmp_path, "serve", "--port", "0"))

    assert result.returncode == 1
    assert f"error: task {bad!r} in tasks.db cannot be read (its JSON does not parse: " in result.stderr
    assert "restore a snapshot taken before it was damaged" in result.stderr
    assert "Traceback" not in result.stderr


async def test_a_steer_whose_write_outlives_its_bound_is_answered_as_a_storage_failure_and_lands_later(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    config = RunnerConfig(drain_timeout_s=0.1, cleanup_timeout_s=WRITE_BOUND_S)
    async with serve_keel(tmp_path / "state", fake_model, runner_config=config) as keel:
        keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done, with the staging runbook.")]
        task = await keel.send("Fix checkout", blocking=False)
        await keel.gate.wait_entered()
        steer = message("Use the staging runbook", "1.0", taskId=task["id"])
        other_program = sqlite3.connect(keel.state_dir / "tasks.db", isolation_level=None, check_same_thread=False)
        try:
            await trio.to_thread.run_sync(other_program.execute, "BEGIN IMMEDIATE")  # holds tasks.db's write lock
            error = await keel.error("SendMessage", {"message": steer, "configuration": {"returnImmediately": True}})
            await trio.to_thread.run_sync(other_program.execute, "ROLLBACK")
        finally:
            other_program.close()
        assert error["code"] == -32603
        assert error["message"].startswith("the server's storage failed while handling 'SendMessage'"), error
        keel.gate.opened.set()
        with trio.fail_after(DEADLINE_S):
            settled = await keel.runner.wait_settled(ANONYMOUS, task["id"])
    assert settled.status.state is TaskState.COMPLETED
    assert steer["messageId"] in [m.message_id for m in settled.history]  # the write landed after all


async def test_a_send_whose_client_leaves_while_its_task_is_written_still_runs_the_task(tmp_path: Path) -> None:
    # Quart cancels a request's handler when its client disconnects; the task's write it was
    # waiting for lands all the same (a queued write is not withdrawn), so its run must start.
    entered, release = threading.Event(), threading.Event()

    def busy_disk(_conn: sqlite3.Connection) -> None:
        entered.set()
        release.wait(DEADLINE_S)

    async def leave_once_blocked(client: trio.CancelScope) -> None:
        await trio.testing.wait_all_tasks_blocked()
        client.cancel()
        release.set()  # and then the disk answers

    async with open_task_store(tmp_path / "tasks.db") as tasks, trio.open_nursery() as nursery:
        runner = Runner(MemorySessionStore(), tasks, ScriptedModel([Answer("Rolled back.")]), AgentSpec())
        await nursery.start(runner.run)
        nursery.start_soon(tasks.pool.run, busy_disk)
        await trio.to_thread.run_sync(entered.wait, DEADLINE_S)
        sent = ask("Roll back the deploy")
        with trio.CancelScope() as client:
            nursery.start_soon(leave_once_blocked, client)
            await runner.send(ANONYMOUS, sent)
            await trio.lowlevel.checkpoint()  # where the request, cancelled, ends
        assert client.cancelled_caught
        with trio.fail_after(DEADLINE_S):
            while (task_id := await tasks.started_by(ANONYMOUS, sent.message.message_id)) is None:
                await trio.sleep(0.01)  # polled until the write lands (the pool's thread tells no one)
            await trio.testing.wait_all_tasks_blocked()  # and the runner has taken it up
            ended = await runner.wait_settled(ANONYMOUS, task_id)
        assert ended.status.state is TaskState.COMPLETED
        assert ended.artifacts[0].parts[0].text == "Rolled back."  # type: ignore[union-attr]
        runner.stop()


async def test_a_send_whose_task_write_is_slow_waits_for_it_and_the_task_runs(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # Another program holds tasks.db past every bound the runner has: the client still waiting
    # gets its task once the write lands, and the task runs (no time passes but by the jump).
    entered, release = threading.Event(), threading.Event()

    def busy_disk(_conn: sqlite3.Connection) -> None:
        entered.set()
        release.wait(DEADLINE_S)

    async with open_task_store(tmp_path / "tasks.db") as tasks, trio.open_nursery() as nursery:
        config = RunnerConfig(cleanup_timeout_s=WRITE_BOUND_S)
        runner = Runner(MemorySessionStore(), tasks, ScriptedModel([Answer("Rolled back.")]), AgentSpec(), config)
        await nursery.start(runner.run)
        nursery.start_soon(tasks.pool.run, busy_disk)
        await trio.to_thread.run_sync(entered.wait, DEADLINE_S)

        async def disk_answers_late() -> None:
            await trio.testing.wait_all_tasks_blocked()  # the send waits on its write
            mock_clock.jump(10 * WRITE_BOUND_S)
            await trio.testing.wait_all_tasks_blocked()  # any bound that was to fire has fired
            release.set()

        nursery.start_soon(disk_answers_late)
        task = await runner.send(ANONYMOUS, ask("Roll back the deploy"))
        assert task.status.state is TaskState.SUBMITTED
        ended = await runner.wait_settled(ANONYMOUS, task.id)
        assert ended.status.state is TaskState.COMPLETED
        runner.stop()
