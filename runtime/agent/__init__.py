"""The agent loop: steps, steers, saves and tool calls. It knows no HTTP server."""

from runtime.agent.errors import (
    AgentError, AnswerEmpty, AnswerFailed, AnswerFiltered, AnswerTooLarge, AnswerTruncated, BudgetExhausted, MaxStepsReached,
    RunFinished, SaveFailed,
)
from runtime.agent.events import AgentEvent, StepStarted, SteerApplied, TextDelta, ToolCalled, ToolResult, UsageReported
from runtime.agent.loop import AgentRun, AgentSpec, Model, Result, SteerGate
from runtime.agent.steers import NEXT_LABEL, STEER_LABEL
from runtime.agent.tools import Tool

__all__ = [
    "NEXT_LABEL",
    "STEER_LABEL",
    "AgentError",
    "AgentEvent",
    "AgentRun",
    "AgentSpec",
    "AnswerEmpty",
    "AnswerFailed",
    "AnswerFiltered",
    "AnswerTooLarge",
    "AnswerTruncated",
    "BudgetExhausted",
    "MaxStepsReached",
    "Model",
    "Result",
    "RunFinished",
    "SaveFailed",
    "StepStarted",
    "SteerApplied",
    "SteerGate",
    "TextDelta",
    "Tool",
    "ToolCalled",
    "ToolResult",
    "UsageReported",
]
