"""The HTTP server under the A2A surface: hypercorn's protocol code, on an accept loop of our own.

``hypercorn.trio.serve`` runs every connection in one nursery with the listeners, so a connection
whose handling raises ends the whole server. Hypercorn 0.18's protocol code does raise on some
requests any client can send: a WebSocket upgrade request with bytes after it (h11's
LocalProtocolError), data on an HTTP/2 stream already answered (a KeyError). Here such a
connection is closed and logged in one line; every other connection goes on.

What hypercorn logs with a traceback (a request its own code failed on, such as the WebSocket
one above) goes to the log in one line (``OneLine``).

A connection the client has closed is let go at once, not when hypercorn's keep-alive timer ends
(``_Connection``).

An offer to upgrade to HTTP/2 (``Upgrade: h2c``) is declined, the request answered over HTTP/1.1
(``_Http11``): the app answers nothing over HTTP/2 (see runtime.surface.app), and hypercorn took
the offer up only for the request to be refused there.

When accept(2) fails for want of file descriptors (or memory), ``trio.serve_listeners`` logs a
traceback every 0.1 s until it succeeds; here it is one line a minute at most, naming the limit.
The connections waiting meanwhile stay in the listen queue, and are taken once descriptors free up.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import hypercorn
import trio
from hypercorn.events import Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState, Framework, LifespanState, TaskGroup
from hypercorn.utils import repr_socket_addr, wrap_app

from runtime.starved import STARVED, starved_reason

if TYPE_CHECKING:
    import h11

logger = logging.getLogger(__name__)

ACCEPT_RETRY_S = 0.1
STARVED_LOG_EVERY_S = 60.0


async def serve_http(
    app: Framework,
    config: hypercorn.Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``config``'s plain-TCP sockets until ``shutdown_trigger`` returns, then
    give the connections ``config.graceful_timeout`` to finish; reports the URLs it serves at.

    Blocks until every connection has closed. Cancelled, the connections are cut at once. Raises
    what the app's lifespan raises; never what one connection raises.
    """
    asgi = wrap_app(app, config.wsgi_max_body_size, None)
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(asgi, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            sockets = config.create_sockets().insecure_sockets
            for sock in sockets:
                sock.listen(config.backlog)  # again for sockets taken earlier: it only sets the backlog
            binds = [f"http://{repr_socket_addr(sock.family, sock.getsockname())}" for sock in sockets]
            for bind in binds:
                await config.log.info(f"Running on {bind} (CTRL + C to quit)")
            handler = functools.partial(_serve_connection, asgi, config, context, ConnectionState(lifespan_state.copy()))
            try:
                async with trio.open_nursery() as accepting:
                    for sock in sockets:
                        accepting.start_soon(_accept, trio.SocketListener(trio.socket.from_stdlib_socket(sock)), connections, handler)
                    task_status.started(binds)
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
            finally:
                await context.terminated.set()  # keep-alive connections close after their request
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _accept(
    listener: trio.SocketListener, connections: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> None:
    starved_logged_at = -STARVED_LOG_EVERY_S
    starved_since: float | None = None  # when the warning last said it could not accept
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in STARVED:
                    raise
                if trio.current_time() - starved_logged_at >= STARVED_LOG_EVERY_S:
                    starved_logged_at = trio.current_time()
                    starved_since = starved_since if starved_since is not None else starved_logged_at
                    logger.warning(
                        "cannot accept connections: %s; they wait in the listen queue until some close."
                        " Raise the limit, or find what holds so many connections (said at most once a minute)",
                        starved_reason(exc.errno or 0),
                    )
                await trio.sleep(ACCEPT_RETRY_S)
            else:
                if starved_since is not None:  # once for each warning at most: never a flood
                    logger.info("accepting connections again, %.0f s after it could not", trio.current_time() - starved_since)
                    starved_since = None
                connections.start_soon(handler, stream)


async def _serve_connection(
    app: AppWrapper,
    config: hypercorn.Config,
    context: WorkerContext,
    state: ConnectionState,
    stream: trio.SocketStream,
) -> None:
    """One connection, as hypercorn serves it; a failure in hypercorn's handling of it closes it."""
    try:
        peer = repr_socket_addr(stream.socket.family, stream.socket.getpeername())
    except OSError:  # the client has gone already
        peer = "a client"
    try:
        # Typed for TLS streams; hypercorn's own serve hands it plain ones too, as here.
        await _Connection(app, config, context, state, stream)  # type: ignore[arg-type]
    except* Exception as failed:
        logger.warning("closed the connection from %s: the HTTP server failed on what it sent (%s)", peer, _reasons(failed))
        logger.debug("how the HTTP server failed", exc_info=failed)
    finally:
        await trio.aclose_forcefully(stream)


class _Connection(TCPServer):
    """hypercorn's connection, let go as soon as the client has closed it, on a cheaper idle timer.

    hypercorn's own waits out its keep-alive timer (5 s) after the client has gone, holding a file
    descriptor all along: 500 connections opened and closed at once held 500 descriptors for 5 s,
    so a client opening and closing 200 a second would hold 1000, all a common limit of 1024
    leaves. Once the client has closed (or the read failed), every request still in flight has
    been told it is over, and nothing the timer would do is left to do.
    """

    def __init__(
        self,
        app: AppWrapper,
        config: hypercorn.Config,
        context: WorkerContext,
        state: LifespanState,
        stream: trio.SSLStream[trio.SocketStream],  # typed as hypercorn types it (see _serve_connection)
    ) -> None:
        super().__init__(app, config, context, state, stream)
        self.idle_task = self._idle = _IdleTimer(self)

    @property  # hypercorn's attribute, which its run() sets: the HTTP/1.1 protocol in it is swapped for _Http11
    def protocol(self) -> ProtocolWrapper:
        return self._protocol

    @protocol.setter
    def protocol(self, wrapper: ProtocolWrapper) -> None:
        if type(wrapper.protocol) is H11Protocol:
            wrapper.protocol = _Http11(
                wrapper.app, wrapper.config, wrapper.context, wrapper.task_group, wrapper.state,
                wrapper.ssl, wrapper.client, wrapper.server, wrapper.send,
            )  # fmt: skip
        self._protocol = wrapper

    async def _read_data(self) -> None:
        await super()._read_data()
        self._idle.end()

    async def protocol_send(self, event: Event) -> None:
        # h11 ends a body of a known length with no bytes: sent, they cost a lock, a cancel
        # scope and a pass through the scheduler, for each response.
        if not (isinstance(event, RawData) and not event.data):
            await super().protocol_send(event)

    async def close_idle(self) -> None:
        await self._initiate_server_close()


class _Http11(H11Protocol):
    """hypercorn's HTTP/1.1, declining an offer to upgrade to HTTP/2 (RFC 9110 7.8: a server may
    ignore ``Upgrade``): the request is answered over HTTP/1.1, and the connection goes on so.

    Java's HttpClient makes the offer on every plain-http request without a body, by default
    (``curl --http2`` too); taken up, the request was answered 505 over HTTP/2, so such a client
    could not even read the agent card. A client that speaks HTTP/2 from its first bytes (prior
    knowledge) is still answered 505 over HTTP/2, which it reads.
    """

    async def _check_protocol(self, event: h11.Request) -> None:
        if not any(name == b"upgrade" and value.strip().lower() == b"h2c" for name, value in event.headers):
            await super()._check_protocol(event)


class _IdleTimer(TrioSingleTask):
    """The connection's keep-alive timer, as hypercorn's: ``restart`` as the connection goes idle
    (it is closed ``keep_alive_timeout`` later, or at once if the server is terminating), ``stop``
    as a request comes in. hypercorn starts a task for each idle spell and cancels it at the next
    request; here one task waits for the connection's life, and its deadline moves: a request
    spawns, wakes and ends no task of it."""

    def __init__(self, connection: _Connection) -> None:
        super().__init__()
        self._connection = connection
        self._deadline = math.inf  # when the idle connection is closed; never while a request is under way
        self._wait: trio.CancelScope | None = None  # the watcher's wait, with that deadline
        self._watching: trio.CancelScope | None = None  # the watcher's whole life (see end)

    async def restart(self, task_group: TaskGroup, action: Callable[[], Awaitable[None]]) -> None:
        # ``action`` is hypercorn's own timer (TCPServer._idle_timeout): _watch does what it does.
        if self._connection.context.terminated.is_set():
            self._deadline = -math.inf
        else:
            self._deadline = trio.current_time() + self._connection.config.keep_alive_timeout
        if self._wait is None:  # started in hypercorn's nursery, as its own timer is
            await task_group._nursery.start(self._watch)  # type: ignore[attr-defined]  # a hypercorn.trio TaskGroup
        else:
            self._wait.deadline = self._deadline

    async def stop(self) -> None:
        self._deadline = math.inf
        if self._wait is not None:
            self._wait.deadline = math.inf

    def end(self) -> None:
        """The connection is over: the watcher goes (a restart after this starts another)."""
        if self._watching is not None:
            self._watching.cancel()

    async def _watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        terminated = self._connection.context.terminated
        try:
            with trio.CancelScope() as self._watching:
                while True:
                    with trio.CancelScope(deadline=self._deadline) as self._wait:
                        task_status.started()  # the first wait is in place for restart to move
                        task_status = trio.TASK_STATUS_IGNORED  # and it is started once
                        await (trio.sleep_forever() if terminated.is_set() else terminated.wait())
                    # Idle too long, or the server is terminating. A connection that is busy
                    # then is closed once it goes idle (restart moves the deadline to the past).
                    if self._deadline != math.inf:
                        break
                with trio.CancelScope(shield=True):
                    await self._connection.close_idle()
        finally:
            self._wait = self._watching = None


class OneLine(logging.Filter):
    """Puts a record logged with a traceback on one line: its message, then what was raised."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is not None and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()} ({_reasons(record.exc_info[1])})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def _reasons(exc: BaseException) -> str:
    """What was raised, type and message, without the cancellations it caused."""
    leaves = [leaf for leaf in _leaves(exc) if not isinstance(leaf, trio.Cancelled)]
    return "; ".join(dict.fromkeys(f"{type(leaf).__name__}: {leaf}" for leaf in leaves)) or type(exc).__name__


def _leaves(exc: BaseException) -> list[BaseException]:
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
