"""What the agent-loop tests share: a counting Session, an in-process scripted model, tools.

The scripted model is for the few tests that must hold an answer open until the test says so;
everything else goes through the real httpx client to the fake model server on loopback.
"""

from __future__ import annotations

import collections
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager, closing
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast

import attrs
import trio
from fake_model import FakeModel

from persistence.api import SessionStore
from persistence.session import Session
from persistence.sessions import SqliteSessionStore, open_session_store
from persistence.tasks import SqliteTaskStore, open_task_store
from persistence.transcript import Message, ToolCall
from runtime.agent import AgentEvent, AgentRun, AgentSpec, Tool
from runtime.models import ChatRequest, Completion, Delta, Finish, ModelConfig, TextDelta, Usage, open_model_client
from runtime.runner import Runner

DEADLINE_S = 10.0  # generous: every wait in these tests is on loopback or in memory
PROMPTLY_S = 1.0  # how soon a cancelled run must have exited (the benchmark measures the real figure)
QUESTION = "Why did the vault lease expire?"
LOOKUP_SCHEMA = {
    "type": "object",
    "properties": {"service": {"type": "string"}},
    "required": ["service"],
    "additionalProperties": False,
}


S = TypeVar("S")


@asynccontextmanager
async def runner_over_files(
    state: Path, model: Any, wrap: Callable[[SqliteSessionStore], S], agent: AgentSpec = AgentSpec()
) -> AsyncIterator[tuple[Runner, S, SqliteTaskStore]]:
    """A runner over ``runtime.db`` and ``tasks.db`` in ``state`` and ``model``, its session
    store seen through ``wrap`` (a test's store that holds a step open, say); stopped when the
    block is left."""
    async with (
        open_session_store(state / "runtime.db") as store,
        open_task_store(state / "tasks.db") as tasks,
        trio.open_nursery() as nursery,
    ):
        sessions = wrap(store)
        runner: Runner = await nursery.start(Runner(cast(SessionStore, sessions), tasks, model, agent).run)
        yield runner, sessions, tasks
        runner.stop()


def config_for(server: FakeModel) -> ModelConfig:
    """Retries back off for a millisecond, so retry tests do not wait on the wall clock."""
    return ModelConfig(base_url=server.base_url, backoff_base_s=0.001, backoff_max_s=0.01)


def question(text: str = QUESTION) -> list[Message]:
    return [Message(role="user", text=text)]


async def stored_messages(path: Path, session_id: str) -> list[Message]:
    """The transcript as another process would read it: through a store object of its own."""
    async with open_session_store(path) as other:
        return await Session.open(session_id, other).messages()


