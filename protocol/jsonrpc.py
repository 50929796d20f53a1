"""JSON-RPC 2.0: parsing a request body, and building success and error responses.

An error object carries the code from ``ERROR_CODES``. In 1.0 its ``data`` is an array of
ProtoJSON ``Any`` objects (spec 1.0 §9.5): a ``google.rpc.ErrorInfo`` with the reason, plus a
``google.rpc.BadRequest`` listing bad fields for -32602. In 0.3 ``data`` is null. -32700 and
-32601 carry no ``data`` in either version. All of this matches the reference captures.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Union

import attrs

from protocol._json import JsonObject
from protocol.errors import (
    MISSING,
    InvalidParams,
    InvalidRequest,
    ParseError,
    ProtocolError,
    describe,
    error_code,
)
from protocol.versions import ProtocolVersion

RequestId = Union[str, int, float, None]
"""JSON-RPC 2.0 §4: a String, a Number (a fraction only discouraged) or null, answered as sent."""

ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo"
BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"
ERROR_DOMAIN = "a2a-protocol.org"


@attrs.frozen
class JsonRpcRequest:
    """A well-formed request. ``id`` is None for a notification (no ``id`` member) or ``"id": null``."""

    id: RequestId
    method: str
    params: JsonObject


class RequestRejected(Exception):
    """A body that is not a usable request: the error to send, and the id and method to send it
    under (as far as they could be read; both None when the body was not even JSON)."""

    def __init__(self, error: ProtocolError, request_id: RequestId = None, method: str | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.request_id = request_id
        self.method = method


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


# Deeper JSON is refused outright. What is stored holds the request's values a few levels
# deeper still, and every reader must be able to decode it: near Python's recursion limit, whether
# it could would depend on how deep the reader's own stack happened to be.
MAX_DEPTH = 100


def _deeper_than(value: object, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[object] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _finite_float(text: str) -> float:
    # A number past a double's range (1e999) would parse as infinity, which no JSON can carry:
    # stored, the task could never be sent back.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of range (a JSON number here must fit a 64-bit float)")
    return value


def _bounded_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # longer than Python converts (sys.get_int_max_str_digits())
        raise ValueError(f"the number {text[:20]}... has {len(text)} digits, more than this server reads") from None


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int)


def load_json(body: bytes | str) -> object:
    """Parse standard JSON (no NaN or Infinity, no number past a double's range) whose strings are
    Unicode text; raises ParseError with the reason."""
    try:
        # A byte order mark is ignored, as RFC 8259 allows (some clients send one).
        text = body.decode("utf-8-sig") if isinstance(body, bytes) else body.removeprefix("\ufeff")
        value = _DECODER.decode(text)
        if text.count("[") + text.count("{") > MAX_DEPTH and _deeper_than(value, MAX_DEPTH):
            raise ParseError(f"nested more than {MAX_DEPTH} deep; flatten it")
        # Bytes decoded as UTF-8 hold no surrogate, so only an escape can spell one.
        if ("\\u" in text and _SURROGATE_ESCAPE.search(text)) or (isinstance(body, str) and _SURROGATE.search(text)):
            where = _lone_surrogate(value)
            if where is not None:
                raise ParseError(
                    f"{where} holds a lone UTF-16 surrogate, which is not Unicode text and cannot be "
                    "stored; send the character as a surrogate pair (\\ud83d\\ude00, say), or drop it"
                )
        return value
    except UnicodeDecodeError as exc:
        raise ParseError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ParseError(f"nested more than {MAX_DEPTH} deep; flatten it") from None
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        if not text.strip():
            raise ParseError("the body is empty; send a JSON-RPC 2.0 request object") from None
        raise ParseError(str(exc)) from None


# JSON can spell a lone surrogate ("\ud800"), which a Python string holds but UTF-8 cannot: any
# store would fail to write it. A valid pair decodes to one character outside the range.
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # an escape that may spell one


def _lone_surrogate(value: object, path: str = "") -> str | None:
    """Where in ``value`` the first string or member name holding a lone surrogate is."""
    if isinstance(value, str):
        if _SURROGATE.search(value) is None:
            return None
        return f"the string at {path}" if path else "the body"
    if isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                return f"a member name in {path or 'the body'}"
            found = _lone_surrogate(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def parse_request(body: bytes | str) -> JsonRpcRequest:
    """Parse one JSON-RPC request body.

    Raises RequestRejected wrapping ParseError (-32700) for a body that is not JSON,
    InvalidRequest (-32600) for JSON that is not a request (not an object, ``jsonrpc`` other
    than "2.0", an id that is not a string, number or null, no method, ``params`` that are
    neither an object nor an array), and InvalidParams (-32602) for ``params`` given as an array
    (by position: A2A's are named). Batches are not part of A2A.
    """
    try:
        obj = load_json(body)
    except ParseError as exc:
        raise RequestRejected(exc) from None
    if not isinstance(obj, dict):
        what = "batch requests are not supported" if isinstance(obj, list) else "the body must be a JSON object"
        raise RequestRejected(InvalidRequest(f"{what}, got {describe(obj)}"))
    request_id = obj.get("id")
    # A float here is finite: load_json refuses a number past a double's range.
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int, float, type(None))):
        raise RequestRejected(InvalidRequest(f"'id' must be a string, a number or null, got {describe(request_id)}"))
    method = obj.get("method", MISSING)
    known_method = method if isinstance(method, str) and method else None
    if obj.get("jsonrpc", MISSING) != "2.0":
        error = InvalidRequest(f"'jsonrpc' must be exactly \"2.0\", got {describe(obj.get('jsonrpc', MISSING))}")
        raise RequestRejected(error, request_id, known_method)
    if known_method is None:
        raise RequestRejected(
            InvalidRequest(f"'method' must be a non-empty string, got {describe(method)}"), request_id
        )
    params = obj.get("params")
    if params is None:
        params = {}
    if isinstance(params, list):  # a structured value, by position: A2A names its params
        raise RequestRejected(InvalidParams("params", "an object", got=params), request_id, known_method)
    if not isinstance(params, dict):  # JSON-RPC 2.0 §4.2: params, when present, are structured
        error = InvalidRequest(f"'params' must be an object (or omitted), got {describe(params)}")
        raise RequestRejected(error, request_id, known_method)
    return JsonRpcRequest(request_id, known_method, params)


def success_response(request_id: RequestId, result: object) -> JsonObject:
    """A response carrying ``result``, already encoded for the request's version."""
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def error_response(request_id: RequestId, error: ProtocolError, version: ProtocolVersion) -> JsonObject:
    return {"jsonrpc": "2.0", "id": request_id, "error": error_object(error, version)}


def error_object(error: ProtocolError, version: ProtocolVersion) -> JsonObject:
    """The ``error`` member for ``error``: code from ERROR_CODES, our message, and ``data``."""
    code = error_code(error)
    obj: JsonObject = {"code": code.code, "message": error.message}
    if code.reason is None:
        return obj
    if version is ProtocolVersion.V0_3:
        obj["data"] = None
        return obj
    info: JsonObject = {"@type": ERROR_INFO_TYPE, "reason": code.reason, "domain": ERROR_DOMAIN, "metadata": {}}
    data = [info]
    violations = error.violations if isinstance(error, InvalidParams) else ()
    if violations:
        info["metadata"] = {"errors": [{"field": v.field, "message": v.description} for v in violations]}
        fields = [{"field": v.field, "description": v.description} for v in violations]
        data.append({"@type": BAD_REQUEST_TYPE, "fieldViolations": fields})
    obj["data"] = data
    return obj


# json.dumps with options builds an encoder each call; one made once encodes a task a quarter faster.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_json(obj: object) -> bytes:
    """Compact UTF-8 JSON for a response body or an SSE data line (it never contains a newline)."""
    try:
        return _ENCODER.encode(obj).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate, which a client can send as "\ud800": escape it rather than fail.
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("ascii")
