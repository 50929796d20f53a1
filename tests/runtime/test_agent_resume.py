"""Resuming a conversation as a program outside the server does: the loop run on a session's
stored messages, in a store of its own over the same file, against the fake model server."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from fake_model import Call, FakeModel, Reply

from persistence.session import Session
from persistence.sessions import open_session_store
from persistence.transcript import Message, ToolCall
from runtime.agent import AgentSpec, BudgetExhausted, SaveFailed
from runtime.agent.steers import steer_message
from tests.runtime.agent_support import DEADLINE_S, QUESTION, lookup_tool, question, run_turn, stored_messages

SESSION = "incident-9"


async def test_resuming_a_turn_whose_answer_is_stored_returns_that_answer_without_asking_again(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text="The lease expired."), Reply(text="A second answer to the same question.")]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            first = await run_turn(fake_model, AgentSpec(), question(), session=Session.open(SESSION, store))
        # Another process, which cannot know whether the one before stored the answer: it runs
        # the loop on what is stored.
        async with open_session_store(path) as store:
            session = Session.open(SESSION, store)
            resumed = await run_turn(fake_model, AgentSpec(), await session.messages(), session=session)
        stored = await stored_messages(path, SESSION)
    assert len(fake_model.bodies) == 1  # the model was not asked the answered question again
    assert resumed.output == first.output == "The lease expired."
    assert (resumed.model_calls, resumed.usage) == (1, None)  # the turn's one call, made before; none now
    assert stored == list(resumed.messages) == [Message(role="user", text=QUESTION), Message(role="assistant", text="The lease expired.")]


async def test_a_turn_given_only_its_new_message_says_the_transcript_must_extend_the_stored_one(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text="The lease expired."), Reply(text="Never asked.")]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            session = Session.open(SESSION, store)
            await run_turn(fake_model, AgentSpec(), question(), session=session)
            with pytest.raises(SaveFailed) as caught:
                await run_turn(fake_model, AgentSpec(), question("And now?"), session=session)
    said = str(caught.value)
    assert "does not extend the one stored (the transcript has 1 message but 2 are stored)" in said
    assert "Session.messages()" in said
    assert "storage is back" not in said and "messageId" not in said  # nothing failed but the caller's transcript
    assert len(fake_model.bodies) == 1


async def test_a_resumed_turn_counts_the_model_calls_its_stored_answers_made_toward_its_budget(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # A turn that died after two model calls (each answer a tool call), a steer taken between
    # them: resumed with a budget of three, it may make one more call, not three.
    asked = [ToolCall(f"call{n:05d}", "lookup", '{"service": "vault"}') for n in range(2)]
    stored = [
        Message(role="user", text="An earlier question."),
        Message(role="assistant", text="An earlier answer."),
        *question(),
        Message(role="assistant", tool_calls=[asked[0]]),
        Message(role="tool", text="vault: ok", tool_call_id=asked[0].id, name="lookup"),
        steer_message("Look again."),
        Message(role="assistant", tool_calls=[asked[1]]),
        Message(role="tool", text="vault: ok", tool_call_id=asked[1].id, name="lookup"),
    ]
    fake_model.default = Reply(tool_calls=[Call("lookup", '{"service": "vault"}')])
    spec = AgentSpec(tools=[lookup_tool()], max_model_calls=3)
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db") as store:
            session = Session.open(SESSION, store)
            await session.save(stored)
            with pytest.raises(BudgetExhausted):
                await run_turn(fake_model, spec, await session.messages(), session=session)
    assert len(fake_model.bodies) == 1


async def test_a_conversation_whose_calls_reasoning_was_let_go_goes_on_from_its_transcript_read_back(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # Reasoning given as ``reasoning`` (Ollama, vLLM), too large to keep with its call: the call is
    # kept without it, and reads back as the message the run holds, so that the transcript the run
    # returned can be extended in a store that reads it back (another process's).
    thought = "x" * 4096
    fake_model.script = [
        Reply(reasoning=thought, reasoning_field="reasoning", tool_calls=[Call("lookup", '{"service": "vault"}')]),
        Reply(text="The lease expired."),
        Reply(text="Still expired."),
    ]
    spec = AgentSpec(tools=[lookup_tool()])
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db", max_event_bytes=2048) as store:
            first = await run_turn(fake_model, spec, question(), session=Session.open(SESSION, store))
        async with open_session_store(tmp_path / "runtime.db", max_event_bytes=2048) as store:
            later = await run_turn(
                fake_model, spec, [*first.messages, Message(role="user", text="And now?")], session=Session.open(SESSION, store)
            )
    assert (first.output, later.output) == ("The lease expired.", "Still expired.")
    assert await stored_messages(tmp_path / "runtime.db", SESSION) == list(later.messages)
