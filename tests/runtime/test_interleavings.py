"""Random interleavings of what clients do, against a model of what each client was told.

Each seed draws a schedule of requests (sends, steers, cancels, reads, subscriptions, messages
sent again, one restart on the same state directory) to Keel served on loopback, whose model
answers slowly and whose one tool holds until the schedule lets it go. After every request,
and once every task has ended, what the server says is checked against what it said before.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from fake_model import Call, FakeModel, Reply

from runtime.agent import AgentSpec
from tests.runtime.agent_support import make_tool
from tests.runtime.served import Served, serve_keel

SEEDS = range(8)  # widen this range to hunt; a seed takes a second or two
STEPS = 28
HOLD = "[hold]"  # a question or steer holding this makes the model call the held tool
TOKEN = re.compile(r"<[qs]\d+>")
TERMINAL = {"TASK_STATE_COMPLETED", "TASK_STATE_CANCELED", "TASK_STATE_FAILED", "TASK_STATE_REJECTED"}
FINAL_S = 15.0  # how long the tasks may take to end once nothing holds them
ALONE = ("list", "resend twice")  # what is done alone: a list counts every task, and is checked so
TOGETHER = ("new", "context", "steer", "cancel", "get", "subscribe", "resend", "steer again", "let go")

JsonObject = dict[str, Any]


@attrs.define(eq=False)
class Holds:
    """The tool the model calls for a message holding HOLD: it returns once the schedule lets go."""

    release: trio.Event = attrs.field(factory=trio.Event)
    forever: bool = False

    async def invoke(self, arguments: dict[str, Any]) -> str:
        if not self.forever:
            await self.release.wait()
        return "held, then let go"

    def let_go(self) -> None:
        self.release.set()
        self.release = trio.Event()


def answering(bodies: list[JsonObject], gap_s: float) -> Callable[[JsonObject], Reply]:
    """The model: a call of the held tool for a last user message holding HOLD, else a slow answer."""

    def respond(body: JsonObject) -> Reply:
        bodies.append(body)
        last = body["messages"][-1]
        if last["role"] == "user" and HOLD in str(last.get("content")):
            return Reply(tool_calls=[Call(name="hold")])
        return Reply(text=f"answer {len(bodies)}", chunk_chars=1, gap_s=gap_s)

    return respond


@attrs.define
class Told:
    """What the clients were told of one task."""

    id: str
    context_id: str
    accepted: list[str]  # the messageIds the task took, in the order it took them
    ended: str | None = None  # COMPLETED or CANCELED, once a client was told so


@attrs.define(eq=False)
class Schedule:
    keel: Served
    rng: random.Random
    holds: Holds
    bodies: list[JsonObject]
    tasks: dict[str, Told] = attrs.field(factory=dict)
    sent: list[tuple[JsonObject, str]] = attrs.field(factory=list)  # each accepted message's params, its task
    refused_steers: set[str] = attrs.field(factory=set)  # the tokens of steers refused
    asked: dict[str, str] = attrs.field(factory=dict)  # the task of each question, by its token
    steered: dict[str, str] = attrs.field(factory=dict)  # the task of each steer accepted, by its token
    in_flight: set[str] = attrs.field(factory=set)  # the messageIds of steers sent and not yet answered
    counter: int = 0
    together: bool = False  # while requests are made together
    # What clients were told before the requests made together: the ends, and the messages taken.
    ended_before: dict[str, str] = attrs.field(factory=dict)
    accepted_before: dict[str, list[str]] = attrs.field(factory=dict)
    restarted: bool = False
    log: list[str] = attrs.field(factory=list)

    def text(self, kind: str) -> str:
        self.counter += 1
        return f"<{kind}{self.counter}>" + (f" {HOLD}" if self.rng.random() < 0.4 else "")

    def params(self, text: str, **fields: str) -> JsonObject:
        return {"message": self.keel.message(text, **fields), "configuration": {"returnImmediately": True}}

    async def send(self, params: JsonObject) -> JsonObject:
        body = (await self.keel.call("SendMessage", params)).json()
        self.log.append(f"SendMessage {params['message']} -> {str(body)[:300]}")
        return body  # type: ignore[no-any-return]

    # -- what a client does --------------------------------------------------------------------------

    async def new_task(self, context_id: str | None) -> None:
        params = self.params(self.text("q"), **({"contextId": context_id} if context_id else {}))
        body = await self.send(params)
        assert "error" not in body, body
        task = body["result"]["task"]
        assert task["id"] not in self.tasks, f"a new message was given task {task['id']} of another"
        assert context_id in (None, task["contextId"]), task
        self.tasks[task["id"]] = Told(task["id"], task["contextId"], [params["message"]["messageId"]])
        self.asked[TOKEN.findall(params["message"]["parts"][0]["text"])[0]] = task["id"]
        self.sent.append((params, task["id"]))

    async def steer(self, told: Told) -> None:
        text = self.text("s")
        params = self.params(text, taskId=told.id)
        self.in_flight.add(params["message"]["messageId"])
        try:
            body = await self.send(params)
        finally:
            self.in_flight.discard(params["message"]["messageId"])
        if "error" in body:
            assert body["error"]["code"] == -32004, body
            self.refused_steers.add(TOKEN.findall(text)[0])
            return
        task = body["result"]["task"]
        assert task["id"] == told.id, task
        told.accepted.append(params["message"]["messageId"])
        self.steered[TOKEN.findall(text)[0]] = told.id
        self.sent.append((params, told.id))
        self.see(task)

    async def cancel(self, told: Told) -> None:
        body = (await self.keel.call("CancelTask", {"id": told.id})).json()
        self.log.append(f"CancelTask {told.id} -> {str(body)[:300]}")
        if "error" in body:
            assert body["error"]["code"] == -32002, body
            task = await self.keel.result("GetTask", {"id": told.id})
            assert task["status"]["state"] in TERMINAL, (body, task)
            return
        assert body["result"]["status"]["state"] == "TASK_STATE_CANCELED", body
        self.see(body["result"])

    async def resend(self, params: JsonObject | None = None, task_id: str = "") -> None:
        if params is None:
            if not self.sent:
                return
            params, task_id = self.rng.choice(self.sent)
        body = await self.send(params)
        assert "error" not in body, (params, body)
        assert body["result"]["task"]["id"] == task_id, (params, body)
        self.see(body["result"]["task"])

    async def subscribe(self, told: Told) -> None:
        async with self.keel.stream("SubscribeToTask", {"id": told.id}) as events:
            if not events.response.headers["content-type"].startswith("text/event-stream"):
                assert await events.rest() == []  # a JSON body: the error, before any stream
                body = json.loads(events.raw)
                self.log.append(f"SubscribeToTask {told.id} -> {str(body)[:300]}")
                assert body["error"]["code"] == -32004, body
                return
            first = await events.next()
            assert first is not None and "result" in first, first
            self.log.append(f"SubscribeToTask {told.id} -> {str(first)[:300]}")
            self.see(first["result"]["task"])
            state = first["result"]["task"]["status"]["state"]
            with trio.move_on_after(self.rng.choice([0, 0.05, 0.2])):  # follow it for a while, then leave
                while (event := await events.next()) is not None:
                    assert state not in TERMINAL, (told.id, state, event)
                    assert "result" in event, event
                    if "statusUpdate" in event["result"]:
                        state = event["result"]["statusUpdate"]["status"]["state"]
                        assert self.ended(told) in (None, state), (told.id, self.ended(told), event)

    async def list_tasks(self) -> None:
        result = await self.keel.result("ListTasks", {"pageSize": 100, "includeArtifacts": True})
        assert result["totalSize"] == len(self.tasks), (result["totalSize"], len(self.tasks))
        assert {task["id"] for task in result["tasks"]} == set(self.tasks), result
        for task in result["tasks"]:
            self.see(task)
        if not self.tasks:
            return
        context_id = self.rng.choice(list(self.tasks.values())).context_id
        result = await self.keel.result("ListTasks", {"contextId": context_id, "historyLength": 0})
        assert result["totalSize"] == sum(told.context_id == context_id for told in self.tasks.values()), result

    # -- what must hold --------------------------------------------------------------------------------

    def ended(self, told: Told) -> str | None:
        """The end a request must find: requests made together may each be answered as the task
        stood before the others."""
        return self.ended_before.get(told.id) if self.together else told.ended

    def see(self, task: JsonObject) -> None:
        """Check one task as a client was just told it, and note an end it was told."""
        told = self.tasks[task["id"]]
        state = task["status"]["state"]
        ended = self.ended(told)
        if ended is not None:
            assert state == ended, f"task {told.id} was told {ended}, now {state}: {task['status']}"
        users = [message["messageId"] for message in task.get("history", []) if message["role"] == "ROLE_USER"]
        if self.together:  # in the order taken before, then what was taken meanwhile, each once
            before = self.accepted_before.get(told.id, [])
            meanwhile = set(told.accepted) | self.in_flight
            assert users[: len(before)] == before and len(set(users)) == len(users) and set(users) <= meanwhile, (users, told)
        else:
            assert users == told.accepted, f"task {told.id}: history {users}, accepted {told.accepted}"
        if state == "TASK_STATE_COMPLETED":
            [answer] = [artifact for artifact in task.get("artifacts", []) if artifact.get("name") == "answer"]
            assert answer["parts"][0]["text"].startswith("answer "), answer
        if state in ("TASK_STATE_COMPLETED", "TASK_STATE_CANCELED"):
            told.ended = state

    async def check_all(self) -> None:
        for told in list(self.tasks.values()):
            self.see(await self.keel.result("GetTask", {"id": told.id}))
        await self.list_tasks()
        self.check_model()

    def check_model(self) -> None:
        first_seen: dict[str, str] = {}
        for number, body in enumerate(self.bodies):
            said = [message for message in body["messages"] if message["role"] != "system"]
            roles = [message["role"] for message in said]
            assert roles and roles[0] == "user", (number, roles)
            for first, second in zip(said, said[1:]):
                assert not (first["role"] == second["role"] == "user"), (number, roles)
                assert not (first["role"] == second["role"] == "assistant"), (number, roles)
            for at, message in enumerate(said):  # each call answered by a tool message, in the messages that follow
                calls = [call["id"] for call in message.get("tool_calls") or []]
                answers = [each.get("tool_call_id") for each in said[at + 1 : at + 1 + len(calls)]]
                assert answers == calls, (number, said)
            tokens = [token for message in said for token in TOKEN.findall(str(message.get("content")))]
            assert len(tokens) == len(set(tokens)), (number, tokens)
            assert not set(tokens) & self.refused_steers, (number, tokens, self.refused_steers)
            # A steer reaches the model first in a request of the task it was sent to, whose
            # question is the last in the conversation, or as part of that task's turn (taken, then
            # canceled before its request): a later task's run never takes it.
            asking = [token for token in tokens if token.startswith("<q")][-1]
            for at, token in enumerate(tokens):
                if token.startswith("<s") and token not in first_seen:
                    first_seen[token] = asking
                    taken_by_later = at > tokens.index(asking) and self.steered[token] != self.asked[asking]
                    assert not taken_by_later, (number, token, asking)

    # -- the schedule ----------------------------------------------------------------------------------

    def open_tasks(self) -> list[Told]:
        return [told for told in self.tasks.values() if told.ended is None]

    async def step(self, restart: Callable[[], Awaitable[Served]]) -> None:
        kinds = [*ALONE, *TOGETHER, "steer", "let go", "together", "together"]
        if not self.restarted:
            kinds.append("restart")
        kind = self.rng.choice(kinds)
        if kind == "restart":
            self.restarted = True
            self.log.append("restart")
            self.keel = await restart()
        elif kind == "together":  # a few requests at once, at most one of them a steer
            first, *others = self.rng.choices(TOGETHER, k=self.rng.randint(2, 3))
            chosen = [first, *(other if other != "steer" else "cancel" for other in others)]
            self.log.append(f"together: {chosen}")
            self.ended_before = {told.id: told.ended for told in self.tasks.values() if told.ended}
            self.accepted_before = {told.id: list(told.accepted) for told in self.tasks.values()}
            self.together = True
            async with trio.open_nursery() as nursery:
                for each in chosen:
                    nursery.start_soon(self.do, each)
            self.together = False
        else:
            await self.do(kind)
        await self.check_all()

    async def do(self, kind: str) -> None:
        known = list(self.tasks.values())
        if kind == "new" or not known:
            await self.new_task(None)
        elif kind == "context":
            await self.new_task(self.rng.choice(known).context_id)
        elif kind == "steer":
            await self.steer(self.rng.choice(self.open_tasks() or known))
        elif kind == "cancel":
            await self.cancel(self.rng.choice(self.open_tasks() or known))
        elif kind == "get":
            told = self.rng.choice(known)
            self.see(await self.keel.result("GetTask", {"id": told.id}))
        elif kind == "list":
            await self.list_tasks()
        elif kind == "subscribe":
            await self.subscribe(self.rng.choice(known))
        elif kind == "resend":
            await self.resend()
        elif kind == "steer again":  # a steer sent again without its taskId, in its context
            steers = [(params, task_id) for params, task_id in self.sent if "taskId" in params["message"]]
            if steers:
                params, task_id = self.rng.choice(steers)
                message = {key: value for key, value in params["message"].items() if key != "taskId"}
                await self.resend({**params, "message": {**message, "contextId": self.tasks[task_id].context_id}}, task_id)
        elif kind == "resend twice" and self.sent:  # the same message sent twice at once
            again, task_id = self.rng.choice(self.sent)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.resend, again, task_id)
                nursery.start_soon(self.resend, again, task_id)
        elif kind == "resend twice":
            await self.list_tasks()
        else:
            self.holds.let_go()

    async def wait_all_ended(self) -> None:
        self.holds.forever = True
        self.holds.let_go()
        with trio.fail_after(FINAL_S):
            for told in self.tasks.values():
                while (task := await self.keel.result("GetTask", {"id": told.id}))["status"]["state"] not in TERMINAL:
                    await trio.sleep(0.01)
                self.see(task)
        await self.check_all()


async def run_schedule(seed: int, fake_model: FakeModel, state_dir: Path) -> Schedule:
    holds = Holds()
    bodies: list[JsonObject] = []
    rng = random.Random(seed)
    fake_model.respond = answering(bodies, rng.choice([0.001, 0.005, 0.02]))
    agent = AgentSpec(system_prompt="Answer briefly.", tools=(make_tool("hold", holds.invoke),))
    server = AsyncExitStack()
    server_keel: list[Served] = []

    async def restart() -> Served:
        nonlocal server
        if server_keel and rng.random() < 0.5:  # stopped as a signal stops it, its runs drained and cut
            server_keel[-1].runner.stop()
            await server_keel[-1].runner.wait_stopped()
        await server.aclose()  # else as a crash: the runs are cut, their tasks left as stored
        server = AsyncExitStack()
        server_keel.append(await server.enter_async_context(serve_keel(state_dir, fake_model, agent=agent)))
        return server_keel[-1]

    schedule = Schedule(await restart(), rng, holds, bodies)
    try:
        for _ in range(STEPS):
            await schedule.step(restart)
        await schedule.wait_all_ended()
    except BaseException:
        print("\n".join(schedule.log[-40:]))
        raise
    finally:
        await server.aclose()
    return schedule


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_interleavings_keep_what_clients_were_told(fake_model: FakeModel, tmp_path: Path, seed: int) -> None:
    with trio.fail_after(25):
        await run_schedule(seed, fake_model, tmp_path / "state")
