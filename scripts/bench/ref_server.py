"""The a2a-sdk reference server for the A2A benchmark (scripts/bench/a2a.py): a TEST-ONLY oracle.

An echo agent on the a2a-sdk's own server stack (``DefaultRequestHandler``, its Starlette JSON-RPC
routes, uvicorn), with its SQLite ``DatabaseTaskStore`` or its ``InMemoryTaskStore``. Each task
goes SUBMITTED -> WORKING ("working...") -> an "echo" artifact with the user's text ->
COMPLETED, the shape of the wire captures in tests/protocol/wire/, so the store sees as many
transitions as Keel's does. JSON-RPC is served at ``/`` (1.0 with ``A2A-Version: 1.0``; 0.3 on
the same URL without the header), the card at ``/.well-known/agent-card.json``.

    python scripts/bench/ref_server.py --store memory|sqlite [--db PATH] [--port 0]

It prints ``ref serving A2A at http://127.0.0.1:PORT/`` once the socket is bound (the card answers
when uvicorn has started), and runs until SIGINT or SIGTERM. Needs the ``test`` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

# This folder holds the benchmark a2a.py, which would shadow the SDK's ``a2a`` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
# The SDK wraps every call in OpenTelemetry spans (no-op ones when no SDK is set up, still a cost)
# unless its documented switch says not to. Keel traces nothing, so neither does its reference.
os.environ.setdefault("OTEL_INSTRUMENTATION_A2A_SDK_ENABLED", "false")

import uvicorn  # noqa: E402
from a2a.helpers import get_message_text, new_task_from_user_message  # noqa: E402
from a2a.server.agent_execution import AgentExecutor, RequestContext  # noqa: E402
from a2a.server.events import EventQueue  # noqa: E402
from a2a.server.request_handlers import DefaultRequestHandler  # noqa: E402
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes  # noqa: E402
from a2a.server.tasks import DatabaseTaskStore, InMemoryTaskStore, TaskStore, TaskUpdater  # noqa: E402
from a2a.types.a2a_pb2 import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, Part  # noqa: E402
from starlette.applications import Starlette  # noqa: E402


class EchoExecutor(AgentExecutor):
    """Completes each task with the user's text, through the same states a real run goes."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        assert message is not None, "the SDK hands execute() the message it was sent"
        task = context.current_task
        if task is None:
            task = new_task_from_user_message(message)
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work(updater.new_agent_message([Part(text="working...")]))
        await updater.add_artifact([Part(text=get_message_text(message))], name="echo", last_chunk=True)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.cancel(updater.new_agent_message([Part(text="canceled")]))


def card(url: str) -> AgentCard:
    return AgentCard(
        name="echo (a2a-sdk reference)",
        description="Echoes the user's text; a reference oracle for Keel's benchmark.",
        version="1.0.0",
        supported_interfaces=[AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="Echo", description="Echoes the text it is sent.", tags=["echo"])],
    )


def task_store(db: Path | None) -> TaskStore:
    """The SDK's SQLite store on ``db``, or its in-memory store when there is no file."""
    if db is None:
        return InMemoryTaskStore()
    # Imported here: the memory variant needs no database driver.
    from sqlalchemy.ext.asyncio import create_async_engine

    # The SDK's defaults on SQLite: aiosqlite, SQLAlchemy's connection pool, SQLite's default
    # rollback journal (not WAL) and synchronous=FULL.
    return DatabaseTaskStore(create_async_engine(f"sqlite+aiosqlite:///{db}"))


def build_app(db: Path | None, url: str) -> Starlette:
    agent_card = card(url)
    store = task_store(db)
    handler = DefaultRequestHandler(agent_executor=EchoExecutor(), task_store=store, agent_card=agent_card)
    routes = [*create_agent_card_routes(agent_card), *create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True)]

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        # The table is created before the first request: left to the store's lazy first use,
        # 32 concurrent first requests race to CREATE TABLE and some fail.
        if isinstance(store, DatabaseTaskStore):
            await store.initialize()
        yield

    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The a2a-sdk echo server Keel's A2A benchmark compares against.")
    parser.add_argument("--store", choices=("sqlite", "memory"), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port; the URL is printed")
    parser.add_argument("--db", type=Path, default=None, help="the SQLite file (--store sqlite)")
    args = parser.parse_args(argv)
    if (args.store == "sqlite") != (args.db is not None):
        parser.error("--db names the SQLite file: give it with --store sqlite, and only then")
    serve(args.store, args.db, args.host, args.port)


def serve(store: str, db: Path | None, host: str, port: int) -> None:
    # Bound here, not by uvicorn, so that port 0 works and the URL is known before serving.
    # IPPROTO_TCP named outright: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and without it every keep-alive response stalls ~40 ms (Nagle against delayed ACKs).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}/"
    # What uvicorn's "auto" would pick, named so that the report can say which stack ran.
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    config = uvicorn.Config(
        build_app(db, url), http=http, loop=loop, log_level="warning", access_log=False, lifespan="on"
    )
    where = "" if db is None else f" in {db}"
    print(f"ref serving A2A at {url} (store {store}{where}; uvicorn {uvicorn.__version__} http={http} loop={loop})", flush=True)
    uvicorn.Server(config).run(sockets=[sock])

if __name__ == "__main__":
    main()
