"""What a run tells whoever listens, as it goes. Each is a frozen value."""

from __future__ import annotations

from typing import TypeAlias

import attrs

from persistence.transcript import ToolCall
from runtime.models import Usage


@attrs.frozen
class StepStarted:
    """Model request number ``step`` (1-based) of this run is about to be made."""

    step: int


@attrs.frozen
class TextDelta:
    text: str


@attrs.frozen
class ToolCalled:
    call: ToolCall


@attrs.frozen
class ToolResult:
    call_id: str
    name: str
    text: str
    is_error: bool


@attrs.frozen
class SteerApplied:
    """A steer was placed in the transcript at ``position``, to ride the next request."""

    text: str
    position: int


@attrs.frozen
class UsageReported:
    usage: Usage


AgentEvent: TypeAlias = StepStarted | TextDelta | ToolCalled | ToolResult | SteerApplied | UsageReported
