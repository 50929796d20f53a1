"""Steering a run: in memory, through the store from another process, placement, exactly-once
delivery, finished runs, steers that arrive too late, and continuations."""

from __future__ import annotations

import sqlite3
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from fake_model import Call, FakeModel, Reply

from persistence.session import Session
from persistence.sessions import open_session_store
from persistence.transcript import Message, ToolCall
from runtime.agent import (
    STEER_LABEL,
    AgentEvent,
    AgentRun,
    AgentSpec,
    BudgetExhausted,
    RunFinished,
    SaveFailed,
    SteerApplied,
    StepStarted,
    TextDelta,
)
from runtime.models import open_model_client
from tests.runtime.agent_support import (
    DEADLINE_S,
    QUESTION,
    Answer,
    EventLog,
    GatedSession,
    ScriptedModel,
    config_for,
    lookup_tool,
    make_tool,
    question,
    refuse_writes_of_events,
    sent_messages,
    stored_messages,
)

ROOT = Path(__file__).resolve().parents[2]
SESSION = "incident-7"
VAULT = '{"service": "vault"}'
STEER = "check the lease expiry, not the token"
LEAVE_STEER = """
import sys
from pathlib import Path

import trio

from persistence.session import Session
from persistence.sessions import open_session_store


async def main(path, session_id, text):
    async with open_session_store(Path(path)) as store:
        await Session.open(session_id, store).steer(text)


trio.run(main, *sys.argv[1:4])
"""


def steered(text: str) -> dict[str, str]:
    """A steer as the model receives it."""
    return {"role": "user", "content": STEER_LABEL + text}


def asked_with_steer(text: str) -> dict[str, str]:
    """The question and a steer placed right after it, as the model receives them: one user
    message, so that the roles it reads alternate."""
    return {"role": "user", "content": f"{QUESTION}\n\n{STEER_LABEL}{text}"}


async def leave_steer(path: Path, text: str) -> None:
    """Leave a steer the way another process does: through a store object of its own, no run needed."""
    async with open_session_store(path) as other:
        await Session.open(SESSION, other).steer(text)


async def test_a_steer_handed_to_the_run_rides_the_next_request_and_is_announced(fake_model: FakeModel) -> None:
    runs: list[AgentRun] = []

    async def lookup(_arguments: dict[str, Any]) -> str:
        runs[0].steer(STEER)
        return "vault: healthy"

    fake_model.script = [Reply(tool_calls=[Call("lookup", VAULT)]), Reply(text="The lease expired.")]
    log = EventLog()
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            asked = question()
            runs.append(AgentRun(client, AgentSpec(tools=[make_tool("lookup", lookup)]), asked, on_event=log))
            result = await runs[0].run()
    assert asked == question()  # the caller's list is not touched
    second = sent_messages(fake_model.bodies[1])
    assert [message["role"] for message in second] == ["user", "assistant", "tool", "user"]
    assert second[3] == steered(STEER)  # labelled, and after the tool result it came during
    assert log.of(SteerApplied) == [SteerApplied(STEER, 3)]
    assert result.messages[3] == Message(role="user", text=STEER_LABEL + STEER)


