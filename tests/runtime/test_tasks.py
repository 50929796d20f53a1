"""LiveTask: writes that apply each change to the newest task, and subscriptions that end at
once, or, cut short, with why."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from persistence.api import TaskRecord
from persistence.errors import StoreClosed
from persistence.memory import MemorySessionStore, MemoryTaskStore
from persistence.tasks import open_task_store
from persistence.transcript import Message as Transcribed
from protocol import (
    EndNotStored,
    InvalidTransition,
    Message,
    Role,
    SendMessageParams,
    StreamCut,
    Task,
    TaskState,
    TaskStatus,
    TaskArtifactUpdateEvent,
    TaskStatusUpdateEvent,
    TextPart,
    UnsupportedOperation,
)
from runtime.agent import AgentSpec
from runtime.models import ChatRequest, Delta, TextDelta
from runtime.runner import ANONYMOUS, Runner, RunnerConfig
from runtime.tasks import (
    SUBSCRIBER_BUFFER,
    LiveTask,
    StreamItem,
    answer_artifact,
    decode,
    encode,
    message_text,
    new_id,
    now,
    with_status,
)
from tests.runtime.agent_support import Answer, ScriptedModel, ScriptedStream


async def live_task(store: MemoryTaskStore) -> LiveTask:
    task = Task(id="t-1", context_id="c-1", status=TaskStatus(state=TaskState.SUBMITTED, timestamp=now()))
    record = await store.create("o", task_id=task.id, context_id=task.context_id, state="TASK_STATE_SUBMITTED", task_json=encode(task))
    return LiveTask(owner="o", task=task, version=record.version)


async def test_persist_applies_each_change_to_the_task_as_it_stands_when_written() -> None:
    store = MemoryTaskStore()
    live = await live_task(store)
    steer = Message(message_id="m-2", role=Role.USER, parts=[TextPart("use staging")], task_id="t-1", context_id="c-1")
    async with trio.open_nursery() as nursery:
        # The run moves to WORKING while a steer is added: whichever writes second must keep both.
        nursery.start_soon(live.persist, store, lambda task: with_status(task, TaskState.WORKING))
        nursery.start_soon(live.persist, store, lambda task: attrs.evolve(task, history=(*task.history, steer)))
    stored = decode(await store.get("o", "t-1"))
    for task in (live.task, stored):
        assert task.status.state is TaskState.WORKING
        assert task.history == (steer,)


async def test_unsubscribe_forgets_the_subscriber_at_once() -> None:
    live = await live_task(MemoryTaskStore())
    receive = live.subscribe()
    assert live.subscribers == 1
    live.unsubscribe(receive)
    assert live.subscribers == 0


def drain(receive: trio.MemoryReceiveChannel[StreamItem]) -> list[StreamItem]:
    items = []
    while True:
        try:
            items.append(receive.receive_nowait())
        except trio.EndOfChannel:
            return items


async def test_a_subscriber_that_falls_too_far_behind_is_cut_off_with_why_and_the_others_go_on() -> None:
    live = await live_task(MemoryTaskStore())
    slow, fast = live.subscribe(), live.subscribe()
    read: list[StreamItem] = [fast.receive_nowait()]  # the task as it stands
    sent = [
        TaskStatusUpdateEvent(task_id="t-1", context_id="c-1", status=TaskStatus(state=TaskState.WORKING, timestamp=now()))
        for _ in range(SUBSCRIBER_BUFFER + 10)
    ]
    for event in sent:
        live.publish(event)
        read.append(fast.receive_nowait())  # this one keeps up
    assert read[1:] == sent and live.subscribers == 1
    kept = drain(slow)  # the task, as many events as fit, then why it ends
    assert kept[0] == live.task and kept[1:-1] == sent[: SUBSCRIBER_BUFFER - 1]
    cut = kept[-1]
    assert isinstance(cut, StreamCut) and "'t-1'" in cut.message and f"{SUBSCRIBER_BUFFER} events behind" in cut.message
    assert "SubscribeToTask" in cut.message
    live.close()
    assert drain(fast) == []  # the settled task ends the other one, without a cut


FORK_AND_DRAW = """
import os
from runtime.tasks import new_id
new_id()  # the parent now holds ids drawn but not yet used
read, write = os.pipe()
if os.fork() == 0:
    os.write(write, new_id().encode())
    os._exit(0)
