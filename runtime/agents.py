"""The agent Keel serves by default, and its card."""

from __future__ import annotations

import functools
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

from protocol import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
from runtime.agent import AgentSpec, Tool
from runtime.tasks import INPUT_MODES

SYSTEM_PROMPT = (
    "You are Keel, a careful assistant. Answer plainly and briefly. Use a tool when it gives you a fact "
    "you do not have; never invent one."
)


async def _clock(_arguments: dict[str, Any]) -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


CLOCK = Tool(
    name="clock",
    description="The current date and time in UTC, ISO 8601.",
    parameters={"type": "object", "properties": {}, "additionalProperties": False},
    invoke=_clock,
    timeout_s=5,
)


def default_agent(*, max_model_calls: int) -> AgentSpec:
    # The runner's runs give a steer that arrives while the answer is being written one more
    # round, as often as the budget allows (see SteerGate); a library caller chooses its own.
    return AgentSpec(
        system_prompt=SYSTEM_PROMPT,
        tools=(CLOCK,),
        max_steps=max_model_calls,
        max_model_calls=max_model_calls,
    )


@functools.cache
def app_version() -> str:
    """Keel's installed version, read from its package metadata on disk: once (the server reads
    it in a thread as it starts), not for every agent card it serves."""
    try:
        return metadata.version("keel")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def agent_card(url: str) -> AgentCard:
    """What clients learn at /.well-known/agent-card.json. It never carries the system prompt."""
    return AgentCard(
        name="Keel",
        description="A durable agent: conversations and tasks survive restarts, and a working run can be steered or canceled.",
        version=app_version(),
        supported_interfaces=(
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0"),
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="0.3"),
        ),
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=INPUT_MODES,
        default_output_modes=("text/plain",),
        skills=(
            AgentSkill(
                id="conversation",
                name="Conversation",
                description="Answers questions in a conversation that can be resumed, steered and canceled.",
                tags=("chat", "durable"),
            ),
        ),
    )
