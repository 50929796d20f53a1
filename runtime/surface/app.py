"""The A2A surface: a Quart-Trio app over the runner.

The server builds it once everything it needs is open, and serves it::

    readiness = Readiness()
    app = create_app(runner=runner, card_for=card_for, health=Health(state_dir=..., model=model),
                     readiness=readiness)
    ... await hypercorn.trio.serve(app, hypercorn_config, shutdown_trigger=...)  # in the root nursery
    readiness.set()  # once the server is up: until then every route answers 503

``runner`` is the started Runner. ``card_for(url)`` returns the AgentCard to serve, given the URL
the JSON-RPC endpoint is reached at (``lambda _url: card`` for a fixed card). ``health`` says
what ``/healthz`` probes. ``config`` holds the limits, with defaults.

Routes::

    POST {rpc_path}                      JSON-RPC 2.0, A2A 1.0 and 0.3 (jsonrpc.py, streams.py)
    GET  /.well-known/agent-card.json    the agent card (card.py); also at /.well-known/agent.json
    GET  /livez                          200 {"status":"alive"}, depending on nothing
    GET  /healthz                        200 {"status":"ready"} or 503 {"status":"unready","problems":[...]}

Anything else is a plain HTTP 404 (or 405): an unrouted path is not the protocol. A request over
HTTP/2 is answered 505, whatever its path (see ``_http1_only``). Handlers hold
the runner, never a nursery: a run lives in the runner's nursery, so a request that ends or a
client that goes away ends only that request.
"""

from __future__ import annotations

import codecs
import logging
from typing import TYPE_CHECKING, Any

import attrs
import trio
from quart import Response
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers
from werkzeug.exceptions import HTTPException

from runtime.runner import ANONYMOUS
from runtime.surface.card import CARD_PATH, CARD_PATH_0_2, CardEndpoint, CardFor
from runtime.surface.health import NOT_STARTED, Health, Readiness
from runtime.surface.jsonrpc import JsonRpcEndpoint, json_response

if TYPE_CHECKING:
    from runtime.runner import Runner

logger = logging.getLogger(__name__)


def _absolute_path(_instance: object, _attribute: object, path: str) -> None:
    if not path.startswith("/"):
        raise ValueError(f"rpc_path must start with '/', got {path!r}")


@attrs.frozen(kw_only=True)
class SurfaceConfig:
    rpc_path: str = attrs.field(default="/", validator=_absolute_path)
    """Where JSON-RPC is served; "/a2a" also answers at "/a2a/" and the other way round."""
    max_body_bytes: int = attrs.field(default=1 << 20, validator=attrs.validators.ge(1))
    body_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    """How long a request body may take to arrive whole."""
    keepalive_s: float = attrs.field(default=3.0, validator=attrs.validators.gt(0))
    """How long a stream may stay silent before it sends a keep-alive comment: less than the 5 s
    the a2a-sdk client waits for a read by default (httpx's timeout), so that its stream outlasts
    a run that is silent (waiting its turn, calling a tool, or a model still thinking)."""
    public_url: str | None = None
    """Where clients reach the server (through a proxy that ends TLS, say): the agent card names
    it, rather than the address a request came in on."""


# The codecs every request uses: werkzeug's routing encodes the request's host as IDNA, and the
# JSON-RPC parser decodes the body as UTF-8 with a byte-order mark. Each is a module read from disk
# the first time it is looked up: left to the first requests, a process out of file descriptors
# failed every one with HTTP 500 (and an error in the log) until a descriptor came free.
REQUEST_CODECS = ("idna", "utf-8-sig")