async def test_a_steer_left_by_another_process_reaches_the_run_and_stays_where_the_request_was(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    path = tmp_path / "runtime.db"
    looked_up: list[dict[str, Any]] = []

    async def lookup(arguments: dict[str, Any]) -> str:
        looked_up.append(arguments)
        if len(looked_up) == 1:
            await leave_steer(path, STEER)  # a second store object over the same file
        return f"{arguments['service']}: healthy"

    fake_model.script = [
        Reply(tool_calls=[Call("lookup", VAULT)]),
        Reply(tool_calls=[Call("lookup", '{"service": "lease-db"}')]),
        Reply(text="Renew the lease."),
    ]
    spec = AgentSpec(tools=[make_tool("lookup", lookup)])
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            # The run is never told of the steer: only the store knows.
            await AgentRun(client, spec, question(), session=Session.open(SESSION, store)).run()
        stored = await stored_messages(path, SESSION)
    second, third = sent_messages(fake_model.bodies[1]), sent_messages(fake_model.bodies[2])
    assert second.index(steered(STEER)) == 3 == len(second) - 1  # where the request was
    assert third.index(steered(STEER)) == 3  # and there it stays: never re-pinned at the end
    assert [message["role"] for message in third] == ["user", "assistant", "tool", "user", "assistant", "tool"]
    assert stored[3] == Message(role="user", text=STEER_LABEL + STEER)


async def test_a_steer_left_by_a_real_subprocess_reaches_the_run(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"

    async def escalate(_arguments: dict[str, Any]) -> str:
        # Another OS process opens the same file, leaves a steer and exits, while this tool runs.
        await trio.run_process([sys.executable, "-c", LEAVE_STEER, str(path), SESSION, STEER], cwd=ROOT)
        return "escalated"

    fake_model.script = [Reply(tool_calls=[Call("escalate")]), Reply(text="Done.")]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            async with open_model_client(config_for(fake_model)) as client:
                spec = AgentSpec(tools=[make_tool("escalate", escalate)])
                await AgentRun(client, spec, question(), session=Session.open(SESSION, store)).run()
            assert await store.take_steers(SESSION) == []
    assert sent_messages(fake_model.bodies[1])[-1] == steered(STEER)


async def test_a_steer_waiting_before_the_run_starts_rides_its_first_request(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text="Looking at staging.")]
    with trio.fail_after(DEADLINE_S):
        await leave_steer(path, "it is the staging vault")  # no run exists yet
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            await AgentRun(client, AgentSpec(), question(), session=Session.open(SESSION, store)).run()
    assert sent_messages(fake_model.bodies[0]) == [asked_with_steer("it is the staging vault")]


async def test_a_steer_is_never_delivered_twice(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    runs: list[AgentRun] = []
    calls = 0

    async def lookup(_arguments: dict[str, Any]) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            runs[0].steer("held by the run")
            await leave_steer(path, "left in the store")
        return "healthy"

    fake_model.script = [*[Reply(tool_calls=[Call("lookup", VAULT)])] * 3, Reply(text="Done.")]
    log = EventLog()
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            spec = AgentSpec(tools=[make_tool("lookup", lookup)])
            runs.append(AgentRun(client, spec, question(), session=Session.open(SESSION, store), on_event=log))
            result = await runs[0].run()
            assert await store.take_steers(SESSION) == []  # nothing left to hand out again
        stored = await stored_messages(path, SESSION)
    assert len(log.of(SteerApplied)) == 2
    # Both steers were placed after the first tool result, so they reach the model as one message.
    for body in fake_model.bodies[1:]:
        assert sent_messages(body)[3] == {"role": "user", "content": f"{STEER_LABEL}held by the run\n\n{STEER_LABEL}left in the store"}
    for text in ("held by the run", "left in the store"):
        for body in fake_model.bodies[1:]:  # every later request carries it once, at one place
            assert sum(message["content"].count(STEER_LABEL + text) for message in sent_messages(body) if message["content"]) == 1
        assert [message.text for message in stored].count(STEER_LABEL + text) == 1
        assert [message.text for message in result.messages].count(STEER_LABEL + text) == 1


async def test_steering_a_finished_run_says_so_rather_than_swallowing_it(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="Done.")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            run = AgentRun(client, AgentSpec(), question())
            await run.run()
    with pytest.raises(RunFinished, match="the run has finished, so there is no request left to carry a steer"):
        run.steer(STEER)


def test_an_empty_steer_is_refused() -> None:
    run = AgentRun(ScriptedModel([]), AgentSpec(), question())
    with pytest.raises(ValueError, match="non-empty"):
        run.steer("  ")


def steer_during_answer(runs: list[AgentRun], texts: dict[int, str]) -> Any:
    """An on_event that hands ``texts[step]`` to the run as the answer of that step starts streaming."""
    step = 0

    def on_event(event: AgentEvent) -> None:
        nonlocal step
        if isinstance(event, StepStarted):
            step = event.step
        elif isinstance(event, TextDelta) and step in texts:
            runs[0].steer(texts.pop(step))

    return on_event


async def test_a_steer_that_arrives_during_the_last_request_is_handed_back(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text="The lease expired.")]
    fake_model.default = Reply(text="A request nobody should have made.")
    runs: list[AgentRun] = []
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            on_event = steer_during_answer(runs, {1: "also check staging"})
            runs.append(AgentRun(client, AgentSpec(), question(), session=Session.open(SESSION, store), on_event=on_event))
            result = await runs[0].run()
        stored = await stored_messages(path, SESSION)
    assert result.unapplied_steers == ("also check staging",)
    assert len(fake_model.bodies) == 1
    assert stored == list(result.messages) == [*question(), Message(role="assistant", text="The lease expired.")]


async def test_a_steer_during_the_last_request_gets_one_more_step_with_a_continuation(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="The lease expired."), Reply(text="Staging is fine too.")]
    fake_model.default = Reply(text="A request nobody should have made.")
    runs: list[AgentRun] = []
    spec = AgentSpec(steer_continuations=1)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            on_event = steer_during_answer(runs, {1: "also check staging", 2: "and production"})
            runs.append(AgentRun(client, spec, question(), on_event=on_event))
            result = await runs[0].run()
    assert len(fake_model.bodies) == 2
    assert sent_messages(fake_model.bodies[1]) == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "The lease expired."},
        steered("also check staging"),
    ]
    assert result.output == "Staging is fine too."
    assert result.unapplied_steers == ("and production",)  # the one continuation is spent


