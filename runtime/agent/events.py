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
    """A piece of the answer's text, as the model streams it (the whole answer is in the Result)."""

    text: str


@attrs.frozen
class ToolCalled:
    """The model called a tool; the call is about to be checked and run."""

    call: ToolCall


@attrs.frozen
class ToolResult:
    """What goes back to the model for a call: the tool's text, or an error (``is_error``) saying
    what was wrong with the call or how the tool failed."""

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
    """The tokens one model request took, as its server reported them (the turn's sum is in the Result)."""

    usage: Usage


AgentEvent: TypeAlias = StepStarted | TextDelta | ToolCalled | ToolResult | SteerApplied | UsageReported
