from __future__ import annotations

import itertools

import pytest

from protocol import (
    TRANSITIONS,
    InvalidTransition,
    ProtocolVersion,
    TaskState,
    UnsupportedOperation,
    can_transition,
    check_transition,
    error_code,
    is_interrupted,
    is_terminal,
)
from protocol.errors import InvalidParams

S = TaskState
TERMINAL = {S.COMPLETED, S.FAILED, S.CANCELED, S.REJECTED}
INTERRUPTED = {S.INPUT_REQUIRED, S.AUTH_REQUIRED}

LEGAL = [
    (S.SUBMITTED, S.WORKING),
    (S.SUBMITTED, S.COMPLETED),
    (S.SUBMITTED, S.CANCELED),
    (S.SUBMITTED, S.REJECTED),
    (S.SUBMITTED, S.INPUT_REQUIRED),
    (S.WORKING, S.WORKING),
    (S.WORKING, S.INPUT_REQUIRED),
    (S.WORKING, S.AUTH_REQUIRED),
    (S.WORKING, S.COMPLETED),
    (S.WORKING, S.FAILED),
    (S.WORKING, S.CANCELED),
    (S.INPUT_REQUIRED, S.WORKING),
    (S.INPUT_REQUIRED, S.CANCELED),
    (S.AUTH_REQUIRED, S.WORKING),
    (S.AUTH_REQUIRED, S.FAILED),
    (S.UNSPECIFIED, S.FAILED),
]
ILLEGAL = [
    (S.SUBMITTED, S.SUBMITTED),
    (S.WORKING, S.SUBMITTED),
    (S.INPUT_REQUIRED, S.COMPLETED),
    (S.INPUT_REQUIRED, S.INPUT_REQUIRED),
    (S.AUTH_REQUIRED, S.SUBMITTED),
    (S.WORKING, S.UNSPECIFIED),
    (S.UNSPECIFIED, S.WORKING),
]


def test_state_terminal_states_are_completed_failed_canceled_rejected() -> None:
    assert {state for state in S if is_terminal(state)} == TERMINAL


def test_state_interrupted_states_are_input_and_auth_required() -> None:
    assert {state for state in S if is_interrupted(state)} == INTERRUPTED


def test_state_stream_ends_on_terminal_and_interrupted_states() -> None:
    assert {state for state in S if state.ends_stream} == TERMINAL | INTERRUPTED


@pytest.mark.parametrize(("current", "target"), LEGAL)
def test_transition_legal_moves_pass(current: TaskState, target: TaskState) -> None:
    assert can_transition(current, target)
    check_transition("t-1", current, target)


@pytest.mark.parametrize(("current", "target"), ILLEGAL)
def test_transition_illegal_moves_raise_invalid_transition(current: TaskState, target: TaskState) -> None:
    assert not can_transition(current, target)
    with pytest.raises(InvalidTransition) as caught:
        check_transition("t-1", current, target)
    assert caught.value.message == f"task 't-1' cannot move from state {current.value!r} to {target.value!r}"


@pytest.mark.parametrize(("current", "target"), list(itertools.product(sorted(TERMINAL, key=str), S)))
def test_transition_out_of_a_terminal_state_is_refused(current: TaskState, target: TaskState) -> None:
    with pytest.raises(InvalidTransition, match=f"{current.value!r} is a terminal state"):
        check_transition("abc", current, target)


def test_transition_error_is_an_unsupported_operation_on_the_wire() -> None:
    with pytest.raises(UnsupportedOperation) as caught:
        check_transition("abc", S.COMPLETED, S.WORKING)
    assert error_code(caught.value).code == -32004


def test_transition_table_covers_every_state_and_never_enters_unspecified() -> None:
    assert set(TRANSITIONS) == set(S)
    assert all(S.UNSPECIFIED not in targets and S.SUBMITTED not in targets for targets in TRANSITIONS.values())


def test_state_wire_names_are_protojson_in_1_0_and_strings_in_0_3() -> None:
    assert S.INPUT_REQUIRED.wire_name(ProtocolVersion.V1_0) == "TASK_STATE_INPUT_REQUIRED"
    assert S.INPUT_REQUIRED.wire_name(ProtocolVersion.V0_3) == "input-required"
    assert S.UNSPECIFIED.wire_name(ProtocolVersion.V1_0) == "TASK_STATE_UNSPECIFIED"
    assert S.UNSPECIFIED.wire_name(ProtocolVersion.V0_3) == "unknown"


@pytest.mark.parametrize("version", list(ProtocolVersion))
def test_state_wire_names_decode_back(version: ProtocolVersion) -> None:
    for state in S:
        assert S.from_wire(state.wire_name(version), version, field="status.state") is state


def test_state_from_the_other_version_is_invalid_params_naming_the_field() -> None:
    with pytest.raises(
        InvalidParams, match=r"'status\.state' must be one of 'TASK_STATE_SUBMITTED'.*got string 'working'"
    ):
        S.from_wire("working", ProtocolVersion.V1_0, field="status.state")