os.close(write)
os.wait()
print(os.read(read, 64).decode(), new_id())
"""


def test_a_forked_child_never_repeats_its_parents_ids() -> None:
    # In a fresh interpreter, which has no threads to make a fork unsafe.
    done = subprocess.run([sys.executable, "-c", FORK_AND_DRAW], capture_output=True, text=True, timeout=60, check=True)
    childs, parents = done.stdout.split()
    assert len(childs) == len(parents) == 32 and childs != parents


def test_new_ids_are_distinct_version_7_uuids_in_the_order_they_were_made(monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    before_ms = time.time_ns() // 1_000_000
    ids = [new_id() for _ in range(1000)]
    after_ms = time.time_ns() // 1_000_000
    assert len(set(ids)) == 1000
    for text in ids:
        parsed = uuid.UUID(hex=text)
        assert (parsed.version, parsed.variant, parsed.hex) == (7, uuid.RFC_4122, text)
        assert before_ms <= parsed.int >> 80 <= after_ms  # the millisecond it was made in
    # The random bits differ, on both sides of the version digit.
    assert len({text[13:16] for text in ids}) > 500 and len({text[16:] for text in ids}) == 1000
    # Made in a later millisecond, an id sorts after every id made before it: in an index keyed
    # by ids, a new one goes in at the end.
    now_ns = [1_796_000_000_000 * 1_000_000]
    monkeypatch.setattr(time, "time_ns", lambda: now_ns[0])
    made = []
    for _ in range(3):
        made += [new_id() for _ in range(100)]
        now_ns[0] += 1_000_000
    assert sorted(made[:100]) + sorted(made[100:200]) + sorted(made[200:]) == sorted(made)
    assert {int(text[:12], 16) for text in made} == {1_796_000_000_000, 1_796_000_000_001, 1_796_000_000_002}


@attrs.define(eq=False)
class AnswerSaveGate(MemorySessionStore):
    """Holds the save of a turn's answer until ``release``: the run is then inside a shielded
    save, past the last point where a cancellation could stop it."""

    entered: trio.Event = attrs.field(factory=trio.Event, kw_only=True)
    release: trio.Event = attrs.field(factory=trio.Event, kw_only=True)

    async def save(self, session_id: str, messages: Sequence[Transcribed]) -> None:
        await self._hold(messages)
        await super().save(session_id, messages)

    async def save_and_take_steers(self, session_id: str, messages: Sequence[Transcribed], **options: Any) -> list[str]:
        await self._hold(messages)  # the run's look for steers after its answer saves the answer
        return await super().save_and_take_steers(session_id, messages, **options)

    async def _hold(self, messages: Sequence[Transcribed]) -> None:
        if messages and messages[-1].role == "assistant" and not messages[-1].tool_calls:
            self.entered.set()
            await self.release.wait()


@attrs.define(eq=False)
class NotedTasks(MemoryTaskStore):
    """A task store that notes each update's state and whether it was urgent; its disk fails
    when the state ``fail_at`` is written."""

    fail_at: str | None = None
    writes: list[tuple[str, bool]] = attrs.field(factory=list)

    async def update(self, owner: str, task_id: str, **fields: Any) -> TaskRecord:
        self.writes.append((fields["state"], fields.get("urgent", False)))
        if fields["state"] == self.fail_at:
            raise StoreClosed("tasks.db")
        return await super().update(owner, task_id, **fields)


@asynccontextmanager
async def turn_held_at_its_answer(tasks: MemoryTaskStore) -> AsyncIterator[tuple[Runner, AnswerSaveGate, Task]]:
    """A running runner and its one task, whose run is inside the shielded save of its answer
    until the block releases it (or leaves); the runner stops when the block is left."""
    sessions = AnswerSaveGate()
    runner = Runner(sessions, tasks, ScriptedModel([Answer("All done.")]), AgentSpec())
    question = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("Roll back the deploy"),))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        task = await runner.send(ANONYMOUS, SendMessageParams(message=question))
        with trio.fail_after(10):
            await sessions.entered.wait()
        yield runner, sessions, task
        sessions.release.set()
        runner.stop()


@asynccontextmanager
async def ended_but_not_stored(tasks: MemoryTaskStore) -> AsyncIterator[tuple[Runner, AnswerSaveGate, Task]]:
    """As ``turn_held_at_its_answer``, once the run has ended and its end could not be stored
    (a blocking send was told so)."""
    async with turn_held_at_its_answer(tasks) as (runner, sessions, task):
        sessions.release.set()
        with trio.fail_after(10), pytest.raises(EndNotStored):
            await runner.wait_settled(ANONYMOUS, task.id)
        yield runner, sessions, task


async def test_a_cancel_written_first_stands_when_the_run_then_completes() -> None:
    tasks = MemoryTaskStore()
    async with turn_held_at_its_answer(tasks) as (runner, sessions, task):
        canceled = await runner.cancel(ANONYMOUS, task.id)  # answered while the run still saves
        assert canceled.status.state is TaskState.CANCELED
        assert runner.statistics().running == 1
    stored = decode(await tasks.get(ANONYMOUS, task.id))
    assert stored.status.state is TaskState.CANCELED  # the run's COMPLETED did not overwrite it
    assert stored.status == canceled.status
    assert (await sessions.messages(task.context_id))[-1].text == "All done."  # the answer was kept


async def test_a_cancels_write_goes_ahead_of_queued_writes_and_the_runs_own_do_not() -> None:
    tasks = NotedTasks()
    async with turn_held_at_its_answer(tasks) as (runner, _, task):
        await runner.cancel(ANONYMOUS, task.id)
    assert tasks.writes == [("TASK_STATE_WORKING", False), ("TASK_STATE_CANCELED", True)]


async def test_a_subscriber_is_told_when_the_tasks_end_could_not_be_stored() -> None:
    tasks = NotedTasks(fail_at="TASK_STATE_COMPLETED")
    async with turn_held_at_its_answer(tasks) as (runner, sessions, task):
        async with runner.subscribe(ANONYMOUS, task.id) as events:
            sessions.release.set()
            with trio.fail_after(10):
                received = [event async for event in events]
    cut = received[-1]
    assert isinstance(cut, StreamCut) and task.id in cut.message and "could not be stored" in cut.message
    assert decode(await tasks.get(ANONYMOUS, task.id)).status.state is TaskState.WORKING  # as last stored


async def test_a_subscriber_that_comes_after_the_end_could_not_be_stored_is_told_so_too() -> None:
    tasks = NotedTasks(fail_at="TASK_STATE_COMPLETED")
    async with ended_but_not_stored(tasks) as (runner, sessions, task):
        async with runner.subscribe(ANONYMOUS, task.id) as events:
            with trio.fail_after(10):
                received = [event async for event in events]
    first, cut = received[0], received[-1]
    assert isinstance(first, Task) and first.status.state is TaskState.WORKING  # as last stored
    assert isinstance(cut, StreamCut) and task.id in cut.message and "could not be stored" in cut.message


async def test_a_message_to_a_task_whose_run_is_over_but_whose_end_is_not_stored_says_so() -> None:
    tasks = NotedTasks(fail_at="TASK_STATE_COMPLETED")
    async with ended_but_not_stored(tasks) as (runner, sessions, task):
        steer = Message(message_id=new_id(), role=Role.USER, parts=(TextPart("use staging"),), task_id=task.id)
        with pytest.raises(UnsupportedOperation) as refused:
            await runner.send(ANONYMOUS, SendMessageParams(message=steer))
        assert await sessions.take_steers(task.context_id) == []  # not left for the conversation's next turn
    assert task.id in refused.value.message and "takes no more messages" in refused.value.message
    assert "has not started" not in refused.value.message


async def test_a_blocking_send_is_told_when_the_tasks_end_could_not_be_stored() -> None:
    tasks = NotedTasks(fail_at="TASK_STATE_COMPLETED")
    async with turn_held_at_its_answer(tasks) as (runner, sessions, task):
        sessions.release.set()
        with trio.fail_after(10), pytest.raises(EndNotStored) as raised:
            await runner.wait_settled(ANONYMOUS, task.id)  # what a blocking SendMessage waits on
    assert task.id in str(raised.value) and "could not be stored" in str(raised.value)
    assert decode(await tasks.get(ANONYMOUS, task.id)).status.state is TaskState.WORKING  # as last stored


async def test_an_end_that_could_not_be_stored_is_tried_again_until_the_store_takes_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tasks = NotedTasks(fail_at="TASK_STATE_COMPLETED")
    async with turn_held_at_its_answer(tasks) as (runner, sessions, task):
        sessions.release.set()
        with trio.fail_after(10), pytest.raises(EndNotStored, match="the server keeps trying"):
            await runner.wait_settled(ANONYMOUS, task.id)
        await trio.sleep(100)  # the disk stays full for 100 s
        attempts = [state for state, _ in tasks.writes].count("TASK_STATE_COMPLETED")
        assert 5 <= attempts <= 8  # after 1, 2, 4, 8, 16 and 30 s: less and less often
        assert decode(await tasks.get(ANONYMOUS, task.id)).status.state is TaskState.WORKING
        tasks.fail_at = None  # room again
        with trio.fail_after(31):
            while decode(await tasks.get(ANONYMOUS, task.id)).status.state is not TaskState.COMPLETED:
                await trio.sleep(1)
        assert (await runner.wait_settled(ANONYMOUS, task.id)).status.state is TaskState.COMPLETED  # no EndNotStored now
        assert runner.statistics().running == 0
    stored = decode(await tasks.get(ANONYMOUS, task.id))
    assert stored.status.message is not None and stored.status.message.parts == (TextPart("All done."),)


async def test_a_runner_that_stops_leaves_an_end_it_could_not_store_to_the_next_process() -> None:
    tasks = NotedTasks(fail_at="TASK_STATE_COMPLETED")
    async with ended_but_not_stored(tasks) as (runner, sessions, task):
        runner.stop()
        with trio.fail_after(10):
            await runner.wait_stopped()  # not held up by the retries
    assert decode(await tasks.get(ANONYMOUS, task.id)).status.state is TaskState.WORKING  # adopted at the next start


async def test_a_cancel_while_the_end_is_tried_again_settles_the_task_for_good(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tasks = NotedTasks(fail_at="TASK_STATE_COMPLETED")  # CANCELED, unlike COMPLETED, can be written
    async with ended_but_not_stored(tasks) as (runner, sessions, task):
        assert (await runner.cancel(ANONYMOUS, task.id)).status.state is TaskState.CANCELED
        assert (await runner.wait_settled(ANONYMOUS, task.id)).status.state is TaskState.CANCELED
        attempts = len(tasks.writes)
        await trio.sleep(100)
        assert len(tasks.writes) <= attempts + 1 and runner.statistics().running == 0  # the retries stopped
    assert decode(await tasks.get(ANONYMOUS, task.id)).status.state is TaskState.CANCELED


@attrs.define(eq=False)
class HeldCreate(MemoryTaskStore):
    """A task store whose task rows, once ``hold`` is set, are written only when ``release``
    is: a send that passed the runner's stopping check is still writing its task."""

    hold: bool = False
    entered: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)

    async def create(self, owner: str, **row: Any) -> TaskRecord:
        if self.hold:
            self.entered.set()
            await self.release.wait()
        return await super().create(owner, **row)


