"""JSON-RPC 2.0 over HTTP POST: A2A 1.0 and 0.3 on one URL.

Every JSON-RPC answer, error or not, travels with HTTP 200, as the reference server's do
(wire/err_*.resp.txt); the ``A2A-Version`` header (or query parameter) picks the version, and
``protocol.route`` applies the rule (absent means 0.3; a 1.0 method without it is -32009).
A body refused before JSON-RPC is reached (over the size limit, declared as something other
than JSON, compressed, or not whole within the time a body may take) is answered the same way,
-32600 with HTTP 200, not 413, 415 or 408: A2A clients read the error from the body, and some
take any other status for a transport failure. So a blocking send whose task still runs once its
first keep-alive is due is answered 200 then, its body white space until the answer
(``_AnswerOnceSettled``).

Protocol errors become error objects in the request's version. A store that fails (a full
disk, say) is an outage: logged in one line, and answered -32603 saying so. Anything else is a
bug: it is logged with its traceback and answered -32603 with a message that names nothing
internal.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, ClassVar

import attrs
import trio
from quart import Response, request
from quart.wrappers.response import ResponseBody
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout

from protocol import (
    METHODS,
    VERSION_HEADER,
    ExtendedAgentCardNotConfigured,
    InvalidRequest,
    ListTasksParams,
    Operation,
    ProtocolError,
    ProtocolVersion,
    PushNotificationNotSupported,
    RequestId,
    RequestRejected,
    Route,
    SendMessageParams,
    Task,
    TaskIdParams,
    TaskIsTerminal,
    TaskQueryParams,
    UnsupportedOperation,
    encode_event,
    encode_json,
    error_response,
    parse_request,
    response_version,
    route,
    send_result_to_json,
    success_response,
    trim_history,
)
from protocol.sse import HEADERS as SSE_HEADERS
from runtime.surface.card import CARD_PATH
from runtime.surface.failures import answer_to
from runtime.surface.streams import TaskEventStream, event_stream_response
from runtime.tasks import STORED_VERSION

if TYPE_CHECKING:
    from runtime.runner import Runner

JSON_TYPE = "application/json"

Params = dict[str, object]


def json_response(body: object, status: int = 200) -> Response:
    return Response(encode_json(body), status=status, content_type=JSON_TYPE)


def _refusal(body: object) -> Response:
    """An answer given before the body was read (or all of it): the connection closes after it,
    so that the rest of the body cannot be taken for the next request, and the client does not
    reuse a connection the server has stopped reading."""
    response = json_response(body)
    response.headers["Connection"] = "close"
    return response


def error_answer(body: object, method: str | None) -> Response:
    """An error's answer: JSON, but to a 0.3 streaming method the one event of an event stream.
    A 0.3 client takes nothing but an event stream from a streaming method (a2a-sdk 0.3 refuses
    a JSON body before reading it), as the 0.3 reference server sends it. 1.0 clients get JSON,
    as from every method."""
    operation = None if method is None else METHODS[ProtocolVersion.V0_3].get(method)
    if operation is not None and operation.streams:
        return Response(encode_event(body), status=200, headers=dict(SSE_HEADERS))
    return json_response(body)


def _is_json(content_type: str | None) -> bool:
    """application/json, or a JSON-based type such as application/a2a+json. A request without
    a Content-Type is let through: its body is judged as JSON all the same."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == JSON_TYPE or (media.startswith("application/") and media.endswith("+json"))


def _version_parameter() -> str | None:
    """The ``A2A-Version`` query parameter, its name in any case: a service parameter's key is
    case-insensitive (spec 1.0 §3.2.6), as a header's name is."""
    wanted = VERSION_HEADER.lower()
    return next((value for name, value in request.args.items(multi=True) if name.lower() == wanted), None)


@attrs.frozen
class _SentTask:
    """A send's 1.0 result, ``{"task": ...}``, whose task is encoded already: ``task_json``,
    as its run stored it (tasks.db keeps a task's 1.0 encoding, as compact as an answer's)."""

    task: Task
    task_json: str


@attrs.frozen
class _Unsettled:
    """A blocking send's task, still running once the answer's first keep-alive is due."""

    task_id: str
    send: SendMessageParams