def create_app(
    *, runner: Runner, card_for: CardFor, health: Health, readiness: Readiness, config: SurfaceConfig = SurfaceConfig()
) -> QuartTrio:
    """The app; building it starts nothing (hypercorn runs it, the runner is already running)."""
    for codec in REQUEST_CODECS:
        codecs.lookup(codec)
    app = QuartTrio(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.config["BODY_TIMEOUT"] = config.body_timeout_s
    rpc = JsonRpcEndpoint(runner, ANONYMOUS, config.max_body_bytes, config.body_timeout_s, config.keepalive_s)
    for index, path in enumerate(_rpc_paths(config.rpc_path)):
        app.add_url_rule(path, f"jsonrpc{index}", rpc.handle, methods=["POST"], strict_slashes=False)
    card = CardEndpoint(card_for, config.rpc_path, config.public_url)
    for index, path in enumerate((CARD_PATH, CARD_PATH_0_2)):
        app.add_url_rule(path, f"agent_card{index}", card.handle, methods=["GET"])
    app.add_url_rule("/livez", "livez", _alive, methods=["GET"])
    app.add_url_rule("/healthz", "healthz", _Readiness(health).handle, methods=["GET"])

    async def refuse_until_ready() -> Response | None:
        return None if readiness.is_set() else unready([NOT_STARTED])

    app.before_request(refuse_until_ready)
    app.register_error_handler(HTTPException, _plain_http_error)
    app.register_error_handler(Exception, _internal_error)
    asgi_app = _closing_after_ambiguous_framing(_ending_uncancelled(_http1_only(app.asgi_app)))
    app.asgi_app = asgi_app  # type: ignore[method-assign]
    return app


FINAL_SEND_BOUND_S = 60.0  # a client taking none of it is cut off sooner (AGENT_SEND_TIMEOUT_S)
Asgi = Any  # an ASGI callable, message or send: hypercorn's typing is richer than this module needs


def _ending_uncancelled(asgi_app: Asgi) -> Asgi:
    """The app, with the last message of each response sent shielded from cancellation.

    hypercorn ends the exchange inside that send: it tells the app the request is over
    (``http.disconnect``), then closes the connection if it is not kept alive (the client sent
    ``Connection: close``, spoke HTTP/1.0, or was refused before its body was read). Quart-Trio
    cancels its own send as soon as it hears ``http.disconnect``, so the close was cut off midway
    and the connection stayed open until the client gave up: a client that reads to the end of
    the connection waited forever.
    """

    async def app(scope: Asgi, receive: Asgi, send: Asgi) -> None:
        if scope["type"] != "http":
            await asgi_app(scope, receive, send)
            return

        async def send_ending_uncancelled(message: Asgi) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.move_on_after(FINAL_SEND_BOUND_S, shield=True):
                    await send(message)
            else:
                await send(message)

        await asgi_app(scope, receive, send_ending_uncancelled)

    return app


def _closing_after_ambiguous_framing(asgi_app: Asgi) -> Asgi:
    """The app, closing the connection after answering a request framed both by Content-Length
    and by Transfer-Encoding, as RFC 9112 6.1 says a server must.

    hypercorn reads such a body by its chunks and kept the connection open. A proxy in front that
    reads it by its Content-Length sends on a body that ends later: the rest, read here as a
    request of its own, would be answered to whichever client the proxy gives the connection next.
    """

    async def app(scope: Asgi, receive: Asgi, send: Asgi) -> None:
        names = {name for name, _value in scope.get("headers", ())}  # lower case, as ASGI gives them
        if scope["type"] != "http" or not {b"content-length", b"transfer-encoding"} <= names:
            await asgi_app(scope, receive, send)
            return

        async def send_closing(message: Asgi) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await asgi_app(scope, receive, send_closing)

    return app


HTTP2_REFUSED = b"505 HTTP Version Not Supported: this server speaks HTTP/1.1; send the request over HTTP/1.1\n"


def _http1_only(asgi_app: Asgi) -> Asgi:
    """The app, answering every request made over HTTP/2 with 505 and nothing else.

    HTTP/2 has flow control of its own: a client that reads its socket but never opens its
    window holds each answer in the server's memory for as long as it stays connected, where
    AGENT_SEND_TIMEOUT_S cannot reach it (the kernel sees a socket that takes everything). Twenty
    such connections asking a hundred times each for a task of 1 MB held 3.9 GB. A2A's JSON-RPC
    binding needs no more than HTTP/1.1, and a 505 is small enough to go out in any window.
    """

    async def app(scope: Asgi, receive: Asgi, send: Asgi) -> None:
        if scope["type"] == "http" and scope.get("http_version") == "2":
            await send({"type": "http.response.start", "status": 505, "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
            await send({"type": "http.response.body", "body": HTTP2_REFUSED})
            return
        await asgi_app(scope, receive, send)

    return app


def _rpc_paths(path: str) -> list[str]:
    bare = path.rstrip("/")
    return ["/"] if not bare else [bare, bare + "/"]


def unready(problems: list[str]) -> Response:
    return json_response({"status": "unready", "problems": problems}, status=503)


async def _alive() -> Response:
    return json_response({"status": "alive"})


@attrs.frozen
class _Readiness:
    health: Health

    async def handle(self) -> Response:
        problems = await self.health.problems()
        return unready(problems) if problems else json_response({"status": "ready"})


async def _plain_http_error(error: HTTPException) -> Response:
    """404, 405 and the like as one line of text (and an Allow header for 405), not an HTML page."""
    headers = Headers([(name, value) for name, value in error.get_headers() if name.lower() != "content-type"])
    status = error.code or 500
    return Response(f"{status} {error.name}\n", status=status, headers=headers, content_type="text/plain; charset=utf-8")


async def _internal_error(error: Exception) -> Response:
    logger.error("unexpected error outside JSON-RPC", exc_info=error)
    return Response("500 Internal Server Error\n", status=500, content_type="text/plain; charset=utf-8")
