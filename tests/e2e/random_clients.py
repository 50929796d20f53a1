"""A seeded, random sequence of what clients do to a real `serve` process, one action at a time,
over A2A 1.0 and 0.3, with the server stopped (SIGTERM) or killed (SIGKILL) between actions or in
the middle of one and started again on the same state directory. A model of what the clients were
told is checked after every action and after every restart; a violation fails with the seed and
the actions so far, so that it reproduces."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import traceback
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from fake_model import Call, FakeModel, Reply, ScriptItem
from protocol import SseParser
from runtime.agent.steers import STEER_LABEL
from runtime.models.transport import with_whole_body
from tests.e2e.harness import STARTUP_DEADLINE_S, KeelProcess, child_env, serve_command, user_message

MODEL_TIMEOUT_S = 2  # how long a hanging model holds a run before it fails
SETTLE_DEADLINE_S = 60  # a bound for a slow machine; settling takes a few seconds
WAIT_S = 1.5  # how long a client waits on a stream or a blocking send before it reads the task instead
FIRST_EVENT_DEADLINE_S = 30  # a bound for a slow machine on a stream's first event, which always comes

UNFINISHED = ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
TERMINAL = ("TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED")
# How far along each state is: a task's state may only move to one further on.
PROGRESS = {"TASK_STATE_SUBMITTED": 0, "TASK_STATE_WORKING": 1, "TASK_STATE_INPUT_REQUIRED": 1, "TASK_STATE_AUTH_REQUIRED": 1}
ANSWER = "An answer."
SLOW = "A slow answer, streamed a few characters at a time. " * 2


def reply_for(body: dict[str, Any]) -> ScriptItem:
    """The fake model's answer to a request, chosen by the mode its last message names: at once,
    slowly, a tool call first, or hanging (until the run's model timeout fails it)."""
    last = body["messages"][-1]
    if last.get("role") == "tool":
        return Reply(text=ANSWER)
    text = str(last.get("content", ""))
    if "mode=slow" in text:
        return Reply(text=SLOW, chunk_chars=4, gap_s=0.03)
    if "mode=tool" in text:
        return Reply(tool_calls=[Call("clock")])
    if "mode=hang" in text:
        return Reply(text="Half an", chunk_chars=4, hang_after_chunks=2)
    return Reply(text=ANSWER)


def when(timestamp: str) -> datetime:
    """An RFC 3339 time as ProtoJSON writes it (0, 3, 6 or 9 digits of the second's fraction)."""
    return datetime.fromisoformat(timestamp)


def state_of(task: dict[str, Any], version: str) -> str:
    state: str = task["status"]["state"]
    return state if version == "1.0" else "TASK_STATE_" + state.upper().replace("-", "_")


@attrs.define
class Known:
    """What the clients were told of one task."""

    id: str
    context_id: str
    first: dict[str, Any]  # its first message, as sent (1.0 or 0.3)
    first_version: str
    state: str = "TASK_STATE_SUBMITTED"
    history: list[str] = attrs.field(factory=list)  # the message ids of its whole history, last seen
    steers: list[tuple[dict[str, Any], str]] = attrs.field(factory=list)  # acknowledged, with their version
    canceled: bool = False  # CancelTask answered it CANCELED
    timestamp: str = ""  # its status's, last seen
    whole: dict[str, Any] | None = None  # as GetTask (1.0) last showed it, once it had ended
    earlier: list[str] = attrs.field(factory=list)  # the questions of its context that had completed when it was sent


class Violation(AssertionError):
    pass


@attrs.define(eq=False)
class Driver:
    state_dir: Path
    fake_model: FakeModel
    seed: int
    wait_s: float = WAIT_S  # see WAIT_S
    model_timeout_s: float = MODEL_TIMEOUT_S  # the server's, as started
    drain_timeout_s: float = 5  # likewise
    rng: random.Random = attrs.field(init=False)
    client: httpx.AsyncClient = attrs.field(init=False)
    keel: KeelProcess | None = None
    tasks: dict[str, Known] = attrs.field(factory=dict)
    unanswered: list[tuple[dict[str, Any], str]] = attrs.field(factory=list)  # sends the server never answered
    unanswered_steers: list[tuple[Known, dict[str, Any], str]] = attrs.field(factory=list)
    log: list[str] = attrs.field(factory=list)
    counter: int = 0
    racing: dict[str, tuple[str, bool]] | None = None  # while requests run at once: each task's state and cancel before them
    nursery: trio.Nursery = attrs.field(init=False)  # reads the output of each server

    def __attrs_post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    # ---- reporting -------------------------------------------------------------------------

    def fail(self, what: str) -> None:
        actions = "\n".join(f"  {line}" for line in self.log[-60:])
        output = self.keel.output.decode(errors="replace")[-4000:] if self.keel else ""
        raise Violation(f"seed {self.seed}: {what}\nactions (last 60):\n{actions}\nserver output (last part):\n{output}")

    def check(self, condition: bool, what: str) -> None:
        if not condition:
            self.fail(what)

    def note(self, line: str) -> None:
        self.log.append(line)

    # ---- the wire --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.keel is not None
        return self.keel.url

    async def rpc(self, method: str, params: dict[str, Any], version: str) -> dict[str, Any]:
        body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
        headers = {"A2A-Version": "1.0"} if version == "1.0" else {}
        request = with_whole_body(self.client.build_request("POST", self.url, json=body, headers=headers))
        response = await self.client.send(request)
        result: dict[str, Any] = response.json()
        return result

    async def stream(self, method: str, params: dict[str, Any], version: str) -> list[dict[str, Any]]:
        """The responses of a streaming method: the first, however long it takes (the headers
        go out before it, and a busy machine may take a while to send it), then the others until
        the stream ends or ``wait_s`` passes."""
        body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
        headers = {"A2A-Version": "1.0"} if version == "1.0" else {}
        request = with_whole_body(self.client.build_request("POST", self.url, json=body, headers=headers))
        events: list[dict[str, Any]] = []
        response = await self.client.send(request, stream=True)
        try:
            if response.headers.get("content-type", "").startswith("application/json"):
                events.append(json.loads(await response.aread()))
                return events
            parser = SseParser()
            chunks = response.aiter_bytes()
            with trio.fail_after(FIRST_EVENT_DEADLINE_S):
                async for chunk in chunks:
                    events += [json.loads(event.data) for event in parser.feed(chunk) if event.data]
                    if events:
                        break
            with trio.move_on_after(self.wait_s):
                async for chunk in chunks:
                    events += [json.loads(event.data) for event in parser.feed(chunk) if event.data]
        finally:
            await response.aclose()
        return events

    def message(self, text: str, version: str, *, context_id: str | None = None, task_id: str | None = None) -> dict[str, Any]:
        self.counter += 1  # ids of the seed's own, so that a sequence runs again as it ran
        return {**user_message(text, context_id=context_id, task_id=task_id, version=version), "messageId": f"m{self.seed}-{self.counter}"}

    # ---- the model of what must be true ------------------------------------------------------

    def seen(self, task: dict[str, Any], version: str, *, whole_history: bool, source: str) -> Known | None:
        """Check a task as the server showed it against what was told before, and keep it."""
        task_id = str(task.get("id"))
        known = self.tasks.get(task_id)
        if known is None:
            return None
        state = state_of(task, version)
        self.check(task.get("contextId") == known.context_id, f"{source}: task {task_id} in context {task.get('contextId')}, was {known.context_id}")
        # Answers to requests made at once may be read in another order than they were given:
        # each is checked against what was known before those requests.
        before, canceled = self.racing.get(task_id, ("TASK_STATE_SUBMITTED", False)) if self.racing is not None else (known.state, known.canceled)
        if before in TERMINAL:
            self.check(state == before, f"{source}: task {task_id} was {before}, now {state}")
        else:
            self.check(
                state in TERMINAL or PROGRESS.get(state, -1) >= PROGRESS[before],
                f"{source}: task {task_id} went from {before} back to {state}",
            )
        if canceled:
            self.check(state == "TASK_STATE_CANCELED", f"{source}: task {task_id} was answered CANCELED, now {state}")
        stamp = task["status"].get("timestamp", "")
        if self.racing is None and stamp:
            self.check(not known.timestamp or when(stamp) >= when(known.timestamp), f"{source}: task {task_id} status dated {stamp}, before {known.timestamp} seen earlier")
            known.timestamp = stamp
        if known.state not in TERMINAL and (state in TERMINAL or PROGRESS.get(state, -1) >= PROGRESS[known.state]):
            known.state = state
        elif self.racing is None:
            known.state = state
        if state == "TASK_STATE_COMPLETED" and version == "1.0" and "message" in task["status"]:
            said = [p.get("text") for p in task["status"]["message"]["parts"]]
            self.check(said in ([ANSWER], [SLOW]), f"{source}: task {task_id} COMPLETED saying {said}")
            answers = [a for a in task.get("artifacts", []) if a.get("artifactId") == "answer"]
            if "artifacts" in task:
                self.check(
                    [[p.get("text") for p in a["parts"]] for a in answers] == [said],
                    f"{source}: task {task_id} COMPLETED saying {said}, its answer artifact {answers}",
                )
        if whole_history:
            ids = [m["messageId"] for m in task.get("history", [])]
            if self.racing is not None:
                self.check(ids[:1] == [known.first["messageId"]] and len(set(ids)) == len(ids), f"{source}: task {task_id} history {ids}")
                return known
            counts = Counter(ids)
            self.check(all(n == 1 for n in counts.values()), f"{source}: task {task_id} holds a message twice: {ids}")
            lost = [m for m in known.history if m not in counts]
            self.check(not lost, f"{source}: task {task_id} lost {lost} from its history (was {known.history}, now {ids})")
            kept = [m for m in ids if m in set(known.history)]
            self.check(kept == known.history, f"{source}: task {task_id} history reordered: was {known.history}, now {ids}")
            self.check(ids[:1] == [known.first["messageId"]], f"{source}: task {task_id} history does not start with its message: {ids}")
            for steer, _ in known.steers:
                self.check(steer["messageId"] in counts, f"{source}: task {task_id} lost its steer {steer['messageId']}: {ids}")
            known.history = ids
        return known

    def adopt(self, task: dict[str, Any], version: str, message: dict[str, Any], message_version: str) -> Known:
        """A new task the server acknowledged for ``message``."""
        known = Known(task["id"], task["contextId"], message, message_version, history=[message["messageId"]])
        known.earlier = [
            k.first["parts"][0]["text"] for k in self.tasks.values()
            if k.context_id == known.context_id and k.state == "TASK_STATE_COMPLETED"
        ]  # fmt: skip
        for other in self.tasks.values():
            self.check(other.first["messageId"] != message["messageId"], f"message {message['messageId']} started {other.id} and {known.id}")
        self.tasks[known.id] = known
        return known

    def task_of(self, reply: dict[str, Any], version: str) -> dict[str, Any] | None:
        result = reply.get("result")
        if not isinstance(result, dict):
            return None
        if version == "1.0":
            task = result.get("task")
            return task if isinstance(task, dict) else None
        return result if result.get("kind") == "task" else None

    def error_of(self, reply: dict[str, Any], source: str, allowed: tuple[int, ...], names: str | None = None) -> dict[str, Any]:
        error = reply.get("error")
        self.check(isinstance(error, dict), f"{source}: neither a task nor an error: {reply}")
        assert isinstance(error, dict)
        self.check(error.get("code") in allowed, f"{source}: error {error.get('code')} is none of {allowed}: {error}")
        if names is not None:
            self.check(names in str(error.get("message")), f"{source}: the error does not name {names}: {error}")
        return error

    # ---- actions -------------------------------------------------------------------------------

    def version(self) -> str:
        return self.rng.choice(["1.0", "0.3"])

    def mode(self, *, hang: bool) -> str:
        modes = ["fast"] * 3 + ["slow"] * 3 + ["tool"] * 2 + (["hang"] if hang else [])
        return self.rng.choice(modes)

    def pick(self, *, unfinished: bool = False) -> Known | None:
        choices = [k for k in self.tasks.values() if not unfinished or k.state not in TERMINAL]
        return self.rng.choice(choices) if choices else None

    async def send(self) -> None:
        version = self.version()
        how = self.rng.choice(["blocking", "immediate", "immediate", "stream"])
        context = self.pick() if self.rng.random() < 0.4 else None
        mode = self.mode(hang=how == "immediate")
        message = self.message(f"question {self.counter + 1} mode={mode}", version, context_id=context.context_id if context else None)
        self.note(f"send {how} v{version} {message['messageId']} mode={mode} context={context.context_id if context else None}")
        await self.deliver(message, version, how)

    async def deliver(self, message: dict[str, Any], version: str, how: str) -> None:
        """Send a message that starts a task, keeping what the server answers."""
        source = f"send {message['messageId']}"
        self.unanswered.append((message, version))
        if how == "stream":
            method = "SendStreamingMessage" if version == "1.0" else "message/stream"
            events = await self.stream(method, {"message": message}, version)
            self.unanswered.remove((message, version))
            self.check(bool(events), f"{source}: a stream with no event")
            first = self.task_of({"result": events[0].get("result")}, version) if "result" in events[0] else None
            if first is None:
                self.refused(events[0], message, version, source)
                return
            if first["id"] not in self.tasks:
                self.adopt(first, version, message, version)
            known = self.tasks[first["id"]]
            self.seen(first, version, whole_history=True, source=source)
            self.stream_events(known, events[1:], version, source)
            return
        configuration = {}
        if how == "immediate":
            configuration = {"configuration": {"returnImmediately": True} if version == "1.0" else {"blocking": False}}
        method = "SendMessage" if version == "1.0" else "message/send"
        reply = None
        with trio.move_on_after(self.wait_s if how == "blocking" else 30):
            reply = await self.rpc(method, {"message": message, **configuration}, version)
        if reply is None:  # the client gave up waiting: the same message sent again gets its task
            self.note(f"  gave up waiting; sent again at once")
            immediate = {"configuration": {"returnImmediately": True} if version == "1.0" else {"blocking": False}}
            reply = await self.rpc(method, {"message": message, **immediate}, version)
        self.unanswered.remove((message, version))
        task = self.task_of(reply, version)
        if task is None:
            self.refused(reply, message, version, source)
            return
        if task["id"] not in self.tasks:
            self.adopt(task, version, message, version)
        self.seen(task, version, whole_history=True, source=source)
        self.note(f"  -> {task['id']} {self.tasks[task['id']].state}")

    def refused(self, reply: dict[str, Any], message: dict[str, Any], version: str, source: str) -> None:
        """A send refused. One refused as the server shuts down is sent again once the next is up,
        as the refusal says: a task the server could not confirm may land yet."""
        error = self.error_of(reply, source, (-32602, -32004))
        if "shutting down" in str(error.get("message")):
            self.unanswered.append((message, version))
        self.note(f"  -> refused {error['code']}: {str(error.get('message'))[:120]}")

    def stream_events(self, known: Known, events: list[dict[str, Any]], version: str, source: str) -> None:
        ended = False
        for event in events:
            result = event.get("result")
            if result is None:
                # A stream cut short says why, naming its task.
                self.error_of(event, source, (-32603,), names=known.id)
                continue
            self.check(not ended, f"{source}: an event after the stream's last state: {event}")
            status_update = result.get("statusUpdate") if version == "1.0" else (result if result.get("kind") == "status-update" else None)
            if status_update is not None:
                self.check(status_update["taskId"] == known.id, f"{source}: an update of another task: {event}")
                task = {"id": known.id, "contextId": status_update["contextId"], "status": status_update["status"]}
                self.seen(task, version, whole_history=False, source=source)
                ended = state_of(task, version) not in UNFINISHED
        self.note(f"  -> {known.id} {known.state} ({len(events)} updates)")

    async def steer(self) -> None:
        target = self.pick(unfinished=self.rng.random() < 0.8)
        if target is None:
            return
        version = self.version()
        mode = self.rng.choice(["fast", "slow"])
        message = self.message(f"steer {self.counter + 1} mode={mode}", version, task_id=target.id)
        self.note(f"steer v{version} {message['messageId']} -> {target.id} (told {target.state})")
        await self.steer_with(target, message, version)

    async def steer_with(self, target: Known, message: dict[str, Any], version: str) -> bool:
        """Whether the steer was taken (answered with its task), rather than refused."""
        source = f"steer {message['messageId']}"
        method = "SendMessage" if version == "1.0" else "message/send"
        configuration = {"configuration": {"returnImmediately": True} if version == "1.0" else {"blocking": False}}
        was = self.racing[target.id][0] if self.racing is not None and target.id in self.racing else target.state
        reply = await self.rpc(method, {"message": message, **configuration}, version)
        task = self.task_of(reply, version)
        if task is None:
            error = self.error_of(reply, source, (-32004, -32602), names=None)
            self.note(f"  -> refused {error['code']}: {error['message'][:120]}")
            return False
        self.check(task["id"] == target.id, f"{source}: a steer to {target.id} answered with task {task['id']}")
        self.check(was not in TERMINAL or any(s["messageId"] == message["messageId"] for s, _ in target.steers),
                   f"{source}: a steer to task {target.id}, which had ended ({was}), was taken")
        if not any(s["messageId"] == message["messageId"] for s, _ in target.steers):
            target.steers.append((message, version))
        self.seen(task, version, whole_history=True, source=source)
        self.note(f"  -> taken, {target.state}")
        return True

    async def resend(self) -> None:
        target = self.pick()
        if target is None:
            return
        if target.steers and self.rng.random() < 0.5:
            await self.resend_steer(target, *self.rng.choice(target.steers))
            return
        message, version = target.first, target.first_version
        how = self.rng.choice(["blocking", "immediate", "stream"])
        self.note(f"resend {how} {message['messageId']} of {target.id}")
        count = len(self.tasks)
        await self.deliver(message, version, how)
        self.check(len(self.tasks) == count, f"resent {message['messageId']} started a second task")

    async def resend_steer(self, target: Known, message: dict[str, Any], version: str) -> None:
        """A steer the server acknowledged, sent again: answered with its task again."""
        self.note(f"resend steer {message['messageId']} of {target.id}")
        self.check(await self.steer_with(target, message, version), f"resent steer {message['messageId']} refused")

    async def race(self) -> None:
        """Two requests at once: a message sent twice, a steer sent twice, a steer and a cancel,
        two cancels. Each answer is checked as it comes."""
        target = self.pick(unfinished=True)
        kind = self.rng.choice(["send twice", "steer twice", "steer and cancel", "cancel twice"])
        if kind == "send twice" or target is None:
            version = self.version()
            context = self.pick() if self.rng.random() < 0.4 else None
            message = self.message(f"question {self.counter + 1} mode={self.mode(hang=False)}", version,
                                   context_id=context.context_id if context else None)  # fmt: skip
            hows = [self.rng.choice(["blocking", "immediate", "stream"]) for _ in range(2)]
            self.note(f"race: send {message['messageId']} twice ({hows}), v{version}")
            self.racing = {k.id: (k.state, k.canceled) for k in self.tasks.values()}
            async with trio.open_nursery() as nursery:
                for how in hows:
                    nursery.start_soon(self.deliver, message, version, how)
            self.racing = None
            for known in self.tasks.values():
                if known.first["messageId"] == message["messageId"]:
                    await self.refresh(known)
            self.check(sum(k.first["messageId"] == message["messageId"] for k in self.tasks.values()) <= 1, "two tasks")
            return
        version = self.version()
        steer = self.message(f"steer {self.counter + 1} mode={self.rng.choice(['fast', 'slow'])}", version, task_id=target.id)
        self.note(f"race: {kind} on {target.id} (told {target.state}), v{version}")
        self.racing = {k.id: (k.state, k.canceled) for k in self.tasks.values()}
        async with trio.open_nursery() as nursery:
            if kind == "steer twice":
                nursery.start_soon(self.steer_with, target, steer, version)
                nursery.start_soon(self.steer_with, target, steer, version)
            elif kind == "steer and cancel":
                nursery.start_soon(self.steer_with, target, steer, version)
                nursery.start_soon(self.cancel_task, target, version)
            else:
                nursery.start_soon(self.cancel_task, target, version)
                nursery.start_soon(self.cancel_task, target, self.version())
        self.racing = None
        await self.refresh(target)

    async def misuse(self) -> None:
        """A message id used again where it does not belong: refused with -32602 naming the task
        it went to, and nothing changes."""
        target = self.pick()
        if target is None:
            return
        version = target.first_version
        kind = self.rng.choice(["other parts", "steer elsewhere", "question as steer", "steer by context"])
        if kind == "steer by context":
            if not target.steers or target.steers[0][1] != "1.0":
                return
            steer, _ = target.steers[0]
            again = {k: v for k, v in steer.items() if k != "taskId"} | {"contextId": target.context_id}
            self.note(f"resend steer {steer['messageId']} of {target.id} by its context")
            reply = await self.rpc("SendMessage", {"message": again, "configuration": {"returnImmediately": True}}, "1.0")
            task = self.task_of(reply, "1.0")
            self.check(task is not None and task["id"] == target.id, f"steer {steer['messageId']} sent again by its context: {reply}")
            assert task is not None
            self.seen(task, "1.0", whole_history=True, source=f"steer {steer['messageId']} by context")
            return
        if kind == "other parts":
            message = dict(target.first)
            message["parts"] = [{"text": "other words"}] if version == "1.0" else [{"kind": "text", "text": "other words"}]
        else:
            others = [k for k in self.tasks.values() if k.context_id == target.context_id and k.id != target.id]
            if not others:
                return
            other = self.rng.choice(others)
            if kind == "steer elsewhere":
                if not target.steers:
                    return
                message, version = target.steers[0]
            else:
                message = target.first
            message = {**message, "taskId": other.id}
        self.note(f"misuse: {kind}, {message['messageId']} of {target.id}")
        method = "SendMessage" if version == "1.0" else "message/send"
        count = len(self.tasks)
        reply = await self.rpc(method, {"message": message}, version)
        self.error_of(reply, f"misuse {kind} {message['messageId']}", (-32602,), names=target.id)
        self.check(len(self.tasks) == count, "a task started")
        await self.refresh(target)

    async def get(self) -> None:
        target = self.pick()
        if target is None:
            return
        version = self.version()
        length = self.rng.choice([None, None, 0, 1, 3])
        params: dict[str, Any] = {"id": target.id}
        if length is not None:
            params["historyLength"] = length
        reply = await self.rpc("GetTask" if version == "1.0" else "tasks/get", params, version)
        task = reply.get("result")
        source = f"get v{version} {target.id} historyLength={length}"
        self.check(isinstance(task, dict), f"{source}: {reply}")
        assert isinstance(task, dict)
        whole = length is None or (version == "0.3" and length == 0)
        self.seen(task, version, whole_history=whole, source=source)
        if not whole:
            ids = [m["messageId"] for m in task.get("history", [])]
            self.check(len(ids) <= (length or 0), f"{source}: {len(ids)} messages")
        self.note(f"get v{version} {target.id} historyLength={length} -> {target.state}")

    async def both_versions(self) -> None:
        """A 1.0 and a 0.3 client see the same task."""
        target = self.pick()
        if target is None:
            return
        one = (await self.rpc("GetTask", {"id": target.id}, "1.0")).get("result")
        other = (await self.rpc("tasks/get", {"id": target.id}, "0.3")).get("result")
        source = f"get both {target.id}"
        self.check(isinstance(one, dict) and isinstance(other, dict), f"{source}: {one} / {other}")
        assert isinstance(one, dict) and isinstance(other, dict)
        self.seen(one, "1.0", whole_history=True, source=source + " 1.0")
        self.seen(other, "0.3", whole_history=True, source=source + " 0.3")
        if state_of(one, "1.0") in TERMINAL:
            self.check(state_of(one, "1.0") == state_of(other, "0.3"), f"{source}: {one['status']} / {other['status']}")
            self.check(
                [m["messageId"] for m in one.get("history", [])] == [m["messageId"] for m in other.get("history", [])],
                f"{source}: the histories differ",
            )
            self.check(
                [[p.get("text") for p in m["parts"]] for m in one.get("history", [])]
                == [[p.get("text") for p in m["parts"]] for m in other.get("history", [])],
                f"{source}: the histories' texts differ",
            )
        self.note(f"get both {target.id} -> {target.state}")

    async def list_tasks(self) -> None:
        """ListTasks (1.0), filtered at random, walked page by page: it agrees with the model."""
        params: dict[str, Any] = {"pageSize": self.rng.randint(1, 6)}
        context = self.pick() if self.rng.random() < 0.4 else None
        if context is not None:
            params["contextId"] = context.context_id
        if self.rng.random() < 0.3:
            params["status"] = self.rng.choice(["TASK_STATE_COMPLETED", "TASK_STATE_WORKING", "TASK_STATE_CANCELED", "TASK_STATE_FAILED"])
        if self.rng.random() < 0.5:
            params["historyLength"] = self.rng.choice([0, 2])
        whole = "historyLength" not in params
        ended_before = {k.id for k in self.tasks.values() if k.state in TERMINAL and (context is None or k.context_id == context.context_id)}
        if "status" in params:
            ended_before = {i for i in ended_before if self.tasks[i].state == params["status"]}
        self.note(f"list {params}")
        listed: list[str] = []
        token = None
        for _ in range(200):
            page_params = dict(params) if token is None else {**params, "pageToken": token}
            reply = await self.rpc("ListTasks", page_params, "1.0")
            result = reply.get("result")
            self.check(isinstance(result, dict), f"list {page_params}: {reply}")
            assert isinstance(result, dict)
            for task in result.get("tasks", []):
                self.check(task["id"] in self.tasks, f"list: a task no client started: {task['id']} {task['status']}")
                if "contextId" in params:
                    self.check(task["contextId"] == params["contextId"], f"list: task {task['id']} of another context")
                if "status" in params:
                    self.check(task["status"]["state"] == params["status"], f"list: task {task['id']} {task['status']['state']}")
                self.seen(task, "1.0", whole_history=whole, source=f"list {params}")
                listed.append(task["id"])
            token = result.get("nextPageToken")
            if not token:
                break
        counts = Counter(listed)
        self.check(all(n == 1 for n in counts.values()), f"list {params}: a task on two pages: {counts}")
        missing = ended_before - set(listed)
        self.check(not missing, f"list {params}: tasks that had ended are on no page: {missing}")
        if "contextId" not in params and "status" not in params:
            self.check(set(listed) <= set(self.tasks), "list: tasks no client started")
        self.note(f"  -> {len(listed)} tasks")

    async def list_all(self) -> list[dict[str, Any]]:
        tasks: list[dict[str, Any]] = []
        token = None
        while True:
            params: dict[str, Any] = {"pageSize": 100} if token is None else {"pageSize": 100, "pageToken": token}
            result = (await self.rpc("ListTasks", params, "1.0"))["result"]
            tasks += result["tasks"]
            token = result["nextPageToken"]
            if not token:
                return tasks

    async def subscribe(self) -> None:
        target = self.pick(unfinished=self.rng.random() < 0.7)
        if target is None:
            return
        version = self.version()
        self.note(f"subscribe v{version} {target.id} (told {target.state})")
        was = target.state
        method = "SubscribeToTask" if version == "1.0" else "tasks/resubscribe"
        events = await self.stream(method, {"id": target.id}, version)
        source = f"subscribe {target.id}"
        self.check(bool(events), f"{source}: nothing")
        first = events[0].get("result")
        if first is None:
            error = self.error_of(events[0], source, (-32004, -32603), names=target.id)
            if error["code"] == -32004:
                # Refused for a task that has ended: it has.
                await self.refresh(target)
                self.check(target.state in TERMINAL, f"{source}: refused ({error['message']}) while {target.state}")
            self.note(f"  -> {error['code']}")
            return
        self.check(was not in TERMINAL, f"{source}: a stream for a task that had ended ({was})")
        task = result_task = first.get("task") if version == "1.0" else first
        self.check(isinstance(result_task, dict) and result_task.get("id") == target.id, f"{source}: first event {first}")
        assert isinstance(task, dict)
        self.seen(task, version, whole_history=True, source=source)
        self.stream_events(target, events[1:], version, source)

    async def refresh(self, target: Known) -> None:
        reply = await self.rpc("GetTask", {"id": target.id}, "1.0")
        self.check("result" in reply, f"get {target.id}: {reply}")
        self.seen(reply["result"], "1.0", whole_history=True, source=f"get {target.id}")
        if target.state in TERMINAL and self.racing is None:
            if target.whole is not None:
                self.check(reply["result"] == target.whole, f"get {target.id}: an ended task changed: {target.whole} -> {reply['result']}")
            target.whole = reply["result"]

    async def list_agrees(self) -> None:
        """ListTasks with every field shows each ended task as GetTask does; a status time it
        shows finds that task and every one that ended later."""
        for known in list(self.tasks.values()):
            await self.refresh(known)
        ended = [k for k in self.tasks.values() if k.whole is not None]
        if not ended:
            return
        after = self.rng.choice(ended).timestamp
        self.note(f"list agrees, statusTimestampAfter={after}")
        listed: dict[str, dict[str, Any]] = {}
        token = None
        while True:
            params: dict[str, Any] = {"pageSize": 7, "includeArtifacts": True, "statusTimestampAfter": after}
            result = (await self.rpc("ListTasks", params | ({"pageToken": token} if token else {}), "1.0"))["result"]
            listed |= {task["id"]: task for task in result["tasks"]}
            token = result["nextPageToken"]
            if not token:
                break
        for known in ended:
            if when(known.timestamp) >= when(after):
                self.check(known.id in listed, f"list after {after}: task {known.id} ({known.timestamp}) missing")
                self.check(listed[known.id] == known.whole, f"list: task {known.id} as listed {listed[known.id]}, as got {known.whole}")
            else:
                self.check(known.id not in listed, f"list after {after}: task {known.id} ({known.timestamp}) listed")

    async def cancel(self) -> None:
        version = self.version()
        method = "CancelTask" if version == "1.0" else "tasks/cancel"
        if self.rng.random() < 0.1:
            unknown = f"no-such-task-{self.counter}"
            self.counter += 1
            reply = await self.rpc(method, {"id": unknown}, version)
            self.error_of(reply, f"cancel {unknown}", (-32001,), names=unknown)
            self.note(f"cancel v{version} {unknown} -> -32001")
            return
        target = self.pick(unfinished=self.rng.random() < 0.7)
        if target is None:
            return
        self.note(f"cancel v{version} {target.id} (told {target.state})")
        await self.cancel_task(target, version)

    async def cancel_task(self, target: Known, version: str) -> None:
        method = "CancelTask" if version == "1.0" else "tasks/cancel"
        was = self.racing[target.id][0] if self.racing is not None and target.id in self.racing else target.state
        reply = await self.rpc(method, {"id": target.id}, version)
        source = f"cancel {target.id}"
        if "result" in reply:
            task = reply["result"] if version == "0.3" else reply["result"]
            self.check(state_of(task, version) == "TASK_STATE_CANCELED", f"{source}: answered {task['status']}")
            self.check(was not in TERMINAL or was == "TASK_STATE_CANCELED", f"{source}: a task that had ended ({was}) canceled")
            self.seen(task, version, whole_history=True, source=source)
            target.canceled = True
            self.note("  -> CANCELED")
            return
        error = self.error_of(reply, source, (-32002,), names=target.id)
        await self.refresh(target)
        self.check(target.state in TERMINAL, f"{source}: not cancelable ({error['message']}) while {target.state}")
        self.note(f"  -> -32002, {target.state}")

    # ---- the server's life ----------------------------------------------------------------------

    async def start(self) -> None:
        orphans = self.rng.choice(["resume", "fail"])
        self.note(f"start (orphans: {orphans})")
        command = serve_command(
            self.state_dir, self.fake_model.base_url, "--orphans", orphans, "--model-timeout-s", str(self.model_timeout_s),
            "--drain-timeout-s", str(self.drain_timeout_s),
        )  # fmt: skip
        process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env())
        keel = self.keel = KeelProcess(process)
        url_found = trio.Event()
        self.nursery.start_soon(keel.read_output, url_found)
        with trio.fail_after(STARTUP_DEADLINE_S):
            await url_found.wait()
        self.check(bool(keel.url), f"serve did not start: exited {process.poll()}")
        await self.after_restart()

    async def stop(self, how: str) -> None:
        assert self.keel is not None
        self.note(f"stop: {how}")
        if how == "kill":
            code = await self.keel.kill()
            self.check(code == -9, f"killed, exited {code}")
        elif how == "term-kill":
            self.keel.process.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                while b"shutting down" not in self.keel.output and self.keel.process.poll() is None:
                    await trio.sleep(0.01)  # polling the output against the deadline
            await trio.sleep(self.rng.uniform(0, 0.3))  # a moment into the drain: when does not matter
            self.keel.process.kill()
            code = await self.keel.wait()
            self.check(code in (-9, 0), f"SIGTERM then SIGKILL, exited {code}")
        else:
            code = await self.keel.terminate(signal.SIGTERM)
            self.check(code == 0, f"SIGTERM, exited {code}")
        self.keel = None

    async def restart(self) -> None:
        how = self.rng.choice(["kill", "kill", "term", "term-kill"])
        target = self.pick(unfinished=True)
        if target is not None and self.rng.random() < 0.3:
            # In the middle of a steer or a cancel: its answer may never come.
            version = self.version()
            delay = self.rng.uniform(0, 0.3)
            steer = self.message(f"steer {self.counter + 1} mode=fast", version, task_id=target.id)
            cancel = self.rng.random() < 0.4
            self.note(f"{'cancel' if cancel else 'steer ' + steer['messageId']} v{version} {target.id}, and {how} after {delay:.2f}s")

            async def in_flight_steer() -> None:
                try:
                    if cancel:
                        await self.cancel_task(target, version)
                    else:
                        await self.steer_with(target, steer, version)
                except (httpx.TransportError, json.JSONDecodeError):
                    self.note("  unanswered")
                    if not cancel:
                        self.unanswered_steers.append((target, steer, version))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(in_flight_steer)
                await trio.sleep(delay)  # a random moment into the request; not a wait for anything
                await self.stop(how)
        elif self.rng.random() < 0.5:
            # In the middle of a send: its answer may never come.
            version = self.version()
            message = self.message(f"question {self.counter + 1} mode={self.mode(hang=False)}", version)
            delay = self.rng.uniform(0, 0.6)
            self.note(f"send blocking v{version} {message['messageId']}, and {how} after {delay:.2f}s")

            async def in_flight() -> None:
                try:
                    await self.deliver(message, version, "blocking")
                except (httpx.TransportError, json.JSONDecodeError):
                    self.note(f"  {message['messageId']} unanswered")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(in_flight)
                await trio.sleep(delay)  # a random moment into the send; not a wait for anything
                await self.stop(how)
        else:
            await self.stop(how)
        await self.start()

    async def after_restart(self) -> None:
        """Every task acknowledged is there; unanswered sends sent again get one task each; once
        the server has settled the tasks it took up, none is left unfinished."""
        for known in list(self.tasks.values()):
            await self.refresh(known)
        for message, version in list(self.unanswered):
            self.unanswered.remove((message, version))
            self.note(f"resend unanswered {message['messageId']}")
            await self.deliver(message, version, "immediate")
        for target, steer, version in list(self.unanswered_steers):
            self.unanswered_steers.remove((target, steer, version))
            self.note(f"resend unanswered steer {steer['messageId']}")
            await self.steer_with(target, steer, version)
        await self.settle()

    async def settle(self) -> None:
        with trio.move_on_after(SETTLE_DEADLINE_S) as waited:
            while True:
                tasks = await self.list_all()
                if not [t for t in tasks if t["status"]["state"] in UNFINISHED]:
                    break
                await trio.sleep(0.05)  # polling against the deadline
        self.check(not waited.cancelled_caught, f"tasks still unfinished {SETTLE_DEADLINE_S}s after a restart: "
                   + str([(t["id"], t["status"]["state"]) for t in tasks if t["status"]["state"] in UNFINISHED]))
        for task in tasks:
            self.check(task["id"] in self.tasks, f"a task no client started: {task['id']}")
            self.seen(task, "1.0", whole_history=True, source="settled")
        self.check(len(tasks) == len(self.tasks), f"listed {len(tasks)} tasks, acknowledged {len(self.tasks)}")
        self.note(f"settled: {Counter(k.state for k in self.tasks.values())}")

    def check_model(self) -> None:
        """The model saw each question and each steer at most once a request, and every steer of a
        task that completed; a task's requests held the questions its conversation had answered
        before it was sent."""
        # A request cut short (its server killed as it sent it) is none the model read: no body.
        asked = [json.dumps(body["messages"]) for body in self.fake_model.bodies if body is not None]
        for known in self.tasks.values():
            question = json.dumps(known.first["parts"][0]["text"])[1:-1]
            counts = [body.count(question) for body in asked]
            self.check(all(n <= 1 for n in counts), f"task {known.id}: its question shown to the model twice in a request")
            for body, n in zip(asked, counts):
                if n and body.rfind(question) > max((body.rfind(json.dumps(e)[1:-1]) for e in known.earlier), default=-1):
                    for earlier in known.earlier:
                        self.check(json.dumps(earlier)[1:-1] in body, f"task {known.id}: asked without {earlier!r} of its conversation")
            for steer, _ in known.steers:
                text = steer["parts"][0]["text"]
                counts = [body.count(json.dumps(STEER_LABEL + text)[1:-1]) for body in asked]
                self.check(all(n <= 1 for n in counts), f"task {known.id}: steer {text!r} shown to the model twice in a request")
                if known.state == "TASK_STATE_COMPLETED":
                    self.check(any(counts), f"task {known.id} COMPLETED, and the model never saw its steer {text!r}")

    async def run(self, actions: int) -> None:
        kinds = (["send"] * 5 + ["steer"] * 3 + ["resend"] * 2 + ["get"] * 2 + ["both"] + ["list"] * 2
                 + ["subscribe"] * 2 + ["cancel"] * 2 + ["race"] * 2 + ["misuse", "agree"] + ["restart"])  # fmt: skip
        do = {
            "send": self.send, "steer": self.steer, "resend": self.resend, "get": self.get, "both": self.both_versions,
            "list": self.list_tasks, "subscribe": self.subscribe, "cancel": self.cancel, "restart": self.restart, "race": self.race, "misuse": self.misuse, "agree": self.list_agrees,
        }  # fmt: skip
        async with self.serving():
            try:
                for _ in range(actions):
                    await do[self.rng.choice(kinds)]()
                await self.restart()
                self.check_model()
                await self.stop("term")
            except Violation:
                raise
            except Exception as error:  # noqa: BLE001  (any failure reports the actions that led to it)
                self.fail(f"{type(error).__name__}: {error}\n{''.join(traceback.format_exception(error)[-6:])}")

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """A server started on the state directory, and the clients' connections to it; the
        server still running at the end is killed."""
        async with httpx.AsyncClient(timeout=30) as self.client, trio.open_nursery() as self.nursery:
            try:
                await self.start()
                yield
            finally:
                if self.keel is not None and self.keel.process.poll() is None:
                    self.keel.process.kill()
                    with trio.move_on_after(10, shield=True):
                        await self.keel.process.wait()
