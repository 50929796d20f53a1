"""Messages: one turn of the conversation, from the user or from the agent."""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from protocol._json import JsonObject, JsonReader, compact, str_tuple
from protocol.errors import InvalidParams
from protocol.parts import Part, part_from_json
from protocol.versions import ProtocolVersion


class Role(enum.Enum):
    """Who wrote a message. The value is the 0.3 wire string."""

    USER = "user"
    AGENT = "agent"

    def wire_name(self, version: ProtocolVersion) -> str:
        """``ROLE_USER`` in 1.0 (ProtoJSON enum name), ``user`` in 0.3."""
        return f"ROLE_{self.name}" if version is ProtocolVersion.V1_0 else self.value

    @classmethod
    def from_wire(cls, name: object, version: ProtocolVersion, *, field: str) -> Role:
        # In 1.0, as ProtoJSON allows, also the enum's number in a2a.proto (0 is unspecified).
        if version is ProtocolVersion.V1_0 and type(name) is int and name in (1, 2):
            return cls.USER if name == 1 else cls.AGENT
        for role in cls:
            if role.wire_name(version) == name:
                return role
        choices = " or ".join(repr(role.wire_name(version)) for role in cls)
        other = version.other
        if any(role.wire_name(other) == name for role in cls):  # the right role in the other version's spelling
            raise InvalidParams(
                field,
                problem=f"must be {choices} in A2A {version.value}, got {name!r}, the A2A {other.value} spelling; "
                f"an A2A {other.value} client sends its requests {other.how_sent}",
            )
        raise InvalidParams(field, choices, got=name)


def _parts(value: Iterable[Part]) -> tuple[Part, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Message:
    message_id: str
    role: Role
    parts: tuple[Part, ...] = attrs.field(converter=_parts)
    task_id: str | None = None
    context_id: str | None = None
    metadata: JsonObject | None = None
    extensions: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    reference_task_ids: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)

    @classmethod
    def from_json(cls, obj: object, version: ProtocolVersion, path: str = "message") -> Message:
        """Decode a message; raises InvalidParams naming the first bad field under ``path``.

        A message needs a messageId, a role and at least one part.
        """
        reader = JsonReader.of(obj, path, proto_names=not version.is_legacy)
        if version is ProtocolVersion.V0_3:
            reader.literal("kind", "message")
        return cls(
            message_id=reader.string("messageId"),
            role=Role.from_wire(reader.sent("role"), version, field=reader.at("role")),
            parts=[
                part_from_json(item, version, item_path) for item_path, item in reader.items("parts", required=True)
            ],
            task_id=reader.opt_string("taskId"),
            context_id=reader.opt_string("contextId"),
            metadata=reader.opt_object("metadata"),
            extensions=reader.strings("extensions"),
            reference_task_ids=reader.strings("referenceTaskIds"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        kind = [("kind", "message")] if version is ProtocolVersion.V0_3 else []
        return compact(
            [
                *kind,
                ("messageId", self.message_id),
                ("contextId", self.context_id),
                ("taskId", self.task_id),
                ("role", self.role.wire_name(version)),
                ("parts", [part.to_json(version) for part in self.parts]),
                ("metadata", self.metadata),
                ("extensions", list(self.extensions)),
                ("referenceTaskIds", list(self.reference_task_ids)),
            ]
        )
