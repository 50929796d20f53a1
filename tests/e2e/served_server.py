"""The real root nursery (runtime.server.serve) in the test's process, on a loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from runtime.agent import AgentSpec
from runtime.config import Config
from runtime.server import Started, serve


@attrs.define(eq=False)
class Running:
    url: str
    shutdown: trio.Event
    stopped: trio.Event


@asynccontextmanager
async def running_server(
    state_dir: Path, model_url: str, *, agent: AgentSpec | None = None, drain_timeout_s: float = 10, **settings: Any
) -> AsyncIterator[Running]:
    """Serve until the block exits (then shut down gracefully and wait for it). ``settings``
    are more of the Config's fields (``model_api_key``, say)."""
    config = attrs.evolve(
        Config(), port=0, state_dir=state_dir, model_base_url=model_url, drain_timeout_s=drain_timeout_s, **settings
    )
    shutdown, stopped = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:

        async def run(*, task_status: trio.TaskStatus[Started]) -> None:
            try:
                await serve(config, shutdown, agent=agent, task_status=task_status)
            finally:
                stopped.set()

        with trio.fail_after(30):
            started: Started = await nursery.start(run)
        try:
            yield Running(url=started.url, shutdown=shutdown, stopped=stopped)
        finally:
            shutdown.set()
