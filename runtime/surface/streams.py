"""Server-sent event answers: SendStreamingMessage / message/stream, SubscribeToTask /
tasks/resubscribe.

A stream begins with the Task (spec 1.0 §3.1.2, §3.1.6), carries its status and artifact
updates, and closes after a terminal or interrupted state; in 0.3 that last status update says
``final: true``. While nothing happens it sends a comment every ``keepalive_s`` so that proxies
keep the connection open.

``TaskEventStream`` is a quart ``ResponseBody``: quart-trio enters it, iterates it and leaves it
in the request's own task. Entering opens the runner subscription and leaving closes it; each
``__anext__`` waits for one event (or the keep-alive) inside its own call, and returns its frames
with those of the events already waiting, so no cancel scope or nursery is ever held across a
yield. A client that disconnects gets its request task cancelled, which ends this subscription
and nothing else: the run lives in the runner's nursery.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AsyncExitStack
from types import TracebackType
from typing import Protocol

import attrs
import trio
from quart import Response
from quart.wrappers.response import ResponseBody

from protocol import (
    ProtocolError,
    ProtocolVersion,
    RequestId,
    StreamEvent,
    Task,
    TaskArtifactUpdateEvent,
    TaskStatusUpdateEvent,
    encode_comment,
    encode_event,
    ends_stream,
    error_response,
    stream_event_to_json,
    success_response,
)
from protocol.sse import HEADERS
from runtime.surface.failures import answer_to
from runtime.tasks import StreamItem


class Subscriptions(Protocol):
    """What a stream needs of the runner."""

    def subscribe(self, owner: str, task_id: str) -> AbstractAsyncContextManager[trio.MemoryReceiveChannel[StreamItem]]: ...

KEEPALIVE = encode_comment("keep-alive")
WRITE_BYTES = 1 << 20  # what one write takes of the events waiting (one event may be larger)


def event_stream_response(stream: TaskEventStream) -> Response:
    """A 200 ``text/event-stream`` response that streams until the task settles."""
    response = Response(stream, status=200, headers=dict(HEADERS))
    response.timeout = None  # quart's RESPONSE_TIMEOUT would cut a long task's stream
    return response


@attrs.define(eq=False)
class TaskEventStream(ResponseBody):
    """The events of one task as SSE frames, each a JSON-RPC response to ``request_id``.

    ``first`` is a Task the caller already has (the one a streaming send created): it is the
    first frame, sent before the subscription opens, and what the subscription's own snapshot
    adds to it goes out as updates. Without it the snapshot itself is the first frame.
    """

    runner: Subscriptions
    owner: str
    task_id: str
    request_id: RequestId
    version: ProtocolVersion
    keepalive_s: float
    method: str  # the request's, which an error it ends with names
    first: Task | None = None
    _exits: AsyncExitStack = attrs.field(init=False, factory=AsyncExitStack)
    _events: trio.MemoryReceiveChannel[StreamItem] | None = attrs.field(init=False, default=None)
    _frames: bytearray = attrs.field(init=False, factory=bytearray)  # to send, next write
    _last_task: Task | None = attrs.field(init=False, default=None)
    _ended: bool = attrs.field(init=False, default=False)

    async def __aenter__(self) -> TaskEventStream:
        if self.first is not None:
            self._send(self.first)
        if self._ended:
            return self
        try:
            self._events = await self._exits.enter_async_context(self.runner.subscribe(self.owner, self.task_id))
        except Exception as exc:  # the task vanished after the request was checked, or the store failed
            # The answer's status and headers are sent: what went wrong is its one event.
            self._frames.extend(encode_event(error_response(self.request_id, answer_to(self.method, exc), self.version)))
            self._ended = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._exits.aclose()

    def __aiter__(self) -> TaskEventStream:
        return self

    async def __anext__(self) -> bytes:
        while not self._frames:
            if self._ended:
                raise StopAsyncIteration
            await self._wait_for_event()
        # The frames queued go out in one write. A write per event would take a pass of the
        # scheduler each, while a model streaming small pieces publishes hundreds in one: a client
        # reading as fast as it can would fall SUBSCRIBER_BUFFER events behind, and be cut off.
        frames = bytes(self._frames)
        self._frames.clear()
        return frames

    async def _wait_for_event(self) -> None:
        """Queue the frames of the next event, or a keep-alive after ``keepalive_s`` of quiet;
        then those of the events already waiting, up to WRITE_BYTES of frames."""
        assert self._events is not None, "the stream is iterated only once entered"
        with trio.move_on_after(self.keepalive_s) as idle:
            try:
                event = await self._events.receive()
            except trio.EndOfChannel:  # after the event that ended the stream, or a StreamCut
                self._ended = True
                return
        if idle.cancelled_caught:
            self._frames.extend(KEEPALIVE)
            return
        self._take(event)
        while not self._ended and len(self._frames) < WRITE_BYTES:
            try:
                self._take(self._events.receive_nowait())
            except trio.WouldBlock:
                return
            except trio.EndOfChannel:
                self._ended = True

    def _take(self, event: StreamItem) -> None:
        """Queue the frames of one event of the subscription."""
        if isinstance(event, ProtocolError):  # cut short: the client is told why, and what to do
            self._frames.extend(encode_event(error_response(self.request_id, event, self.version)))
            self._ended = True
            return
        if isinstance(event, Task) and self._last_task is not None:
            for update in _updates_since(self._last_task, event):
                self._send(update)
            self._last_task = event
            return
        self._send(event)

    def _send(self, event: StreamEvent) -> None:
        if self._ended:
            return
        if isinstance(event, Task):
            self._last_task = event
        self._frames.extend(self._frame(event))
        self._ended = ends_stream(event)
        if self._ended and isinstance(event, Task) and self.version is ProtocolVersion.V0_3:
            # A 0.3 client reads until final:true, which only a status update carries.
            self._frames.extend(self._frame(TaskStatusUpdateEvent(task_id=event.id, context_id=event.context_id, status=event.status)))

    def _frame(self, event: StreamEvent) -> bytes:
        return encode_event(success_response(self.request_id, stream_event_to_json(event, self.version)))


def _updates_since(sent: Task, now: Task) -> list[StreamEvent]:
    """The updates that turn ``sent`` into ``now``: what happened to the task between the
    moment a streaming send created it and the moment its subscription opened.

    In the order they happened: a new status first (WORKING comes before any of the answer),
    unless it ends the task, which comes last. An artifact is whole (``lastChunk``) only in an
    ended task; mid-answer it is the text so far, and the pieces that follow append to it."""
    ended = now.status.state.ends_stream
    artifacts: list[StreamEvent] = [
        TaskArtifactUpdateEvent(task_id=now.id, context_id=now.context_id, artifact=artifact, last_chunk=ended)
        for artifact in now.artifacts
        if artifact not in sent.artifacts
    ]
    if now.status == sent.status:
        return artifacts
    status = TaskStatusUpdateEvent(task_id=now.id, context_id=now.context_id, status=now.status)
    return [*artifacts, status] if ended else [status, *artifacts]

