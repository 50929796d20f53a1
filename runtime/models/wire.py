"""The OpenAI chat-completions wire shapes, sans I/O: request bodies out, completions in.

Tool-call arguments travel as the raw text the model produced, in both directions: a stored
``ToolCall.arguments`` goes out as ``function.arguments`` unchanged and an answer's arguments come
back unchanged (duplicate keys, key order and whitespace included). The exceptions are text that
is not Unicode at all (see ``unicode_text``), which no store holds, and arguments going out that
are not a JSON object (see ``wire_arguments``), which servers refuse to read back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import attrs

from persistence.transcript import REASONING_CONTENT, Message, ToolCall
from persistence.validate import lone_surrogate, strict_json
from runtime.models.errors import ModelBadResponse
from runtime.models.reasoning import answer_text
from runtime.models.values import ChatRequest, Completion, ToolSpec, Usage

# What is kept of what a server said (an error, a chunk that is not JSON), for the log: more
# than the log keeps, so that a secret across the log's cut is still whole when it is scrubbed.
SAID_CHARS = 8000


def request_body(request: ChatRequest, *, model: str, stream: bool, server: str) -> dict[str, Any]:
    """The JSON body of ``POST /chat/completions`` for ``request``, to the model server
    ``server`` (``ModelConfig.server``): what another server attached to its answers is left out.

    Raises ValueError naming the message when the transcript cannot be sent (a tool result
    that does not say which call it answers).
    """
    messages = [message_to_wire(index, message, server) for index, message in enumerate(request.messages)]
    body: dict[str, Any] = {
        "model": model,
        "messages": joined_user_messages(messages),
        "stream": stream,
    }
    if stream:
        # Without this, OpenAI-compatible servers leave token usage out of a streamed answer.
        body["stream_options"] = {"include_usage": True}
    if request.tools:
        body["tools"] = [tool_to_wire(tool) for tool in request.tools]
    if request.temperature is not None:
        body["temperature"] = request.temperature
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    return body


def message_to_wire(index: int, message: Message, server: str) -> dict[str, Any]:
    """``message`` as the API takes it. What a server attached to it (reasoning before its tool
    calls, ``extra_content`` on them) goes only to that server (``message.via``), or to any when the
    message does not say (stored by an earlier build): another may refuse a field it does not know."""
    if message.role == "tool":
        if not message.tool_call_id:
            raise ValueError(
                f"message {index} is a tool result without a tool_call_id; "
                "it must name the tool call it answers"
            )
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.text}
    wire: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.name:
        wire["name"] = message.name
    if message.role == "assistant" and message.tool_calls:
        # The API's own shape for an assistant turn that only calls tools is content: null.
        wire["content"] = message.text or None
        attached = not message.via or message.via == server
        wire["tool_calls"] = [tool_call_to_wire(call, attached=attached) for call in message.tool_calls]
        if not attached:
            return wire
        if message.reasoning:  # only ever kept from a server that sent it so: see REASONING_FIELDS
            names = [name for name in message.reasoning_as.split() if name in REASONING_FIELDS]  # none but these
            wire.update(dict.fromkeys(names, message.reasoning))
        details = _stored_json(message.reasoning_details)
        if isinstance(details, list) and details:
            wire["reasoning_details"] = details
    return wire


def marked(message: Message, server: str) -> Message:
    """``message`` (an answer of the model server ``server``), marked as that server's (``via``)
    when it attached something to it: reasoning before its tool calls, or ``extra_content`` on one."""
    if not (message.reasoning or message.reasoning_details or any(call.extra for call in message.tool_calls)):
        return message
    return attrs.evolve(message, via=server)


def marked_completion(completion: Completion, server: str) -> Completion:
    """``completion``, its message ``marked``."""
    message = marked(completion.message, server)
    return completion if message is completion.message else attrs.evolve(completion, message=message)


def joined_user_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each run of user messages next to each other (of one ``name``) sent as
    one, their texts a blank line apart.

    A transcript has such runs where a turn ended with no answer (it was cancelled, or failed)
    and the next one began, or where a steer came before the model's first answer. Many chat
    templates (Mistral's, Gemma's and others, as vLLM and llama.cpp's server apply them) refuse
    a conversation whose roles do not alternate, and with it every later turn of it; the model
    reads the joined message as it would have read the two. A message the same as the one just
    before it is not repeated: a turn that fails tells its client to send the message again, and
    the model is to read the question once, however many turns failed on it."""
    joined: list[dict[str, Any]] = []
    previous = None  # the content of the message before
    for message in messages:
        last = joined[-1] if joined else None
        if last is not None and last["role"] == message["role"] == "user" and last.get("name") == message.get("name"):
            if message["content"] != previous:
                joined[-1] = {**last, "content": "\n\n".join(filter(None, (last["content"], message["content"])))}
        else:
            joined.append(message)
        previous = message["content"]
    return joined


