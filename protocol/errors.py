"""The protocol layer's errors, and the one table that maps each to its wire codes.

ProtocolError
├── ParseError                      -32700  the body is not JSON
├── InvalidRequest                  -32600  JSON, but not a JSON-RPC 2.0 request
├── MethodNotFound                  -32601  no such method in any version Keel speaks
├── InvalidParams                   -32602  a field is missing or has the wrong shape
│   └── ContextMismatch                     a message's contextId is not its task's
├── InternalError                   -32603  a bug or an outage; details stay in the log
│   ├── StorageFailed                       the server's storage failed (a full disk, say)
│   ├── StorageDamaged                      what a request reads or writes is on a damaged page
│   ├── TaskUnreadable                      a stored task's row cannot be read (it was damaged)
│   ├── EndNotStored                        a blocking send's task ended, its end unwritten
│   └── StreamCut                           a stream ended before its task did
├── TaskNotFound                    -32001  no such task (for this caller)
├── TaskNotCancelable               -32002  the task is already terminal
├── PushNotificationNotSupported    -32003
├── UnsupportedOperation            -32004  not possible in the task's current state
│   ├── TaskIsTerminal                      an operation that needs a live task
│   └── InvalidTransition                   a state change the task state machine forbids
├── ContentTypeNotSupported         -32005
├── ExtendedAgentCardNotConfigured  -32007
└── VersionNotSupported             -32009

Messages name the thing they are about and never carry a stack trace: they go on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

MISSING: object = object()
"""Stands for a field the client did not send, in InvalidParams(got=MISSING)."""


_TYPE_NAMES = {int: "integer", float: "number", str: "string"}


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quoted(text: str) -> str:
    """A name a client sent (an id, a method), quoted for a message: never the whole of a long one."""
    return _clip(repr(text), 80)


def clipped(text: str) -> str:
    """Words a client sent (a media type), as they are for a message: never the whole of long ones."""
    return _clip(text, 80)


def describe(value: object) -> str:
    """A short description of a JSON value for an error message; never the whole of a big one."""
    if value is MISSING:
        return "nothing (the field is missing)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, dict):
        keys = ", ".join(repr(key) for key in list(value)[:5]) + (", ..." if len(value) > 5 else "")
        return f"an object with keys {_clip(keys)}" if value else "an empty object"
    if isinstance(value, list):
        return f"an array of {len(value)} item{'s' if len(value) > 1 else ''}" if value else "an empty array"
    return f"{_TYPE_NAMES.get(type(value), type(value).__name__)} {_clip(repr(value))}"


class ProtocolError(Exception):
    """Base class for every error that becomes a JSON-RPC error object."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ParseError(ProtocolError):
    def __init__(self, detail: str) -> None:
        super().__init__(f"request body is not valid JSON: {detail}")


