"""An OpenAI-compatible chat-completions client over ``httpx.AsyncClient``.

It speaks to Ollama, vLLM, the llama.cpp server and hosted APIs alike, and stores nothing: each
call sends the whole request it is given. Failures before the server has started an answer
(connection refused or reset, HTTP 429, HTTP 5xx) are retried a bounded number of times with
exponential backoff. Once the server has answered 2xx the call is never retried, streamed or not:
part of the answer may already be in the caller's hands, and a second request would say it twice.
Which failure is which ModelError, and which may be retried, is ``runtime.models.failures``; where
the server is, and the secrets its URL may carry, ``runtime.models.endpoint``; how each request
goes over the wire (its turn for a connection, its body) ``runtime.models.transport``.
"""

from __future__ import annotations

import json
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any
from urllib.parse import quote

import attrs
import httpx
import trio

from persistence.transcript import Message
from persistence.validate import MAX_EVENT_BYTES
from protocol import SseLines
from protocol.sse import LineTooLong
from runtime.models.assembly import StreamAssembler
from runtime.models.endpoint import ModelConfig
from runtime.models.errors import ModelBadResponse, ModelError, ModelTimeout
from runtime.models.failures import (
    Failure, broken_answer, failure_of_status, failure_to_send, part_awaited, refuses_stream_options,
)
from runtime.models.transport import QueuedTransport, with_whole_body
from runtime.models.values import ChatRequest, Completion, Delta, Finish, TextDelta
from runtime.models.wire import SAID_CHARS, marked, marked_completion, parse_completion, request_body

logger = logging.getLogger(__name__)

_DETAIL_CHARS = 2000  # how much of a server's error body is kept for the logs
# Far past any answer the agent keeps (a message is at most 1 MiB stored, ~6 MiB JSON-escaped):
# a server that sends more is not answering, and is not held in memory to find that out.
MAX_BODY_BYTES = 32 << 20
MAX_LINE_CHARS = 16 << 20  # one line of a streamed answer, and one event's data lines together: one chunk of it
# As much reasoning as one answer may hold (MAX_EVENT_BYTES): a model that reasons past it without
# starting its answer is going round in circles, and a call that would never end is ended.
MAX_REASONING_CHARS = MAX_EVENT_BYTES


# A connection left silent (a model that sends nothing until it has loaded, which for Ollama can
# take minutes) is probed by the kernel after KEEPALIVE_IDLE_S, then every KEEPALIVE_INTERVAL_S:
# a NAT or a firewall on the way that forgets idle connections (AWS's NAT gateways after 350 s,
# Azure's load balancers after 4 minutes) sees it in use, and a peer gone without a word (its host
# off, the path cut) is found after KEEPALIVE_PROBES unanswered probes, rather than once
# read_timeout_s has passed, which an operator raises for such a model.
KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3
_KEEPALIVE_TIMES = {"TCP_KEEPIDLE": KEEPALIVE_IDLE_S, "TCP_KEEPINTVL": KEEPALIVE_INTERVAL_S, "TCP_KEEPCNT": KEEPALIVE_PROBES}
KEEPALIVE_OPTIONS = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)] + [
    (socket.IPPROTO_TCP, getattr(socket, name), value)
    for name, value in _KEEPALIVE_TIMES.items()
    if hasattr(socket, name)  # Linux's; a system without them keeps its own times
]


@asynccontextmanager
async def open_model_client(config: ModelConfig) -> AsyncIterator[ModelClient]:
    """A ModelClient with its own connection pool, closed when the block exits.

    Proxy settings are not read from the environment (nothing below ``main`` reads it); a local
    model server is reached directly.
    """
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
    pool = httpx.AsyncHTTPTransport(limits=limits, trust_env=False, socket_options=KEEPALIVE_OPTIONS)
    transport = QueuedTransport(pool, config.max_connections)
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, transport=transport) as http:
        yield ModelClient(config, http)


AFTER_DONE_S = 1.0  # how long the body may stay open after [DONE] before it is let go


# A body of text/html: a proxy's or a login page's, not the API's.
WEB_PAGE = "the server answered with a web page (text/html)"


