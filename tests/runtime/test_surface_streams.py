"""SSE streams through a real hypercorn server: the Task first, then updates, closing on a
terminal or interrupted state; subscriptions; keep-alives; and a client that disconnects."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from fake_model import ErrorReply, FakeModel, Reply

from protocol import (
    Artifact,
    EndNotStored,
    ProtocolError,
    ProtocolVersion,
    SseParser,
    StreamEvent,
    Task,
    TaskArtifactUpdateEvent,
    TaskNotFound,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
    TextPart,
)
from persistence.errors import DatabaseFailed
from runtime.runner import ANONYMOUS, Runner
from runtime.surface import SurfaceConfig
from runtime.surface.streams import TaskEventStream
from runtime.tasks import SUBSCRIBER_BUFFER, LiveTask, StreamItem, encode, new_id, now
from tests.runtime.served import DEADLINE_S, GATE_CALL, Served, fill_tasks_disk, message, serve_keel

V1 = "1.0"
V03 = None
BOTH = pytest.mark.parametrize("version", [V1, V03], ids=["1.0", "0.3"])
STREAM = {V1: "SendStreamingMessage", V03: "message/stream"}
SUBSCRIBE = {V1: "SubscribeToTask", V03: "tasks/resubscribe"}
GET = {V1: "GetTask", V03: "tasks/get"}


def part(text: str, version: str | None) -> dict[str, str]:
    return {"text": text} if version == V1 else {"kind": "text", "text": text}


def results(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert all(frame["jsonrpc"] == "2.0" and frame["id"] == 1 for frame in frames), frames
    return [frame["result"] for frame in frames]


def kind(result: dict[str, Any]) -> str:
    """"task", "statusUpdate", "artifactUpdate" (1.0) or the 0.3 ``kind``."""
    return result["kind"] if "kind" in result else next(iter(result))


def body(result: dict[str, Any]) -> dict[str, Any]:
    inner: dict[str, Any] = result if "kind" in result else next(iter(result.values()))
    return inner


def state(result: dict[str, Any]) -> str:
    return body(result)["status"]["state"]  # type: ignore[no-any-return]


async def test_v1_stream_begins_with_the_task_and_closes_after_completed(keel: Served) -> None:
    keel.model.script = [Reply(text="The vault lease expired.")]
    async with keel.stream("SendStreamingMessage", {"message": message("Why?")}) as events:
        assert events.response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert events.response.headers["cache-control"] == "no-store"
        frames = results(await events.rest())
    task = frames[0]["task"]
    assert task["status"]["state"] == "TASK_STATE_SUBMITTED"
    assert [kind(f) for f in frames[:2]] == ["task", "statusUpdate"]
    assert state(frames[1]) == "TASK_STATE_WORKING"
    assert kind(frames[-1]) == "statusUpdate" and state(frames[-1]) == "TASK_STATE_COMPLETED"
    chunks = [f["artifactUpdate"] for f in frames if kind(f) == "artifactUpdate"]
    assert "".join(c["artifact"]["parts"][0]["text"] for c in chunks if not c.get("lastChunk")) == "The vault lease expired."
    assert chunks[-1]["lastChunk"] is True and chunks[-1]["artifact"]["parts"] == [{"text": "The vault lease expired."}]
    assert all(body(f).get("taskId", task["id"]) == task["id"] for f in frames)
    assert b'"final"' not in events.raw and b'"kind"' not in events.raw  # 1.0 has neither
    stored = await keel.result("GetTask", {"id": task["id"]})
    assert stored["status"]["state"] == "TASK_STATE_COMPLETED"


async def test_v03_stream_marks_only_the_last_status_update_final(keel: Served) -> None:
    keel.model.script = [Reply(text="The vault lease expired.")]
    async with keel.stream("message/stream", {"message": message("Why?", V03)}, version=V03) as events:
        frames = results(await events.rest())
    assert frames[0]["kind"] == "task" and frames[0]["status"]["state"] == "submitted"
    updates = [f for f in frames if f["kind"] == "status-update"]
    assert [u["final"] for u in updates] == [False] * (len(updates) - 1) + [True]
    assert frames[-1] is updates[-1] and frames[-1]["status"]["state"] == "completed"
    assert all(f["kind"] in ("task", "status-update", "artifact-update") for f in frames)


async def test_the_task_arrives_before_the_model_answers(keel: Served) -> None:
    keel.model.script = [Reply(text="never sent", hang_after_chunks=0)]  # the model says nothing
    async with keel.stream("SendStreamingMessage", {"message": message("Why?")}) as events:
        first = await events.next()
        assert first is not None
        task = first["result"]["task"]
        await keel.wait_for_model_requests(1)
        canceled = await keel.result("CancelTask", {"id": task["id"]})
        frames = results(await events.rest())
    assert canceled["status"]["state"] == "TASK_STATE_CANCELED"
    assert state(frames[-1]) == "TASK_STATE_CANCELED"


async def test_a_steer_adds_no_status_update_to_a_stream_of_its_task(keel: Served) -> None:
    # Its message goes to the task's history, which no stream event carries; the status it left
    # unchanged was sent again to every stream, the same state at the same time.
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Used the staging runbook.")]
    task = await keel.send("Fix checkout", blocking=False)
    await keel.gate.wait_entered()
    async with keel.stream("SubscribeToTask", {"id": task["id"]}) as events:
        first = await events.next()
        assert first is not None
        await keel.send("Use the staging runbook", blocking=False, taskId=task["id"])
        keel.gate.opened.set()
        frames = results(await events.rest())
    updates = [body(f)["status"] for f in frames if kind(f) == "statusUpdate"]
    assert [status["state"] for status in updates] == ["TASK_STATE_COMPLETED"]
    assert (await keel.result("GetTask", {"id": task["id"]}))["history"][1]["parts"] == [{"text": "Use the staging runbook"}]


@BOTH
async def test_subscribe_follows_a_working_task_to_its_end(keel: Served, version: str | None) -> None:
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done.")]
    task = await keel.send("Roll back", version=version, blocking=False)
    await keel.gate.wait_entered()
    async with keel.stream(SUBSCRIBE[version], {"id": task["id"]}, version=version) as events:
        first = await events.next()
        assert first is not None
        assert kind(first["result"]) == "task" and body(first["result"])["id"] == task["id"]
        assert state(first["result"]) in ("TASK_STATE_WORKING", "working")
        keel.gate.opened.set()
        frames = results(await events.rest())
    last = frames[-1]
    assert state(last) in ("TASK_STATE_COMPLETED", "completed")
    if version is V03:
        assert last["final"] is True
    assert any(kind(f) in ("artifactUpdate", "artifact-update") for f in frames)


async def test_resubscribe_during_a_cancel_ends_final_and_canceled(keel: Served) -> None:
    keel.model.script = [Reply(tool_calls=[GATE_CALL])]
    task = await keel.send("Drain", version=V03, blocking=False)
    await keel.gate.wait_entered()
    async with keel.stream("tasks/resubscribe", {"id": task["id"]}, version=V03) as events:
        assert await events.next() is not None
        await keel.result("tasks/cancel", {"id": task["id"]}, version=V03)
        frames = results(await events.rest())
    assert frames[-1]["kind"] == "status-update"
    assert frames[-1]["status"]["state"] == "canceled" and frames[-1]["final"] is True


async def test_every_subscriber_gets_every_event(keel: Served) -> None:
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done for both.")]
    task = await keel.send("Roll back", blocking=False)
    await keel.gate.wait_entered()
    params = {"id": task["id"]}
    async with keel.stream("SubscribeToTask", params) as one, keel.stream("SubscribeToTask", params) as two:
        assert await one.next() == await two.next()
        keel.gate.opened.set()
        assert await one.rest() == await two.rest()


@BOTH
async def test_subscribe_to_a_terminal_task_is_unsupported_operation(keel: Served, version: str | None) -> None:
    keel.model.script = [Reply(text="ok")]
    done = await keel.send("one", version=version)
    error = await keel.stream_error(SUBSCRIBE[version], {"id": done["id"]}, version=version)
    assert error["code"] == -32004
    assert error["message"] == (
        f"task {done['id']!r} has ended (completed) and cannot be subscribed to; read it as it ended with {GET[version]}"
    )
    read = await keel.result(GET[version], {"id": done["id"]}, version=version)
    assert read["status"]["state"] in ("TASK_STATE_COMPLETED", "completed")


@pytest.mark.parametrize(
    ("body", "version", "code"),
    [
        ('{"jsonrpc":"2.0","id":7,"method":"message/stream","params":"x"}', V03, -32600),
        ('{"jsonrpc":"1.0","id":7,"method":"message/stream","params":{}}', V03, -32600),
        ('{"jsonrpc":"2.0","id":7,"method":"tasks/resubscribe","params":["t"]}', V03, -32602),
        ('{"jsonrpc":"2.0","id":7,"method":"tasks/resubscribe","params":{"id":"t"}}', "2.0", -32009),
        ('{"jsonrpc":"2.0","id":7,"method":"SendStreamingMessage","params":"x"}', V1, -32600),
    ],
    ids=["0.3-params-a-string", "0.3-jsonrpc-1.0", "0.3-params-an-array", "0.3-version-2.0", "1.0-params-a-string"],
)
async def test_a_streaming_request_refused_before_it_is_routed_answers_as_its_version_does(
    keel: Served, body: str, version: str | None, code: int
) -> None:
    with trio.fail_after(DEADLINE_S):
        response = await keel.http.post(keel.rpc_path, content=body, headers=keel.headers(version))
    if version == V1:  # 1.0: a JSON body, as every JSON-RPC error
        assert response.headers["content-type"] == "application/json"
        answer = response.json()
    else:  # a 0.3 client reads nothing but an event stream from a streaming method
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.text.startswith("data: ") and response.text.endswith("\n\n")
        answer = json.loads(response.text.removeprefix("data: "))
    assert answer["id"] == 7 and answer["error"]["code"] == code


@BOTH
async def test_subscribe_to_an_unknown_task_is_task_not_found(keel: Served, version: str | None) -> None:
    assert (await keel.stream_error(SUBSCRIBE[version], {"id": "no-such-task"}, version=version))["code"] == -32001


@BOTH
async def test_a_stream_to_a_terminal_task_is_an_error_not_a_stream(keel: Served, version: str | None) -> None:
    keel.model.script = [Reply(text="ok")]
    done = await keel.send("one", version=version)
    params = {"message": message("again", version, taskId=done["id"])}
    assert (await keel.stream_error(STREAM[version], params, version=version))["code"] == -32004


@BOTH
async def test_a_stream_with_bad_params_is_an_error_not_a_stream(keel: Served, version: str | None) -> None:
    role = "ROLE_USER" if version == V1 else "user"
    assert (await keel.stream_error(STREAM[version], {"message": {"role": role}}, version=version))["code"] == -32602


async def test_disconnecting_a_stream_leaves_the_task_running(keel: Served) -> None:
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Finished all the same.")]
    async with keel.stream("SendStreamingMessage", {"message": message("Roll back")}) as events:
        first = await events.next()
        assert first is not None
        task_id = first["result"]["task"]["id"]
        await keel.gate.wait_entered()
        assert keel.runner.statistics().subscribers == 1
    # The client has gone. Once the server has noticed, the subscription is gone and the run is not.
    with trio.fail_after(DEADLINE_S):
        while keel.runner.statistics().subscribers:
            await trio.sleep(0.005)
    assert keel.runner.statistics().running == 1
    keel.gate.opened.set()
    settled = await keel.runner.wait_settled(ANONYMOUS, task_id)
    assert settled.status.state.value == "completed"
    stored = await keel.result("GetTask", {"id": task_id})
    assert stored["artifacts"][0]["parts"] == [{"text": "Finished all the same."}]


async def test_an_idle_stream_sends_keepalive_comments(fake_model: FakeModel, tmp_path: Path) -> None:
    async with serve_keel(tmp_path / "state", fake_model, surface=SurfaceConfig(keepalive_s=0.02)) as keel:
        keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done.")]
        async with keel.stream("SendStreamingMessage", {"message": message("Roll back")}) as events:
            assert await events.next() is not None
            await keel.gate.wait_entered()
            await events.wait_for_bytes(b"\n\n: keep-alive\n\n")
            keel.gate.opened.set()
            frames = results(await events.rest())
        assert state(frames[-1]) == "TASK_STATE_COMPLETED"


async def test_an_idle_stream_sends_a_keepalive_before_a_client_with_httpx_defaults_gives_up_on_it(keel: Served) -> None:
    # The a2a-sdk client, made as documented (create_client without an HTTP client of its own),
    # reads through an httpx client with httpx's default timeout: its stream fails once it has
    # read nothing for that long, though the run goes on (waiting its turn, in a tool, a model
    # slow to start its answer).
    gives_up_after_s = httpx.AsyncClient().timeout.read
    assert gives_up_after_s is not None
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done.")]
    async with keel.stream("SendStreamingMessage", {"message": message("Roll back")}) as events:
        assert await events.next() is not None
        await keel.gate.wait_entered()
        with trio.fail_after(gives_up_after_s):
            await events.wait_for_bytes(b"\n\n: keep-alive\n\n")
        keel.gate.opened.set()
        frames = results(await events.rest())
    assert state(frames[-1]) == "TASK_STATE_COMPLETED"


@BOTH
async def test_a_store_that_fails_as_a_stream_opens_ends_it_with_an_error_saying_so_logged_in_one_line(
    keel: Served, version: str | None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The task is read when the request is checked, and again when its stream opens (after the
    # 200 and its headers are sent): a store that fails in between (a disk failing, say) was a
    # body cut off mid-chunk, and a traceback in the log.
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done.")]
    task = await keel.send("Roll back", version=version, blocking=False)
    await keel.gate.wait_entered()

    @asynccontextmanager
    async def failing(_runner: Runner, _owner: str, _task_id: str) -> AsyncIterator[trio.MemoryReceiveChannel[StreamItem]]:
        raise DatabaseFailed(keel.state_dir / "tasks.db", sqlite3.OperationalError("disk I/O error"))
        yield  # pragma: no cover

    monkeypatch.setattr(Runner, "subscribe", failing)
    with caplog.at_level(logging.ERROR, logger="runtime.surface"):
        async with keel.stream(SUBSCRIBE[version], {"id": task["id"]}, version=version) as events:
            [answer] = await events.rest()
    assert answer["id"] == 1 and answer["error"]["code"] == -32603
    assert answer["error"]["message"].startswith(f"the server's storage failed while handling {SUBSCRIBE[version]!r}")
    assert "disk I/O" not in answer["error"]["message"] and str(keel.state_dir) not in answer["error"]["message"]
    [logged] = caplog.records
    assert "tasks.db" in logged.getMessage() and "disk I/O error" in logged.getMessage()
    assert logged.exc_info is None  # an outage, not a bug: no traceback
    monkeypatch.undo()
    keel.gate.opened.set()  # the task goes on
    assert (await keel.runner.wait_settled(ANONYMOUS, task["id"])).status.state is TaskState.COMPLETED


@BOTH
async def test_subscribing_to_an_unfinished_task_no_run_of_this_server_holds_says_where_to_look(
    keel: Served, version: str | None
) -> None:
    # A task left working for the next server to resume (by a process that stopped with it so).
    elsewhere = Task(id=new_id(), context_id=new_id(), status=TaskStatus(state=TaskState.WORKING, timestamp=now()))
    await keel.tasks.create(
        ANONYMOUS, task_id=elsewhere.id, context_id=elsewhere.context_id, state="TASK_STATE_WORKING", task_json=encode(elsewhere)
    )
    async with keel.stream(SUBSCRIBE[version], {"id": elsewhere.id}, version=version) as events:
        first, *rest = await events.rest()
    assert state(first["result"]) in ("TASK_STATE_WORKING", "working")
    (last,) = rest
    assert last["id"] == 1 and last["error"]["code"] == -32603
    assert elsewhere.id in last["error"]["message"] and "no run of it is in this server" in last["error"]["message"]
    assert "poll GetTask" in last["error"]["message"]


# -- the stream body on its own, against a runner double ------------------------------------------


@attrs.define
class ScriptedSubscriptions:
    """A runner double whose subscription holds ``events`` and then ends (or raises ``error``)."""

    events: list[StreamEvent] = attrs.field(factory=list)
    error: ProtocolError | None = None

    @asynccontextmanager
    async def subscribe(self, owner: str, task_id: str) -> AsyncIterator[trio.MemoryReceiveChannel[StreamEvent]]:
        if self.error is not None:
            raise self.error
        send, receive = trio.open_memory_channel[StreamEvent](len(self.events))
        for event in self.events:
            send.send_nowait(event)
        send.close()
        with receive:
            yield receive


def task_in(state_: TaskState, *artifacts: Artifact) -> Task:
    status = TaskStatus(state=state_, timestamp=datetime(2026, 11, 29, tzinfo=timezone.utc))
    return Task(id="t-1", context_id="c-1", status=status, artifacts=artifacts)


async def frames_of(subscriptions: ScriptedSubscriptions, first: Task | None) -> list[dict[str, Any]]:
    stream = TaskEventStream(
        runner=subscriptions, owner="o", task_id="t-1", request_id=1, version=ProtocolVersion.V1_0, keepalive_s=10,
        method="SubscribeToTask", first=first,
    )
    parser = SseParser()
    async with stream as chunks:
        raw = b"".join([chunk async for chunk in chunks])
    return [json.loads(event.data) for event in parser.feed(raw)]


async def test_a_streaming_send_catches_up_with_what_happened_before_it_subscribed() -> None:
    answer = Artifact(artifact_id="answer", parts=[TextPart("done")])
    later = TaskStatusUpdateEvent(task_id="t-1", context_id="c-1", status=task_in(TaskState.WORKING).status)
    snapshot = task_in(TaskState.COMPLETED, answer)  # the run ended before the subscription opened
    frames = results(await frames_of(ScriptedSubscriptions([snapshot, later]), first=task_in(TaskState.SUBMITTED)))
    assert [kind(f) for f in frames] == ["task", "artifactUpdate", "statusUpdate"]
    assert frames[1]["artifactUpdate"]["artifact"]["parts"] == [{"text": "done"}]
    assert state(frames[2]) == "TASK_STATE_COMPLETED"  # and nothing after the end


async def test_a_streaming_send_that_catches_up_mid_answer_sends_working_then_the_text_so_far_not_as_whole() -> None:
    so_far = Artifact(artifact_id="answer", parts=[TextPart("The lease ")])
    snapshot = task_in(TaskState.WORKING, so_far)  # the task as it stands: the answer streaming
    rest = TaskArtifactUpdateEvent(
        task_id="t-1", context_id="c-1", artifact=Artifact(artifact_id="answer", parts=[TextPart("expired.")]), append=True
    )
    done = TaskStatusUpdateEvent(task_id="t-1", context_id="c-1", status=task_in(TaskState.COMPLETED).status)
    frames = results(await frames_of(ScriptedSubscriptions([snapshot, rest, done]), first=task_in(TaskState.SUBMITTED)))
    assert [kind(f) for f in frames] == ["task", "statusUpdate", "artifactUpdate", "artifactUpdate", "statusUpdate"]
    assert state(frames[1]) == "TASK_STATE_WORKING"
    caught_up = frames[2]["artifactUpdate"]
    assert caught_up["artifact"]["parts"] == [{"text": "The lease "}] and not caught_up.get("lastChunk")
    assert frames[3]["artifactUpdate"]["append"] is True


async def test_a_streaming_send_does_not_repeat_an_unchanged_task() -> None:
    submitted = task_in(TaskState.SUBMITTED)
    working = TaskStatusUpdateEvent(task_id="t-1", context_id="c-1", status=task_in(TaskState.WORKING).status)
    frames = results(await frames_of(ScriptedSubscriptions([submitted, working]), first=submitted))
    assert [kind(f) for f in frames] == ["task", "statusUpdate"]


async def test_a_task_that_vanishes_before_its_stream_opens_gets_an_error_event() -> None:
    frames = await frames_of(ScriptedSubscriptions(error=TaskNotFound("t-1")), first=None)
    assert [frame["error"]["code"] for frame in frames] == [-32001]


@attrs.define
class LiveSubscriptions:
    """The runner's part of a subscription, around one LiveTask."""

    live: LiveTask

    @asynccontextmanager
    async def subscribe(self, owner: str, task_id: str) -> AsyncIterator[trio.MemoryReceiveChannel[StreamItem]]:
        receive = self.live.subscribe()
        try:
            yield receive
        finally:
            self.live.unsubscribe(receive)


