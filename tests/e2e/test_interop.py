"""The a2a-sdk client (the reference implementation's, a test-only dependency) drives Keel."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio
from a2a.client import ClientConfig, create_client
from a2a.types import a2a_pb2 as a2a

from fake_model import FakeModel, Reply
from runtime.agent import AgentSpec
from tests.e2e.served_server import running_server
from tests.runtime.served import GATE_CALL, Gate


def ask(text: str, *, return_immediately: bool = False) -> a2a.SendMessageRequest:
    message = a2a.Message(message_id=uuid.uuid4().hex, role=a2a.Role.ROLE_USER, parts=[a2a.Part(text=text)])
    return a2a.SendMessageRequest(
        message=message, configuration=a2a.SendMessageConfiguration(return_immediately=return_immediately)
    )


@asynccontextmanager
async def sdk_client(url: str, *, streaming: bool) -> AsyncIterator[object]:
    async with httpx.AsyncClient(timeout=30) as http:
        client = await create_client(url, ClientConfig(streaming=streaming, httpx_client=http))
        try:
            yield client
        finally:
            await client.close()


async def test_the_reference_client_sends_gets_and_streams(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.default = Reply(text="Hello from Keel.")
    async with running_server(tmp_path / "state", fake_model.base_url) as server:
        async with sdk_client(server.url, streaming=False) as client:
            responses = [r async for r in client.send_message(ask("hi"))]  # type: ignore[attr-defined]
            task = responses[-1].task
            assert task.status.state == a2a.TaskState.TASK_STATE_COMPLETED
            assert task.artifacts[0].parts[0].text == "Hello from Keel."
            got = await client.get_task(a2a.GetTaskRequest(id=task.id))  # type: ignore[attr-defined]
            assert got.id == task.id and got.status.state == a2a.TaskState.TASK_STATE_COMPLETED
        async with sdk_client(server.url, streaming=True) as client:
            events = [r async for r in client.send_message(ask("stream it"))]  # type: ignore[attr-defined]
            assert events[0].WhichOneof("payload") == "task"
            assert events[0].task.status.state == a2a.TaskState.TASK_STATE_SUBMITTED
            assert events[-1].status_update.status.state == a2a.TaskState.TASK_STATE_COMPLETED
            artifacts = [e.artifact_update for e in events if e.HasField("artifact_update")]
            assert artifacts[-1].last_chunk and artifacts[-1].artifact.parts[0].text == "Hello from Keel."
            chunks = [a.artifact.parts[0].text for a in artifacts[:-1]]
            assert "".join(chunks) == "Hello from Keel." and len(chunks) > 1, chunks


async def test_the_reference_client_streams_text_holding_unicode_line_separators(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # The client splits an SSE stream into lines as Python's str.splitlines() does, which also
    # breaks at U+2028, U+2029 and U+0085: sent raw inside a JSON string, each cut a data line.
    said = "first\u2028second\u2029third\x85fourth"
    fake_model.default = Reply(text=said)
    async with running_server(tmp_path / "state", fake_model.base_url) as server:
        async with sdk_client(server.url, streaming=True) as client:
            events = [r async for r in client.send_message(ask(f"echo {said}"))]  # type: ignore[attr-defined]
    assert events[0].task.history[0].parts[0].text == f"echo {said}"
    assert events[-1].status_update.status.state == a2a.TaskState.TASK_STATE_COMPLETED
    artifacts = [e.artifact_update for e in events if e.HasField("artifact_update")]
    assert artifacts[-1].artifact.parts[0].text == said


async def test_the_reference_client_cancels_and_subscribes(tmp_path: Path, fake_model: FakeModel) -> None:
    gate = Gate()
    agent = AgentSpec(system_prompt="test", tools=(gate.tool(),))
    fake_model.script = [Reply(tool_calls=[GATE_CALL])]
    async with running_server(tmp_path / "state", fake_model.base_url, agent=agent) as server:
        async with sdk_client(server.url, streaming=False) as sender:
            first = [r async for r in sender.send_message(ask("hold", return_immediately=True))]  # type: ignore[attr-defined]
        task_id = first[0].task.id
        assert first[0].task.status.state == a2a.TaskState.TASK_STATE_SUBMITTED
        await gate.wait_entered()
        async with sdk_client(server.url, streaming=True) as client:
            seen: list[object] = []

            async def follow() -> None:
                async for event in client.subscribe(a2a.SubscribeToTaskRequest(id=task_id)):  # type: ignore[attr-defined]
                    seen.append(event)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow)
                with trio.fail_after(10):
                    while not seen:
                        await trio.sleep(0.01)
                canceled = await client.cancel_task(a2a.CancelTaskRequest(id=task_id))  # type: ignore[attr-defined]
            assert canceled.status.state == a2a.TaskState.TASK_STATE_CANCELED
            assert seen[0].task.id == task_id  # type: ignore[attr-defined]
            assert seen[-1].status_update.status.state == a2a.TaskState.TASK_STATE_CANCELED  # type: ignore[attr-defined]
