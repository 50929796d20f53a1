"""The stored shape of a conversation: messages and tool calls.

A message is stored as one event whose content is the JSON this module writes. Tool-call
arguments are kept as the raw text the model produced (duplicate keys, key order and
whitespace included), carried as a JSON string so they come back byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import attrs

ROLES = ("system", "user", "assistant", "tool")
REASONING_CONTENT = "reasoning_content"  # the field a message's reasoning came in, unless it names others
# The stored form's encoder, made once: json.dumps with options makes a new one for every call,
# and every save encodes each message it appends.
_STORED_FORM = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


@attrs.frozen
class ToolCall:
    """One call the model made. ``extra`` is what its server attached to the call besides these,
    as JSON text ("" when nothing): it goes back to that server with the call, unread (Gemini's
    thought signature, without which Gemini 3 refuses the conversation)."""

    id: str
    name: str
    arguments: str = attrs.field(default="{}", validator=attrs.validators.instance_of(str))
    extra: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    def to_dict(self) -> dict[str, Any]:
        data = {"id": self.id, "name": self.name, "arguments": self.arguments}
        if self.extra:
            data["extra"] = self.extra
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        arguments, extra = str(data.get("arguments", "{}")), str(data.get("extra", ""))
        return cls(id=str(data["id"]), name=str(data["name"]), arguments=arguments, extra=extra)


def _tool_calls(calls: Iterable[ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(calls)


@attrs.frozen
class Message:
    """One message of a transcript.

    ``partial`` marks an assistant message the model was still streaming when the run was
    cancelled: what it had said so far, kept rather than lost. ``turn_id`` names the turn a
    user message opened (the runner uses the A2A task's id), so that a turn resumed after a
    crash finds where it began; it is stored, never sent to the model. ``reasoning`` is what
    the model server gave as its reasoning with an assistant message's tool calls, in the fields
    ``reasoning_as`` names (``reasoning_content``, ``reasoning``, or both, space-separated), and
    ``reasoning_details`` what it gave as OpenRouter's ``reasoning_details`` (a JSON array): they
    go back with the calls, as they came (DeepSeek's thinking mode and Kimi refuse a conversation
    whose tool calls come back without their ``reasoning_content``, and OpenRouter's Anthropic and
    Gemini 3 models one whose calls come back without their ``reasoning_details``).
    ``via`` names the model server whose answer a message is, when the server attached any of
    these (or ``extra_content`` to a call): they are its own, and go back to it alone, since
    another may refuse a field it does not know (a conversation moved to another server).
    """

    role: str = attrs.field(validator=attrs.validators.in_(ROLES))
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = attrs.field(default=(), converter=_tool_calls)
    tool_call_id: str = ""
    name: str = ""
    partial: bool = False
    turn_id: str = ""
    reasoning: str = ""
    reasoning_as: str = REASONING_CONTENT
    reasoning_details: str = ""
    via: str = ""

    def to_json(self) -> str:
        """The stored form: empty fields are left out, so the shape stays small and stable."""
        data: dict[str, Any] = {"role": self.role}
        if self.text:
            data["text"] = self.text
        if self.tool_calls:
            data["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        if self.tool_call_id:
            data["tool_call_id"] = self.tool_call_id
        if self.name:
            data["name"] = self.name
        if self.partial:
            data["partial"] = True
        if self.turn_id:
            data["turn_id"] = self.turn_id
        if self.reasoning:
            data["reasoning"] = self.reasoning
        if self.reasoning_as != REASONING_CONTENT:  # even with no reasoning: a message reads back equal
            data["reasoning_as"] = self.reasoning_as
        if self.reasoning_details:
            data["reasoning_details"] = self.reasoning_details
        if self.via:
            data["via"] = self.via
        return _STORED_FORM.encode(data)

    def stored_bytes(self) -> int:
        """The size of the stored form in bytes: what a store's ``max_event_bytes`` bounds."""
        return len(self.to_json().encode("utf-8", "surrogatepass"))

    def oversize(self, max_bytes: int) -> int | None:
        """The stored size when it is over ``max_bytes``, else None. Cheap for a message far under
        it: as JSON in UTF-8 a character takes at most 6 bytes (an escape such as ``\\u001f``)."""
        chars = len(self.text) + len(self.tool_call_id) + len(self.name) + len(self.turn_id)
        chars += len(self.reasoning) + len(self.reasoning_as) + len(self.reasoning_details) + len(self.via)
        chars += sum(len(call.id) + len(call.name) + len(call.arguments) + len(call.extra) + 24 for call in self.tool_calls)
        if chars * 6 + 200 <= max_bytes:
            return None
        size = self.stored_bytes()
        return size if size > max_bytes else None

    def cut_to_fit(self, max_bytes: int, note: str = "") -> Message:
        """This message with its text cut short, and ``note`` after what is kept, so that its
        stored form fits ``max_bytes``; the message itself if it fits already. ValueError if it
        cannot fit even with no text (tool calls too large, or the note)."""
        if self.oversize(max_bytes) is None:
            return self

        def fits(length: int) -> bool:
            return attrs.evolve(self, text=self.text[:length] + note).stored_bytes() <= max_bytes

        if not fits(0):
            raise ValueError(f"this {self.role} message ({self.stored_bytes()} bytes) cannot be cut to fit {max_bytes}")
        low, high = 0, len(self.text)  # the longest text that fits is at least low and less than high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return attrs.evolve(self, text=self.text[:low] + note)

    @classmethod
    def from_json(cls, text: str) -> Message:
        """Raises ValueError (json.JSONDecodeError, KeyError wrapped) when text is not a message."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("not a message: JSON nested deeper than can be read") from None
        if not isinstance(data, dict) or "role" not in data:
            raise ValueError("not a message: an object with a 'role' was expected")
        try:
            return cls(
                role=data["role"],
                text=data.get("text", ""),
                tool_calls=tuple(ToolCall.from_dict(call) for call in data.get("tool_calls", ())),
                tool_call_id=data.get("tool_call_id", ""),
                name=data.get("name", ""),
                partial=bool(data.get("partial", False)),
                turn_id=data.get("turn_id", ""),
                reasoning=data.get("reasoning", ""),
                reasoning_as=data.get("reasoning_as", REASONING_CONTENT),
                reasoning_details=data.get("reasoning_details", ""),
                via=data.get("via", ""),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a message: {exc}") from exc