async def test_a_client_that_falls_too_far_behind_is_told_so_in_the_last_event() -> None:
    live = LiveTask(owner="o", task=task_in(TaskState.WORKING), version=2)
    stream = TaskEventStream(
        runner=LiveSubscriptions(live), owner="o", task_id="t-1", request_id=1, version=ProtocolVersion.V1_0, keepalive_s=10,
        method="SubscribeToTask",
    )
    update = TaskStatusUpdateEvent(task_id="t-1", context_id="c-1", status=task_in(TaskState.WORKING).status)
    parser = SseParser()
    async with stream as chunks:
        for _ in range(SUBSCRIBER_BUFFER + 1):  # while the client reads nothing
            live.publish(update)
        assert live.subscribers == 0  # dropped; the task goes on
        raw = b"".join([chunk async for chunk in chunks])
    frames = [json.loads(event.data) for event in parser.feed(raw)]
    assert [kind(f) for f in results(frames[:-1])] == ["task"] + ["statusUpdate"] * (SUBSCRIBER_BUFFER - 1)
    error = frames[-1]["error"]
    assert error["code"] == -32603 and "'t-1'" in error["message"] and "SubscribeToTask" in error["message"]


async def test_a_stream_keeps_up_with_a_model_that_streams_several_pieces_between_two_writes() -> None:
    # A model's answer comes several pieces to a read (hundreds, from a fast server), all
    # published before the stream's next write; each write (to the client's socket) takes the
    # scheduler a pass at least. A stream that wrote one event a write fell SUBSCRIBER_BUFFER
    # events behind a client that took every byte at once, and was cut off.
    live = LiveTask(owner="o", task=task_in(TaskState.WORKING), version=2)
    stream = TaskEventStream(
        runner=LiveSubscriptions(live), owner="o", task_id="t-1", request_id=1, version=ProtocolVersion.V1_0, keepalive_s=10,
        method="SubscribeToTask",
    )
    pieces_a_read, reads = 8, SUBSCRIBER_BUFFER // 4
    raw = bytearray()

    async def write_to_the_client(chunks: TaskEventStream) -> None:
        async for chunk in chunks:
            raw.extend(chunk)
            await trio.lowlevel.checkpoint()  # the write to the socket

    async with stream as chunks, trio.open_nursery() as nursery:
        nursery.start_soon(write_to_the_client, chunks)
        for _ in range(reads):
            for _ in range(pieces_a_read):
                live.stream_answer("x")
            await trio.lowlevel.checkpoint()  # the model client's next read
        live.close()  # the task has settled: the stream ends after what it was sent
    frames = [json.loads(event.data) for event in SseParser().feed(bytes(raw))]
    assert all("result" in frame for frame in frames), frames[-1]
    pieces = [f["artifactUpdate"]["artifact"]["parts"][0]["text"] for f in results(frames) if kind(f) == "artifactUpdate"]
    assert "".join(pieces) == "x" * pieces_a_read * reads


