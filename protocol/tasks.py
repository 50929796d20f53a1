"""Tasks: their status, the artifacts they produce, their message history, and history trimming."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

import attrs

from protocol._json import JsonObject, JsonReader, compact, format_timestamp, str_tuple
from protocol.messages import Message
from protocol.parts import Part, part_from_json
from protocol.states import TaskState
from protocol.versions import ProtocolVersion

V03 = ProtocolVersion.V0_3


def _is_aware(instance: object, attribute: attrs.Attribute[datetime | None], value: datetime | None) -> None:
    if value is not None and value.utcoffset() is None:
        raise ValueError(f"{attribute.name} must be a timezone-aware datetime, got the naive {value!r}")


@attrs.frozen(kw_only=True)
class TaskStatus:
    state: TaskState
    message: Message | None = None
    """What the agent said with this state ("working...", "need more input", "canceled")."""
    timestamp: datetime | None = attrs.field(default=None, validator=_is_aware)

    @classmethod
    def from_json(cls, obj: object, version: ProtocolVersion, path: str) -> TaskStatus:
        reader = JsonReader.of(obj, path, proto_names=not version.is_legacy)
        message = None
        if reader.has("message"):
            message = Message.from_json(reader.value("message"), version, reader.at("message"))
        return cls(
            state=TaskState.from_wire(reader.value("state"), version, field=reader.at("state")),
            message=message,
            timestamp=reader.opt_timestamp("timestamp"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        return compact(
            [
                ("state", self.state.wire_name(version)),
                ("message", None if self.message is None else self.message.to_json(version)),
                ("timestamp", None if self.timestamp is None else format_timestamp(self.timestamp)),
            ]
        )


def _parts(value: Iterable[Part]) -> tuple[Part, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Artifact:
    artifact_id: str
    parts: tuple[Part, ...] = attrs.field(converter=_parts)
    name: str | None = None
    description: str | None = None
    metadata: JsonObject | None = None
    extensions: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)

    @classmethod
    def from_json(cls, obj: object, version: ProtocolVersion, path: str) -> Artifact:
        reader = JsonReader.of(obj, path, proto_names=not version.is_legacy)
        return cls(
            artifact_id=reader.string("artifactId"),
            parts=[
                part_from_json(item, version, item_path) for item_path, item in reader.items("parts", required=True)
            ],
            name=reader.opt_string("name"),
            description=reader.opt_string("description"),
            metadata=reader.opt_object("metadata"),
            extensions=reader.strings("extensions"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        return compact(
            [
                ("artifactId", self.artifact_id),
                ("name", self.name),
                ("description", self.description),
                ("parts", [part.to_json(version) for part in self.parts]),
                ("metadata", self.metadata),
                ("extensions", list(self.extensions)),
            ]
        )


def _artifacts(value: Iterable[Artifact]) -> tuple[Artifact, ...]:
    return tuple(value)


def _messages(value: Iterable[Message]) -> tuple[Message, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Task:
    """A unit of work; ``context_id`` is the conversation (Keel's session) it belongs to."""

    id: str
    context_id: str
    status: TaskStatus
    artifacts: tuple[Artifact, ...] = attrs.field(default=(), converter=_artifacts)
    history: tuple[Message, ...] = attrs.field(default=(), converter=_messages)
    metadata: JsonObject | None = None

    @classmethod
    def from_json(cls, obj: object, version: ProtocolVersion, path: str = "task") -> Task:
        """Decode a task; raises InvalidParams naming the first bad field under ``path``."""
        reader = JsonReader.of(obj, path, proto_names=not version.is_legacy)
        if version is V03:
            reader.literal("kind", "task")
        return cls(
            id=reader.string("id"),
            context_id=reader.string("contextId"),
            status=TaskStatus.from_json(reader.value("status"), version, reader.at("status")),
            artifacts=[Artifact.from_json(item, version, at) for at, item in reader.items("artifacts")],
            history=[Message.from_json(item, version, at) for at, item in reader.items("history")],
            metadata=reader.opt_object("metadata"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        return compact(
            [
                ("kind", "task" if version is V03 else None),
                ("id", self.id),
                ("contextId", self.context_id),
                ("status", self.status.to_json(version)),
                ("artifacts", [artifact.to_json(version) for artifact in self.artifacts]),
                ("history", [message.to_json(version) for message in self.history]),
                ("metadata", self.metadata),
            ]
        )


def trim_history(task: Task, history_length: int | None, version: ProtocolVersion) -> Task:
    """The task with only as much history as a client asked for (``historyLength``).

    1.0 (spec §3.2.4): unset keeps everything, 0 keeps nothing (the ``history`` key is then
    omitted), N > 0 keeps the last N messages. 0.3 never defined 0, and the reference SDK reads
    it as "unlimited" (a2a-sdk #1312), so in 0.3 both unset and 0 keep everything.
    """
    if history_length is None or (history_length == 0 and version is V03):
        return task
    if history_length < 0:
        raise ValueError(f"history_length must be None or at least 0, got {history_length}")
    kept = task.history[-history_length:] if history_length else ()
    return attrs.evolve(task, history=kept)
