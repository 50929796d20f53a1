"""Resuming a conversation as a program outside the server does: the loop run on a session's
stored messages, in a store of its own over the same file, against the fake model server."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from fake_model import FakeModel, Reply

from persistence.session import Session
from persistence.sessions import open_session_store
from persistence.transcript import Message
from runtime.agent import AgentSpec, SaveFailed
from tests.runtime.agent_support import DEADLINE_S, QUESTION, question, run_turn, stored_messages

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
    assert (resumed.model_calls, resumed.usage) == (0, None)
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
