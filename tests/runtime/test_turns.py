"""Where a turn begins and what it waits for: the question a task saves is tagged with the task's
id, so a turn cut short by a dying process is resumed from exactly where it was; and the model is
asked only once the task's WORKING state and the transcript are both durable."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, closing
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from fake_model import Call, FakeModel, Reply

from persistence.api import TaskRecord
from persistence.errors import StoreClosed
from persistence.session import Session
from persistence.sessions import SqliteSessionStore, open_session_store
from persistence.tasks import SqliteTaskStore, open_task_store
from persistence.transcript import Message as Transcribed
from persistence.transcript import ToolCall
from persistence.writer import running
from protocol import Message, Role, SendMessageParams, Task, TaskState, TaskStatus, TextPart, UnsupportedOperation
from runtime.agent import AgentSpec
from runtime.agent.steers import steer_message
from runtime.models import ModelConfig, open_model_client
from runtime.runner import ANONYMOUS, Runner, RunnerConfig
from runtime.tasks import STORED_VERSION, encode, message_text, new_id, now
from tests.runtime.served import GATE_CALL, serve_keel

DEADLINE_S = 10.0
QUESTION = "Is the deploy done?"


def question(text: str = QUESTION) -> Message:
    return Message(message_id=new_id(), role=Role.USER, parts=(TextPart(text),))


OpenTasks = Callable[[Path], AbstractAsyncContextManager[SqliteTaskStore]]


@asynccontextmanager
async def runner_over(
    state: Path,
    model: FakeModel,
    open_tasks: OpenTasks = open_task_store,
    agent: AgentSpec = AgentSpec(),
    config: RunnerConfig = RunnerConfig(),
) -> AsyncIterator[tuple[Runner, SqliteSessionStore, SqliteTaskStore]]:
    """A runner over the SQLite files in ``state`` (taking up what a dead process left there
    before this yields) and the fake model server; stopped when the block is left."""
    async with (
        open_session_store(state / "runtime.db") as sessions,
        open_tasks(state / "tasks.db") as tasks,
        open_model_client(ModelConfig(base_url=model.base_url, max_retries=0)) as client,
        trio.open_nursery() as nursery,
    ):
        runner: Runner = await nursery.start(Runner(sessions, tasks, client, agent, config).run)
        yield runner, sessions, tasks
        runner.stop()


async def left_by_a_dead_process(
    state: Path,
    state_left: TaskState,
    transcript: Callable[[str], Sequence[Transcribed]],
    *,
    context_id: str = "ctx-1",
    text: str = QUESTION,
) -> str:
    """Store a task and its session as a process that died mid-turn leaves them; its id."""
    state.mkdir(parents=True, exist_ok=True)
    task = Task(
        id=new_id(), context_id=context_id, status=TaskStatus(state=state_left, timestamp=now()), history=(question(text),)
    )  # fmt: skip
    async with open_session_store(state / "runtime.db") as sessions, open_task_store(state / "tasks.db") as tasks:
        await tasks.create(
            ANONYMOUS, task_id=task.id, context_id=context_id, state=state_left.wire_name(STORED_VERSION), task_json=encode(task)
        )  # fmt: skip
        await Session.open(context_id, sessions).save(transcript(task.id))
    return task.id


def user_texts(body: dict[str, object]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "user"]  # type: ignore[attr-defined]


EARLIER = [Transcribed(role="user", text="Which region?", turn_id="an-earlier-task"), Transcribed(role="assistant", text="eu-west-1.")]


async def test_a_turn_whose_process_died_after_saving_its_question_asks_it_once(tmp_path: Path, fake_model: FakeModel) -> None:
    # Its WORKING state, written alongside that save, never became durable: the task is SUBMITTED.
    task_id = await left_by_a_dead_process(
        tmp_path, TaskState.SUBMITTED, lambda task_id: [*EARLIER, Transcribed(role="user", text=QUESTION, turn_id=task_id)]
    )
    fake_model.default = Reply(text="Yes, at noon.")
    async with runner_over(tmp_path, fake_model) as (runner, sessions, _):
        with trio.fail_after(DEADLINE_S):
            settled = await runner.wait_settled(ANONYMOUS, task_id)
        assert settled.status.state is TaskState.COMPLETED
        assert [user_texts(body) for body in fake_model.bodies] == [["Which region?", QUESTION]]
        assert [m.text for m in await sessions.messages("ctx-1")] == ["Which region?", "eu-west-1.", QUESTION, "Yes, at noon."]


async def test_a_turn_whose_process_died_before_saving_its_question_saves_it_once(tmp_path: Path, fake_model: FakeModel) -> None:
    task_id = await left_by_a_dead_process(tmp_path, TaskState.WORKING, lambda task_id: EARLIER)
    fake_model.default = Reply(text="Yes, at noon.")
    async with runner_over(tmp_path, fake_model) as (runner, sessions, _):
        with trio.fail_after(DEADLINE_S):
            assert (await runner.wait_settled(ANONYMOUS, task_id)).status.state is TaskState.COMPLETED
        assert [user_texts(body) for body in fake_model.bodies] == [["Which region?", QUESTION]]
        stored = await sessions.messages("ctx-1")
        assert [(m.text, m.turn_id) for m in stored[2:]] == [(QUESTION, task_id), ("Yes, at noon.", "")]


def answered_before_the_crash(task_id: str) -> list[Transcribed]:
    return [Transcribed(role="user", text=QUESTION, turn_id=task_id), Transcribed(role="assistant", text="Yes.")]


async def test_a_turn_whose_process_died_after_saving_its_answer_completes_without_asking_again(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    task_id = await left_by_a_dead_process(tmp_path, TaskState.WORKING, answered_before_the_crash)
    async with runner_over(tmp_path, fake_model) as (runner, _, _):
        with trio.fail_after(DEADLINE_S):
            settled = await runner.wait_settled(ANONYMOUS, task_id)
    assert settled.status.state is TaskState.COMPLETED
    assert settled.status.message is not None and settled.status.message.parts == (TextPart("Yes."),)
    assert fake_model.bodies == []


async def test_with_orphans_fail_a_turn_whose_process_died_after_saving_its_answer_completes_with_it(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Failed, the task would tell its client there was no answer, while the conversation the
    # model reads at the next turn holds one the model believes the user saw.
    task_id = await left_by_a_dead_process(tmp_path, TaskState.WORKING, answered_before_the_crash)
    async with runner_over(tmp_path, fake_model, config=RunnerConfig(orphans="fail")) as (runner, _, _):
        settled = await runner.get(ANONYMOUS, task_id)  # taken up before the runner starts
    assert settled.status.state is TaskState.COMPLETED
    assert settled.status.message is not None and settled.status.message.parts == (TextPart("Yes."),)
    assert fake_model.bodies == []


async def test_with_orphans_fail_an_orphan_whose_conversation_cannot_be_read_fails_alone(
    tmp_path: Path, fake_model: FakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    # One damaged conversation must not keep the server from starting, nor its other orphans from ending.
    damaged = await left_by_a_dead_process(tmp_path, TaskState.WORKING, answered_before_the_crash, context_id="ctx-damaged")
    sound = await left_by_a_dead_process(tmp_path, TaskState.WORKING, answered_before_the_crash, context_id="ctx-sound")
    with closing(sqlite3.connect(tmp_path / "runtime.db", isolation_level=None)) as conn:
        conn.execute("UPDATE events SET content = '{not json' WHERE session_id = 'ctx-damaged' AND seq = 1")
    async with runner_over(tmp_path, fake_model, config=RunnerConfig(orphans="fail")) as (runner, _, _):
        ended = {task_id: await runner.get(ANONYMOUS, task_id) for task_id in (damaged, sound)}  # taken up before it starts
    assert ended[sound].status.state is TaskState.COMPLETED
    assert ended[damaged].status.state is TaskState.FAILED
    said = message_text(ended[damaged].status.message)  # type: ignore[arg-type]
    assert "send the message again, with a new messageId" in said, said
    [logged] = [record for record in caplog.records if "ctx-damaged" in record.getMessage()]
    assert logged.levelname == "WARNING" and damaged in logged.getMessage() and logged.exc_info is None
    assert fake_model.bodies == []


async def test_an_unfinished_turn_that_a_later_turn_has_overtaken_fails_rather_than_answer_the_later_one(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # The task's run ended unanswered but its end could not be stored (it stayed WORKING), and a
    # later turn of the conversation went on: its question is followed by that later turn.
    task_id = await left_by_a_dead_process(
        tmp_path,
        TaskState.WORKING,
        lambda task_id: [
            Transcribed(role="user", text=QUESTION, turn_id=task_id),
            Transcribed(role="user", text="And the rollback?", turn_id="a-later-task"),
            Transcribed(role="assistant", text="Not needed."),
        ],
    )
    fake_model.default = Reply(text="Yes, at noon.")
    async with runner_over(tmp_path, fake_model) as (runner, sessions, _):
        with trio.fail_after(DEADLINE_S):
            settled = await runner.wait_settled(ANONYMOUS, task_id)
        # Not asked: the request would have ended with the later turn's answer.
        assert fake_model.bodies == []
        assert settled.status.state is TaskState.FAILED
        assert settled.status.message is not None
        assert "its conversation has gone on since" in message_text(settled.status.message)
        assert [m.text for m in await sessions.messages("ctx-1")] == [QUESTION, "And the rollback?", "Not needed."]


def calls_and_results(task_id: str, calls: int) -> list[Transcribed]:
    """A turn's question, then ``calls`` model calls of a tool and their results."""
    messages = [Transcribed(role="user", text=QUESTION, turn_id=task_id)]
    for n in range(calls):
        messages.append(Transcribed(role="assistant", tool_calls=[ToolCall(f"call_{n}", "lookup", "{}")]))
        messages.append(Transcribed(role="tool", text="no such tool", tool_call_id=f"call_{n}"))
    return messages


