"""Drive Keel end to end: a real `python -m runtime serve` process, or the server in-process,
over real HTTP on loopback, with the fake model server as the model."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from protocol import SseParser
from runtime.models.transport import with_whole_body

STARTUP_DEADLINE_S = 30
SERVING = re.compile(rb"keel serving A2A at (\S+)")


@attrs.define(eq=False)
class KeelProcess:
    """A `python -m runtime serve` child process; stop it with ``terminate()`` or ``kill()``."""

    process: trio.Process
    url: str = ""
    output: bytearray = attrs.field(factory=bytearray)

    async def terminate(self, sig: signal.Signals = signal.SIGTERM) -> int:
        self.process.send_signal(sig)
        return await self.wait()

    async def kill(self) -> int:
        self.process.kill()  # SIGKILL: no cleanup of any kind
        return await self.wait()

    async def wait(self) -> int:
        with trio.fail_after(STARTUP_DEADLINE_S):
            return await self.process.wait()

    async def read_output(self, url_found: trio.Event) -> None:
        """Keep what the server writes in ``output`` until it ends, and where it serves in ``url``
        once it says so: ``url_found`` is set then, or when its output ends without it."""
        assert self.process.stdout is not None
        async for chunk in self.process.stdout:
            self.output.extend(chunk)
            match = SERVING.search(self.output)
            if match and not url_found.is_set():
                self.url = match.group(1).decode()
                url_found.set()
        url_found.set()


# A child started as from a terminal: the signals a shell may have left ignored for the tests
# (SIGINT and SIGQUIT in a script's background job, SIGHUP under nohup) at their defaults again, so
# that what a test sends it does what it does to a process started in a terminal.
AS_FROM_A_TERMINAL = ("env", "--default-signal=HUP,INT,QUIT,TERM")


def serve_command(state_dir: Path, model_url: str, *extra: str, started_by: Sequence[str] = ()) -> list[str]:
    """``python -m runtime serve`` on a port of its choosing, started as from a terminal, through
    ``started_by`` if given (a command that runs the rest)."""
    return [
        *AS_FROM_A_TERMINAL, *started_by, sys.executable, "-m", "runtime", "serve", "--port", "0",
        "--state-dir", str(state_dir), "--model-base-url", model_url, *extra,
    ]  # fmt: skip


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@asynccontextmanager
async def keel_process(state_dir: Path, model_url: str, *extra: str) -> AsyncIterator[KeelProcess]:
    """Start the server and wait for it to say where it serves; kill it if still running after."""
    async with started_keel(serve_command(state_dir, model_url, *extra)) as keel:
        yield keel


@asynccontextmanager
async def started_keel(command: Sequence[str], *, cwd: Path | None = None) -> AsyncIterator[KeelProcess]:
    """Run ``command`` (a serve, however it is started) in ``cwd`` and wait for it to say where it
    serves; kill it if still running after."""
    process = await trio.lowlevel.open_process(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(), cwd=cwd
    )
    keel = KeelProcess(process)
    try:
        async with trio.open_nursery() as nursery:
            url_found = trio.Event()
            nursery.start_soon(keel.read_output, url_found)
            with trio.fail_after(STARTUP_DEADLINE_S):
                while not url_found.is_set():
                    if process.poll() is not None:
                        raise AssertionError(f"serve exited with {process.returncode}:\n{keel.output.decode()}")
                    with trio.move_on_after(0.05):
                        await url_found.wait()
            if not keel.url:  # its output ended first
                with trio.fail_after(STARTUP_DEADLINE_S):
                    code = await process.wait()
                raise AssertionError(f"serve exited with {code}:\n{keel.output.decode()}")
            yield keel
            nursery.cancel_scope.cancel()
    finally:
        if process.poll() is None:
            process.kill()
        with trio.move_on_after(10, shield=True):
            await process.wait()


async def run_serve_to_exit(state_dir: Path, model_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run serve expecting it to refuse to start: its exit code and output."""
    return await run_to_exit(serve_command(state_dir, model_url, *extra))


async def run_to_exit(command: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (a ``check``, a ``state`` command, a serve that refuses to start) to its
    end: its exit code and output."""
    with trio.fail_after(STARTUP_DEADLINE_S):
        result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False, env=child_env())
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(), result.stderr.decode())


def user_message(text: str, *, context_id: str | None = None, task_id: str | None = None, version: str = "1.0") -> dict[str, Any]:
    message: dict[str, Any] = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER" if version == "1.0" else "user"}
    message["parts"] = [{"text": text}] if version == "1.0" else [{"kind": "text", "text": text}]
    if version == "0.3":
        message["kind"] = "message"
    if context_id:
        message["contextId"] = context_id
    if task_id:
        message["taskId"] = task_id
    return message


def headers(version: str) -> dict[str, str]:
    return {"A2A-Version": version} if version == "1.0" else {}


async def rpc(client: httpx.AsyncClient, url: str, method: str, params: dict[str, Any], *, version: str = "1.0") -> dict[str, Any]:
    body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
    # A workload cancelled mid-send leaves no unfinished body generator behind (a ResourceWarning).
    response = await client.send(with_whole_body(client.build_request("POST", url, json=body, headers=headers(version))))
    result: dict[str, Any] = response.json()
    return result


async def stream(
    client: httpx.AsyncClient, url: str, method: str, params: dict[str, Any], *, version: str = "1.0", limit: int | None = None
) -> list[dict[str, Any]]:
    """The JSON-RPC responses of an SSE stream, until it closes (or ``limit`` of them)."""
    body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
    events: list[dict[str, Any]] = []
    parser = SseParser()
    request = with_whole_body(client.build_request("POST", url, json=body, headers=headers(version)))
    response = await client.send(request, stream=True)
    try:
        async for chunk in response.aiter_bytes():
            for event in parser.feed(chunk):
                if event.data:
                    events.append(json.loads(event.data))
            if limit is not None and len(events) >= limit:
                break
    finally:
        await response.aclose()
    return events


def stored_task(state_dir: Path, task_id: str) -> tuple[str, dict[str, Any]] | None:
    """The task's state and JSON as tasks.db holds them, read with a read-only connection."""
    path = state_dir / "tasks.db"
    if not path.exists():
        return None
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT state, task FROM tasks WHERE id = ?", (task_id,)).fetchone()
    finally:
        conn.close()
    return None if row is None else (row[0], json.loads(row[1]))


async def wait_stored_state(state_dir: Path, task_id: str, states: Sequence[str], *, deadline_s: float = 30) -> str:
    """Poll tasks.db (in a thread) until the task is in one of ``states``."""
    with trio.fail_after(deadline_s):
        while True:
            found = await trio.to_thread.run_sync(stored_task, state_dir, task_id)
            if found is not None and found[0] in states:
                return found[0]
            await trio.sleep(0.02)  # polling interval against a deadline, not a wait for an event