async def test_a_streaming_send_sent_again_streams_the_task_it_started_and_ends(keel: Served) -> None:
    keel.model.script = [Reply(text="Once.")]
    question = message("Why?")
    task = (await keel.result("SendMessage", {"message": question}))["task"]
    async with keel.stream("SendStreamingMessage", {"message": question}) as events:
        frames = results(await events.rest())
    assert [(f["task"]["id"], f["task"]["status"]["state"]) for f in frames] == [(task["id"], "TASK_STATE_COMPLETED")]
    assert len(keel.model.bodies) == 1


async def test_a_v03_streaming_send_sent_again_ends_with_a_final_status_update(keel: Served) -> None:
    # A 0.3 client reads until final:true, which only a status update carries.
    keel.model.script = [Reply(text="Once.")]
    question = message("Why?", V03)
    task = await keel.result("message/send", {"message": question}, version=V03)
    async with keel.stream("message/stream", {"message": question}, version=V03) as events:
        frames = results(await events.rest())
    assert [(f["kind"], f["status"]["state"], f.get("final")) for f in frames] == [
        ("task", "completed", None),
        ("status-update", "completed", True),
    ]
    assert frames[0]["id"] == frames[1]["taskId"] == task["id"]
    assert len(keel.model.bodies) == 1


@pytest.mark.parametrize("end", ["canceled", "failed"])
async def test_a_task_that_ends_mid_answer_keeps_the_answer_its_subscribers_were_sent(keel: Served, end: str) -> None:
    # As the reference keeps a canceled task's artifact chunks (wire/v1_cancel_running.resp.txt):
    # what a stream assembled and what GetTask says stay the same.
    keel.model.script = [Reply(text="Looking at the lease. ", tool_calls=[GATE_CALL]), ErrorReply(status=400)]
    task = await keel.send("Why?", blocking=False)
    await keel.gate.wait_entered()
    if end == "canceled":
        ended = await keel.result("CancelTask", {"id": task["id"]})
    else:
        keel.gate.opened.set()  # the next step's model request is refused: the task fails
        with trio.fail_after(DEADLINE_S):
            while (ended := (await keel.result("GetTask", {"id": task["id"]})))["status"]["state"] != "TASK_STATE_FAILED":
                await trio.sleep(0.01)
    assert ended["status"]["state"] == f"TASK_STATE_{end.upper()}"
    assert ended["artifacts"] == [{"artifactId": "answer", "name": "answer", "parts": [{"text": "Looking at the lease. "}]}]
    assert (await keel.result("GetTask", {"id": task["id"]}))["artifacts"] == ended["artifacts"]