@pytest.mark.parametrize("made", [3, 4])
async def test_a_resumed_turn_counts_the_model_calls_it_made_before_its_process_died_toward_its_budget(
    tmp_path: Path, fake_model: FakeModel, made: int
) -> None:
    task_id = await left_by_a_dead_process(tmp_path, TaskState.WORKING, lambda task_id: calls_and_results(task_id, made))
    fake_model.default = Reply(tool_calls=[Call("lookup")])  # a runaway turn
    async with runner_over(tmp_path, fake_model, agent=AgentSpec(max_model_calls=4)) as (runner, _, _):
        with trio.fail_after(DEADLINE_S):
            settled = await runner.wait_settled(ANONYMOUS, task_id)
    assert len(fake_model.bodies) == 4 - made
    assert settled.status.state is TaskState.FAILED
    assert settled.status.message is not None
    assert "the turn made its 4 model calls" in message_text(settled.status.message)


@attrs.define(eq=False)
class HeldWorking(SqliteTaskStore):
    """tasks.db whose WORKING writes wait for ``release`` (or fail, with ``fail``)."""

    entered: trio.Event = attrs.field(factory=trio.Event, kw_only=True)
    release: trio.Event = attrs.field(factory=trio.Event, kw_only=True)
    fail: bool = attrs.field(default=False, kw_only=True)

    async def update(self, owner: str, task_id: str, **fields: Any) -> TaskRecord:
        if fields["state"] == TaskState.WORKING.wire_name(STORED_VERSION):
            self.entered.set()
            await self.release.wait()
            if self.fail:
                raise StoreClosed("tasks.db")
        return await super().update(owner, task_id, **fields)


