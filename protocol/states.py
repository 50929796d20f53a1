"""The task state machine: every state, its wire names, and which moves are legal.

This is the only place that knows which states are terminal or interrupted; the runner, the
stores and the stream code ask it rather than keeping their own lists.

    SUBMITTED ──> WORKING ──> COMPLETED | FAILED | CANCELED | REJECTED   (terminal)
        │            │ ▲
        │            ▼ │
        └──────> INPUT_REQUIRED | AUTH_REQUIRED                          (interrupted)

WORKING may repeat (a new progress message). An interrupted task goes back to WORKING when
the client answers, or ends CANCELED or FAILED. A terminal task never changes again.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from protocol.errors import InvalidParams, InvalidTransition
from protocol.versions import ProtocolVersion


class TaskState(enum.Enum):
    """A task's lifecycle state. The value is the 0.3 wire string."""

    SUBMITTED = "submitted"
    WORKING = "working"
    INPUT_REQUIRED = "input-required"
    AUTH_REQUIRED = "auth-required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    REJECTED = "rejected"
    UNSPECIFIED = "unknown"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def is_interrupted(self) -> bool:
        """The task waits for the client (spec 1.0 §4.1.3 "This is an interrupted state")."""
        return self in _INTERRUPTED

    @property
    def ends_stream(self) -> bool:
        """A stream about this task closes after announcing this state (spec 1.0 §3.1.2)."""
        return self.is_terminal or self.is_interrupted

    def wire_name(self, version: ProtocolVersion) -> str:
        """``TASK_STATE_WORKING`` in 1.0 (ProtoJSON enum name), ``working`` in 0.3."""
        if version is ProtocolVersion.V1_0:
            return f"TASK_STATE_{self.name}"
        return self.value

    @classmethod
    def from_wire(cls, name: object, version: ProtocolVersion, *, field: str) -> TaskState:
        """The state a wire name (or in 1.0, as ProtoJSON allows, its enum number) stands
        for; raises InvalidParams naming ``field`` otherwise."""
        if version is ProtocolVersion.V1_0 and type(name) is int and name in _NUMBERED:
            return _NUMBERED[name]
        for state in cls:
            if state.wire_name(version) == name:
                return state
        choices = ", ".join(repr(state.wire_name(version)) for state in cls)
        raise InvalidParams(field, f"one of {choices}", got=name)


# The numbers of ``enum TaskState`` in a2a.proto (1.0).
_NUMBERED = dict(enumerate((
    TaskState.UNSPECIFIED, TaskState.SUBMITTED, TaskState.WORKING, TaskState.COMPLETED, TaskState.FAILED,
    TaskState.CANCELED, TaskState.INPUT_REQUIRED, TaskState.REJECTED, TaskState.AUTH_REQUIRED,
)))  # fmt: skip
_TERMINAL = frozenset({TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELED, TaskState.REJECTED})
_INTERRUPTED = frozenset({TaskState.INPUT_REQUIRED, TaskState.AUTH_REQUIRED})
_RUNNING_TARGETS = frozenset({TaskState.WORKING} | _INTERRUPTED | _TERMINAL)

TRANSITIONS: Mapping[TaskState, frozenset[TaskState]] = {
    TaskState.SUBMITTED: _RUNNING_TARGETS,
    TaskState.WORKING: _RUNNING_TARGETS,
    TaskState.INPUT_REQUIRED: frozenset({TaskState.WORKING, TaskState.CANCELED, TaskState.FAILED}),
    TaskState.AUTH_REQUIRED: frozenset({TaskState.WORKING, TaskState.CANCELED, TaskState.FAILED}),
    # Nothing moves into UNSPECIFIED; a task decoded in it can only be settled.
    TaskState.UNSPECIFIED: frozenset({TaskState.CANCELED, TaskState.FAILED}),
    **{state: frozenset() for state in _TERMINAL},
}


def is_terminal(state: TaskState) -> bool:
    return state.is_terminal


def is_interrupted(state: TaskState) -> bool:
    return state.is_interrupted


def can_transition(current: TaskState, target: TaskState) -> bool:
    return target in TRANSITIONS[current]


def check_transition(task_id: str, current: TaskState, target: TaskState) -> None:
    """Return if ``current -> target`` is legal for a task; raise InvalidTransition if not."""
    if not can_transition(current, target):
        raise InvalidTransition(task_id, current.value, target.value, terminal=current.is_terminal)
