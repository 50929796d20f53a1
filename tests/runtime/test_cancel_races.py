"""CancelTask against what races it: a steer read before the cancel and judged after it, and a
task waiting its turn behind a run the cancel has not yet stopped (a tool slow to let go).
Real SQLite stores, the real model client against the fake model over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import attrs
import trio
from fake_model import Call, FakeModel, Reply

from persistence.api import TaskRecord, TaskStore
from persistence.sessions import open_session_store
from persistence.tasks import SqliteTaskStore, open_task_store
from protocol import TaskState, TextPart, UnsupportedOperation
from runtime.agent import AgentSpec, Tool
from runtime.models import open_model_client
from runtime.runner import ANONYMOUS, Runner
from runtime.tasks import decode
from tests.runtime.agent_support import config_for, make_tool
from tests.runtime.served import DEADLINE_S, message, serve_keel
from tests.runtime.test_late_steers import ask


@attrs.define(eq=False)
class SlowToStop:
    """A tool that, cancelled, still takes until ``let_go`` to return: a cleanup of its own,
    shielded, as a tool that flushes what it wrote may do."""

    entered: trio.Event = attrs.field(factory=trio.Event)
    let_go: trio.Event = attrs.field(factory=trio.Event)

    def tool(self) -> Tool:
        return make_tool("flush", self._invoke)

    async def _invoke(self, arguments: dict[str, Any]) -> str:
        self.entered.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await self.let_go.wait()
        return "flushed"  # never: only a cancellation ends the sleep


@attrs.define(eq=False)
class ReadHeld:
    """tasks.db, whose next read of a task, once ``hold`` is set, hands back what it read only on
    ``release``: by then the task may have moved on."""

    store: SqliteTaskStore
    hold: bool = False
    entered: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def get(self, owner: str, task_id: str) -> TaskRecord:
        record = await self.store.get(owner, task_id)
        if self.hold:
            self.hold = False
            self.entered.set()
            await self.release.wait()
        return record


async def test_a_steer_read_before_a_cancel_and_judged_after_it_is_refused_not_acknowledged(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # It used to be taken, as the task had read WORKING: answered with the task CANCELED and the
    # steer in its history, for a run that would never ask the model again.
    slow = SlowToStop()
    fake_model.script = [Reply(tool_calls=[Call(name="flush")])]
    said: list[str] = []
    with trio.fail_after(DEADLINE_S):
        async with (
            open_session_store(tmp_path / "runtime.db") as sessions,
            open_task_store(tmp_path / "tasks.db") as store,
            open_model_client(config_for(fake_model)) as model,
            trio.open_nursery() as nursery,
        ):
            tasks = ReadHeld(store)
            agent = AgentSpec(tools=(slow.tool(),))
            runner: Runner = await nursery.start(Runner(sessions, cast(TaskStore, tasks), model, agent).run)
            task = await runner.send(ANONYMOUS, ask("Flush the cache"))
            await slow.entered.wait()

            async def steer() -> None:
                try:
                    said.append((await runner.send(ANONYMOUS, ask("only the staging cache", task=task))).status.state.value)
                except UnsupportedOperation as exc:
                    said.append(exc.message)

            tasks.hold = True
            nursery.start_soon(steer)
            await tasks.entered.wait()  # the steer has read the task WORKING
            canceled = await runner.cancel(ANONYMOUS, task.id)
            tasks.release.set()
            while not said:
                await trio.sleep(0.005)
            slow.let_go.set()
            while runner.statistics().running:  # until the run has ended
                await trio.sleep(0.005)
            stored = decode(await store.get(ANONYMOUS, task.id))
            left = await sessions.pending_steers(session_id=task.context_id)
            runner.stop()
    assert canceled.status.state is TaskState.CANCELED
    assert said == [
        f"task {task.id!r} takes no more messages: it has been canceled; send this message without a taskId, with"
        f" contextId {task.context_id!r}, to start the conversation's next task"
    ]
    assert [part.text for m in stored.history for part in m.parts if isinstance(part, TextPart)] == ["Flush the cache"]
    assert stored.status.state is TaskState.CANCELED and left == []


async def test_a_task_waiting_behind_a_canceled_run_is_not_sent_to_steer_that_run(fake_model: FakeModel, tmp_path: Path) -> None:
    # The canceled run holds its conversation's turn until its tool lets go. A steer to the task
    # waiting behind it was told to go to the canceled task instead, which refuses every message.
    slow = SlowToStop()
    fake_model.script = [Reply(tool_calls=[Call(name="flush")]), Reply(text="Restarted.")]
    async with serve_keel(tmp_path / "state", fake_model, agent=AgentSpec(tools=(slow.tool(),))) as keel:
        first = await keel.send("Flush the cache", blocking=False)
        with trio.fail_after(DEADLINE_S):
            await slow.entered.wait()
        assert (await keel.result("CancelTask", {"id": first["id"]}))["status"]["state"] == "TASK_STATE_CANCELED"
        second = await keel.send("Then restart the workers", blocking=False, contextId=first["contextId"])
        assert second["status"]["state"] == "TASK_STATE_SUBMITTED"
        error = await keel.error("SendMessage", {"message": message("only the blue ones", taskId=second["id"])})
        slow.let_go.set()
        with trio.fail_after(DEADLINE_S):
            done = await keel.runner.wait_settled(ANONYMOUS, second["id"])
    assert error["code"] == -32004
    assert error["message"] == (
        f"task {second['id']!r} has not started: it waits while task {first['id']!r}, which has been canceled, lets its"
        " conversation's turn go; send this message again once the task is working"
    )
    assert done.status.state is TaskState.COMPLETED


async def test_a_task_waiting_behind_a_run_giving_its_last_answer_is_not_sent_to_steer_that_run(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # A run in the budget's last model call takes no steer; the task waiting behind it was told to
    # send its steer there.
    fake_model.script = [Reply(text="The lease expired because", chunk_chars=4, hang_after_chunks=3), Reply(text="Done.")]
    async with serve_keel(tmp_path / "state", fake_model, agent=AgentSpec(max_model_calls=1)) as keel:
        first = await keel.send("Why did the lease expire?", blocking=False)
        with trio.fail_after(DEADLINE_S):
            while not fake_model.bodies:  # its one model call is under way
                await trio.sleep(0.005)
        second = await keel.send("Then renew it", blocking=False, contextId=first["contextId"])
        error = await keel.error("SendMessage", {"message": message("for a week", taskId=second["id"])})
        await keel.result("CancelTask", {"id": first["id"]})
        with trio.fail_after(DEADLINE_S):
            done = await keel.runner.wait_settled(ANONYMOUS, second["id"])
    assert error["code"] == -32004
    assert error["message"] == (
        f"task {second['id']!r} has not started: it waits while task {first['id']!r} gives its last answer; send this"
        " message again once the task is working"
    )
    assert done.status.state is TaskState.COMPLETED
