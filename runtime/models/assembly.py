"""Turning a streamed answer (server-sent events of chat-completion chunks) into deltas, sans I/O.

Tool calls are assembled by their ``index``: the first fragment of a call carries its id and name,
later ones only pieces of ``arguments``, which are concatenated as text, exactly as they came
(save that UTF-16 surrogates sent apart are joined, and lone ones replaced: ``wire.unicode_text``).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from persistence.transcript import Message, ToolCall
from runtime.models.errors import ModelBadResponse, ModelReasoningRunaway, ModelUnavailable
from runtime.models.reasoning import ThinkFilter
from runtime.models.values import Completion, Delta, Finish, TextDelta, ToolCallDelta, Usage
from runtime.models.wire import (
    REASONING_FIELDS, SAID_CHARS, ReasoningDetails, arguments_text, carries_reasoning, content_text, distinct_ids, extra_text,
    inferred_finish_reason, kept_reasoning, optional_str, parse_usage, reasoning_chars, tool_call, unicode_text,
)


@attrs.define
class _CallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = attrs.Factory(list)
    extra: str = ""  # see wire.extra_text


@attrs.define(eq=False)
class StreamAssembler:
    """Feed it the lines of the response body; it returns the deltas each line completes.

    ``done`` turns true at ``data: [DONE]``. Raises ModelBadResponse for a chunk that is not a chat
    completion chunk; ModelUnavailable for an error the server reports in the stream, and for a
    stream that ends before the model finished.
    """

    model: str
    # The most characters one event's data may hold (its data lines together): one chunk of the
    # answer. Past it the stream is refused, rather than held in memory until it ends.
    max_event_chars: int | None = attrs.field(default=None, kw_only=True)
    # The most characters the model may reason before its answer starts: past it the stream is
    # refused (ModelReasoningRunaway), rather than read for as long as the model goes round.
    max_reasoning_chars: int | None = attrs.field(default=None, kw_only=True)
    done: bool = attrs.field(init=False, default=False)
    # Chunks that carried any of the answer (text, reasoning, a piece of a tool call, the finish):
    # one holding none of it (an empty delta, usage alone, another choice) is no sign of life.
    pieces: int = attrs.field(init=False, default=0)
    _data: list[str] = attrs.field(init=False, factory=list)
    _event: str = attrs.field(init=False, default="")  # the type of the event being collected
    _data_chars: int = attrs.field(init=False, default=0)
    _text: list[str] = attrs.field(init=False, factory=list)
    _held: str = attrs.field(init=False, default="")  # a surrogate that ended the last text, awaiting its pair
    _think: ThinkFilter = attrs.field(init=False, factory=ThinkFilter)  # reasoning opening the text is not the answer
    _reasoned: bool = attrs.field(init=False, default=False)  # reasoning came apart from the text
    _reasoning_chars: int = attrs.field(init=False, default=0)  # of reasoning, in the answer so far
    _reasoning: dict[str, list[str]] = attrs.field(init=False, factory=dict)  # by field: see wire.REASONING_FIELDS
    _details: ReasoningDetails = attrs.field(init=False, factory=ReasoningDetails)
    _calls: dict[int, _CallParts] = attrs.field(init=False, factory=dict)
    _moved: dict[int, int] = attrs.field(init=False, factory=dict)  # a server's call index, to the call it now leads to
    _finish_reason: str = attrs.field(init=False, default="")
    _usage: Usage | None = attrs.field(init=False, default=None)

    def feed_line(self, line: str) -> list[Delta]:
        """One line of the body, without its line ending (server-sent events framing)."""
        if self.done:
            return []
        if not line:
            return self._dispatch()
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
            self._data_chars += len(value)
            if self.max_event_chars is not None and self._data_chars > self.max_event_chars:
                raise ModelBadResponse(self.model, f"a stream event is longer than {self.max_event_chars} characters")
        elif field == "event":
            self._event = value
        elif field == "error":
            # llama.cpp's server, until late 2025, reported a failure in a field of its own, which
            # the event-stream rules ignore, and then sent [DONE] (ggml-org/llama.cpp#16109).
            raise self._reported(value)
        # Comments (":" keep-alives) and the id and retry fields carry nothing we use.
        return []

    @property
    def finished(self) -> bool:
        """Whether the model has said it finished (a finish reason), [DONE] or not."""
        return bool(self._finish_reason)

    @property
    def started(self) -> bool:
        """Whether any of the answer has arrived: text, a tool call or the finish (the opening
        chunk that only names the assistant's role is none of it, nor is a comment)."""
        return bool(self._text or self._held or self._calls or self._finish_reason)

    @property
    def reasoning(self) -> bool:
        """Whether the model has been reasoning (apart from its text, or in a block opening it)
        and none of its answer has arrived yet."""
        return (self._reasoned or self._think.reasoned) and not self.started

    def end_of_stream(self, *, cut_off: bool = False) -> list[Delta]:
        """The body ended. A server that finished but sent no ``[DONE]`` is forgiven; one that
        stopped before the model finished is not: it failed in the middle of the answer, as one
        whose connection breaks there does (Ollama ends the body so when its model fails, the
        error read as a chunk holding nothing). ``cut_off``: the connection broke, so an event
        still being collected is a fragment, and dropped."""
        if cut_off:
            self._data.clear()
        deltas = self._dispatch()
        if not self.done:
            if not self._finish_reason:
                detail = "the body ended with no finish_reason and no [DONE]; the model server's own log may say why"
                raise ModelUnavailable(self.model, "the stream ended before the model finished its answer", detail=detail)
            self.done = True
            deltas.extend(self._final_usage())
        return deltas

    def _final_usage(self) -> list[Delta]:
        """The answer's usage, once, as it stands at the end: a server may send it on every chunk,
        each time the whole so far (vLLM's continuous usage stats), so summing those would count
        the same tokens many times."""
        return [] if self._usage is None else [self._usage]

    def completion(self) -> Completion:
        if not self.done:
            raise RuntimeError("The answer is not complete yet; read the stream to its end before asking for the completion.")
        return Completion(message=self._message(partial=False), finish_reason=self._finish_reason, usage=self._usage)

    def partial_message(self) -> Message:
        """What the model has said so far, marked partial; tool calls are left out until the model
        has finished, because their arguments may have been cut off mid-way."""
        return self._message(partial=not self.done)

    def _message(self, *, partial: bool) -> Message:
        calls = () if partial else self._tool_calls()
        # A surrogate held for its pair is the answer's, unless the text is still in its reasoning.
        text = "".join(self._text) + ("" if self._think.thinking else unicode_text(self._held))
        # Only with calls: see wire.REASONING_FIELDS.
        reasoning, reasoning_as = kept_reasoning({name: "".join(given) for name, given in self._reasoning.items()} if calls else {})
        details = self._details.text() if calls else ""
        return Message(
            role="assistant", text=text, tool_calls=calls, partial=partial,
            reasoning=reasoning, reasoning_as=reasoning_as, reasoning_details=details,
        )

    def _tool_calls(self) -> tuple[ToolCall, ...]:
        return distinct_ids(
            tool_call(index, parts.id, parts.name, "".join(parts.arguments), parts.extra)
            for index, parts in sorted(self._calls.items())
        )

    def _unicode(self, text: str) -> str:
        """A chunk's text as Unicode text (see wire.unicode_text), holding back a first half of a
        surrogate pair that ends it until the next chunk brings the second."""
        text, self._held = self._held + text, ""
        if "\ud800" <= text[-1:] <= "\udbff":
            text, self._held = text[:-1], text[-1]
        return unicode_text(text)

    def _dispatch(self) -> list[Delta]:
        event, self._event = self._event, ""
        if not self._data:
            return []
        data = "\n".join(self._data)
        self._data.clear()
        self._data_chars = 0
        if not data.strip():  # an event with no data is not dispatched (a proxy's heartbeat, say)
            return []
        if event == "error":  # whatever its data's shape: what came before it is not the whole answer
            raise self._reported(data)
        if data.strip() == "[DONE]":
            self.done = True
            finish = [] if self._finish_reason else self._finish(inferred_finish_reason(self._tool_calls()))
            return [*finish, *self._final_usage()]
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past what Python reads
            raise ModelBadResponse(self.model, "a stream event is not JSON", detail=data[:SAID_CHARS]) from exc
        return self._on_chunk(chunk)

    def _on_chunk(self, chunk: object) -> list[Delta]:
        if not isinstance(chunk, dict):
            raise ModelBadResponse(self.model, "a stream event is not a JSON object")
        if "error" in chunk:
            raise self._reported(json.dumps(chunk["error"], ensure_ascii=False))
        deltas: list[Delta] = []
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise ModelBadResponse(self.model, "a chunk's choices are not a list")
        for choice in choices:
            # One answer is asked for (n=1); a server that sends more choices is ignored past the first.
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                deltas.extend(self._on_choice(choice))
        usage = parse_usage(chunk.get("usage"), model=self.model)
        if usage is not None:  # handed out at the end (_final_usage)
            self._usage = usage
        return deltas

    def _reported(self, said: str) -> ModelUnavailable:
        """The error for a failure the server reported in the stream (the server failing, as an
        HTTP 5xx says, not an answer that cannot be read); what it said is the log's."""
        return ModelUnavailable(self.model, "the server reported an error in the middle of the answer", detail=said[:SAID_CHARS])

    def _on_choice(self, choice: dict[str, Any]) -> list[Delta]:
        deltas: list[Delta] = []
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise ModelBadResponse(self.model, "a chunk's delta is not a JSON object")
        self._reasoned = self._reasoned or carries_reasoning(delta)
        for name in REASONING_FIELDS:
            if isinstance(given := delta.get(name), str):
                self._reasoning.setdefault(name, []).append(given)
        self._details.feed(delta.get("reasoning_details"))
        content = self._unicode(content_text(delta.get("content"), model=self.model, what="a chunk's content"))
        text = self._think.feed(content)
        # What its reasoning block held, or what came apart from the content: counted for the whole
        # answer, since reasoning that goes on once the answer has begun adds nothing to its size.
        reasoned = reasoning_chars(delta) + len(content) - len(text)
        self._reasoning_chars += reasoned
        if self.max_reasoning_chars is not None and self._reasoning_chars > self.max_reasoning_chars:
            raise ModelReasoningRunaway(self.model, self.max_reasoning_chars, started=self.started)
        deltas.extend(self._said(text))
        calls = delta.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ModelBadResponse(self.model, "a chunk's tool calls are not a list")
        if content or reasoned or calls or choice.get("finish_reason"):
            self.pieces += 1
        if calls and self._finish_reason:
            raise ModelBadResponse(self.model, "a tool call fragment came after the model had finished")
        for position, call in enumerate(calls):
            deltas.append(self._on_tool_call(position, call))
        reason = optional_str(choice.get("finish_reason"), model=self.model, what="the finish reason")
        if reason and not self._finish_reason:
            deltas.extend(self._finish(reason))
        return deltas

    def _on_tool_call(self, position: int, call: object) -> ToolCallDelta:
        if not isinstance(call, dict):
            raise ModelBadResponse(self.model, "a tool call fragment is not a JSON object")
        call_id = optional_str(call.get("id"), model=self.model, what="the id of a tool call")
        given = call.get("index")
        index = self._unindexed(call_id, position) if given is None else given
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ModelBadResponse(self.model, "a tool call fragment has an index that is not a count")
        function = call.get("function") or {}
        if not isinstance(function, dict):
            raise ModelBadResponse(self.model, f"tool call {index} is not a function call")
        name = optional_str(function.get("name"), model=self.model, what=f"the name of tool call {index}")
        if given is not None:
            index = self._reindexed(index, call_id, name)
        fragment = arguments_text(function.get("arguments"), model=self.model, index=index)
        parts = self._calls.setdefault(index, _CallParts())
        # The id and name come once; a server that repeats them in later fragments is not
        # asking for them to be concatenated.
        parts.id = parts.id or call_id
        parts.name = parts.name or name
        parts.extra = parts.extra or extra_text(call)
        if fragment:
            parts.arguments.append(fragment)
        return ToolCallDelta(index=index, id=call_id, name=name, arguments=fragment)

    def _reindexed(self, index: int, call_id: str, name: str) -> int:
        """Where a fragment given ``index`` goes. One that names a call, with an id other than that
        of the call its index leads to, opens the next call, or goes on with the call of that id
        (Ollama streams every call of a parallel batch at index 0, ollama/ollama#15457); the
        fragments after it at that index go on with the call it led to. A fragment with another id
        but no name goes on with its index's call (Poolside gives a call's later pieces an id of
        their own, poolsideai/pool#9)."""
        held = self._calls.get(self._moved.get(index, index))
        if call_id and name and held is not None and held.id and held.id != call_id:
            known = next((other for other, parts in self._calls.items() if parts.id == call_id), None)
            self._moved[index] = known if known is not None else max(self._calls) + 1
        return self._moved.get(index, index)

    def _unindexed(self, call_id: str, position: int) -> int:
        """Where a fragment that gives no index goes (a server that sends whole calls): one with
        an id not seen yet opens the next call, as does any after the first of its chunk; one
        with a known id, or the first of its chunk with none, goes on with that call."""
        if call_id:
            known = next((index for index, parts in self._calls.items() if parts.id == call_id), None)
            if known is not None:
                return known
        elif position == 0 and self._calls:
            return max(self._calls)
        return max(self._calls, default=-1) + 1

    def _said(self, text: str) -> list[Delta]:
        if not text:
            return []
        self._text.append(text)
        return [TextDelta(text)]

    def _finish(self, reason: str) -> list[Delta]:
        """Called once: the text held back (see ThinkFilter), the assembled calls, then Finish.
        A finish_reason is never empty after it."""
        self._finish_reason = reason
        for index, parts in sorted(self._calls.items()):
            if not parts.name:  # named by its place, not by its id: the id is the server's words
                raise ModelBadResponse(self.model, f"tool call {index} has no name")
        held, self._held = unicode_text(self._held), ""  # its pair is not coming: the text ends here
        return [*self._said(self._think.feed(held) + self._think.end()), *self._tool_calls(), Finish(reason)]
