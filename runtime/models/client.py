"""An OpenAI-compatible chat-completions client over ``httpx.AsyncClient``.

It speaks to Ollama, vLLM, the llama.cpp server and hosted APIs alike, and stores nothing: each
call sends the whole request it is given. Failures before the server has started an answer
(connection refused or reset, HTTP 429, HTTP 5xx) are retried a bounded number of times with
exponential backoff. Once the server has answered 2xx the call is never retried, streamed or not:
part of the answer may already be in the caller's hands, and a second request would say it twice.
"""

from __future__ import annotations

import base64
import email.utils
import json
import logging
import math
import ssl
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from types import TracebackType
from typing import Any
from urllib.parse import SplitResult, unquote, unquote_plus, urlsplit, urlunsplit

import attrs
import httpx
import trio

from persistence.transcript import Message
from protocol import SseLines
from protocol.sse import LineTooLong
from runtime.models.assembly import StreamAssembler
from runtime.models.errors import (
    ModelBadResponse,
    ModelError,
    ModelRateLimited,
    ModelRejected,
    ModelTimeout,
    ModelUnavailable,
)
from runtime.models.values import ChatRequest, Completion, Delta, Finish, TextDelta
from runtime.models.wire import SAID_CHARS, parse_completion, request_body

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:11434/v1"  # a local Ollama
DEFAULT_MODEL = "qwen3:4b-instruct"
_DETAIL_CHARS = 2000  # how much of a server's error body is kept for the logs
# Far past any answer the agent keeps (a message is at most 1 MiB stored, ~6 MiB JSON-escaped):
# a server that sends more is not answering, and is not held in memory to find that out.
MAX_BODY_BYTES = 32 << 20
MAX_LINE_CHARS = 16 << 20  # one line of a streamed answer, and one event's data lines together: one chunk of it


