"""A fake OpenAI-compatible model server. It is a TEST DOUBLE: it answers from a script, not a model.

It serves ``POST /v1/chat/completions`` (streamed as server-sent events, or in one body) and
``GET /v1/models`` over real HTTP on loopback, with hypercorn on Trio. Each chat request takes
the next item of ``script``: a ``Reply`` (text and/or tool calls, optionally slow or cut off
mid-stream) or an ``ErrorReply`` (an HTTP error status with a body). When the script is empty
the ``default`` item answers; with no default the request gets HTTP 500 saying so. A ``respond``
function, when given, answers each request from its body instead (a tool call, then the answer). Every request
is recorded in ``received`` (``bodies`` holds the chat request bodies: what the model saw), unless
``record`` is false, as it is standalone.

In a test (``tests/conftest.py`` has the ``fake_model`` fixture)::

    server = await nursery.start(FakeModel(script=[Reply(text="hello")]).serve)
    client_config = ModelConfig(base_url=server.base_url)

Standalone, for demos (one reply to every request, forever)::

    python scripts/dev/fake_model.py --port 8000 --reply "The lease expired."

With ``--call-tool NAME`` it first calls the tool NAME, then replies once the tool's result comes.
"""

from __future__ import annotations

import argparse
import email.utils
import errno
import functools
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import attrs
import hypercorn
import hypercorn.trio
import trio

DEFAULT_MODEL = "qwen3:4b-instruct"

Scope = dict[str, Any]
Event = dict[str, Any]
Receive = Callable[[], Awaitable[Event]]
Send = Callable[[Event], Awaitable[None]]


@attrs.frozen
class Call:
    """A tool call the fake model makes; ``arguments`` goes out exactly as written."""

    name: str
    arguments: str = "{}"
    id: str = ""  # "" gives call_<request>_<index>
    # JSON text of an object sent as the call's "extra_content", as Gemini's OpenAI-compatible API
    # sends a call's thought signature: {"google": {"thought_signature": "..."}}.
    extra_content: str = ""


def _calls(calls: Iterable[Call]) -> tuple[Call, ...]:
    return tuple(calls)


# How llama.cpp's server reported a failure in the middle of a stream until late 2025: a field of
# its own, which the event-stream rules ignore, followed by [DONE].
LLAMA_CPP_ERROR = 'error: {"code": 500, "message": "the model failed mid-answer", "type": "server_error"}'
# How Ollama's OpenAI-compatible API ends a stream its model failed in the middle of (its runner
# crashed, say): the error its chat handler streams is read as one more chunk, which holds nothing
# but the role, and the body ends there, cleanly, with no finish_reason and no [DONE].
OLLAMA_ERROR = 'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "", "system_fingerprint": "fp_ollama", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}'


