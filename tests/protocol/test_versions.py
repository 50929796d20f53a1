"""The A2A-Version header rule and method routing (spec 1.0 §3.6, wire/err_* captures)."""

from __future__ import annotations

import pytest

from protocol import (
    METHODS,
    MethodNotFound,
    Operation,
    ProtocolVersion,
    Route,
    VersionNotSupported,
    parse_version_header,
    requested_version,
    response_version,
    route,
)

V1, V03 = ProtocolVersion.V1_0, ProtocolVersion.V0_3


@pytest.mark.parametrize(
    ("header", "version"),
    [(None, V03), ("", V03), ("  ", V03), ("0.3", V03), ("0.3.0", V03), ("1.0", V1), ("1.0.1", V1), (" 1.0 ", V1)],
)
def test_version_header_selects_the_version(header: str | None, version: ProtocolVersion) -> None:
    assert parse_version_header(header) is version


@pytest.mark.parametrize(
    ("header", "requested"), [("2.0", "2.0"), ("1.1", "1.1"), ("1", "1"), ("v1.0", "v1.0"), ("01.00", "1.0")]
)
def test_version_header_requested_is_major_minor(header: str, requested: str) -> None:
    assert requested_version(header) == requested


@pytest.mark.parametrize("header", ["2.0", "1.1", "0.2", "1", "latest", "\u0661.\u0660"])
def test_version_header_unsupported_raises_version_not_supported(header: str) -> None:
    with pytest.raises(VersionNotSupported) as caught:
        parse_version_header(header)
    assert caught.value.requested == header
    assert f"A2A version {header!r} is not supported" in caught.value.message


def test_version_header_of_more_digits_than_any_version_has_is_not_supported_and_shown_cut() -> None:
    with pytest.raises(VersionNotSupported) as caught:
        parse_version_header("1" * 5000 + ".0")
    assert "is not supported; send 'A2A-Version: 1.0', or no header for 0.3" in caught.value.message
    assert len(caught.value.message) < 300


def test_route_1_0_method_with_1_0_header() -> None:
    assert route("SendMessage", "1.0") == Route("SendMessage", V1, Operation.SEND_MESSAGE)
    assert route("ListTasks", "1.0.1").operation is Operation.LIST_TASKS


def test_route_0_3_method_without_header() -> None:
    assert route("message/stream", None) == Route("message/stream", V03, Operation.SEND_STREAMING_MESSAGE)
    assert route("tasks/resubscribe", "").operation is Operation.SUBSCRIBE_TO_TASK


def test_route_1_0_method_without_header_is_version_not_supported() -> None:
    """wire/err_v1_method_without_version_header: GetTask with no header gets -32009."""
    with pytest.raises(VersionNotSupported) as caught:
        route("GetTask", None)
    assert caught.value.requested == "0.3"
    assert response_version("GetTask", None) is V1


def test_route_unsupported_header_is_version_not_supported_even_for_known_methods() -> None:
    """wire/err_version_2: GetTask with A2A-Version 2.0 gets -32009 in 1.0 form."""
    with pytest.raises(VersionNotSupported):
        route("GetTask", "2.0")
    with pytest.raises(VersionNotSupported):
        route("NoSuchMethod", "2.0")
    assert response_version(None, "2.0") is V1


def test_route_0_3_method_with_1_0_header_is_version_not_supported() -> None:
    with pytest.raises(VersionNotSupported, match="omit the A2A-Version header"):
        route("message/send", "1.0")


def test_route_unknown_method_is_method_not_found() -> None:
    with pytest.raises(MethodNotFound, match="method 'NoSuchMethod' not found"):
        route("NoSuchMethod", "1.0")


def test_route_0_3_has_no_tasks_list() -> None:
    """wire/v03_tasks_list: tasks/list is -32601 in 0.3."""
    with pytest.raises(MethodNotFound) as caught:
        route("tasks/list", None)
    assert str(caught.value) == (
        "method 'tasks/list' not found; A2A 0.3 has message/send, message/stream, tasks/get, tasks/cancel,"
        " tasks/resubscribe, tasks/pushNotificationConfig/set, tasks/pushNotificationConfig/get,"
        " tasks/pushNotificationConfig/list, tasks/pushNotificationConfig/delete and"
        " agent/getAuthenticatedExtendedCard (listing tasks is A2A 1.0's ListTasks)"
    )


def test_a_misspelt_method_is_not_found_and_the_one_meant_is_named() -> None:
    with pytest.raises(MethodNotFound) as caught:
        route("SendMesage", "1.0")
    assert str(caught.value) == "method 'SendMesage' not found; did you mean 'SendMessage'?"


def test_methods_tables_cover_every_operation_once_per_version() -> None:
    assert sorted(METHODS[V1].values(), key=str) == sorted(Operation, key=str)
    assert set(METHODS[V03].values()) == set(Operation) - {Operation.LIST_TASKS}
    assert len(set(METHODS[V03].values())) == len(METHODS[V03])


def test_operations_that_stream_are_the_streaming_send_and_subscribe() -> None:
    assert {op for op in Operation if op.streams} == {Operation.SEND_STREAMING_MESSAGE, Operation.SUBSCRIBE_TO_TASK}
    assert sum(op.is_push_config for op in Operation) == 4


def test_response_version_follows_the_header_for_unknown_methods() -> None:
    assert response_version("NoSuchMethod", None) is V03
    assert response_version("NoSuchMethod", "1.0") is V1
    assert response_version("message/send", "1.0") is V03