def _check_base_url(_instance: object, _attribute: object, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the model base URL must be an http:// or https:// URL with a host, for example {DEFAULT_BASE_URL}")
    if misplaced_at(url):
        raise ValueError(MISPLACED_AT)
    if port_unusable(parts):
        raise ValueError(f"the model base URL's port must be a whole number from 1 to 65535, for example {DEFAULT_BASE_URL}")


def port_unusable(parts: SplitResult) -> bool:
    """Whether a URL names a port no server listens on: past 65535, or 0 (which urlsplit takes)."""
    try:
        return parts.port == 0
    except ValueError:
        return True


MISPLACED_AT = (
    "it holds an '@' after its host: credentials holding '/', '?' or '#' must be percent-encoded"
    " (%2F, %3F, %23) to be read as credentials rather than as the host and path"
)


def misplaced_at(url: str) -> bool:
    """Whether ``url`` holds an '@' that is not the end of its credentials: one in its path,
    query or fragment, where a password written with a '/', '?' or '#' puts it."""
    parts = urlsplit(url)
    return "@" in parts.path or "@" in parts.query or "@" in parts.fragment


# Stands in for a character a URL parser drops (see without_credentials): a private-use one,
# which it keeps.
_HELD = 0xE000


def without_credentials(url: str) -> str:
    """``url`` as it may be shown: what it carries before an ``@`` (a user name can be a key
    too, and a password is one), and the values of its query (where some APIs take their key),
    replaced by ``***``. What a URL parser drops (a tab or a newline within it, control
    characters and spaces at either end) is shown where it was: the URL shown is the one given."""
    held = "".join(chr(_HELD + ord(c)) if c <= " " else c for c in url)
    return "".join(chr(ord(c) - _HELD) if _HELD <= ord(c) <= _HELD + 0x20 else c for c in _masked(held))


def _masked(url: str) -> str:
    try:
        scheme, slashes, rest = url.partition("//")
        if slashes and "@" in rest:
            # Up to the last '@', wherever it is: a password may hold a '/', '?' or '#' that
            # was not percent-encoded, and then urlsplit takes part of it for the path or query.
            url = f"{scheme}//***@{rest.rpartition('@')[2]}"
        parts = urlsplit(url)
        query = "&".join(f"{name.partition('=')[0]}=***" for name in parts.query.split("&")) if parts.query else ""
        return urlunsplit(parts._replace(query=query))
    except ValueError:
        return "(not shown: it cannot be read as a URL)"


def url_credentials(url: str) -> tuple[str, str]:
    """The user name and password ``url`` carries before its ``@``, decoded: what httpx sends
    as HTTP Basic auth when either is not empty. ``("", "")`` when it carries none."""
    parts = urlsplit(url)
    return unquote(parts.username or ""), unquote(parts.password or "")


@attrs.frozen
class ModelConfig:
    """Where the model is and how long to wait for it.

    ``read_timeout_s`` bounds each wait for data: for the answer to start, and between two
    pieces of it (keep-alive comments and events with empty data in a stream, and whitespace in
    a whole JSON answer, are not data). A bound on the whole call is the caller's
    ``trio.fail_after``. At most ``max_connections`` requests are open at once; the others wait
    their turn for as long as it takes (as a model server queues what it cannot run yet), never
    failing for it.
    """

    base_url: str = attrs.field(default=DEFAULT_BASE_URL, validator=_check_base_url, repr=without_credentials)
    model: str = attrs.field(default=DEFAULT_MODEL, validator=attrs.validators.min_len(1))
    api_key: str | None = attrs.field(default=None, repr=False)
    connect_timeout_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    read_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    max_retries: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    backoff_base_s: float = attrs.field(default=0.5, validator=attrs.validators.ge(0))
    backoff_max_s: float = attrs.field(default=8.0, validator=attrs.validators.ge(0))
    max_connections: int = attrs.field(default=100, validator=attrs.validators.ge(1))

    def __attrs_post_init__(self) -> None:
        # httpx would send the URL's credentials as HTTP Basic auth in place of the key.
        if self.api_key and any(url_credentials(self.base_url)):
            raise ValueError(
                "the model base URL carries credentials (before its '@') and an API key is given too: only one can be"
                " sent; take them out of the URL to send the key, or give no key to send them as HTTP Basic auth"
            )

    def url(self, path: str) -> str:
        """``path`` under the base URL, its query (where some APIs take a version) kept."""
        parts = urlsplit(self.base_url)
        return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{path}"))

    @property
    def endpoint(self) -> str:
        """The base URL without credentials or query, fit for a log line or an operator."""
        parts = urlsplit(self.base_url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"

    def scrub(self, text: str) -> str:
        """``text`` (what a server or the transport said) with the secrets of this config masked,
        in each form a server may repeat them: the API key; the base URL's credentials as the
        HTTP Basic token they are sent as, as ``user:password`` (decoded or as written), and the
        password alone, or the user name alone when it comes without one (a key, then)."""
        for secret, mask in self._secrets():
            text = text.replace(secret, mask)
        return text

    def _secrets(self) -> list[tuple[str, str]]:
        found = [(self.api_key, "[api key]")] if self.api_key else []
        user, password = url_credentials(self.base_url)
        if user or password:
            parts = urlsplit(self.base_url)
            written_user, written_password = parts.username or "", parts.password or ""
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            alone = (password, written_password) if password else (user, written_user)
            candidates = (token, token.rstrip("="), f"{user}:{password}", f"{written_user}:{written_password}", *alone)
            found.extend((secret, "[credentials]") for secret in candidates if secret)
        # The values of its query (where some APIs take their key), as written and decoded:
        # sent with every request, and hidden wherever the URL is shown. A value too short to
        # be a key (``v=1``) is left, or every "1" of what the server said would be masked.
        query = urlsplit(self.base_url).query
        values = {form for pair in query.split("&") for form in (pair.partition("=")[2], unquote_plus(pair.partition("=")[2]))}
        found.extend((value, "[query value]") for value in sorted(values, key=len, reverse=True) if len(value) >= 8)
        return found


@asynccontextmanager
async def open_model_client(config: ModelConfig) -> AsyncIterator[ModelClient]:
    """A ModelClient with its own connection pool, closed when the block exits.

    Proxy settings are not read from the environment (nothing below ``main`` reads it); a local
    model server is reached directly.
    """
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, limits=limits) as http:
        yield ModelClient(config, http)


AFTER_DONE_S = 1.0  # how long the body may stay open after [DONE] before it is let go


class _Body(httpx.AsyncByteStream):
    """A request's body, whose iterators are not async generators.

    httpx's own body for ``json=`` is one, and a send cancelled while it writes the body (a run
    cancelled while it asks the model) leaves that generator unfinished, for the collector to
    finalize later with a ResourceWarning."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def __aiter__(self) -> _OneChunk:
        return _OneChunk(self._body)


class _OneChunk:
    def __init__(self, body: bytes) -> None:
        self._body: bytes | None = body

    def __aiter__(self) -> _OneChunk:
        return self

    async def __anext__(self) -> bytes:
        if self._body is None:
            raise StopAsyncIteration
        body, self._body = self._body, None
        return body


@attrs.frozen
class _Failure:
    error: ModelError
    retry: bool
    retry_after_s: float | None = None


# A base URL given as the server's bare address, without the /v1 Ollama, vLLM and llama.cpp
# serve their API under: the most common reason for a 404. (A path of its own is a gateway's.)
_NO_PATH_HINT = (
    "; the base URL has no path: add the /v1 that OpenAI-compatible servers serve under to AGENT_MODEL_BASE_URL"
    " (or --model-base-url)"
)
# How servers refuse a request that holds more tokens than the model reads at once: OpenAI's
# code, vLLM's words, llama.cpp's (error type and words), and those of others like them.
_TOO_LONG_MARKERS = ("context_length_exceeded", "maximum context length", "context length", "context size", "context window")
_TOO_LONG = "the conversation is longer than the model can read at once"
_TOO_LONG_HINT = "; send the next message without a contextId, to start a new conversation"
# A redirect is not followed (a POST would be sent again as a GET, a key to another host):
# the base URL is to say where the server is.
_REDIRECT_HINT = ": give AGENT_MODEL_BASE_URL (or --model-base-url) the address it leads to, which the log names"
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

    async def complete(self, request: ChatRequest) -> Completion:
        """The model's next message, in one piece.

        Blocks until the whole answer has arrived. Cancellation closes the connection. Raises a
        ModelError subclass; ValueError when the transcript cannot be sent.
        """
        body = request_body(request, model=self.config.model, stream=False)
        response = await self._open("POST", "chat/completions", body, accept="application/json")
        data = await self._read_json(response)
        try:
            return parse_completion(data, model=self.config.model)
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
        """The ids in the server's catalog (``GET {base}/models``). Raises a ModelError subclass."""
        response = await self._open("GET", "models", None, accept="application/json", waiting_for="the catalog")
        data = await self._read_json(response)
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ModelBadResponse(self.config.model, "the model catalog has no list of models")
        return tuple(entry["id"] for entry in entries if isinstance(entry, dict) and isinstance(entry.get("id"), str))

    async def has_model(self, name: str | None = None) -> bool:
        """Whether the server's catalog offers ``name`` (by default the configured model).

        A readiness check: it runs no inference. A name without a tag also matches Ollama's
        ``name:latest``. Raises a ModelError subclass when the catalog cannot be read.
        """
        wanted = name or self.config.model
        models = await self.list_models()
        return wanted in models or (":" not in wanted and f"{wanted}:latest" in models)

    async def _open(
        self, method: str, path: str, body: dict[str, Any] | None, *, accept: str, waiting_for: str = "the answer to start"
    ) -> httpx.Response:
        """Send with retries; returns a 2xx response whose body is unread. The caller closes it.
        ``waiting_for``: what a timeout says it waited for."""
        url = self.config.url(path)
        # No bound on the wait for one of the pool's connections: with max_connections calls
        # already open (a slow local model holds each for its whole answer), a call waits its
        # turn instead of failing. Cancelling the caller ends the wait.
        timeout = httpx.Timeout(
            connect=self.config.connect_timeout_s, read=self.config.read_timeout_s,
            write=self.config.read_timeout_s, pool=None,
        )
        attempt = 0
        while True:
            attempt += 1
            try:
                request = self._http.build_request(method, url, json=body, headers=self._headers(accept), timeout=timeout)
                request.stream = _Body(request.content)
                response = await self._http.send(request, stream=True)
            except httpx.RequestError as exc:
                failure = self._failure_to_send(exc, attempt, waiting_for)
            else:
                if response.is_success:
                    return response
                failure = await self._failure_status(response, attempt)
            await self._wait_to_retry(failure, attempt)

    async def _wait_to_retry(self, failure: _Failure, attempt: int) -> None:
        """Sleep before the next attempt, or raise the failure's error if there is none."""
        if not failure.retry or attempt > self.config.max_retries:
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

    def _failure_to_send(self, exc: httpx.RequestError, attempt: int, waiting_for: str) -> _Failure:
        """Errors before any response: the server has produced nothing, so retrying is safe."""
        model, detail = self.config.model, self._detail(exc)
        if isinstance(exc, httpx.ConnectTimeout):
            error = ModelTimeout(model, "a connection", self.config.connect_timeout_s, detail=detail, attempts=attempt)
            return _Failure(error, retry=True)
        if isinstance(exc, httpx.TimeoutException):
            # The server took the request and is slow to answer it; asking again would only add load.
            error = ModelTimeout(model, waiting_for, self.config.read_timeout_s, detail=detail, attempts=attempt)
            return _Failure(error, retry=False)
        tls = _tls_failure(exc)
        if tls is not None:  # a matter of settings or certificates: trying again changes nothing
            return _Failure(ModelUnavailable(model, tls, detail=detail, attempts=attempt), retry=False)
        if isinstance(exc, httpx.ConnectError):
            return _Failure(ModelUnavailable(model, "the model server cannot be reached", detail=detail, attempts=attempt), retry=True)
        if isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
            reason = "the connection broke before the answer started"
            return _Failure(ModelUnavailable(model, reason, detail=detail, attempts=attempt), retry=True)
        return _Failure(ModelUnavailable(model, "the request could not be sent", detail=detail, attempts=attempt), retry=False)

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

    async def _failure_status(self, response: httpx.Response, attempt: int) -> _Failure:
        model, status = self.config.model, response.status_code
        detail = await self._body_start(response)
        retry_after_s = _retry_after_s(response.headers.get("retry-after"))
        if status == 429:
            error: ModelError = ModelRateLimited(model, retry_after_s=retry_after_s, detail=detail, attempts=attempt)
            return _Failure(error, retry=True, retry_after_s=retry_after_s)
        if status >= 500:
            error = ModelUnavailable(model, f"the server answered HTTP {status}", detail=detail, status=status, attempts=attempt)
            return _Failure(error, retry=True, retry_after_s=retry_after_s)
        if status >= 400:
            if status in (400, 413, 422) and any(marker in detail.lower() for marker in _TOO_LONG_MARKERS):
                error = ModelRejected(model, status, detail=detail, attempts=attempt, meaning=_TOO_LONG, hint=_TOO_LONG_HINT)
                return _Failure(error, retry=False)
            hint = _NO_PATH_HINT if status == 404 and urlsplit(self.config.base_url).path in ("", "/") else ""
            error = ModelRejected(model, status, detail=detail, attempts=attempt, sent=self._credentials_sent(), hint=hint)
            return _Failure(error, retry=False)
        reason = f"the server answered HTTP {status}"
        if response.has_redirect_location:  # http:// to a server that wants https://, say; not followed
            reason += f", a redirect{_REDIRECT_HINT}"
            detail = f"it redirects to {self._scrub(without_credentials(response.headers['location']))}; {detail}"
        error = ModelBadResponse(model, reason, detail=detail, status=status, attempts=attempt)
        return _Failure(error, retry=False)

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
            raise self._broken_answer(exc, started=_any_data(pieces)) from exc
        finally:
            await response.aclose()
        if quiet.cancelled_caught:
            started = _any_data(pieces)
            detail = "part of the JSON arrived, then whitespace at most" if started else "no JSON arrived, whitespace at most"
            raise ModelTimeout(model, _waiting_for(started), timeout_s, detail=detail)
        raw = b"".join(pieces)
        if len(raw) > MAX_BODY_BYTES:
            raise ModelBadResponse(model, f"the body is larger than {MAX_BODY_BYTES} bytes")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            detail = self._scrub_cut(raw[:SAID_CHARS].decode("utf-8", "replace"))
            media = response.headers.get("content-type", "").split(";")[0].strip().lower()
            reason = WEB_PAGE + ", not JSON" if media == "text/html" else "the body is not JSON"  # a proxy's error page, say
            raise ModelBadResponse(model, reason, detail=detail) from exc

    def _broken_answer(self, exc: httpx.RequestError, *, started: bool) -> ModelError:
        """The error for a failure after the server answered 2xx: never retried. ``started``:
        whether any of the answer had arrived."""
        model, detail = self.config.model, self._detail(exc)
        if isinstance(exc, httpx.TimeoutException):
            return ModelTimeout(model, _waiting_for(started), self.config.read_timeout_s, detail=detail)
        if isinstance(exc, httpx.DecodingError):
            return ModelBadResponse(model, "the body could not be decoded", detail=detail)
        where = "in the middle of the answer" if started else "before the answer started"
        return ModelUnavailable(model, f"the connection broke {where}", detail=detail)

    def _detail(self, exc: Exception) -> str:
        """What the transport said, with what caused it (httpx's own words are often empty)."""
        return self._scrub("; from ".join(f"{type(link).__name__}: {link}" for link in _causes(exc)))

    def _credentials_sent(self) -> str | None:
        if self.config.api_key:
            return "the API key"
        return "the credentials in the base URL" if any(url_credentials(self.config.base_url)) else None

    def _scrub_cut(self, text: str) -> str:
        """``text`` scrubbed, then cut to what the log keeps (in that order: a secret across the
        cut would no longer match)."""
        return self._scrub(text)[:_DETAIL_CHARS]

    def _scrub(self, text: str) -> str:
        # Some servers echo the key or the credentials they refused; logs should not keep them either.
        return self.config.scrub(text)


def _waiting_for(started: bool) -> str:
    """What a timeout after a 2xx answer was waiting for: ``started``, whether any of the answer
    had arrived (keep-alive comments, whitespace and a stream's opening role are none of it)."""
    return "the rest of the answer" if started else "the answer to start"


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


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it, outermost first (at most a few links)."""
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain and len(chain) < 4:
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def _tls_failure(exc: BaseException) -> str | None:
    """Why a TLS handshake failed, in words for a client and what to change, or None."""
    for link in _causes(exc):
        if isinstance(link, ssl.SSLCertVerificationError):
            return (
                "its TLS certificate is not trusted here; give the server a certificate this machine trusts"
                " (or add its authority to the system's trust store)"
            )
        if isinstance(link, ssl.SSLError):
            if link.reason == "WRONG_VERSION_NUMBER":
                return "it does not speak TLS at that address; check http:// or https:// in AGENT_MODEL_BASE_URL"
            return "the TLS handshake with it failed"
    return None


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After in seconds, given as seconds or as an HTTP-date (a date gone by: 0); None
    when absent or unreadable."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # "-0000": UTC, as HTTP-dates always are
            when = when.replace(tzinfo=timezone.utc)
        return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


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
    _whole: Completion | None = attrs.field(init=False, default=None)  # from a server that would not stream

    @_assembler.default
    def _new_assembler(self) -> StreamAssembler:
        return StreamAssembler(self._client.config.model, max_event_chars=MAX_LINE_CHARS)

    async def __aenter__(self) -> ChatStream:
        if self._entered:
            raise RuntimeError("A ChatStream is read once; call client.stream(request) again for another answer.")
        self._entered = True
        body = request_body(self._request, model=self._client.config.model, stream=True)
        self._response = await self._client._open("POST", "chat/completions", body, accept="text/event-stream")
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
                    field, _, value = line.partition(":")
                    if field == "data" and value.strip():  # an event with empty data is a heartbeat, as a comment is
                        self._quiet_until = quiet.deadline = trio.current_time() + timeout_s
                    self._pending.extend(self._assembler.feed_line(line))
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
        waiting_for, detail = _waiting_for(self._assembler.started), "no data arrived in that time, keep-alive comments at most"
        raise ModelTimeout(self._client.config.model, waiting_for, timeout_s, detail=detail)

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
            raise self._client._broken_answer(exc, started=self._assembler.started) from exc
        finally:
            self._body_ended = ended

    def completion(self) -> Completion:
        """The whole answer; RuntimeError until the stream has been read to its end."""
        return self._whole if self._whole is not None else self._assembler.completion()

    def partial_message(self) -> Message:
        """What has arrived so far, as an assistant message marked ``partial`` unless complete."""
        return self._whole.message if self._whole is not None else self._assembler.partial_message()


def _deltas(whole: Completion) -> list[Delta]:
    """A whole answer as the deltas a stream of it would have carried, in the same order."""
    deltas: list[Delta] = [TextDelta(whole.message.text)] if whole.message.text else []
    deltas.extend(whole.message.tool_calls)
    deltas.append(Finish(whole.finish_reason))
    if whole.usage is not None:
        deltas.append(whole.usage)
    return deltas
