"""A server restarted after a crash before its model server is up (a machine rebooting): the
tasks the dead process left wait for the model, rather than fail, and end as usual otherwise."""

from __future__ import annotations

import functools
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from fake_model import FakeModel, Reply
from tests.e2e.harness import KeelProcess, keel_process, rpc, stored_task, user_message, wait_stored_state
from tests.e2e.test_process import killed_mid_answer

DEADLINE_S = 20
UNREACHABLE = "the model server cannot be reached"


def free_port() -> int:
    """A loopback port nothing listens on (yet)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port: int = unused.getsockname()[1]
    return port


async def state_once_waiting(keel: KeelProcess, state: Path, task_id: str) -> str:
    """The task's stored state once the server says the task waits for the model server, or
    once it has ended without waiting."""
    waits = f"task {task_id} waits for the model server at http://127.0.0.1:"
    with trio.fail_after(DEADLINE_S):
        while waits not in keel.output.decode():
            found = await trio.to_thread.run_sync(stored_task, state, task_id)
            if found is not None and found[0] != "TASK_STATE_WORKING":
                return found[0]
            await trio.sleep(0.02)  # polling interval against a deadline, not a wait for an event
    assert f"to be reachable to resume: {UNREACHABLE}" in keel.output.decode()
    found = await trio.to_thread.run_sync(stored_task, state, task_id)
    assert found is not None
    return found[0]


@asynccontextmanager
async def restarted_before_the_model(
    client: httpx.AsyncClient, state: Path, fake_model: FakeModel, *extra: str
) -> AsyncIterator[tuple[KeelProcess, str, int]]:
    """A server killed mid-answer, started again with its model server at a port where nothing
    listens yet: the server, the task the first left WORKING, waiting, and that port."""
    task_id = await killed_mid_answer(client, state, fake_model)
    port = free_port()
    async with keel_process(state, f"http://127.0.0.1:{port}/v1", *extra) as keel:
        assert await state_once_waiting(keel, state, task_id) == "TASK_STATE_WORKING"
        yield keel, task_id, port


async def test_a_task_left_working_waits_for_a_model_server_that_comes_up_after_the_restart(
    tmp_path: Path, fake_model: FakeModel, nursery: trio.Nursery
) -> None:
    state = tmp_path / "state"
    async with (
        httpx.AsyncClient(timeout=30) as client,
        restarted_before_the_model(client, state, fake_model) as (keel, task_id, port),
    ):
        health = await client.get(keel.url + "healthz")
        assert health.status_code == 503 and UNREACHABLE in health.json()["problems"][0]
        # Nothing else waits: a new task fails at once, its client there to be told.
        with trio.fail_after(DEADLINE_S):
            new = (await rpc(client, keel.url, "SendMessage", {"message": user_message("Are you there?")}))["result"]["task"]
        assert new["status"]["state"] == "TASK_STATE_FAILED"
        assert UNREACHABLE in new["status"]["message"]["parts"][0]["text"]
        got = (await rpc(client, keel.url, "GetTask", {"id": task_id}))["result"]
        assert got["status"]["state"] == "TASK_STATE_WORKING"
        # A steer sent meanwhile rides the resumed request.
        steer = user_message("Be brief.", task_id=task_id, context_id=got["contextId"])
        steered = await rpc(client, keel.url, "SendMessage", {"message": steer, "configuration": {"returnImmediately": True}})
        assert steered["result"]["task"]["id"] == task_id
        later = await nursery.start(functools.partial(FakeModel(default=Reply(text="The resumed answer.")).serve, port=port))
        assert await wait_stored_state(state, task_id, ["TASK_STATE_COMPLETED"], deadline_s=DEADLINE_S) == "TASK_STATE_COMPLETED"
        got = (await rpc(client, keel.url, "GetTask", {"id": task_id}))["result"]
        assert got["status"]["message"]["parts"] == [{"text": "The resumed answer."}]
        assert await keel.terminate() == 0
    assert f"task {task_id} resumes: the model server is reachable after " in keel.output.decode()
    assert len(later.bodies) == 1
    asked = [m.get("content") for m in later.bodies[0]["messages"] if m["role"] == "user"]
    assert asked[0].startswith("Tell me slowly.") and asked[-1].endswith("Be brief.")  # the steer, after the question


async def test_a_resumed_task_waiting_for_its_model_server_is_canceled_at_once(tmp_path: Path, fake_model: FakeModel) -> None:
    state = tmp_path / "state"
    async with (
        httpx.AsyncClient(timeout=30) as client,
        restarted_before_the_model(client, state, fake_model) as (keel, task_id, _),
    ):
        with trio.fail_after(5):
            canceled = (await rpc(client, keel.url, "CancelTask", {"id": task_id}))["result"]
        assert canceled["status"]["state"] == "TASK_STATE_CANCELED"
        assert await wait_stored_state(state, task_id, ["TASK_STATE_CANCELED"], deadline_s=5) == "TASK_STATE_CANCELED"
        assert await keel.terminate() == 0


async def test_a_server_stopped_while_a_resumed_task_waits_for_its_model_server_does_not_wait_out_the_drain(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        async with restarted_before_the_model(client, state, fake_model, "--drain-timeout-s", "60") as (keel, task_id, _):
            with trio.fail_after(10):  # far less than the drain's 60 s
                assert await keel.terminate(signal.SIGTERM) == 0
    found = stored_task(state, task_id)
    assert found is not None and found[0] == "TASK_STATE_CANCELED"
    assert "the server shut down before it finished" in found[1]["status"]["message"]["parts"][0]["text"]
    assert f"task {task_id}, waiting for the model server to resume, is canceled" in keel.output.decode()


async def test_a_resumed_task_whose_model_server_refuses_its_model_fails_at_once(tmp_path: Path, fake_model: FakeModel) -> None:
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        task_id = await killed_mid_answer(client, state, fake_model)
        async with keel_process(state, fake_model.base_url, "--model", "absent:1b") as keel:
            assert await wait_stored_state(state, task_id, ["TASK_STATE_FAILED"], deadline_s=DEADLINE_S) == "TASK_STATE_FAILED"
            assert await keel.terminate() == 0
    found = stored_task(state, task_id)
    assert found is not None
    refused = "the model or the endpoint does not exist on the server (HTTP 404)"
    assert refused in found[1]["status"]["message"]["parts"][0]["text"]
    assert "waits for the model server" not in keel.output.decode()