def ask(text: str) -> SendMessageParams:
    return SendMessageParams(message=Message(message_id=new_id(), role=Role.USER, parts=(TextPart(text),)))


async def send_into(runner: Runner, text: str, sent: list[Task]) -> None:
    sent.append(await runner.send(ANONYMOUS, ask(text)))


async def test_a_drain_ends_when_the_last_run_does_though_a_send_landed_during_it() -> None:
    tasks = HeldCreate()
    first_held = trio.Event()
    runner = Runner(
        MemorySessionStore(), tasks, ScriptedModel([Answer("one", hold=first_held), Answer("two")]), AgentSpec(),
        RunnerConfig(drain_timeout_s=60),
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        first = await runner.send(ANONYMOUS, ask("first"))
        tasks.hold = True
        nursery.start_soon(runner.send, ANONYMOUS, ask("second"))
        with trio.fail_after(10):
            await tasks.entered.wait()
        runner.stop()  # the drain begins with the second send's row still being written
        await trio.testing.wait_all_tasks_blocked()
        tasks.release.set()
        await trio.testing.wait_all_tasks_blocked()
        first_held.set()
        with trio.fail_after(10):  # not the whole drain timeout
            await runner.wait_stopped()
    states = sorted(decode(record).status.state.value for record in tasks.tasks.values())
    assert states == ["completed", "completed"]  # the late send's run was drained too


async def test_a_send_that_lands_after_the_drain_is_recorded_canceled_and_the_runner_still_stops(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    tasks = HeldCreate()
    runner = Runner(
        MemorySessionStore(), tasks, ScriptedModel([Answer("one", hold=trio.Event()), Answer("two", hold=trio.Event())]),
        AgentSpec(), RunnerConfig(drain_timeout_s=0.5),
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        first = await runner.send(ANONYMOUS, ask("first"))
        tasks.hold = True
        late: list[Task] = []
        nursery.start_soon(send_into, runner, "second", late)
        with trio.fail_after(10):
            await tasks.entered.wait()
            runner.stop()
            while decode(await tasks.get(ANONYMOUS, first.id)).status.state is not TaskState.CANCELED:
                await trio.sleep(0.01)  # the drain is over, and the first run was cut
        tasks.release.set()
        with trio.fail_after(10):
            await runner.wait_stopped()
    assert runner.statistics().running == 0
    assert decode(await tasks.get(ANONYMOUS, late[0].id)).status.state is TaskState.CANCELED
    # Said so, to the client and in the log: not a CancelTask's cancel.
    for task_id in (first.id, late[0].id):
        said = decode(await tasks.get(ANONYMOUS, task_id)).status.message
        assert said is not None and "the server shut down before it finished" in message_text(said)
    cut = [r.getMessage() for r in caplog.records if "did not finish within 0.5 s and are canceled" in r.getMessage()]
    assert len(cut) == 1 and first.id in cut[0], cut


async def test_a_cancel_task_during_the_drain_is_a_clients_cancel_not_the_shutdowns() -> None:
    tasks = MemoryTaskStore()
    runner = Runner(
        MemorySessionStore(), tasks, ScriptedModel([Answer("held", hold=trio.Event())]), AgentSpec(), RunnerConfig(drain_timeout_s=600)
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        task = await runner.send(ANONYMOUS, ask("first"))
        runner.stop()  # draining: the run may finish, for 600 s
        with trio.fail_after(10):
            canceled = await runner.cancel(ANONYMOUS, task.id)
            await runner.wait_stopped()
    # The run's own end (the shutdown's CANCELED) comes second, and leaves the client's as it is.
    for said in (canceled.status.message, decode(await tasks.get(ANONYMOUS, task.id)).status.message):
        assert said is not None and message_text(said) == "The task was canceled."


async def test_a_send_whose_task_write_the_drain_gives_up_on_is_told_to_send_again_and_the_drain_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tasks = HeldCreate()
    runner = Runner(MemorySessionStore(), tasks, ScriptedModel([]), AgentSpec(), RunnerConfig(drain_timeout_s=0.5))

    async def send_held() -> None:
        with pytest.raises(UnsupportedOperation, match=r"could not confirm task .*; send the same message again \(the same messageId\)"):
            await runner.send(ANONYMOUS, ask("first"))

    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        tasks.hold = True
        nursery.start_soon(send_held)
        with trio.fail_after(10):
            await tasks.entered.wait()
        runner.stop()
        with trio.fail_after(10):
            await runner.wait_stopped()
    assert runner.statistics().running == 0


async def test_an_abandoned_runner_stops_at_once_and_leaves_its_tasks_as_stored() -> None:
    # What a server whose start failed does with the tasks its runner took up: nothing more.
    tasks = NotedTasks()
    runner = Runner(MemorySessionStore(), tasks, ScriptedModel([Answer("held", hold=trio.Event())]), AgentSpec())
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        task = await runner.send(ANONYMOUS, ask("first"))
        with trio.fail_after(10):
            while decode(await tasks.get(ANONYMOUS, task.id)).status.state is not TaskState.WORKING:
                await trio.sleep(0.01)
        written = list(tasks.writes)
        runner.abandon()
        with trio.fail_after(10):
            await runner.wait_stopped()
    assert tasks.writes == written  # no CANCELED
    assert decode(await tasks.get(ANONYMOUS, task.id)).status.state is TaskState.WORKING  # for the next process
    assert runner.statistics().running == 0



@attrs.define(eq=False)
class OneReadAfterTheHold(ScriptedStream):
    """After its hold, the rest of the answer comes as one read would bring it: several pieces
    handed out with no checkpoint between them, as the model client hands out one chunk's lines."""

    _released: bool = attrs.field(init=False, default=False)

    async def __anext__(self) -> Delta:
        if self._steps and isinstance(hold := self._steps[0], trio.Event):
            self._steps.popleft()
            await hold.wait()
            self._released = True
        if self._released and self._steps:
            step = self._steps.popleft()
            assert not isinstance(step, trio.Event)
            if isinstance(step, TextDelta):
                self._said.append(step.text)
            return step
        return await super().__anext__()


@attrs.define
class HoldThenBurst:
    hold: trio.Event

    def stream(self, request: ChatRequest) -> OneReadAfterTheHold:
        stream = OneReadAfterTheHold(Answer(text="ab", hold=self.hold))
        stream._steps.insert(3, TextDelta("c"))  # a second piece in the same read as "b"
        return stream


async def test_a_canceled_task_keeps_exactly_the_answer_its_subscribers_were_sent(tmp_path: Path) -> None:
    # The CANCELED goes to SQLite, through its thread: meanwhile the run, resumed by the read
    # that came in just before the cancel, streams on until its next checkpoint.
    hold = trio.Event()
    async with open_task_store(tmp_path / "tasks.db") as tasks, trio.open_nursery() as nursery:
        runner = Runner(MemorySessionStore(), tasks, HoldThenBurst(hold), AgentSpec())
        await nursery.start(runner.run)
        task = await runner.send(ANONYMOUS, ask("Why?"))
        pieces: list[str] = []
        async with runner.subscribe(ANONYMOUS, task.id) as events:
            with trio.fail_after(10):
                async for event in events:
                    if isinstance(event, TaskArtifactUpdateEvent):  # "a": the model now waits
                        pieces.append(event.artifact.parts[0].text)  # type: ignore[union-attr]
                        break
            hold.set()  # the next read is in: the run is scheduled to go on, and cannot be stopped mid-read
            canceled = await runner.cancel(ANONYMOUS, task.id)
            with trio.fail_after(10):
                async for event in events:
                    if isinstance(event, TaskArtifactUpdateEvent):
                        text = event.artifact.parts[0].text  # type: ignore[union-attr]
                        pieces = [*pieces, text] if event.append else [text]
        runner.stop()
        await runner.wait_stopped()
        stored = decode(await tasks.get(ANONYMOUS, task.id))
    assert canceled.status.state is TaskState.CANCELED
    assert canceled.artifacts == stored.artifacts == (answer_artifact("".join(pieces)),)


@pytest.mark.parametrize("ended", [TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELED])
@pytest.mark.parametrize("to", [TaskState.WORKING, TaskState.COMPLETED, TaskState.CANCELED])
def test_a_task_that_ended_is_given_no_other_status(ended: TaskState, to: TaskState) -> None:
    # Every status a task is given passes through with_status, which holds it to the protocol's
    # state machine: the runner's own guards (a run's end and a cancel race) have a backstop.
    task = Task(id="t-1", context_id="c-1", status=TaskStatus(state=ended, timestamp=now()))
    with pytest.raises(InvalidTransition, match=f"task 't-1' cannot move from state '{ended.value}' to '{to.value}'"):
        with_status(task, to)
    submitted = Task(id="t-2", context_id="c-1", status=TaskStatus(state=TaskState.SUBMITTED, timestamp=now()))
    working = with_status(submitted, TaskState.WORKING)
    assert with_status(working, to).status.state is to