@BOTH
async def test_a_subscriber_that_comes_mid_answer_gets_the_text_so_far_in_the_task_then_the_rest(
    keel: Served, version: str | None
) -> None:
    # The first step streams its text and calls the gate tool, which holds the run; the
    # subscriber joins there, then the second step streams the rest. The task it starts with
    # is the task as it stands (A2A 1.0 §3.1.6), the text so far included, as GetTask shows it.
    keel.model.script = [Reply(text="Looking at the lease. ", tool_calls=[GATE_CALL]), Reply(text="It expired.", chunk_chars=4)]
    task = await keel.send("Why?", blocking=False, version=version)
    await keel.gate.wait_entered()
    polled = await keel.result(GET[version], {"id": task["id"]}, version=version)
    async with keel.stream(SUBSCRIBE[version], {"id": task["id"]}, version=version) as late:
        first = await late.next()
        assert first is not None and kind(first["result"]) == "task"
        assert body(first["result"])["artifacts"] == polled["artifacts"]
        assert body(first["result"])["artifacts"][0]["parts"] == [part("Looking at the lease. ", version)]
        keel.gate.opened.set()
        frames = results(await late.rest())
    if version == V03:  # 0.3's events, told apart by their kind, are checked as far as here
        assert state(frames[-1]) == "completed"
        return
    updates = [f["artifactUpdate"] for f in frames if kind(f) == "artifactUpdate"]
    pieces, whole = updates[:-1], updates[-1]
    # The second model request's first piece replaces the first's text; the others append.
    assert [bool(u.get("append")) for u in pieces] == [False, True, True]
    assert "".join(u["artifact"]["parts"][0]["text"] for u in pieces) == "It expired."
    assert whole["lastChunk"] is True and not whole.get("append") and whole["artifact"]["parts"] == [{"text": "It expired."}]
    assert state(frames[-1]) == "TASK_STATE_COMPLETED"


