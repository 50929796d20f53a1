"""`python -m runtime serve` behind a real nginx, configured as the common guides say, with the
fake model over real HTTP: streams, long blocking sends, the agent card, and pooled connections."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio

from fake_model import FakeModel, Reply
from protocol import SseParser
from tests.e2e.harness import headers, keel_process, rpc, user_message, wait_stored_state
from tests.e2e.nginx import nginx_in_front_of
from tests.runtime.served import EventStream

# The a2a-sdk client's own HTTP client gives up on a read silent for 5 s: so does this one.
CLIENT_TIMEOUT = httpx.Timeout(10, read=5)


Timed = list[tuple[float, dict[str, Any]]]


async def _timed_events(client: httpx.AsyncClient, url: str, method: str, params: dict[str, Any]) -> Timed:
    """The JSON-RPC responses of an SSE stream, each with the time it arrived."""
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    parser = SseParser()
    events: Timed = []
    async with client.stream("POST", url, json=body, headers=headers("1.0")) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        async for chunk in response.aiter_bytes():
            events.extend((trio.current_time(), json.loads(event.data)) for event in parser.feed(chunk) if event.data)
    return events


def _texts(events: Timed) -> list[tuple[float, str]]:
    """The answer's pieces as they came, each with the time it arrived; the last is the whole text."""
    pieces: list[tuple[float, str]] = []
    for at, event in events:
        update = event["result"].get("artifactUpdate")
        if update is not None:
            pieces.append((at, "".join(part["text"] for part in update["artifact"]["parts"])))
    return pieces


async def test_a_streaming_send_through_nginx_arrives_piece_by_piece(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="one two three four five six", chunk_chars=4, gap_s=0.4)]
    async with (
        keel_process(tmp_path / "state", fake_model.base_url) as keel,
        nginx_in_front_of(keel.url, tmp_path / "nginx") as nginx,
        httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client,
    ):
        events = await _timed_events(client, nginx.url, "SendStreamingMessage", {"message": user_message("count")})
        pieces = _texts(events)
        assert "".join(text for _, text in pieces[:-1]) == pieces[-1][1] == "one two three four five six"
        assert events[-1][1]["result"]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
        # Seven pieces 0.4 s apart: had nginx held them, they would all come at the end.
        assert pieces[-1][0] - pieces[0][0] > 1.5, pieces


async def test_a_subscription_through_nginx_arrives_piece_by_piece(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="one two three four five six", chunk_chars=4, gap_s=0.4, delay_s=0.5)]
    async with (
        keel_process(tmp_path / "state", fake_model.base_url) as keel,
        nginx_in_front_of(keel.url, tmp_path / "nginx") as nginx,
        httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client,
    ):
        send = {"message": user_message("count"), "configuration": {"returnImmediately": True}}
        task_id = (await rpc(client, nginx.url, "SendMessage", send))["result"]["task"]["id"]
        events = await _timed_events(client, nginx.url, "SubscribeToTask", {"id": task_id})
        assert events[0][1]["result"]["task"]["id"] == task_id
        pieces = _texts(events)
        assert pieces[-1][1] == "one two three four five six"
        assert len(pieces) > 3 and pieces[-1][0] - pieces[0][0] > 1, pieces


async def test_a_quiet_stream_through_nginx_outlives_its_read_timeout(tmp_path: Path, fake_model: FakeModel) -> None:
    """Keel's keep-alive comment every 3 s keeps nginx (and a client) reading past 5 s of quiet."""
    fake_model.script = [Reply(text="at last", delay_s=8)]
    async with (
        keel_process(tmp_path / "state", fake_model.base_url) as keel,
        nginx_in_front_of(keel.url, tmp_path / "nginx", read_timeout_s=5) as nginx,
        httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client,
    ):
        events = await _timed_events(client, nginx.url, "SendStreamingMessage", {"message": user_message("wait")})
        assert _texts(events)[-1][1] == "at last"
        assert events[-1][0] - events[0][0] > 7
        assert events[-1][1]["result"]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"


async def test_a_long_blocking_send_through_nginx_gets_its_answer(tmp_path: Path, fake_model: FakeModel) -> None:
    """A run longer than nginx's read timeout and the client's: the spaces Keel sends meanwhile
    reach the client, rather than wait in nginx's buffer."""
    fake_model.script = [Reply(text="done at last", delay_s=8)]
    async with (
        keel_process(tmp_path / "state", fake_model.base_url) as keel,
        nginx_in_front_of(keel.url, tmp_path / "nginx", read_timeout_s=5) as nginx,
        httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client,
    ):
        answer = await rpc(client, nginx.url, "SendMessage", {"message": user_message("wait")})
        task = answer["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_COMPLETED"
        assert task["artifacts"][0]["parts"][0]["text"] == "done at last"


async def test_the_agent_card_behind_nginx_names_the_public_url(tmp_path: Path, fake_model: FakeModel) -> None:
    public = "https://agents.example.com/keel/"
    async with (
        keel_process(tmp_path / "state", fake_model.base_url, "--public-url", public) as keel,
        nginx_in_front_of(keel.url, tmp_path / "nginx") as nginx,
        httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client,
    ):
        card = (await client.get(nginx.url + ".well-known/agent-card.json")).json()
        assert card["supportedInterfaces"][0]["url"] == public
        assert public[:-1] not in json.dumps(card).replace(public, "")


async def test_a_client_leaving_a_stream_through_nginx_ends_only_its_subscription(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.script = [Reply(text="one two three four five six", chunk_chars=4, gap_s=0.3)]
    state = tmp_path / "state"
    async with (
        keel_process(state, fake_model.base_url) as keel,
        nginx_in_front_of(keel.url, tmp_path / "nginx") as nginx,
        httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client,
    ):
        body = {"jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage", "params": {"message": user_message("count")}}
        request = client.build_request("POST", nginx.url, json=body, headers=headers("1.0"))
        events = EventStream(await client.send(request, stream=True))
        try:
            first = await events.next()
            assert first is not None
            task_id = first["result"]["task"]["id"]
        finally:
            await events.close()
        # The client has gone, nginx has closed its connection to Keel: the run goes on.
        assert await wait_stored_state(state, task_id, ["TASK_STATE_COMPLETED"]) == "TASK_STATE_COMPLETED"
        task = (await rpc(client, nginx.url, "GetTask", {"id": task_id}))["result"]
        assert task["artifacts"][0]["parts"][0]["text"] == "one two three four five six"
        assert b"Traceback" not in keel.output


async def test_nginx_closing_its_idle_connections_before_keel_never_answers_502(tmp_path: Path, fake_model: FakeModel) -> None:
    """The advice for a proxy that pools its connections: Keel's keep-alive longer than the proxy's
    idle timeout. Requests sent just as nginx lets a pooled connection go are each answered."""
    nginx_idle_s = 0.3
    async with (
        keel_process(tmp_path / "state", fake_model.base_url, "--keep-alive-s", "2") as keel,
        nginx_in_front_of(keel.url, tmp_path / "nginx", upstream_idle_s=nginx_idle_s) as nginx,
        httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client,
    ):
        statuses = []
        for attempt in range(30):
            body = {"jsonrpc": "2.0", "id": attempt, "method": "ListTasks", "params": {}}
            response = await client.post(nginx.url, json=body, headers=headers("1.0"))
            statuses.append(response.status_code)
            # Idle for nginx's timeout, give or take 10 ms: the connection is let go about now.
            await trio.sleep(nginx_idle_s - 0.01 + attempt % 20 * 0.001)
        assert statuses == [200] * 30, nginx.error_log.read_text()
