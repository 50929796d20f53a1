"""runtime.server.serve end to end: the root nursery's shutdown, and what clients never see."""

from __future__ import annotations

import functools
import logging
import os
import socket
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import httpx
import pytest
import trio
import trio.testing

import runtime.server
from fake_model import FakeModel, Reply
from persistence.errors import DatabaseBusy
from persistence.sessions import SqliteSessionStore
from persistence.tasks import open_task_store
from protocol import TaskState
from runtime.agent import AgentSpec
from runtime.config import Config
from runtime.models import ChatRequest
from runtime.runner import ANONYMOUS
from runtime.tasks import decode
from tests.e2e.harness import rpc, stored_task, user_message
from tests.e2e.served_server import running_server
from tests.runtime.agent_support import Answer, ScriptedStream
from tests.runtime.http2 import Http2Client
from tests.runtime.served import DEADLINE_S, GATE_CALL, Gate
from tests.runtime.test_turns import left_by_a_dead_process


async def test_shutdown_refuses_new_tasks_reports_unready_and_lets_a_running_task_finish(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    gate = Gate()
    agent = AgentSpec(system_prompt="test", tools=(gate.tool(),))
    fake_model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="done after the gate")]
    async with httpx.AsyncClient(timeout=30) as client, running_server(tmp_path / "state", fake_model.base_url, agent=agent) as server:
        sent = await rpc(client, server.url, "SendMessage", {"message": user_message("hold"), "configuration": {"returnImmediately": True}})
        task_id = sent["result"]["task"]["id"]
        await gate.wait_entered()
        server.shutdown.set()
        with trio.fail_after(10):
            while (health := await client.get(server.url + "healthz")).status_code == 200:
                await trio.sleep(0.01)
        assert health.json() == {"status": "unready", "problems": ["the server is shutting down: it takes no new tasks"]}
        refused = await rpc(client, server.url, "SendMessage", {"message": user_message("too late")})
        assert refused["error"]["code"] == -32004 and "shutting down" in refused["error"]["message"]
        working = await rpc(client, server.url, "GetTask", {"id": task_id})
        assert working["result"]["status"]["state"] == "TASK_STATE_WORKING"
        gate.opened.set()
        with trio.fail_after(30):
            await server.stopped.wait()
    state, task = stored_task(tmp_path / "state", task_id)  # type: ignore[misc]
    assert state == "TASK_STATE_COMPLETED"
    assert task["status"]["message"]["parts"] == [{"text": "done after the gate"}]


