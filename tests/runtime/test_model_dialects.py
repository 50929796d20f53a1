"""What OpenAI-compatible servers other than OpenAI's send, read through the real client against the
fake model server on loopback: each test names the server whose dialect it speaks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from fake_model import OLLAMA_ERROR, Call, ErrorReply, FakeModel, Reply

from persistence.session import Session
from persistence.sessions import open_session_store
from persistence.transcript import Message, ToolCall
from runtime.agent import AgentSpec
from runtime.models import ModelReasoningRunaway, ModelUnavailable, TextDelta, open_model_client
from runtime.models.assembly import StreamAssembler
from runtime.models.client import MAX_REASONING_CHARS
from tests.runtime.agent_support import lookup_tool, question, run_turn, sent_messages, stored_messages
from tests.runtime.test_models import ASK, DEADLINE_S, config_for, read_stream, sse, timed_out_stream

VAULT = '{"service": "vault"}'


MID_ANSWER = "the server reported an error in the middle of the answer"
ENDED_EARLY = "the stream ended before the model finished its answer"


@pytest.mark.parametrize(
    ("error_event", "done_after_error", "reason"),
    [
        # llama.cpp's server until late 2025 (ggml-org/llama.cpp#16109): a field of its own.
        ('error: {"code": 500, "message": "the model failed mid-answer", "type": "server_error"}', True, MID_ANSWER),
        # The event-stream rules' own way, whatever the data's shape.
        ('event: error\ndata: {"message": "the model failed mid-answer"}', True, MID_ANSWER),
        # Ollama's OpenAI-compatible API turns the error into a chunk holding nothing and ends the
        # body there, cleanly: no finish_reason, no [DONE]. Not an unreadable answer: the server failed.
        (OLLAMA_ERROR, False, ENDED_EARLY),
    ],
    ids=["llama.cpp-error-field", "error-event", "ollama-body-ended"],
)
async def test_an_error_reported_mid_stream_in_another_shape_fails_the_answer_rather_than_end_it(
    fake_model: FakeModel, error_event: str, done_after_error: bool, reason: str
) -> None:
    # Read as nothing, the text so far would pass for the whole answer.
    reply = Reply(text="The lease expired because", chunk_chars=5, error_after_chunks=3, error_event=error_event, done_after_error=done_after_error)
    fake_model.script = [reply]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_retries=0)) as client:
            async with client.stream(ASK) as chunks:
                with pytest.raises(ModelUnavailable) as raised:
                    async for _ in chunks:
                        pass
                partial = chunks.partial_message()
    assert (raised.value.reason, raised.value.may_pass) == (reason, True)
    assert reason == ENDED_EARLY or "the model failed mid-answer" in raised.value.detail
    assert (partial.text, partial.partial) == ("The lease ", True)


async def test_a_turn_whose_server_reports_an_error_mid_answer_fails_and_keeps_the_text_as_partial(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # As llama.cpp's server did until late 2025: completed, the task would hold half an answer as the whole.
    path = tmp_path / "runtime.db"
    fake_model.script = [Reply(text="The lease expired because", chunk_chars=5, error_after_chunks=3)]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path) as store:
            with pytest.raises(ModelUnavailable, match="reported an error in the middle of the answer"):
                await run_turn(fake_model, AgentSpec(), question(), session=Session.open("incident-7", store))
        stored = await stored_messages(path, "incident-7")
    assert stored == [*question(), Message(role="assistant", text="The lease ", partial=True)]


async def test_parallel_calls_a_server_streams_all_at_index_0_stay_apart(fake_model: FakeModel) -> None:
    # Ollama streams every call of a parallel batch at index 0 (ollama/ollama#15457), each with its own id.
    calls = [Call("clock", "{}"), Call("lookup", VAULT), Call("lookup", '{"service": "dns"}')]
    fake_model.script = [Reply(tool_calls=calls, same_call_index=True, chunk_chars=5)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            _, completion = await read_stream(client)
    assert completion.message.tool_calls == (
        ToolCall("call_1_0", "clock", "{}"),
        ToolCall("call_1_1", "lookup", VAULT),
        ToolCall("call_1_2", "lookup", '{"service": "dns"}'),
    )


def test_later_pieces_of_a_call_that_come_with_an_id_of_their_own_go_on_with_that_call() -> None:
    # Poolside gives a call's later pieces an id other than its first's (poolsideai/pool#9): no new call.
    def piece(call_id: str, arguments: str, name: str = "") -> dict[str, Any]:
        function = {"name": name, "arguments": arguments} if name else {"arguments": arguments}
        call = {"index": 0, "id": call_id, "function": function}
        return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}

    finished = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    assembler = StreamAssembler("m")
    pieces = [piece("call_a", "", name="lookup"), piece("call_b", '{"service": '), piece("call_b", '"vault"}')]
    for line in sse(*pieces, finished, "[DONE]"):
        assembler.feed_line(line)
    assert assembler.completion().message.tool_calls == (ToolCall("call_a", "lookup", VAULT),)


async def test_a_turn_runs_each_of_the_parallel_calls_a_server_streams_at_index_0(fake_model: FakeModel) -> None:
    fake_model.script = [
        Reply(tool_calls=[Call("lookup", VAULT), Call("lookup", '{"service": "dns"}')], same_call_index=True),
        Reply(text="Both expired."),
    ]
    calls: list[dict[str, Any]] = []
    with trio.fail_after(DEADLINE_S):
        result = await run_turn(fake_model, AgentSpec(tools=[lookup_tool(calls)]), question())
    assert calls == [{"service": "vault"}, {"service": "dns"}]
    answered = [message["tool_call_id"] for message in sent_messages(fake_model.bodies[1]) if message["role"] == "tool"]
    assert answered == ["call_1_0", "call_1_1"]
    assert result.output == "Both expired."


@pytest.mark.parametrize(
    ("status", "said"),
    [
        # Azure AI's serverless models (CherryHQ/cherry-studio#9214).
        (400, {"detail": "Extra parameters ['stream_options'] are not allowed when extra-parameters is not set"}),
        # A server whose request schema forbids fields it does not know.
        (422, {"error": {"message": "Validation error at #/stream_options: Extra inputs are not permitted"}}),
    ],
)
async def test_a_server_that_refuses_stream_options_is_asked_again_without_them_and_not_again(
    fake_model: FakeModel, status: int, said: dict[str, object]
) -> None:
    fake_model.script = [ErrorReply(status, body=json.dumps(said)), Reply(text="Answered."), Reply(text="Again.")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_retries=0)) as client:
            _, first = await read_stream(client)
            _, second = await read_stream(client)
    assert (first.message.text, second.message.text) == ("Answered.", "Again.")
    assert [("stream_options" in body) for body in fake_model.bodies] == [True, False, False]
    assert (first.usage, second.usage) == (None, None)  # the one thing lost: what the answers cost


async def test_content_sent_as_typed_parts_is_read_and_its_thinking_is_not_the_answer(fake_model: FakeModel) -> None:
    # Mistral's API streams its reasoning models' content as lists of "thinking" and "text" parts
    # (BerriAI/litellm#16272), and answers in one body the same way.
    reply = Reply(text="The lease expired.", reasoning="The user asks about the lease.", content_parts=True)
    fake_model.script = [reply, reply]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            deltas, streamed = await read_stream(client)
            whole = await client.complete(ASK)
    assert "".join(delta.text for delta in deltas if isinstance(delta, TextDelta)) == "The lease expired."
    assert streamed.message.text == whole.message.text == "The lease expired."


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_a_model_that_reasons_longer_than_the_timeout_is_not_cut_off_nor_its_reasoning_taken_for_the_answer(
    fake_model: FakeModel, field: str
) -> None:
    # vLLM, llama.cpp and DeepSeek stream reasoning_content; Ollama and newer vLLM, reasoning. The
    # content stays empty meanwhile, for longer than the model may send nothing.
    fake_model.script = [Reply(text="Renew it.", reasoning="x" * 40, reasoning_field=field, chunk_chars=2, gap_s=0.05)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, read_timeout_s=0.4)) as client:
            deltas, completion = await read_stream(client)
    assert "".join(delta.text for delta in deltas if isinstance(delta, TextDelta)) == "Renew it."
    assert (completion.message.text, completion.finish_reason) == ("Renew it.", "stop")


REASONING = "The user asks about the lease. It expired, 25h after its renewal."
REASONING_REPLIES = {
    "reasoning_content": Reply(text="Renew it.", reasoning=REASONING),
    "reasoning": Reply(text="Renew it.", reasoning=REASONING, reasoning_field="reasoning"),
    "thinking-parts": Reply(text="Renew it.", reasoning=REASONING, content_parts=True),
    "think-block": Reply(text=f"<think>{REASONING}</think>Renew it."),
    "magistral-block": Reply(text=f"[THINK]{REASONING}[/THINK]Renew it."),
}


@pytest.mark.parametrize("dialect", REASONING_REPLIES)
async def test_a_model_that_falls_silent_while_reasoning_times_out_saying_so_and_for_how_long(
    fake_model: FakeModel, dialect: str
) -> None:
    # The opening chunk, then five pieces of reasoning 0.1s apart (the first holds a block's whole
    # opening tag), then nothing: the model had been reasoning for 0.4s, and none of its answer had come.
    fake_model.script = [attrs.evolve(REASONING_REPLIES[dialect], chunk_chars=8, gap_s=0.1, hang_after_chunks=6)]
    received, timeout = await timed_out_stream(fake_model, 0.3)
    said = re.fullmatch(
        r"model 'qwen3:4b-instruct' timed out: nothing arrived within 0\.3s while waiting for the model to go on reasoning "
        r"\(it had been reasoning for (\d+\.\d)s; none of its answer had come\)",
        str(timeout),
    )
    assert said is not None, str(timeout)
    assert 0.3 <= float(said[1]) < DEADLINE_S  # 0.4, give or take how promptly loopback delivers
    assert received == []


@pytest.mark.parametrize("dialect", REASONING_REPLIES)
async def test_a_model_that_reasons_for_longer_than_the_timeout_in_any_dialect_is_not_cut_off(
    fake_model: FakeModel, dialect: str
) -> None:
    fake_model.script = [attrs.evolve(REASONING_REPLIES[dialect], chunk_chars=2, gap_s=0.05)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, read_timeout_s=0.3)) as client:
            deltas, completion = await read_stream(client)
    assert "".join(delta.text for delta in deltas if isinstance(delta, TextDelta)) == "Renew it."
    assert (completion.message.text, completion.finish_reason) == ("Renew it.", "stop")


async def test_a_connection_that_breaks_while_the_model_reasons_fails_saying_so(fake_model: FakeModel) -> None:
    fake_model.script = [attrs.evolve(REASONING_REPLIES["reasoning_content"], chunk_chars=8, fail_after_chunks=3)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_retries=0)) as client:
            broke = r"the connection broke while the model was reasoning \(\d+\.\ds into it\), before its answer started"
            with pytest.raises(ModelUnavailable, match=broke):
                await read_stream(client)
    assert len(fake_model.bodies) == 1


async def stopped_reasoning(fake_model: FakeModel) -> tuple[ModelReasoningRunaway, list[Any]]:
    """What the model client raised as the model's scripted reasoning ran away, and what it had streamed till then."""
    received: list[Any] = []
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            with pytest.raises(ModelReasoningRunaway) as raised:
                async with client.stream(ASK) as chunks:
                    async for delta in chunks:
                        received.append(delta)
    return raised.value, received


