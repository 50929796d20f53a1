"""The OpenAI-compatible model client, through real httpx against the fake model server on loopback."""

from __future__ import annotations

import email.utils
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from fake_model import Call, ErrorReply, FakeModel, Reply
from hypothesis import given, settings
from hypothesis import strategies as st

from persistence.transcript import Message, ToolCall
from runtime.models import (
    ChatRequest,
    Completion,
    Delta,
    Finish,
    ModelBadResponse,
    ModelClient,
    ModelConfig,
    ModelError,
    ModelRateLimited,
    ModelRejected,
    ModelTimeout,
    ModelUnavailable,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
    open_model_client,
    request_body,
)
from runtime.models.assembly import StreamAssembler
from runtime.models.client import AFTER_DONE_S
from runtime.models.failures import failure_to_send
from tests.runtime.unanswered import unanswered_model_url

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 10.0  # generous: every wait in these tests is on loopback
ASK = ChatRequest([Message(role="user", text="Which service holds the vault lease?")])
# Duplicate keys and odd whitespace, and an escape the model wrote that must stay an escape.
ODD_ARGUMENTS = '{"z":1,"query":"vault","z":3}'
ODDER_ARGUMENTS = '{ "path" :\t"vault.go" ,\n  "note": "caf\\u00e9 \u2615"  }'


def config_for(server: FakeModel, **changes: Any) -> ModelConfig:
    """Retries back off for a millisecond, so retry tests do not wait on the wall clock."""
    return ModelConfig(base_url=server.base_url, backoff_base_s=0.001, backoff_max_s=0.01, **changes)


async def read_stream(client: ModelClient, request: ChatRequest = ASK) -> tuple[list[Delta], Completion]:
    async with client.stream(request) as chunks:
        deltas = [delta async for delta in chunks]
    return deltas, chunks.completion()


