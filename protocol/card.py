"""The agent card: who the agent is, where it listens, and what it can do.

One model, two encodings. 1.0 lists every endpoint in ``supportedInterfaces`` and keeps the
extended-card switch under ``capabilities``; 0.3 has one top-level ``url`` with its
``preferredTransport`` and ``protocolVersion``, other endpoints under ``additionalInterfaces``,
and a top-level ``supportsAuthenticatedExtendedCard``. Security schemes, signatures and
capability extensions are not modelled yet; decoding ignores them.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from protocol._json import JsonObject, JsonReader, compact, str_tuple
from protocol.versions import ProtocolVersion, requested_version

V1 = ProtocolVersion.V1_0


@attrs.frozen(kw_only=True)
class AgentInterface:
    """One endpoint: ``protocol_binding`` is JSONRPC, GRPC or HTTP+JSON; the version e.g. "1.0"."""

    url: str
    protocol_binding: str
    protocol_version: str
    tenant: str | None = None

    @property
    def speaks(self) -> str:
        """The Major.Minor of ``protocol_version`` ("0.3.0" -> "0.3")."""
        return requested_version(self.protocol_version)

    def to_json(self) -> JsonObject:
        fields = [("url", self.url), ("protocolBinding", self.protocol_binding), ("tenant", self.tenant)]
        return compact([*fields, ("protocolVersion", self.protocol_version)])


@attrs.frozen(kw_only=True)
class AgentProvider:
    organization: str
    url: str

    @classmethod
    def from_json(cls, reader: JsonReader) -> AgentProvider:
        return cls(organization=reader.string("organization"), url=reader.string("url"))

    def to_json(self) -> JsonObject:
        return {"url": self.url, "organization": self.organization}


@attrs.frozen(kw_only=True)
class AgentCapabilities:
    """Optional switches; None means "not said", which a client reads as false."""

    streaming: bool | None = None
    push_notifications: bool | None = None
    extended_agent_card: bool | None = None
    """1.0 ``capabilities.extendedAgentCard``; 0.3 ``supportsAuthenticatedExtendedCard`` on the card."""

    @classmethod
    def from_json(cls, card: JsonReader, version: ProtocolVersion) -> AgentCapabilities:
        """Read the capabilities of ``card`` (the whole card: 0.3 keeps one flag outside them)."""
        reader = card.child("capabilities")
        extended = reader if version is V1 else card
        return cls(
            streaming=reader.opt_bool("streaming"),
            push_notifications=reader.opt_bool("pushNotifications"),
            extended_agent_card=extended.opt_bool(
                "extendedAgentCard" if version is V1 else "supportsAuthenticatedExtendedCard"
            ),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        flags = [("streaming", self.streaming), ("pushNotifications", self.push_notifications)]
        if version is V1:
            return compact([*flags, ("extendedAgentCard", self.extended_agent_card)])
        return compact(flags)


@attrs.frozen(kw_only=True)
class AgentSkill:
    id: str
    name: str
    description: str
    tags: tuple[str, ...] = attrs.field(converter=str_tuple)
    examples: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    input_modes: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    output_modes: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)

    @classmethod
    def from_json(cls, obj: object, path: str) -> AgentSkill:
        reader = JsonReader.of(obj, path)
        return cls(
            id=reader.string("id"),
            name=reader.string("name"),
            description=reader.text("description"),
            tags=reader.strings("tags"),
            examples=reader.strings("examples"),
            input_modes=reader.strings("inputModes"),
            output_modes=reader.strings("outputModes"),
        )

    def to_json(self) -> JsonObject:
        head = {"id": self.id, "name": self.name, "description": self.description, "tags": list(self.tags)}
        modes = [("inputModes", list(self.input_modes)), ("outputModes", list(self.output_modes))]
        return {**head, **compact([("examples", list(self.examples)), *modes])}


def _interfaces(value: Iterable[AgentInterface]) -> tuple[AgentInterface, ...]:
    return tuple(value)


def _skills(value: Iterable[AgentSkill]) -> tuple[AgentSkill, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class AgentCard:
    name: str
    description: str
    version: str
    supported_interfaces: tuple[AgentInterface, ...] = attrs.field(converter=_interfaces)
    capabilities: AgentCapabilities = AgentCapabilities()
    default_input_modes: tuple[str, ...] = attrs.field(converter=str_tuple)
    default_output_modes: tuple[str, ...] = attrs.field(converter=str_tuple)
    skills: tuple[AgentSkill, ...] = attrs.field(converter=_skills)
    provider: AgentProvider | None = None
    documentation_url: str | None = None
    icon_url: str | None = None

    @supported_interfaces.validator
    def _check_interfaces(self, attribute: object, value: tuple[AgentInterface, ...]) -> None:
        if not value:
            raise ValueError("an AgentCard needs at least one supported interface")

    @classmethod
    def from_json(cls, obj: object, version: ProtocolVersion, path: str = "card") -> AgentCard:
        """Decode a card; raises InvalidParams naming the first bad field under ``path``."""
        reader = JsonReader.of(obj, path)
        provider = reader.opt_child("provider")
        return cls(
            name=reader.string("name"),
            description=reader.text("description"),
            version=reader.string("version"),
            supported_interfaces=_interfaces_v1(reader) if version is V1 else _interfaces_v03(reader),
            capabilities=AgentCapabilities.from_json(reader, version),
            default_input_modes=reader.strings("defaultInputModes"),
            default_output_modes=reader.strings("defaultOutputModes"),
            skills=[AgentSkill.from_json(item, at) for at, item in reader.items("skills")],
            provider=None if provider is None else AgentProvider.from_json(provider),
            documentation_url=reader.opt_string("documentationUrl"),
            icon_url=reader.opt_string("iconUrl"),
        )

    def to_json(self, version: ProtocolVersion) -> JsonObject:
        head: JsonObject = {"name": self.name, "description": self.description}
        if version is V1:
            head["supportedInterfaces"] = [interface.to_json() for interface in self.supported_interfaces]
        else:
            head.update(_endpoints_v03(self.supported_interfaces))
        body = {
            "version": self.version,
            "capabilities": self.capabilities.to_json(version),
            "defaultInputModes": list(self.default_input_modes),
            "defaultOutputModes": list(self.default_output_modes),
            "skills": [skill.to_json() for skill in self.skills],
        }
        optional: list[tuple[str, object]] = [
            ("provider", None if self.provider is None else self.provider.to_json()),
            ("documentationUrl", self.documentation_url),
            ("iconUrl", self.icon_url),
        ]
        if version is not V1:
            optional.append(("supportsAuthenticatedExtendedCard", self.capabilities.extended_agent_card))
        return {**head, **body, **compact(optional)}

    def well_known_json(self) -> JsonObject:
        """The card served at ``/.well-known/agent-card.json``: the 1.0 card, plus the 0.3
        top-level ``url``, ``preferredTransport`` and ``protocolVersion`` of the first 0.3
        interface when there is one, so 0.3 clients find their endpoint too. This is what the
        reference server serves (wire/agent_card.txt); a strict 1.0 schema rejects the extras.
        """
        card = self.to_json(V1)
        legacy = next((i for i in self.supported_interfaces if i.speaks == "0.3"), None)
        if legacy is not None:
            card.update(preferredTransport=legacy.protocol_binding, protocolVersion=legacy.protocol_version)
            card["url"] = legacy.url
        return card


def _interfaces_v1(reader: JsonReader) -> list[AgentInterface]:
    interfaces = []
    for at, item in reader.items("supportedInterfaces", required=True):
        entry = JsonReader.of(item, at)
        interfaces.append(
            AgentInterface(
                url=entry.string("url"),
                protocol_binding=entry.string("protocolBinding"),
                protocol_version=entry.string("protocolVersion"),
                tenant=entry.opt_string("tenant"),
            )
        )
    return interfaces


def _interfaces_v03(reader: JsonReader) -> list[AgentInterface]:
    version = reader.opt_string("protocolVersion") or "0.3.0"
    binding = reader.opt_string("preferredTransport") or "JSONRPC"
    interfaces = [AgentInterface(url=reader.string("url"), protocol_binding=binding, protocol_version=version)]
    for at, item in reader.items("additionalInterfaces"):
        entry = JsonReader.of(item, at)
        interface = AgentInterface(
            url=entry.string("url"), protocol_binding=entry.string("transport"), protocol_version=version
        )
        if interface not in interfaces:
            interfaces.append(interface)
    return interfaces


def _endpoints_v03(interfaces: tuple[AgentInterface, ...]) -> JsonObject:
    """0.3's one main endpoint and its ``additionalInterfaces``, from the 0.3 interfaces."""
    legacy = [interface for interface in interfaces if interface.speaks == "0.3"]
    main = legacy[0] if legacy else interfaces[0]
    others = [{"url": i.url, "transport": i.protocol_binding} for i in legacy if i is not main]
    endpoint = {
        "protocolVersion": main.protocol_version if legacy else "0.3.0",
        "url": main.url,
        "preferredTransport": main.protocol_binding,
    }
    return {**endpoint, **compact([("additionalInterfaces", others)])}