async def test_a_clients_task_metadata_comes_back_exactly_as_sent(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.default = Reply(text="ok")
    metadata = {"mine": 1, "keel": {"transcriptStart": "theirs"}}  # even under the server's own name
    async with httpx.AsyncClient(timeout=30) as client, running_server(tmp_path / "state", fake_model.base_url) as server:
        sent = await rpc(client, server.url, "SendMessage", {"message": user_message("hi"), "metadata": metadata})
        task = sent["result"]["task"]
        got = (await rpc(client, server.url, "GetTask", {"id": task["id"]}))["result"]
        listed = (await rpc(client, server.url, "ListTasks", {}))["result"]["tasks"]
        for seen in (task, got, *listed):
            assert seen["metadata"] == metadata


async def test_healthz_names_an_unreachable_model_server_without_waiting_on_retries(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    async with httpx.AsyncClient(timeout=30) as client, running_server(tmp_path / "state", dead_url) as server:
        assert (await client.get(server.url + "livez")).json() == {"status": "alive"}
        with trio.fail_after(3):  # one attempt, not the request path's retries with backoff
            health = await client.get(server.url + "healthz")
        assert health.status_code == 503
        problems = health.json()["problems"]
        assert problems == [
            f"model server unavailable: its catalog could not be read to find 'qwen3:4b-instruct': "
            "the model server cannot be reached"
        ]


async def test_healthz_leaves_the_model_unchecked_when_told_to(
    tmp_path: Path, fake_model: FakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    # Azure OpenAI's catalog lists its base models, and requests name a deployment; some gateways
    # have no catalog at all. With model_check "off", /healthz does not ask for one.
    caplog.set_level(logging.INFO, logger="runtime.server")
    fake_model.models, fake_model.deployments = ("gpt-4o-2024-11-20",), ("gpt-4o-prod",)
    fake_model.default = Reply(text="ok")
    async with (
        httpx.AsyncClient(timeout=30) as client,
        running_server(tmp_path / "state", fake_model.base_url, model="gpt-4o-prod", model_check="off") as server,
    ):
        health = await client.get(server.url + "healthz")
        assert (health.status_code, health.json()) == (200, {"status": "ready"})
        sent = await rpc(client, server.url, "SendMessage", {"message": user_message("hi")})
        assert sent["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", sent
    assert not [r for r in fake_model.received if r.path.startswith("/v1/models")]
    assert "AGENT_MODEL_CHECK=off: /healthz does not check that the model server offers 'gpt-4o-prod'" in caplog.text


async def test_a_steer_sent_while_the_answer_is_written_gets_one_more_step(tmp_path: Path, fake_model: FakeModel) -> None:
    # The first answer streams slowly; the steer arrives in the middle of it.
    fake_model.script = [Reply(text="The first answer, written slowly.", chunk_chars=2, gap_s=0.05), Reply(text="Second, steered.")]
    async with httpx.AsyncClient(timeout=30) as client, running_server(tmp_path / "state", fake_model.base_url) as server:
        sent = await rpc(client, server.url, "SendMessage", {"message": user_message("Answer me."), "configuration": {"returnImmediately": True}})
        task = sent["result"]["task"]
        with trio.fail_after(10):
            while not fake_model.bodies:
                await trio.sleep(0.01)
        # A blocking send to the working task: it steers, then waits for the task to settle.
        steered = await rpc(
            client, server.url, "SendMessage",
            {"message": user_message("Mention the steer.", task_id=task["id"], context_id=task["contextId"])},
        )  # fmt: skip
    done = steered["result"]["task"]
    assert done["id"] == task["id"] and done["status"]["state"] == "TASK_STATE_COMPLETED"
    assert done["status"]["message"]["parts"] == [{"text": "Second, steered."}]
    assert [m["parts"][0]["text"] for m in done["history"]][:2] == ["Answer me.", "Mention the steer."]
    assert len(fake_model.bodies) == 2
    last_user = [m["content"] for m in fake_model.bodies[1]["messages"] if m["role"] == "user"][-1]
    assert last_user.endswith("Mention the steer.") and "while you were working" in last_user


async def test_a_task_store_that_cannot_be_opened_stops_the_start_and_closes_the_session_store(
    tmp_path: Path, fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[SqliteSessionStore] = []
    open_sessions = SqliteSessionStore.open

    async def open_and_keep(path: Path) -> SqliteSessionStore:
        opened.append(await open_sessions(path))
        return opened[-1]

    async def busy(path: Path) -> None:  # another program holds tasks.db past the busy timeout
        raise DatabaseBusy(path, sqlite3.OperationalError("database is locked"))

    monkeypatch.setattr(runtime.server.SqliteSessionStore, "open", open_and_keep)
    monkeypatch.setattr(runtime.server.SqliteTaskStore, "open", busy)
    config = attrs.evolve(Config(), port=0, state_dir=tmp_path / "state", model_base_url=fake_model.base_url)

    with pytest.raises(BaseExceptionGroup) as refused, trio.fail_after(30):
        await runtime.server.serve(config, trio.Event())
    assert refused.group_contains(DatabaseBusy, match="tasks.db")

    [sessions] = opened
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        sessions.pool._conn.execute("SELECT 1")  # the connection was closed, not left to the collector


async def test_a_start_given_up_while_http_starts_leaves_the_tasks_it_took_up_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A signal before the server serves ends the start, and what the runner took up of a dead
    # process's work is left for the next process (runtime.server abandons the runner): not
    # written CANCELED by the runs the same cancellation reaches first.
    state = tmp_path / "state"
    first = await left_by_a_dead_process(state, TaskState.WORKING, lambda _: [], text="Roll back the deploy.")
    second = await left_by_a_dead_process(state, TaskState.WORKING, lambda _: [], text="Then page the owner.")
    with sqlite3.connect(state / "tasks.db") as conn:  # made a millisecond apart: the second waits for the first's turn
        conn.execute("UPDATE tasks SET created_at_ms = created_at_ms + 1 WHERE id = ?", (second,))
    conn.close()

    @attrs.define(eq=False)
    class HeldModel:
        """Asked, it holds its answer until cancelled; its catalog lists it."""

        asked: trio.Event = attrs.field(factory=trio.Event)
        model: str = "held"
        endpoint: str = "in process"

        def stream(self, request: ChatRequest) -> ScriptedStream:
            self.asked.set()
            return ScriptedStream(Answer(hold=trio.Event()))

        async def has_model(self, name: str | None = None) -> bool:
            return True

    http_starting = trio.Event()

    async def still_starting(*_args: object, **_kwargs: object) -> None:  # HTTP, not yet serving
        http_starting.set()
        await trio.sleep_forever()

    monkeypatch.setattr(runtime.server, "serve_http", still_starting)
    model = HeldModel()
    config = attrs.evolve(Config(), port=0, state_dir=state)
    with trio.CancelScope() as start:  # what serve_cli cancels on a signal before the server serves
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(runtime.server.serve, config, trio.Event(), model=model))
            with trio.fail_after(DEADLINE_S):
                await model.asked.wait()  # the first task's run asks the model; the second's waits for the turn
                await http_starting.wait()
            await trio.testing.wait_all_tasks_blocked()
            start.cancel()
    assert start.cancelled_caught
    async with open_task_store(state / "tasks.db") as tasks:
        states = [decode(await tasks.get(ANONYMOUS, task_id)).status.state for task_id in (first, second)]
    assert states == [TaskState.WORKING, TaskState.WORKING]


# Bytes after a WebSocket upgrade request make hypercorn 0.18 raise from its own protocol code
# (h11's LocalProtocolError); data on an HTTP/2 stream it has answered, a KeyError. Either once
# ended the whole server.
WEBSOCKET_UPGRADE_THEN_A_BYTE = (
    b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: bKdPyn3u98cTfZJSh4TNeQ==\r\n\r\nx\n"
)


async def send_bytes_after_a_websocket_upgrade_request(host: str, port: int) -> None:
    async with await trio.open_tcp_stream(host, port) as stream:
        await stream.send_all(WEBSOCKET_UPGRADE_THEN_A_BYTE)
        with trio.fail_after(DEADLINE_S):
            while await stream.receive_some():
                pass


async def send_data_on_an_http2_stream_already_answered(host: str, port: int) -> None:
    client = await Http2Client.open(host, port)
    try:
        asked = await client.request("/", {"content-type": "text/plain"}, b"{", end=False)  # refused unread
        await client.answer(asked)
        await client.send_data(asked, b"}")
        await client.wait_closed()
    finally:
        await client.aclose()


@pytest.mark.parametrize("send", [send_bytes_after_a_websocket_upgrade_request, send_data_on_an_http2_stream_already_answered])
async def test_a_request_the_http_layer_fails_on_closes_its_connection_and_every_other_client_is_served(
    tmp_path: Path, fake_model: FakeModel, caplog: pytest.LogCaptureFixture, send: Callable[[str, int], Awaitable[None]]
) -> None:
    fake_model.default = Reply(text="still here")
    async with httpx.AsyncClient(timeout=30) as client, running_server(tmp_path / "state", fake_model.base_url) as server:
        address = urlsplit(server.url)
        assert address.hostname is not None and address.port is not None
        await send(address.hostname, address.port)
        assert (await client.get(server.url + "livez")).json() == {"status": "alive"}
        sent = await rpc(client, server.url, "SendMessage", {"message": user_message("are you there?")})
        assert sent["result"]["task"]["status"]["message"]["parts"] == [{"text": "still here"}]
    closed = [record.getMessage() for record in caplog.records if record.name == "runtime.http_server"]
    assert len(closed) == 1 and closed[0].startswith("closed the connection from 127.0.0.1:"), closed
    assert all(record.exc_info is None for record in caplog.records), "a traceback in the log"


async def test_a_connection_its_client_has_closed_is_let_go_at_once_not_after_the_keep_alive_timer(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Each one held a file descriptor for hypercorn's keep-alive timeout (5 s) after the client had
    # gone: a client opening and closing 200 connections a second starved a server of 1024.
    async with running_server(tmp_path / "state", fake_model.base_url) as server:
        address = urlsplit(server.url)
        assert address.hostname is not None and address.port is not None
        open_files = len(os.listdir("/proc/self/fd"))
        for _ in range(50):
            stream = await trio.open_tcp_stream(address.hostname, address.port)
            await stream.aclose()
        with trio.fail_after(2):  # well within the 5 s the server used to hold them
            while len(os.listdir("/proc/self/fd")) > open_files:
                await trio.sleep(0.01)  # polling against the deadline
