"""A lean HTTP/1.1 client for benchmarks on loopback: one keep-alive connection, one request at
a time, on Trio.

A load generator that shares two cores with the server it measures should spend as little CPU as
it can, and the same little on every server it compares. This client writes a request with
``Content-Length`` and reads the response whole: status line, headers, then a body framed by
``Content-Length`` or chunked encoding (what hypercorn and uvicorn send). It understands nothing
else, and says so (``HttpError``) rather than guess.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import trio

MAX_HEAD = 64 * 1024
READ_SIZE = 64 * 1024


class HttpError(Exception):
    """The server broke the connection or answered something this client does not read."""


class Connection:
    """One connection to ``url``'s host; reconnects when the server closed it between requests."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"this client speaks plain http to host:port, not {url!r}")
        self.host, self.port, self.path = parts.hostname, parts.port, parts.path or "/"
        self._stream: trio.SocketStream | None = None
        self._buffer = bytearray()

    async def post_json(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """POST ``body`` as JSON to the URL's path; the status and the decoded JSON answer."""
        status, raw = await self.request("POST", self.path, json.dumps(body, separators=(",", ":")).encode(), headers)
        try:
            return status, json.loads(raw)
        except ValueError as exc:
            raise HttpError(f"HTTP {status} with a body that is not JSON: {raw[:200]!r}") from exc

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        if self._stream is None:
            try:
                self._stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                raise HttpError(f"could not connect to {self.host}:{self.port}: {exc}") from exc
            self._buffer.clear()
        lines = [f"{method} {path} HTTP/1.1", f"host: {self.host}:{self.port}", f"content-length: {len(body)}"]
        if body:
            lines.append("content-type: application/json")
        lines.extend(f"{name}: {value}" for name, value in (headers or {}).items())
        try:
            await self._stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            status, reply, keep = await self._read_response()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            await self.aclose()
            raise HttpError(f"the connection broke: {exc!r}") from exc
        except BaseException:
            await self.aclose()  # half a response may be buffered: the connection is spoiled
            raise
        if not keep:
            await self.aclose()
        return status, reply

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()

    async def _read_response(self) -> tuple[int, bytes, bool]:
        head = await self._read_until(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(status_line.split(" ", 2)[1])
        except (IndexError, ValueError) as exc:
            raise HttpError(f"not an HTTP status line: {status_line!r}") from exc
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        keep = headers.get("connection", "").lower() != "close"
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return status, await self._read_chunked(), keep
        if "content-length" not in headers:
            raise HttpError(f"HTTP {status} without content-length or chunked encoding")
        return status, await self._read_exactly(int(headers["content-length"])), keep

    async def _read_chunked(self) -> bytes:
        pieces: list[bytes] = []
        while True:
            size = int((await self._read_until(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self._read_until(b"\r\n")  # no trailers are sent to this client
                return b"".join(pieces)
            pieces.append(await self._read_exactly(size))
            await self._read_exactly(2)

    async def _read_until(self, mark: bytes) -> bytes:
        while (end := self._buffer.find(mark)) < 0:
            if len(self._buffer) > MAX_HEAD:
                raise HttpError("a response head longer than 64 KiB")
            await self._fill()
        data = bytes(self._buffer[:end])
        del self._buffer[: end + len(mark)]
        return data

    async def _read_exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            await self._fill()
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    async def _fill(self) -> None:
        assert self._stream is not None
        data = await self._stream.receive_some(READ_SIZE)
        if not data:
            raise HttpError("the server closed the connection in the middle of a response")
        self._buffer += data