@pytest.mark.parametrize("dialect", REASONING_REPLIES)
async def test_a_model_that_would_not_stop_reasoning_is_stopped_saying_so_in_any_dialect(
    fake_model: FakeModel, dialect: str
) -> None:
    # A small model can loop in its reasoning for ever, a piece at a time, never silent for long
    # enough to time out: past as much as one message may hold, the call ends, and no answer is taken.
    reply = REASONING_REPLIES[dialect]
    looping = "I must check the lease again. " * (MAX_REASONING_CHARS // 30 + 100)
    if reply.reasoning:
        reply = attrs.evolve(reply, reasoning=looping)
    else:  # a block opening the content
        reply = attrs.evolve(reply, text=reply.text.replace(REASONING, looping))
    fake_model.script = [attrs.evolve(reply, chunk_chars=1 << 16)]
    raised, received = await stopped_reasoning(fake_model)
    assert str(raised) == (
        f"model 'qwen3:4b-instruct' would not stop reasoning: it reasoned for more than {MAX_REASONING_CHARS} characters"
        " and had not started its answer; ask again, or for less in one message"
    )
    assert not [delta for delta in received if isinstance(delta, TextDelta)]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_a_model_that_goes_back_to_reasoning_once_its_answer_began_and_would_not_stop_is_stopped_saying_so(
    fake_model: FakeModel, field: str
) -> None:
    # Its reasoning adds nothing to the answer's size and keeps the call from timing out: unbounded,
    # it held its task WORKING for as long as the model went round.
    looping = "I must check the lease again. " * (MAX_REASONING_CHARS // 30 + 100)
    fake_model.script = [Reply(text="Let me think.", reasoning_after=looping, reasoning_field=field, chunk_chars=1 << 16)]
    raised, received = await stopped_reasoning(fake_model)
    assert str(raised) == (
        f"model 'qwen3:4b-instruct' would not stop reasoning: it reasoned for more than {MAX_REASONING_CHARS} characters"
        " in one answer; ask again, or for less in one message"
    )
    assert received == [TextDelta("Let me think.")]


async def test_a_model_whose_server_sends_its_reasoning_under_both_names_may_reason_as_long_as_any_other(
    fake_model: FakeModel,
) -> None:
    # A server that keeps the older name of the field beside the newer one sends the same text
    # twice: it is as much reasoning as once, and the model is not stopped at half the bound.
    reasoning = "I must check the lease once more. " * (MAX_REASONING_CHARS // 34 * 3 // 4)
    fake_model.script = [
        Reply(text="Renew it.", reasoning=reasoning, reasoning_field="reasoning_content reasoning", chunk_chars=1 << 16)
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            _, completion = await read_stream(client)
    assert completion.message.text == "Renew it."