@attrs.define(eq=False)
class ModelClient:
    """Chat completions, streamed or not, and the server's model catalog.

    ``http`` is the caller's ``httpx.AsyncClient`` (see ``open_model_client``); its own timeouts
    and base URL are not used, the config's are.
    """

    config: ModelConfig
    _http: httpx.AsyncClient = attrs.field(alias="http")
    _usage_refused: bool = attrs.field(init=False, default=False)  # the server refuses stream_options

    async def complete(self, request: ChatRequest) -> Completion:
        """The model's next message, in one piece.

        Blocks until the whole answer has arrived. Cancellation closes the connection. Raises a
        ModelError subclass; ValueError when the transcript cannot be sent.
        """
        body = request_body(request, model=self.config.model, stream=False, server=self.config.server)
        response = await self._open("POST", "chat/completions", body, accept="application/json")
        data = await self._read_json(response)
        try:
            return marked_completion(parse_completion(data, model=self.config.model), self.config.server)
        except ModelError as exc:  # what the server said may repeat the key it was sent
            exc.detail = self._scrub_cut(exc.detail)
            raise

    def stream(self, request: ChatRequest) -> ChatStream:
        """The model's next message as it is produced::

            async with client.stream(request) as chunks:
                async for delta in chunks:
                    ...
            completion = chunks.completion()

        Entering sends the request (retrying as the module docstring says); iterating reads the
        answer. Leaving the block, by cancellation or otherwise, closes the HTTP stream.
        Raises a ModelError subclass from either; ValueError when the transcript cannot be sent.
        """
        return ChatStream(self, request)

    @property
    def model(self) -> str:
        """The model every request asks for (``config.model``)."""
        return self.config.model

    @property
    def endpoint(self) -> str:
        """Where its requests go, without credentials or query (``config.endpoint``)."""
        return self.config.endpoint

    async def list_models(self) -> tuple[str, ...]:
        """The ids in the server's catalog (``GET {base}/models``). Raises a ModelError subclass.
        A catalog whose list is null lists none: Ollama's, with no model pulled yet. A catalog
        given as the bare list of its models, not an object holding it under "data", is read
        as well: Together's."""
        response = await self._open("GET", "models", None, accept="application/json", waiting_for="the catalog")
        data = await self._read_json(response)
        entries = data if isinstance(data, list) else data.get("data", ()) if isinstance(data, dict) else ()
        if entries is None:  # Ollama's, with no model pulled yet
            entries = []
        if not isinstance(entries, list):
            raise ModelBadResponse(self.config.model, "the model catalog has no list of models")
        return tuple(entry["id"] for entry in entries if isinstance(entry, dict) and isinstance(entry.get("id"), str))

    async def has_model(self, name: str | None = None) -> bool:
        """Whether the server's catalog offers ``name`` (by default the configured model).

        A readiness check: it runs no inference. A name without a tag also matches Ollama's
        ``name:latest``, and any name Gemini's ``models/name``, as its catalog lists the models
        it is asked for by their names alone. Raises a ModelError subclass when the catalog
        cannot be read.
        """
        wanted = name or self.config.model
        models = await self.list_models()
        untagged = () if ":" in wanted else (f"{wanted}:latest",)
        if any(form in models for form in (wanted, f"models/{wanted}", *untagged)):
            return True
        return await self._answers_for(wanted)

    async def _answers_for(self, name: str) -> bool:
        """Whether the server describes ``name`` at ``GET {base}/models/{name}``, OpenAI's route
        for one model, though its catalog does not list it: Anthropic's lists dated ids, 20 to
        a page, and answers there for an alias or a model on a later page, both of which its
        chat takes. Asked once, not retried: an answer of 429 or 5xx is the server's trouble, and
        one of 401 or 403 the key's (refused for this model alone: the catalog took it), not news
        of the model (a ModelError, as the catalog's would be); any other but a 2xx holding the
        model's entry (a 404 from a server with no such route, say) leaves it absent."""
        url = self.config.url(f"models/{quote(name, safe=':@')}")
        request = self._http.build_request("GET", url, headers=self._headers("application/json"), timeout=self._timeout())
        try:
            response = await self._http.send(request, stream=True)
        except httpx.RequestError as exc:  # the catalog was read a moment ago: the server's trouble is news
            raise failure_to_send(self.config, exc, 1, "the model's entry in the catalog").error from exc
        if response.status_code in (401, 403, 429) or response.status_code >= 500:
            raise failure_of_status(self.config, response, await self._body_start(response), 1).error
        try:
            if not response.is_success:
                return False
            entry = await self._read_json(response)
        except ModelError:  # not an entry, whatever it is: absent, as from a server with no such route
            return False
        finally:
            await response.aclose()
        return isinstance(entry, dict) and isinstance(entry.get("id"), str)

    async def _open(
        self, method: str, path: str, body: dict[str, Any] | None, *, accept: str, waiting_for: str = "the answer to start"
    ) -> httpx.Response:
        """Send with retries; returns a 2xx response whose body is unread. The caller closes it.
        ``waiting_for``: what a timeout says it waited for."""
        url, timeout = self.config.url(path), self._timeout()
        attempt = 0
        while True:
            attempt += 1
            try:
                request = self._http.build_request(method, url, json=body, headers=self._headers(accept), timeout=timeout)
                response = await self._http.send(with_whole_body(request), stream=True)
            except httpx.RequestError as exc:
                failure = failure_to_send(self.config, exc, attempt, waiting_for)
            else:
                if response.is_success:
                    return response
                failure = failure_of_status(self.config, response, await self._body_start(response), attempt)
            await self._wait_to_retry(failure, attempt)

    async def _open_stream(self, body: dict[str, Any]) -> httpx.Response:
        """``_open`` for a streamed answer. A server that refuses the ``stream_options`` asking for
        its usage is asked again without them, now and from then on: its answers' usage is all
        that is lost, where every answer would be."""
        if self._usage_refused:
            body = {key: value for key, value in body.items() if key != "stream_options"}
        try:
            return await self._open("POST", "chat/completions", body, accept="text/event-stream")
        except ModelError as exc:
            if "stream_options" not in body or not refuses_stream_options(exc):
                raise
            logger.warning(
                "model %r at %s refuses stream_options (%s); asking without them, so its answers' usage is not known",
                self.config.model, self.config.endpoint, exc.detail,
            )
        self._usage_refused = True
        return await self._open_stream(body)

    def _timeout(self) -> httpx.Timeout:
        """Every request's bounds. None on the wait for one of the pool's connections: with
        max_connections calls already open (a slow local model holds each for its whole answer),
        a call waits its turn instead of failing. Cancelling the caller ends the wait."""
        read_s = self.config.read_timeout_s
        return httpx.Timeout(connect=self.config.connect_timeout_s, read=read_s, write=read_s, pool=None)

    async def _wait_to_retry(self, failure: Failure, attempt: int) -> None:
        """Sleep before the next attempt, or raise the failure's error if there is none."""
        retries = self.config.max_retries
        if failure.retries_at_most is not None:
            retries = min(retries, failure.retries_at_most)
        if not failure.retry or attempt > retries:
            raise failure.error
        delay_s = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (attempt - 1))
        if failure.retry_after_s is not None:
            if failure.retry_after_s > self.config.backoff_max_s:
                raise failure.error  # the server asks for a longer wait than this client will do
            delay_s = max(delay_s, failure.retry_after_s)
        logger.warning(
            "model %r at %s: attempt %d failed (%s); retrying in %.3gs",
            self.config.model, self.config.endpoint, attempt, failure.error.detail or failure.error, delay_s,
        )
        await trio.sleep(delay_s)

    def _headers(self, accept: str) -> dict[str, str]:
        headers = {"Accept": accept}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    async def _body_start(self, response: httpx.Response) -> str:
        """For the logs: the start of a body that is not an answer (an error's, a web page's),
        scrubbed; only that much is read, and that not forever. The response is closed after."""
        body = f"(the body did not end within {self.config.read_timeout_s:g} s)".encode()
        try:
            with trio.move_on_after(self.config.read_timeout_s):
                body = await _read_at_most(response, SAID_CHARS)
        except httpx.RequestError as exc:
            body = f"(the body could not be read: {type(exc).__name__})".encode()
        finally:
            await response.aclose()
        return self._scrub_cut(f"HTTP {response.status_code}: {body.decode('utf-8', 'replace')}")

    async def _read_json(self, response: httpx.Response) -> Any:
        """A whole JSON body, at most MAX_BODY_BYTES of it. Each wait for more of it is bounded
        by ``read_timeout_s``; whitespace (what a gateway may send to keep a slow answer's
        connection open) does not count as more, as keep-alive comments do not in a stream."""
        model, timeout_s = self.config.model, self.config.read_timeout_s
        pieces: list[bytes] = []
        try:
            with trio.CancelScope(deadline=trio.current_time() + timeout_s) as quiet:
                await _read_at_most(response, MAX_BODY_BYTES + 1, quiet=quiet, quiet_s=timeout_s, into=pieces)
        except httpx.RequestError as exc:
            raise broken_answer(self.config, exc, started=_any_data(pieces)) from exc
        finally:
            await response.aclose()
        if quiet.cancelled_caught:
            started = _any_data(pieces)
            detail = "part of the JSON arrived, then whitespace at most" if started else "no JSON arrived, whitespace at most"
            raise ModelTimeout(model, part_awaited(started), timeout_s, detail=detail)
        raw = b"".join(pieces)
        if len(raw) > MAX_BODY_BYTES:
            raise ModelBadResponse(model, f"the body is larger than {MAX_BODY_BYTES} bytes")
        try:
            return _loads(raw)
        except (ValueError, RecursionError) as exc:
            detail = self._scrub_cut(raw[:SAID_CHARS].decode("utf-8", "replace"))
            media = response.headers.get("content-type", "").split(";")[0].strip().lower()
            reason = WEB_PAGE + ", not JSON" if media == "text/html" else "the body is not JSON"  # a proxy's error page, say
            raise ModelBadResponse(model, reason, detail=detail) from exc

    def _scrub_cut(self, text: str) -> str:
        """``text`` scrubbed, then cut to what the log keeps (in that order: a secret across the
        cut would no longer match)."""
        # Some servers echo the key or the credentials they refused; logs should not keep them either.
        return self.config.scrub(text)[:_DETAIL_CHARS]


