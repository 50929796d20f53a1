"""The a2a-sdk client (the reference implementation's, a test-only dependency) drives Keel."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from a2a.client import Client, ClientConfig, create_client
from a2a.client.card_resolver import A2ACardResolver
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import A2AError, TaskNotCancelableError, TaskNotFoundError, UnsupportedOperationError
from google.protobuf import json_format, struct_pb2  # type: ignore[import-untyped]  # protobuf ships no stubs

from fake_model import FakeModel, Reply
from runtime.agent import AgentSpec
from tests.e2e.served_server import running_server
from tests.runtime.served import GATE_CALL, Gate


def ask(
    text: str, *, return_immediately: bool = False, parts: list[a2a.Part] | None = None, task_id: str = ""
) -> a2a.SendMessageRequest:
    message = a2a.Message(
        message_id=uuid.uuid4().hex, role=a2a.Role.ROLE_USER, parts=parts or [a2a.Part(text=text)], task_id=task_id
    )
    return a2a.SendMessageRequest(
        message=message, configuration=a2a.SendMessageConfiguration(return_immediately=return_immediately)
    )


@asynccontextmanager
async def sdk_client(url: str, *, streaming: bool, version: str = "1.0") -> AsyncIterator[Client]:
    """The reference client of ``version``: it takes the first interface of the card that speaks it
    (the card lists 1.0 first, so "0.3" keeps only the 0.3 ones, as a card of a 0.3 agent would)."""
    async with httpx.AsyncClient(timeout=30) as http:
        card = await A2ACardResolver(http, url).get_agent_card()
        speaking = [interface for interface in card.supported_interfaces if interface.protocol_version == version]
        del card.supported_interfaces[:]
        card.supported_interfaces.extend(speaking)
        client = await create_client(card, ClientConfig(streaming=streaming, httpx_client=http))
        try:
            yield client
        finally:
            await client.close()


def json_value(value: object) -> struct_pb2.Value:
    return json_format.ParseDict(value, struct_pb2.Value())



async def followed(client: Any, task_id: str, nursery: trio.Nursery) -> list[Any]:
    """The events of a subscription to the task, in a list that grows as they come (in
    ``nursery``); returned once the first has come."""
    seen: list[Any] = []

    async def follow() -> None:
        async for event in client.subscribe(a2a.SubscribeToTaskRequest(id=task_id)):
            seen.append(event)

    nursery.start_soon(follow)
    with trio.fail_after(10):
        while not seen:
            await trio.sleep(0.01)
    return seen

async def test_the_reference_client_sends_gets_and_streams(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.default = Reply(text="Hello from Keel.")
    async with running_server(tmp_path / "state", fake_model.base_url) as server:
        async with sdk_client(server.url, streaming=False) as client:
            responses = [r async for r in client.send_message(ask("hi"))]
            task = responses[-1].task
            assert task.status.state == a2a.TaskState.TASK_STATE_COMPLETED
            assert task.artifacts[0].parts[0].text == "Hello from Keel."
            got = await client.get_task(a2a.GetTaskRequest(id=task.id))
            assert got.id == task.id and got.status.state == a2a.TaskState.TASK_STATE_COMPLETED
        async with sdk_client(server.url, streaming=True) as client:
            events = [r async for r in client.send_message(ask("stream it"))]
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
            events = [r async for r in client.send_message(ask(f"echo {said}"))]
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
            first = [r async for r in sender.send_message(ask("hold", return_immediately=True))]
        task_id = first[0].task.id
        assert first[0].task.status.state == a2a.TaskState.TASK_STATE_SUBMITTED
        await gate.wait_entered()
        async with sdk_client(server.url, streaming=True) as client:
            async with trio.open_nursery() as nursery:
                seen = await followed(client, task_id, nursery)
                canceled = await client.cancel_task(a2a.CancelTaskRequest(id=task_id))
            assert canceled.status.state == a2a.TaskState.TASK_STATE_CANCELED
            assert seen[0].task.id == task_id
            assert seen[-1].status_update.status.state == a2a.TaskState.TASK_STATE_CANCELED


@pytest.mark.parametrize(("sender", "reader"), [("1.0", "0.3"), ("0.3", "1.0")])
async def test_a_data_part_holding_no_object_reads_back_as_sent_in_the_other_version(
    tmp_path: Path, fake_model: FakeModel, sender: str, reader: str
) -> None:
    # 0.3 data is an object: the reference carries any other JSON value as {"value": ...} marked
    # "data_part_compat" in the part's metadata, and unwraps it in 1.0.
    fake_model.default = Reply(text="Noted.")
    sent = [a2a.Part(text="Keep these:"), a2a.Part(data=json_value(["a", True, None]))]
    async with running_server(tmp_path / "state", fake_model.base_url) as server:
        async with sdk_client(server.url, streaming=False, version=sender) as client:
            [answer] = [r async for r in client.send_message(ask("", parts=sent))]
        async with sdk_client(server.url, streaming=False, version=reader) as client:
            task = await client.get_task(a2a.GetTaskRequest(id=answer.task.id))
    [asked] = [m["content"] for m in fake_model.bodies[0]["messages"] if m["role"] == "user"]
    assert asked == 'Keep these:\n["a", true, null]'
    assert list(task.history[0].parts) == sent


async def drain(events: Any) -> list[Any]:
    async with aclosing(events) as stream:
        return [event async for event in stream]


# The client raises a stream's error from inside its generators without closing the ones under them
# (its own, httpx's), which Trio then reports as collected unexhausted: that is the client's, not the
# server's, and says nothing about what the server answered.
@pytest.mark.filterwarnings("ignore:Async generator .* was garbage collected before it had been exhausted:ResourceWarning")
@pytest.mark.parametrize("version", ["1.0", "0.3"])
async def test_the_reference_client_gets_the_typed_error_of_each_refusal(
    tmp_path: Path, fake_model: FakeModel, version: str
) -> None:
    fake_model.default = Reply(text="Done.")
    async with running_server(tmp_path / "state", fake_model.base_url) as server:
        async with sdk_client(server.url, streaming=False, version=version) as client:
            [done] = await drain(client.send_message(ask("hi")))
            ended = done.task.id
            refusals: list[tuple[type[A2AError], Any]] = [
                (TaskNotFoundError, client.get_task(a2a.GetTaskRequest(id="no-such-task"))),
                (TaskNotFoundError, client.cancel_task(a2a.CancelTaskRequest(id="no-such-task"))),
                (TaskNotCancelableError, client.cancel_task(a2a.CancelTaskRequest(id=ended))),
                (UnsupportedOperationError, drain(client.send_message(ask("more", task_id=ended)))),
            ]
            for error, call in refusals:
                with pytest.raises(error, match="no-such-task" if error is TaskNotFoundError else ended):
                    await call
        async with sdk_client(server.url, streaming=True, version=version) as client:
            streams: list[tuple[type[A2AError], Any]] = [
                (TaskNotFoundError, client.subscribe(a2a.SubscribeToTaskRequest(id="no-such-task"))),
                (UnsupportedOperationError, client.subscribe(a2a.SubscribeToTaskRequest(id=ended))),
                (UnsupportedOperationError, client.send_message(ask("more", task_id=ended))),
            ]
            for error, events in streams:
                with pytest.raises(error, match="no-such-task" if error is TaskNotFoundError else ended):
                    await drain(events)


@pytest.mark.parametrize(("starter", "other"), [("1.0", "0.3"), ("0.3", "1.0")])
async def test_a_task_started_in_one_version_is_steered_followed_and_canceled_in_the_other(
    tmp_path: Path, fake_model: FakeModel, starter: str, other: str
) -> None:
    gate = Gate()
    agent = AgentSpec(system_prompt="test", tools=(gate.tool(),))
    fake_model.script = [Reply(tool_calls=[GATE_CALL])]
    async with running_server(tmp_path / "state", fake_model.base_url, agent=agent) as server:
        async with sdk_client(server.url, streaming=False, version=starter) as client:
            [started] = await drain(client.send_message(ask("hold", return_immediately=True)))
        task_id = started.task.id
        await gate.wait_entered()
        async with sdk_client(server.url, streaming=False, version=other) as client:
            [steered] = await drain(client.send_message(ask("and this", task_id=task_id, return_immediately=True)))
        assert [m.parts[0].text for m in steered.task.history] == ["hold", "and this"]
        async with sdk_client(server.url, streaming=True, version=other) as client:
            async with trio.open_nursery() as nursery:
                seen = await followed(client, task_id, nursery)
                async with sdk_client(server.url, streaming=False, version=starter) as canceler:
                    canceled = await canceler.cancel_task(a2a.CancelTaskRequest(id=task_id))
        assert canceled.status.state == a2a.TaskState.TASK_STATE_CANCELED
        assert seen[0].task.status.state == a2a.TaskState.TASK_STATE_WORKING
        assert seen[-1].status_update.status.state == a2a.TaskState.TASK_STATE_CANCELED


# A2A 0.2 named the card's place /.well-known/agent.json; the a2a-sdk 0.3 servers still served it
# there too, and clients of that time (and those that fall back to it) look for it nowhere else.
async def test_the_card_is_found_at_the_well_known_path_of_a2a_0_2_too(tmp_path: Path, fake_model: FakeModel) -> None:
    async with running_server(tmp_path / "state", fake_model.base_url) as server:
        async with httpx.AsyncClient(timeout=30) as http:
            card = await A2ACardResolver(http, server.url).get_agent_card()
            older = await A2ACardResolver(http, server.url, agent_card_path="/.well-known/agent.json").get_agent_card()
    assert older == card



async def test_the_reference_client_made_as_documented_waits_out_a_blocking_send_longer_than_its_timeout(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Made without an HTTP client of its own, the client reads through httpx's defaults: a read
    # that waits 5 s for a byte fails. A model slow to answer (a local one loading, say) takes longer.
    gives_up_after_s = httpx.AsyncClient().timeout.read
    assert gives_up_after_s is not None
    fake_model.default = Reply(text="Worth the wait.", delay_s=gives_up_after_s + 1)
    async with running_server(tmp_path / "state", fake_model.base_url) as server:
        async with httpx.AsyncClient(timeout=30) as http:
            card = await A2ACardResolver(http, server.url).get_agent_card()
        client = await create_client(card, ClientConfig(streaming=False))
        try:
            [response] = [r async for r in client.send_message(ask("Take your time"))]
        finally:
            await client.close()
    assert response.task.status.state == a2a.TaskState.TASK_STATE_COMPLETED
    assert response.task.artifacts[0].parts[0].text == "Worth the wait."
