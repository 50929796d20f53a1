"""A zero-latency OpenAI-compatible model for benchmarks: a TEST DOUBLE, it answers from a script.

Keel's model client always speaks HTTP to a base URL; this is that URL's far end, made as cheap
as an honest HTTP server can be, so that a benchmark measures Keel and not its model. It serves
``POST /v1/chat/completions`` (streamed as server-sent events, or in one body) and
``GET /v1/models`` over real HTTP/1.1 with keep-alive, on a bare asyncio protocol: requests are
parsed (request line, headers, Content-Length body) but the body is not decoded, and every
answer is bytes built once at start-up.

Every request gets ``--reply`` at once, except one whose body contains ``--slow-marker``: that
one is streamed one word every ``--slow-gap-s`` for ``--slow-s`` seconds (chunked encoding), the
long task a benchmark cancels. A client that leaves ends its stream.

    python scripts/bench/zero_model.py [--port 0] [--reply ok]

prints ``zero model (a test double) serving http://127.0.0.1:PORT/v1`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

MODEL = "qwen3:4b-instruct"  # Keel's default model name; any name is accepted
MAX_HEAD = 64 * 1024


def _event(delta: dict[str, object] | None, finish: str | None = None, *, usage: bool = False) -> bytes:
    chunk: dict[str, object] = {"id": "chatcmpl-zero", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    if usage:
        chunk["choices"] = []
        chunk["usage"] = {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}
    else:
        chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _response(status: str, content_type: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class Answers:
    """Every response this server can give, as bytes."""

    def __init__(self, reply: str) -> None:
        stream = b"".join(
            [
                _event({"role": "assistant", "content": ""}),
                _event({"content": reply}),
                _event({}, "stop"),
                _event(None, usage=True),
                b"data: [DONE]\n\n",
            ]
        )
        self.stream = _response("200 OK", "text/event-stream", stream)
        message = {"role": "assistant", "content": reply}
        whole = {
            "id": "chatcmpl-zero", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
        }  # fmt: skip
        self.whole = _response("200 OK", "application/json", json.dumps(whole).encode())
        catalog = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "keel-bench"}]}
        self.catalog = _response("200 OK", "application/json", json.dumps(catalog).encode())
        self.not_found = _response("404 Not Found", "application/json", b'{"error":{"message":"no such route"}}')
        self.slow_head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        self.slow_first = _chunk(_event({"role": "assistant", "content": ""}))
        self.slow_word = _chunk(_event({"content": "tick "}))
        self.slow_end = _chunk(_event({}, "stop")) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class ModelProtocol(asyncio.Protocol):
    def __init__(self, answers: Answers, marker: bytes, gap_s: float, slow_s: float) -> None:
        self.answers = answers
        self.marker = marker
        self.gap_s = gap_s
        self.slow_s = slow_s
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.slow: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.slow is not None:
            self.slow.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and self.slow is None and self._one_request():
            pass

    def _one_request(self) -> bool:
        """Answer the first whole request in the buffer; False when there is none yet."""
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                self._close()
            return False
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buffer) < end + 4 + length:
            return False
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        method, path, _ = lines[0].split(b" ", 2)
        self._answer(method, path, body)
        return True

    def _answer(self, method: bytes, path: bytes, body: bytes) -> None:
        assert self.transport is not None
        if method == b"GET" and path == b"/v1/models":
            self.transport.write(self.answers.catalog)
        elif method != b"POST" or path != b"/v1/chat/completions":
            self.transport.write(self.answers.not_found)
        elif self.marker in body:
            self.transport.write(self.answers.slow_head + self.answers.slow_first)
            self._tick(time.monotonic() + self.slow_s)
        elif b'"stream":true' in body.replace(b" ", b""):
            self.transport.write(self.answers.stream)
        else:
            self.transport.write(self.answers.whole)

    def _tick(self, until: float) -> None:
        if self.transport is None:
            return
        if time.monotonic() >= until:
            self.slow = None
            self.transport.write(self.answers.slow_end)
            self.data_received(b"")  # a request that came in meanwhile
            return
        self.transport.write(self.answers.slow_word)
        self.slow = asyncio.get_running_loop().call_later(self.gap_s, self._tick, until)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve(host: str, port: int, reply: str, marker: str, gap_s: float, slow_s: float) -> None:
    loop = asyncio.get_running_loop()
    answers = Answers(reply)
    server = await loop.create_server(lambda: ModelProtocol(answers, marker.encode(), gap_s, slow_s), host, port)
    bound = server.sockets[0].getsockname()
    print(f"zero model (a test double) serving http://{bound[0]}:{bound[1]}/v1", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A zero-latency OpenAI-compatible model server (a test double).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port; the URL is printed")
    parser.add_argument("--reply", default="ok", help="the text of every answer")
    parser.add_argument("--slow-marker", default="[slow]", help="a request whose body holds this gets the slow answer")
    parser.add_argument("--slow-gap-s", type=float, default=0.05, help="seconds between two words of a slow answer")
    parser.add_argument("--slow-s", type=float, default=30.0, help="how long a slow answer lasts")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.reply, args.slow_marker, args.slow_gap_s, args.slow_s))


if __name__ == "__main__":
    main()
