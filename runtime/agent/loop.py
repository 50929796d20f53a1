"""The ReAct loop: ask the model, run the tools it calls, repeat until it answers.

A run works on a transcript (a list of ``Message``). With a Session it saves that transcript
before every model request and once more when it returns, and it collects the steers left for
the session by anyone, anywhere, before every request. There is no resume call: running the
loop on a session's stored messages, on any process, continues the conversation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import attrs
import trio

from persistence.errors import StoreError
from persistence.session import Session
from persistence.transcript import Message
from runtime.agent.errors import BudgetExhausted, MaxStepsReached, SaveFailed
from runtime.agent.events import AgentEvent, StepStarted, SteerApplied, TextDelta, ToolCalled, ToolResult, UsageReported
from runtime.agent.steers import STEER_LABEL, SteerBox
from runtime.agent.tools import Tool, call_tool
from runtime.models import ChatRequest, Completion, Delta, Usage
from runtime.models import TextDelta as ModelText

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_CALLS = 12
CLEANUP_TIMEOUT_S = 5.0  # bound on the shielded save of a partial answer when cancelled


class AnswerStream(Protocol):
    def __aiter__(self) -> Any: ...

    def completion(self) -> Completion: ...

    def partial_message(self) -> Message: ...


class Model(Protocol):
    """What the loop needs of a model client (runtime.models.ModelClient is one)."""

    def stream(self, request: ChatRequest) -> AbstractAsyncContextManager[AnswerStream]: ...


@attrs.frozen
class AgentSpec:
    """What an agent is: its prompt, its tools, and the limits of one turn."""

    system_prompt: str = ""
    tools: tuple[Tool, ...] = attrs.field(default=(), converter=tuple)
    max_steps: int = attrs.field(default=DEFAULT_MAX_MODEL_CALLS, validator=attrs.validators.ge(1))
    max_model_calls: int = attrs.field(default=DEFAULT_MAX_MODEL_CALLS, validator=attrs.validators.ge(1))
    steer_continuations: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    temperature: float | None = None

    @tools.validator
    def _unique_names(self, _attribute: object, tools: tuple[Tool, ...]) -> None:
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")


@attrs.frozen
class Result:
    output: str
    messages: tuple[Message, ...]
    model_calls: int
    usage: Usage | None
    unapplied_steers: tuple[str, ...]


def _ignore(_event: AgentEvent) -> None:
    pass


@attrs.define(eq=False)
class AgentRun:
    """One turn of the agent. ``await run.run()`` runs it in the caller's task and cancel scope;
    ``run.steer(text)`` may be called from any task of the process meanwhile.

    Cancelling the caller's scope ends the run promptly, mid-stream or mid-tool: what the store
    holds stays, and an answer the model was streaming is kept, marked partial.
    """

    model: Model
    spec: AgentSpec
    messages: list[Message] = attrs.field(converter=list)  # a copy: the caller's list is not touched
    session: Session | None = None
    on_event: Callable[[AgentEvent], None] = _ignore
    _box: SteerBox = attrs.field(init=False, factory=SteerBox)
    _ready: list[str] = attrs.field(init=False, factory=list)  # taken, not yet placed
    _calls: int = attrs.field(init=False, default=0)
    _usage: Usage | None = attrs.field(init=False, default=None)

    def steer(self, text: str) -> None:
        """Hand the run a steer for its next model request; RunFinished once it has ended."""
        self._box.add(text)

    async def run(self) -> Result:
        """Run the turn to the model's answer.

        Raises BudgetExhausted or MaxStepsReached when the model will not conclude, SaveFailed
        when the session cannot be written (before the model is called), a ModelError when the
        model fails.
        """
        try:
            continuations = 0
            while True:
                await self._react()
                # A steer that came while the answer was being written has had no request to
                # ride; with continuations left, one more round carries it.
                if continuations < self.spec.steer_continuations and await self._collect_steers():
                    continuations += 1
                    continue
                break
        finally:
            unapplied = self._ready + self._box.close()
        await self._save("saving the answer")
        return Result(
            output=self.messages[-1].text,
            messages=tuple(self.messages),
            model_calls=self._calls,
            usage=self._usage,
            unapplied_steers=tuple(unapplied),
        )

    async def _react(self) -> None:
        tools = {tool.name: tool for tool in self.spec.tools}
        for _ in range(self.spec.max_steps):
            await self._collect_steers()
            self._place_steers()
            await self._save("saving the transcript")
            if self._calls >= self.spec.max_model_calls:
                raise BudgetExhausted(self.spec.max_model_calls)
            answer = await self._ask()
            self.messages.append(answer)
            if not answer.tool_calls:
                return
            for call in answer.tool_calls:
                self.on_event(ToolCalled(call))
                outcome = await call_tool(tools, call)
                self.messages.append(Message(role="tool", text=outcome.text, tool_call_id=call.id, name=call.name))
                self.on_event(ToolResult(call.id, call.name, outcome.text, outcome.is_error))
        raise MaxStepsReached(self.spec.max_steps)

    async def _collect_steers(self) -> bool:
        """Take the steers waiting in memory and in the store; True if any are ready to place."""
        self._ready.extend(self._box.take())
        if self.session is not None:
            try:
                self._ready.extend(await self.session.take_steers())
            except StoreError as exc:
                raise SaveFailed(self.session.id, "collecting the steers") from exc
        return bool(self._ready)

    def _place_steers(self) -> None:
        """Each steer becomes a user message where the run has got to, and stays there: later
        requests carry it at that position, never re-pinned at the end."""
        for text in self._ready:
            self.messages.append(Message(role="user", text=STEER_LABEL + text))
            self.on_event(SteerApplied(text, len(self.messages) - 1))
        self._ready.clear()

    async def _save(self, what: str) -> None:
        if self.session is None:
            return
        try:
            await self.session.save(self.messages)
        except StoreError as exc:
            raise SaveFailed(self.session.id, what) from exc

    async def _ask(self) -> Message:
        """One streamed model request. The crash seam: a process that dies here has saved the
        transcript up to this request, so a resumed run redoes this step (tool calls included)."""
        request = ChatRequest(
            messages=[m for m in self._with_system(self.messages) if not m.partial],
            tools=[tool.spec() for tool in self.spec.tools],
            temperature=self.spec.temperature,
        )
        self._calls += 1
        self.on_event(StepStarted(self._calls))
        async with self.model.stream(request) as stream:
            try:
                async for delta in stream:
                    self._emit_delta(delta)
            except trio.Cancelled:
                await self._keep_partial(stream.partial_message())
                raise
            completion = stream.completion()
        return completion.message

    def _emit_delta(self, delta: Delta) -> None:
        if isinstance(delta, ModelText):
            self.on_event(TextDelta(delta.text))
        elif isinstance(delta, Usage):
            self._usage = delta if self._usage is None else _add(self._usage, delta)
            self.on_event(UsageReported(delta))

    async def _keep_partial(self, partial: Message) -> None:
        if not (partial.text or partial.tool_calls):
            return
        self.messages.append(partial)
        with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            try:
                await self._save("saving the partial answer")
            except SaveFailed as exc:
                logger.warning("%s", exc)

    def _with_system(self, messages: Sequence[Message]) -> list[Message]:
        if not self.spec.system_prompt:
            return list(messages)
        return [Message(role="system", text=self.spec.system_prompt), *messages]


def _add(a: Usage, b: Usage) -> Usage:
    return Usage(
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        completion_tokens=a.completion_tokens + b.completion_tokens,
        total_tokens=a.total_tokens + b.total_tokens,
    )
