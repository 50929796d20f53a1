"""What a failed exchange with the model server is: a typed ModelError, and whether to try again.

A failure before any response (the transport's exception), a response that is not 2xx (its status,
its Retry-After and the start of its body) and a failure after a 2xx answer each become one error
of ``runtime.models.errors``, with the reason a client may be shown and the detail only the logs
keep. Deciding which, and whether another attempt is safe, needs no connection: it is apart from
the client that sends the requests and sleeps between attempts, and can be read on its own.
"""

from __future__ import annotations

import email.utils
import ipaddress
import math
import ssl
from datetime import datetime, timezone
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import attrs
import httpx

from runtime.models.endpoint import url_credentials, without_credentials
from runtime.models.errors import (
    ModelBadResponse,
    ModelError,
    ModelRateLimited,
    ModelRejected,
    ModelTimeout,
    ModelUnavailable,
)
from runtime.starved import STARVED, starved_reason

if TYPE_CHECKING:
    from runtime.models.endpoint import ModelConfig


@attrs.frozen
class Failure:
    """One attempt's failure: its error, whether another attempt may follow, and after how long
    the server asked it to (Retry-After), if it did."""

    error: ModelError
    retry: bool
    retry_after_s: float | None = None
    retries_at_most: int | None = None  # fewer than the client's max_retries, for this failure

    def __attrs_post_init__(self) -> None:
        self.error.retryable = self.retry  # raised once the client gives up, it still says so


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
# Ollama's 500 when a model does not fit in the memory its machine has free ("model requires more
# system memory (5.5 GiB) than is available (3.2 GiB)"): asked again seconds later it fails the same.
_NO_ROOM_MARKERS = ("requires more system memory",)
_NO_ROOM = "the model server has too little memory free to load the model"
# A redirect is not followed (a POST would be sent again as a GET, a key to another host):
# the base URL is to say where the server is.
_REDIRECT_HINT = ": give AGENT_MODEL_BASE_URL (or --model-base-url) the address it leads to, which the log names"


# A connection not made within its timeout is tried once more, not max_retries times: the kernel
# already sends the connection request again within that timeout (after 1 s, then 3 s), so a host
# that did not answer twice is off or cut off, and each try more only holds the run another
# connect_timeout_s. Its error stays retryable: a resumed run waiting for the model server waits on.
CONNECT_TIMEOUT_RETRIES = 1


def failure_to_send(config: ModelConfig, exc: httpx.RequestError, attempt: int, waiting_for: str) -> Failure:
    """Errors before any response: the server has produced nothing, so retrying is safe.
    ``waiting_for``: what a read timeout says it waited for."""
    model, detail = config.model, _detail(config, exc)
    if isinstance(exc, httpx.ConnectTimeout):
        detail = _timed_out(exc, f"the connection was not made in {config.connect_timeout_s:g}s: {_not_made(config)}")
        error = ModelTimeout(model, None, config.connect_timeout_s, detail=detail, attempts=attempt)
        return Failure(error, retry=True, retries_at_most=CONNECT_TIMEOUT_RETRIES)
    if isinstance(exc, httpx.TimeoutException):
        # The server took the request and is slow to answer it; asking again would only add load.
        said = "took no more of the request" if isinstance(exc, httpx.WriteTimeout) else "sent no byte of the response"
        detail = _timed_out(exc, f"the server {said} in {config.read_timeout_s:g}s")
        error = ModelTimeout(model, waiting_for, config.read_timeout_s, detail=detail, attempts=attempt)
        return Failure(error, retry=False)
    starved = _starved(exc)
    if starved is not None:  # this process's own want, not the model server's: one may come free meanwhile
        reason = f"this server cannot open a connection to it: {starved_reason(starved, 'it')}"
        return Failure(ModelUnavailable(model, reason, detail=detail, attempts=attempt), retry=True)
    tls = _tls_failure(exc)
    if tls is not None:  # a matter of settings or certificates: trying again changes nothing
        return Failure(ModelUnavailable(model, tls, detail=detail, attempts=attempt, may_pass=False), retry=False)
    if isinstance(exc, httpx.ConnectError):
        return Failure(ModelUnavailable(model, "the model server cannot be reached", detail=detail, attempts=attempt), retry=True)
    if isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
        reason = "the connection broke before the answer started"
        return Failure(ModelUnavailable(model, reason, detail=detail, attempts=attempt), retry=True)
    unsent = ModelUnavailable(model, "the request could not be sent", detail=detail, attempts=attempt, may_pass=False)
    return Failure(unsent, retry=False)