def held_working(fail: bool) -> OpenTasks:
    @asynccontextmanager
    async def open_tasks(path: Path) -> AsyncIterator[HeldWorking]:
        store = await HeldWorking.open(path)
        store.fail = fail
        async with running(store) as opened:
            yield opened

    return open_tasks


async def test_the_question_is_saved_while_working_is_written_and_the_model_waits_for_both(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.default = Reply(text="Yes.")
    async with runner_over(tmp_path, fake_model, held_working(fail=False)) as (runner, sessions, tasks):
        assert isinstance(tasks, HeldWorking)
        task = await runner.send(ANONYMOUS, SendMessageParams(message=question()))
        with trio.fail_after(DEADLINE_S):
            await tasks.entered.wait()
            while not await sessions.messages(task.context_id):  # saved while WORKING is held
                await trio.sleep(0.005)
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        assert fake_model.bodies == [], "the model was asked before the task was WORKING on disk"
        assert (await tasks.get(ANONYMOUS, task.id)).state == TaskState.SUBMITTED.wire_name(STORED_VERSION)
        tasks.release.set()
        with trio.fail_after(DEADLINE_S):
            settled = await runner.wait_settled(ANONYMOUS, task.id)
    assert settled.status.state is TaskState.COMPLETED
    assert len(fake_model.bodies) == 1


async def test_a_working_state_that_cannot_be_stored_fails_the_task_before_the_model_is_asked(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.default = Reply(text="Yes.")
    async with runner_over(tmp_path, fake_model, held_working(fail=True)) as (runner, _, tasks):
        assert isinstance(tasks, HeldWorking)
        tasks.release.set()
        task = await runner.send(ANONYMOUS, SendMessageParams(message=question()))
        with trio.fail_after(DEADLINE_S):
            settled = await runner.wait_settled(ANONYMOUS, task.id)
    assert settled.status.state is TaskState.FAILED
    assert fake_model.bodies == []


async def test_unfinished_turns_of_one_context_are_resumed_in_the_order_their_tasks_were_made(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    import sqlite3

    # The scheduler starts the resumed runs in either order; four starts make a lucky pass of a
    # runner that does not keep the order one in sixteen.
    for start in range(4):
        state = tmp_path / f"start-{start}"
        first = await left_by_a_dead_process(state, TaskState.SUBMITTED, lambda _: [], text="Roll back the deploy.")
        second = await left_by_a_dead_process(state, TaskState.SUBMITTED, lambda _: [], text="Then page the owner.")
        with sqlite3.connect(state / "tasks.db") as conn:  # made a millisecond apart, as two sends would be
            conn.execute("UPDATE tasks SET created_at_ms = created_at_ms + 1 WHERE id = ?", (second,))
        conn.close()
        fake_model.script = [Reply(text="Rolled back."), Reply(text="Paged.")]
        async with runner_over(state, fake_model) as (runner, sessions, _):
            with trio.fail_after(DEADLINE_S):
                assert (await runner.wait_settled(ANONYMOUS, first)).status.state is TaskState.COMPLETED
                assert (await runner.wait_settled(ANONYMOUS, second)).status.state is TaskState.COMPLETED
            stored = [m.text for m in await sessions.messages("ctx-1")]
        assert stored == ["Roll back the deploy.", "Rolled back.", "Then page the owner.", "Paged."], start


@attrs.define(eq=False)
class HeldRead(SqliteSessionStore):
    """runtime.db whose transcript reads, once ``hold`` is set, wait for ``release`` first, and
    as a read in the database's thread does: a cancellation waits for it to finish."""

    hold: bool = attrs.field(default=False, kw_only=True)
    entered: trio.Event = attrs.field(factory=trio.Event, kw_only=True)
    release: trio.Event = attrs.field(factory=trio.Event, kw_only=True)

    async def messages(self, session_id: str) -> list[Transcribed]:
        if not self.hold:
            return await super().messages(session_id)
        self.entered.set()
        with trio.CancelScope(shield=True):
            await self.release.wait()
            messages = await super().messages(session_id)
        return messages


@attrs.define(eq=False)
class NotedStates(SqliteTaskStore):
    """tasks.db that notes the state of every update it takes."""

    states: list[str] = attrs.field(factory=list, kw_only=True)

    async def update(self, owner: str, task_id: str, **fields: Any) -> TaskRecord:
        record = await super().update(owner, task_id, **fields)
        self.states.append(fields["state"])
        return record


async def test_a_task_cancelled_while_its_turn_reads_the_transcript_is_never_written_working_after(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Written WORKING over its CANCELED, a task the client was told is canceled would be taken
    # for an orphan by the next process if this one died before writing CANCELED again.
    fake_model.default = Reply(text="Done.")
    sessions = await HeldRead.open(tmp_path / "runtime.db")
    tasks = await NotedStates.open(tmp_path / "tasks.db")
    async with (
        running(sessions),
        running(tasks),
        open_model_client(ModelConfig(base_url=fake_model.base_url, max_retries=0)) as client,
        trio.open_nursery() as nursery,
    ):
        runner: Runner = await nursery.start(Runner(sessions, tasks, client, AgentSpec()).run)
        first = await runner.send(ANONYMOUS, SendMessageParams(message=question("Roll back the deploy.")))
        with trio.fail_after(DEADLINE_S):
            await runner.wait_settled(ANONYMOUS, first.id)
        sessions.hold = True
        second = await runner.send(
            ANONYMOUS, SendMessageParams(message=attrs.evolve(question("Then page the owner."), context_id=first.context_id))
        )
        with trio.fail_after(DEADLINE_S):
            await sessions.entered.wait()  # the second turn reads the transcript
        tasks.states.clear()
        assert (await runner.cancel(ANONYMOUS, second.id)).status.state is TaskState.CANCELED
        sessions.release.set()
        with trio.fail_after(DEADLINE_S):
            while runner.statistics().running:
                await trio.sleep(0.01)
        runner.stop()
    assert tasks.states == [TaskState.CANCELED.wire_name(STORED_VERSION)]
    assert len(fake_model.bodies) == 1  # the first turn's; the canceled one never asked


async def test_a_steer_to_a_resumed_task_whose_answer_was_stored_is_refused_or_taken_never_left_untaken(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Its process died after the answer was saved, before the task said so. Steered while the
    # restarted run reads its transcript (a client back as soon as the server is), the steer
    # was taken, and the task then completed on the stored answer: no request ever carried it.
    task_id = await left_by_a_dead_process(tmp_path, TaskState.WORKING, answered_before_the_crash)
    fake_model.default = Reply(text="Yes, at noon.")
    sessions = await HeldRead.open(tmp_path / "runtime.db")
    sessions.hold = True
    async with (
        running(sessions),
        open_task_store(tmp_path / "tasks.db") as tasks,
        open_model_client(ModelConfig(base_url=fake_model.base_url, max_retries=0)) as client,
        trio.open_nursery() as nursery,
    ):
        runner: Runner = await nursery.start(Runner(sessions, tasks, client, AgentSpec()).run)
        with trio.fail_after(DEADLINE_S):
            await sessions.entered.wait()  # the resumed run reads its transcript
        steer = attrs.evolve(question("At what time?"), task_id=task_id)
        try:
            await runner.send(ANONYMOUS, SendMessageParams(message=steer))
        except UnsupportedOperation as exc:
            refused: str | None = str(exc)
        else:
            refused = None
        sessions.release.set()
        with trio.fail_after(DEADLINE_S):
            settled = await runner.wait_settled(ANONYMOUS, task_id)
        sessions.hold = False
        stored = [m.text for m in await sessions.messages("ctx-1")]
        runner.stop()
    assert settled.status.state is TaskState.COMPLETED
    if refused is not None:
        assert f"task {task_id!r}" in refused and "send this message again" in refused, refused
        assert [user_texts(body) for body in fake_model.bodies] == []
        assert steer.message_id not in [m.message_id for m in settled.history]
    else:  # taken: a request carried it, after the stored answer
        assert [user_texts(body)[-1] for body in fake_model.bodies] == [steer_message("At what time?").text]
        assert stored == [QUESTION, "Yes.", steer_message("At what time?").text, "Yes, at noon."]


async def test_a_turn_begun_before_its_process_died_goes_on_before_the_tasks_that_waited_for_it(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Sent at once, the message whose task is made second can take the conversation's turn first
    # (the writes of one commit wake in either order), leaving a task made before it waiting. After
    # a crash, the turn that had begun goes on first: the waiting task, resumed before it, would
    # answer both questions as one, and the other would fail, overtaken.
    fake_model.script = [Reply(tool_calls=[GATE_CALL])]
    async with serve_keel(tmp_path, fake_model) as keel:
        begun = await keel.send("Roll back the deploy.", blocking=False, contextId="ctx-1")
        await keel.gate.wait_entered()
        waiting = await keel.send("Then page the owner.", blocking=False, contextId="ctx-1")
    # Leaving the block cancels the runner without stopping it: the tasks stay as a crash leaves them.
    with closing(sqlite3.connect(tmp_path / "tasks.db")) as conn, conn:  # made a millisecond before the other
        conn.execute(
            "UPDATE tasks SET created_at_ms = (SELECT created_at_ms - 1 FROM tasks WHERE id = ?) WHERE id = ?",
            (begun["id"], waiting["id"]),
        )
    fake_model.script = [Reply(text="Rolled back."), Reply(text="Paged.")]
    async with serve_keel(tmp_path, fake_model) as keel:
        with trio.fail_after(DEADLINE_S):
            settled = [await keel.runner.wait_settled(ANONYMOUS, task["id"]) for task in (begun, waiting)]
    assert [task.status.state for task in settled] == [TaskState.COMPLETED, TaskState.COMPLETED]
    assert [user_texts(body)[-1] for body in fake_model.bodies[1:]] == ["Roll back the deploy.", "Then page the owner."]


async def test_a_turn_whose_conversation_cannot_be_read_fails_naming_it_not_as_an_internal_error(
    tmp_path: Path, fake_model: FakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    fake_model.default = Reply(text="Yes.")
    async with runner_over(tmp_path, fake_model) as (runner, _, _tasks):
        first = await runner.send(ANONYMOUS, SendMessageParams(message=question()))
        with trio.fail_after(DEADLINE_S):
            await runner.wait_settled(ANONYMOUS, first.id)
        with closing(sqlite3.connect(tmp_path / "runtime.db", isolation_level=None)) as conn:  # a damaged row
            conn.execute("UPDATE events SET content = '{not json' WHERE session_id = ? AND seq = 0", (first.context_id,))
        again = attrs.evolve(question("And now?"), context_id=first.context_id)
        task = await runner.send(ANONYMOUS, SendMessageParams(message=again))
        with trio.fail_after(DEADLINE_S):
            ended = await runner.wait_settled(ANONYMOUS, task.id)
    assert ended.status.state is TaskState.FAILED
    said = message_text(ended.status.message)  # type: ignore[arg-type]
    assert first.context_id in said and "could not be read" in said and "internal error" not in said, said
    assert len(fake_model.bodies) == 1  # the model was not asked about a conversation it cannot be shown
    assert not [record for record in caplog.records if record.exc_info], "logged with a traceback"