@pytest.mark.parametrize("continuations", [0, 1])
async def test_a_stored_steer_during_the_last_request_waits_for_a_continuation_or_the_next_run(
    tmp_path: Path, continuations: int
) -> None:
    path = tmp_path / "runtime.db"
    hold = trio.Event()
    model = ScriptedModel([Answer("The lease expired.", hold=hold), Answer("Staging is fine too.")])
    log = EventLog()
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            session = Session.open(SESSION, store)
            run = AgentRun(model, AgentSpec(steer_continuations=continuations), question(), session=session, on_event=log)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run.run)
                await log.wait_for(TextDelta)  # the last answer is half written
                await leave_steer(path, "also check staging")
                hold.set()
            left = await store.take_steers(SESSION)
        stored = await stored_messages(path, SESSION)
    if continuations:
        assert len(model.requests) == 2
        assert model.requests[1].messages[-1] == Message(role="user", text=STEER_LABEL + "also check staging")
        assert left == []
        assert stored[-1] == Message(role="assistant", text="Staging is fine too.")
    else:
        assert len(model.requests) == 1
        assert left == ["also check staging"]  # still in the store, for the session's next run
        assert stored == [*question(), Message(role="assistant", text="The lease expired.")]


async def test_a_cancelled_run_still_stores_the_steers_it_took(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text="Checking staging.")]
    with trio.fail_after(DEADLINE_S):
        await leave_steer(path, "it is the staging vault")
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            session = GatedSession(SESSION, store)
            scope = trio.CancelScope()

            async def go() -> None:
                with scope:
                    await AgentRun(client, AgentSpec(), question(), session=session).run()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(go)
                await session.taken.wait()  # the store has handed the steer out; the run holds it
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                session.gate.set()
            assert scope.cancelled_caught
            assert fake_model.bodies == []  # cancelled before the model was called
            assert await store.take_steers(SESSION) == []
        stored = await stored_messages(path, SESSION)
        assert stored == [*question(), Message(role="user", text=STEER_LABEL + "it is the staging vault")]
        # The run resumed from the session sends it.
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            await AgentRun(client, AgentSpec(), stored, session=Session.open(SESSION, store)).run()
    assert sent_messages(fake_model.bodies[0]) == [asked_with_steer("it is the staging vault")]