def failure_of_status(config: ModelConfig, response: httpx.Response, detail: str, attempt: int) -> Failure:
    """A response that is not 2xx, ``detail`` being the start of its body as the logs keep it:
    429 and 5xx may be tried again, a 4xx or a redirect may not."""
    model, status = config.model, response.status_code
    retry_after_s = _retry_after_s(response.headers.get("retry-after"), response.headers.get("date"))
    if status == 429:
        error: ModelError = ModelRateLimited(model, retry_after_s=retry_after_s, detail=detail, attempts=attempt)
        return Failure(error, retry=True, retry_after_s=retry_after_s)
    if status >= 500 and any(marker in detail.lower() for marker in _NO_ROOM_MARKERS):
        reason = f"{_NO_ROOM} (HTTP {status}); free memory on its machine, or choose a smaller model"
        error = ModelUnavailable(model, reason, detail=detail, status=status, attempts=attempt, may_pass=False)
        return Failure(error, retry=False)
    if status >= 500:
        error = ModelUnavailable(model, f"the server answered HTTP {status}", detail=detail, status=status, attempts=attempt)
        return Failure(error, retry=True, retry_after_s=retry_after_s)
    if status >= 400:
        if status in (400, 413, 422) and any(marker in detail.lower() for marker in _TOO_LONG_MARKERS):
            error = ModelRejected(model, status, detail=detail, attempts=attempt, meaning=_TOO_LONG, hint=_TOO_LONG_HINT)
            return Failure(error, retry=False)
        hint = _NO_PATH_HINT if status == 404 and urlsplit(config.base_url).path in ("", "/") else ""
        error = ModelRejected(model, status, detail=detail, attempts=attempt, sent=_credentials_sent(config), hint=hint)
        return Failure(error, retry=False)
    reason = f"the server answered HTTP {status}"
    if response.has_redirect_location:  # http:// to a server that wants https://, say; not followed
        reason += f", a redirect{_REDIRECT_HINT}"
        detail = f"it redirects to {config.scrub(without_credentials(response.headers['location']))}; {detail}"
    error = ModelBadResponse(model, reason, detail=detail, status=status, attempts=attempt)
    return Failure(error, retry=False)


def refuses_stream_options(error: ModelError) -> bool:
    """Whether ``error`` is a server refusing the ``stream_options`` a streamed request asks for its
    usage with, as some refuse fields they do not know (Azure AI's serverless models, 400: "Extra
    parameters ['stream_options'] are not allowed"), rather than the request itself."""
    return isinstance(error, ModelRejected) and error.status in (400, 422) and "stream_options" in error.detail


def broken_answer(
    config: ModelConfig, exc: httpx.RequestError, *, started: bool, reasoning_s: float | None = None
) -> ModelError:
    """The error for a failure after the server answered 2xx: never retried. ``started`` and
    ``reasoning_s``: see part_awaited."""
    model, detail = config.model, _detail(config, exc)
    if isinstance(exc, httpx.TimeoutException):
        detail = _timed_out(exc, f"the server sent no byte of the answer in {config.read_timeout_s:g}s")
        return ModelTimeout(model, part_awaited(started, reasoning_s), config.read_timeout_s, detail=detail)
    if isinstance(exc, httpx.DecodingError):
        return ModelBadResponse(model, "the body could not be decoded", detail=detail)
    where = "in the middle of the answer" if started else "before the answer started"
    if reasoning_s is not None:
        where = f"while the model was reasoning ({reasoning_s:.1f}s into it), before its answer started"
    return ModelUnavailable(model, f"the connection broke {where}", detail=detail)


