from __future__ import annotations

import json

import pytest

from protocol import (
    InvalidParams,
    InvalidRequest,
    JsonRpcRequest,
    ParseError,
    ProtocolError,
    RequestRejected,
    encode_json,
    parse_request,
    success_response,
)
from protocol.jsonrpc import MAX_DEPTH


def rejected(body: bytes | str) -> RequestRejected:
    with pytest.raises(RequestRejected) as caught:
        parse_request(body)
    return caught.value


def test_parse_request_reads_id_method_and_params() -> None:
    body = b'{"jsonrpc":"2.0","id":"r-1","method":"GetTask","params":{"id":"t"}}'
    assert parse_request(body) == JsonRpcRequest("r-1", "GetTask", {"id": "t"})


def test_parse_request_without_params_gets_an_empty_object() -> None:
    assert parse_request('{"jsonrpc":"2.0","id":40,"method":"agent/getAuthenticatedExtendedCard"}').params == {}
    assert parse_request('{"jsonrpc":"2.0","id":1,"method":"m","params":null}').params == {}


def test_parse_request_without_id_is_a_notification_with_id_none() -> None:
    assert parse_request('{"jsonrpc":"2.0","method":"GetTask"}').id is None


@pytest.mark.parametrize(
    "body",
    [b'{"jsonrpc":"2.0","id":19,"method":', b"", b"{'single': 1}", b'{"a": NaN}', b"\xff\xfe{}", b"[" * 100_000],
)
def test_parse_request_bad_json_is_a_parse_error_with_null_id(body: bytes) -> None:
    rejection = rejected(body)
    assert isinstance(rejection.error, ParseError)
    assert rejection.request_id is None
    assert rejection.error.message.startswith("request body is not valid JSON: ")


def test_parse_request_ignores_a_byte_order_mark() -> None:
    body = '{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"t"}}'
    assert parse_request(b"\xef\xbb\xbf" + body.encode()) == parse_request(body)
    assert parse_request("\ufeff" + body) == parse_request(body)


def test_parse_request_parse_error_keeps_the_parser_reason() -> None:
    assert rejected(b'{"jsonrpc":"2.0","id":19,"method":').error.message == (
        "request body is not valid JSON: Expecting value: line 1 column 35 (char 34)"
    )


def test_parse_request_says_an_empty_body_is_empty() -> None:
    for body in (b"", b"  \r\n", b"\xef\xbb\xbf", "\ufeff "):
        assert rejected(body).error.message == "request body is not valid JSON: the body is empty; send a JSON-RPC 2.0 request object"


def test_parse_request_refuses_json_nested_past_the_limit_however_deep() -> None:
    for depth in (MAX_DEPTH + 1, 5_000, 1_000_000):
        body = '{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":' + "[" * (depth - 2) + "]" * (depth - 2) + "}}"
        rejection = rejected(body)
        assert rejection.error.message == f"request body is not valid JSON: nested more than {MAX_DEPTH} deep; flatten it"
    body = '{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":' + "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2) + "}}"
    assert parse_request(body).method == "m"


@pytest.mark.parametrize("number", ["1e999", "-1e999", "1.5e400"])
def test_parse_request_a_number_past_a_doubles_range_is_a_parse_error_naming_it(number: str) -> None:
    rejection = rejected(f'{{"jsonrpc":"2.0","id":1,"method":"m","params":{{"data":{{"x":{number}}}}}}}')
    assert isinstance(rejection.error, ParseError)
    assert rejection.error.message == (
        f"request body is not valid JSON: the number {number} is out of range (a JSON number here must fit a 64-bit float)"
    )


def test_parse_request_keeps_numbers_a_double_holds_and_big_integers() -> None:
    params = parse_request('{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":1e308,"b":1e-999,"c":123456789012345678901234567890}}').params
    assert params == {"a": 1e308, "b": 0.0, "c": 123456789012345678901234567890}
    assert encode_json(params) == b'{"a":1e+308,"b":0.0,"c":123456789012345678901234567890}'


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (rb'{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":{"message":{"parts":[{"text":"x\ud800"}]}}}',
         "the string at params.message.parts[0].text"),
        (rb'{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":{"message":{"contextId":"\uDC00"}}}',
         "the string at params.message.contextId"),
        (rb'{"jsonrpc":"2.0","id":1,"method":"m","params":{"\udbff":1}}', "a member name in params"),
        (rb'"\ud800"', "the body"),
        ('{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":["\ud800"]}}', "the string at params.a[0]"),
    ],
)  # fmt: skip
def test_parse_request_text_holding_a_lone_surrogate_is_a_parse_error_saying_where(body: bytes | str, where: str) -> None:
    rejection = rejected(body)
    assert isinstance(rejection.error, ParseError)
    assert rejection.error.message == (
        f"request body is not valid JSON: {where} holds a lone UTF-16 surrogate, which is not Unicode text and "
        "cannot be stored; send the character as a surrogate pair (\\ud83d\\ude00, say), or drop it"
    )


