"""The JSON-RPC method tables of 1.0 and 0.3, and routing a request to an operation.

Both versions are served on one URL. The ``A2A-Version`` header picks the version (absent
means 0.3) and the method must belong to it: a 1.0 method sent without the header gets
VersionNotSupported (-32009), as the reference server does
(wire/err_v1_method_without_version_header).
"""

from __future__ import annotations

import difflib

import enum
from collections.abc import Mapping

import attrs

from protocol.errors import MethodNotFound, VersionNotSupported
from protocol.versions import ProtocolVersion, parse_version_header, requested_version


class Operation(enum.Enum):
    SEND_MESSAGE = "send_message"
    SEND_STREAMING_MESSAGE = "send_streaming_message"
    GET_TASK = "get_task"
    LIST_TASKS = "list_tasks"
    CANCEL_TASK = "cancel_task"
    SUBSCRIBE_TO_TASK = "subscribe_to_task"
    CREATE_PUSH_CONFIG = "create_push_config"
    GET_PUSH_CONFIG = "get_push_config"
    LIST_PUSH_CONFIGS = "list_push_configs"
    DELETE_PUSH_CONFIG = "delete_push_config"
    GET_EXTENDED_AGENT_CARD = "get_extended_agent_card"

    @property
    def streams(self) -> bool:
        """Answered with an SSE stream rather than one JSON body."""
        return self in (Operation.SEND_STREAMING_MESSAGE, Operation.SUBSCRIBE_TO_TASK)

    @property
    def is_push_config(self) -> bool:
        return self.value.endswith(("push_config", "push_configs"))


METHODS: Mapping[ProtocolVersion, Mapping[str, Operation]] = {
    ProtocolVersion.V1_0: {
        "SendMessage": Operation.SEND_MESSAGE,
        "SendStreamingMessage": Operation.SEND_STREAMING_MESSAGE,
        "GetTask": Operation.GET_TASK,
        "ListTasks": Operation.LIST_TASKS,
        "CancelTask": Operation.CANCEL_TASK,
        "SubscribeToTask": Operation.SUBSCRIBE_TO_TASK,
        "CreateTaskPushNotificationConfig": Operation.CREATE_PUSH_CONFIG,
        "GetTaskPushNotificationConfig": Operation.GET_PUSH_CONFIG,
        "ListTaskPushNotificationConfigs": Operation.LIST_PUSH_CONFIGS,
        "DeleteTaskPushNotificationConfig": Operation.DELETE_PUSH_CONFIG,
        "GetExtendedAgentCard": Operation.GET_EXTENDED_AGENT_CARD,
    },
    # 0.3 has no ListTasks over JSON-RPC (spec 0.3 §7: "tasks/list … JSON-RPC N/A").
    ProtocolVersion.V0_3: {
        "message/send": Operation.SEND_MESSAGE,
        "message/stream": Operation.SEND_STREAMING_MESSAGE,
        "tasks/get": Operation.GET_TASK,
        "tasks/cancel": Operation.CANCEL_TASK,
        "tasks/resubscribe": Operation.SUBSCRIBE_TO_TASK,
        "tasks/pushNotificationConfig/set": Operation.CREATE_PUSH_CONFIG,
        "tasks/pushNotificationConfig/get": Operation.GET_PUSH_CONFIG,
        "tasks/pushNotificationConfig/list": Operation.LIST_PUSH_CONFIGS,
        "tasks/pushNotificationConfig/delete": Operation.DELETE_PUSH_CONFIG,
        "agent/getAuthenticatedExtendedCard": Operation.GET_EXTENDED_AGENT_CARD,
    },
}


@attrs.frozen
class Route:
    """Where a request goes: its operation, and the version its params and results speak."""

    method: str
    version: ProtocolVersion
    operation: Operation


def method_version(method: str) -> ProtocolVersion | None:
    """The version whose table lists ``method``, or None for a method no version has."""
    for version, table in METHODS.items():
        if method in table:
            return version
    return None


def route(method: str, version_header: str | None) -> Route:
    """Route a request by its method and ``A2A-Version`` header (None when absent).

    Raises VersionNotSupported (-32009) for a version Keel does not speak, or a method of the
    other version; MethodNotFound (-32601) for a method neither version has.
    """
    version = parse_version_header(version_header)
    operation = METHODS[version].get(method)
    if operation is not None:
        return Route(method, version, operation)
    owner = method_version(method)
    if owner is None:
        raise MethodNotFound(method, _instead(method, version))
    raise VersionNotSupported(requested_version(version_header), method=method, expected=owner.value)


def response_version(method: str | None, version_header: str | None) -> ProtocolVersion:
    """The encoding for a response, including an error raised before routing succeeded.

    A known method answers in its own version (the reference server answers a 1.0 method
    without the header in 1.0 form); otherwise the header decides, and an unsupported header
    gets the newest encoding (wire/err_version_2).
    """
    owner = None if method is None else method_version(method)
    if owner is not None:
        return owner
    try:
        return parse_version_header(version_header)
    except VersionNotSupported:
        return ProtocolVersion.V1_0


def _instead(method: str, version: ProtocolVersion) -> str:
    """The method a client misspelt, or else every method of the version it speaks."""
    known = list(METHODS[version])
    close = difflib.get_close_matches(method, known, n=1, cutoff=0.8) if len(method) <= 100 else []
    if close:
        return f"did you mean {close[0]!r}?"
    listed = f"A2A {version.value} has {', '.join(known[:-1])} and {known[-1]}"
    if version.is_legacy and method == "tasks/list":
        listed += " (listing tasks is A2A 1.0's ListTasks)"
    return listed
