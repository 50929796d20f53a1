"""A zero-latency model that runs in process: a TEST DOUBLE for benchmarks, it answers from a
script. It implements the agent loop's Model protocol (and the readiness probe's catalog), so
that what a benchmark times is Keel, with no model server and no HTTP between them.

- ``InstantModel(steps)``: ``steps - 1`` answers that call the ``lookup`` tool, then a final
  answer; each answer is already whole when asked for.
- ``slow_marker``: a request whose last message holds it gets its first words at once, then
  nothing more for ``slow_s`` seconds (the long task a benchmark cancels); ``hang`` does the
  same for every request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from persistence.transcript import Message, ToolCall
from runtime.models import ChatRequest, Completion, Delta, Finish, Usage
from runtime.models import TextDelta as ModelText

ARGUMENTS = '{"service": "vault"}'


@attrs.define(eq=False)
class InstantStream:
    """One answer, already whole: a little text, then a tool call (or the final answer)."""

    number: int
    final: bool
    text: str
    hang_s: float | None = None
    _deltas: list[Delta] = attrs.field(init=False, factory=list)
    _said: str = attrs.field(init=False, default="")
    _done: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._deltas = [ModelText(self.text)]
        if not self.final:
            self._deltas.append(ToolCall(f"call_{self.number}", "lookup", ARGUMENTS))
        self._deltas += [Finish("stop" if self.final else "tool_calls"), Usage(400, 20, 420)]
        self._deltas.reverse()

    def __aiter__(self) -> InstantStream:
        return self

    async def __anext__(self) -> Delta:
        if not self._deltas:
            self._done = True
            raise StopAsyncIteration
        if self.hang_s is not None and self._said:  # the first words are out; now it is slow
            await trio.sleep(self.hang_s)
            self.hang_s = None
        delta = self._deltas.pop()
        if isinstance(delta, ModelText):
            self._said += delta.text
        return delta

    def completion(self) -> Completion:
        calls: tuple[ToolCall, ...] = () if self.final else (ToolCall(f"call_{self.number}", "lookup", ARGUMENTS),)
        message = Message(role="assistant", text=self._said, tool_calls=calls)
        return Completion(message, "stop" if self.final else "tool_calls")

    def partial_message(self) -> Message:
        return Message(role="assistant", text=self._said, partial=not self._done)


@attrs.define(eq=False)
class InstantModel:
    """The loop's Model protocol with no latency: ``steps - 1`` tool calls, then an answer."""

    steps: int = 1
    text: str = "Looking at the vault lease. "
    hang: bool = False
    slow_marker: str | None = None
    slow_s: float = 60.0
    _requests: int = attrs.field(init=False, default=0)

    @asynccontextmanager
    async def stream(self, request: ChatRequest) -> AsyncIterator[InstantStream]:
        self._requests += 1
        slow = self.hang or (self.slow_marker is not None and self.slow_marker in request.messages[-1].text)
        await trio.lowlevel.checkpoint()
        yield InstantStream(self._requests, final=self._requests >= self.steps, text=self.text, hang_s=self.slow_s if slow else None)

    @property
    def endpoint(self) -> str:
        """Where readiness says the catalog is: there is no server."""
        return "(in process)"

    async def has_model(self, name: str | None = None) -> bool:
        await trio.lowlevel.checkpoint()
        return True
