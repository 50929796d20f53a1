"""The scripts the README runs, run as a user runs them: from a directory of the user's own."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from fake_model import FakeModel
from tests.e2e.harness import AS_FROM_A_TERMINAL, STARTUP_DEADLINE_S, keel_process, rpc, run_to_exit, started_keel, user_message

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"


async def test_scripts_serve_keeps_a_relative_state_dir_in_the_directory_it_is_called_from(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # A script builds .venv (and installs Keel in it) when it is missing or out of date; run from
    # the suite, it must find it ready, as it does under ./scripts/test, which runs the suite there.
    assert Path(sys.prefix).resolve() == VENV.resolve(), "run the suite with ./scripts/test, in this checkout's .venv"
    name = f"state-{uuid.uuid4().hex}"
    mine = tmp_path / "mine"
    mine.mkdir()
    command = [str(ROOT / "scripts" / "serve"), "--port", "0", "--state-dir", name, "--model-base-url", fake_model.base_url]
    try:
        async with started_keel(command, cwd=mine) as keel, httpx.AsyncClient() as client:
            assert (await client.get(keel.url + "livez")).json() == {"status": "alive"}
            assert await keel.terminate() == 0
        assert not (ROOT / name).exists(), "the state directory was made in the repository"
        assert sorted(path.name for path in (mine / name).glob("*.db")) == ["runtime.db", "tasks.db"]
    finally:
        shutil.rmtree(ROOT / name, ignore_errors=True)  # where a script that moved to the repository put it


async def test_scripts_refuse_a_python_too_old_for_keel_saying_which_and_what_to_do(tmp_path: Path) -> None:
    # python3 of an older distribution (3.9, say) made .venv, and pip then failed on Keel's
    # requires-python; naming a newer one with PYTHON did nothing while that .venv was there.
    repo = tmp_path / "keel"
    (repo / "scripts").mkdir(parents=True)
    for name in ("_venv.sh", "serve"):
        shutil.copy2(ROOT / "scripts" / name, repo / "scripts" / name)
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    old = tmp_path / "python3.9"  # answers as Python 3.9.2 does to what the script asks
    old.write_text('#!/bin/sh\ncase "$2" in *platform*) echo 3.9.2;; *) exit 1;; esac\n')
    old.chmod(0o755)
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy2(old, repo / ".venv" / "bin" / "python")  # made by it before
    serve = repo / "scripts" / "serve"

    refused = await run_to_exit(["env", f"PYTHON={old}", str(serve), "--help"])
    said = f"serve: Keel needs Python 3.11 or newer, and {old} is 3.9.2: install a newer one, and name it with PYTHON"
    assert (refused.returncode, refused.stdout) == (1, ""), refused
    assert refused.stderr == f"{said} (PYTHON=python3.12 {serve})\n", refused.stderr
    assert not (repo / ".venv").exists()  # made again, by a Python new enough, once one is named
    missing = await run_to_exit(["env", f"PYTHON={tmp_path / 'python3.14'}", str(serve), "--help"])
    assert missing.returncode == 1 and f"there is no {tmp_path / 'python3.14'} here" in missing.stderr, missing


async def test_the_fake_model_server_stops_quietly_at_ctrl_c() -> None:
    command = [*AS_FROM_A_TERMINAL, sys.executable, str(ROOT / "scripts" / "dev" / "fake_model.py"), "--port", "0"]
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    said = b""
    assert process.stdout is not None
    with trio.fail_after(STARTUP_DEADLINE_S):
        while b"serving http://" not in said:
            said += await process.stdout.receive_some(65536)
        process.send_signal(signal.SIGINT)
        assert await process.wait() == 0
        async for chunk in process.stdout:
            said += chunk
    assert b"Traceback" not in said, said.decode()


async def test_the_fake_model_server_on_a_port_in_use_says_so_in_one_line() -> None:
    # The README starts it on port 8000 twice: the second time, with the first one still there,
    # it ended in a page of nested exception groups.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        command = [sys.executable, str(ROOT / "scripts" / "dev" / "fake_model.py"), "--port", str(port)]
        with trio.fail_after(STARTUP_DEADLINE_S):
            done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 1
    assert done.stdout == b""
    assert done.stderr.decode().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use; stop what listens there, or give another --port"
    ]


def resident_kib(pid: int) -> int:
    """The process's resident memory (VmRSS), as Linux reports it."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


