"""A process that runs one agent turn and blocks inside its tool, for a test to kill there.

Usage: python agent_child.py DB_PATH MODEL_BASE_URL SESSION_ID. Prints "paging" once its
``page_oncall`` tool has been called; the tool never returns.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import trio

from persistence.session import Session
from persistence.sessions import open_session_store
from persistence.transcript import Message
from runtime.agent import AgentRun, AgentSpec, Tool
from runtime.models import ModelConfig, open_model_client


async def page_oncall(_arguments: dict[str, Any]) -> str:
    print("paging", flush=True)
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def main(path: str, base_url: str, session_id: str) -> None:
    tool = Tool("page_oncall", "Page the on-call team.", {"type": "object"}, page_oncall)
    question = [Message(role="user", text="Why did the vault lease expire?")]
    async with open_session_store(Path(path)) as store, open_model_client(ModelConfig(base_url=base_url)) as client:
        await AgentRun(client, AgentSpec(tools=[tool]), question, session=Session.open(session_id, store)).run()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
