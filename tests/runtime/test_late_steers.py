"""Steers that come while an answer is being written, or as a run ends: a steer the runner
accepts is carried by a model request, however late it came; one too late for any is refused
with a reason, never acknowledged and left untaken. Real SQLite stores, an in-process model."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from persistence.api import TaskRecord
from persistence.memory import MemorySessionStore, MemoryTaskStore
from persistence.sessions import SqliteSessionStore
from persistence.transcript import Message as Transcribed
from protocol import Message, Role, SendMessageParams, Task, TaskState, TextPart, UnsupportedOperation
from runtime.agent import STEER_LABEL, AgentSpec
from runtime.runner import ANONYMOUS, Runner
from runtime.tasks import decode, new_id
from tests.runtime.agent_support import Answer, ScriptedModel, runner_over_files

DEADLINE_S = 10.0


def ask(text: str, *, task: Task | None = None, context_id: str | None = None) -> SendMessageParams:
    message = Message(
        message_id=new_id(), role=Role.USER, parts=(TextPart(text),), task_id=None if task is None else task.id,
        context_id=context_id,
    )  # fmt: skip
    return SendMessageParams(message=message)


@asynccontextmanager
async def runner_over(state: Path, model: ScriptedModel, agent: AgentSpec) -> AsyncIterator[Runner]:
    async with runner_over_files(state, model, lambda store: store, agent) as (runner, _, _):
        yield runner


async def asked(model: ScriptedModel, requests: int) -> None:
    """Until the model has been sent ``requests`` requests (the last one waits on its hold)."""
    while len(model.requests) < requests:
        await trio.testing.wait_all_tasks_blocked()


def steers_left(state: Path) -> int:
    with sqlite3.connect(f"file:{state / 'runtime.db'}?mode=ro", uri=True) as db:
        return int(db.execute("SELECT count(*) FROM steers").fetchone()[0])


async def test_a_steer_during_each_answer_gets_a_round_of_its_own_not_only_the_first(tmp_path: Path) -> None:
    first, second = trio.Event(), trio.Event()
    model = ScriptedModel([Answer("The lease expired.", hold=first), Answer("Staging too.", hold=second), Answer("All three.")])
    with trio.fail_after(DEADLINE_S):
        async with runner_over(tmp_path, model, AgentSpec()) as runner:
            task = await runner.send(ANONYMOUS, ask("Which leases expired?"))
            await asked(model, 1)
            await runner.send(ANONYMOUS, ask("also check staging", task=task))
            first.set()  # the answer ends with a steer waiting: one more round
            await asked(model, 2)
            steered = await runner.send(ANONYMOUS, ask("and production", task=task))
            assert steered.status.state is TaskState.WORKING
            second.set()  # and again: the steer is not acknowledged and then dropped
            done = await runner.wait_settled(ANONYMOUS, task.id)
    assert len(model.requests) == 3
    assert model.requests[2].messages[-1].text == STEER_LABEL + "and production"
    assert done.status.state is TaskState.COMPLETED and done.history[-1].parts == (TextPart("All three."),)
    assert steers_left(tmp_path) == 0


async def test_a_steer_too_late_for_the_budgets_last_request_is_refused_not_left_untaken(tmp_path: Path) -> None:
    first, last = trio.Event(), trio.Event()
    model = ScriptedModel([Answer("The lease expired.", hold=first), Answer("Staging too.", hold=last)])
    with trio.fail_after(DEADLINE_S):
        async with runner_over(tmp_path, model, AgentSpec(max_model_calls=2)) as runner:
            task = await runner.send(ANONYMOUS, ask("Which leases expired?"))
            await asked(model, 1)
            await runner.send(ANONYMOUS, ask("also check staging", task=task))
            first.set()
            await asked(model, 2)  # the budget's last request: nothing after it can carry a steer
            with pytest.raises(UnsupportedOperation) as refused:
                await runner.send(ANONYMOUS, ask("and production", task=task))
            last.set()
            done = await runner.wait_settled(ANONYMOUS, task.id)
    assert refused.value.message == (
        f"task {task.id!r} takes no more messages: its run is giving, or has given, its last answer; send this message"
        f" without a taskId, with contextId {task.context_id!r}, to start the conversation's next task"
    )
    assert done.status.state is TaskState.COMPLETED
    assert [part.text for m in done.history for part in m.parts if isinstance(part, TextPart)] == [
        "Which leases expired?", "also check staging", "Staging too."
    ]  # fmt: skip
    assert steers_left(tmp_path) == 0


@attrs.define(eq=False)
class LastLookHeld:
    """A session store whose look for steers after an answer (the run's last, if it finds none)
    waits for ``release`` once it has taken them: the moment a late steer used to slip into."""

    store: SqliteSessionStore
    entered: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def save_and_take_steers(self, session_id: str, messages: Sequence[Transcribed], **options: Any) -> list[str]:
        taken = await self.store.save_and_take_steers(session_id, messages, **options)
        if messages[-1].role == "assistant":
            self.entered.set()
            await self.release.wait()
        return taken


async def test_a_steer_sent_during_the_runs_last_look_is_refused_not_left_untaken(tmp_path: Path) -> None:
    model = ScriptedModel([Answer("The lease expired.")])
    said: list[str] = []
    with trio.fail_after(DEADLINE_S):
        async with runner_over_files(tmp_path, model, LastLookHeld) as (runner, sessions, _), trio.open_nursery() as nursery:
            task = await runner.send(ANONYMOUS, ask("Which leases expired?"))
            await sessions.entered.wait()  # the look has taken what was there: nothing

            async def steer() -> None:
                try:
                    await runner.send(ANONYMOUS, ask("also check staging", task=task))
                    said.append("accepted")
                except UnsupportedOperation as exc:
                    said.append(exc.message)

            nursery.start_soon(steer)
            await trio.testing.wait_all_tasks_blocked()
            sessions.release.set()
            done = await runner.wait_settled(ANONYMOUS, task.id)
    assert len(said) == 1 and said[0].startswith(f"task {task.id!r} takes no more messages: its run is giving")
    assert done.status.state is TaskState.COMPLETED and len(done.history) == 2
    assert steers_left(tmp_path) == 0


@attrs.define(eq=False)
class StaleRead(MemoryTaskStore):
    """A task store whose reads, once ``hold`` is set, return what they read only after
    ``release``: by then the task may have moved on."""

    hold: bool = False
    entered: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)

    async def get(self, owner: str, task_id: str) -> TaskRecord:
        record = await super().get(owner, task_id)
        if self.hold:
            self.hold = False
            self.entered.set()
            await self.release.wait()
        return record


async def test_a_steer_whose_task_ended_while_it_was_read_is_refused_not_recorded_after_the_answer() -> None:
    tasks, sessions, answered = StaleRead(), MemorySessionStore(), trio.Event()
    model = ScriptedModel([Answer("The lease expired.", hold=answered)])
    said: list[str] = []
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            runner: Runner = await nursery.start(Runner(sessions, tasks, model, AgentSpec()).run)
            task = await runner.send(ANONYMOUS, ask("Which leases expired?"))
            await asked(model, 1)

            async def steer() -> None:
                try:
                    said.append((await runner.send(ANONYMOUS, ask("also check staging", task=task))).status.state.value)
                except UnsupportedOperation as exc:
                    said.append(exc.message)

            tasks.hold = True
            nursery.start_soon(steer)
            await tasks.entered.wait()  # the steer has read the task WORKING
            answered.set()
            done = await runner.wait_settled(ANONYMOUS, task.id)  # and the run has ended since
            tasks.release.set()
            await trio.testing.wait_all_tasks_blocked()
            runner.stop()
    assert len(said) == 1 and said[0].startswith(f"task {task.id!r} takes no more messages"), said
    assert done.status.state is TaskState.COMPLETED
    stored = decode(await tasks.get(ANONYMOUS, task.id))
    assert [m.role for m in stored.history] == [Role.USER, Role.AGENT]  # no steer recorded after the answer
    assert await sessions.take_steers(task.context_id) == []


async def test_a_steer_its_task_never_took_is_not_kept_once_the_task_is_canceled(tmp_path: Path) -> None:
    model = ScriptedModel([Answer("The lease expired.", hold=trio.Event())])  # an answer that never ends
    with trio.fail_after(DEADLINE_S):
        async with runner_over(tmp_path, model, AgentSpec()) as runner:
            task = await runner.send(ANONYMOUS, ask("Which leases expired?"))
            await asked(model, 1)
            steer = ask("also check staging", task=task)
            assert (await runner.send(ANONYMOUS, steer)).status.state is TaskState.WORKING
            await runner.cancel(ANONYMOUS, task.id)
            while runner.statistics().running:  # until the run has ended, and settled what it leaves
                await trio.sleep(0.005)
            canceled = await runner.get(ANONYMOUS, task.id)
            again = await runner.send(ANONYMOUS, steer)  # sent again: the task it went to, and nothing new
    assert steers_left(tmp_path) == 0, "a steer no run will ever take is kept in runtime.db for good"
    assert canceled.status.state is TaskState.CANCELED
    assert [part.text for m in canceled.history for part in m.parts if isinstance(part, TextPart)] == [
        "Which leases expired?", "also check staging"
    ]  # fmt: skip
    assert again.id == task.id and again.status.state is TaskState.CANCELED and len(again.history) == len(canceled.history)


@attrs.define(eq=False)
class TurnPassedSlowly:
    """A session store whose conversation turn, the second time it is taken, is handed to the
    run that took it only on ``release``: the moment a turn passes from one run to the next,
    held open."""

    store: SqliteSessionStore
    handed: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)
    _taken: int = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    @asynccontextmanager
    async def turn_lock(self, session_id: str) -> AsyncIterator[None]:
        async with self.store.turn_lock(session_id):
            self._taken += 1
            if self._taken == 2:
                self.handed.set()
                await self.release.wait()
            yield


async def test_a_steer_to_a_task_waiting_its_turn_is_refused_while_the_turn_passes_to_the_task_ahead(tmp_path: Path) -> None:
    # Nothing held the turn at that moment, so the steer used to be taken for the task it was
    # sent to, and then dropped unseen by the first look of the run the turn went to: another
    # task's steer, to its store.
    answered = trio.Event()
    model = ScriptedModel([Answer("Checkout fixed.", hold=answered), Answer("Cart fixed."), Answer("Payments fixed.")])
    with trio.fail_after(DEADLINE_S):
        async with runner_over_files(tmp_path, model, TurnPassedSlowly) as (runner, sessions, _):
            first = await runner.send(ANONYMOUS, ask("Fix checkout"))
            await asked(model, 1)
            second = await runner.send(ANONYMOUS, ask("Then fix the cart", context_id=first.context_id))
            third = await runner.send(ANONYMOUS, ask("Then fix payments", context_id=first.context_id))
            answered.set()
            await sessions.handed.wait()  # the first run has let the turn go; the second's has not begun
            with pytest.raises(UnsupportedOperation) as refused:
                await runner.send(ANONYMOUS, ask("Only the mobile payments", task=third))
            sessions.release.set()
            done = await runner.wait_settled(ANONYMOUS, third.id)
    assert refused.value.message.startswith(
        f"task {third.id!r} has not started: it waits while task {second.id!r} has its conversation's turn"
    )
    assert done.status.state is TaskState.COMPLETED
    assert [part.text for m in done.history for part in m.parts if isinstance(part, TextPart)] == [
        "Then fix payments", "Payments fixed."
    ]  # fmt: skip
    assert steers_left(tmp_path) == 0