async def test_a_second_model_requests_text_replaces_the_firsts_in_what_get_task_and_a_cancel_keep(keel: Served) -> None:
    # Two answers run together ("...lease. It e") would read as one, which neither was.
    keel.model.script = [
        Reply(text="Looking at the lease. ", tool_calls=[GATE_CALL]),
        Reply(text="It expired, as nobody renewed it.", chunk_chars=4, hang_after_chunks=3),
    ]
    task = await keel.send("Why?", blocking=False)
    await keel.gate.wait_entered()
    keel.gate.opened.set()
    so_far = [{"text": "It expir"}]  # the two pieces of text the second request streams before it stalls
    with trio.fail_after(10):
        while (polled := await keel.result("GetTask", {"id": task["id"]})).get("artifacts", [{}])[0].get("parts") != so_far:
            await trio.sleep(0.01)
    canceled = await keel.result("CancelTask", {"id": task["id"]})
    assert canceled["artifacts"][0]["parts"] == so_far


async def test_a_subscriber_that_comes_after_the_answer_was_sent_gets_the_whole_answer() -> None:
    working = Task(id="t", context_id="c", status=TaskStatus(state=TaskState.WORKING, timestamp=now()))
    live = LiveTask(owner=ANONYMOUS, task=working, version=2)
    live.stream_answer("Looking at the lease. ")
    live.stream_answer("The lease expired.")
    live.finish_answer("The lease expired.")  # the last step's text only
    receive = live.subscribe()
    first = receive.receive_nowait()
    assert isinstance(first, Task) and first.status == working.status
    assert [artifact.parts for artifact in first.artifacts] == [(TextPart("The lease expired."),)]
    # An empty answer is still the whole answer.
    empty = LiveTask(owner=ANONYMOUS, task=working, version=2)
    empty.finish_answer("")
    receive = empty.subscribe()
    first = receive.receive_nowait()
    assert isinstance(first, Task) and [artifact.parts for artifact in first.artifacts] == [(TextPart(""),)]