def refuse_writes_of_events(path: Path) -> None:
    """Make the events table of a live database refuse every insert, from another connection,
    the way a full disk would: SQLite itself fails the write."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("CREATE TRIGGER refuse_events BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'disk is full'); END")


@attrs.frozen
class CountingSession(Session):
    """A real Session that notes, as each save returns, how many messages it saved and how many
    model requests the server had received by then."""

    requests_made: Callable[[], int] = attrs.field(kw_only=True)
    saves: list[tuple[int, int]] = attrs.field(factory=list, kw_only=True)

    async def save(self, messages: Sequence[Message]) -> None:
        await super().save(messages)
        self.saves.append((len(messages), self.requests_made()))

    async def save_and_take_steers(
        self, messages: Sequence[Message], *, placed: Callable[[str], Message] | None = None
    ) -> list[str]:
        taken = await super().save_and_take_steers(messages, placed=placed)
        self.saves.append((len(messages) + (len(taken) if placed else 0), self.requests_made()))
        return taken


@attrs.frozen
class GatedSession(Session):
    """A real Session that, once the store has handed steers out (with the save or alone),
    waits for ``gate`` before returning them: a window in which a test can cancel the run."""

    taken: trio.Event = attrs.field(factory=trio.Event, kw_only=True)
    gate: trio.Event = attrs.field(factory=trio.Event, kw_only=True)

    async def take_steers(self) -> list[str]:
        return await self._hold(await super().take_steers())

    async def save_and_take_steers(
        self, messages: Sequence[Message], *, placed: Callable[[str], Message] | None = None
    ) -> list[str]:
        return await self._hold(await super().save_and_take_steers(messages, placed=placed))

    async def _hold(self, steers: list[str]) -> list[str]:
        if steers:
            self.taken.set()
            await self.gate.wait()
        return steers


def make_tool(
    name: str,
    invoke: Callable[[dict[str, Any]], Awaitable[str]],
    *,
    parameters: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> Tool:
    return Tool(
        name=name,
        description=f"The {name} tool of a test.",
        parameters=parameters if parameters is not None else {"type": "object", "properties": {}},
        invoke=invoke,
        timeout_s=timeout_s,
    )


def lookup_tool(calls: list[dict[str, Any]] | None = None, result: str = "vault: lease TTL 24h, last renewed 25h ago") -> Tool:
    """A tool that answers at once and notes the arguments of every call."""

    async def lookup(arguments: dict[str, Any]) -> str:
        if calls is not None:
            calls.append(arguments)
        await trio.lowlevel.checkpoint()
        return result

    return make_tool("lookup", lookup, parameters=LOOKUP_SCHEMA)


@attrs.define(eq=False)
class EventLog:
    """An ``on_event`` that keeps every event and lets a test wait for one of a kind."""

    events: list[AgentEvent] = attrs.field(factory=list)
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def __call__(self, event: AgentEvent) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = trio.Event()

    def of(self, kind: type[Any]) -> list[Any]:
        return [event for event in self.events if isinstance(event, kind)]

    async def wait_for(self, kind: type[Any], count: int = 1) -> None:
        while len(self.of(kind)) < count:
            await self._changed.wait()


async def run_turn(fake: FakeModel, spec: AgentSpec, messages: list[Message], **options: Any) -> Any:
    """One turn against the fake model, through the real client."""
    async with open_model_client(config_for(fake)) as client:
        return await AgentRun(client, spec, messages, **options).run()


def sent_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of a request body the fake model received, without the system prompt."""
    return [message for message in body["messages"] if message["role"] != "system"]


# -- an in-process model whose answers a test can hold open ---------------------------------------


def _calls(calls: Iterable[ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(calls)


@attrs.frozen
class Answer:
    """One scripted answer. With ``hold``, the stream sends the first half of the text, then
    waits for the event before sending the rest."""

    text: str = ""
    calls: tuple[ToolCall, ...] = attrs.field(default=(), converter=_calls)
    hold: trio.Event | None = None


@attrs.define(eq=False)
class ScriptedModel:
    """A Model (the loop's protocol) answering from a script, in process; it keeps each request."""

    answers: list[Answer]
    requests: list[ChatRequest] = attrs.field(init=False, factory=list)

    def stream(self, request: ChatRequest) -> ScriptedStream:
        self.requests.append(request)
        return ScriptedStream(self.answers.pop(0))


_Step = Delta | trio.Event


@attrs.define(eq=False)
class ScriptedStream:
    answer: Answer
    _steps: collections.deque[_Step] = attrs.field(init=False, factory=collections.deque)
    _said: list[str] = attrs.field(init=False, factory=list)
    _done: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        text, middle = self.answer.text, len(self.answer.text) // 2
        for piece in (text[:middle], self.answer.hold, text[middle:]):
            if isinstance(piece, trio.Event):
                self._steps.append(piece)
            elif piece:
                self._steps.append(TextDelta(piece))
        self._steps.extend(self.answer.calls)
        self._steps.extend([Finish("tool_calls" if self.answer.calls else "stop"), Usage(10, 5, 15)])

    async def __aenter__(self) -> ScriptedStream:
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await trio.lowlevel.checkpoint()

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> Delta:
        while self._steps:
            step = self._steps.popleft()
            if isinstance(step, trio.Event):
                await step.wait()
                continue
            await trio.lowlevel.checkpoint()
            if isinstance(step, TextDelta):
                self._said.append(step.text)
            return step
        self._done = True
        raise StopAsyncIteration

    def completion(self) -> Completion:
        message = Message(role="assistant", text="".join(self._said), tool_calls=self.answer.calls)
        return Completion(message=message, finish_reason="tool_calls" if self.answer.calls else "stop")

    def partial_message(self) -> Message:
        return Message(role="assistant", text="".join(self._said), partial=not self._done)
