"""A client speaking HTTP/2 with prior knowledge, frame by frame (h2's state machine over a
trio stream), for tests of what a server does with HTTP/2."""

from __future__ import annotations

import attrs
import h2.config
import h2.connection
import h2.events
import trio

from tests.runtime.served import DEADLINE_S


def _connection() -> h2.connection.H2Connection:
    return h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))


@attrs.define(eq=False)
class Http2Client:
    stream: trio.SocketStream
    connection: h2.connection.H2Connection = attrs.field(factory=_connection)
    closed: bool = False
    _answers: dict[int, tuple[int, bytearray, bool]] = attrs.field(factory=dict)  # status, body, ended

    @classmethod
    async def open(cls, host: str, port: int) -> Http2Client:
        client = cls(await trio.open_tcp_stream(host, port))
        client.connection.initiate_connection()
        await client._flush()
        return client

    async def request(self, path: str, headers: dict[str, str], body: bytes = b"", *, end: bool = True) -> int:
        """Send a POST (its body whole, unless ``end`` is false); the id of its stream."""
        stream_id = self.connection.get_next_available_stream_id()
        fields = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "localhost"), *headers.items()]
        self.connection.send_headers(stream_id, fields, end_stream=end and not body)
        if body:
            self.connection.send_data(stream_id, body, end_stream=end)
        await self._flush()
        return stream_id

    async def send_data(self, stream_id: int, data: bytes) -> None:
        self.connection.send_data(stream_id, data)
        await self._flush()

    async def answer(self, stream_id: int) -> tuple[int, bytes]:
        """The status and body of the answer on ``stream_id``, once it has ended."""
        with trio.fail_after(DEADLINE_S):
            while not self._answers.get(stream_id, (0, b"", False))[2]:
                assert not self.closed, "the server closed the connection before it answered"
                await self._read()
        status, body, _ended = self._answers[stream_id]
        return status, bytes(body)

    async def wait_closed(self) -> None:
        """Read until the server closes the connection."""
        with trio.fail_after(DEADLINE_S):
            while not self.closed:
                await self._read()

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def _read(self) -> None:
        try:
            data = await self.stream.receive_some()
        except trio.BrokenResourceError:
            data = b""
        if not data:
            self.closed = True
            return
        for event in self.connection.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id is not None:
                fields = dict(event.headers or [])
                self._answers[event.stream_id] = (int(fields.get(b":status", b"0")), bytearray(), False)
            elif isinstance(event, h2.events.DataReceived) and event.stream_id is not None:
                self._answers[event.stream_id][1].extend(event.data or b"")
                self.connection.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id is not None:
                code, body, _ended = self._answers[event.stream_id]
                self._answers[event.stream_id] = (code, body, True)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.closed = True
        await self._flush()

    async def _flush(self) -> None:
        if data := self.connection.data_to_send():
            try:
                await self.stream.send_all(data)
            except trio.BrokenResourceError:
                self.closed = True