async def test_the_fake_model_server_run_for_a_demo_does_not_grow_with_every_request() -> None:
    # Run by hand, it answers for as long as the demo (or a load run) goes on: it must not keep
    # every request it was sent, as a test's FakeModel does for the test to read.
    async with fake_model_script("--gap-s", "0") as (process, url):
        question = {"model": "qwen3:4b-instruct", "messages": [{"role": "user", "content": "x" * (256 << 10)}]}
        with trio.fail_after(STARTUP_DEADLINE_S):
            async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
                await client.post("/chat/completions", json=question)
                before = resident_kib(process.pid)
                for _ in range(160):  # 40 MiB of questions
                    assert (await client.post("/chat/completions", json=question)).status_code == 200
                grown = resident_kib(process.pid) - before
    assert grown < 12 << 10, f"the fake model grew by {grown} KiB over 160 requests"


@asynccontextmanager
async def fake_model_script(*args: str) -> AsyncIterator[tuple[trio.Process, str]]:
    """scripts/dev/fake_model.py run as the README runs it, and the base URL it says it serves at;
    killed on exit."""
    command = [sys.executable, str(ROOT / "scripts" / "dev" / "fake_model.py"), "--port", "0", *args]
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    said = b""
    assert process.stdout is not None
    try:
        with trio.fail_after(STARTUP_DEADLINE_S):
            while b"serving http://" not in said:
                said += await process.stdout.receive_some(65536)
        yield process, said.split(b"serving ")[1].split()[0].decode()
    finally:
        process.kill()
        with trio.move_on_after(STARTUP_DEADLINE_S, shield=True):
            await process.wait()


async def test_scripts_serve_help_prints_the_options_and_makes_nothing(tmp_path: Path) -> None:
    # The README's first demo line, run where .venv is ready: it must not make a state directory.
    with trio.fail_after(STARTUP_DEADLINE_S):
        helped = await trio.run_process([str(ROOT / "scripts" / "serve"), "--help"], cwd=tmp_path, capture_stdout=True)
    assert helped.stdout.decode().startswith("usage: python -m runtime serve ")
    assert list(tmp_path.iterdir()) == []


async def test_the_readme_demo_steers_then_cancels_a_slow_reply_from_the_fake_model_script(tmp_path: Path) -> None:
    reply = "Hello from the fake model."
    async with fake_model_script("--reply", reply, "--gap-s", "0.2") as (_, model_url):
        async with keel_process(tmp_path / "state", model_url) as keel, httpx.AsyncClient(timeout=30) as client:
            at_once = {"returnImmediately": True}
            sent = await rpc(client, keel.url, "SendMessage", {"message": user_message("Count to ten"), "configuration": at_once})
            task_id = sent["result"]["task"]["id"]
            steer = user_message("In French, please", task_id=task_id)
            steered = (await rpc(client, keel.url, "SendMessage", {"message": steer, "configuration": at_once}))["result"]["task"]
            assert steered["status"]["state"] == "TASK_STATE_WORKING"
            assert [m["parts"][0]["text"] for m in steered["history"]] == ["Count to ten", "In French, please"]
            with trio.fail_after(STARTUP_DEADLINE_S):  # part of the answer streams meanwhile
                while not (await rpc(client, keel.url, "GetTask", {"id": task_id}))["result"].get("artifacts"):
                    await trio.sleep(0.05)
            canceled = (await rpc(client, keel.url, "CancelTask", {"id": task_id}))["result"]
            assert await keel.terminate() == 0
    assert canceled["status"]["state"] == "TASK_STATE_CANCELED"
    partial = canceled["artifacts"][0]["parts"][0]["text"]
    assert partial and reply.startswith(partial) and partial != reply, partial


async def test_the_fake_model_server_told_to_call_a_tool_calls_it_then_replies() -> None:
    # The README's program that uses the loop from Python runs against it so.
    async with fake_model_script("--gap-s", "0", "--call-tool", "clock", "--reply", "It is noon.") as (_process, url):
        asked = [{"role": "user", "content": "What time is it?"}]
        with trio.fail_after(STARTUP_DEADLINE_S):
            async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
                first = (await client.post("/chat/completions", json={"model": "qwen3:4b-instruct", "messages": asked})).json()
                call = first["choices"][0]["message"]["tool_calls"][0]
                answered = [*asked, first["choices"][0]["message"], {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]
                second = (await client.post("/chat/completions", json={"model": "qwen3:4b-instruct", "messages": answered})).json()
    assert call["function"] == {"name": "clock", "arguments": "{}"}
    assert second["choices"][0]["message"]["content"] == "It is noon."
    assert not second["choices"][0]["message"].get("tool_calls")