@pytest.mark.parametrize(
    "body",
    [
        rb'{"jsonrpc":"2.0","id":1,"method":"m","params":{"text":"\ud83d\ude00"}}',  # a pair: one character
        rb'{"jsonrpc":"2.0","id":1,"method":"m","params":{"text":"\\ud800"}}',  # a backslash, then "ud800"
    ],
)
def test_parse_request_accepts_a_surrogate_pair_and_an_escaped_backslash(body: bytes) -> None:
    assert parse_request(body).params["text"] in ("\U0001f600", "\\ud800")


@pytest.mark.parametrize(
    ("body", "request_id", "reason"),
    [
        ("[]", None, "batch requests are not supported, got an empty array"),
        ('"hello"', None, "the body must be a JSON object, got string 'hello'"),
        ('{"jsonrpc":"1.0","id":20,"method":"GetTask"}', 20, "'jsonrpc' must be exactly \"2.0\", got string '1.0'"),
        ('{"id":"a","method":"GetTask"}', "a", "'jsonrpc' must be exactly \"2.0\", got nothing (the field is missing)"),
        ('{"jsonrpc":2.0,"id":1,"method":"GetTask"}', 1, "'jsonrpc' must be exactly \"2.0\", got number 2.0"),
        (
            '{"jsonrpc":"2.0","id":true,"method":"GetTask"}',
            None,
            "'id' must be a string, a number or null, got boolean true",
        ),
        (
            '{"jsonrpc":"2.0","id":{},"method":"GetTask"}',
            None,
            "'id' must be a string, a number or null, got an empty object",
        ),
        ('{"jsonrpc":"2.0","id":3}', 3, "'method' must be a non-empty string, got nothing (the field is missing)"),
        ('{"jsonrpc":"2.0","id":3,"method":7}', 3, "'method' must be a non-empty string, got integer 7"),
        ('{"jsonrpc":"2.0","id":3,"method":""}', 3, "'method' must be a non-empty string, got string ''"),
    ],
)
def test_parse_request_malformed_request_is_invalid_request(body: str, request_id: object, reason: str) -> None:
    rejection = rejected(body)
    assert isinstance(rejection.error, InvalidRequest)
    assert rejection.request_id == request_id
    assert rejection.error.message == f"invalid JSON-RPC request: {reason}"


@pytest.mark.parametrize(("text", "value"), [("1.5", 1.5), ("1.0", 1.0), ("-2.5e3", -2500.0)])
def test_parse_request_takes_any_json_number_as_the_id(text: str, value: float) -> None:
    # JSON-RPC 2.0 §4 (and A2A 0.3's JSONRPCMessage): the id is a String, a Number or null, and the
    # answer carries the same value; a fraction is only discouraged (SHOULD NOT).
    request = parse_request('{"jsonrpc":"2.0","id":' + text + ',"method":"GetTask"}')
    assert request.id == value
    assert json.loads(encode_json(success_response(request.id, {})))["id"] == value


def test_parse_request_rejection_keeps_the_method_for_choosing_the_encoding() -> None:
    assert rejected('{"jsonrpc":"1.0","id":20,"method":"GetTask"}').method == "GetTask"


def test_parse_request_params_that_are_not_an_object_are_invalid_params() -> None:
    rejection = rejected('{"jsonrpc":"2.0","id":"x","method":"GetTask","params":["t-1"]}')
    assert isinstance(rejection.error, InvalidParams)
    assert (rejection.request_id, rejection.method) == ("x", "GetTask")
    assert rejection.error.message == "invalid params: 'params' must be an object, got an array of 1 item"


@pytest.mark.parametrize("params", ['"t-1"', "3", "true"])
def test_parse_request_params_that_are_no_structured_value_make_no_request(params: str) -> None:
    rejection = rejected('{"jsonrpc":"2.0","id":"x","method":"GetTask","params":' + params + "}")
    assert isinstance(rejection.error, InvalidRequest)
    assert (rejection.request_id, rejection.method) == ("x", "GetTask")
    assert rejection.error.message.startswith("invalid JSON-RPC request: 'params' must be an object (or omitted), got ")


def test_parse_request_rejection_wraps_a_protocol_error_with_its_message() -> None:
    rejection = rejected(b"{")
    assert isinstance(rejection.error, ProtocolError)
    assert str(rejection) == rejection.error.message


def test_success_response_carries_the_result_and_id() -> None:
    assert success_response("r", {"id": "t"}) == {"jsonrpc": "2.0", "id": "r", "result": {"id": "t"}}


def test_encode_json_is_compact_utf8_without_newlines() -> None:
    body = encode_json({"text": "line one\nline two é", "n": [1, 2]})
    assert body == '{"text":"line one\\nline two é","n":[1,2]}'.encode()
    assert json.loads(body) == {"text": "line one\nline two é", "n": [1, 2]}


def test_encode_json_refuses_nan() -> None:
    with pytest.raises(ValueError):
        encode_json({"x": float("nan")})