def tool_call_to_wire(call: ToolCall, *, attached: bool = True) -> dict[str, Any]:
    """``call`` as the API takes it; with what its server attached to it (``extra_content``) if ``attached``."""
    wire: dict[str, Any] = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": wire_arguments(call.arguments)}}
    if not attached:
        return wire
    extra = _stored_json(call.extra)
    if isinstance(extra, dict) and extra:
        wire["extra_content"] = extra
    return wire


def _stored_json(text: str) -> object:
    """What a server gave, stored as JSON text (see extra_text, ReasoningDetails): the value, or
    None when there is none (a call or message stored without any) or it does not read."""
    try:
        return json.loads(text) if text else None
    except (ValueError, RecursionError):
        return None


def wire_arguments(arguments: str) -> str:
    """A call's arguments as they are sent back with it: the model's text, unchanged, when it is
    a JSON object a server can read back (not one holding 1e309, say: see strict_json); otherwise
    a JSON object the server can read.

    Servers read the arguments of the calls in a transcript back as an object (Ollama decodes
    them into a map, vLLM hands them to the chat template), and refuse the whole request when
    they cannot: a call the model got wrong, which the model is told of in the call's result,
    would otherwise end this run and every later turn of the conversation. No arguments ("") go
    as ``{}``, as the tool took them; any other text goes as ``{"invalid_arguments": text}``,
    for the model to see what it wrote beside the error it was sent.
    """
    if not arguments:
        return "{}"
    try:
        value = strict_json(arguments)
    except (ValueError, RecursionError):
        value = None
    if isinstance(value, dict):
        return arguments
    return json.dumps({"invalid_arguments": arguments}, ensure_ascii=False)


