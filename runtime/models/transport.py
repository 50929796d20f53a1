"""What the model client adds to httpx's transport: requests that wait their turn for one of the
pool's connections here, and request bodies sent whole.

Apart from the client, which is about what is asked and answered: these are about how each
request goes over the wire, and each works around a cost or a warning of httpx's own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import trio


class QueuedTransport(httpx.AsyncBaseTransport):
    """``transport``, handed at most ``max_requests`` requests at once (one a connection of its
    pool); the others wait their turn here, first come first served.

    httpcore's pool looks at every request waiting in it for each one that starts or ends: with
    hundreds waiting for a slow model, that work grew as their square. 500 runs cancelled at once
    (a drain's end) kept the event loop busy 9 s past the drain, and 500 sends queued took 27 s.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport, max_requests: int) -> None:
        self._transport = transport
        self._turns = trio.CapacityLimiter(max_requests)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        turn = object()  # released by whichever task closes the response
        await self._turns.acquire_on_behalf_of(turn)
        try:
            response = await self._transport.handle_async_request(request)
        except BaseException:
            self._turns.release_on_behalf_of(turn)
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream), "an async transport's"
        response.stream = _Releasing(response.stream, self._turns, turn)
        return response

    async def aclose(self) -> None:
        await self._transport.aclose()


class _Releasing(httpx.AsyncByteStream):
    """A response's body that gives its request's turn back once it is closed."""

    def __init__(self, body: httpx.AsyncByteStream, turns: trio.CapacityLimiter, turn: object) -> None:
        self._body, self._turns, self._turn = body, turns, turn

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._body.__aiter__()

    async def aclose(self) -> None:
        try:
            await self._body.aclose()
        finally:
            if self._turn is not None:
                self._turns.release_on_behalf_of(self._turn)
                self._turn = None


class _Body(httpx.AsyncByteStream):
    """A request's body, whose iterators are not async generators.

    httpx's own body for ``json=`` is one, and a send cancelled while it writes the body (a run
    cancelled while it asks the model) leaves that generator unfinished, for the collector to
    finalize later with a ResourceWarning."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def __aiter__(self) -> _OneChunk:
        return _OneChunk(self._body)


def with_whole_body(request: httpx.Request) -> httpx.Request:
    """``request``, its body sent as one chunk by an iterator that is not an async generator: one
    a cancelled send can leave unfinished without a ResourceWarning (see _Body)."""
    request.stream = _Body(request.content)
    return request


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