def closed_port_url() -> str:
    """A loopback URL where nothing listens: the port was bound to find it free, then released."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@attrs.define(eq=False)
class RefusesFirstConnections(httpx.AsyncBaseTransport):
    """A real transport that fails its first ``refusals`` connections the way a down server does."""

    refusals: int
    attempts: int = 0
    inner: httpx.AsyncHTTPTransport = attrs.Factory(httpx.AsyncHTTPTransport)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        if self.attempts <= self.refusals:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_stream_assembles_text_in_the_order_it_was_sent(fake_model: FakeModel) -> None:
    text = "The vault lease expired at 03:12 UTC; renew it with `vault lease renew`."
    fake_model.script = [Reply(text=text, chunk_chars=3)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            deltas, completion = await read_stream(client)
    texts = [delta.text for delta in deltas if isinstance(delta, TextDelta)]
    assert len(texts) > 1
    assert "".join(texts) == text
    assert Finish("stop") in deltas
    assert completion.message == Message(role="assistant", text=text)
    assert completion.finish_reason == "stop"


async def test_stream_assembles_tool_call_arguments_byte_for_byte(fake_model: FakeModel) -> None:
    calls = [Call("search", ODD_ARGUMENTS), Call("read_file", ODDER_ARGUMENTS)]
    fake_model.script = [Reply(text="Looking.", tool_calls=calls, chunk_chars=5)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            deltas, completion = await read_stream(client)
    fragments = [delta for delta in deltas if isinstance(delta, ToolCallDelta)]
    assert "".join(f.arguments for f in fragments if f.index == 1) == ODDER_ARGUMENTS
    assembled = [delta for delta in deltas if isinstance(delta, ToolCall)]
    assert [(call.name, call.arguments) for call in assembled] == [("search", ODD_ARGUMENTS), ("read_file", ODDER_ARGUMENTS)]
    assert len({call.id for call in assembled}) == 2
    assert deltas.index(Finish("tool_calls")) > max(deltas.index(call) for call in assembled)
    assert completion.message.tool_calls == tuple(assembled)
    assert completion.message.text == "Looking."


async def test_complete_returns_text_tool_calls_and_usage_in_one_piece(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="One call.", tool_calls=[Call("search", ODDER_ARGUMENTS, id="call_a")], prompt_tokens=40, completion_tokens=6)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            completion = await client.complete(ASK)
    assert completion.message == Message(role="assistant", text="One call.", tool_calls=[ToolCall("call_a", "search", ODDER_ARGUMENTS)])
    assert completion.finish_reason == "tool_calls"
    assert completion.usage == Usage(40, 6, 46)
    assert fake_model.bodies[0]["stream"] is False
    assert "stream_options" not in fake_model.bodies[0]


# An emoji's two UTF-16 halves, as separate characters: what a server that cuts text by UTF-16
# units (as JavaScript does) sends in two chunks, each spelled as a JSON escape.
HIGH, LOW = "\ud83d", "\ude00"


async def test_stream_joins_an_emoji_cut_between_chunks_and_replaces_a_lone_half(fake_model: FakeModel) -> None:
    sent = f"smile {HIGH}{LOW}, half {HIGH} and {LOW}!"
    arguments = f'{{"q": "{HIGH}{LOW}"}}'
    fake_model.script = [Reply(text=sent, tool_calls=[Call("search", arguments)], chunk_chars=1)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            deltas, completion = await read_stream(client)
    texts = [delta.text for delta in deltas if isinstance(delta, TextDelta)]
    assert "".join(texts) == completion.message.text == "smile \U0001f600, half \ufffd and \ufffd!"
    assert "\U0001f600" in texts  # held back one chunk, then sent whole
    assert completion.message.tool_calls[0].arguments == '{"q": "\U0001f600"}'


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "one body"])
async def test_bytes_that_are_not_utf8_are_replaced_streamed_or_in_one_body(fake_model: FakeModel, whole: bool) -> None:
    # A server that cuts a character's bytes apart (an answer stopped mid-character, a byte-level
    # token) sends bytes that are not UTF-8; the rest of the answer is still the answer.
    cut = "\u00e9".encode()[:1].decode("utf-8", "surrogateescape")  # the first of the two bytes of an e-acute
    fake_model.script = [
        Reply(text=f"caf{cut} ok", tool_calls=[Call("search", f'{{"q": "caf{cut}"}}')], raw_bytes=True, ignore_stream=whole)
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            _, completion = await read_stream(client)
    assert completion.message.text == "caf\ufffd ok"
    assert completion.message.tool_calls[0].arguments == '{"q": "caf\ufffd"}'


async def test_stream_keeps_text_and_arguments_holding_unicode_line_separators(fake_model: FakeModel) -> None:
    # Raw inside a JSON string (a server need not escape them), they are not line breaks in an
    # event stream, though Python's str.splitlines() takes them for some.
    said = "one\u2028two\u2029three\x85four\x1cfive"
    arguments = json.dumps({"q": said}, ensure_ascii=False)
    fake_model.script = [Reply(text=said, tool_calls=[Call("search", arguments)], chunk_chars=3)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            _, completion = await read_stream(client)
    assert completion.message.text == said
    assert completion.message.tool_calls[0].arguments == arguments


async def test_complete_replaces_text_that_is_not_unicode(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text=f"ok {HIGH}{LOW} {LOW}", tool_calls=[Call("search", f'{{"q": "{HIGH}"}}', id="call_a")])]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            completion = await client.complete(ASK)
    assert completion.message.text == "ok \U0001f600 \ufffd"
    assert completion.message.tool_calls == (ToolCall("call_a", "search", '{"q": "\ufffd"}'),)


async def test_calls_past_the_connection_limit_wait_their_turn_however_long_and_none_fails(fake_model: FakeModel) -> None:
    # Each answer takes longer than the connect timeout, which once bounded the wait for one of
    # the pool's connections too: the calls past the limit failed as timeouts.
    fake_model.default = Reply(text="in turn", delay_s=0.5)
    config = attrs.evolve(config_for(fake_model), max_connections=2, connect_timeout_s=0.1)
    answers: list[str] = []
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config) as client:

            async def ask() -> None:
                answers.append((await client.complete(ASK)).message.text)

            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(ask)
    assert answers == ["in turn"] * 5
    assert fake_model.most_answering == 2


async def test_stream_asks_for_usage_and_reports_it(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="Counted.", prompt_tokens=31, completion_tokens=9)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            deltas, completion = await read_stream(client)
    assert fake_model.bodies[0]["stream_options"] == {"include_usage": True}
    assert [delta for delta in deltas if isinstance(delta, Usage)] == [Usage(31, 9, 40)]
    assert completion.usage == Usage(31, 9, 40)


def test_request_body_carries_roles_tool_calls_and_raw_arguments() -> None:
    schema = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    request = ChatRequest(
        messages=[
            Message(role="system", text="You are on call."),
            Message(role="user", text="Is the vault up?"),
            Message(role="assistant", tool_calls=[ToolCall("call_1", "search", ODD_ARGUMENTS)]),
            Message(role="tool", text="vault: 3 incidents", tool_call_id="call_1", name="search"),
            Message(role="assistant", text="It is degraded."),
        ],
        tools=[ToolSpec("search", "Search the incident log.", schema)],
        temperature=0.2,
        max_tokens=256,
    )
    assert request_body(request, model="qwen3:4b-instruct", stream=True, server="") == {
        "model": "qwen3:4b-instruct",
        "messages": [
            {"role": "system", "content": "You are on call."},
            {"role": "user", "content": "Is the vault up?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "search", "arguments": ODD_ARGUMENTS}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "vault: 3 incidents"},
            {"role": "assistant", "content": "It is degraded."},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "search", "description": "Search the incident log.", "parameters": schema}}],
        "temperature": 0.2,
        "max_tokens": 256,
    }


def test_request_body_sends_user_messages_next_to_each_other_as_one_so_that_roles_alternate() -> None:
    request = ChatRequest(
        messages=[
            Message(role="user", text="Is the vault up?"),
            Message(role="user", text="[sent while the agent was working] Check the lease too."),
            Message(role="assistant", text="It is degraded."),
            Message(role="user", text=""),
            Message(role="user", text="Why?"),
            Message(role="user", text="I am Ana.", name="ana"),
            Message(role="user", text="And I am Ben.", name="ben"),
        ]
    )
    assert request_body(request, model="m", stream=False, server="")["messages"] == [
        {"role": "user", "content": "Is the vault up?\n\n[sent while the agent was working] Check the lease too."},
        {"role": "assistant", "content": "It is degraded."},
        {"role": "user", "content": "Why?"},
        {"role": "user", "content": "I am Ana.", "name": "ana"},  # two speakers are not merged into one
        {"role": "user", "content": "And I am Ben.", "name": "ben"},
    ]
    assert [message.text for message in request.messages][:2] == ["Is the vault up?", "[sent while the agent was working] Check the lease too."]


def test_request_body_refuses_a_tool_result_that_names_no_call() -> None:
    request = ChatRequest([Message(role="user", text="hi"), Message(role="tool", text="result")])
    with pytest.raises(ValueError, match="message 1 is a tool result without a tool_call_id"):
        request_body(request, model="m", stream=False, server="")


def test_request_values_refuse_what_the_api_would_refuse() -> None:
    with pytest.raises(ValueError, match="at least one message"):
        ChatRequest([])
    with pytest.raises(ValueError, match="tool name 'read file'"):
        ToolSpec("read file", "Reads a file.")


async def test_model_sees_stored_tool_arguments_exactly_as_they_were_stored(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="ok")]
    transcript = [
        Message(role="user", text="Find it."),
        Message(role="assistant", tool_calls=[ToolCall("call_9", "read_file", ODDER_ARGUMENTS)]),
        Message(role="tool", text="found", tool_call_id="call_9"),
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            await client.complete(ChatRequest(transcript))
    sent = fake_model.bodies[0]["messages"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == ODDER_ARGUMENTS
    assert sent[2] == {"role": "tool", "tool_call_id": "call_9", "content": "found"}


async def test_rate_limit_is_retried_then_succeeds(fake_model: FakeModel) -> None:
    fake_model.script = [ErrorReply(429, retry_after="0"), Reply(text="after the limit")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            completion = await client.complete(ASK)
    assert completion.message.text == "after the limit"
    assert len(fake_model.bodies) == 2


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_server_error_is_retried_then_a_stream_succeeds(fake_model: FakeModel, status: int) -> None:
    fake_model.script = [ErrorReply(status), ErrorReply(status), Reply(text="back again")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_retries=2)) as client:
            _, completion = await read_stream(client)
    assert completion.message.text == "back again"
    assert len(fake_model.bodies) == 3


async def test_connect_error_is_retried_then_succeeds(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="connected")]
    transport = RefusesFirstConnections(refusals=2)
    with trio.fail_after(DEADLINE_S):
        async with httpx.AsyncClient(transport=transport) as http:
            completion = await ModelClient(config_for(fake_model, max_retries=2), http).complete(ASK)
    assert completion.message.text == "connected"
    assert transport.attempts == 3
    assert len(fake_model.bodies) == 1


async def test_a_model_its_server_has_no_memory_to_load_fails_at_once_saying_so_and_not_that_it_may_pass(
    fake_model: FakeModel,
) -> None:
    # Ollama answers 500 when the model does not fit in the memory its machine has free; asked
    # again a second later, it fails the same: the operator has something to change.
    said = '{"error":"model requires more system memory (5.5 GiB) than is available (3.2 GiB)"}'
    fake_model.default = ErrorReply(500, body=said)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_retries=2)) as client:
            with pytest.raises(ModelUnavailable) as raised:
                await client.complete(ASK)
    assert len(fake_model.bodies) == 1
    assert str(raised.value) == (
        "model 'qwen3:4b-instruct' is unavailable: the model server has too little memory free to load the model"
        " (HTTP 500); free memory on its machine, or choose a smaller model"
    )
    assert not raised.value.may_pass and "5.5 GiB" in raised.value.detail  # what it said: the log's


@pytest.mark.parametrize(("status", "error"), [(429, ModelRateLimited), (500, ModelUnavailable)])
async def test_retries_are_bounded_and_end_in_a_typed_error(fake_model: FakeModel, status: int, error: type[Exception]) -> None:
    fake_model.default = ErrorReply(status)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_retries=2)) as client:
            with pytest.raises(error, match="gave up after 3 attempts") as raised:
                await client.complete(ASK)
    assert len(fake_model.bodies) == 3
    assert raised.value.status == status  # type: ignore[attr-defined]  # every ModelError has a status
    assert raised.value.retryable  # type: ignore[attr-defined]  # likewise


async def test_connection_refused_ends_in_model_unavailable_after_bounded_retries() -> None:
    config = ModelConfig(base_url=closed_port_url(), max_retries=2, backoff_base_s=0.001, backoff_max_s=0.01)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config) as client:
            with pytest.raises(ModelUnavailable, match="the model server cannot be reached") as raised:
                await client.complete(ASK)
    assert raised.value.attempts == 3
    assert raised.value.retryable  # a caller that can wait longer may try again later
    # What the operator's log gets says why, once: the refusal under httpx's words, not them again.
    said = raised.value.detail.split("; from ")
    assert len(said) == 2 and said[-1].startswith("ConnectionRefusedError: ") and said[-1].endswith("Connection refused"), said


async def test_a_model_server_that_never_answers_a_connection_is_a_timeout_each_attempt_in_the_operators_words() -> None:
    # Its host off, or a firewall dropping what is sent to it: no refusal comes, each connect waits.
    with unanswered_model_url() as url:
        config = ModelConfig(base_url=url, connect_timeout_s=0.2, max_retries=1, backoff_base_s=0.001, backoff_max_s=0.01)
        with trio.fail_after(DEADLINE_S):
            async with open_model_client(config) as client:
                with pytest.raises(ModelTimeout) as raised:
                    await client.complete(ASK)
    assert str(raised.value) == (
        "model 'qwen3:4b-instruct' timed out: no connection to the model server was made within 0.2s (gave up after 2 attempts)"
    )
    assert raised.value.retryable and raised.value.may_pass
    # The log's words say what happened, not the event loop's ("Cancelled: cancelled due to deadline").
    assert "Cancelled" not in raised.value.detail and "deadline" not in raised.value.detail, raised.value.detail
    assert raised.value.detail.startswith("ConnectTimeout: the connection was not made in 0.2s: not a refusal")


async def test_a_model_server_that_never_answers_a_connection_is_tried_once_more_not_every_retry() -> None:
    # The kernel already sends the connection request again within each connect timeout: a third
    # try of a host that has not answered two only made a new task fail 16 s after it began, not 11.
    with unanswered_model_url() as url:
        config = ModelConfig(base_url=url, connect_timeout_s=0.2, max_retries=2, backoff_base_s=0.001, backoff_max_s=0.01)
        with trio.fail_after(DEADLINE_S):
            async with open_model_client(config) as client:
                with pytest.raises(ModelTimeout) as raised:
                    await client.complete(ASK)
    assert raised.value.attempts == 2, str(raised.value)
    assert raised.value.retryable  # a resumed run waiting for its model server still waits on


def _tcp_timer(remote_port: int) -> tuple[int, float]:
    """The kernel's timer on this machine's established IPv4 connection to ``remote_port`` on
    loopback (its kind: 0 none, 1 retransmission, 2 keep-alive, 4 zero window probe; and the
    seconds until it fires), as /proc/net/tcp shows it."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == remote_port and fields[3] == "01":
            kind, when = fields[5].split(":")
            return int(kind, 16), int(when, 16) / os.sysconf("SC_CLK_TCK")
    raise LookupError(f"no connection to port {remote_port}")


