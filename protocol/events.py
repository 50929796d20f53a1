"""What a stream carries, and the results of a send.

1.0 wraps each stream item in a ``StreamResponse`` oneof (``{"task": …}``, ``{"message": …}``,
``{"statusUpdate": …}``, ``{"artifactUpdate": …}``) and a send result in the same way. 0.3 sends
the object itself, told apart by ``kind``, and marks the last status update ``final``.
"""

from __future__ import annotations

from typing import Union

import attrs

from protocol._json import JsonObject, JsonReader, compact
from protocol.errors import InvalidParams
from protocol.messages import Message
from protocol.tasks import Artifact, Task, TaskStatus
from protocol.versions import ProtocolVersion

V1 = ProtocolVersion.V1_0
V03 = ProtocolVersion.V0_3


@attrs.frozen(kw_only=True)
class TaskStatusUpdateEvent:
    task_id: str
    context_id: str
    status: TaskStatus
    metadata: JsonObject | None = None

    @classmethod
    def from_json(cls, obj: object, version: ProtocolVersion, path: str) -> TaskStatusUpdateEvent:
        reader = JsonReader.of(obj, path, proto_names=not version.is_legacy)
        if version is V03:
            reader.literal("kind", "status-update")
            reader.opt_bool("final")  # derived from the state on the way out; only its type is checked
        return cls(
            task_id=reader.string("taskId"),
            context_id=reader.string("contextId"),
            status=TaskStatus.from_json(reader.value("status"), version, reader.at("status")),
            metadata=reader.opt_object("metadata"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        fields = [("taskId", self.task_id), ("contextId", self.context_id), ("status", self.status.to_json(version))]
        if version is V1:
            return compact([*fields, ("metadata", self.metadata)])
        # 0.3 `final` marks the last event of the stream. Keel closes a stream on interrupted
        # states too (spec 1.0 §3.1.2), so it says final there as well; the reference server
        # sends final:false and then closes, leaving a 0.3 client waiting (a2a-protocol.md 2.4).
        final = self.status.state.ends_stream
        return compact([("kind", "status-update"), *fields, ("final", final), ("metadata", self.metadata)])


@attrs.frozen(kw_only=True)
class TaskArtifactUpdateEvent:
    """A new artifact, or (``append``) more parts for one already sent with the same id."""

    task_id: str
    context_id: str
    artifact: Artifact
    append: bool = False
    last_chunk: bool = False
    metadata: JsonObject | None = None

    @classmethod
    def from_json(cls, obj: object, version: ProtocolVersion, path: str) -> TaskArtifactUpdateEvent:
        reader = JsonReader.of(obj, path, proto_names=not version.is_legacy)
        if version is V03:
            reader.literal("kind", "artifact-update")
        return cls(
            task_id=reader.string("taskId"),
            context_id=reader.string("contextId"),
            artifact=Artifact.from_json(reader.value("artifact"), version, reader.at("artifact")),
            append=reader.flag("append"),
            last_chunk=reader.flag("lastChunk"),
            metadata=reader.opt_object("metadata"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        fields = [
            ("taskId", self.task_id),
            ("contextId", self.context_id),
            ("artifact", self.artifact.to_json(version)),
        ]
        if version is V1:
            # proto3 leaves false booleans out.
            flags: list[tuple[str, object]] = [("append", self.append or None), ("lastChunk", self.last_chunk or None)]
            return compact([*fields, *flags, ("metadata", self.metadata)])
        flags = [("append", self.append), ("lastChunk", self.last_chunk)]
        return compact([("kind", "artifact-update"), *fields, *flags, ("metadata", self.metadata)])


StreamEvent = Union[Task, Message, TaskStatusUpdateEvent, TaskArtifactUpdateEvent]
SendResult = Union[Task, Message]

_V1_KEYS: dict[str, type[StreamEvent]] = {
    "task": Task,
    "message": Message,
    "statusUpdate": TaskStatusUpdateEvent,
    "artifactUpdate": TaskArtifactUpdateEvent,
}
_V03_KINDS: dict[str, type[StreamEvent]] = {
    "task": Task,
    "message": Message,
    "status-update": TaskStatusUpdateEvent,
    "artifact-update": TaskArtifactUpdateEvent,
}


def ends_stream(event: StreamEvent) -> bool:
    """Whether a stream closes after this event: a lone message, or a task or status update in a
    terminal or interrupted state (spec 1.0 §3.1.2; the reference closes on input-required too)."""
    if isinstance(event, Message):
        return True
    if isinstance(event, Task):
        return event.status.state.ends_stream
    if isinstance(event, TaskStatusUpdateEvent):
        return event.status.state.ends_stream
    return False


def stream_event_to_json(event: StreamEvent, version: ProtocolVersion) -> JsonObject:
    """The ``result`` of one stream event (and of a send, for a Task or Message)."""
    if version is V03:
        return event.to_json(version)
    for key, cls in _V1_KEYS.items():
        if isinstance(event, cls):
            return {key: event.to_json(version)}
    raise TypeError(f"not a stream event: {type(event).__name__}")


def stream_event_from_json(obj: object, version: ProtocolVersion, path: str = "result") -> StreamEvent:
    """Decode a stream event or send result; raises InvalidParams naming the bad field."""
    reader = JsonReader.of(obj, path, proto_names=not version.is_legacy)
    if version is V03:
        kind = reader.value("kind")
        if not isinstance(kind, str) or kind not in _V03_KINDS:
            raise InvalidParams(reader.at("kind"), "one of " + ", ".join(map(repr, _V03_KINDS)), got=kind)
        return _V03_KINDS[kind].from_json(reader.obj, version, path)
    present = [key for key in _V1_KEYS if reader.has(key)]
    if len(present) != 1:
        choices = ", ".join(map(repr, _V1_KEYS))
        raise InvalidParams(path, f"an object with exactly one of {choices}", got=reader.obj)
    key = present[0]
    return _V1_KEYS[key].from_json(reader.value(key), version, reader.at(key))


def send_result_to_json(result: SendResult, version: ProtocolVersion) -> JsonObject:
    """The ``result`` of SendMessage / message/send: ``{"task": …}`` or ``{"message": …}`` in 1.0."""
    return stream_event_to_json(result, version)


def send_result_from_json(obj: object, version: ProtocolVersion, path: str = "result") -> SendResult:
    event = stream_event_from_json(obj, version, path)
    if not isinstance(event, (Task, Message)):
        raise InvalidParams(path, "a task or a message", got=obj)
    return event
