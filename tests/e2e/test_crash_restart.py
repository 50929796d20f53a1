"""A server killed (SIGKILL) or stopped (SIGTERM) under mixed load, and the one that replaces it on
the same state directory: what the clients were told stands, and nothing is left half done."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from fake_model import FakeModel, Reply
from runtime.agent.steers import STEER_LABEL
from tests.e2e.harness import KeelProcess, keel_process, rpc, stream, user_message

ANSWER = "A slow answer, a few characters at a time."
UNFINISHED = ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
# How far along each state is: a state the client was told may only be followed by one further on.
PROGRESS = {"TASK_STATE_SUBMITTED": 0, "TASK_STATE_WORKING": 1}
SETTLE_DEADLINE_S = 60  # a bound for a slow machine; settling takes a few seconds
SEED = 20240611


def slow_model(fake_model: FakeModel, gap_s: float = 0.05) -> None:
    """Every answer is ``ANSWER``, streamed 3 characters every ``gap_s`` (about 0.7 s at 0.05)."""
    fake_model.default = Reply(text=ANSWER, chunk_chars=3, gap_s=gap_s)


@attrs.define
class Told:
    """What the clients were answered: the state each task was last said to be in, the steers
    each task acknowledged, and the first message of each task (to send again)."""

    states: dict[str, str] = attrs.field(factory=dict)
    steers: dict[str, list[str]] = attrs.field(factory=dict)
    steer_messages: dict[str, list[dict[str, Any]]] = attrs.field(factory=dict)  # task id -> the steers it acknowledged
    first_messages: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # task id -> its first message
    contexts: list[str] = attrs.field(factory=list)
    unanswered: list[dict[str, Any]] = attrs.field(factory=list)  # messages whose send the server never answered
    unanswered_steers: list[dict[str, Any]] = attrs.field(factory=list)

    def task(self, task: dict[str, Any]) -> None:
        self.state(task["id"], task["status"]["state"])
        if task["contextId"] not in self.contexts:
            self.contexts.append(task["contextId"])

    def state(self, task_id: str, state: str) -> None:
        before = self.states.get(task_id)
        if before is None or PROGRESS.get(state, 2) >= PROGRESS.get(before, 2):
            assert before is None or before in PROGRESS or before == state, f"task {task_id} told {before}, then {state}"
            self.states[task_id] = state

    def working(self) -> list[str]:
        return [task_id for task_id, state in self.states.items() if state in UNFINISHED]


def answered(reply: dict[str, Any]) -> dict[str, Any] | None:
    result = reply.get("result")
    if not isinstance(result, dict):
        return None
    task = result.get("task", result)
    return task if "status" in task else None


async def workload(client: httpx.AsyncClient, keel: KeelProcess, told: Told, rng: random.Random, operations: int) -> None:
    """``operations`` requests of every kind, a few at a time, until the server goes away."""

    async def one(kind: str) -> None:
        try:
            await operation(kind)
        except (httpx.TransportError, json.JSONDecodeError):
            pass  # the server was killed under it: nothing was acknowledged

    async def send(message: dict[str, Any], *, blocking: bool) -> None:
        config = {} if blocking else {"configuration": {"returnImmediately": True}}
        told.unanswered.append(message)
        task = answered(await rpc(client, keel.url, "SendMessage", {"message": message, **config}))
        told.unanswered.remove(message)
        if task is not None:
            told.first_messages.setdefault(task["id"], message)
            told.task(task)

    async def operation(kind: str) -> None:
        context = rng.choice(told.contexts) if told.contexts and rng.random() < 0.4 else None
        working = told.working()
        if kind == "send":
            await send(user_message(f"question {rng.random():.6f}", context_id=context), blocking=rng.random() < 0.5)
        elif kind == "stream":
            message = user_message(f"streamed {rng.random():.6f}", context_id=context)
            for event in await stream(client, keel.url, "SendStreamingMessage", {"message": message}):
                result = event.get("result", {})
                if "task" in result:
                    told.first_messages.setdefault(result["task"]["id"], message)
                    told.task(result["task"])
                elif "statusUpdate" in result:
                    told.state(result["statusUpdate"]["taskId"], result["statusUpdate"]["status"]["state"])
        elif kind == "steer" and working:
            task_id = rng.choice(working)
            text = f"steer {rng.random():.6f}"
            message = user_message(text, task_id=task_id)
            told.unanswered_steers.append(message)
            reply = await rpc(client, keel.url, "SendMessage", {"message": message, "configuration": {"returnImmediately": True}})
            task = answered(reply)
            told.unanswered_steers.remove(message)
            if task is not None:
                told.steers.setdefault(task_id, []).append(text)
                told.steer_messages.setdefault(task_id, []).append(message)
                told.task(task)
        elif kind == "cancel" and working:
            task = answered(await rpc(client, keel.url, "CancelTask", {"id": rng.choice(working)}))
            if task is not None:
                told.task(task)
        elif kind == "get" and told.states:
            task = answered(await rpc(client, keel.url, "GetTask", {"id": rng.choice(list(told.states))}))
            if task is not None:
                told.task(task)
        elif kind == "list":
            for task in (await rpc(client, keel.url, "ListTasks", {"historyLength": 0})).get("result", {}).get("tasks", []):
                told.task(task)

    kinds = ["send"] * 4 + ["stream"] * 2 + ["steer"] * 3 + ["cancel", "get", "list"]
    async with trio.open_nursery() as nursery:
        for _ in range(operations):
            nursery.start_soon(one, rng.choice(kinds))
            await trio.sleep(rng.uniform(0, 0.1))  # the pace of a client sending requests, not a wait for anything


def stored_tasks(state_dir: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every task's state and JSON as tasks.db holds them."""
    conn = sqlite3.connect(f"{(state_dir / 'tasks.db').resolve().as_uri()}?mode=ro", uri=True)
    try:
        return {row[0]: (row[1], json.loads(row[2])) for row in conn.execute("SELECT id, state, task FROM tasks")}
    finally:
        conn.close()