async def test_a_model_connection_waiting_in_silence_is_kept_alive_by_the_kernel(fake_model: FakeModel) -> None:
    # A model that sends nothing until it has loaded (Ollama, for minutes) leaves the connection
    # idle; a NAT or a firewall between the two forgets an idle connection (AWS's NAT gateways
    # after 350 s, Azure's load balancers after 4 minutes), and then neither side hears of it
    # until the timeout. TCP keep-alives keep it remembered, and find a peer that is gone.
    fake_model.default = Reply(text="loaded at last", delay_s=DEADLINE_S)
    port = int(fake_model.base_url.rsplit(":", 1)[1].split("/")[0])
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client, trio.open_nursery() as nursery:
            nursery.start_soon(client.complete, ASK)
            while not fake_model.bodies:
                await trio.sleep(0.01)
            kind, when_s = _tcp_timer(port)
            nursery.cancel_scope.cancel()
    assert kind == 2 and when_s <= 60, (kind, when_s)  # a keep-alive, well within those idle timeouts


@pytest.mark.parametrize(
    ("base_url", "looked_up", "tls"),
    [
        ("http://models.internal:8000/v1", True, False),
        ("https://models.example/v1", True, True),
        ("http://10.0.0.7:8000/v1", False, False),
        ("http://[::1]:8000/v1", False, False),
    ],
)
def test_a_connection_not_made_in_time_is_explained_by_what_its_address_could_have_met(
    base_url: str, looked_up: bool, tls: bool
) -> None:
    # httpx bounds the look-up of a host's name and a TLS handshake by the connect timeout too.
    failure = failure_to_send(ModelConfig(base_url=base_url), httpx.ConnectTimeout(""), 1, "the answer to start")
    assert failure.retry and isinstance(failure.error, ModelTimeout) and failure.error.connecting
    assert ("a DNS server that does not answer" in failure.error.detail) is looked_up, failure.error.detail
    assert ("the TLS handshake did not finish" in failure.error.detail) is tls, failure.error.detail


async def test_a_model_server_that_takes_the_request_and_never_answers_times_out_in_the_operators_words(
    fake_model: FakeModel,
) -> None:
    fake_model.default = Reply(text="too late", delay_s=DEADLINE_S)
    config = attrs.evolve(config_for(fake_model), read_timeout_s=0.2)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config) as client:
            with pytest.raises(ModelTimeout, match=r"nothing arrived within 0\.2s while waiting for the answer") as raised:
                await client.complete(ASK)
    assert raised.value.attempts == 1  # the server has the request: asking again would only add to its load
    assert "Cancelled" not in raised.value.detail and "deadline" not in raised.value.detail, raised.value.detail
    assert raised.value.detail == "ReadTimeout: the server sent no byte of the response in 0.2s", raised.value.detail


async def test_rejected_request_is_not_retried(fake_model: FakeModel) -> None:
    fake_model.default = ErrorReply(400, body='{"error": {"message": "context length exceeded"}}')
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            with pytest.raises(ModelRejected, match="HTTP 400") as raised:
                await client.complete(ASK)
    assert len(fake_model.bodies) == 1
    assert "context length exceeded" in raised.value.detail
    assert not raised.value.retryable


@pytest.mark.parametrize(
    "said",
    [
        # vLLM, and OpenAI's own (its code: context_length_exceeded)
        '{"object": "error", "message": "This model\'s maximum context length is 4096 tokens. However, you requested'
        ' 5210 tokens (4186 in the messages, 1024 in the completion).", "type": "BadRequestError", "code": 400}',
        '{"error": {"message": "Input too long.", "type": "invalid_request_error", "code": "context_length_exceeded"}}',
        # llama.cpp's server
        '{"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it",'
        ' "type": "exceed_context_size_error", "n_prompt_tokens": 5210, "n_ctx": 4096}}',
    ],
    ids=["vllm", "openai", "llama.cpp"],
)
async def test_a_conversation_longer_than_the_model_reads_is_said_to_be_so_and_what_to_do(
    fake_model: FakeModel, said: str
) -> None:
    # Every later turn of the conversation is refused the same way: the way on is a new one.
    fake_model.default = ErrorReply(400, body=said)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            with pytest.raises(ModelRejected) as raised:
                await client.complete(ASK)
    assert raised.value.reason == (
        "the conversation is longer than the model can read at once (HTTP 400); send the next message without a"
        " contextId, to start a new conversation"
    )
    assert "tokens" not in str(raised.value) and "context size" not in str(raised.value)  # the server's words stay in the log


async def test_model_missing_from_the_server_is_rejected_as_not_found(fake_model: FakeModel) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, model="mistral:7b")) as client:
            with pytest.raises(ModelRejected, match="'mistral:7b' rejected the request: the model or the endpoint") as raised:
                await client.complete(ASK)
    assert raised.value.reason == "the model or the endpoint does not exist on the server (HTTP 404)"


async def test_a_base_url_without_v1_is_hinted_at_when_the_server_has_no_such_endpoint(fake_model: FakeModel) -> None:
    # The most common slip: the server's address given without the /v1 its API is served under.
    bare = fake_model.base_url.removesuffix("/v1")
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(attrs.evolve(config_for(fake_model), base_url=bare)) as client:
            with pytest.raises(ModelRejected) as raised:
                await client.complete(ASK)
            with pytest.raises(ModelRejected) as listed:
                await client.list_models()
    for error in (raised.value, listed.value):
        assert error.reason == (
            "the model or the endpoint does not exist on the server (HTTP 404); the base URL has no path: add the /v1"
            " that OpenAI-compatible servers serve under to AGENT_MODEL_BASE_URL (or --model-base-url)"
        )
        assert bare not in str(error)
    # A base URL with a path of its own (a gateway's, say) gets no such guess.
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(attrs.evolve(config_for(fake_model), base_url=bare + "/openai")) as client:
            with pytest.raises(ModelRejected) as raised:
                await client.complete(ASK)
    assert raised.value.reason == "the model or the endpoint does not exist on the server (HTTP 404)"


async def test_a_redirect_says_what_to_change_and_the_log_says_where_it_leads(fake_model: FakeModel) -> None:
    # http:// given for a server that redirects to https:// was "the server answered HTTP 301",
    # and the log said no more.
    fake_model.default = ErrorReply(301, body="Moved", location="https://models.example/v1/chat/completions?key=k-secret-1")
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            with pytest.raises(ModelBadResponse) as raised:
                await client.complete(ASK)
    assert raised.value.reason == (
        "the server answered HTTP 301, a redirect: give AGENT_MODEL_BASE_URL (or --model-base-url) the address it leads"
        " to, which the log names"
    )
    assert raised.value.detail == "it redirects to https://models.example/v1/chat/completions?key=***; HTTP 301: Moved"
    assert "models.example" not in str(raised.value)


async def test_rate_limit_asking_for_a_longer_wait_than_the_backoff_cap_is_not_waited_for(fake_model: FakeModel) -> None:
    fake_model.default = ErrorReply(429, retry_after="3600")
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            with pytest.raises(ModelRateLimited, match="asked to wait 3600s") as raised:
                await client.complete(ASK)
    assert raised.value.retry_after_s == 3600
    assert len(fake_model.bodies) == 1


