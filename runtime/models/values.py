"""The values a model request is made of and the pieces an answer arrives in.

A streamed answer is a sequence of deltas: ``TextDelta`` and ``ToolCallDelta`` as they arrive,
then, when the model finishes, one assembled ``ToolCall`` (the transcript's type) per call in
index order followed by ``Finish``; ``Usage`` comes whenever the server reports it (usually last).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, TypeAlias

import attrs

from persistence.transcript import Message, ToolCall

# The function-name rule of the OpenAI API, which the compatible servers share.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _check_tool_name(_instance: object, _attribute: object, name: str) -> None:
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ValueError(f"tool name {name!r} must be 1 to 64 letters, digits, '_' or '-'")


def _empty_object_schema() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@attrs.frozen
class ToolSpec:
    """A tool the model may call: its name, what it does, and a JSON schema for its arguments."""

    name: str = attrs.field(validator=_check_tool_name)
    description: str = attrs.field(validator=attrs.validators.instance_of(str))
    parameters: dict[str, Any] = attrs.field(
        factory=_empty_object_schema, validator=attrs.validators.instance_of(dict)
    )


def _messages(messages: Iterable[Message]) -> tuple[Message, ...]:
    return tuple(messages)


def _tools(tools: Iterable[ToolSpec]) -> tuple[ToolSpec, ...]:
    return tuple(tools)


@attrs.frozen
class ChatRequest:
    """One request for the model's next message, given the transcript so far and the tools on offer."""

    messages: tuple[Message, ...] = attrs.field(converter=_messages)
    tools: tuple[ToolSpec, ...] = attrs.field(default=(), converter=_tools)
    temperature: float | None = None
    max_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0))
    )

    @messages.validator
    def _check_messages(self, _attribute: object, messages: tuple[Message, ...]) -> None:
        if not messages:
            raise ValueError("a chat request needs at least one message")
        for index, message in enumerate(messages):
            if not isinstance(message, Message):
                raise TypeError(f"message {index} is a {type(message).__name__}, not a persistence.transcript.Message")


@attrs.frozen
class TextDelta:
    """A piece of the answer's text, in the order it arrived."""

    text: str


@attrs.frozen
class ToolCallDelta:
    """A piece of tool call ``index``: ``id`` and ``name`` usually arrive once, ``arguments`` in fragments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@attrs.frozen
class Finish:
    """The model has finished: ``reason`` is the server's ``finish_reason`` ("stop", "tool_calls", "length", ...)."""

    reason: str


Delta: TypeAlias = TextDelta | ToolCallDelta | ToolCall | Usage | Finish


@attrs.frozen
class Completion:
    """A whole answer: the assistant message, why it ended, and the tokens it cost when the server said."""

    message: Message
    finish_reason: str
    usage: Usage | None = None
