"""Every capture from the a2a-sdk reference server decodes, and re-encodes to the same JSON.

The captures (real requests and responses of the a2a-sdk 1.3.0 reference server) live in
tests/protocol/wire/. Known, deliberate
differences from the reference server each have their own test below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from protocol import (
    AgentCard,
    ContextMismatch,
    ExtendedAgentCardNotConfigured,
    ListTasksParams,
    ListTasksResult,
    Operation,
    ProtocolError,
    ProtocolVersion,
    PushNotificationNotSupported,
    RequestRejected,
    SendMessageParams,
    SseParser,
    Task,
    TaskIdParams,
    TaskIsTerminal,
    TaskNotCancelable,
    TaskNotFound,
    TaskQueryParams,
    UnsupportedOperation,
    encode_event,
    error_response,
    parse_request,
    response_version,
    route,
    send_result_from_json,
    send_result_to_json,
    stream_event_from_json,
    stream_event_to_json,
)

WIRE = Path(__file__).resolve().parent / "wire"
V1, V03 = ProtocolVersion.V1_0, ProtocolVersion.V0_3

# The A2A-Version header each request was sent with (None: absent).
HEADER_OVERRIDES = {"err_v1_method_without_version_header": None, "err_version_2": "2.0"}
# Streams captured without their request (they answered a subscribe).
RESPONSE_ONLY = {
    "v1_subscribe_during_cancel": (V1, Operation.SUBSCRIBE_TO_TASK),
    "v03_resubscribe_during_cancel": (V03, Operation.SUBSCRIBE_TO_TASK),
}
# The error a Keel handler raises for each captured A2A error (the reference's own wording differs).
HANDLER_ERRORS: dict[str, ProtocolError] = {
    "v1_cancel_again": TaskNotCancelable("8b77d7be-1a60-497c-85fc-4f9ea3a7e361", "canceled"),
    "v1_cancel_completed": TaskNotCancelable("ef783ad9-96bf-48d0-9efb-e4b5ace54656", "completed"),
    "v1_get_task_notfound": TaskNotFound("does-not-exist"),
    "v1_send_to_terminal": TaskIsTerminal("ef783ad9-96bf-48d0-9efb-e4b5ace54656", "completed", "accept messages"),
    "v1_subscribe_terminal": TaskIsTerminal("8b77d7be-1a60-497c-85fc-4f9ea3a7e361", "canceled", "be subscribed to"),
    "v1_context_mismatch": ContextMismatch(
        "other-ctx", "ef783ad9-96bf-48d0-9efb-e4b5ace54656", "d1fb2eee-a5a3-46dd-a88e-bb80d58e4f52"
    ),
    "err_extended_card": UnsupportedOperation("this agent does not declare an extended agent card"),
    "err_push_not_supported": PushNotificationNotSupported(),
    "v03_extended_card": ExtendedAgentCardNotConfigured("this agent does not declare an extended agent card"),
    "v03_push_set": PushNotificationNotSupported(),
    "v03_tasks_cancel_again": TaskNotCancelable("e68b9e2e-debd-4576-a179-03ba613186c1", "canceled"),
    "v03_tasks_get_notfound": TaskNotFound("nope"),
}
# Captured errors Keel answers with another code on purpose, each with its own test below.
OTHER_CODE = {"v03_extended_card"}
# Requests the protocol layer itself rejects, with the code it answers.
REJECTED = {
    "err_parse": -32700,
    "err_invalid_request": -32600,
    "err_method_not_found": -32601,
    "err_invalid_params": -32602,
    "err_v1_method_without_version_header": -32009,
    "err_version_2": -32009,
    "v1_invalid_params": -32602,
    "v03_invalid_params": -32602,  # the reference answers -32600 here; see its own test
    "v03_tasks_list": -32601,
}


def names(suffix: str) -> list[str]:
    return sorted(path.name.removesuffix(suffix) for path in WIRE.glob(f"*{suffix}"))


def header_for(name: str) -> str | None:
    if name in HEADER_OVERRIDES:
        return HEADER_OVERRIDES[name]
    return None if name.startswith("v03_") else "1.0"


def request_body(name: str) -> bytes:
    return (WIRE / f"{name}.req.json").read_bytes()


def response_payloads(name: str) -> list[Any]:
    """The JSON-RPC responses of a capture: one for a JSON body, one per event for a stream."""
    raw = (WIRE / (f"{name}.resp.txt" if name != "agent_card" else "agent_card.txt")).read_bytes()
    if raw.startswith(b"HTTP/"):
        raw = raw.replace(b"\r\n", b"\n").split(b"\n\n", 1)[1]
    if not raw.startswith(b"data:"):
        return [json.loads(raw)]
    parser = SseParser()
    events = parser.feed(raw)
    assert parser.close()
    return [json.loads(event.data) for event in events]


def routed(name: str) -> tuple[ProtocolVersion, Operation]:
    if name in RESPONSE_ONLY:
        return RESPONSE_ONLY[name]
    request = parse_request(request_body(name))
    found = route(request.method, header_for(name))
    return found.version, found.operation


def decode_params(operation: Operation, params: object, version: ProtocolVersion) -> Any:
    kinds: dict[Operation, Any] = {
        Operation.SEND_MESSAGE: SendMessageParams,
        Operation.SEND_STREAMING_MESSAGE: SendMessageParams,
        Operation.GET_TASK: TaskQueryParams,
        Operation.CANCEL_TASK: TaskIdParams,
        Operation.SUBSCRIBE_TO_TASK: TaskIdParams,
        Operation.LIST_TASKS: ListTasksParams,
    }
    return kinds[operation].from_json(params, version)


def reencode_result(operation: Operation, result: object, version: ProtocolVersion) -> object:
    if operation in (Operation.GET_TASK, Operation.CANCEL_TASK):
        return Task.from_json(result, version, "result").to_json(version)
    if operation is Operation.LIST_TASKS:
        return ListTasksResult.from_json(result, version).to_json(version)
    if operation is Operation.SEND_MESSAGE:
        return send_result_to_json(send_result_from_json(result, version), version)
    return stream_event_to_json(stream_event_from_json(result, version), version)


def without_message(response: dict[str, Any]) -> dict[str, Any]:
    error = {key: value for key, value in response["error"].items() if key != "message"}
    return {**response, "error": error}


def without_proto_defaults(value: Any) -> Any:
    """Drop the empty strings and arrays the ListTasks serializer prints (a2a-protocol.md 2.4)."""
    if isinstance(value, dict):
        return {k: without_proto_defaults(v) for k, v in value.items() if v not in ("", [])}
    if isinstance(value, list):
        return [without_proto_defaults(item) for item in value]
    return value


GOOD_REQUESTS = [name for name in names(".req.json") if name not in REJECTED]
RESULTS = [n for n in names(".resp.txt") if n not in REJECTED and n not in HANDLER_ERRORS]


def test_captures_are_all_covered() -> None:
    assert WIRE.is_dir(), f"the reference captures are missing: {WIRE}"
    responses = set(names(".resp.txt"))
    assert responses == set(RESULTS) | set(HANDLER_ERRORS) | set(REJECTED)
    assert set(GOOD_REQUESTS) | set(REJECTED) == set(names(".req.json"))
    assert len(RESULTS) == 20


@pytest.mark.parametrize("name", GOOD_REQUESTS)
def test_capture_request_params_round_trip(name: str) -> None:
    request = parse_request(request_body(name))
    version, operation = routed(name)
    if operation.is_push_config or operation is Operation.GET_EXTENDED_AGENT_CARD:
        return  # Keel answers these without reading params (see HANDLER_ERRORS)
    assert decode_params(operation, request.params, version).to_json(version) == request.params


@pytest.mark.parametrize("name", RESULTS)
def test_capture_results_round_trip(name: str) -> None:
    version, operation = routed(name)
    for response in response_payloads(name):
        expected = response["result"]
        if operation is Operation.LIST_TASKS:
            expected = {**expected, "tasks": without_proto_defaults(expected["tasks"])}
        if name == "v03_stream_input_required" and expected.get("status", {}).get("state") == "input-required":
            expected = {**expected, "final": True}  # see test_v03_stream_says_final_on_input_required
        assert reencode_result(operation, response["result"], version) == expected


@pytest.mark.parametrize("name", sorted(set(HANDLER_ERRORS) - OTHER_CODE))
def test_capture_handler_errors_match_code_and_data(name: str) -> None:
    request = parse_request(request_body(name))
    version = route(request.method, header_for(name)).version
    [captured] = response_payloads(name)
    ours = error_response(request.id, HANDLER_ERRORS[name], version)
    assert without_message(ours) == without_message(captured)


def rejection(name: str) -> tuple[ProtocolError, Any, ProtocolVersion]:
    """The error Keel answers a rejected capture with, its request id, and its encoding."""
    header = header_for(name)
    try:
        request = parse_request(request_body(name))
    except RequestRejected as rejected:
        return rejected.error, rejected.request_id, response_version(rejected.method, header)
    try:
        found = route(request.method, header)
        decode_params(found.operation, request.params, found.version)
    except ProtocolError as exc:
        return exc, request.id, response_version(request.method, header)
    raise AssertionError(f"{name} was accepted")


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_capture_rejections_raise_the_captured_code(name: str) -> None:
    error, request_id, version = rejection(name)
    ours = error_response(request_id, error, version)
    assert ours["error"]["code"] == REJECTED[name]
    [captured] = response_payloads(name)
    if name in ("err_invalid_params", "v1_invalid_params", "v03_invalid_params"):
        return  # field reports differ in wording; test_invalid_params_data_lists_the_bad_field
    assert without_message(ours) == without_message(captured)


def test_invalid_params_data_lists_the_bad_field() -> None:
    error, request_id, version = rejection("err_invalid_params")
    ours = error_response(request_id, error, version)
    [captured] = response_payloads("err_invalid_params")
    info, bad_request = ours["error"]["data"]
    assert {k: v for k, v in info.items() if k != "metadata"} == {
        k: v for k, v in captured["error"]["data"][0].items() if k != "metadata"
    }
    assert bad_request["fieldViolations"][0]["field"] == "id"
    assert "must be a non-empty string, got integer 5" in ours["error"]["message"]


def test_v03_invalid_message_is_invalid_params_not_invalid_request() -> None:
    """The reference answers -32600 with pydantic text (a2a-protocol.md 2.4, deviation 1)."""
    [captured] = response_payloads("v03_invalid_params")
    error, request_id, version = rejection("v03_invalid_params")
    assert captured["error"]["code"] == -32600
    assert error_response(request_id, error, version)["error"] == {
        "code": -32602,
        "message": "invalid params: 'message.messageId' must be a non-empty string, got nothing (the field is missing)",
        "data": None,
    }


def test_v03_extended_card_is_not_configured_rather_than_unsupported() -> None:
    """The 1.x reference's 0.3 layer answers -32004, the 1.0 code (err_extended_card); spec 0.3 §8.2
    names -32007 (AuthenticatedExtendedCardNotConfiguredError) for an agent with no extended card,
    and the 0.3 a2a-sdk server answers it."""
    [captured] = response_payloads("v03_extended_card")
    request = parse_request(request_body("v03_extended_card"))
    ours = error_response(request.id, HANDLER_ERRORS["v03_extended_card"], V03)
    assert captured["error"]["code"] == -32004
    assert ours["error"]["code"] == -32007
    assert without_message(ours) == {**captured, "error": {**without_message(captured)["error"], "code": -32007}}


def test_v03_stream_says_final_on_input_required() -> None:
    """The reference sends final:false and closes (deviation 2); a 0.3 client then waits forever."""
    last = response_payloads("v03_stream_input_required")[-1]["result"]
    assert last["final"] is False
    assert stream_event_to_json(stream_event_from_json(last, V03), V03)["final"] is True


def test_agent_card_capture_round_trips_as_the_well_known_card() -> None:
    [captured] = response_payloads("agent_card")
    card = AgentCard.from_json(captured, V1)
    assert card.well_known_json() == captured
    assert {"url", "preferredTransport", "protocolVersion"}.isdisjoint(card.to_json(V1))


@pytest.mark.parametrize("name", [n for n in RESULTS if routed(n)[1].streams])
def test_capture_streams_reencode_as_one_data_line_per_event(name: str) -> None:
    payloads = response_payloads(name)
    framed = b"".join(encode_event(payload) for payload in payloads)
    assert framed.count(b"\n\n") == len(payloads)
    assert all(line.startswith(b"data: {") for line in framed.split(b"\n\n") if line)
    parser = SseParser()
    assert [json.loads(e.data) for e in parser.feed(framed)] == payloads