async def test_rate_limit_asking_to_wait_until_a_date_past_the_backoff_cap_is_not_waited_for(fake_model: FakeModel) -> None:
    fake_model.default = ErrorReply(429, retry_after="Wed, 21 Oct 2099 07:28:00 GMT")
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            with pytest.raises(ModelRateLimited, match="asked to wait") as raised:
                await client.complete(ASK)
    assert raised.value.retry_after_s is not None and raised.value.retry_after_s > 3600 * 24 * 365
    assert len(fake_model.bodies) == 1


async def test_rate_limit_asking_to_wait_until_a_date_gone_by_is_retried(fake_model: FakeModel) -> None:
    fake_model.script = [ErrorReply(429, retry_after="Sun, 06 Nov 1994 08:49:37 GMT"), Reply(text="after the limit")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            assert (await client.complete(ASK)).message.text == "after the limit"
    assert len(fake_model.bodies) == 2


async def test_rate_limit_asking_to_wait_until_a_date_is_read_by_the_model_servers_clock_not_this_machines(
    fake_model: FakeModel,
) -> None:
    # This machine's clock is an hour behind the model server's (a VM resumed from suspend, say):
    # the date it asks to wait until is now by its own clock, as its Date header says.
    fake_model.clock_ahead_s = 3600
    now_there = email.utils.formatdate(time.time() + 3600, usegmt=True)
    fake_model.script = [ErrorReply(429, retry_after=now_there), Reply(text="after the limit")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            assert (await client.complete(ASK)).message.text == "after the limit"
    assert len(fake_model.bodies) == 2


async def test_stream_is_never_retried_after_its_first_byte(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="half an answer, then silence", chunk_chars=4, fail_after_chunks=3), Reply(text="a second answer")]
    received: list[Delta] = []
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_retries=5)) as client:
            with pytest.raises(ModelUnavailable, match="in the middle of the answer"):
                async with client.stream(ASK) as chunks:
                    async for delta in chunks:
                        received.append(delta)
    assert received == [TextDelta("half"), TextDelta(" an ")]
    assert len(fake_model.bodies) == 1
    assert chunks.partial_message() == Message(role="assistant", text="half an ", partial=True)


async def test_answer_cut_short_without_streaming_is_not_retried(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="never whole", fail_after_chunks=0), Reply(text="a second answer")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_retries=5)) as client:
            with pytest.raises(ModelUnavailable, match="in the middle of the answer"):
                await client.complete(ASK)
    assert len(fake_model.bodies) == 1


async def test_error_messages_never_show_the_key_the_url_or_the_server_text(fake_model: FakeModel) -> None:
    key = "sk-keel-secret-4471"
    fake_model.api_key = key
    port = fake_model.base_url.rsplit(":", 1)[1].split("/")[0]
    fake_model.script = [ErrorReply(500, body="database password hunter2 rejected")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, api_key=key, max_retries=0)) as client:
            with pytest.raises(ModelUnavailable) as server_error:
                await client.complete(ASK)
        wrong = "sk-wrong-key-0001"
        async with open_model_client(config_for(fake_model, api_key=wrong)) as client:
            with pytest.raises(ModelRejected, match="the API key was refused") as key_error:
                await client.complete(ASK)
    assert "hunter2" in server_error.value.detail
    assert "Incorrect API key provided: [api key]" in key_error.value.detail
    for error, secret in ((server_error.value, key), (key_error.value, wrong)):
        message = str(error)
        for leak in (secret, "hunter2", "Incorrect API key", port, "127.0.0.1"):
            assert leak not in message
        assert secret not in error.detail
    assert key not in repr(config_for(fake_model, api_key=key))


async def test_bearer_key_is_sent_with_every_request(fake_model: FakeModel) -> None:
    fake_model.api_key = "sk-keel-secret-4471"
    fake_model.script = [Reply(text="authorised")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, api_key="sk-keel-secret-4471")) as client:
            assert (await client.complete(ASK)).message.text == "authorised"
            assert await client.has_model()
    assert {item.headers["authorization"] for item in fake_model.received} == {"Bearer sk-keel-secret-4471"}


async def test_has_model_answers_from_the_catalog(fake_model: FakeModel) -> None:
    fake_model.models = ("qwen3:4b-instruct", "nomic-embed-text:latest")
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            assert await client.list_models() == ("qwen3:4b-instruct", "nomic-embed-text:latest")
            assert await client.has_model() is True
            assert await client.has_model("nomic-embed-text") is True
            assert await client.has_model("mistral:7b") is False
    assert fake_model.bodies == []  # a readiness check runs no inference


async def test_has_model_raises_when_the_server_cannot_be_reached() -> None:
    config = ModelConfig(base_url=closed_port_url(), max_retries=0)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config) as client:
            with pytest.raises(ModelUnavailable, match="the model server cannot be reached"):
                await client.has_model()


async def test_cancelling_mid_stream_closes_the_connection_promptly(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="The lease", chunk_chars=32, hang_after_chunks=2)]
    got_text = trio.Event()
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            async with trio.open_nursery() as nursery:

                async def read() -> None:
                    async with client.stream(ASK) as chunks:
                        async for delta in chunks:
                            if isinstance(delta, TextDelta):
                                got_text.set()
                    pytest.fail("the stream ended although the model never finished")

                nursery.start_soon(read)
                await got_text.wait()
                await trio.testing.wait_all_tasks_blocked()  # the reader is blocked on the socket
                cancelled_at = trio.current_time()
                nursery.cancel_scope.cancel()
            assert trio.current_time() - cancelled_at < 1.0
            await fake_model.wait_disconnected()


async def test_leaving_a_stream_early_closes_the_connection_without_waiting_for_the_model(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="The lease", chunk_chars=32, hang_after_chunks=2)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            async with client.stream(ASK) as chunks:
                async for delta in chunks:
                    if isinstance(delta, TextDelta):
                        left_at = trio.current_time()
                        break
            assert trio.current_time() - left_at < 1.0
            await fake_model.wait_disconnected()
    assert chunks.partial_message() == Message(role="assistant", text="The lease", partial=True)


async def test_slow_answer_times_out_and_is_not_retried(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="too late", delay_s=60), Reply(text="a second answer")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, read_timeout_s=0.2)) as client:
            with pytest.raises(ModelTimeout, match="within 0.2s while waiting for the answer to start"):
                await client.complete(ASK)
    assert len(fake_model.bodies) == 1


async def timed_out_stream(fake_model: FakeModel, read_timeout_s: float) -> tuple[list[Delta], ModelTimeout]:
    """Read one streamed answer with the read timeout given, until it times out: what arrived
    before, and the timeout."""
    received: list[Delta] = []
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, read_timeout_s=read_timeout_s)) as client:
            with pytest.raises(ModelTimeout) as caught:
                async with client.stream(ASK) as chunks:
                    async for delta in chunks:
                        received.append(delta)
    return received, caught.value


async def test_stream_that_stalls_mid_answer_times_out(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="The lease", chunk_chars=32, hang_after_chunks=2), Reply(text="a second answer")]
    received: list[Delta] = []
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, read_timeout_s=0.2)) as client:
            with pytest.raises(ModelTimeout, match="the rest of the answer"):
                async with client.stream(ASK) as chunks:
                    async for delta in chunks:
                        received.append(delta)
    assert received == [TextDelta("The lease")]
    assert len(fake_model.bodies) == 1


async def test_stream_that_sends_only_keep_alive_comments_times_out_all_the_same(fake_model: FakeModel) -> None:
    # Bytes keep arriving, so no read waits long; no data does, which is what the bound is about.
    fake_model.script = [Reply(text="The lease", chunk_chars=32, hang_after_chunks=2, keepalive_s=0.02)]
    received: list[Delta] = []
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, read_timeout_s=0.3)) as client:
            with pytest.raises(ModelTimeout, match=r"nothing arrived within 0.3s while waiting for the rest of the answer") as caught:
                async with client.stream(ASK) as chunks:
                    async for delta in chunks:
                        received.append(delta)
            await trio.testing.wait_all_tasks_blocked()
    assert caught.value.detail == (
        "none of the answer arrived in that time, keep-alive comments or chunks holding none of it at most"
    )
    assert received == [TextDelta("The lease")]
    assert fake_model.disconnects == 1  # the connection was closed, not left to the server