def _success(request_id: RequestId, result: object) -> bytes:
    if isinstance(result, _SentTask):
        try:
            task = result.task_json.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate, which encode_json escapes
            result = send_result_to_json(result.task, STORED_VERSION)
        else:
            # Byte for byte what encode_json makes of success_response(request_id, {"task": ...}).
            return b'{"jsonrpc":"2.0","id":' + encode_json(request_id) + b',"result":{"task":' + task + b"}}"
    return encode_json(success_response(request_id, result))


@attrs.define(eq=False)
class _AnswerOnceSettled(ResponseBody):
    """The body of a blocking send's answer whose task runs on: a space every ``keepalive_s``
    (JSON allows white space before a value) until the task settles, then the answer. A client,
    or a proxy, that gives up on a read silent for a few seconds (the a2a-sdk client's own HTTP
    client does after 5 s) stays for a run that takes minutes. Each call waits inside itself,
    holding no cancel scope across a yield, as runtime.surface.streams does."""

    answer: Callable[[], Awaitable[bytes]]
    keepalive_s: float
    _sent: bool = attrs.field(init=False, default=False)

    async def __aenter__(self) -> _AnswerOnceSettled:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        pass

    def __aiter__(self) -> _AnswerOnceSettled:
        return self

    async def __anext__(self) -> bytes:
        if self._sent:
            raise StopAsyncIteration
        with trio.move_on_after(self.keepalive_s):
            body = await self.answer()
            self._sent = True
            return body
        return b" "


