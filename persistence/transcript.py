"""The stored shape of a conversation: messages and tool calls.

A message is stored as one event whose content is the JSON this module writes. Tool-call
arguments are kept as the raw text the model produced (duplicate keys, key order and
whitespace included), carried as a JSON string so they come back byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

ROLES = ("system", "user", "assistant", "tool")


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str = attrs.field(default="{}", validator=attrs.validators.instance_of(str))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        return cls(id=str(data["id"]), name=str(data["name"]), arguments=str(data.get("arguments", "{}")))


@attrs.frozen
class Message:
    """One message of a transcript.

    ``partial`` marks an assistant message the model was still streaming when the run was
    cancelled: what it had said so far, kept rather than lost. ``turn_id`` names the turn a
    user message opened (the runner uses the A2A task's id), so that a turn resumed after a
    crash finds where it began; it is stored, never sent to the model.
    """

    role: str = attrs.field(validator=attrs.validators.in_(ROLES))
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = attrs.field(default=(), converter=tuple)
    tool_call_id: str = ""
    name: str = ""
    partial: bool = False
    turn_id: str = ""

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
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Message:
        """Raises ValueError (json.JSONDecodeError, KeyError wrapped) when text is not a message."""
        data = json.loads(text)
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
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a message: {exc}") from exc