EMPTY_CHUNKS = {
    # The opening chunk again and again, as a server stuck before its first token can send it.
    "empty content": '{"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": ""}}]}',
    "no choices": '{"id": "c", "object": "chat.completion.chunk", "choices": []}',
    # Usage on every chunk (vLLM's continuous usage stats), and nothing else.
    "usage alone": '{"id": "c", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 0, "total_tokens": 12}}',
    "another choice": '{"id": "c", "choices": [{"index": 1, "delta": {"content": "x"}}]}',  # n=1 was asked for
}


@pytest.mark.parametrize("chunk", EMPTY_CHUNKS.values(), ids=EMPTY_CHUNKS.keys())
@pytest.mark.parametrize(("hang_after", "waiting_for"), [(1, "the answer to start"), (2, "the rest of the answer")])
async def test_a_stream_of_chunks_holding_none_of_the_answer_times_out_as_keep_alives_do(
    fake_model: FakeModel, chunk: str, hang_after: int, waiting_for: str
) -> None:
    # Data keeps coming, but none of the answer does: the model has sent nothing, for as long as it likes.
    heartbeat = f"data: {chunk}"
    fake_model.script = [
        Reply(text="The lease", chunk_chars=32, hang_after_chunks=hang_after, keepalive_s=0.02, keepalive_event=heartbeat)
    ]
    received, timeout = await timed_out_stream(fake_model, 0.3)
    assert str(timeout) == f"model 'qwen3:4b-instruct' timed out: nothing arrived within 0.3s while waiting for {waiting_for}"
    assert received == ([TextDelta("The lease")] if hang_after == 2 else [])


@pytest.mark.parametrize(
    ("reply", "waiting_for"),
    [
        # The opening chunk (it only names the role), then keep-alive comments or silence: none of the answer.
        (Reply(text="The lease", hang_after_chunks=1, keepalive_s=0.02), "the answer to start"),
        (Reply(text="The lease", gap_s=60), "the answer to start"),
        # Some text or a piece of a tool call, then the same: the answer stopped midway.
        (Reply(text="The lease", chunk_chars=32, hang_after_chunks=2, keepalive_s=0.02), "the rest of the answer"),
        (Reply(text="The lease", chunk_chars=32, hang_after_chunks=2), "the rest of the answer"),
        (Reply(tool_calls=[Call("lookup", '{"service": "vault"}')], hang_after_chunks=3), "the rest of the answer"),
    ],
    ids=["keep-alives before", "silence before", "keep-alives midway", "silence midway", "a tool call midway"],
)
async def test_a_stream_that_times_out_says_whether_any_of_the_answer_had_arrived(
    fake_model: FakeModel, reply: Reply, waiting_for: str
) -> None:
    fake_model.script = [reply]
    received, timeout = await timed_out_stream(fake_model, 0.3)
    assert str(timeout) == f"model 'qwen3:4b-instruct' timed out: nothing arrived within 0.3s while waiting for {waiting_for}"
    assert bool(received) == (waiting_for == "the rest of the answer")


@pytest.mark.parametrize(
    ("body", "then", "error", "said"),
    [
        (b"", b"", ModelTimeout, "nothing arrived within 0.3s while waiting for the answer to start"),
        (b'{"choices": [', b"", ModelTimeout, "nothing arrived within 0.3s while waiting for the rest of the answer"),
        (b"\n", b"\n", ModelTimeout, "nothing arrived within 0.3s while waiting for the answer to start"),
        (b'{"choices": [', b"\n", ModelTimeout, "nothing arrived within 0.3s while waiting for the rest of the answer"),
        (b"", None, ModelUnavailable, "the connection broke before the answer started"),
        (b'{"choices": [', None, ModelUnavailable, "the connection broke in the middle of the answer"),
    ],
    ids=["silence", "silence midway", "whitespace", "whitespace midway", "closed", "closed midway"],
)
async def test_a_whole_answer_that_stops_says_whether_any_of_it_had_arrived(
    nursery: trio.Nursery, body: bytes, then: bytes | None, error: type[ModelError], said: str
) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"

    async def handle(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        try:
            await stream.send_all(head + body)
            while then is not None:  # None: the server closes the connection, the body unfinished
                if then:
                    await stream.send_all(then)
                await trio.sleep(0.02)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client gave up

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1"
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0, read_timeout_s=0.3)) as client:
            with pytest.raises(error) as caught:
                await client.complete(ASK)
    assert caught.value.reason == said


async def test_a_server_that_will_not_stream_is_read_as_one_answer_all_the_same(fake_model: FakeModel) -> None:
    # Asked to stream, some servers and proxies answer in one JSON body; the answer is as good.
    fake_model.script = [Reply(text="The lease", tool_calls=[Call("lookup", '{"service": "vault"}')], ignore_stream=True)]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            async with client.stream(ASK) as chunks:
                received = [delta async for delta in chunks]
            completion = chunks.completion()
    call = ToolCall(id="call_1_0", name="lookup", arguments='{"service": "vault"}')  # the fake numbers its requests from 1
    assert received == [TextDelta("The lease"), call, Finish("tool_calls"), Usage(12, 8, 20)]
    assert completion.message == Message(role="assistant", text="The lease", tool_calls=(call,))
    assert chunks.partial_message() == completion.message
    assert fake_model.bodies[0]["stream"] is True


async def test_stream_is_read_once(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="once")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            stream = client.stream(ASK)
            async with stream as chunks:
                assert [delta async for delta in chunks][0] == TextDelta("once")
            with pytest.raises(RuntimeError, match="read once"):
                async with stream:
                    pass


def sse(*events: object) -> list[str]:
    lines = []
    for event in events:
        lines += [f"data: {event if isinstance(event, str) else json.dumps(event)}", ""]
    return lines


def tool_fragment(index: int, arguments: str, *, name: str = "") -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name:
        call.update(id=f"call_{name}", type="function")
        call["function"]["name"] = name
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}


@settings(deadline=None)  # pure CPU; a slow CI machine is not a failure
@given(arguments=st.text(), cuts=st.lists(st.integers(min_value=0, max_value=200)))
def test_assembler_keeps_arguments_byte_for_byte_however_they_are_split(arguments: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(arguments), *(cut for cut in cuts if cut < len(arguments))})
    pieces = [arguments[start:end] for start, end in zip(bounds, bounds[1:])]
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    events = [tool_fragment(0, "", name="search"), *(tool_fragment(0, piece) for piece in pieces), finish, "[DONE]"]
    assembler = StreamAssembler("m")
    for line in sse(*events):
        assembler.feed_line(line)
    assert assembler.done
    assert assembler.completion().message.tool_calls == (ToolCall("call_search", "search", arguments),)


def test_assembler_refuses_a_stream_that_ends_before_the_model_finished() -> None:
    assembler = StreamAssembler("m")
    for line in sse({"choices": [{"index": 0, "delta": {"content": "half"}}]}):
        assembler.feed_line(line)
    with pytest.raises(ModelUnavailable, match="ended before the model finished") as raised:
        assembler.end_of_stream()
    assert raised.value.may_pass
    assert assembler.partial_message() == Message(role="assistant", text="half", partial=True)


def test_assembler_reports_an_error_event_without_repeating_its_text() -> None:
    assembler = StreamAssembler("m")
    with pytest.raises(ModelUnavailable) as raised:
        for line in sse({"error": {"message": "CUDA out of memory at 0x7f00"}}):
            assembler.feed_line(line)
    assert "CUDA" not in str(raised.value)
    assert "CUDA out of memory" in raised.value.detail


async def test_fake_model_runs_standalone_and_answers_every_request(nursery: trio.Nursery) -> None:
    command = [sys.executable, str(ROOT / "scripts/dev/fake_model.py"), "--port", "0", "--reply", "standing by", "--gap-s", "0"]
    with trio.fail_after(DEADLINE_S):
        process = await nursery.start(lambda task_status: trio.run_process(command, stdout=subprocess.PIPE, task_status=task_status))
        banner = b""
        while not banner.endswith(b"\n"):
            chunk = await process.stdout.receive_some()
            assert chunk, "the fake model exited before printing its URL"
            banner += chunk
        base_url = banner.decode().split("serving ", 1)[1].split()[0]
        async with open_model_client(ModelConfig(base_url=base_url)) as client:
            first = await client.complete(ASK)
            _, second = await read_stream(client)
    assert first.message.text == second.message.text == "standing by"