async def test_a_stream_whose_task_end_cannot_be_stored_as_the_server_stops_says_the_next_server_resumes_it(
    keel: Served,
) -> None:
    # Told "the server keeps trying", a client would wait on a server that is about to exit; the
    # server leaves the task as stored, for the next one on its state to resume.
    keel.model.script = [Reply(tool_calls=[GATE_CALL])]
    told: list[EndNotStored] = []

    async def wait_as_a_blocking_send_does(task_id: str) -> None:
        with pytest.raises(EndNotStored) as raised:
            await keel.runner.wait_settled(ANONYMOUS, task_id)
        told.append(raised.value)

    async with keel.stream("SendStreamingMessage", {"message": message("Rotate the staging keys")}) as events:
        first = await events.next()
        assert first is not None
        task_id = first["result"]["task"]["id"]
        await keel.gate.wait_entered()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_as_a_blocking_send_does, task_id)
            await trio.testing.wait_all_tasks_blocked()
            fill_tasks_disk(keel.state_dir, for_text="staging keys")
            keel.runner.stop()  # the drain runs out, and the run's CANCELED cannot be stored
            last = (await events.rest())[-1]
    said = last["error"]["message"]
    assert last["error"]["code"] == -32603 and task_id in said
    assert "keeps trying" not in said and "the server is shutting down" in said and "takes the task up again" in said
    assert [str(error) for error in told] == [
        said.replace(f"the event stream of task {task_id!r} ended before the task did: ", f"task {task_id!r} ended, but ")
    ]