@attrs.frozen
class Reply:
    """An answer. Streamed, its text and each call's arguments go out ``chunk_chars`` at a time.

    ``delay_s`` passes before the response starts and ``gap_s`` between two streamed events.
    ``fail_after_chunks=N`` drops the connection after N events (non-streamed: after half the body).
    ``hang_after_chunks=N`` (streamed only) sends N events and then nothing, until the client leaves;
    with ``keepalive_s`` it sends ``keepalive_event`` that often meanwhile (an SSE comment, as a
    proxy keeping the connection open sends; or a chunk that holds none of the answer).
    ``ignore_stream`` answers in one JSON body even when asked to stream, as some servers and
    proxies do. ``repeat_call_names`` repeats each call's id and
    name in every piece of it, as some servers do.

    Other servers' dialects: ``reasoning`` goes out before the text, ``chunk_chars`` at a time, in
    ``reasoning_field`` deltas whose content is empty (a reasoning model thinking); in one body, in
    the message's ``reasoning_field``. ``reasoning_after`` goes out the same way after the text
    (a model that goes back to reasoning once its answer has begun); streamed only.
    ``content_parts`` sends content (and reasoning) as lists of typed parts, as Mistral's API does
    for its reasoning models. ``same_call_index`` gives every call index 0, as Ollama streams
    parallel calls. ``error_after_chunks=N`` sends N events, then ``error_event`` (written as it
    is) and ``[DONE]``, as a server that fails mid-answer does; with ``done_after_error`` false, the
body ends after ``error_event``, with no ``[DONE]`` (Ollama: see OLLAMA_ERROR). ``raw_bytes`` sends the surrogate
    escapes in the text and arguments (U+DC80 to U+DCFF, which ``bytes.decode("utf-8", "surrogateescape")``
    makes of bytes that are not UTF-8) as the bytes they stand for: a server that cut a character's
    UTF-8 bytes apart. ``no_call_ids`` sends the calls without ids, as some local servers do.
    """

    text: str = ""
    tool_calls: tuple[Call, ...] = attrs.field(default=(), converter=_calls)
    chunk_chars: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    delay_s: float = 0.0
    gap_s: float = 0.0
    fail_after_chunks: int | None = None
    hang_after_chunks: int | None = None
    keepalive_s: float = 0.0
    keepalive_event: str = ": keep-alive"
    ignore_stream: bool = False
    repeat_call_names: bool = False
    finish_reason: str = ""  # "" gives "tool_calls" or "stop"
    reasoning: str = ""
    reasoning_after: str = ""
    # vLLM's, llama.cpp's and DeepSeek's; Ollama's is "reasoning". Several, space-separated, each
    # carry the same text (as servers do that keep an older name beside the new one);
    # "reasoning_details" carries it as OpenRouter does: see reasoning_details.
    reasoning_field: str = "reasoning_content"
    content_parts: bool = False
    same_call_index: bool = False
    error_after_chunks: int | None = None
    error_event: str = LLAMA_CPP_ERROR
    done_after_error: bool = True
    prompt_tokens: int = 12
    completion_tokens: int = 8
    raw_bytes: bool = False
    no_call_ids: bool = False


@attrs.frozen
class ErrorReply:
    """An HTTP error, or with ``location`` a redirect (a 3xx status). An empty ``body`` gives an
    OpenAI-style error object."""

    status: int = attrs.field(validator=[attrs.validators.ge(300), attrs.validators.le(599)])
    body: str = ""
    retry_after: str | None = None
    delay_s: float = 0.0
    location: str | None = None


ScriptItem = Reply | ErrorReply


@attrs.frozen
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # the parsed JSON, or None when the body was empty or not JSON


@attrs.define
class _Exchange:
    """One request in flight; ``complete`` turns true just before the last byte is sent."""

    complete: bool = False


def _script(items: Iterable[ScriptItem]) -> list[ScriptItem]:
    return list(items)