async def test_a_base_url_with_a_query_keeps_it_and_still_reaches_each_path(fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="Routed.")]
    config = attrs.evolve(config_for(fake_model), base_url=f"{fake_model.base_url}?api-version=2024-06-01")
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config) as client:
            assert await client.has_model()
            _, completion = await read_stream(client)
    assert completion.message.text == "Routed."
    assert [(r.method, r.path) for r in fake_model.received] == [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]


async def serve_raw(nursery: trio.Nursery, answer: bytes, then: bytes = b"", every_s: float = 0.01) -> str:
    """A misbehaving model server: to any request, ``answer`` (a status line and headers, and
    maybe a body), then ``then`` over and over, every ``every_s``, until the client leaves; with
    no ``then``, nothing more, the connection held open."""

    async def handle(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        try:
            await stream.send_all(answer)
            if not then:
                await trio.sleep_forever()
            while True:
                await stream.send_all(then)
                await trio.sleep(every_s)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1"


async def test_an_error_body_without_end_is_read_only_as_far_as_the_log_keeps(nursery: trio.Nursery) -> None:
    url = await serve_raw(nursery, b"HTTP/1.1 500 Oops\r\ncontent-type: text/html\r\ntransfer-encoding: chunked\r\n\r\n", b"400\r\n" + b"x" * 1024 + b"\r\n")
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0)) as client:
            with pytest.raises(ModelUnavailable) as raised:
                await read_stream(client)
    assert raised.value.status == 500 and len(raised.value.detail) < 2100


async def test_an_error_body_that_stalls_is_still_the_error_its_status_says(nursery: trio.Nursery) -> None:
    url = await serve_raw(nursery, b"HTTP/1.1 503 Busy\r\ncontent-type: text/plain\r\ncontent-length: 100\r\n\r\n")
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0, read_timeout_s=0.3)) as client:
            with pytest.raises(ModelUnavailable, match="HTTP 503") as raised:
                await read_stream(client)
    assert "did not end within 0.3 s" in raised.value.detail


@pytest.mark.parametrize("kept_alive_s", [0.6, None])
async def test_a_whole_answer_kept_alive_with_whitespace_is_read_if_it_comes_within_the_timeout(
    nursery: trio.Nursery, kept_alive_s: float | None
) -> None:
    # As some gateways do for a slow answer that is not streamed. Whitespace is not the answer:
    # like keep-alive comments in a stream, it does not hold the call open past the timeout.
    answer = json.dumps({"choices": [{"message": {"content": "late but whole"}, "finish_reason": "stop"}]}).encode()

    async def handle(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            with trio.move_on_after(kept_alive_s if kept_alive_s is not None else math.inf):
                while True:
                    await stream.send_all(b"1\r\n\n\r\n")
                    await trio.sleep(0.1)
            await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(answer), answer))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client gave up, as it should when only whitespace comes

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1"
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0, read_timeout_s=1.0)) as client:
            if kept_alive_s is not None:
                assert (await client.complete(ASK)).message.text == "late but whole"
            else:
                with pytest.raises(ModelTimeout, match="within 1s while waiting for the answer to start"):
                    await client.complete(ASK)


async def test_a_streamed_line_past_the_limit_is_a_bad_response_not_a_growing_buffer(
    fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("runtime.models.client.MAX_LINE_CHARS", 1000)
    fake_model.script = [Reply(text="y" * 5000, chunk_chars=5000)]  # one event, one 5 kB line
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_retries=0)) as client:
            with pytest.raises(ModelBadResponse, match="longer than 1000 characters"):
                await read_stream(client)


async def test_a_stream_whose_events_never_end_is_a_bad_response_not_a_growing_buffer(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each chunk on a line of its own, with no blank line between them: by the SSE rules one event
    # that never ends, so no piece of the answer is ever read, and a model that would not stop is
    # not stopped by the answer's size. The event is held to the limit of a line.
    monkeypatch.setattr("runtime.models.client.MAX_LINE_CHARS", 1000)
    chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": "and on "}}]}).encode()
    url = await serve_raw(
        nursery, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n", b"data: " + chunk + b"\n"
    )
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0)) as client:
            with pytest.raises(ModelBadResponse, match="a stream event is longer than 1000 characters"):
                await read_stream(client)


def assembled(*events: object) -> StreamAssembler:
    assembler = StreamAssembler("m")
    for line in sse(*events):
        assembler.feed_line(line)
    return assembler


def delta(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


FINISHED = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}


def test_whole_calls_without_an_index_sent_one_a_chunk_stay_apart() -> None:
    def whole(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return delta(tool_calls=[{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}])

    done = assembled(whole("a", "f", '{"x":1}'), whole("b", "g", '{"y":2}'), FINISHED, "[DONE]")
    assert done.completion().message.tool_calls == (ToolCall("a", "f", '{"x":1}'), ToolCall("b", "g", '{"y":2}'))
    # With no id either, the first of a chunk goes on with the last call, the others open new ones.
    two = delta(tool_calls=[{"function": {"name": "f", "arguments": "{"}}, {"function": {"name": "g", "arguments": "{}"}}])
    rest = delta(tool_calls=[{"function": {"arguments": "}"}}])
    calls = assembled(two, rest, FINISHED, "[DONE]").completion().message.tool_calls
    assert [(call.name, call.arguments) for call in calls] == [("f", "{"), ("g", "{}}")]


@pytest.mark.parametrize(
    ("event", "said"),
    [
        ({"choices": 5}, "choices are not a list"),
        (delta(tool_calls=7), "tool calls are not a list"),
        ("[" * 100_000, "not JSON"),  # deeper than Python's JSON reader goes
    ],
)
def test_a_chunk_of_the_wrong_shape_is_a_bad_response(event: object, said: str) -> None:
    with pytest.raises(ModelBadResponse, match=said):
        assembled(event)


def test_a_nameless_tool_call_is_named_by_its_place_not_by_the_servers_id() -> None:
    nameless = delta(tool_calls=[{"index": 0, "id": "see https://internal.example/secret", "function": {"arguments": "{}"}}])
    with pytest.raises(ModelBadResponse) as raised:
        assembled(nameless, FINISHED)
    assert "tool call 0 has no name" in str(raised.value) and "internal.example" not in str(raised.value)


def test_a_tool_call_fragment_after_the_finish_is_a_bad_response() -> None:
    with pytest.raises(ModelBadResponse, match="after the model had finished"):
        assembled(tool_fragment(0, "{", name="f"), FINISHED, tool_fragment(0, "}"))


async def test_what_a_server_says_mid_stream_is_kept_for_the_log_without_the_key(nursery: trio.Nursery) -> None:
    said = b'data: {"error": {"message": "key sk-secret-1 is over its quota"}}\n\n'
    url = await serve_raw(nursery, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + said)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, api_key="sk-secret-1", max_retries=0)) as client:
            with pytest.raises(ModelUnavailable) as raised:
                await read_stream(client)
    assert "over its quota" in raised.value.detail and "sk-secret-1" not in raised.value.detail
    assert "quota" not in str(raised.value)


LONG_KEY = "sk-keel-secret-4471-abcdefghijklmnop"


def what_a_server_said_across_the_cut(prefix: str) -> str:
    """A server's text that repeats the key where the part kept for the log ends (2000 characters)."""
    return "x" * (1990 - len(prefix)) + f" key {LONG_KEY} is over its quota"


async def test_a_key_a_server_repeats_where_the_kept_part_of_its_error_body_ends_is_masked(fake_model: FakeModel) -> None:
    fake_model.script = [ErrorReply(500, body=what_a_server_said_across_the_cut("HTTP 500: "))]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, api_key=LONG_KEY, max_retries=0)) as client:
            with pytest.raises(ModelUnavailable) as raised:
                await client.complete(ASK)
    assert raised.value.detail.startswith("HTTP 500: xxx") and "sk-" not in raised.value.detail


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_key_a_server_repeats_where_the_kept_part_of_a_body_that_is_not_json_ends_is_masked(
    nursery: trio.Nursery, streamed: bool
) -> None:
    said = what_a_server_said_across_the_cut("")
    if streamed:
        head, body = b"content-type: text/event-stream", f"data: {said}\n\n".encode()
    else:
        head, body = b"content-type: application/json\r\ncontent-length: %d" % len(said), said.encode()
    url = await serve_raw(nursery, b"HTTP/1.1 200 OK\r\n" + head + b"\r\nconnection: close\r\n\r\n" + body)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, api_key=LONG_KEY, max_retries=0)) as client:
            with pytest.raises(ModelBadResponse, match="not JSON") as raised:
                await (read_stream(client) if streamed else client.complete(ASK))
    assert raised.value.detail.startswith("xxx") and "sk-" not in raised.value.detail