def transcripts(state_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every session's messages, in order, as runtime.db holds them."""
    conn = sqlite3.connect(f"{(state_dir / 'runtime.db').resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT session_id, content FROM events ORDER BY session_id, seq").fetchall()
    finally:
        conn.close()
    sessions: dict[str, list[dict[str, Any]]] = {}
    for session_id, content in rows:
        sessions.setdefault(session_id, []).append(json.loads(content))
    return sessions


def turns(messages: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A session's messages by the turn (task) whose question opened them."""
    by_turn: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] = []
    for message in messages:
        if message.get("turn_id"):
            assert message["turn_id"] not in by_turn, f"the question of task {message['turn_id']} is stored twice"
            current = by_turn[message["turn_id"]] = []
        current.append(message)
    return by_turn


async def wait_settled(state_dir: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """Poll tasks.db until no task is SUBMITTED or WORKING; the tasks then."""
    with trio.fail_after(SETTLE_DEADLINE_S):
        while True:
            tasks = await trio.to_thread.run_sync(stored_tasks, state_dir)
            if not [task_id for task_id, (state, _) in tasks.items() if state in UNFINISHED]:
                return tasks
            await trio.sleep(0.05)  # polling interval against a deadline


def left_steers(state_dir: Path) -> list[tuple[str, str]]:
    """The steers runtime.db holds for a run to take."""
    conn = sqlite3.connect(f"{(state_dir / 'runtime.db').resolve().as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT task_id, text FROM steers").fetchall()
    finally:
        conn.close()


def check_invariants(state_dir: Path, told: Told) -> None:
    assert left_steers(state_dir) == [], "steers left in runtime.db for tasks that have ended"
    tasks = stored_tasks(state_dir)
    for task_id, state in told.states.items():
        assert task_id in tasks, f"task {task_id} was acknowledged ({state}) and is not stored"
        stored = tasks[task_id][0]
        if state in PROGRESS:
            assert PROGRESS.get(stored, 2) >= PROGRESS[state], f"task {task_id}: told {state}, stored {stored}"
        else:
            assert stored == state, f"task {task_id}: told {state}, stored {stored}"
    sessions = transcripts(state_dir)
    by_turn = {turn_id: turn for messages in sessions.values() for turn_id, turn in turns(messages).items()}
    for task_id, (state, task) in tasks.items():
        assert state not in UNFINISHED, f"task {task_id} left {state}"
        history = [m for m in task.get("history", [])]
        said = [p.get("text", "") for m in history if m["role"] == "ROLE_USER" for p in m["parts"]]
        for steer in told.steers.get(task_id, []):
            assert steer in said, f"task {task_id}: the steer {steer!r} it acknowledged is not in its history"
        turn = by_turn.get(task_id, [])
        answers = [m for m in turn if m["role"] == "assistant" and not m.get("tool_calls") and not m.get("partial")]
        # One answer a turn, and a steer taken more than once would be stored twice.
        steers_taken = Counter(m["text"] for m in turn if m["role"] == "user" and m["text"].startswith(STEER_LABEL))
        assert all(count == 1 for count in steers_taken.values()), f"task {task_id}: a steer taken twice: {steers_taken}"
        for steer in steers_taken:
            assert steer.removeprefix(STEER_LABEL) in said, f"task {task_id}: its run took {steer!r}, not in its history"
        if state == "TASK_STATE_COMPLETED":
            assert len(answers) >= 1, f"task {task_id} COMPLETED with no answer in runtime.db"
            assert task["status"]["message"]["parts"][0]["text"] == answers[-1]["text"] == ANSWER
            for steer in told.steers.get(task_id, []):
                assert steers_taken[STEER_LABEL + steer] == 1, f"task {task_id} COMPLETED without its steer {steer!r}"
            # Each answer stored is a model request answered: one a round (a steer's continuation makes two).
            assert len(answers) <= 1 + len(steers_taken), f"task {task_id}: answered {len(answers)} times"
        else:
            # A cancel written after the answer was saved, before COMPLETED was: the answer stays.
            late_cancel = 1 if state == "TASK_STATE_CANCELED" else 0
            assert len(answers) <= len(steers_taken) + late_cancel, f"task {task_id} {state} with {len(answers)} answers stored"


async def resend_steers(client: httpx.AsyncClient, keel: KeelProcess, told: Told) -> None:
    """The steers whose send the server never answered, sent again as their client would: one its
    task did not record (the process died between the steer's write and the task's) is recorded."""
    for message in told.unanswered_steers:
        task = answered(await rpc(client, keel.url, "SendMessage", {"message": message}))
        if task is not None:
            told.steers.setdefault(message["taskId"], []).append(message["parts"][0]["text"])
            told.steer_messages.setdefault(message["taskId"], []).append(message)


async def resend_all(client: httpx.AsyncClient, keel: KeelProcess, told: Told, state_dir: Path) -> None:
    """Each acknowledged task's first message, sent again: its task back, and nothing new."""
    before = stored_tasks(state_dir)
    for task_id, message in told.first_messages.items():
        reply = await rpc(client, keel.url, "SendMessage", {"message": message, "configuration": {"returnImmediately": True}})
        assert answered(reply) is not None, reply
        assert answered(reply)["id"] == task_id  # type: ignore[index]
    for task_id, messages in told.steer_messages.items():
        for message in messages:
            context_id = before[task_id][1]["contextId"]
            for again in (message, {**{k: v for k, v in message.items() if k != "taskId"}, "contextId": context_id}):
                params = {"message": again, "configuration": {"returnImmediately": True}}
                reply = await rpc(client, keel.url, "SendMessage", params)
                assert answered(reply) is not None, reply
                assert answered(reply)["id"] == task_id  # type: ignore[index]
    after = stored_tasks(state_dir)
    assert {task_id: state for task_id, (state, _) in after.items()} == {task_id: state for task_id, (state, _) in before.items()}
    for message in told.unanswered:  # its task may have been stored: sent again, it is taken once
        reply = await rpc(client, keel.url, "SendMessage", {"message": message, "configuration": {"returnImmediately": True}})
        assert answered(reply) is not None, reply
    firsts = Counter(task["history"][0]["messageId"] for _, task in stored_tasks(state_dir).values())
    assert all(count == 1 for count in firsts.values()), "a message started two tasks"
    for task_id, (_, task) in after.items():
        ids = Counter(m["messageId"] for m in task["history"])
        assert all(count == 1 for count in ids.values()), f"task {task_id}: a message twice in its history"
    assert set(after) == set(before)
    assert {task_id: state for task_id, (state, _) in after.items()} == {task_id: state for task_id, (state, _) in before.items()}


async def stop(keel: KeelProcess, how: str, rng: random.Random) -> None:
    """Stop the server as ``how`` says: "kill" (SIGKILL), "term" (SIGTERM, its drain let run), or
    "term-kill" (SIGTERM, then SIGKILL a moment into the drain)."""
    if how == "kill":
        assert await keel.kill() == -9
        return
    keel.process.send_signal(signal.SIGTERM)
    if how == "term":
        assert await keel.wait() == 0
        return
    with trio.fail_after(10):
        while b"shutting down" not in keel.output:
            await trio.sleep(0.01)  # polling the output against the deadline
    await trio.sleep(rng.uniform(0, 0.5))  # a moment into the drain: when does not matter, only that it varies
    assert await keel.kill() in (-9, 0)  # a drain with nothing left to wait for may have ended first


async def crash_rounds(state: Path, fake_model: FakeModel, seed: int, rounds: list[str], *extra: str) -> Told:
    rng = random.Random(seed)
    told = Told()
    async with httpx.AsyncClient(timeout=30) as client:
        for how in rounds:
            async with keel_process(state, fake_model.base_url, *extra) as keel, trio.open_nursery() as nursery:
                nursery.start_soon(workload, client, keel, told, rng, 40)
                await trio.sleep(rng.uniform(1.0, 2.5))  # some of the workload done, some under way
                await stop(keel, how, rng)
                nursery.cancel_scope.cancel()
        async with keel_process(state, fake_model.base_url) as keel:
            await wait_settled(state)
            await resend_steers(client, keel, told)
            check_invariants(state, told)
            await resend_all(client, keel, told, state)
            assert await keel.terminate() == 0
    assert told.states, "the workload was acknowledged nothing"
    return told


async def test_a_mixed_load_killed_at_random_moments_keeps_what_each_client_was_told(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    slow_model(fake_model)
    await crash_rounds(tmp_path / "state", fake_model, SEED, ["kill", "kill", "kill"])


async def test_a_mixed_load_stopped_by_sigterm_and_killed_in_its_drain_keeps_what_each_client_was_told(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    slow_model(fake_model)
    rounds = ["term-kill", "term", "term-kill"]
    await crash_rounds(tmp_path / "state", fake_model, SEED + 1, rounds, "--drain-timeout-s", "30")