def tool_to_wire(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def parse_completion(data: object, *, model: str) -> Completion:
    """The answer in a non-streamed response body; raises ModelBadResponse if it is not one."""
    if not isinstance(data, dict):
        raise ModelBadResponse(model, "the body is not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        if data.get("error") is not None:  # a proxy's or gateway's failure, answered with HTTP 200
            detail = json.dumps(data["error"], ensure_ascii=False)[:SAID_CHARS]
            raise ModelBadResponse(model, "the server reported an error instead of an answer", detail=detail)
        raise ModelBadResponse(model, "the body has no choices")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise ModelBadResponse(model, "the first choice has no message")
    text = answer_text(unicode_text(content_text(message.get("content"), model=model, what="the message content")))
    wire_calls = message.get("tool_calls") or []
    if not isinstance(wire_calls, list):
        raise ModelBadResponse(model, "the message's tool calls are not a list")
    calls = distinct_ids(tool_call_from_wire(index, call, model=model) for index, call in enumerate(wire_calls))
    reason = optional_str(choices[0].get("finish_reason"), model=model, what="the finish reason")
    reasoning, reasoning_as = kept_reasoning({name: message.get(name) for name in REASONING_FIELDS} if calls else {})
    details = ReasoningDetails()
    details.feed(message.get("reasoning_details") if calls else None, whole=True)
    return Completion(
        message=Message(
            role="assistant", text=text, tool_calls=calls, reasoning=reasoning, reasoning_as=reasoning_as, reasoning_details=details.text()
        ),
        finish_reason=reason or inferred_finish_reason(calls),
        usage=parse_usage(data.get("usage"), model=model),
    )


def tool_call_from_wire(index: int, call: object, *, model: str) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ModelBadResponse(model, f"tool call {index} is not a function call")
    function = call["function"]
    name = optional_str(function.get("name"), model=model, what=f"the name of tool call {index}")
    if not name:
        raise ModelBadResponse(model, f"tool call {index} has no name")
    call_id = optional_str(call.get("id"), model=model, what=f"the id of tool call {index}")
    arguments = arguments_text(function.get("arguments"), model=model, index=index)
    return tool_call(index, call_id, name, arguments, extra_text(call))


def tool_call(index: int, call_id: str, name: str, arguments: str, extra: str = "") -> ToolCall:
    return ToolCall(
        id=unicode_text(call_id) or synthetic_call_id(index),
        name=unicode_text(name),
        arguments=unicode_text(arguments),
        extra=extra,
    )


def extra_text(call: dict[str, Any]) -> str:
    """What a server attached to a call (or a piece of one) in its ``extra_content``, as JSON
    text to be sent back with the call: Gemini's OpenAI-compatible API gives each call of a
    Gemini 3 model its thought signature there, ``{"google": {"thought_signature": ...}}``, and
    refuses a later request whose call comes without it. "" when there is none, or it is not an
    object (nothing a server would read back), or holds text that is not Unicode (no store can)."""
    extra = call.get("extra_content")
    if not isinstance(extra, dict) or not extra:
        return ""
    text = json.dumps(extra, ensure_ascii=False, separators=(",", ":"))
    return "" if lone_surrogate(text) is not None else text


def distinct_ids(calls: Iterable[ToolCall]) -> tuple[ToolCall, ...]:
    """``calls``, each with an id no other call of the answer has: a call whose id an earlier one
    took gets that id with ``_2`` (``_3``...) after it, or, an id of letters and digits alone,
    that id with its last characters made the count (``aB3dE6gH9``: ``aB3dE6gH2``): of the same
    length and characters, as Mistral's API and its models' chat templates take no other (9
    letters and digits). Each call is run and answered; its result names the call it answers,
    and a request whose calls share an id cannot say which result is whose (servers that check
    ids refuse it)."""
    taken: set[str] = set()
    distinct = []
    for call in calls:
        call_id, count = call.id, 1
        while call_id in taken:
            count += 1
            call_id = _counted(call.id, count)
        taken.add(call_id)
        distinct.append(call if call_id == call.id else attrs.evolve(call, id=call_id))
    return tuple(distinct)


def _counted(call_id: str, count: int) -> str:
    """The ``count``-th id made of ``call_id`` (see distinct_ids)."""
    if call_id.isascii() and call_id.isalnum():
        return call_id[: max(0, len(call_id) - len(str(count)))] + str(count)
    return f"{call_id}_{count}"


def unicode_text(text: str) -> str:
    """``text`` as Unicode text, which is what a store can hold.

    JSON can spell UTF-16 surrogates one at a time, and a server that cuts its text by UTF-16
    units (as JavaScript's strings do) may send an emoji's two halves in two chunks: the halves
    are joined here into their character. A half left alone is replaced by U+FFFD, as a bad
    byte would be. Anything else, tool-call arguments included, is returned unchanged.
    """
    if lone_surrogate(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def arguments_text(arguments: object, *, model: str, index: int) -> str:
    """The raw arguments text. A server that sends an object instead of text leaves no raw text
    to keep, so that object is the one thing this module serialises."""
    if arguments is None or isinstance(arguments, str):
        return arguments or ""
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    raise ModelBadResponse(model, f"the arguments of tool call {index} are neither text nor an object")


def synthetic_call_id(index: int) -> str:
    # Some local servers leave the id out; a tool result still has to name the call it answers.
    # Nine letters and digits (call00000, call00001...): the only ids Mistral's API and its
    # models' chat templates take, and ids every other server takes too.
    return f"call{index:05d}"


def inferred_finish_reason(calls: tuple[ToolCall, ...]) -> str:
    # Used only when a server ends an answer without saying why.
    return "tool_calls" if calls else "stop"


def parse_usage(usage: object, *, model: str) -> Usage | None:
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise ModelBadResponse(model, "the usage is not a JSON object")
    # The usage is an account of the answer, not part of it: counts given as null are not
    # given, whole numbers written as floats (2.0) are whole numbers, and a usage whose counts
    # cannot be read is left out rather than fail an answer the model finished.
    prompt, completion = (_count(usage.get(key)) for key in ("prompt_tokens", "completion_tokens"))
    if prompt is None or completion is None:
        return None
    total = _count(usage.get("total_tokens")) or prompt + completion  # not given (or 0): their sum
    return Usage(prompt, completion, total)


def _count(value: object) -> int | None:
    """A token count as a server wrote it: an integer (absent or null: 0), or None if unreadable."""
    if value is None:
        return 0
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


# What a model reasons before it calls tools goes back with its calls, as the fields it came in:
# ``reasoning_content``, which DeepSeek's thinking mode and Moonshot's Kimi refuse a conversation
# without ("Missing `reasoning_content` field in the assistant message"); ``reasoning``, the name
# vLLM gives it now (and reads back, handing the chat template the reasoning of the calls since the
# last user message, as Qwen3's, MiniMax-M2's and gpt-oss's templates want), and Ollama's, Groq's
# and OpenRouter's; and OpenRouter's ``reasoning_details``, which its Anthropic and Gemini 3 models
# want back unmodified (their text is signed, or encrypted). Only what a server sent is sent back
# (OpenAI's refuses a field it does not know, Groq's ``reasoning`` for a model that does not reason,
# Anthropic's a reasoning text without its signed details), and only with tool calls: an answer's
# reasoning is read back by none of them.
REASONING_FIELDS = (REASONING_CONTENT, "reasoning")
_DETAIL_PIECES = ("text", "summary", "data")  # what a reasoning detail streamed in pieces spreads over them


def kept_reasoning(fields: dict[str, object]) -> tuple[str, str]:
    """The reasoning given in ``fields`` (a message's REASONING_FIELDS, or their streamed pieces
    joined), and the names it came under, space-separated. A server that keeps an older name
    beside the newer sends the same text in both: the first is taken."""
    names = [name for name in REASONING_FIELDS if isinstance(fields.get(name), str) and fields[name]]
    if not names:
        return "", REASONING_CONTENT
    return unicode_text(str(fields[names[0]])), " ".join(names)


@attrs.define
class ReasoningDetails:
    """OpenRouter's ``reasoning_details`` (typed objects: ``reasoning.text`` with its
    ``signature``, ``reasoning.summary``, ``reasoning.encrypted``), put together from the pieces a
    stream gives them in: a piece of the detail of the same type and ``index`` adds its text
    (summary, data) to that detail's, and gives it the other fields it has (the signature comes
    last); one without an index is a detail of its own. A body's details come whole."""

    _details: list[dict[str, Any]] = attrs.field(factory=list)
    _at: dict[tuple[str, int], dict[str, Any]] = attrs.field(factory=dict)

    def feed(self, details: object, *, whole: bool = False) -> None:
        """Take a chunk's details (pieces), or with ``whole`` a body's (each one as it came)."""
        for detail in details if isinstance(details, list) else []:
            if not isinstance(detail, dict):
                continue
            index, key = detail.get("index"), None
            if not whole and isinstance(index, int) and not isinstance(index, bool):
                key = (str(detail.get("type")), index)
            kept = self._at.get(key) if key is not None else None
            if kept is None:
                self._details.append(kept := dict(detail))
                if key is not None:
                    self._at[key] = kept
                continue
            for name, value in detail.items():
                if name in _DETAIL_PIECES and isinstance(value, str) and isinstance(kept.get(name), str):
                    kept[name] += value
                elif value is not None:
                    kept[name] = value

    def text(self) -> str:
        """The details as JSON text, to be stored and sent back; "" when there are none."""
        if not self._details:
            return ""
        return unicode_text(json.dumps(self._details, ensure_ascii=False, separators=(",", ":")))


def details_chars(details: object) -> int:
    """How many characters of reasoning a message's (or a chunk's) ``reasoning_details`` carry."""
    details = details if isinstance(details, list) else []
    pieces = (detail.get(name) for detail in details if isinstance(detail, dict) for name in _DETAIL_PIECES)
    return sum(len(piece) for piece in pieces if isinstance(piece, str))


def carries_reasoning(message: dict[str, Any]) -> bool:
    """Whether a message (or a chunk's delta) carries reasoning apart from its answer: in
    ``reasoning_content`` (vLLM, llama.cpp, DeepSeek), ``reasoning`` (Ollama, newer vLLM),
    ``reasoning_details`` (OpenRouter) or, in content given as typed parts, "thinking" parts
    (Mistral). None of it is the answer."""
    content = message.get("content")
    parts = content if isinstance(content, list) else []
    thinking = any(isinstance(part, dict) and part.get("type") == "thinking" for part in parts)
    return thinking or any(message.get(name) for name in (*REASONING_FIELDS, "reasoning_details"))


def reasoning_chars(message: dict[str, Any]) -> int:
    """How many characters of reasoning apart from its answer a message (or a chunk's delta)
    carries, wherever carries_reasoning finds it. A server that sends both ``reasoning_content``
    and ``reasoning`` (an older name kept beside the newer), or OpenRouter's ``reasoning_details``
    beside its ``reasoning``, sends the same text twice: it counts once."""
    fields = (message.get(name) for name in REASONING_FIELDS)
    count = max((len(text) for text in fields if isinstance(text, str)), default=0)
    count = max(count, details_chars(message.get("reasoning_details")))  # OpenRouter's, beside its ``reasoning``
    content = message.get("content")
    for part in content if isinstance(content, list) else []:
        if isinstance(part, dict) and part.get("type") == "thinking":
            thinking = part.get("thinking")
            pieces = thinking if isinstance(thinking, list) else [{"text": thinking}]
            count += sum(len(piece["text"]) for piece in pieces if isinstance(piece, dict) and isinstance(piece.get("text"), str))
    return count


def content_text(content: object, *, model: str, what: str) -> str:
    """A message's content: its text, or, given as a list of typed parts (as Mistral's API sends
    its reasoning models' answers), the text of its "text" parts; the others ("thinking") are
    not the answer."""
    if isinstance(content, list):
        texts = (part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text")
        return "".join(text for text in texts if isinstance(text, str))
    return optional_str(content, model=model, what=what)


def optional_str(value: object, *, model: str, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ModelBadResponse(model, f"{what} is not text")
    return value