SEND = {V1: "SendMessage", V03: "message/send"}


@asynccontextmanager
async def blocking_send(keel: Served, text: str, version: str | None) -> AsyncIterator[httpx.Response]:
    """A blocking send whose answer is read as it comes."""
    params = {"message": message(text, version)}
    request = keel.http.build_request("POST", keel.rpc_path, json=keel.body(SEND[version], params), headers=keel.headers(version))
    with trio.fail_after(DEADLINE_S):
        response = await keel.http.send(request, stream=True)
    try:
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        yield response
    finally:
        await response.aclose()


async def read_until(chunks: AsyncIterator[bytes], received: bytearray, enough: Callable[[bytes], bool]) -> None:
    with trio.fail_after(DEADLINE_S):
        while not enough(bytes(received)):
            received.extend(await anext(chunks))


async def read_rest(chunks: AsyncIterator[bytes], received: bytearray) -> None:
    with trio.fail_after(DEADLINE_S):
        async for chunk in chunks:
            received.extend(chunk)


@BOTH
async def test_a_blocking_send_whose_task_runs_on_keeps_its_answer_alive_until_the_task_settles(
    fake_model: FakeModel, tmp_path: Path, version: str | None
) -> None:
    # A proxy or client that gives up on a read silent a few seconds (the a2a-sdk client's own
    # HTTP client does after 5 s; a load balancer after 60) would cut a long run's answer.
    async with serve_keel(tmp_path / "state", fake_model, surface=SurfaceConfig(keepalive_s=0.02)) as keel:
        keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Rolled back.")]
        async with blocking_send(keel, "Roll back", version) as response:
            chunks, received = response.aiter_bytes(), bytearray()
            await read_until(chunks, received, lambda said: said.count(b" ") >= 3)
            assert received.strip() == b""  # white space alone while the run goes on
            keel.gate.opened.set()
            await read_rest(chunks, received)
    answer = json.loads(received)  # JSON allows white space before a value
    assert answer["id"] == 1 and state(answer["result"]) in ("TASK_STATE_COMPLETED", "completed"), answer
    assert body(answer["result"])["artifacts"][0]["parts"] == [part("Rolled back.", version)]


