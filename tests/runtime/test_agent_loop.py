"""The agent loop through the real httpx client against the fake model server on loopback, with
real SQLite session files under tmp_path: answers, events, saving, limits, retries,
cancellation and resume."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from fake_model import Call, ErrorReply, FakeModel, Reply

from persistence.session import Session
from persistence.sessions import open_session_store
from persistence.transcript import Message, ToolCall
from runtime.agent import (
    AgentEvent,
    AgentRun,
    AgentSpec,
    AnswerFailed,
    AnswerFiltered,
    AnswerTooLarge,
    AnswerTruncated,
    BudgetExhausted,
    MaxStepsReached,
    RunFinished,
    SaveFailed,
    StepStarted,
    TextDelta,
    ToolCalled,
    ToolResult,
    UsageReported,
)
from runtime.models import Delta, ModelUnavailable, ToolCallDelta, Usage, open_model_client
from tests.runtime.agent_support import (
    DEADLINE_S,
    PROMPTLY_S,
    QUESTION,
    CountingSession,
    Answer,
    EventLog,
    ScriptedStream,
    config_for,
    lookup_tool,
    make_tool,
    question,
    refuse_writes_of_events,
    run_turn,
    sent_messages,
    stored_messages,
)

ROOT = Path(__file__).resolve().parents[2]
SESSION = "incident-7"
VAULT = '{"service": "vault"}'
CHILD = Path(__file__).with_name("agent_child.py")


async def test_loop_answers_with_the_whole_transcript_and_what_it_cost(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="The lease was not renewed.", prompt_tokens=20, completion_tokens=6)]
    spec = AgentSpec(system_prompt="You are the on-call assistant.", tools=[lookup_tool()])
    with trio.fail_after(DEADLINE_S):
        result = await run_turn(fake_model, spec, question())
    assert result.output == "The lease was not renewed."
    assert result.messages == (Message(role="user", text=QUESTION), Message(role="assistant", text="The lease was not renewed."))
    assert (result.model_calls, result.usage, result.unapplied_steers) == (1, Usage(20, 6, 26), ())
    body = fake_model.bodies[0]
    assert body["messages"] == [
        {"role": "system", "content": "You are the on-call assistant."},
        {"role": "user", "content": QUESTION},
    ]
    assert [tool["function"]["name"] for tool in body["tools"]] == ["lookup"]


async def test_loop_runs_the_tools_the_model_calls_and_sends_their_results_back(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(tool_calls=[Call("lookup", VAULT)]), Reply(text="It expired.")]
    calls: list[dict[str, Any]] = []
    with trio.fail_after(DEADLINE_S):
        result = await run_turn(fake_model, AgentSpec(tools=[lookup_tool(calls)]), question())
    assert calls == [{"service": "vault"}]
    second = sent_messages(fake_model.bodies[1])
    call = second[1]["tool_calls"][0]
    assert call["function"] == {"name": "lookup", "arguments": VAULT}  # byte for byte, as the model wrote it
    assert second[2] == {"role": "tool", "tool_call_id": call["id"], "content": "vault: lease TTL 24h, last renewed 25h ago"}
    assert result.output == "It expired."
    assert (result.model_calls, result.usage) == (2, Usage(24, 16, 40))


async def test_loop_emits_typed_events_as_it_goes(fake_model: FakeModel) -> None:
    fake_model.script = [
        Reply(text="Checking.", tool_calls=[Call("lookup", VAULT, id="call_1")], chunk_chars=3),
        Reply(text="Done."),
    ]
    log = EventLog()
    with trio.fail_after(DEADLINE_S):
        await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), question(), on_event=log)
    kinds = [type(event).__name__ for event in log.events]
    collapsed = [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1]]
    assert collapsed == [
        "StepStarted", "TextDelta", "UsageReported", "ToolCalled", "ToolResult",
        "StepStarted", "TextDelta", "UsageReported",
    ]  # fmt: skip
    assert log.of(StepStarted) == [StepStarted(1), StepStarted(2)]
    assert [event.text for event in log.of(TextDelta)] == ["Che", "cki", "ng.", "Done", "."]
    assert log.of(ToolCalled) == [ToolCalled(ToolCall("call_1", "lookup", VAULT))]
    assert log.of(ToolResult) == [ToolResult("call_1", "lookup", "vault: lease TTL 24h, last renewed 25h ago", False)]
    assert log.of(UsageReported) == [UsageReported(Usage(12, 8, 20))] * 2


async def test_transcript_is_saved_before_every_request_and_once_at_the_end(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [
        Reply(tool_calls=[Call("lookup", VAULT)]),
        Reply(tool_calls=[Call("lookup", '{"service": "lease-db"}')]),
        Reply(text="Renew the lease and add an alert."),
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            session = CountingSession(SESSION, store, requests_made=lambda: len(fake_model.bodies))
            result = await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), question(), session=session)
        # (messages saved, requests the model had received when the save returned)
        assert session.saves == [(1, 0), (3, 1), (5, 2), (6, 3)]
        for (saved, _), body in zip(session.saves, fake_model.bodies, strict=False):
            assert len(sent_messages(body)) == saved  # each request carried what had just been saved
        # The answer reached the store, not only the requests; another process reads it.
        assert await stored_messages(path, SESSION) == list(result.messages)


async def test_each_step_costs_the_store_one_transaction(fake_model: FakeModel, tmp_path: Path) -> None:
    fake_model.script = [Reply(tool_calls=[Call("lookup", VAULT)]), Reply(tool_calls=[Call("lookup", VAULT)]), Reply(text="Done.")]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db") as store:
            before = store.batches
            await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), question(), session=Session.open(SESSION, store))
            # The save and the take of the steers before each request share one transaction.
            assert store.batches - before == 3 + 1


async def test_a_turn_with_a_continuation_to_spare_still_saves_once_at_the_end(fake_model: FakeModel, tmp_path: Path) -> None:
    fake_model.script = [Reply(tool_calls=[Call("lookup", VAULT)]), Reply(text="Done.")]
    spec = AgentSpec(tools=[lookup_tool()], steer_continuations=1)
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db") as store:
            session = CountingSession(SESSION, store, requests_made=lambda: len(fake_model.bodies))
            result = await run_turn(fake_model, spec, question(), session=session)
    # The look for late steers after the answer saves the answer; nothing is saved twice.
    assert session.saves == [(1, 0), (3, 1), (4, 2)]
    assert result.output == "Done."


@pytest.mark.parametrize("breakage", ["closed", "refusing writes"])
async def test_a_store_that_cannot_be_written_stops_the_run_before_the_model_is_called(
    fake_model: FakeModel, tmp_path: Path, breakage: str
) -> None:
    path = tmp_path / "runtime.db"
    fake_model.default = Reply(text="An answer nobody should have asked for.")
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            if breakage == "closed":
                await store.aclose()
            else:
                refuse_writes_of_events(path)
            with pytest.raises(SaveFailed, match=f"context '{SESSION}' failed, so the run stopped before calling the model"):
                await run_turn(fake_model, AgentSpec(), question(), session=Session.open(SESSION, store))
    assert fake_model.bodies == []


async def test_a_store_that_fails_between_steps_stops_the_run_before_the_next_request(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    path = tmp_path / "runtime.db"

    async def break_the_disk(_arguments: dict[str, Any]) -> str:
        refuse_writes_of_events(path)
        return "done"

    fake_model.script = [Reply(tool_calls=[Call("break_the_disk")])]
    fake_model.default = Reply(text="An answer nobody should have asked for.")
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            with pytest.raises(SaveFailed, match=f"saving the transcript for context '{SESSION}' failed") as caught:
                spec = AgentSpec(tools=[make_tool("break_the_disk", break_the_disk)])
                await run_turn(fake_model, spec, question(), session=Session.open(SESSION, store))
            assert "disk is full" in str(caught.value.__cause__)  # the store's words, kept for the logs
        assert len(fake_model.bodies) == 1
        assert await stored_messages(path, SESSION) == question()  # what was saved before stays


async def test_without_a_session_nothing_touches_any_store(
    fake_model: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    fake_model.script = [Reply(tool_calls=[Call("lookup", VAULT)]), Reply(text="It expired.")]
    with trio.fail_after(DEADLINE_S):
        result = await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), question())
    assert result.output == "It expired."
    assert list(tmp_path.iterdir()) == []  # no database, journal or lock file was created


async def test_the_budget_bounds_a_runaway_turn(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    fake_model.default = Reply(tool_calls=[Call("lookup", VAULT)])  # a model that never concludes
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            with pytest.raises(BudgetExhausted, match="budget exhausted: the turn made its 12 model calls"):
                await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), question(), session=Session.open(SESSION, store))
        assert len(fake_model.bodies) == 12
        stored = await stored_messages(path, SESSION)
    # The last step's tool result is stored too, so a resumed run does not make that call again.
    assert len(stored) == 1 + 12 * 2
    assert stored[-1].role == "tool"


async def test_max_steps_bounds_a_round_below_the_budget(fake_model: FakeModel) -> None:
    fake_model.default = Reply(tool_calls=[Call("lookup", VAULT)])
    with trio.fail_after(DEADLINE_S):
        with pytest.raises(MaxStepsReached, match=r"max_steps \(3\) with the model still calling tools"):
            await run_turn(fake_model, AgentSpec(tools=[lookup_tool()], max_steps=3), question())
    assert len(fake_model.bodies) == 3


@pytest.mark.parametrize(
    ("finish_reason", "error", "says"),
    [
        ("length", AnswerTruncated, "cut off at its length limit"),
        ("content_filter", AnswerFiltered, "withheld by its provider's content filter"),
        ("error", AnswerFailed, "ended the answer with an error"),
    ],
)
async def test_an_answer_cut_off_at_its_length_limit_or_by_a_filter_fails_the_run_and_is_kept_as_partial(
    fake_model: FakeModel, tmp_path: Path, finish_reason: str, error: type[Exception], says: str
) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text="The lease expired at", finish_reason=finish_reason)]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            with pytest.raises(error, match=says):
                await run_turn(fake_model, AgentSpec(), question(), session=Session.open(SESSION, store))
        stored = await stored_messages(path, SESSION)
    assert stored == [*question(), Message(role="assistant", text="The lease expired at", partial=True)]


@pytest.mark.parametrize(
    "text", ["x" * 10_000, "\x01" * 1_000], ids=["more characters than the limit", "past the limit only as stored"]
)
async def test_an_answer_larger_than_a_message_may_be_fails_the_run_and_is_kept_cut_to_fit(
    fake_model: FakeModel, tmp_path: Path, text: str
) -> None:
    # Stored as JSON, a control character takes six bytes: 1 000 of them stream past no bound
    # on characters, and are caught as the answer completes.
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text=text, chunk_chars=100)]
    log = EventLog()
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path, max_event_bytes=4096) as store:
            with pytest.raises(AnswerTooLarge, match="the model's answer grew past 4096 bytes, the most one message"):
                await run_turn(fake_model, AgentSpec(), question(), session=Session.open(SESSION, store), on_event=log)
        stored = await stored_messages(path, SESSION)
    assert stored[:-1] == question()
    kept = stored[-1]
    assert (kept.role, kept.partial) == ("assistant", True)
    assert text.startswith(kept.text) and 4096 - 100 < kept.stored_bytes() <= 4096
    streamed = "".join(event.text for event in log.of(TextDelta))
    assert text.startswith(streamed) and len(streamed) <= 4096  # no more went out than may be kept


@pytest.mark.parametrize("sent", ["streamed", "streamed, every piece naming the call", "whole"])
async def test_a_tool_call_that_takes_most_of_a_message_is_taken_however_it_is_sent(
    fake_model: FakeModel, tmp_path: Path, sent: str
) -> None:
    # Its arguments arrive in pieces and then whole, and some servers repeat the call's id and
    # name in every piece: counted once, they fit the limit.
    arguments = '{"service": "' + "v" * 3_000 + '"}'
    whole, repeat = sent == "whole", "naming" in sent
    fake_model.script = [
        Reply(tool_calls=[Call("lookup", arguments)], ignore_stream=whole, repeat_call_names=repeat),
        Reply(text="It expired.", ignore_stream=whole),
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db", max_event_bytes=4096) as store:
            result = await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), question(), session=Session.open(SESSION, store))
        stored = await stored_messages(tmp_path / "runtime.db", SESSION)
    assert result.output == "It expired." and stored == list(result.messages)
    assert stored[1].tool_calls[0].arguments == arguments


@pytest.mark.parametrize("continuations", [0, 1])
async def test_a_store_that_fails_as_the_answer_is_saved_says_the_end_of_the_run_is_not_stored(
    fake_model: FakeModel, tmp_path: Path, continuations: int
) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text="The lease expired.")]

    def break_the_disk_as_the_answer_comes(event: AgentEvent) -> None:
        if isinstance(event, StepStarted):
            refuse_writes_of_events(path)

    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            spec = AgentSpec(steer_continuations=continuations)
            with pytest.raises(SaveFailed) as caught:
                await run_turn(
                    fake_model, spec, question(), session=Session.open(SESSION, store), on_event=break_the_disk_as_the_answer_comes
                )  # fmt: skip
        assert await stored_messages(path, SESSION) == question()
    # Not "stopped before calling the model": the model had answered; its answer is what is lost.
    assert str(caught.value) == (
        f"saving the answer for context '{SESSION}' failed, so the conversation does not hold it; "
        "send the message again, with a new messageId, once the server's storage is back"
    )
    assert len(fake_model.bodies) == 1


async def test_retries_stop_after_the_first_streamed_byte(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    # Three events go out (the role, "The ", "leas"), then the connection drops.
    fake_model.script = [Reply(text="The lease expired at 03:12.", fail_after_chunks=3)]
    fake_model.default = Reply(text="A second answer nobody should have asked for.")
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            with pytest.raises(ModelUnavailable, match="in the middle of the answer"):
                await run_turn(fake_model, AgentSpec(), question(), session=Session.open(SESSION, store))
        assert len(fake_model.bodies) == 1
        stored = await stored_messages(path, SESSION)
    assert stored == [*question(), Message(role="assistant", text="The leas", partial=True)]


async def test_a_failure_before_the_first_byte_is_retried_within_one_step(fake_model: FakeModel, tmp_path: Path) -> None:
    fake_model.script = [ErrorReply(503), Reply(text="Renewed.")]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db") as store:
            session = CountingSession(SESSION, store, requests_made=lambda: len(fake_model.bodies))
            result = await run_turn(fake_model, AgentSpec(), question(), session=session)
    assert result.output == "Renewed."
    assert result.model_calls == 1
    assert len(fake_model.bodies) == 2
    assert fake_model.bodies[0] == fake_model.bodies[1]
    assert session.saves == [(1, 0), (2, 2)]  # one save before the step, however many attempts it took


async def cancel_when(run: AgentRun, ready: Callable[[], Awaitable[None]]) -> float:
    """Run ``run`` in a cancel scope, cancel it once ``ready()`` returns, and return the seconds
    from ``cancel()`` to the run having exited."""
    scope = trio.CancelScope()
    exited_at = 0.0

    async def go() -> None:
        nonlocal exited_at
        with scope:
            await run.run()
        exited_at = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(go)
        await ready()
        cancelled_at = trio.current_time()
        scope.cancel()
    assert scope.cancelled_caught
    return exited_at - cancelled_at


async def test_cancelling_mid_stream_ends_the_run_promptly_and_keeps_the_partial_answer(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [
        Reply(tool_calls=[Call("lookup", VAULT)]),
        Reply(text="The lease expired because nobody renewed it.", hang_after_chunks=3),  # then stalls
    ]
    log = EventLog()
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            session = Session.open(SESSION, store)
            run = AgentRun(client, AgentSpec(tools=[lookup_tool()]), question(), session=session, on_event=log)
            latency_s = await cancel_when(run, lambda: log.wait_for(TextDelta, 2))
            await fake_model.wait_disconnected()
        assert latency_s < PROMPTLY_S
        stored = await stored_messages(path, SESSION)
    streamed = "".join(event.text for event in log.of(TextDelta))
    assert streamed == "The leas"
    assert stored[:3] == list(run.messages[:3])  # the question, the call and its result: nothing lost
    assert stored[3:] == [Message(role="assistant", text=streamed, partial=True)]
    with pytest.raises(RunFinished):
        run.steer("too late")


async def test_cancelling_mid_tool_ends_the_run_promptly_and_loses_nothing_saved(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    never = trio.Event()

    async def wait_for_approval(_arguments: dict[str, Any]) -> str:
        await never.wait()
        return "approved"

    fake_model.script = [Reply(tool_calls=[Call("lookup", VAULT)]), Reply(tool_calls=[Call("wait_for_approval")])]
    log = EventLog()
    spec = AgentSpec(tools=[lookup_tool(), make_tool("wait_for_approval", wait_for_approval)])
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store, open_model_client(config_for(fake_model)) as client:
            run = AgentRun(client, spec, question(), session=Session.open(SESSION, store), on_event=log)
            latency_s = await cancel_when(run, lambda: log.wait_for(ToolCalled, 2))
        assert latency_s < PROMPTLY_S
        stored = await stored_messages(path, SESSION)
    assert len(log.of(ToolResult)) == 1  # the second tool never finished
    # What was saved before the second request stays; the step in flight was not stored, so a
    # resumed run does it again (see test_a_resumed_run_redoes_the_step_a_killed_process_was_in).
    assert stored == list(run.messages[:3])


async def test_a_run_resumes_from_what_another_run_saved(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    follow_up = Message(role="user", text="And which line returns the token error?")
    fake_model.script = [
        Reply(tool_calls=[Call("lookup", VAULT)]),
        Reply(text="The lease was not renewed."),
        Reply(text="Line 42 of vault.go."),
    ]
    spec = AgentSpec(tools=[lookup_tool()])
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            first = await run_turn(fake_model, spec, question(), session=Session.open(SESSION, store))
        # Another process: a store of its own over the same file, and nothing else shared.
        async with open_session_store(path) as store:
            session = Session.open(SESSION, store)
            messages = await session.messages()
            assert messages == list(first.messages)
            second = await run_turn(fake_model, spec, [*messages, follow_up], session=session)
        stored = await stored_messages(path, SESSION)
    assert sent_messages(fake_model.bodies[2])[:4] == sent_messages(fake_model.bodies[1]) + [
        {"role": "assistant", "content": "The lease was not renewed."}
    ]
    assert sent_messages(fake_model.bodies[2])[4] == {"role": "user", "content": follow_up.text}
    assert second.output == "Line 42 of vault.go."
    assert stored == list(second.messages) == [*first.messages, follow_up, Message(role="assistant", text="Line 42 of vault.go.")]


async def test_a_resumed_run_redoes_the_step_a_killed_process_was_in(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [
        Reply(tool_calls=[Call("page_oncall", '{"team": "vault"}')]),  # the child process's request
        Reply(tool_calls=[Call("page_oncall", '{"team": "vault"}')]),  # the same step, done again
        Reply(text="Paged the vault team."),
    ]
    with trio.fail_after(DEADLINE_S):
        # A real process runs the turn and is killed with SIGKILL while its tool runs.
        child = await trio.lowlevel.open_process(
            [sys.executable, str(CHILD), str(path), fake_model.base_url, SESSION], stdout=subprocess.PIPE, cwd=ROOT
        )
        assert child.stdout is not None
        try:
            seen = b""
            while b"paging\n" not in seen:
                chunk = await child.stdout.receive_some()
                assert chunk, f"the child ended before its tool ran: {seen!r}"
                seen += chunk
        finally:
            child.kill()
            await child.wait()
            await child.stdout.aclose()
        assert child.returncode == -signal.SIGKILL
        paged: list[dict[str, Any]] = []

        async def page_oncall(arguments: dict[str, Any]) -> str:
            paged.append(arguments)
            return "paged"

        spec = AgentSpec(tools=[make_tool("page_oncall", page_oncall)])
        async with open_session_store(path) as store:
            session = Session.open(SESSION, store)
            messages = await session.messages()
            assert messages == question()  # saved before the request the child was killed after
            result = await run_turn(fake_model, spec, messages, session=session)
        stored = await stored_messages(path, SESSION)
    assert sent_messages(fake_model.bodies[1]) == sent_messages(fake_model.bodies[0])  # the same request again
    assert paged == [{"team": "vault"}]  # the tool ran again in this process
    assert result.output == "Paged the vault team."
    assert [message.role for message in stored] == ["user", "assistant", "tool", "assistant"]


async def test_a_run_resumed_after_a_cut_off_answer_never_sends_the_partial_text(fake_model: FakeModel, tmp_path: Path) -> None:
    path = tmp_path / "runtime.db"
    cut_off = Message(role="assistant", text="The lease exp", partial=True)
    follow_up = Message(role="user", text="Go on.")
    fake_model.script = [Reply(text="The lease expired at 03:12.")]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            session = Session.open(SESSION, store)
            await session.save([*question(), cut_off])
            result = await run_turn(fake_model, AgentSpec(), [*await session.messages(), follow_up], session=session)
        stored = await stored_messages(path, SESSION)
    # With the unfinished answer left out, the two questions go as one: roles still alternate.
    assert sent_messages(fake_model.bodies[0]) == [{"role": "user", "content": f"{QUESTION}\n\nGo on."}]
    assert stored == list(result.messages) == [*question(), cut_off, follow_up, Message(role="assistant", text="The lease expired at 03:12.")]


async def test_an_agent_run_runs_once(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="Once.")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            run = AgentRun(client, AgentSpec(), question())
            await run.run()
            with pytest.raises(RuntimeError, match="An AgentRun runs once"):
                await run.run()
    assert len(fake_model.bodies) == 1


def test_an_agent_run_refuses_a_transcript_of_something_other_than_messages() -> None:
    with pytest.raises(TypeError):
        AgentRun(object(), AgentSpec(), [{"role": "user", "content": QUESTION}])  # type: ignore[arg-type, list-item]  # the wrong types are the point


async def test_a_tool_result_that_cannot_fit_beside_its_calls_own_name_ends_the_run_as_too_large(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # A call to a tool of a name nearly a whole message long: even an empty result, with the
    # note that it was cut, would not fit. The model's answer was too large, said as such.
    fake_model.script = [Reply(tool_calls=[Call("x" * 3990, "{}")])]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db", max_event_bytes=4096) as store:
            with pytest.raises(AnswerTooLarge, match="grew past 4096 bytes"):
                await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), question(), session=Session.open(SESSION, store))


@attrs.define(eq=False)
class NamesComeLater(ScriptedStream):
    """Calls whose first piece has no id or name, sent in a later piece (a long name): it
    counts how many pieces it handed out."""

    handed: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        for index in range(200):
            self._steps.append(ToolCallDelta(index=index, arguments="{}"))
            self._steps.append(ToolCallDelta(index=index, id=f"c{index}", name="x" * 5000))

    async def __anext__(self) -> Delta:
        self.handed += 1
        return await super().__anext__()


async def test_a_call_whose_name_comes_after_its_first_piece_counts_toward_the_answers_size(tmp_path: Path) -> None:
    streams: list[NamesComeLater] = []

    class Model:
        def stream(self, request: object) -> NamesComeLater:
            streams.append(NamesComeLater(Answer()))
            return streams[-1]

    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db", max_event_bytes=4096) as store:
            with pytest.raises(AnswerTooLarge):
                await AgentRun(Model(), AgentSpec(), question(), session=Session.open(SESSION, store)).run()
    assert streams[0].handed < 10  # left as soon as the names passed the limit, not read to its end