async def test_a_steer_whose_save_fails_is_left_for_the_run_that_resumes(fake_model: FakeModel, tmp_path: Path) -> None:
    # The steers are taken in the transaction that saves them placed: a disk that refuses the
    # write (here only the steer's, by a trigger) leaves the steer waiting, not taken and lost.
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text="The lease expired.")]
    with trio.fail_after(DEADLINE_S):
        await leave_steer(path, STEER)
        with closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute(
                "CREATE TRIGGER full_disk BEFORE INSERT ON events WHEN NEW.content LIKE '%lease expiry%'"
                " BEGIN SELECT RAISE(ABORT, 'disk is full'); END"
            )
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            with pytest.raises(SaveFailed, match=SESSION):
                await AgentRun(client, AgentSpec(), question(), session=Session.open(SESSION, store)).run()
        assert fake_model.bodies == []
        with closing(sqlite3.connect(path, isolation_level=None)) as conn:
            assert conn.execute("SELECT text FROM steers").fetchall() == [(STEER,)]
            conn.execute("DROP TRIGGER full_disk")
        assert await stored_messages(path, SESSION) == []  # the question's save failed with it
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            await AgentRun(client, AgentSpec(), question(), session=Session.open(SESSION, store)).run()
    assert sent_messages(fake_model.bodies[0]) == [asked_with_steer(STEER)]


@pytest.mark.parametrize("ending", ["over budget", "its save failing"])
async def test_a_steer_handed_to_a_run_that_ends_in_an_error_is_handed_back(tmp_path: Path, ending: str) -> None:
    path = tmp_path / "runtime.db"
    hold = trio.Event()
    model = ScriptedModel([Answer("Looking.", calls=(ToolCall("c1", "lookup", VAULT),), hold=hold)])
    log = EventLog()
    expected = BudgetExhausted if ending == "over budget" else SaveFailed
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            spec = AgentSpec(tools=[lookup_tool()], max_model_calls=1 if ending == "over budget" else 12)
            run = AgentRun(model, spec, question(), session=Session.open(SESSION, store), on_event=log)

            async def go() -> None:
                with pytest.raises(expected):
                    await run.run()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(go)
                await log.wait_for(TextDelta)
                run.steer("also check staging")  # taken: the run has not ended
                if ending == "its save failing":
                    refuse_writes_of_events(path)  # the save before the next request fails
                hold.set()
    assert run.unapplied_steers == ("also check staging",)
    if ending == "its save failing":  # never sent, so never said to be applied
        assert not log.of(SteerApplied) and all("also check staging" not in m.text for m in run.messages)


async def test_a_question_that_opens_with_the_steer_label_is_read_as_a_question(fake_model: FakeModel) -> None:
    # A question the runner stored names its turn (turn_id); a steer never does. One that happens
    # to open with the words a steer is labelled with is still the turn's question: the turn's
    # calls are counted from it, and the question after it is not labelled as following a steer.
    quoted = STEER_LABEL + "restart the vault"
    earlier = [
        Message(role="user", text="Is the vault up?", turn_id="turn-1"),
        Message(role="assistant", text="It is."),
    ]
    resumed = [
        *earlier,
        Message(role="user", text=quoted, turn_id="turn-2"),
        Message(role="assistant", tool_calls=[ToolCall("call_1", "lookup", VAULT)]),
        Message(role="tool", text="vault: healthy", tool_call_id="call_1", name="lookup"),
    ]
    fake_model.script = [Reply(text="Restarted."), Reply(text="Both done.")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            # One call of this turn is made; one more is allowed. Counted from the answer of the
            # turn before, the budget would be spent.
            result = await AgentRun(client, AgentSpec(tools=[lookup_tool()], max_model_calls=2), resumed).run()
            assert (result.output, result.model_calls) == ("Restarted.", 2)
            unanswered = [
                *earlier,
                Message(role="user", text=quoted, turn_id="turn-2"),  # its run ended with no answer
                Message(role="user", text="And the cache?", turn_id="turn-3"),
            ]
            await AgentRun(client, AgentSpec(), unanswered).run()
    assert sent_messages(fake_model.bodies[1])[2] == {"role": "user", "content": f"{quoted}\n\nAnd the cache?"}