async def test_a_key_a_server_repeats_where_the_kept_part_of_its_error_event_ends_is_masked(nursery: trio.Nursery) -> None:
    event = json.dumps({"error": {"message": what_a_server_said_across_the_cut('{"message": "')}})
    url = await serve_raw(
        nursery, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: " + event.encode() + b"\n\n"
    )
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, api_key=LONG_KEY, max_retries=0)) as client:
            with pytest.raises(ModelUnavailable, match="reported an error") as raised:
                await read_stream(client)
    assert raised.value.detail.startswith('{"message": "xxx') and "sk-" not in raised.value.detail


async def test_https_to_a_server_that_speaks_plain_http_says_so_and_is_not_retried(fake_model: FakeModel) -> None:
    url = fake_model.base_url.replace("http://", "https://")
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=3, backoff_base_s=5.0)) as client:
            with pytest.raises(ModelUnavailable) as raised:
                await client.complete(ASK)
    assert raised.value.reason == "it does not speak TLS at that address; check http:// or https:// in AGENT_MODEL_BASE_URL"
    assert raised.value.attempts == 1
    assert "SSLError" in raised.value.detail and "WRONG_VERSION_NUMBER" in raised.value.detail  # for the log


async def test_a_catalog_that_never_comes_is_a_timeout_waiting_for_the_catalog(nursery: trio.Nursery) -> None:
    url = await serve_raw(nursery, b"")  # takes the request, answers nothing
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, read_timeout_s=0.2)) as client:
            with pytest.raises(ModelTimeout, match="nothing arrived within 0.2s while waiting for the catalog"):
                await client.has_model()


def test_the_endpoint_a_log_or_an_operator_is_shown_has_no_credentials_or_query() -> None:
    assert ModelConfig(base_url="https://bob:pa55w0rd@models.example:8443/v1?key=q-1").endpoint == "https://models.example:8443/v1"
    assert ModelConfig(base_url="http://[::1]:11434/v1").endpoint == "http://[::1]:11434/v1"


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/v1", "http://127.0.0.1:abc/v1", "http://127.0.0.1:-1/v1", "http://127.0.0.1:0/v1"])
def test_a_model_config_refuses_a_base_url_whose_port_is_no_port(url: str) -> None:
    with pytest.raises(ValueError, match="port must be a whole number from 1 to 65535"):
        ModelConfig(base_url=url)


def test_a_model_config_refuses_url_credentials_beside_an_api_key_and_never_shows_them() -> None:
    with pytest.raises(ValueError, match="carries credentials") as refused:
        ModelConfig(base_url="http://bob:pa55w0rd@127.0.0.1:8000/v1", api_key="sk-RIGHTKEY")
    assert "pa55w0rd" not in str(refused.value) and "sk-RIGHTKEY" not in str(refused.value)
    config = ModelConfig(base_url="http://bob:pa55w0rd@127.0.0.1:8000/v1?key=q-secret")
    assert "pa55w0rd" not in repr(config) and "q-secret" not in repr(config)


async def test_url_credentials_without_an_api_key_go_as_basic_auth_and_are_never_kept_in_what_a_server_said(
    fake_model: FakeModel,
) -> None:
    # As a gateway that takes basic auth is reached; one that refuses them may say them back.
    url = fake_model.base_url.replace("http://", "http://bob:pa55w0rd@")
    fake_model.script = [
        Reply(text="through the gateway"),
        ErrorReply(401, body="user bob:pa55w0rd refused: the password pa55w0rd has expired"),
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0)) as client:
            assert (await client.complete(ASK)).message.text == "through the gateway"
            with pytest.raises(ModelRejected) as said_plainly:
                await client.complete(ASK)
            fake_model.api_key = "sk-RIGHTKEY"  # now it wants a key, and repeats what it got instead
            with pytest.raises(ModelRejected, match=r"the credentials in the base URL were refused \(HTTP 401\)") as said_encoded:
                await client.has_model()
    assert fake_model.received[0].headers["authorization"] == "Basic Ym9iOnBhNTV3MHJk"  # base64 of bob:pa55w0rd
    assert said_plainly.value.detail.endswith("user [credentials] refused: the password [credentials] has expired")
    assert "Incorrect API key provided: Basic [credentials]" in said_encoded.value.detail
    for error in (said_plainly.value, said_encoded.value):
        for leak in ("pa55w0rd", "Ym9iOnBhNTV3MHJk"):
            assert leak not in error.detail and leak not in str(error)


async def test_a_server_that_wants_a_key_none_was_given_says_so(fake_model: FakeModel) -> None:
    fake_model.api_key = "sk-RIGHTKEY"
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=fake_model.base_url, max_retries=0)) as client:
            with pytest.raises(ModelRejected) as refused:
                await client.complete(ASK)
    assert refused.value.reason == "the server wants an API key, and none was given (HTTP 401)"


@pytest.mark.parametrize(
    ("url", "said", "kept"),
    [
        # Written percent-encoded, sent decoded: either may come back.
        ("http://bob:pa%2455@models.example/v1", "bad pa%2455 / pa$55 / Basic Ym9iOnBhJDU1", "bad [credentials] / [credentials] / Basic [credentials]"),
        # A key given as the user name is the secret itself.
        ("https://sk-live-abc123@models.example/v1", "key sk-live-abc123 (c2stbGl2ZS1hYmMxMjM6) refused", "key [credentials] ([credentials]) refused"),
        # A token may come back with its padding or without.
        ("http://bob:pwd1@models.example/v1", "token Ym9iOnB3ZDE= or Ym9iOnB3ZDE", "token [credentials] or [credentials]"),
        # With a password, the user name alone is not a secret, and is left as it is.
        ("http://bob:pa55w0rd@models.example/v1", "bob is locked out; Basic Ym9iOnBhNTV3MHJk", "bob is locked out; Basic [credentials]"),
    ],
    ids=["percent-encoded", "a key as the user name", "a token without its padding", "a user name beside a password"],
)
def test_what_a_server_says_is_scrubbed_of_the_url_credentials_in_each_form(url: str, said: str, kept: str) -> None:
    assert ModelConfig(base_url=url).scrub(said) == kept


def sse_bytes(*events: object) -> bytes:
    """``events`` as one chunk of a chunked body, in server-sent events framing."""
    text = "".join(f"{line}\n" for line in sse(*events)).encode()
    return b"%x\r\n%s\r\n" % (len(text), text)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
STOPPED = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}