@BOTH
async def test_a_blocking_send_settled_before_its_first_keepalive_is_answered_with_its_length(
    fake_model: FakeModel, tmp_path: Path, version: str | None
) -> None:
    async with serve_keel(tmp_path / "state", fake_model, surface=SurfaceConfig(keepalive_s=DEADLINE_S)) as keel:
        keel.model.script = [Reply(text="Quick.")]
        async with blocking_send(keel, "Quick one", version) as response:
            assert response.headers["content-length"] == str(len(await response.aread()))
            assert state(response.json()["result"]) in ("TASK_STATE_COMPLETED", "completed")


async def test_a_blocking_send_keeps_its_answer_alive_for_a_client_with_httpx_defaults(keel: Served) -> None:
    gives_up_after_s = httpx.AsyncClient().timeout.read
    assert gives_up_after_s is not None
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done.")]
    async with blocking_send(keel, "Roll back", V1) as response:
        chunks, received = response.aiter_bytes(), bytearray()
        await keel.gate.wait_entered()
        with trio.fail_after(gives_up_after_s):
            received.extend(await anext(chunks))
        assert received.strip() == b""
        keel.gate.opened.set()
        await read_rest(chunks, received)
    assert state(json.loads(received)["result"]) == "TASK_STATE_COMPLETED"


async def test_a_store_failing_while_a_blocking_send_waits_ends_its_answer_with_the_error(
    fake_model: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with serve_keel(tmp_path / "state", fake_model, surface=SurfaceConfig(keepalive_s=0.02)) as keel:
        keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done.")]
        async with blocking_send(keel, "Roll back", V1) as response:
            chunks, received = response.aiter_bytes(), bytearray()
            await read_until(chunks, received, lambda said: said.count(b" ") >= 1)

            async def failing(_runner: Runner, _owner: str, _task_id: str) -> tuple[Task, str | None]:
                raise DatabaseFailed(keel.state_dir / "tasks.db", sqlite3.OperationalError("disk I/O error"))

            monkeypatch.setattr(Runner, "wait_settled_encoded", failing)
            with caplog.at_level(logging.ERROR, logger="runtime.surface"):
                await read_rest(chunks, received)
            monkeypatch.undo()
            keel.gate.opened.set()  # the task goes on
            [task] = (await keel.result("ListTasks", {}))["tasks"]
            assert (await keel.runner.wait_settled(ANONYMOUS, task["id"])).status.state is TaskState.COMPLETED
    error = json.loads(received)["error"]
    assert error["code"] == -32603 and error["message"].startswith("the server's storage failed while handling 'SendMessage'")
    assert "disk I/O" not in error["message"] and str(keel.state_dir) not in error["message"]
    [logged] = caplog.records
    assert "tasks.db" in logged.getMessage() and logged.exc_info is None