def _loads(raw: bytes) -> Any:
    """A JSON body. Bytes that are not UTF-8 (a character a server cut apart) read as U+FFFD, as
    they do in a stream (SseLines), rather than make the whole answer unreadable."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        return json.loads(raw.decode("utf-8-sig", "replace"))


def _any_data(pieces: list[bytes]) -> bool:
    return any(piece.strip() for piece in pieces)


async def _read_at_most(
    response: httpx.Response,
    limit: int,
    *,
    quiet: trio.CancelScope | None = None,
    quiet_s: float = 0.0,
    into: list[bytes] | None = None,
) -> bytes:
    """The body, or its first ``limit`` bytes or so: what follows is not read. With ``quiet``,
    its deadline moves ``quiet_s`` on each time something other than whitespace arrives. Each
    piece is appended to ``into`` as it arrives, so the caller has them if the reading fails."""
    pieces: list[bytes] = into if into is not None else []
    size = 0
    chunks = response.aiter_bytes()
    try:
        async for piece in chunks:
            pieces.append(piece)
            size += len(piece)
            if size >= limit:
                break
            if quiet is not None and piece.strip():
                quiet.deadline = trio.current_time() + quiet_s
    finally:
        await _unwind(chunks)
    return b"".join(pieces)


async def _unwind(chunks: AsyncIterator[bytes]) -> None:
    """Leave httpx's reader of a body, a stack of async generators that each need closing.

    Closing only the outermost would leave the inner ones for the garbage collector (which trio
    rightly warns about). Resumed inside an already-cancelled scope, the reader gets through
    what is buffered and then meets trio.Cancelled at its next socket read, deep inside; that
    exception, caught by this scope alone, closes every generator on its way out. It ends
    without waiting on the network. (A reader already finished just ends.)
    """
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            async for _ in chunks:
                pass
        except httpx.RequestError:
            pass  # the caller has left this body; how its last bytes failed is no one's concern



@attrs.define(eq=False)
class ChatStream:
    """One streamed answer. Use it once, as ``async with client.stream(request) as chunks:``."""

    _client: ModelClient = attrs.field(alias="client")
    _request: ChatRequest = attrs.field(alias="request")
    _response: httpx.Response | None = attrs.field(init=False, default=None)
    _chunks: AsyncIterator[bytes] | None = attrs.field(init=False, default=None)  # the body, as it arrives
    _splitter: SseLines = attrs.field(init=False, factory=lambda: SseLines(max_line_chars=MAX_LINE_CHARS))
    _lines: deque[str] = attrs.field(init=False, factory=deque)  # split from the body, not yet read
    _assembler: StreamAssembler = attrs.field(init=False)
    _pending: deque[Delta] = attrs.field(init=False, factory=deque)
    _entered: bool = attrs.field(init=False, default=False)
    _body_ended: bool = attrs.field(init=False, default=False)
    _cut_off: bool = attrs.field(init=False, default=False)  # the connection broke after the model finished
    _quiet_until: float = attrs.field(init=False, default=0.0)  # when the model has been silent too long
    _reasoning_from: float | None = attrs.field(init=False, default=None)  # _quiet_until as its reasoning began to arrive
    _whole: Completion | None = attrs.field(init=False, default=None)  # from a server that would not stream

    @_assembler.default
    def _new_assembler(self) -> StreamAssembler:
        return StreamAssembler(self._client.config.model, max_event_chars=MAX_LINE_CHARS, max_reasoning_chars=MAX_REASONING_CHARS)

    async def __aenter__(self) -> ChatStream:
        if self._entered:
            raise RuntimeError("A ChatStream is read once; call client.stream(request) again for another answer.")
        self._entered = True
        body = request_body(self._request, model=self._client.config.model, stream=True, server=self._client.config.server)
        self._response = await self._client._open_stream(body)
        media = self._response.headers.get("content-type", "").split(";")[0].strip().lower()
        if media == "text/html":  # a proxy's error page, say: not a stream that ended early
            detail = await self._client._body_start(self._response)
            reason = WEB_PAGE + ", not an event stream or JSON"
            raise ModelBadResponse(self._client.config.model, reason, detail=detail, status=self._response.status_code)
        if media == "application/json":
            # A server (or a proxy in front of it) that does not stream answers in one body.
            data = await self._client._read_json(self._response)
            try:
                self._whole = parse_completion(data, model=self._client.config.model)
            except ModelError as exc:
                exc.detail = self._client._scrub_cut(exc.detail)
                raise
            self._pending.extend(_deltas(self._whole))
            return self
        # Not httpx's aiter_lines(): it breaks lines where str.splitlines() does, inside JSON too.
        self._chunks = self._response.aiter_bytes()
        self._quiet_until = trio.current_time() + self._client.config.read_timeout_s
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._chunks is not None and not self._body_ended:
                await self._abandon_body()
        finally:
            if self._response is not None:
                await self._response.aclose()

    async def _abandon_body(self) -> None:
        assert self._chunks is not None, "only called once the body is being read"
        self._body_ended = True
        await _unwind(self._chunks)

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> Delta:
        if self._whole is not None:
            if self._pending:
                return self._pending.popleft()
            raise StopAsyncIteration
        if self._chunks is None:
            raise RuntimeError("Read a ChatStream inside 'async with client.stream(request) as chunks:'.")
        # httpx bounds each wait for bytes; this bounds the wait for data. A server (or a proxy)
        # that sends only keep-alive comments would otherwise hold the answer open forever.
        timeout_s = self._client.config.read_timeout_s
        with trio.CancelScope(deadline=self._quiet_until) as quiet:
            while not self._pending:
                if self._assembler.done:
                    # Read on to the end of the body (nothing follows [DONE]), so the reader ends
                    # on its own rather than being unwound by __aexit__: much cheaper, every call.
                    # Briefly: a server that holds the body open after [DONE] is not waited for.
                    with trio.move_on_after(AFTER_DONE_S):
                        while not self._body_ended and await self._read_line() is not None:
                            pass
                    raise StopAsyncIteration
                line = await self._read_line()
                try:
                    if line is None:
                        self._pending.extend(self._assembler.end_of_stream(cut_off=self._cut_off))
                        continue
                    pieces = self._assembler.pieces
                    self._pending.extend(self._assembler.feed_line(line))
                    if self._assembler.pieces != pieces:  # a chunk holding none of the answer is a heartbeat, as a comment is
                        self._quiet_until = quiet.deadline = trio.current_time() + timeout_s
                    if self._reasoning_from is None and self._assembler.reasoning:
                        self._reasoning_from = self._quiet_until
                except ModelError as exc:  # what the server said may repeat the key it was sent
                    exc.detail = self._client._scrub_cut(exc.detail)
                    raise
            return self._pending.popleft()
        if self._assembler.finished:
            # The model had finished: only what follows its answer (the usage, [DONE], the end
            # of the body) did not come. The answer is whole, as when the connection breaks there.
            if not self._assembler.done:
                self._pending.extend(self._assembler.end_of_stream(cut_off=True))
            if self._pending:
                return self._pending.popleft()
            raise StopAsyncIteration
        waiting_for = part_awaited(self._assembler.started, self._reasoned_s())
        detail = "none of the answer arrived in that time, keep-alive comments or chunks holding none of it at most"
        raise ModelTimeout(self._client.config.model, waiting_for, timeout_s, detail=detail)

    def _reasoned_s(self) -> float | None:
        """How long the model had been reasoning when data last came, if none of its answer has."""
        if self._reasoning_from is None or not self._assembler.reasoning:
            return None
        return self._quiet_until - self._reasoning_from  # each is when data came, plus the timeout

    async def _read_line(self) -> str | None:
        """The next line of the body, or None at its end."""
        while not self._lines:
            if self._body_ended:
                return None
            chunk = await self._read_chunk()
            if chunk is None:
                if self._cut_off:  # a line the break cut in two is a fragment, not a line
                    return None
                return self._splitter.close() or None  # a last line may have no line ending
            try:
                self._lines.extend(self._splitter.feed(chunk))
            except LineTooLong as exc:
                raise ModelBadResponse(self._client.config.model, str(exc)) from None
        return self._lines.popleft()

    async def _read_chunk(self) -> bytes | None:
        """The next bytes of the body, or None at its end."""
        assert self._chunks is not None, "only called once the response is open"
        # Any exception out of the reader, trio.Cancelled included, means it has finished.
        ended = True
        try:
            chunk = await anext(self._chunks)
            ended = False
            return chunk
        except StopAsyncIteration:
            return None
        except httpx.RequestError as exc:
            if self._assembler.finished:  # the answer is whole; only the end of the body was lost
                self._cut_off = True
                return None
            started, reasoning_s = self._assembler.started, self._reasoned_s()
            raise broken_answer(self._client.config, exc, started=started, reasoning_s=reasoning_s) from exc
        finally:
            self._body_ended = ended

    def completion(self) -> Completion:
        """The whole answer; RuntimeError until the stream has been read to its end."""
        whole = self._whole if self._whole is not None else self._assembler.completion()
        return marked_completion(whole, self._client.config.server)

    def partial_message(self) -> Message:
        """What has arrived so far, as an assistant message marked ``partial`` unless complete."""
        message = self._whole.message if self._whole is not None else self._assembler.partial_message()
        return marked(message, self._client.config.server)


def _deltas(whole: Completion) -> list[Delta]:
    """A whole answer as the deltas a stream of it would have carried, in the same order."""
    deltas: list[Delta] = [TextDelta(whole.message.text)] if whole.message.text else []
    deltas.extend(whole.message.tool_calls)
    deltas.append(Finish(whole.finish_reason))
    if whole.usage is not None:
        deltas.append(whole.usage)
    return deltas
