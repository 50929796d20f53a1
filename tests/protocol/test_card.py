"""The agent card in 1.0, 0.3, and the combined form served at the well-known path."""

from __future__ import annotations

import attrs
import pytest

from protocol import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentProvider,
    AgentSkill,
    InvalidParams,
    ProtocolVersion,
)

V1, V03 = ProtocolVersion.V1_0, ProtocolVersion.V0_3
URL = "http://127.0.0.1:8000/"


def card(*interfaces: AgentInterface, extended: bool | None = None) -> AgentCard:
    return AgentCard(
        name="Keel",
        description="On-call incident assistant",
        version="0.1.0",
        supported_interfaces=interfaces
        or [AgentInterface(url=URL, protocol_binding="JSONRPC", protocol_version="1.0")],
        capabilities=AgentCapabilities(streaming=True, push_notifications=False, extended_agent_card=extended),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain", "application/json"],
        skills=[AgentSkill(id="triage", name="Triage", description="Triage an incident.", tags=["incident"])],
        provider=AgentProvider(organization="keel", url="https://example.invalid"),
    )


BOTH = (
    AgentInterface(url=URL, protocol_binding="JSONRPC", protocol_version="1.0"),
    AgentInterface(url=URL, protocol_binding="JSONRPC", protocol_version="0.3"),
)


def test_card_1_0_lists_interfaces_and_keeps_extended_card_in_capabilities() -> None:
    encoded = card(*BOTH, extended=True).to_json(V1)
    assert encoded["supportedInterfaces"][1] == {"url": URL, "protocolBinding": "JSONRPC", "protocolVersion": "0.3"}
    assert encoded["capabilities"] == {"streaming": True, "pushNotifications": False, "extendedAgentCard": True}
    assert "url" not in encoded and "supportsAuthenticatedExtendedCard" not in encoded


def test_card_0_3_has_one_url_and_a_top_level_extended_card_flag() -> None:
    encoded = card(*BOTH, extended=True).to_json(V03)
    assert (encoded["url"], encoded["preferredTransport"], encoded["protocolVersion"]) == (URL, "JSONRPC", "0.3")
    assert encoded["supportsAuthenticatedExtendedCard"] is True
    assert encoded["capabilities"] == {"streaming": True, "pushNotifications": False}
    assert "supportedInterfaces" not in encoded and "additionalInterfaces" not in encoded


def test_card_0_3_lists_other_0_3_endpoints_as_additional_interfaces() -> None:
    rest = AgentInterface(url=URL + "rest", protocol_binding="HTTP+JSON", protocol_version="0.3.0")
    encoded = card(*BOTH, rest).to_json(V03)
    assert encoded["additionalInterfaces"] == [{"url": URL + "rest", "transport": "HTTP+JSON"}]
    decoded = AgentCard.from_json(encoded, V03)
    assert [(i.url, i.protocol_binding) for i in decoded.supported_interfaces] == [
        (URL, "JSONRPC"),
        (URL + "rest", "HTTP+JSON"),
    ]


def test_card_without_a_0_3_interface_still_gives_0_3_clients_an_endpoint() -> None:
    encoded = card().to_json(V03)
    assert (encoded["url"], encoded["protocolVersion"]) == (URL, "0.3.0")


def test_card_well_known_adds_the_0_3_endpoint_fields_only_when_0_3_is_served() -> None:
    assert card().well_known_json() == card().to_json(V1)
    served = card(*BOTH).well_known_json()
    assert (served["url"], served["preferredTransport"], served["protocolVersion"]) == (URL, "JSONRPC", "0.3")
    assert AgentCard.from_json(served, V03).name == "Keel"


@pytest.mark.parametrize("version", list(ProtocolVersion))
def test_card_round_trips(version: ProtocolVersion) -> None:
    original = card(*BOTH, extended=False)
    assert AgentCard.from_json(original.to_json(version), version).to_json(version) == original.to_json(version)


def test_card_needs_an_interface() -> None:
    with pytest.raises(ValueError, match="at least one supported interface"):
        attrs.evolve(card(), supported_interfaces=())
    with pytest.raises(InvalidParams, match=r"'card\.supportedInterfaces' must be a non-empty array"):
        AgentCard.from_json({**card().to_json(V1), "supportedInterfaces": []}, V1)


def test_card_bad_skill_is_named_by_index() -> None:
    encoded = card().to_json(V1)
    encoded["skills"] = [{"id": "s", "name": "S", "description": "d", "tags": ["x", 3]}]
    with pytest.raises(InvalidParams, match=r"'card\.skills\[0\]\.tags\[1\]' must be a string, got integer 3"):
        AgentCard.from_json(encoded, V1)