@attrs.frozen
class JsonRpcEndpoint:
    """The handler of ``POST /``: one request, one answer (a JSON body or an SSE stream)."""

    runner: Runner
    owner: str
    max_body_bytes: int
    body_timeout_s: float
    keepalive_s: float

    async def handle(self) -> Response:
        header = request.headers.get(VERSION_HEADER) or _version_parameter()
        if not _is_json(request.content_type):
            error = InvalidRequest(f"the body must be sent as {JSON_TYPE}, not {request.content_type!r}")
            return _refusal(error_response(None, error, response_version(None, header)))
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity"):  # an empty list of codings is none (RFC 9110 8.4)
            error = InvalidRequest(f"a body in Content-Encoding {encoding!r} cannot be read here; send it uncompressed")
            return _refusal(error_response(None, error, response_version(None, header)))
        try:
            body = await request.get_data(cache=False)
        except RequestEntityTooLarge:
            error = InvalidRequest(f"the body is larger than the limit of {self.max_body_bytes} bytes")
            return _refusal(error_response(None, error, response_version(None, header)))
        except RequestTimeout:
            error = InvalidRequest(f"the body did not arrive whole within {self.body_timeout_s:g} s; send it at once")
            return _refusal(error_response(None, error, response_version(None, header)))
        try:
            call = parse_request(body)
        except RequestRejected as rejected:
            version = response_version(rejected.method, header)
            return error_answer(error_response(rejected.request_id, rejected.error, version), rejected.method)
        try:
            target = route(call.method, header)
        except ProtocolError as exc:
            return error_answer(error_response(call.id, exc, response_version(call.method, header)), call.method)
        return await self._dispatch(call.id, target, call.params)

    async def _dispatch(self, request_id: RequestId, target: Route, params: Params) -> Response:
        try:
            if target.operation.streams:
                stream = await self._open_stream(request_id, target, params)
                return event_stream_response(stream)
            result = await self._answer(target.operation, params, target.version)
            if isinstance(result, _Unsettled):
                body = _AnswerOnceSettled(functools.partial(self._answer_once_settled, request_id, target, result), self.keepalive_s)
                response = Response(body, status=200, content_type=JSON_TYPE)
                # Each space goes out as it is written: nginx, buffering by default, holds the headers
                # and the first space until the next one, 6 s in, when a client may have given up.
                response.headers["X-Accel-Buffering"] = "no"
                response.timeout = None  # quart's RESPONSE_TIMEOUT would cut a long task's answer
                return response
            return Response(_success(request_id, result), content_type=JSON_TYPE)  # encoding can fail too
        except Exception as exc:
            error = answer_to(target.method, exc)
        return error_answer(error_response(request_id, error, target.version), target.method)

    async def _answer_once_settled(self, request_id: RequestId, target: Route, unsettled: _Unsettled) -> bytes:
        """The answer to a blocking send, once its task settles; its status is sent already."""
        try:
            return _success(request_id, await self._settled(unsettled.task_id, unsettled.send, target.version))
        except Exception as exc:
            return encode_json(error_response(request_id, answer_to(target.method, exc), target.version))

    async def _answer(self, operation: Operation, params: Params, version: ProtocolVersion) -> object:
        if operation.is_push_config:
            raise PushNotificationNotSupported()
        handler = self._unary.get(operation)
        if handler is None:
            raise AssertionError(f"no handler for {operation}")  # every Operation is listed
        return await handler(self, params, version)

    async def _send_message(self, params: Params, version: ProtocolVersion) -> object:
        """A blocking send (the default) returns once the task is terminal or interrupted; with
        ``returnImmediately`` (0.3: ``blocking: false``) it returns the task as created."""
        send = SendMessageParams.from_json(params, version)
        task = await self.runner.send(self.owner, send)
        if send.configuration.return_immediately:
            return send_result_to_json(trim_history(task, send.configuration.history_length, version), version)
        with trio.move_on_after(self.keepalive_s):
            return await self._settled(task.id, send, version)
        return _Unsettled(task.id, send)  # answered by a body that keeps the connection alive meanwhile

    async def _settled(self, task_id: str, send: SendMessageParams, version: ProtocolVersion) -> object:
        task, stored = await self.runner.wait_settled_encoded(self.owner, task_id)
        if stored is not None and version is STORED_VERSION and send.configuration.history_length is None:
            return _SentTask(task, stored)
        return send_result_to_json(trim_history(task, send.configuration.history_length, version), version)

    async def _get_task(self, params: Params, version: ProtocolVersion) -> object:
        query = TaskQueryParams.from_json(params, version)
        task = await self.runner.get(self.owner, query.id)
        return trim_history(task, query.history_length, version).to_json(version)

    async def _list_tasks(self, params: Params, version: ProtocolVersion) -> object:
        listing = ListTasksParams.from_json(params, version)
        return (await self.runner.list_tasks(self.owner, listing)).to_json(version)

    async def _cancel_task(self, params: Params, version: ProtocolVersion) -> object:
        target = TaskIdParams.from_json(params, version)
        return (await self.runner.cancel(self.owner, target.id)).to_json(version)

    async def _extended_card(self, params: Params, version: ProtocolVersion) -> object:
        # The card says it has none. In 1.0 that makes the method unsupported (-32004). 0.3 has a
        # code for it (spec 0.3 §8.2, AuthenticatedExtendedCardNotConfiguredError), which the 0.3
        # a2a-sdk server answers; the 1.x reference's 0.3 layer answers -32004 (wire captures).
        field = "capabilities.extendedAgentCard" if version is ProtocolVersion.V1_0 else "supportsAuthenticatedExtendedCard"
        why = (
            f"this agent has no extended agent card (its agent card does not set {field}); "
            f"the public card at {CARD_PATH} is all there is"
        )
        raise UnsupportedOperation(why) if version is ProtocolVersion.V1_0 else ExtendedAgentCardNotConfigured(why)

    _unary: ClassVar[dict[Operation, Callable[[JsonRpcEndpoint, Params, ProtocolVersion], Awaitable[object]]]] = {
        Operation.SEND_MESSAGE: _send_message,
        Operation.GET_TASK: _get_task,
        Operation.LIST_TASKS: _list_tasks,
        Operation.CANCEL_TASK: _cancel_task,
        Operation.GET_EXTENDED_AGENT_CARD: _extended_card,
    }

    async def _open_stream(self, request_id: RequestId, target: Route, params: Params) -> TaskEventStream:
        """Check the request and find the task; the stream itself opens when quart enters it."""
        version = target.version
        first = None
        if target.operation is Operation.SEND_STREAMING_MESSAGE:
            send = SendMessageParams.from_json(params, version)
            created = await self.runner.send(self.owner, send)
            first = trim_history(created, send.configuration.history_length, version)
            task_id = created.id
        else:
            task_id = TaskIdParams.from_json(params, version).id
            task = await self.runner.get(self.owner, task_id)
            if task.status.state.is_terminal:
                read = "GetTask" if version is ProtocolVersion.V1_0 else "tasks/get"
                raise TaskIsTerminal(task_id, task.status.state.value, "be subscribed to", instead=f"read it as it ended with {read}")
        return TaskEventStream(
            runner=self.runner, owner=self.owner, task_id=task_id, request_id=request_id, version=version,
            keepalive_s=self.keepalive_s, method=target.method, first=first,
        )  # fmt: skip
