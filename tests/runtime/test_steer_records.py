"""A steer's record in its task's history, kept with the steer in runtime.db until the task holds
it, and settled as the task's run ends. Real SQLite stores, an in-process model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from persistence.api import TaskRecord
from persistence.sessions import SqliteSessionStore, open_session_store
from persistence.tasks import SqliteTaskStore, open_task_store
from protocol import TaskState, TextPart
from runtime.agent import AgentSpec
from runtime.runner import ANONYMOUS, Runner
from tests.runtime.agent_support import Answer, ScriptedModel
from tests.runtime.test_late_steers import DEADLINE_S, ask, asked


@attrs.define(eq=False)
class ReadsCounted:
    """A task store that notes the state of every task it reads."""

    store: SqliteTaskStore
    read: list[str] = attrs.field(factory=list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def get(self, owner: str, task_id: str) -> TaskRecord:
        record = await self.store.get(owner, task_id)
        self.read.append(record.state)
        return record


@attrs.define(eq=False)
class MarksCounted:
    """A session store that notes each write marking steers recorded."""

    store: SqliteSessionStore
    marked: list[tuple[str, ...]] = attrs.field(factory=list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def steers_recorded(self, session_id: str, message_ids: Sequence[str]) -> None:
        await self.store.steers_recorded(session_id, message_ids)
        self.marked.append(tuple(message_ids))


async def test_a_run_ending_with_steers_its_task_holds_reads_no_task_and_marks_them_in_one_write(tmp_path: Path) -> None:
    # Each steer's task is stored whole (33 messages of 1 MiB at most): read back and decoded once
    # a steer as the run ended, it held the event loop for seconds, with a write for each.
    hold = trio.Event()
    model = ScriptedModel([Answer("The lease expired.", hold=hold), Answer("All three.")])
    with trio.fail_after(DEADLINE_S):
        async with (
            open_session_store(tmp_path / "runtime.db") as store,
            open_task_store(tmp_path / "tasks.db") as task_store,
            trio.open_nursery() as nursery,
        ):
            sessions, tasks = MarksCounted(store), ReadsCounted(task_store)
            runner: Runner = await nursery.start(Runner(sessions, tasks, model, AgentSpec()).run)
            task = await runner.send(ANONYMOUS, ask("Which leases expired?"))
            await asked(model, 1)
            steers = [ask(text, task=task) for text in ("check staging", "and production", "and the cart")]
            for steer in steers:
                await runner.send(ANONYMOUS, steer)
            hold.set()
            done = await runner.wait_settled(ANONYMOUS, task.id)
            while runner.statistics().running:  # until the run has settled what it leaves
                await trio.sleep(0.005)
            pending = await store.pending_steers()
            runner.stop()
    assert done.status.state is TaskState.COMPLETED and done.history[-1].parts == (TextPart("All three."),)
    assert [m.message_id for m in done.history[1:4]] == [steer.message.message_id for steer in steers]
    assert pending == []
    assert "TASK_STATE_COMPLETED" not in tasks.read, tasks.read
    assert sessions.marked == [tuple(steer.message.message_id for steer in steers)]
