"""Conversations through the A2A surface: what the model is sent turn after turn, and what the
client is told of each turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from fake_model import FakeModel, Reply

from runtime.agent import NEXT_LABEL, STEER_LABEL
from runtime.runner import ANONYMOUS
from tests.runtime.served import GATE_CALL, SYSTEM_PROMPT, Served, serve_keel


def _shown(message: dict[str, Any]) -> tuple[Any, ...]:
    return message["role"], message.get("content"), message.get("tool_calls"), message.get("tool_call_id")


def sent(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The messages of a request the model received, as (role, content)."""
    return [(message["role"], message["content"]) for message in body["messages"]]


@pytest.mark.parametrize("version", ["1.0", None])
@pytest.mark.parametrize("finish_reason", ["error", "abort"])
async def test_an_answer_its_server_ended_with_an_error_fails_the_turn_and_is_never_sent_as_complete(
    keel: Served, finish_reason: str, version: str | None
) -> None:
    # OpenRouter ends an answer its provider failed in the middle of with finish_reason "error";
    # vLLM one its engine aborted with "abort". What came before is part of an answer, not all of it.
    keel.model.script = [Reply(text="The lease expired at", finish_reason=finish_reason), Reply(text="At 03:00 UTC.")]
    failed = await keel.send("When did the lease expire?", version=version)
    said = failed["status"]["message"]["parts"][0]["text"]
    assert failed["status"]["state"] in ("TASK_STATE_FAILED", "failed"), failed["status"]
    assert f"ended the answer with an error (finish_reason {finish_reason!r})" in said, said
    assert "send the message again" in said, said
    await keel.send("And why?", version=version, contextId=failed["contextId"])
    assert sent(keel.model.bodies[1])[1:] == [("user", "When did the lease expire?\n\nAnd why?")]


@pytest.mark.parametrize("text", ["", "\n\n"], ids=["nothing", "white space"])
async def test_an_answer_with_no_text_fails_the_turn_rather_than_complete_it_with_nothing(keel: Served, text: str) -> None:
    # A reasoning model that spends its answer thinking can stop with nothing left to say.
    keel.model.script = [Reply(text=text), Reply(text="At 03:00 UTC.")]
    failed = await keel.send("When did the lease expire?")
    said = failed["status"]["message"]["parts"][0]["text"]
    assert failed["status"]["state"] == "TASK_STATE_FAILED", failed["status"]
    assert "the model's answer held no text" in said and "send the message again, with a new messageId" in said, said
    answered = await keel.send("And why?", contextId=failed["contextId"])
    assert answered["status"]["state"] == "TASK_STATE_COMPLETED"
    assert sent(keel.model.bodies[1])[1:] == [("user", "When did the lease expire?\n\nAnd why?")]


@pytest.mark.parametrize("version", ["1.0", None])
async def test_a_conversation_across_tools_a_steer_a_cancel_and_a_restart_is_sent_to_the_model_as_it_went(
    fake_model: FakeModel, tmp_path: Path, version: str | None
) -> None:
    fake_model.script = [
        Reply(tool_calls=[GATE_CALL]),
        Reply(text="The lease expired."),
        Reply(tool_calls=[GATE_CALL]),
        Reply(text="The gate is open again."),
    ]
    async with serve_keel(tmp_path / "state", fake_model) as keel:
        first = await keel.send("Why did vault fail?", version=version, blocking=False)
        context = first["contextId"]
        await keel.gate.wait_entered()
        await keel.send("Check staging too", version=version, blocking=False, taskId=first["id"])
        keel.gate.opened.set()
        answered = await keel.runner.wait_settled(ANONYMOUS, first["id"])
        assert answered.status.state.value in ("completed", "TASK_STATE_COMPLETED")
        keel.gate.entered, keel.gate.opened = trio.Event(), trio.Event()
        second = await keel.send("Rotate the lease", version=version, blocking=False, contextId=context)
        await keel.gate.wait_entered()
        await keel.result("tasks/cancel" if version is None else "CancelTask", {"id": second["id"]}, version=version)
    async with serve_keel(tmp_path / "state", fake_model) as keel:
        await keel.send("Is the gate open?", version=version, contextId=context)
        listed = await keel.result("ListTasks", {"contextId": context, "historyLength": 1})
    steer = STEER_LABEL + "Check staging too"
    call = [{"id": "call_1_0", "type": "function", "function": {"name": GATE_CALL.name, "arguments": "{}"}}]
    asked = [[_shown(message) for message in body["messages"]] for body in fake_model.bodies]
    system = ("system", SYSTEM_PROMPT, None, None)
    assert asked[1] == [
        system, ("user", "Why did vault fail?", None, None), ("assistant", None, call, None),
        ("tool", "the gate opened", None, "call_1_0"), ("user", steer, None, None),
    ]  # fmt: skip
    assert asked[3] == [
        *asked[1], ("assistant", "The lease expired.", None, None),
        ("user", "Rotate the lease\n\nIs the gate open?", None, None),  # the canceled question, joined with the next
    ]  # fmt: skip
    last_said = [task["history"][0]["parts"][0]["text"] for task in listed["tasks"]]  # historyLength 1: the last message
    assert last_said == ["The gate is open again.", "Rotate the lease", "The lease expired."]


async def test_the_question_after_a_steer_whose_turn_was_canceled_is_not_sent_as_part_of_the_steer(keel: Served) -> None:
    keel.model.script = [
        Reply(tool_calls=[GATE_CALL]),
        Reply(text="Checking staging", hang_after_chunks=1),  # canceled before it is answered
        Reply(text="Rotated."),
    ]
    first = await keel.send("Why did vault fail?", blocking=False)
    await keel.gate.wait_entered()
    await keel.send("Check staging too", blocking=False, taskId=first["id"])
    keel.gate.opened.set()
    await keel.wait_for_model_requests(2)  # the steer rides it
    await keel.result("CancelTask", {"id": first["id"]})
    await keel.send("Rotate the lease", contextId=first["contextId"])
    # One user message, so that the roles alternate; the question under a label of its own, not
    # read as more of what was sent while the agent worked.
    assert sent(keel.model.bodies[2])[-1] == ("user", f"{STEER_LABEL}Check staging too\n\n{NEXT_LABEL}Rotate the lease")


async def test_a_question_sent_again_after_its_turn_failed_is_sent_to_the_model_once(keel: Served) -> None:
    # A turn that fails says to send the message again; each time the client does, the model must
    # read the question once, not once for every failed turn before it.
    keel.model.script = [Reply(text=""), Reply(text=""), Reply(text="At 03:00 UTC.")]
    failed = await keel.send("When did the lease expire?")
    for _ in range(2):
        answered = await keel.send("When did the lease expire?", contextId=failed["contextId"])
    assert answered["status"]["state"] == "TASK_STATE_COMPLETED"
    assert [sent(body)[1:] for body in keel.model.bodies] == [[("user", "When did the lease expire?")]] * 3
