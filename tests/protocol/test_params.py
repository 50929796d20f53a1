"""Request params: what each method's params decode to, and how bad ones are reported."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from protocol import (
    InvalidParams,
    ListTasksParams,
    ListTasksResult,
    Message,
    ProtocolVersion,
    Role,
    SendConfiguration,
    SendMessageParams,
    TaskIdParams,
    TaskQueryParams,
    TaskState,
    TextPart,
)

V1, V03 = ProtocolVersion.V1_0, ProtocolVersion.V0_3


def complaint(cls: Any, params: Any, version: ProtocolVersion = V1) -> str:
    with pytest.raises(InvalidParams) as caught:
        cls.from_json(params, version)
    return caught.value.message


def test_send_params_default_to_blocking() -> None:
    params = {"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "hi"}]}}
    decoded = SendMessageParams.from_json(params, V1)
    assert decoded.configuration == SendConfiguration()
    assert decoded.message == Message(message_id="m", role=Role.USER, parts=[TextPart("hi")])
    assert decoded.to_json(V1) == params


def test_1_0_params_are_read_under_their_proto_names_too_as_protojson_parsers_do() -> None:
    camel = {
        "message": {
            "messageId": "m", "role": "ROLE_USER", "parts": [{"raw": "aGk=", "mediaType": "text/plain"}],
            "taskId": "t", "contextId": "c", "referenceTaskIds": ["r"],
        },
        "configuration": {"returnImmediately": True, "historyLength": 2, "acceptedOutputModes": ["text/plain"]},
    }
    proto = {
        "message": {
            "message_id": "m", "role": "ROLE_USER", "parts": [{"raw": "aGk=", "media_type": "text/plain"}],
            "task_id": "t", "context_id": "c", "reference_task_ids": ["r"],
        },
        "configuration": {"return_immediately": True, "history_length": 2, "accepted_output_modes": ["text/plain"]},
    }
    assert SendMessageParams.from_json(proto, V1) == SendMessageParams.from_json(camel, V1)
    assert TaskQueryParams.from_json({"id": "t", "history_length": 0}, V1).history_length == 0
    listed = {"context_id": "c", "page_size": 1, "page_token": "p", "status_timestamp_after": "2026-11-29T22:00:00Z", "include_artifacts": True}
    assert ListTasksParams.from_json(listed, V1) == ListTasksParams.from_json(
        {"contextId": "c", "pageSize": 1, "pageToken": "p", "statusTimestampAfter": "2026-11-29T22:00:00Z", "includeArtifacts": True}, V1
    )


def test_a_1_0_field_given_under_both_its_names_with_two_values_is_refused() -> None:
    same = {"id": "t", "historyLength": 1, "history_length": 1}
    assert TaskQueryParams.from_json(same, V1).history_length == 1
    assert complaint(TaskQueryParams, {"id": "t", "historyLength": 1, "history_length": 2}) == (
        "invalid params: 'historyLength' is given twice, as 'historyLength' and as 'history_length' (its proto name),"
        " with two values; send one"
    )


def test_0_3_params_are_read_under_their_json_names_only() -> None:
    message = {"messageId": "m", "role": "user", "parts": [{"kind": "text", "text": "x"}], "task_id": "t"}
    assert SendMessageParams.from_json({"message": message}, V03).message.task_id is None
    assert "'message.messageId' must be a non-empty string" in complaint(
        SendMessageParams, {"message": {"message_id": "m", "role": "user", "parts": [{"kind": "text", "text": "x"}]}}, V03
    )


def test_send_params_return_immediately_is_1_0_for_0_3_blocking_false() -> None:
    v1 = SendMessageParams.from_json(
        {
            "message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]},
            "configuration": {"returnImmediately": True},
        },
        V1,
    )
    v03 = SendMessageParams.from_json(
        {
            "message": {"messageId": "m", "role": "user", "parts": [{"kind": "text", "text": "x"}]},
            "configuration": {"blocking": False},
        },
        V03,
    )
    assert v1.configuration.return_immediately and v03.configuration.return_immediately
    assert v1.to_json(V03)["configuration"] == {"blocking": False}
    assert v03.to_json(V1)["configuration"] == {"returnImmediately": True}


@pytest.mark.parametrize(
    ("version", "role", "configuration", "words"),
    [
        (V1, "ROLE_USER", {"blocking": False}, (
            "invalid params: 'configuration.blocking' is the A2A 0.3 spelling, which an A2A 1.0 request does not read;"
            ' in 1.0, send "returnImmediately": true to be answered at once (an A2A 0.3 client sends its requests'
            " without an A2A-Version header)"
        )),
        (V03, "user", {"returnImmediately": True}, (
            "invalid params: 'configuration.returnImmediately' is the A2A 1.0 spelling, which an A2A 0.3 request does"
            ' not read; in 0.3, send "blocking": false to be answered at once (an A2A 1.0 client sends its requests'
            " with the header A2A-Version: 1.0)"
        )),
    ],
    ids=["blocking-in-1.0", "returnImmediately-in-0.3"],
)
def test_send_params_refuse_the_other_versions_way_to_be_answered_at_once(
    version: ProtocolVersion, role: str, configuration: dict[str, Any], words: str
) -> None:
    # Read as the default, it would block a client that asked to be answered at once.
    part = {"text": "x"} if version is V1 else {"kind": "text", "text": "x"}
    params = {"message": {"messageId": "m", "role": role, "parts": [part]}, "configuration": configuration}
    assert complaint(SendMessageParams, params, version) == words


def test_send_params_take_the_other_versions_spelling_of_the_default_as_the_default() -> None:
    # "blocking": true in 1.0 asks for what happens anyway: nothing to refuse.
    v1 = {"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]}, "configuration": {"blocking": True}}
    v03 = {
        "message": {"messageId": "m", "role": "user", "parts": [{"kind": "text", "text": "x"}]},
        "configuration": {"returnImmediately": False},
    }
    assert not SendMessageParams.from_json(v1, V1).configuration.return_immediately
    assert not SendMessageParams.from_json(v03, V03).configuration.return_immediately


def test_send_params_keep_history_length_output_modes_and_push_config() -> None:
    configuration = {
        "acceptedOutputModes": ["text/plain"],
        "historyLength": 2,
        "taskPushNotificationConfig": {"url": "https://hook"},
    }
    params = {
        "message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]},
        "configuration": configuration,
    }
    decoded = SendMessageParams.from_json(params, V1).configuration
    assert decoded == SendConfiguration(
        accepted_output_modes=["text/plain"], history_length=2, push_notification_config={"url": "https://hook"}
    )


def test_send_params_without_message_name_the_field() -> None:
    assert (
        complaint(SendMessageParams, {})
        == "invalid params: 'message' must be an object, got nothing (the field is missing)"
    )


def test_send_params_negative_history_length_names_the_field() -> None:
    message = {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]}
    assert complaint(SendMessageParams, {"message": message, "configuration": {"historyLength": -1}}) == (
        "invalid params: 'configuration.historyLength' must be a non-negative integer, got integer -1"
    )


def test_task_query_params_keep_history_length_presence() -> None:
    assert TaskQueryParams.from_json({"id": "t"}, V1).history_length is None
    assert TaskQueryParams.from_json({"id": "t", "historyLength": 0}, V1).history_length == 0
    assert TaskQueryParams.from_json({"id": "t", "historyLength": "3"}, V1).history_length == 3
    # ProtoJSON reads a number with no fraction as an integer, however it is written.
    assert TaskQueryParams.from_json({"id": "t", "historyLength": 3.0}, V1).history_length == 3
    assert TaskQueryParams.from_json({"id": "t", "historyLength": 1e2}, V1).history_length == 100
    assert TaskQueryParams.from_json({"id": "t", "historyLength": "1e2"}, V1).history_length == 100  # quoted too
    assert TaskQueryParams.from_json({"id": "t", "historyLength": "2.5E1"}, V1).history_length == 25


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"id": 5}, "'id' must be a non-empty string, got integer 5"),
        ({"id": ""}, "'id' must be a non-empty string, got string ''"),
        ({"id": "t", "historyLength": "abc"}, "'historyLength' must be a non-negative integer, got string 'abc'"),
        ({"id": "t", "historyLength": True}, "'historyLength' must be a non-negative integer, got boolean true"),
        ({"id": "t", "historyLength": 1.5}, "'historyLength' must be a non-negative integer, got number 1.5"),
        ({"id": "t", "historyLength": "--5"}, "'historyLength' must be a non-negative integer, got string '--5'"),
        ({"id": "t", "historyLength": "1.5e0"}, "'historyLength' must be a non-negative integer, got string '1.5e0'"),
        ({"id": "t", "historyLength": "1e999"}, "'historyLength' must be a non-negative integer, got string '1e999'"),
        ({"id": "t", "historyLength": 2**40}, "'historyLength' is 1099511627776, more than an int32 holds (at most 2147483647)"),
        ({"id": "t", "historyLength": 10**400}, f"'historyLength' is 1{'0' * 76}..., more than an int32 holds (at most 2147483647)"),
    ],
)
def test_task_query_params_bad_fields_are_named(params: Any, message: str) -> None:
    assert complaint(TaskQueryParams, params) == f"invalid params: {message}"


def test_a_history_length_of_more_digits_than_any_integer_has_is_invalid_params() -> None:
    assert "'historyLength' must be a non-negative integer, got string '999" in complaint(TaskQueryParams, {"id": "t", "historyLength": "9" * 5000})


def test_task_id_params_round_trip() -> None:
    params = {"id": "t", "metadata": {"reason": "user"}}
    assert TaskIdParams.from_json(params, V03).to_json(V03) == params


def test_list_tasks_params_decode_every_filter() -> None:
    params = {
        "contextId": "c",
        "status": "TASK_STATE_WORKING",
        "pageSize": 10,
        "pageToken": "next",
        "historyLength": 0,
        "statusTimestampAfter": "2026-11-29T22:00:00Z",
        "includeArtifacts": True,
    }
    decoded = ListTasksParams.from_json(params, V1)
    assert decoded == ListTasksParams(
        context_id="c",
        status=TaskState.WORKING,
        page_size=10,
        page_token="next",
        history_length=0,
        status_timestamp_after=datetime(2026, 11, 29, 22, tzinfo=timezone.utc),
        include_artifacts=True,
    )
    assert decoded.to_json(V1) == params


def test_list_tasks_status_may_be_an_enum_number_and_unspecified_is_no_filter() -> None:
    assert ListTasksParams.from_json({"status": 4}, V1).status is TaskState.FAILED  # a2a.proto's number
    assert ListTasksParams.from_json({"status": 8}, V1).status is TaskState.AUTH_REQUIRED
    # "UNRECOGNIZED": what @a2a-js/sdk's listTasks() sends when no status is asked for.
    for unspecified in ("TASK_STATE_UNSPECIFIED", 0, "UNRECOGNIZED"):
        assert ListTasksParams.from_json({"status": unspecified}, V1).status is None
    assert "'status' must be one of" in complaint(ListTasksParams, {"status": 9})
    assert "'status' must be one of" in complaint(ListTasksParams, {"status": "WORKING"})  # a typo is still said
    assert "'status' must be one of" in complaint(ListTasksParams, {"status": True})


def test_list_tasks_timestamp_may_end_in_a_lower_case_z_as_rfc_3339_allows() -> None:
    upper = ListTasksParams.from_json({"statusTimestampAfter": "2024-05-01T12:00:00Z"}, V1)
    assert ListTasksParams.from_json({"statusTimestampAfter": "2024-05-01t12:00:00z"}, V1) == upper


@pytest.mark.parametrize("moment", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-01:00", "2026-11-29T22:00:00", "yesterday"])
def test_list_tasks_timestamp_it_cannot_take_names_the_field(moment: str) -> None:
    assert complaint(ListTasksParams, {"statusTimestampAfter": moment}) == (
        "invalid params: 'statusTimestampAfter' must be an RFC 3339 timestamp with a time zone, from year 1 to 9999 in UTC,"
        f" got string {moment!r}"
    )


@pytest.mark.parametrize("size", [0, 101, -5])
def test_list_tasks_page_size_out_of_range_names_the_limits(size: int) -> None:
    assert complaint(ListTasksParams, {"pageSize": size}) == (
        f"invalid params: 'pageSize' must be an integer from 1 to 100, got integer {size}"
    )


def test_list_tasks_result_always_sends_the_next_page_token() -> None:
    assert ListTasksResult(tasks=[], next_page_token="", page_size=50, total_size=0).to_json(V1) == {
        "tasks": [],
        "nextPageToken": "",
        "pageSize": 50,
        "totalSize": 0,
    }


def test_params_that_are_not_an_object_are_named_params() -> None:
    assert complaint(TaskIdParams, ["t"]) == "invalid params: 'params' must be an object, got an array of 1 item"
