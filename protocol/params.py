"""The ``params`` of each A2A request, and the ListTasks result.

Every ``from_json`` raises InvalidParams naming the bad field by its path in ``params``
(``message.parts[0].text``, ``configuration.historyLength``). Fields Keel does not use, such
as 1.0's ``tenant``, are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

import attrs

from protocol._json import JsonObject, JsonReader, compact, format_timestamp, str_tuple
from protocol.errors import InvalidParams
from protocol.messages import Message
from protocol.states import TaskState
from protocol.tasks import Task
from protocol.versions import ProtocolVersion

V1 = ProtocolVersion.V1_0
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 100
# The longest id a client may have stored (messageId, contextId, referenceTaskIds). Each is a key
# the server keeps many copies of: in every message of a conversation, in every task, in caches.
MAX_ID_CHARS = 512
# The most parts a client's message may have. Each part is read, checked, stored and sent on one by
# one: 85,000 small parts (under the 1 MiB a body may be) took the server 14 times as long as the
# same bytes in one part, about 1.8 s of its event loop, while every other client waited.
MAX_PARTS = 1000
# The most JSON values (objects, arrays, strings, numbers...) a message's data parts and the metadata
# sent with it (the request's, the message's, its parts') may hold together. Each is
# an object of its own in memory for as long as its task runs: 250,000 empty objects, 1 MiB as
# sent, kept about 20 MiB for each run that had them.
MAX_DATA_VALUES = 50_000


@attrs.frozen(kw_only=True)
class SendConfiguration:
    accepted_output_modes: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    history_length: int | None = None
    return_immediately: bool = False
    """1.0 ``returnImmediately``; 0.3 said ``blocking`` (the opposite). Both default to blocking."""
    push_notification_config: JsonObject | None = None
    """Kept as sent (1.0 ``taskPushNotificationConfig``, 0.3 ``pushNotificationConfig``)."""

    @classmethod
    def from_json(cls, reader: JsonReader, version: ProtocolVersion) -> SendConfiguration:
        # The other version's way to be answered at once, read as the default, would block a
        # client that asked not to be: refused, saying this version's.
        mine, theirs, asking = (
            ('"returnImmediately": true', "blocking", False) if version is V1 else ('"blocking": false', "returnImmediately", True)
        )
        if reader.value(theirs) is asking:  # the value that would have it answered at once
            other = version.other
            raise InvalidParams(
                reader.at(theirs),
                problem=f"is the A2A {other.value} spelling, which an A2A {version.value} request does not read; in"
                f" {version.value}, send {mine} to be answered at once (an A2A {other.value} client sends its requests"
                f" {other.how_sent})",
            )
        if version is V1:
            return_immediately = reader.flag("returnImmediately")
            push = reader.opt_object("taskPushNotificationConfig")
        else:
            blocking = reader.opt_bool("blocking")
            return_immediately = blocking is False
            push = reader.opt_object("pushNotificationConfig")
        return cls(
            accepted_output_modes=reader.strings("acceptedOutputModes"),
            history_length=reader.opt_int("historyLength", minimum=0),
            return_immediately=return_immediately,
            push_notification_config=push,
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        mode: list[tuple[str, object]]
        if version is V1:
            mode = [("returnImmediately", self.return_immediately or None)]
            push = [("taskPushNotificationConfig", self.push_notification_config)]
        else:
            mode = [("blocking", False if self.return_immediately else None)]
            push = [("pushNotificationConfig", self.push_notification_config)]
        modes = [("acceptedOutputModes", list(self.accepted_output_modes)), ("historyLength", self.history_length)]
        return compact([*modes, *push, *mode])


@attrs.frozen(kw_only=True)
class SendMessageParams:
    """SendMessage / SendStreamingMessage (1.0), message/send / message/stream (0.3)."""

    message: Message
    configuration: SendConfiguration = SendConfiguration()
    metadata: JsonObject | None = None

    @classmethod
    def from_json(cls, params: object, version: ProtocolVersion) -> SendMessageParams:
        reader = JsonReader.of(params, "", proto_names=not version.is_legacy)
        configuration = reader.opt_child("configuration")
        _check_part_count(reader.value("message"))  # before any part is read
        _check_values(reader.obj)
        message = Message.from_json(reader.sent("message"), version, "message")
        _check_ids(message)
        return cls(
            message=message,
            configuration=SendConfiguration()
            if configuration is None
            else SendConfiguration.from_json(configuration, version),
            metadata=reader.opt_object("metadata"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        configuration = self.configuration.to_json(version)
        return compact(
            [("message", self.message.to_json(version)), ("configuration", configuration), ("metadata", self.metadata)]
        )


def _check_part_count(message: object) -> None:
    parts = message.get("parts") if isinstance(message, dict) else None
    if isinstance(parts, list) and len(parts) > MAX_PARTS:
        raise InvalidParams(
            "message.parts", problem=f"are {len(parts)}; a message may have at most {MAX_PARTS}: send their text as fewer parts"
        )


def _check_values(params: Mapping[str, object]) -> None:
    """The JSON values of the message's data parts and of the metadata sent with it (the request's,
    the message's and its parts'), counted together: each is kept in the task while it runs."""
    message = params.get("message")
    message = message if isinstance(message, dict) else {}
    parts = message.get("parts")
    found = [("metadata", params, "metadata"), ("message.metadata", message, "metadata")]
    for index, part in enumerate(parts if isinstance(parts, list) else []):
        if isinstance(part, dict):
            found += [(f"message.parts[{index}].data", part, "data"), (f"message.parts[{index}].metadata", part, "metadata")]
    values = 0
    for field, holder, key in found:
        if key not in holder:
            continue
        data = [holder[key]]
        while data and values <= MAX_DATA_VALUES:
            value = data.pop()
            values += 1
            if isinstance(value, dict):
                data.extend(value.values())
            elif isinstance(value, list):
                data.extend(value)
        if values > MAX_DATA_VALUES:
            raise InvalidParams(
                field,
                problem=f"brings the message to more than {MAX_DATA_VALUES} JSON values, counted in its data parts and metadata;"
                f" a message may hold at most {MAX_DATA_VALUES}: send large data as text, or as fewer values",
            )


def _check_ids(message: Message) -> None:
    ids = {"message.messageId": message.message_id, "message.taskId": message.task_id, "message.contextId": message.context_id}
    ids |= {f"message.referenceTaskIds[{index}]": task_id for index, task_id in enumerate(message.reference_task_ids)}
    for field, value in ids.items():
        if value is not None and len(value) > MAX_ID_CHARS:
            raise InvalidParams(field, problem=f"is {len(value)} characters long; an id may be at most {MAX_ID_CHARS}")


@attrs.frozen(kw_only=True)
class TaskQueryParams:
    """GetTask / tasks/get: which task, and how much of its history to return."""

    id: str
    history_length: int | None = None
    metadata: JsonObject | None = None

    @classmethod
    def from_json(cls, params: object, version: ProtocolVersion) -> TaskQueryParams:
        reader = JsonReader.of(params, "", proto_names=not version.is_legacy)
        return cls(
            id=reader.string("id"),
            history_length=reader.opt_int("historyLength", minimum=0),
            metadata=reader.opt_object("metadata"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        return compact([("id", self.id), ("historyLength", self.history_length), ("metadata", self.metadata)])


@attrs.frozen(kw_only=True)
class TaskIdParams:
    """CancelTask, SubscribeToTask (1.0); tasks/cancel, tasks/resubscribe (0.3)."""

    id: str
    metadata: JsonObject | None = None

    @classmethod
    def from_json(cls, params: object, version: ProtocolVersion) -> TaskIdParams:
        reader = JsonReader.of(params, "", proto_names=not version.is_legacy)
        return cls(id=reader.string("id"), metadata=reader.opt_object("metadata"))

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        return compact([("id", self.id), ("metadata", self.metadata)])


UNRECOGNIZED = "UNRECOGNIZED"  # protobuf-es's name for the enum value -1: one it could not name


@attrs.frozen(kw_only=True)
class ListTasksParams:
    """ListTasks (1.0 only). ``page_size`` None means DEFAULT_PAGE_SIZE."""

    context_id: str | None = None
    status: TaskState | None = None
    page_size: int | None = None
    page_token: str | None = None
    history_length: int | None = None
    status_timestamp_after: datetime | None = None
    include_artifacts: bool = False

    @classmethod
    def from_json(cls, params: object, version: ProtocolVersion) -> ListTasksParams:
        reader = JsonReader.of(params, "", proto_names=not version.is_legacy)
        status = None
        if reader.has("status") and reader.value("status") != UNRECOGNIZED:
            status = TaskState.from_wire(reader.value("status"), version, field="status")
        return cls(
            context_id=reader.opt_string("contextId"),
            # Unspecified (the proto's zero, which has no presence) is no filter, as in the
            # reference; so is UNRECOGNIZED, what protobuf-es clients (@a2a-js/sdk) send for a
            # filter left unset.
            status=None if status is TaskState.UNSPECIFIED else status,
            page_size=reader.opt_int("pageSize", minimum=1, maximum=MAX_PAGE_SIZE),
            page_token=reader.opt_string("pageToken"),
            history_length=reader.opt_int("historyLength", minimum=0),
            status_timestamp_after=_at_or_after(reader, "statusTimestampAfter"),
            include_artifacts=reader.flag("includeArtifacts"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        after = self.status_timestamp_after
        return compact(
            [
                ("contextId", self.context_id),
                ("status", None if self.status is None else self.status.wire_name(version)),
                ("pageSize", self.page_size),
                ("pageToken", self.page_token),
                ("historyLength", self.history_length),
                ("statusTimestampAfter", None if after is None else format_timestamp(after)),
                ("includeArtifacts", self.include_artifacts or None),
            ]
        )


# A fraction of a second that goes on, past its microseconds, to a digit other than 0 (after
# RFC 3339's point, or ISO 8601's comma, which the parse takes too).
_FINER_THAN_MICROSECONDS = re.compile(r"[.,][0-9]{6}[0-9]*[1-9]")


def _at_or_after(reader: JsonReader, key: str) -> datetime | None:
    """A lower bound on times of whole microseconds (a datetime holds no finer ones), so the
    time given rounded up to its microsecond: a ProtoJSON Timestamp may have nanoseconds, which
    the parse drops, and a time just past a microsecond must not take in that microsecond."""
    moment = reader.opt_timestamp(key)
    text = reader.value(key)
    if moment is None or not isinstance(text, str) or _FINER_THAN_MICROSECONDS.search(text) is None:
        return moment
    if moment == datetime.max.replace(tzinfo=moment.tzinfo):  # nothing comes after it anyway
        return moment
    return moment + timedelta(microseconds=1)


def _tasks(value: Iterable[Task]) -> tuple[Task, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class ListTasksResult:
    """One page of tasks; ``next_page_token`` is "" on the last page and always sent (§3.1.4)."""

    tasks: tuple[Task, ...] = attrs.field(converter=_tasks)
    next_page_token: str
    page_size: int
    total_size: int

    @classmethod
    def from_json(cls, obj: object, version: ProtocolVersion, path: str = "result") -> ListTasksResult:
        reader = JsonReader.of(obj, path, proto_names=not version.is_legacy)
        return cls(
            tasks=[Task.from_json(item, version, at) for at, item in reader.items("tasks")],
            next_page_token=reader.opt_string("nextPageToken") or "",
            page_size=reader.opt_int("pageSize", minimum=0) or 0,
            total_size=reader.opt_int("totalSize", minimum=0) or 0,
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        return {
            "tasks": [task.to_json(version) for task in self.tasks],
            "nextPageToken": self.next_page_token,
            "pageSize": self.page_size,
            "totalSize": self.total_size,
        }