class InvalidRequest(ProtocolError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid JSON-RPC request: {reason}")


class MethodNotFound(ProtocolError):
    def __init__(self, method: str, hint: str = "") -> None:
        """``hint``: what to send instead, to follow a semicolon."""
        self.method = method
        super().__init__(f"method {quoted(method)} not found" + (f"; {hint}" if hint else ""))


@attrs.frozen
class FieldViolation:
    """One bad field of a request: its path as the client spelt it, and what was wrong."""

    field: str
    description: str


class InvalidParams(ProtocolError):
    """A request field is missing or malformed; ``field`` is its path, e.g. ``message.parts[0]``."""

    def __init__(self, field: str, expected: str = "", *, got: object = MISSING, problem: str = "") -> None:
        """``expected``: what the field must be (it is said what was got instead); or ``problem``:
        what is wrong with it, in words that follow its name."""
        self.field = field
        description = problem or f"must be {expected}, got {describe(got)}"
        self.violations: tuple[FieldViolation, ...] = (FieldViolation(field, description),)
        super().__init__(f"invalid params: {field!r} {description}")


class ContextMismatch(InvalidParams):
    def __init__(self, context_id: str, task_id: str, task_context_id: str) -> None:
        self.field = "message.contextId"
        self.violations = ()
        ProtocolError.__init__(
            self,
            f"context {quoted(context_id)} does not match context {task_context_id!r} of task {task_id!r}; "
            "omit contextId or send the task's own",
        )


class InternalError(ProtocolError):
    def __init__(self, what: str = "the request") -> None:
        super().__init__(f"internal error while handling {what}; the server log has the details")


END_NOT_STORED = (
    "its final state could not be stored yet; the server keeps trying, and until then GetTask shows it as last stored "
    "(the server log has the details)"
)
END_LEFT_FOR_NEXT = (
    "the server is shutting down with its final state not stored; the next server to start on the same state takes "
    "the task up again, so poll GetTask once it is up (the server log has the details)"
)


class StorageFailed(InternalError):
    """An outage, not a bug: the server's storage failed (a full disk, say) during a request."""

    def __init__(self, what: str) -> None:
        ProtocolError.__init__(
            self,
            f"the server's storage failed while handling {what}; what it acknowledged before is kept. Try again "
            "shortly (a message sent again with the same messageId is taken once); the server log has the details",
        )


class StorageDamaged(InternalError):
    """The server's storage is damaged where a request reads or writes it: not an outage that
    passes, until its operator restores it."""

    def __init__(self, what: str) -> None:
        ProtocolError.__init__(
            self,
            f"the server's storage is damaged where {what} reads or writes it, so it cannot be handled until the"
            " server's operator restores the storage (the server log says how); trying again will not help until then",
        )


class TaskUnreadable(InternalError):
    """A stored task this server cannot read (its row was damaged): the operator must repair it."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        ProtocolError.__init__(
            self,
            f"task {task_id!r} is stored in a form this server cannot read; the server log tells its operator how to"
            " repair it",
        )


class EndNotStored(InternalError):
    """A task's run ended, but its final state could not be stored: the answer to a blocking send."""

    def __init__(self, task_id: str, why: str = END_NOT_STORED) -> None:
        self.task_id = task_id
        ProtocolError.__init__(self, f"task {task_id!r} ended, but {why}")


class StreamCut(InternalError):
    """A task's event stream ended before the task did; ``why`` says why and what to do."""

    def __init__(self, task_id: str, why: str) -> None:
        self.task_id = task_id
        ProtocolError.__init__(self, f"the event stream of task {task_id!r} ended before the task did: {why}")


class TaskNotFound(ProtocolError):
    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        super().__init__(f"task {quoted(task_id)} not found")


class TaskNotCancelable(ProtocolError):
    def __init__(self, task_id: str, state: str) -> None:
        self.task_id = task_id
        super().__init__(f"task {task_id!r} cannot be canceled: it is already {state}")


class PushNotificationNotSupported(ProtocolError):
    def __init__(self) -> None:
        super().__init__("push notifications are not supported by this agent")


class UnsupportedOperation(ProtocolError):
    def __init__(self, message: str) -> None:
        super().__init__(message)


class TaskIsTerminal(UnsupportedOperation):
    """``state`` in words ("completed"), the same for every protocol version."""

    def __init__(self, task_id: str, state: str, action: str, *, instead: str = "") -> None:
        """``instead``: what to do instead, in words that follow a semicolon."""
        self.task_id = task_id
        super().__init__(f"task {task_id!r} has ended ({state}) and cannot {action}" + (f"; {instead}" if instead else ""))


class InvalidTransition(UnsupportedOperation):
    def __init__(self, task_id: str, current: str, target: str, *, terminal: bool = False) -> None:
        self.task_id = task_id
        self.current = current
        self.target = target
        why = f": {current!r} is a terminal state" if terminal else ""
        super().__init__(f"task {task_id!r} cannot move from state {current!r} to {target!r}{why}")


class ContentTypeNotSupported(ProtocolError):
    def __init__(self, media_type: str, supported: Sequence[str] = (), *, problem: str = "") -> None:
        """``problem``, if given, says what is wrong in place of the default words."""
        self.media_type = media_type
        accepted = f"; this agent accepts {', '.join(map(repr, supported))}" if supported else ""
        super().__init__(problem or f"content type {quoted(media_type)} is not supported{accepted}")


class ExtendedAgentCardNotConfigured(ProtocolError):
    def __init__(self, message: str = "this agent has no extended agent card configured") -> None:
        super().__init__(message)


class VersionNotSupported(ProtocolError):
    """The requested A2A version is unknown, or is not the version ``method`` belongs to."""

    def __init__(self, requested: str, *, method: str | None = None, expected: str | None = None) -> None:
        self.requested = requested
        if method is None or expected is None:
            super().__init__(
                f"A2A version {quoted(requested)} is not supported; send 'A2A-Version: 1.0', or no header for 0.3"
            )
            return
        fix = "send 'A2A-Version: 1.0'" if expected == "1.0" else "omit the A2A-Version header"
        super().__init__(f"method {quoted(method)} belongs to A2A version {expected!r}, not {quoted(requested)}; {fix}")


@attrs.frozen
class ErrorCode:
    """How one error class appears on the wire.

    ``http_status`` is for the HTTP+JSON binding (spec 1.0.1 §5.4); JSON-RPC errors always
    travel with HTTP 200. ``reason`` is the 1.0 ``google.rpc.ErrorInfo`` reason; None means the
    error carries no ``data`` at all, as the reference server does for -32700 and -32601.
    """

    code: int
    http_status: int
    reason: str | None


ERROR_CODES: Mapping[type[ProtocolError], ErrorCode] = {
    ParseError: ErrorCode(-32700, 400, None),
    InvalidRequest: ErrorCode(-32600, 400, "INVALID_REQUEST"),
    MethodNotFound: ErrorCode(-32601, 404, None),
    InvalidParams: ErrorCode(-32602, 400, "INVALID_PARAMS"),
    InternalError: ErrorCode(-32603, 500, "INTERNAL_ERROR"),
    TaskNotFound: ErrorCode(-32001, 404, "TASK_NOT_FOUND"),
    TaskNotCancelable: ErrorCode(-32002, 400, "TASK_NOT_CANCELABLE"),
    PushNotificationNotSupported: ErrorCode(-32003, 400, "PUSH_NOTIFICATION_NOT_SUPPORTED"),
    UnsupportedOperation: ErrorCode(-32004, 400, "UNSUPPORTED_OPERATION"),
    ContentTypeNotSupported: ErrorCode(-32005, 400, "CONTENT_TYPE_NOT_SUPPORTED"),
    ExtendedAgentCardNotConfigured: ErrorCode(-32007, 400, "EXTENDED_AGENT_CARD_NOT_CONFIGURED"),
    VersionNotSupported: ErrorCode(-32009, 400, "VERSION_NOT_SUPPORTED"),
}


def error_code(error: ProtocolError) -> ErrorCode:
    """The wire codes of ``error``: its own class's row, or its nearest listed ancestor's."""
    for cls in type(error).__mro__:
        for listed, code in ERROR_CODES.items():
            if listed is cls:
                return code
    raise TypeError(f"{type(error).__name__} has no row in ERROR_CODES; add one next to its class")