async def serve_then_close(nursery: trio.Nursery, answer: bytes) -> str:
    """A model server that sends ``answer`` to any request, then closes the connection."""

    async def handle(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        await stream.send_all(answer)
        await stream.aclose()

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1"


async def test_an_answer_the_model_finished_is_kept_when_the_connection_breaks_before_the_body_ends(
    nursery: trio.Nursery,
) -> None:
    # A proxy that closes the connection once the model has said it finished, before [DONE] and
    # before the body's last chunk: the answer is whole; only the end of the body was lost.
    finished = await serve_then_close(nursery, STREAM_HEAD + sse_bytes(delta(content="The lease expired."), STOPPED))
    # ... or in the middle of the event after the finish (the usage, say): a fragment, dropped.
    fragment = b'data: {"choices":[],"usage":{"prompt_tok'
    mid_event = await serve_then_close(
        nursery, STREAM_HEAD + sse_bytes(delta(content="The lease expired."), STOPPED) + b"%x\r\n%s\r\n" % (len(fragment), fragment)
    )
    unfinished = await serve_then_close(nursery, STREAM_HEAD + sse_bytes(delta(content="The lease")))
    with trio.fail_after(DEADLINE_S):
        for url in (finished, mid_event):
            async with open_model_client(ModelConfig(base_url=url, max_retries=0)) as client:
                _, completion = await read_stream(client)
            assert (completion.message.text, completion.finish_reason) == ("The lease expired.", "stop")
        async with open_model_client(ModelConfig(base_url=unfinished, max_retries=0)) as client:
            with pytest.raises(ModelUnavailable, match="broke"):  # before the finish, the same break is a broken answer
                await read_stream(client)


async def test_a_body_held_open_after_done_does_not_hold_up_the_answer(nursery: trio.Nursery) -> None:
    url = await serve_raw(nursery, STREAM_HEAD + sse_bytes(delta(content="Standing by."), STOPPED, "[DONE]"))
    with trio.fail_after(AFTER_DONE_S + 5):  # far less than the read timeout it once waited out
        async with open_model_client(ModelConfig(base_url=url, max_retries=0, read_timeout_s=60)) as client:
            _, completion = await read_stream(client)
    assert completion.message.text == "Standing by."


async def test_an_answer_the_model_finished_is_kept_when_the_body_then_stays_open_without_done(nursery: trio.Nursery) -> None:
    # A server that sends the finish and the usage but neither [DONE] nor the end of the body:
    # the wait for what follows runs out, and the answer it had finished is kept, as when the
    # connection breaks there, rather than failed as a model that stopped answering.
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
    url = await serve_raw(nursery, STREAM_HEAD + sse_bytes(delta(content="Standing by."), STOPPED, usage))
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0, read_timeout_s=0.3)) as client:
            deltas, completion = await read_stream(client)
    assert (completion.message.text, completion.finish_reason, completion.usage) == ("Standing by.", "stop", Usage(7, 3, 10))
    assert deltas[-1] == Usage(7, 3, 10)


async def test_an_error_a_server_answers_200_in_place_of_an_answer_is_named_and_kept_for_the_log(nursery: trio.Nursery) -> None:
    # Some proxies and gateways answer an upstream failure with HTTP 200 and an error object, in
    # one JSON body whether the answer was asked for streamed or not. What it says is the log's,
    # as for an error event in the middle of a stream; the client is told only that it was one.
    said = json.dumps({"error": {"message": f"key {LONG_KEY} is over its quota", "type": "insufficient_quota"}}).encode()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(said)
    urls = [await serve_then_close(nursery, head + said) for _ in range(2)]
    raised = []
    with trio.fail_after(DEADLINE_S):
        for url, call in zip(urls, ("stream", "complete")):
            async with open_model_client(ModelConfig(base_url=url, api_key=LONG_KEY, max_retries=0)) as client:
                with pytest.raises(ModelBadResponse) as caught:
                    await (read_stream(client) if call == "stream" else client.complete(ASK))
            raised.append(caught.value)
    for error in raised:
        assert error.reason == "the server reported an error instead of an answer"
        assert "over its quota" in error.detail and "insufficient_quota" in error.detail
        assert LONG_KEY not in error.detail and "[api key]" in error.detail
        assert "quota" not in str(error)


async def test_a_stream_of_heartbeat_events_with_empty_data_times_out_as_keep_alive_comments_do(nursery: trio.Nursery) -> None:
    # A proxy's heartbeat may be an event whose data is empty rather than a comment: it carries
    # nothing of the answer either, and does not hold the call open past the model's timeout.
    heartbeat = b"data:\n\ndata: \n\n"
    url = await serve_raw(nursery, STREAM_HEAD, then=b"%x\r\n%s\r\n" % (len(heartbeat), heartbeat), every_s=0.02)
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0, read_timeout_s=0.3)) as client:
            with pytest.raises(ModelTimeout, match=r"nothing arrived within 0.3s while waiting for the answer to start"):
                await read_stream(client)


def test_an_event_with_empty_data_is_not_dispatched() -> None:
    assembler = StreamAssembler("m")  # a proxy's heartbeat: an event whose data is empty
    for line in ["data: ", "", "data:", "", *sse(delta(content="ok"), STOPPED, "[DONE]")]:
        assembler.feed_line(line)
    assert assembler.completion().message.text == "ok"


def test_usage_sent_with_every_chunk_is_counted_once_as_it_stands_at_the_end() -> None:
    # vLLM's continuous usage stats: each chunk carries the usage so far.
    events = [
        {**delta(content="The "), "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}},
        {**delta(content="lease."), "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}},
        {**STOPPED, "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}},
        "[DONE]",
    ]
    assembler = StreamAssembler("m")
    deltas = [d for line in sse(*events) for d in assembler.feed_line(line)]
    assert [d for d in deltas if isinstance(d, Usage)] == [Usage(10, 3, 13)]
    assert assembler.completion().usage == Usage(10, 3, 13)


async def test_a_web_page_in_place_of_an_answer_is_named_as_such(nursery: trio.Nursery) -> None:
    # A proxy's error page, answered 200: not a stream that ended early.
    page = b"<html><body>proxy error: upstream says no</body></html>"
    url = await serve_then_close(
        nursery, b"HTTP/1.1 200 OK\r\ncontent-type: text/html; charset=utf-8\r\ncontent-length: %d\r\n\r\n%s" % (len(page), page)
    )
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0)) as client:
            with pytest.raises(ModelBadResponse) as raised:
                await read_stream(client)
    assert raised.value.reason == "the server answered with a web page (text/html), not an event stream or JSON"
    assert "upstream says no" in raised.value.detail and "upstream" not in str(raised.value)


@pytest.mark.parametrize(
    ("usage", "counted"),
    [
        ({"prompt_tokens": 10, "completion_tokens": None, "total_tokens": None}, Usage(10, 0, 10)),
        ({"prompt_tokens": 10.0, "completion_tokens": 3.0}, Usage(10, 3, 13)),
        ({"prompt_tokens": 10, "completion_tokens": 2.5}, None),
        ({"prompt_tokens": "10", "completion_tokens": 3}, None),
        ({"prompt_tokens": -1, "completion_tokens": 3}, None),
    ],
    ids=["null", "whole-floats", "a-fraction", "text", "negative"],
)
def test_a_usage_whose_counts_are_odd_is_read_as_far_as_it_can_be_and_never_fails_the_answer(
    usage: dict[str, Any], counted: Usage | None
) -> None:
    # The usage accounts for an answer; it is not part of it. An answer the model finished is
    # kept whatever a server wrote there.
    assembler = StreamAssembler("m")
    for line in sse(delta(content="Done."), {**STOPPED, "usage": usage}, "[DONE]"):
        assembler.feed_line(line)
    completion = assembler.completion()
    assert (completion.message.text, completion.usage) == ("Done.", counted)


def test_a_tool_call_fragment_whose_index_is_null_is_placed_as_one_that_gives_none() -> None:
    call = {"index": None, "id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}
    assembler = StreamAssembler("m")
    for line in sse(delta(tool_calls=[call]), {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}, "[DONE]"):
        assembler.feed_line(line)
    [made] = assembler.completion().message.tool_calls
    assert (made.id, made.name, made.arguments) == ("call_1", "clock", "{}")


async def test_a_client_of_one_connection_gives_its_turn_back_however_a_request_ends(fake_model: FakeModel) -> None:
    # Requests past the connections wait their turn in the client: one that failed, was cut
    # short mid-answer, or was cancelled holding the connection, waiting for it, or waiting for
    # its answer to start must give its turn back, or every later request would wait for ever.
    fake_model.script = [
        ErrorReply(400),
        Reply(text="The lease expired.", chunk_chars=4),
        Reply(text="The lease", chunk_chars=32, hang_after_chunks=2),
        Reply(text="not yet", delay_s=DEADLINE_S),
        Reply(text="answered"),
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model, max_connections=1)) as client:
            with pytest.raises(ModelError):
                await client.complete(ASK)
            async with client.stream(ASK) as chunks:
                async for _delta in chunks:
                    break  # the caller stops reading: the answer is cut short
            holding = trio.Event()

            async def hold() -> None:
                async with client.stream(ASK) as chunks:
                    async for _delta in chunks:
                        holding.set()  # its answer hangs after this: it holds the connection

            with trio.CancelScope() as both:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(hold)
                    await holding.wait()
                    nursery.start_soon(read_stream, client)  # waits its turn
                    await trio.testing.wait_all_tasks_blocked()
                    both.cancel()
            with trio.CancelScope() as unanswered:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(client.complete, ASK)  # cancelled before its answer's head comes
                    await trio.testing.wait_all_tasks_blocked()
                    unanswered.cancel()
            assert (await client.complete(ASK)).message.text == "answered"
