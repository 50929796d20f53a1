"""What real HTTP clients and the proxies in front of a server send it, on a real socket: the server
(runtime.server.serve, with its own HTTP layer) answers them as the HTTP RFCs say."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import h11
import trio

from fake_model import FakeModel
from runtime.config import Config
from runtime.server import _http_config
from tests.e2e.served_server import running_server
from tests.runtime.served import DEADLINE_S

# What Java's HttpClient adds by default to a request without a body over plain http (curl --http2 the same).
H2C_OFFER = (("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", "h2c"), ("HTTP2-Settings", "AAMAAABkAAQCAAAAAAIAAAAA"))


async def open_stream(url: str) -> trio.SocketStream:
    address = urlsplit(url)
    assert address.hostname is not None and address.port is not None
    return await trio.open_tcp_stream(address.hostname, address.port)


async def get(stream: trio.SocketStream, client: h11.Connection, path: str, *headers: tuple[str, str]) -> tuple[int, bytes]:
    """GET ``path`` over ``stream`` as ``client`` (an HTTP/1.1 client's state): the status of the answer, and its body."""
    await stream.send_all(client.send(h11.Request(method="GET", target=path, headers=[("Host", "keel"), *headers])))
    await stream.send_all(client.send(h11.EndOfMessage()))
    status, body = 0, bytearray()
    with trio.fail_after(DEADLINE_S):
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await stream.receive_some())
            elif isinstance(event, h11.InformationalResponse | h11.Response):
                status = event.status_code
                if status == 101:  # the server switched protocols: what follows is no HTTP/1.1
                    return status, b""
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                client.start_next_cycle()
                return status, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise AssertionError(f"the server closed the connection before it answered GET {path}")


async def test_an_offer_to_upgrade_to_http2_is_declined_and_the_request_answered_over_http_1_1(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Taken up, only for the request to be answered 505 over HTTP/2, the offer left a client that
    # makes it (Java's HttpClient, by default) unable to read even the agent card.
    async with running_server(tmp_path / "state", fake_model.base_url) as server, await open_stream(server.url) as stream:
        client = h11.Connection(h11.CLIENT)
        status, card = await get(stream, client, "/.well-known/agent-card.json", *H2C_OFFER)
        assert status == 200, status
        assert json.loads(card)["supportedInterfaces"][0]["url"] == "http://keel/"
        # The connection goes on in HTTP/1.1, the offer made again and declined again.
        assert await get(stream, client, "/livez", *H2C_OFFER) == (200, b'{"status":"alive"}')


async def test_a_request_framed_both_by_content_length_and_by_chunks_is_answered_and_its_connection_closed(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # RFC 9112 6.1: a proxy that reads such a request by its Content-Length sends on a body that
    # this server, reading its chunks, ends sooner; the rest, taken for a request of its own, would
    # be answered to whichever client the proxy gives that connection next. The server must close it.
    get_task = b'{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"x"}}'
    smuggled = b"GET /livez HTTP/1.1\r\nHost: keel\r\nConnection: close\r\n\r\n"
    body = b"%x\r\n%s\r\n0\r\n\r\n%s" % (len(get_task), get_task, smuggled)
    head = (
        b"POST / HTTP/1.1\r\nHost: keel\r\nContent-Type: application/json\r\nA2A-Version: 1.0\r\n"
        b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    async with running_server(tmp_path / "state", fake_model.base_url) as server:
        received = bytearray()
        with trio.fail_after(DEADLINE_S):
            async with await open_stream(server.url) as stream:
                await stream.send_all(head + body)
                while chunk := await stream.receive_some():
                    received += chunk
    assert received.count(b"HTTP/1.1 ") == 1, bytes(received)  # the request's answer, and only it
    assert b"connection: close" in received.lower() and b'"TASK_NOT_FOUND"' in received, bytes(received)


async def test_an_idle_connection_is_kept_as_long_as_the_keep_alive_setting_says(tmp_path: Path, fake_model: FakeModel) -> None:
    # A proxy keeps its connections to the server open for a while (nginx's upstream keepalive,
    # a cloud load balancer's 60 s or more): the server must keep them longer, or the proxy sends
    # a request on one just as the server closes it, and its client gets a 502. Shorter here.
    keep_s = 0.5
    async with (
        running_server(tmp_path / "state", fake_model.base_url, keep_alive_s=keep_s) as server,
        await open_stream(server.url) as stream,
    ):
        client = h11.Connection(h11.CLIENT)
        assert (await get(stream, client, "/livez"))[0] == 200
        idle_since = trio.current_time()
        with trio.fail_after(DEADLINE_S):
            assert await stream.receive_some() == b""  # closed by the server
        idle_for = trio.current_time() - idle_since
        # Sooner than by default: closed after the setting, not after hypercorn's own 5 s.
        assert keep_s <= idle_for < Config().keep_alive_s, idle_for


def test_the_keep_alive_setting_is_the_http_servers() -> None:
    assert _http_config(Config.load({"AGENT_KEEP_ALIVE_S": "75"})).keep_alive_timeout == 75.0
    assert _http_config(Config.load({})).keep_alive_timeout == 5.0
