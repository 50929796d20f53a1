"""Steers and a server killed (SIGKILL) around them: the task's history and its run, after the
next process has taken the task up, each hold every steer that was stored, once."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from fake_model import FakeModel, Reply
from runtime.agent.steers import STEER_LABEL
from tests.e2e.harness import keel_process, rpc, stored_task, user_message, wait_stored_state

DEADLINE_S = 20
FIRST = Reply(text="The first answer, streamed slowly enough for a steer to come. " * 2, chunk_chars=4, gap_s=0.05)
STEERED = "The steered answer."


def _rows(state_dir: Path, sql: str, *args: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"{(state_dir / 'runtime.db').resolve().as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def steers_stored(state_dir: Path, message_id: str) -> int:
    """How many receipts runtime.db holds for the steer with this message id."""
    return len(_rows(state_dir, "SELECT 1 FROM steer_receipts WHERE message_id = ?", message_id))


def steers_taken(state_dir: Path, text: str) -> int:
    """How many times a run took the steer saying ``text`` into its conversation."""
    events = [json.loads(content) for (content,) in _rows(state_dir, "SELECT content FROM events")]
    return sum(event["role"] == "user" and STEER_LABEL + text in event["text"] for event in events)


async def wait_for(probe: Any, *args: object) -> None:
    with trio.fail_after(DEADLINE_S):
        while not await trio.to_thread.run_sync(probe, *args):
            await trio.sleep(0.02)  # polling interval against a deadline


@asynccontextmanager
async def tasks_db_held(state_dir: Path) -> AsyncIterator[None]:
    """Another program holding tasks.db's write lock: every task write waits on it."""
    holder = sqlite3.connect(state_dir / "tasks.db", isolation_level=None, check_same_thread=False)
    try:
        await trio.to_thread.run_sync(holder.execute, "BEGIN IMMEDIATE")
        yield
    finally:
        await trio.to_thread.run_sync(holder.close)  # its transaction rolled back


def history(state_dir: Path, task_id: str) -> list[str]:
    found = stored_task(state_dir, task_id)
    assert found is not None
    return [message["messageId"] for message in found[1]["history"] if message["role"] == "ROLE_USER"]


async def working_task(client: httpx.AsyncClient, url: str, state_dir: Path, fake_model: FakeModel) -> tuple[str, str]:
    """A task whose run is streaming its first answer: its id and its question's message id."""
    question = user_message("Count to ten.")
    sent = await rpc(client, url, "SendMessage", {"message": question, "configuration": {"returnImmediately": True}})
    task_id: str = sent["result"]["task"]["id"]
    await wait_stored_state(state_dir, task_id, ["TASK_STATE_WORKING"])
    with trio.fail_after(DEADLINE_S):
        while not fake_model.bodies:
            await trio.sleep(0.02)  # polling interval against a deadline
    return task_id, question["messageId"]


async def send_steer(client: httpx.AsyncClient, url: str, message: dict[str, Any], replies: list[dict[str, Any] | None]) -> None:
    """Send a steer; its reply, or None when the server was killed before it answered."""
    try:
        replies.append(await rpc(client, url, "SendMessage", {"message": message}))
    except httpx.TransportError:
        replies.append(None)


@pytest.mark.parametrize("record", ["waits", "times-out"])
async def test_a_steer_stored_by_a_process_killed_before_its_task_recorded_it_is_in_its_history_and_taken_once_after_restart(
    tmp_path: Path, fake_model: FakeModel, record: str
) -> None:
    # Its record in the task waits on tasks.db's lock: the process dies with it queued, either
    # before the steer's client is answered, or once it was told the write failed and the run
    # took the steer all the same.
    state = tmp_path / "state"
    fake_model.script = [FIRST]
    fake_model.default = Reply(text=STEERED)
    steer = user_message("In French, please.")
    replies: list[dict[str, Any] | None] = []
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        async with keel_process(state, fake_model.base_url) as keel:
            task_id, question_id = await working_task(client, keel.url, state, fake_model)
            steer["taskId"] = task_id
            async with tasks_db_held(state), trio.open_nursery() as nursery:
                if record == "waits":
                    nursery.start_soon(send_steer, client, keel.url, steer, replies)
                    await wait_for(steers_stored, state, steer["messageId"])
                else:  # held past the bound on the steer's write
                    await send_steer(client, keel.url, steer, replies)
                    await wait_for(steers_taken, state, "In French, please.")
                assert await keel.kill() == -9
        if record == "waits":
            assert replies == [None]
        else:
            assert replies[0] is not None and replies[0]["error"]["code"] == -32603, replies
        assert history(state, task_id) == [question_id]
        asked = len(fake_model.bodies)
        async with keel_process(state, fake_model.base_url) as keel:
            await wait_stored_state(state, task_id, ["TASK_STATE_COMPLETED"])
            assert history(state, task_id) == [question_id, steer["messageId"]]
            got = await rpc(client, keel.url, "GetTask", {"id": task_id})
            assert got["result"]["status"]["message"]["parts"] == [{"text": STEERED}]
            assert await keel.terminate() == 0
    assert steers_taken(state, "In French, please.") == 1
    # The resumed run asked at most once more, with the question and the steer, each once.
    assert all(body["messages"][-1]["content"].count("In French, please.") == 1 for body in fake_model.bodies[asked:])


async def test_a_steer_acknowledged_then_killed_before_its_run_took_it_is_applied_once_and_sent_again_is_not_applied_twice(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    fake_model.script = [Reply(text="An answer that the kill cuts short. " * 8, chunk_chars=2, gap_s=0.1)]
    fake_model.default = Reply(text=STEERED)
    steer = user_message("In French, please.")
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        async with keel_process(state, fake_model.base_url) as keel:
            task_id, question_id = await working_task(client, keel.url, state, fake_model)
            steer["taskId"] = task_id
            params = {"message": steer, "configuration": {"returnImmediately": True}}
            acknowledged = await rpc(client, keel.url, "SendMessage", params)
            assert acknowledged["result"]["task"]["status"]["state"] == "TASK_STATE_WORKING", acknowledged
            assert await keel.kill() == -9  # the answer still streaming: its run has not taken the steer
        assert steers_taken(state, "In French, please.") == 0
        asked = len(fake_model.bodies)
        async with keel_process(state, fake_model.base_url) as keel:
            await wait_stored_state(state, task_id, ["TASK_STATE_COMPLETED"])
            again = await rpc(client, keel.url, "SendMessage", {"message": steer})
            task = again["result"]["task"]
            assert (task["id"], task["status"]["state"]) == (task_id, "TASK_STATE_COMPLETED")
            assert history(state, task_id) == [question_id, steer["messageId"]]
            assert await keel.terminate() == 0
    assert steers_taken(state, "In French, please.") == 1
    assert [body["messages"][-1]["content"].count("In French, please.") for body in fake_model.bodies[asked:]] == [1]