def part_awaited(started: bool, reasoning_s: float | None = None) -> str:
    """What a timeout after a 2xx answer was waiting for: ``started``, whether any of the answer
    had arrived (keep-alive comments, whitespace and a stream's opening role are none of it);
    ``reasoning_s``, if the model was reasoning instead, how long it had been (a reasoning model
    can think for minutes before it answers, so "the answer to start" would mislead)."""
    if reasoning_s is not None:
        return f"the model to go on reasoning (it had been reasoning for {reasoning_s:.1f}s; none of its answer had come)"
    return "the rest of the answer" if started else "the answer to start"


def _not_made(config: ModelConfig) -> str:
    """Why a connection is not made in time, where a host that is up and has nothing listening
    refuses it at once. (httpx bounds the look-up of a host's name, and a TLS handshake, by the
    connect timeout too.)"""
    parts = urlsplit(config.base_url)
    causes = ["the host is off or unreachable"]
    if not _is_address(parts.hostname or ""):
        causes.append("its name was not looked up in time (a DNS server that does not answer)")
    causes += ["a firewall drops what is sent to it", "the server has more connections waiting than it takes"]
    if parts.scheme == "https":
        causes.append("the TLS handshake did not finish")
    said = ", ".join(causes[:-1])
    return f"not a refusal, which a host that is up sends at once when nothing listens; {said}, or {causes[-1]}"


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _timed_out(exc: httpx.TimeoutException, what: str) -> str:
    """A timeout's detail for the log: what did not come, and in how long. httpx says nothing of
    its own there, and what it wraps is the event loop's deadline, not the network's doing."""
    return f"{type(exc).__name__}: {what}"


def _detail(config: ModelConfig, exc: Exception) -> str:
    """What the transport said, with what caused it (httpx's own words are often empty), scrubbed:
    some servers echo the key or the credentials they refused, and logs should not keep them."""
    said: list[str] = []
    last = None
    for link in _causes(exc):
        # A group says only how many it holds, and a link that repeats the one it wraps says nothing new.
        if not isinstance(link, BaseExceptionGroup) and str(link) != last:
            said.append(f"{type(link).__name__}: {link}")
            last = str(link)
    return config.scrub("; from ".join(said))


def _credentials_sent(config: ModelConfig) -> str | None:
    if config.api_key:
        return "the API key"
    return "the credentials in the base URL" if any(url_credentials(config.base_url)) else None


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it, outermost first (at most a few links); a group's is its first
    exception (the refusal under "all attempts to connect failed")."""
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain and len(chain) < 6:
        chain.append(link)
        if isinstance(link, BaseExceptionGroup):
            link = link.exceptions[0]
        else:
            link = link.__cause__ or link.__context__
    return chain


def _starved(exc: BaseException) -> int | None:
    """The errno, if ``exc`` comes of this process being out of file descriptors (or the kernel
    out of memory for sockets)."""
    for link in _causes(exc):
        if isinstance(link, OSError) and link.errno in STARVED:
            return link.errno
    return None


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


def _retry_after_s(value: str | None, date: str | None) -> float | None:
    """Retry-After in seconds, given as seconds or as an HTTP-date (a date gone by: 0); None
    when absent or unreadable. A date is read against the response's own Date, the time by the
    same clock, where it has one: this machine's clock may be set otherwise (a wait of an hour
    where the server asked for a second, or none at all)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        when = _http_date(value)
        if when is None:
            return None
        return max(0.0, (when - (_http_date(date) or datetime.now(timezone.utc))).total_seconds())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _http_date(value: str | None) -> datetime | None:
    """An HTTP-date, None when absent or unreadable."""
    if value is None:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when  # "-0000": UTC, as HTTP-dates always are
