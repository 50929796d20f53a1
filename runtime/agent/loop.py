"""The ReAct loop: ask the model, run the tools it calls, repeat until it answers.

A run works on a transcript (a list of ``Message``). With a Session it saves that transcript
before every model request and once more when it returns, and before every request it takes the
steers waiting for it: those handed to the run (``AgentRun.steer``) and those left for the
session by anyone, anywhere (``Session.steer``). There is no resume call: running the loop on a
session's stored messages, on any process, continues the conversation (``AgentRun._ask`` says
what a crash costs); a transcript that ends with the model's answer is a turn already over, and
the run returns that answer without asking the model again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import attrs
import trio

from persistence.errors import TranscriptConflict, is_damage, told_before
from persistence.locks import holding
from persistence.session import Session
from persistence.transcript import REASONING_CONTENT, Message, ToolCall
from persistence.validate import MAX_EVENT_BYTES
from runtime.agent.errors import (
    AnswerEmpty, AnswerFailed, AnswerFiltered, AnswerTooLarge, AnswerTruncated, BudgetExhausted, MaxStepsReached, SaveFailed,
)
from runtime.agent.events import AgentEvent, StepStarted, SteerApplied, TextDelta, ToolCalled, ToolResult, UsageReported
from runtime.agent.steers import SteerBox, is_steer, labelled_after_steers, steer_message
from runtime.agent.tools import Outcome, Tool, call_tool
from runtime.models import ChatRequest, Completion, Delta, ToolCallDelta, ToolSpec, Usage
from runtime.models import TextDelta as ModelText

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_CALLS = 12
DEFAULT_MAX_CALLS_PER_ANSWER = 32  # with each tool's timeout, bounds how long one step's tools may take
STORE_TIMEOUT_S = 30.0  # bound on the shielded take-and-save before a request; a slower store has failed
CLEANUP_TIMEOUT_S = 5.0  # bound on the shielded save of a partial answer as the run ends
_SAVING = "saving the transcript"
# Finish reasons of an answer its server gave up on: what came is part of an answer, not all of it.
# OpenRouter says "error" when the provider failed mid-answer; vLLM "abort" when its engine aborted.
FAILED_FINISHES = frozenset({"error", "abort"})


class AnswerStream(Protocol):
    def __aiter__(self) -> Any: ...

    def completion(self) -> Completion: ...

    def partial_message(self) -> Message: ...


class Model(Protocol):
    """What the loop needs of a model client (runtime.models.ModelClient is one)."""

    def stream(self, request: ChatRequest) -> AbstractAsyncContextManager[AnswerStream]: ...


def _tools(tools: Iterable[Tool]) -> tuple[Tool, ...]:
    return tuple(tools)


def _messages(messages: Iterable[Message]) -> list[Message]:
    return list(messages)


@attrs.frozen
class AgentSpec:
    """What an agent is: its prompt, its tools, and the limits of one turn.

    ``max_model_calls`` is the turn's budget, continuations included; ``max_steps`` bounds the
    requests of one round (a continuation starts a new round). ``max_calls_per_answer`` bounds the
    tool calls of one answer that are run: each later one is answered with an error saying so,
    so that one answer's calls take at most that many tool timeouts. ``steer_continuations`` is how
    many extra rounds a turn may take for steers that arrived while its answer was being written
    (a run given a SteerGate takes as many as its budget allows).
    """

    system_prompt: str = ""
    tools: tuple[Tool, ...] = attrs.field(default=(), converter=_tools)
    max_steps: int = attrs.field(default=DEFAULT_MAX_MODEL_CALLS, validator=attrs.validators.ge(1))
    max_model_calls: int = attrs.field(default=DEFAULT_MAX_MODEL_CALLS, validator=attrs.validators.ge(1))
    max_calls_per_answer: int = attrs.field(default=DEFAULT_MAX_CALLS_PER_ANSWER, validator=attrs.validators.ge(1))
    steer_continuations: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    temperature: float | None = None

    @tools.validator
    def _unique_names(self, _attribute: object, tools: tuple[Tool, ...]) -> None:
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")


@attrs.frozen
class Result:
    """How a turn ended. ``unapplied_steers`` were handed to the run (``AgentRun.steer``) too late
    for any request. Steers left in the store too late stay there: one left for no task in
    particular for the session's next run, one left for this run's task for none (a later task's
    run drops it; see SessionStore.take_steers)."""

    output: str
    messages: tuple[Message, ...]
    model_calls: int  # the turn's, those made before a restart included (AgentRun.calls_made)
    usage: Usage | None
    unapplied_steers: tuple[str, ...]


def _ignore(_event: AgentEvent) -> None:
    pass


@attrs.define(eq=False)
class SteerGate:
    """Where a run's looks for steers meet the steers its caller accepts for it.

    The caller accepts a steer (stores it for the session) only holding ``lock``, and only while
    the gate is open. The run takes its steers holding the lock too, and closes the gate at its
    last look: the one no model request but the budget's last, or none at all, follows. A steer
    accepted is then one a request carries; one that comes later is refused, not left behind.
    """

    lock: trio.Lock = attrs.field(factory=trio.Lock)
    closed: bool = False


@attrs.define(eq=False)
class AgentRun:
    """One turn of the agent. ``await run.run()`` runs it in the caller's task and cancel scope;
    ``run.steer(text)`` may be called from any task of the process meanwhile.

    Cancelling the caller's scope ends the run promptly, mid-stream or mid-tool: what the store
    holds stays, and the text the model was streaming is kept, marked partial. A save already
    begun is finished first (within a bound), so the store never holds less than the run said.
    """

    model: Model
    spec: AgentSpec
    # A copy: the caller's list is not touched.
    messages: list[Message] = attrs.field(
        converter=_messages, validator=attrs.validators.deep_iterable(attrs.validators.instance_of(Message))
    )
    session: Session | None = None
    on_event: Callable[[AgentEvent], None] = _ignore
    # Awaited once, after the first save and before the first model request: whatever else must
    # be true before the model is asked, done meanwhile by the caller (the runner: the task's
    # WORKING state, written to its own database while the transcript is saved to this one).
    ready: Callable[[], Awaitable[object]] | None = None
    # Given by a caller that accepts steers for this run (see SteerGate); the run closes it.
    gate: SteerGate | None = None
    # The model calls this turn had made when its process stopped (the answers it stored, for a
    # run that resumes it): they count toward the budget, so that no number of restarts lets a
    # runaway turn make more calls than one run may. None: the model's messages after the turn's
    # question, the last user message that is no steer (calls_made_in).
    calls_made: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(0)), kw_only=True)
    _box: SteerBox = attrs.field(init=False, factory=SteerBox)
    _unapplied: list[str] = attrs.field(init=False, factory=list)  # see unapplied_steers
    _calls: int = attrs.field(init=False, default=0)  # set once the messages are checked: __attrs_post_init__
    _usage: Usage | None = attrs.field(init=False, default=None)
    _started: bool = attrs.field(init=False, default=False)
    _saved: int = attrs.field(init=False, default=-1)  # how many messages the last save stored

    def __attrs_post_init__(self) -> None:
        self._calls = calls_made_in(self.messages) if self.calls_made is None else self.calls_made

    def steer(self, text: str) -> None:
        """Hand the run a steer for its next model request. Raises RunFinished once the run has
        ended, ValueError for empty text."""
        self._box.add(text)

    async def run(self) -> Result:
        """Run the turn to the model's answer. Blocks for the whole turn. A transcript that ends
        with the model's answer (a turn resumed after its answer was stored) is a turn already
        over: its answer is returned (saved, if it is not stored yet) and the model is not asked.

        Cancellation ends it promptly (see the class docstring). Raises BudgetExhausted or
        MaxStepsReached when the model will not conclude (the last step's work is stored first),
        AnswerTruncated when its answer stops at its length limit (the text is kept as partial),
        AnswerFiltered when its provider's content filter withholds the answer (likewise),
        AnswerFailed when its server ends the answer with an error (likewise),
        AnswerEmpty when the answer holds no text and calls no tool,
        AnswerTooLarge when its answer grows past what one stored message may hold (the text is
        kept as partial, cut to fit; a tool's output that large is cut short instead, saying so),
        SaveFailed when the session cannot be written (the run stops before its next model
        request) or the answer cannot be stored, a ModelError when the model fails (after
        retries, and never once it has started answering), RuntimeError when called twice.
        """
        if self._started:
            raise RuntimeError("An AgentRun runs once; make a new one for the next turn of the conversation.")
        self._started = True
        try:
            await self._turn()
        except (BudgetExhausted, MaxStepsReached):
            # The last step's tool results are work done: store them, so that a run resumed from
            # the session does not make those calls again. The limit stays the run's error.
            self._unapplied.extend(self._box.close())
            try:
                await self._save("saving the last step", before_model=False)
            except SaveFailed as exc:
                logger.warning("%s (%s)", exc, told_before(exc.__cause__) or repr(exc.__cause__))
            raise
        finally:
            self._unapplied.extend(self._box.close())
        if self._saved != len(self.messages):  # a continuation's look for steers may have saved it all
            await self._save("saving the answer", before_model=False)
        return Result(
            output=self.messages[-1].text,
            messages=tuple(self.messages),
            model_calls=self._calls,
            usage=self._usage,
            unapplied_steers=self.unapplied_steers,
        )

    @property
    def unapplied_steers(self) -> tuple[str, ...]:
        """The steers handed to this run (``steer``) that no model request carried, in the
        order given, for the caller to hand on: once ``run`` has returned (they are in its
        Result too) or raised, however it ended. None is ever dropped silently."""
        return tuple(self._unapplied)

    async def _turn(self) -> None:
        tools = {tool.name: tool for tool in self.spec.tools}
        specs = tuple(tool.spec() for tool in self.spec.tools)
        steps = continuations = 0
        if answered(self.messages):
            # A turn resumed after its answer was stored is over: asked again, the model would
            # answer it twice (or its server refuse two assistant messages in a row).
            if self.gate is not None:
                async with holding(self.gate.lock):
                    self.gate.closed = True
            return
        if self._calls >= self.spec.max_model_calls:  # spent before a restart
            raise BudgetExhausted(self.spec.max_model_calls)
        # A run resumed from a session's stored messages starts here; if a process died during
        # a step, the transcript ends where that step began, and the step is done again (_ask).
        await self._look()
        if self.ready is not None:
            await self.ready()
        while True:
            steps += 1
            answer = await self._ask(specs)
            self.messages.append(answer)
            if answer.tool_calls:
                await self._call_tools(tools, answer.tool_calls)
                self._check_limits(steps)
                await self._look()
            # A steer that arrived while the answer was being written has had no request to ride.
            # With a continuation (and budget) left, it is placed after the answer and the model
            # is asked once more; otherwise it is handed back in Result.unapplied_steers. A run
            # with a gate has as many continuations as its budget: its caller accepted each
            # steer on the promise that a request carries it (see SteerGate).
            elif (
                (self.gate is not None or continuations < self.spec.steer_continuations)
                and self._calls < self.spec.max_model_calls
                and await self._look("saving the answer", before_model=False)
            ):
                continuations += 1
                steps = 0
            else:  # with a gate, closed by now: at the look that found nothing, or before the last call
                return

    async def _look(self, what: str = _SAVING, *, before_model: bool = True) -> bool:
        """_prepare_request, holding the gate's lock if there is a gate, and closing it when no
        request can carry a steer accepted after this look: none follows (no steer was found
        after the answer), or only the budget's last one does."""
        if self.gate is None:
            return await self._prepare_request(what, before_model=before_model)
        async with holding(self.gate.lock):
            found = await self._prepare_request(what, before_model=before_model)
            if not (before_model or found) or self._calls + 1 >= self.spec.max_model_calls:
                self.gate.closed = True
            return found

    def _check_limits(self, steps: int) -> None:
        # The budget is checked first: with both limits at their defaults, a runaway turn is
        # reported as the budget it exhausted.
        if self._calls >= self.spec.max_model_calls:
            raise BudgetExhausted(self.spec.max_model_calls)
        if steps >= self.spec.max_steps:
            raise MaxStepsReached(self.spec.max_steps)

    async def _prepare_request(self, what: str = _SAVING, *, before_model: bool = True) -> bool:
        """Take the steers waiting, pin each where the run has got to, and save the transcript.
        True if a steer was placed. ``what`` and ``before_model`` say, should the save fail,
        what was being saved and whether a model request was to follow (see SaveFailed).

        Each steer becomes a labelled user message at the end of the transcript as it stands,
        which is where the run has got to. Later messages go after it, so every later request
        carries it at this position: it is never re-pinned last, where the model would read it
        as new every time. (It does not go where the run was when it arrived if that was during
        a step: before the answer being written, the transcript would claim the model had read
        it; between a tool call and its result, the transcript could not be sent.)

        The steers left in the store are taken and saved, placed, in the same transaction as the
        transcript before them, so none is ever taken and lost. That write is shielded from
        cancellation (within a bound): once begun it is finished, and the run knows what it took.
        Steers are announced (SteerApplied) once saved; those handed to the run (``steer``) go
        back to ``unapplied_steers`` if the save fails.
        """
        handed = self._box.take()
        start = len(self.messages)
        self.messages.extend(map(steer_message, handed))
        taken: list[str] = []
        if self.session is not None:
            try:
                with trio.move_on_after(STORE_TIMEOUT_S, shield=True) as bound:
                    taken = await self._save_and_take_steers(self.session, what, before_model=before_model)
            except SaveFailed:  # nothing of the save was stored: the handed steers go back, unsent
                del self.messages[start:]
                self._unapplied.extend(handed)
                raise
            if bound.cancelled_caught:  # the write may still land: its steers stay placed
                raise SaveFailed(self.session.id, f"{what} within {STORE_TIMEOUT_S:g} s", before_model=before_model)
        for offset, text in enumerate((*handed, *taken)):
            self.on_event(SteerApplied(text, start + offset))
        return bool(handed or taken)

    async def _save_and_take_steers(self, session: Session, what: str, *, before_model: bool) -> list[str]:
        """Save the transcript, take the steers left in the store and save them placed after it,
        in one step (one transaction on SQLite): one round trip to the database per step, and a
        save that fails leaves the steers for the run that resumes."""
        try:
            taken = await session.save_and_take_steers(self.messages, placed=steer_message)
        except Exception as exc:  # any failure, as in _save
            raise SaveFailed(session.id, what, before_model=before_model, damaged=is_damage(exc), conflict=_conflict(exc)) from exc
        self.messages.extend(map(steer_message, taken))  # as saved
        self._saved = len(self.messages)
        return taken

    async def _save(self, what: str, *, before_model: bool = True, bound_s: float = STORE_TIMEOUT_S) -> None:
        """Save the transcript, shielded from cancellation within ``bound_s``: a save once begun
        is finished, so a run cancelled meanwhile has still stored what it said it stored."""
        if self.session is None:
            return
        with trio.move_on_after(bound_s, shield=True):
            try:
                await self.session.save(self.messages)
                self._saved = len(self.messages)
            except Exception as exc:
                # Whatever the store raises (its own errors, or a driver's it let through), the
                # run stops with an error naming the session; the store's words stay in __cause__.
                raise SaveFailed(self.session.id, what, before_model=before_model, damaged=is_damage(exc), conflict=_conflict(exc)) from exc
            return
        raise SaveFailed(self.session.id, f"{what} within {bound_s:g} s", before_model=before_model)

    async def _ask(self, tools: tuple[ToolSpec, ...]) -> Message:
        """One streamed model request; returns the model's message.

        The crash seam. The transcript was saved just before this request, so a process that
        dies during this step (while the model answers or while its tools run) leaves the
        session at the start of the step, and a run resumed from the session's stored messages
        does the whole step again, tool calls included. A run that is cancelled here, or whose
        model fails mid-answer, stops at its length limit or will not stop, keeps the text
        streamed so far (see _keep_partial).
        """
        request = ChatRequest(messages=self._request_messages(), tools=tools, temperature=self.spec.temperature)
        self._calls += 1
        self.on_event(StepStarted(self._calls))
        limit = self._max_message_bytes
        said = 0  # characters of the answer so far: at least as many bytes once stored
        named: set[tuple[int, str]] = set()  # (call index, "id" or "name") counted already
        stream: AnswerStream | None = None
        try:
            async with self.model.stream(request) as stream:
                async for delta in stream:
                    said += _characters(delta, named)
                    if said > limit:  # a model that would not stop: what it said is kept, cut to fit
                        raise AnswerTooLarge(limit)
                    self._emit(delta)
                completion = stream.completion()
                if completion.finish_reason == "length":
                    # Not an answer to act on: its end, and maybe its tool calls, are missing.
                    # The text is kept as partial, like a cancelled answer's.
                    raise AnswerTruncated()
                if completion.finish_reason == "content_filter":  # likewise: what is there is not all of it
                    raise AnswerFiltered()
                if completion.finish_reason in FAILED_FINISHES:  # likewise
                    raise AnswerFailed(completion.finish_reason)
                if not (completion.message.tool_calls or completion.message.text.strip()):
                    # An answer of nothing is no answer: completed, the client would be told nothing,
                    # and the model shown a reply it never gave.
                    raise AnswerEmpty()
                answer = completion.message
                if (answer.reasoning or answer.reasoning_details) and answer.oversize(limit) is not None:
                    # Its calls are what the run needs; a server that wants their reasoning
                    # back refuses the next request without it, and says so. All of it goes: a
                    # reasoning text without its signed details is refused as forged.
                    answer = attrs.evolve(answer, reasoning="", reasoning_as=REASONING_CONTENT, reasoning_details="")
                if answer.oversize(limit) is not None:
                    raise AnswerTooLarge(limit)
        except BaseException:
            # After the stream is closed, so the model server hears at once that we left.
            if stream is not None:
                await self._keep_partial(stream.partial_message())
            raise
        return answer

    @property
    def _max_message_bytes(self) -> int:
        """The largest message the run may store: its session's limit (the default without one)."""
        return MAX_EVENT_BYTES if self.session is None else self.session.max_message_bytes

    def _request_messages(self) -> list[Message]:
        # Partial answers are kept for the record, never sent: the model did not finish them.
        messages = labelled_after_steers([message for message in self.messages if not message.partial])
        if self.spec.system_prompt:
            messages.insert(0, Message(role="system", text=self.spec.system_prompt))
        return messages

    def _emit(self, delta: Delta) -> None:
        if isinstance(delta, ModelText):
            self.on_event(TextDelta(delta.text))
        elif isinstance(delta, Usage):
            self._usage = delta if self._usage is None else _add(self._usage, delta)
            self.on_event(UsageReported(delta))

    async def _keep_partial(self, said: Message) -> None:
        """Keep the text of an answer that was cut off, as an assistant message marked partial,
        and store it (the run may be ending by cancellation: see _save). Its tool calls are
        dropped: without their results the transcript could not be sent again."""
        if not said.text:
            return
        self.messages.append(Message(role="assistant", text=said.text, partial=True).cut_to_fit(self._max_message_bytes))
        try:
            await self._save("saving the partial answer", before_model=False, bound_s=CLEANUP_TIMEOUT_S)
        except SaveFailed as exc:  # the run is already ending with the error that cut the answer off
            logger.warning("%s (%s)", exc, told_before(exc.__cause__) or repr(exc.__cause__))

    async def _call_tools(self, tools: dict[str, Tool], calls: Sequence[ToolCall]) -> None:
        task_id = self.session.task_id if self.session else None
        limit = self.spec.max_calls_per_answer
        for index, call in enumerate(calls):
            self.on_event(ToolCalled(call))
            if index < limit:
                outcome = await call_tool(tools, call, task_id=task_id)
            else:  # every call is answered: a transcript with a call and no result cannot be sent
                why = f"one answer may make at most {limit} tool calls; make the rest in your next answer"
                outcome = Outcome(f"error: {call.name} was not run: {why}", True)
            result = _fitted(Message(role="tool", text=outcome.text, tool_call_id=call.id, name=call.name), self._max_message_bytes)
            self.messages.append(result)
            self.on_event(ToolResult(call.id, call.name, result.text, outcome.is_error))


def calls_made_in(messages: Sequence[Message]) -> int:
    """The model calls the turn a transcript ends in has made: its assistant messages (each an
    answer, or part of one a call was cut short in) after its question, the last user message
    that is not a steer."""
    calls = 0
    for message in reversed(messages):
        if message.role == "user" and not is_steer(message):
            break
        calls += message.role == "assistant"
    return calls


def answered(messages: Sequence[Message]) -> bool:
    """Whether a transcript ends with the model's answer: an assistant message, whole, that
    calls no tool. The next turn begins with the next user message."""
    if not messages:
        return False
    last = messages[-1]
    return last.role == "assistant" and not last.tool_calls and not last.partial


def _characters(delta: Delta, named: set[tuple[int, str]]) -> int:
    """The characters a delta adds to the answer. A call's id and name count once each, in the
    first piece that carries them, as the answer keeps them, however many pieces repeat them
    (as some servers do); a whole ToolCall, sent once a stream has given its pieces, adds none:
    the completion's own check counts it."""
    if isinstance(delta, ModelText):
        return len(delta.text)
    if isinstance(delta, ToolCallDelta):
        size = len(delta.arguments)
        for part, text in (("id", delta.id), ("name", delta.name)):
            if text and (delta.index, part) not in named:
                named.add((delta.index, part))
                size += len(text)
        return size
    return 0


def _conflict(exc: Exception) -> str:
    """How the transcript a run saved differs from the stored one, if that is why its save failed."""
    return exc.reason if isinstance(exc, TranscriptConflict) else ""


def _fitted(result: Message, limit: int) -> Message:
    """A tool's result as the transcript can hold it: an output larger than one message may be
    is cut short, saying so, rather than stopping the run at its next save. The model reads
    what is kept, and the note."""
    size = result.oversize(limit)
    if size is None:
        return result
    note = f"\n[output cut here: the tool returned {size} bytes, more than the {limit} one message may hold]"
    try:
        return result.cut_to_fit(limit, note)
    except ValueError:  # the call's own id and name leave no room: the model's answer was too large
        raise AnswerTooLarge(limit) from None


def _add(a: Usage, b: Usage) -> Usage:
    return Usage(
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        completion_tokens=a.completion_tokens + b.completion_tokens,
        total_tokens=a.total_tokens + b.total_tokens,
    )