def _names(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(names)


@attrs.define(eq=False)
class FakeModel:
    script: list[ScriptItem] = attrs.field(factory=list, converter=_script)
    default: ScriptItem | None = None
    models: tuple[str, ...] = attrs.field(default=(DEFAULT_MODEL,), converter=_names)
    # An empty catalog lists its models as null rather than [], as Ollama's does with none pulled.
    null_when_empty: bool = False
    api_key: str | None = None
    # Refuse, as many chat templates do, a conversation with two user messages in a row.
    alternate_roles: bool = False
    # List the catalog as a bare JSON array of its entries, as Together's API does, rather than
    # as an object whose "data" holds them.
    bare_catalog: bool = False
    # What each id in the catalog starts with that requests leave out: "models/" for Gemini's
    # OpenAI-compatible API, which lists models/gemini-2.5-flash and is asked for gemini-2.5-flash.
    catalog_prefix: str = ""
    # Names answered at GET /v1/models/NAME, as Anthropic's API answers an alias (or a model past
    # the first page of its catalog) there, to the model it stands for, though its catalog does
    # not list it: alias to the id answered.
    aliases: dict[str, str] = attrs.Factory(dict)
    # The status GET /v1/models/NAME answers every name with, as a server in trouble does (503, a
    # proxy whose upstream is down); None: as the catalog and ``aliases`` say.
    entry_status: int | None = None
    # Names its chat takes though its catalog neither lists them nor answers for them, as Azure
    # OpenAI's deployments: its catalog lists the models they deploy.
    deployments: tuple[str, ...] = attrs.field(default=(), converter=_names)
    # Refuse, as Mistral's API and its models' chat templates do, a tool call id in the
    # conversation that is not 9 letters and digits.
    nine_char_call_ids: bool = False
    # Refuse, as Gemini 3 models do, a conversation in which a call this server gave with
    # extra_content (its thought signature) comes back without it.
    wants_extra_content: bool = False
    # Refuse, as DeepSeek's thinking mode and Kimi do, a conversation in which an assistant message
    # whose tool calls this server gave with reasoning_content comes back without that reasoning
    # (and, as OpenRouter's Anthropic and Gemini 3 models do, without its reasoning_details
    # unmodified, or without its reasoning as the field it came in).
    wants_reasoning_back: bool = False
    # When set, each chat request is answered by what this makes of its body, before the script.
    respond: Callable[[dict[str, Any]], ScriptItem] | None = None
    # Every request is kept in ``received`` for a test to read; run standalone (for a demo, or a
    # load run) it keeps none, so that it does not grow with every request it answers.
    record: bool = True
    # How far its clock is ahead of this machine's (behind, if negative): the Date header of
    # each response says the time by it, as a model server whose clock is set otherwise would.
    clock_ahead_s: float = 0.0
    received: list[Received] = attrs.field(init=False, factory=list)
    disconnects: int = attrs.field(init=False, default=0)
    answering: int = attrs.field(init=False, default=0)  # chat requests being answered now
    most_answering: int = attrs.field(init=False, default=0)  # the most there have been at once
    base_url: str = attrs.field(init=False, default="")
    _changed: trio.Event = attrs.field(init=False, factory=trio.Event)
    _chats: int = attrs.field(init=False, default=0)  # chat requests so far, which number the answers' ids
    _extra_given: dict[str, Any] = attrs.field(init=False, factory=dict)  # a call's id, to the extra_content it went with
    # A call's id, to the fields (and their values) of the reasoning it came after.
    _reasoning_given: dict[str, dict[str, Any]] = attrs.field(init=False, factory=dict)

    @property
    def bodies(self) -> list[Any]:
        """The body of every chat-completions request, in order."""
        return [item.body for item in self.received if item.path == "/v1/chat/completions"]

    async def serve(self, *, host: str = "127.0.0.1", port: int = 0, task_status: trio.TaskStatus[FakeModel] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started(self)`` once listening, with ``base_url`` set."""
        if self.base_url:
            raise RuntimeError(f"This FakeModel is already serving at {self.base_url}; make another for a second server.")
        config = hypercorn.Config()
        config.bind = [f"{host}:{port}"]
        config.loglevel = "WARNING"
        config.include_date_header = False  # the app dates its responses itself, by its own clock
        async with trio.open_nursery() as nursery:
            # The app speaks ASGI in plain dicts; hypercorn's TypedDicts describe the same shapes.
            app = functools.partial(hypercorn.trio.serve, self._app, config)  # type: ignore[arg-type]
            binds = await nursery.start(app)
            self.base_url = f"{binds[0]}/v1"
            task_status.started(self)

    async def wait_disconnected(self, count: int = 1) -> None:
        """Block until ``count`` clients in all have gone away before their answer was complete."""
        while self.disconnects < count:
            await self._changed.wait()

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        send = functools.partial(_dated, send, self.clock_ahead_s)
        raw = await _read_body(receive)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        body = _parse_json(raw)
        if self.record:
            self.received.append(Received(scope["method"], scope["path"], headers, body))
        if scope["path"] == "/v1/chat/completions":
            self._chats += 1
        presented = headers.get("authorization", "").removeprefix("Bearer ")
        if self.api_key is not None and presented != self.api_key:
            # Like some hosted APIs, the refusal repeats the key it was given.
            await _send_json(send, 401, _error(f"Incorrect API key provided: {presented}", "invalid_api_key"))
        elif (scope["method"], scope["path"]) == ("GET", "/v1/models"):
            await _send_json(send, 200, self._catalog())
        elif (scope["method"], scope["path"]) == ("POST", "/v1/chat/completions"):
            await self._chat(body, receive, send)
        elif scope["method"] == "GET" and scope["path"].startswith("/v1/models/") and self.entry_status is not None:
            await _send_json(send, self.entry_status, _error("the model service is unavailable", "service_unavailable"))
        elif scope["method"] == "GET" and (entry := self._entry(scope["path"])) is not None:
            await _send_json(send, 200, entry)
        else:
            await _send_json(send, 404, _error(f"no route for {scope['method']} {scope['path']}", "not_found"))

    def _catalog(self) -> dict[str, Any] | list[dict[str, Any]]:
        entries = [{"id": self.catalog_prefix + name, "object": "model", "created": 0, "owned_by": "keel-fake"} for name in self.models]
        if self.bare_catalog:
            return entries
        return {"object": "list", "data": entries or (None if self.null_when_empty else [])}

    def _entry(self, path: str) -> dict[str, Any] | None:
        """The catalog's entry for GET /v1/models/NAME: a model it lists, or an alias's model."""
        name = path.removeprefix("/v1/models/") if path.startswith("/v1/models/") else ""  # ASGI's path is decoded
        model = self.aliases.get(name) or (name if name and name in self.models else None)
        return None if model is None else {"id": model, "object": "model", "created": 0, "owned_by": "keel-fake"}

    async def _chat(self, request: Any, receive: Receive, send: Send) -> None:
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            await _send_json(send, 400, _error("the body must be a JSON object with a list of messages", "invalid_request_error"))
            return
        if request.get("model") not in (*self.models, *self.aliases, *self.deployments):
            message = f"model {json.dumps(request.get('model'))} not found, try pulling it first"
            await _send_json(send, 404, _error(message, "not_found_error"))
            return
        if self.alternate_roles and _two_users_in_a_row(request["messages"]):
            message = "Conversation roles must alternate user/assistant/user/assistant/..."
            await _send_json(send, 400, _error(message, "BadRequestError"))
            return
        bad_id = _not_nine_chars(request["messages"]) if self.nine_char_call_ids else None
        if bad_id is not None:
            message = f"Tool call id was {bad_id} but must be a-z, A-Z, 0-9, with a length of 9."
            await _send_json(send, 400, _error(message, "invalid_request_error"))
            return
        unreasoned = self._unreasoned(request["messages"]) if self.wants_reasoning_back else None
        if unreasoned is not None:
            message = f"Missing `{unreasoned[1]}` field in the assistant message at message index {unreasoned[0]}"
            await _send_json(send, 400, _error(message, "invalid_request_error"))
            return
        unsigned = self._unsigned(request["messages"]) if self.wants_extra_content else None
        if unsigned is not None:
            message = f"Function call is missing a thought_signature in functionCall parts. Additional data, function call `{unsigned}`"
            await _send_json(send, 400, [{"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}])
            return
        if self.respond is not None:
            item: ScriptItem | None = self.respond(request)
        else:
            item = self.script.pop(0) if self.script else self.default
        exchange = _Exchange()
        self.answering += 1
        self.most_answering = max(self.most_answering, self.answering)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, exchange, nursery.cancel_scope)
                await self._answer(item, request, send, exchange)
                nursery.cancel_scope.cancel()
        finally:
            self.answering -= 1

    def _unreasoned(self, messages: list[Any]) -> tuple[int, str] | None:
        """The index of the first assistant message of ``messages`` with a call this server gave
        after reasoning, that comes back without that reasoning as it was given, and the field."""
        for index, message in enumerate(messages):
            calls = (message.get("tool_calls") or []) if isinstance(message, dict) else []
            for call in calls:
                given = self._reasoning_given.get(str(call.get("id"))) if isinstance(call, dict) else None
                for field, value in (given or {}).items():
                    if message.get(field) != value:
                        return index, field
        return None

    def _unsigned(self, messages: list[Any]) -> str | None:
        """The name of the first call of ``messages`` that went out with extra_content and came
        back without it (or with other)."""
        for message in messages:
            for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
                given = self._extra_given.get(str(call.get("id"))) if isinstance(call, dict) else None
                if given is not None and call.get("extra_content") != given:
                    return str(call.get("function", {}).get("name"))
        return None

    async def _watch_disconnect(self, receive: Receive, exchange: _Exchange, scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not exchange.complete:
            self.disconnects += 1
            self._changed.set()
            self._changed = trio.Event()
            scope.cancel()

    async def _answer(self, item: ScriptItem | None, request: dict[str, Any], send: Send, exchange: _Exchange) -> None:
        if item is None:
            exchange.complete = True
            message = "the fake model's script is empty and it has no default reply"
            await _send_json(send, 500, _error(message, "server_error"))
            return
        await trio.sleep(item.delay_s)
        if isinstance(item, ErrorReply):
            exchange.complete = True
            body = item.body or json.dumps(_error(f"scripted HTTP {item.status}", "scripted_error"))
            extra = [(b"retry-after", item.retry_after.encode())] if item.retry_after is not None else []
            extra += [(b"location", item.location.encode())] if item.location is not None else []
            await _send_bytes(send, item.status, body.encode(), "application/json", extra)
            return
        number = self._chats
        for index, call in enumerate(item.tool_calls):
            if call.extra_content:
                self._extra_given[_call_id(call, number, index)] = json.loads(call.extra_content)
            if item.reasoning:
                self._reasoning_given[_call_id(call, number, index)] = _reasoning_fields(item, item.reasoning)
        if request.get("stream") is True and not item.ignore_stream:
            stream_options = request.get("stream_options") or {}
            usage = isinstance(stream_options, dict) and stream_options.get("include_usage") is True
            await _send_stream(send, item, _chunks(item, request, number, usage=usage), exchange)
        else:
            await _send_whole(send, item, _completion(item, request, number), exchange)


def _two_users_in_a_row(messages: list[Any]) -> bool:
    roles = [message.get("role") if isinstance(message, dict) else None for message in messages]
    return any(first == second == "user" for first, second in zip(roles, roles[1:]))


_NINE_CHARS = re.compile(r"[a-zA-Z0-9]{9}")


def _not_nine_chars(messages: list[Any]) -> str | None:
    """The first tool call id of ``messages`` (a call's, or the one a result answers) that is not
    9 letters and digits."""
    for message in messages:
        if not isinstance(message, dict):
            continue
        calls = message.get("tool_calls") or []
        ids = [call.get("id") for call in calls if isinstance(call, dict)]
        if message.get("role") == "tool":
            ids.append(message.get("tool_call_id"))
        for call_id in ids:
            if not (isinstance(call_id, str) and _NINE_CHARS.fullmatch(call_id)):
                return str(call_id)
    return None


def _chunks(reply: Reply, request: dict[str, Any], number: int, *, usage: bool) -> Iterator[str]:
    """The data of each server-sent event of a streamed answer, ``[DONE]`` last."""
    head = {"id": f"chatcmpl-fake-{number}", "object": "chat.completion.chunk", "created": int(time.time()), "model": request["model"]}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return _json({**head, "choices": [choice]}, raw_bytes=reply.raw_bytes)

    yield chunk({"role": "assistant", "content": ""})
    def reasoning(text: str) -> Iterator[str]:
        for piece in _pieces(text, reply.chunk_chars):
            if reply.content_parts:
                yield chunk({"content": [{"type": "thinking", "thinking": [{"type": "text", "text": piece}]}]})
            else:
                yield chunk({"content": "", **_reasoning_fields(reply, piece, streamed=True)})
        if "reasoning_details" in reply.reasoning_field.split() and text:
            # The text's signature, and the encrypted part after it, come once the text is done.
            yield from (chunk({"reasoning_details": [detail]}) for detail in _reasoning_details("", ended=True))

    yield from reasoning(reply.reasoning)
    for piece in _pieces(reply.text, reply.chunk_chars):
        yield chunk({"content": [{"type": "text", "text": piece}] if reply.content_parts else piece})
    yield from reasoning(reply.reasoning_after)
    for index, call in enumerate(reply.tool_calls):
        function = {"name": call.name, "arguments": ""}
        at = 0 if reply.same_call_index else index
        call_id = _call_id(call, number, index)
        named_id = {} if reply.no_call_ids else {"id": call_id}
        extra = {"extra_content": json.loads(call.extra_content)} if call.extra_content else {}
        yield chunk({"tool_calls": [{"index": at, **named_id, "type": "function", "function": function, **extra}]})
        for piece in _pieces(call.arguments, reply.chunk_chars):
            again = {**named_id, "type": "function"} if reply.repeat_call_names else {}
            named = {"name": call.name} if reply.repeat_call_names else {}
            yield chunk({"tool_calls": [{"index": at, **again, "function": {**named, "arguments": piece}}]})
    yield chunk({}, _finish_reason(reply))
    if usage:
        yield json.dumps({**head, "choices": [], "usage": _usage(reply)})
    yield "[DONE]"


def _reasoning_fields(reply: Reply, text: str, *, streamed: bool = False) -> dict[str, Any]:
    """The fields of a message (or of one piece of a streamed one) that carry ``text`` as its
    reasoning, each as ``reply.reasoning_field`` names them."""
    fields: dict[str, Any] = {}
    for name in reply.reasoning_field.split():
        fields[name] = _reasoning_details(text, ended=not streamed) if name == "reasoning_details" else text
    return fields


REASONING_SIGNATURE = "EqQBCkgIAxABGAIiQLbS3Nz0"  # as an Anthropic model's thinking block is signed
REASONING_ENCRYPTED = "gAAAAABpLm4xZWRhY3RlZF90aGlua2luZw=="  # a redacted thinking block, as OpenRouter passes it on


def _reasoning_details(text: str, *, ended: bool) -> list[dict[str, Any]]:
    """Reasoning as OpenRouter gives an Anthropic model's: a ``reasoning.text`` detail (index 0)
    and, once it is done, its signature and a ``reasoning.encrypted`` detail (index 1). Streamed,
    the text comes in pieces of detail 0 with no signature, then a piece of it with the signature
    alone (``ended`` and no text); in one body, the details whole."""
    head = {"format": "anthropic-claude-v1", "index": 0}
    encrypted = {"type": "reasoning.encrypted", "data": REASONING_ENCRYPTED, "format": "anthropic-claude-v1", "index": 1}
    if not ended:
        return [{"type": "reasoning.text", "text": text, **head}]
    return [{"type": "reasoning.text", "text": text, "signature": REASONING_SIGNATURE, **head}, encrypted]


def _completion(reply: Reply, request: dict[str, Any], number: int) -> dict[str, Any]:
    content: str | list[dict[str, Any]] = reply.text
    if reply.content_parts:
        thinking = [{"type": "thinking", "thinking": [{"type": "text", "text": reply.reasoning}]}] if reply.reasoning else []
        content = [*thinking, {"type": "text", "text": reply.text}]
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if reply.tool_calls else "")}
    if reply.reasoning and not reply.content_parts:
        message.update(_reasoning_fields(reply, reply.reasoning))
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                **({} if reply.no_call_ids else {"id": _call_id(call, number, index)}),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
                **({"extra_content": json.loads(call.extra_content)} if call.extra_content else {}),
            }
            for index, call in enumerate(reply.tool_calls)
        ]
    return {
        "id": f"chatcmpl-fake-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request["model"],
        "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(reply)}],
        "usage": _usage(reply),
    }


async def _send_stream(send: Send, reply: Reply, events: Iterator[str], exchange: _Exchange) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
    data = list(events)
    for sent, event in enumerate(data):
        if sent == reply.fail_after_chunks:
            return  # returning before the body is complete makes hypercorn drop the connection
        if sent == reply.error_after_chunks:
            exchange.complete = True
            done = "data: [DONE]\n\n" if reply.done_after_error else ""
            failed = f"{reply.error_event}\n\n{done}".encode()
            await send({"type": "http.response.body", "body": failed, "more_body": False})
            return
        if sent == reply.hang_after_chunks:  # a stalled model; ends when the client goes away
            while reply.keepalive_s:
                await trio.sleep(reply.keepalive_s)
                await send({"type": "http.response.body", "body": f"{reply.keepalive_event}\n\n".encode(), "more_body": True})
            await trio.sleep_forever()
        if sent and reply.gap_s:
            await trio.sleep(reply.gap_s)
        last = sent == len(data) - 1
        exchange.complete = last
        await send({"type": "http.response.body", "body": _encoded(f"data: {event}\n\n"), "more_body": not last})


async def _send_whole(send: Send, reply: Reply, completion: dict[str, Any], exchange: _Exchange) -> None:
    body = _encoded(_json(completion, raw_bytes=reply.raw_bytes))
    if reply.fail_after_chunks is not None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
        return  # the promised length never arrives
    exchange.complete = True
    await _send_bytes(send, 200, body, "application/json")


def _pieces(text: str, size: int) -> list[str]:
    return [text[start : start + size] for start in range(0, len(text), size)]


def _call_id(call: Call, number: int, index: int) -> str:
    return call.id or f"call_{number}_{index}"


def _finish_reason(reply: Reply) -> str:
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


def _usage(reply: Reply) -> dict[str, int]:
    total = reply.prompt_tokens + reply.completion_tokens
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens, "total_tokens": total}


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        event = await receive()
        if event["type"] == "http.disconnect":
            break
        parts.append(event.get("body", b""))
        if not event.get("more_body", False):
            break
    return b"".join(parts)


def _json(data: object, *, raw_bytes: bool = False) -> str:
    """UTF-8 JSON text, as most servers send it; a string that is not Unicode text (a lone
    UTF-16 surrogate, which a script can hold, say to stand for half an emoji that a JavaScript
    server cut between two chunks) is spelled as a JSON escape, as such a server spells it, unless
    ``raw_bytes`` (see Reply) leaves it for ``_encoded``."""
    text = json.dumps(data, ensure_ascii=False)
    if raw_bytes:
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(data)
    return text


def _encoded(text: str) -> bytes:
    """``text`` in UTF-8, with its surrogate escapes as the bytes they stand for (see Reply.raw_bytes)."""
    return text.encode("utf-8", "surrogateescape")


async def _dated(send: Send, clock_ahead_s: float, event: Event) -> None:
    """``send``, with a Date header on the start of a response: the time by a clock ``clock_ahead_s`` ahead."""
    if event["type"] == "http.response.start":
        date = email.utils.formatdate(time.time() + clock_ahead_s, usegmt=True).encode()
        event = {**event, "headers": [*event["headers"], (b"date", date)]}
    await send(event)


async def _send_json(send: Send, status: int, data: object) -> None:
    await _send_bytes(send, status, _json(data).encode(), "application/json")


async def _send_bytes(send: Send, status: int, body: bytes, content_type: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        event = await receive()
        if event["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif event["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _serve_forever(fake: FakeModel, host: str, port: int) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(fake.serve, host=host, port=port))
        print(f"fake model (a test double) serving {fake.base_url} with models {', '.join(fake.models)}", flush=True)


def calling(tool: str, reply: Reply) -> Callable[[dict[str, Any]], ScriptItem]:
    """A ``respond`` that calls ``tool`` (no arguments) when the conversation's last message is
    not a tool's result, and gives ``reply`` when it is."""

    def respond(request: dict[str, Any]) -> ScriptItem:
        messages = request.get("messages") or [{}]
        if messages[-1].get("role") == "tool":
            return reply
        return attrs.evolve(reply, text="", tool_calls=[Call(tool)])

    return respond


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A fake OpenAI-compatible model server (a test double) that gives one reply to every request.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port; the URL is printed")
    parser.add_argument("--reply", default="This is the fake model answering.", help="the text of every answer")
    parser.add_argument("--model", action="append", help=f"a model id in the catalog (repeatable; default {DEFAULT_MODEL})")
    parser.add_argument("--api-key", default=None, help="require this Bearer key")
    parser.add_argument("--gap-s", type=float, default=0.02, help="seconds between streamed chunks")
    parser.add_argument(
        "--call-tool", metavar="NAME", default=None,
        help="first call the tool NAME (with no arguments), and give the reply once its result is sent back",
    )  # fmt: skip
    args = parser.parse_args(argv)
    models = tuple(args.model or [DEFAULT_MODEL])
    reply = Reply(text=args.reply, gap_s=args.gap_s)
    respond = None if args.call_tool is None else calling(args.call_tool, reply)
    fake = FakeModel(default=reply, models=models, api_key=args.api_key, record=False, respond=respond)
    try:
        trio.run(_serve_forever, fake, args.host, args.port)
    except* KeyboardInterrupt:  # raised inside the server's nursery, so it comes in a group
        pass  # Ctrl-C is how a demo server is meant to stop
    except* OSError as group:  # one line, not the nurseries' traceback, for the usual mistake
        if group.subgroup(lambda exc: getattr(exc, "errno", None) == errno.EADDRINUSE) is None:
            raise
        reason = os.strerror(errno.EADDRINUSE)
        sys.exit(f"error: cannot listen on {args.host}:{args.port}: {reason}; stop what listens there, or give another --port")


if __name__ == "__main__":
    main()
