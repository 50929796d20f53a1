from __future__ import annotations

import pytest

import protocol.errors as errors_module
from protocol import (
    ERROR_CODES,
    ContentTypeNotSupported,
    ContextMismatch,
    ExtendedAgentCardNotConfigured,
    InternalError,
    InvalidParams,
    InvalidRequest,
    InvalidTransition,
    MethodNotFound,
    ParseError,
    ProtocolError,
    ProtocolVersion,
    PushNotificationNotSupported,
    TaskIsTerminal,
    TaskNotCancelable,
    TaskNotFound,
    UnsupportedOperation,
    VersionNotSupported,
    error_code,
    error_object,
    error_response,
)

V1, V03 = ProtocolVersion.V1_0, ProtocolVersion.V0_3

# error instance, JSON-RPC code, HTTP status (spec 1.0.1 §5.4), 1.0 ErrorInfo reason
TABLE = [
    (ParseError("Expecting value: line 1 column 1 (char 0)"), -32700, 400, None),
    (InvalidRequest("'jsonrpc' must be exactly \"2.0\""), -32600, 400, "INVALID_REQUEST"),
    (MethodNotFound("NoSuchMethod"), -32601, 404, None),
    (InvalidParams("id", "a non-empty string", got=5), -32602, 400, "INVALID_PARAMS"),
    (ContextMismatch("other", "t-1", "ctx-1"), -32602, 400, "INVALID_PARAMS"),
    (InternalError(), -32603, 500, "INTERNAL_ERROR"),
    (TaskNotFound("abc"), -32001, 404, "TASK_NOT_FOUND"),
    (TaskNotCancelable("abc", "completed"), -32002, 400, "TASK_NOT_CANCELABLE"),
    (PushNotificationNotSupported(), -32003, 400, "PUSH_NOTIFICATION_NOT_SUPPORTED"),
    (UnsupportedOperation("no extended card"), -32004, 400, "UNSUPPORTED_OPERATION"),
    (TaskIsTerminal("abc", "canceled", "be subscribed to"), -32004, 400, "UNSUPPORTED_OPERATION"),
    (InvalidTransition("abc", "completed", "working", terminal=True), -32004, 400, "UNSUPPORTED_OPERATION"),
    (ContentTypeNotSupported("image/png", ["text/plain"]), -32005, 400, "CONTENT_TYPE_NOT_SUPPORTED"),
    (ExtendedAgentCardNotConfigured(), -32007, 400, "EXTENDED_AGENT_CARD_NOT_CONFIGURED"),
    (VersionNotSupported("2.0"), -32009, 400, "VERSION_NOT_SUPPORTED"),
]


@pytest.mark.parametrize(("error", "code", "status", "reason"), TABLE, ids=lambda v: type(v).__name__)
def test_error_table_gives_code_status_and_reason(error: ProtocolError, code: int, status: int, reason: str) -> None:
    found = error_code(error)
    assert (found.code, found.http_status, found.reason) == (code, status, reason)


def test_error_table_has_a_row_for_every_direct_protocol_error() -> None:
    classes = [v for v in vars(errors_module).values() if isinstance(v, type) and issubclass(v, ProtocolError)]
    direct = {cls for cls in classes if ProtocolError in cls.__bases__}
    assert direct == set(ERROR_CODES)
    assert len({row.code for row in ERROR_CODES.values()}) == len(ERROR_CODES)


def test_error_without_a_row_is_a_type_error_naming_the_fix() -> None:
    class Stray(ProtocolError):
        pass

    with pytest.raises(TypeError, match="Stray has no row in ERROR_CODES"):
        error_code(Stray("x"))


def test_error_messages_name_the_thing_they_are_about() -> None:
    assert str(TaskNotFound("abc")) == "task 'abc' not found"
    assert str(TaskNotCancelable("abc", "completed")) == "task 'abc' cannot be canceled: it is already completed"
    assert str(MethodNotFound("tasks/list")) == "method 'tasks/list' not found"
    assert str(TaskIsTerminal("abc", "completed", "accept messages")) == (
        "task 'abc' has ended (completed) and cannot accept messages"
    )
    assert str(ContentTypeNotSupported("image/png", ["text/plain"])) == (
        "content type 'image/png' is not supported; this agent accepts 'text/plain'"
    )
    assert "context 'other' does not match context 'ctx-1' of task 't-1'" in str(
        ContextMismatch("other", "t-1", "ctx-1")
    )


def test_error_version_messages_say_how_to_fix_the_header() -> None:
    assert "send 'A2A-Version: 1.0'" in str(VersionNotSupported("2.0"))
    mismatch = VersionNotSupported("0.3", method="GetTask", expected="1.0")
    assert str(mismatch) == "method 'GetTask' belongs to A2A version '1.0', not '0.3'; send 'A2A-Version: 1.0'"
    legacy = VersionNotSupported("1.0", method="tasks/get", expected="0.3")
    assert str(legacy).endswith("omit the A2A-Version header")


def test_invalid_params_describes_what_was_sent_without_dumping_it() -> None:
    assert str(InvalidParams("historyLength", "an integer", got="abc")) == (
        "invalid params: 'historyLength' must be an integer, got string 'abc'"
    )
    long = InvalidParams("id", "a non-empty string", got=["x"] * 1000)
    assert str(long).endswith("got an array of 1000 items")
    huge = InvalidParams("text", "an integer", got="y" * 10_000)
    assert len(str(huge)) < 150
    keys = InvalidParams("parts[0]", "a part", got={f"k{i}": i for i in range(9)})
    assert str(keys).endswith("got an object with keys 'k0', 'k1', 'k2', 'k3', 'k4', ...")


def test_internal_error_message_carries_no_detail() -> None:
    message = error_object(InternalError("GetTask"), V1)["message"]
    assert message == "internal error while handling GetTask; the server log has the details"
    assert "Traceback" not in message


def test_error_object_1_0_carries_error_info() -> None:
    assert error_object(TaskNotFound("abc"), V1) == {
        "code": -32001,
        "message": "task 'abc' not found",
        "data": [
            {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "TASK_NOT_FOUND",
                "domain": "a2a-protocol.org",
                "metadata": {},
            }
        ],
    }


def test_error_object_1_0_invalid_params_adds_bad_request_field_violations() -> None:
    data = error_object(InvalidParams("message.role", "'ROLE_USER' or 'ROLE_AGENT'", got="x"), V1)["data"]
    description = "must be 'ROLE_USER' or 'ROLE_AGENT', got string 'x'"
    assert data[0]["metadata"] == {"errors": [{"field": "message.role", "message": description}]}
    assert data[1] == {
        "@type": "type.googleapis.com/google.rpc.BadRequest",
        "fieldViolations": [{"field": "message.role", "description": description}],
    }


def test_error_object_0_3_has_null_data() -> None:
    assert error_object(TaskNotCancelable("abc", "canceled"), V03) == {
        "code": -32002,
        "message": "task 'abc' cannot be canceled: it is already canceled",
        "data": None,
    }


@pytest.mark.parametrize("version", list(ProtocolVersion))
def test_error_object_for_parse_and_method_errors_has_no_data(version: ProtocolVersion) -> None:
    assert "data" not in error_object(ParseError("x"), version)
    assert "data" not in error_object(MethodNotFound("x"), version)


def test_error_response_wraps_the_error_with_the_request_id() -> None:
    response = error_response(7, TaskNotFound("abc"), V03)
    assert response == {"jsonrpc": "2.0", "id": 7, "error": error_object(TaskNotFound("abc"), V03)}
