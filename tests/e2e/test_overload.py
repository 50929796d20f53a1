"""A real `python -m runtime serve` process out of file descriptors: what its clients are told,
and what its log says."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import trio

from fake_model import FakeModel, Reply
from tests.e2e.harness import KeelProcess, rpc, serve_command, started_keel, user_message

FILE_LIMIT = 64
STARVED = b"cannot accept connections"
DEADLINE_S = 10


def limited(state: Path, model_url: str, *extra: str) -> list[str]:
    """serve, with at most FILE_LIMIT files open."""
    return ["sh", "-c", f'ulimit -n {FILE_LIMIT} && exec "$@"', "sh", *serve_command(state, model_url, *extra)]


def open_files(keel: KeelProcess) -> int:
    return len(os.listdir(f"/proc/{keel.process.pid}/fd"))


@asynccontextmanager
async def the_last_descriptor_taken(keel: KeelProcess, *, free: int = 0) -> AsyncIterator[trio.SocketStream]:
    """A connection the server has taken with the last of its file descriptors: idle connections
    are opened until it can accept no more, then one more waits in its listen queue, and as many
    of the others close as to let it in (and those queued before it), and ``free`` more, left
    free. Within hypercorn's keep-alive timeout (5 s) of the first, the server closes none of the
    others."""
    address = urlsplit(keel.url)
    assert address.hostname is not None and address.port is not None
    before = open_files(keel)
    held: list[trio.SocketStream] = []
    try:
        with trio.fail_after(DEADLINE_S):
            while STARVED not in keel.output:  # said once the last descriptor is taken
                count = open_files(keel)
                held.append(await trio.open_tcp_stream(address.hostname, address.port))
                while open_files(keel) == count and STARVED not in keel.output:
                    await trio.sleep(0.005)  # polling the server's descriptors against the deadline
            while open_files(keel) < FILE_LIMIT:
                await trio.sleep(0.005)
        waiting = len(held) - (FILE_LIMIT - before)  # opened, still in the listen queue
        async with await trio.open_tcp_stream(address.hostname, address.port) as last:
            for stream in held[: waiting + 1 + free]:
                await stream.aclose()
            with trio.fail_after(DEADLINE_S):
                while open_files(keel) > FILE_LIMIT - free:
                    await trio.sleep(0.005)  # polling the server's descriptors against the deadline
            yield last
    finally:
        for stream in held:
            await stream.aclose()


async def answer_to(stream: trio.SocketStream, url: str, method: str, params: dict[str, Any]) -> tuple[bytes, Any]:
    """Send one JSON-RPC request over ``stream`` and read its answer: the status line and the body."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode()
    head = f"POST / HTTP/1.1\r\nA2A-Version: 1.0\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return await exchange(stream, url, head.encode(), body)


async def exchange(stream: trio.SocketStream, url: str, head: bytes, body: bytes = b"") -> tuple[bytes, Any]:
    """Send one request (``head``, its request line and headers, then ``body``) over ``stream``,
    and read its answer to the end: the status line and the body, read as JSON if it is."""
    await stream.send_all(head + f"Host: {urlsplit(url).netloc}\r\nConnection: close\r\n\r\n".encode() + body)
    answer = b""
    with trio.fail_after(DEADLINE_S):
        while chunk := await stream.receive_some(65536):
            answer += chunk
    head_bytes, _, payload = answer.partition(b"\r\n\r\n")
    status = head_bytes.split(b"\r\n", 1)[0]
    return status, json.loads(payload) if payload.startswith(b"{") else payload


async def test_the_first_request_a_server_out_of_file_descriptors_takes_is_answered_not_failed(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # The HTTP layer read a module from disk (a codec) on a process's first requests: taken while
    # every descriptor was in use, each failed with HTTP 500 and an error in the log, one a request.
    async with started_keel(limited(tmp_path / "state", fake_model.base_url)) as keel:
        async with the_last_descriptor_taken(keel) as last:
            status, answer = await answer_to(last, keel.url, "GetTask", {"id": "no-such-task"})
        assert status == b"HTTP/1.1 200 ", (status, answer)
        assert answer["error"]["code"] == -32001, answer
        assert await keel.terminate() == 0
    output = keel.output.decode()
    assert output.count("cannot accept connections") == 1, output
    assert " ERROR " not in output, output


async def test_a_run_that_cannot_open_a_connection_to_the_model_for_want_of_descriptors_says_so(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # It failed saying the model server could not be reached, sending the operator to a model
    # server that was up.
    fake_model.default = Reply(text="never asked")
    async with started_keel(limited(tmp_path / "state", fake_model.base_url)) as keel:
        async with the_last_descriptor_taken(keel) as last:
            status, answer = await answer_to(last, keel.url, "SendMessage", {"message": user_message("hello")})
        assert status == b"HTTP/1.1 200 ", (status, answer)
        task = answer["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_FAILED", task
        said = task["status"]["message"]["parts"][0]["text"]
        assert f"this server cannot open a connection to it: it has as many files open as its limit allows ({FILE_LIMIT}" in said
        assert "cannot be reached" not in said, said
        assert fake_model.received == []
        assert await keel.terminate() == 0
    assert "Too many open files" in keel.output.decode()  # what the system said, for the operator


async def test_healthz_in_a_server_out_of_file_descriptors_names_the_limit_not_its_files(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # It said the state directory was not writable and each database not usable, sending the
    # operator to the disk.
    async with started_keel(limited(tmp_path / "state", fake_model.base_url)) as keel:
        async with the_last_descriptor_taken(keel) as last:
            status, answer = await exchange(last, keel.url, b"GET /healthz HTTP/1.1\r\n")
        assert status == b"HTTP/1.1 503 ", (status, answer)
        limit = f"this server has as many files open as its limit allows ({FILE_LIMIT}: ulimit -n)"
        assert answer["problems"] == [
            f"the state directory cannot be checked: {limit}",
            f"session store cannot be checked: {limit}",
            f"task store cannot be checked: {limit}",
            "model server unavailable: its catalog could not be read to find 'qwen3:4b-instruct': this server cannot open"
            f" a connection to it: it has as many files open as its limit allows ({FILE_LIMIT}: ulimit -n)",
        ], answer
        assert await keel.terminate() == 0


async def test_healthz_in_a_server_a_descriptor_short_of_what_a_store_check_needs_names_the_limit_not_the_store(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # A store's check made sure one descriptor was free, then SQLite needed three (the file, its
    # -wal and its -shm): with two free, it said the file was not usable, sending the operator to
    # a database that was fine.
    async with started_keel(limited(tmp_path / "state", fake_model.base_url)) as keel:
        async with the_last_descriptor_taken(keel, free=2) as last:
            status, answer = await exchange(last, keel.url, b"GET /healthz HTTP/1.1\r\n")
        assert status == b"HTTP/1.1 503 ", (status, answer)
        problems = answer["problems"]
        limit = f"this server has as many files open as its limit allows ({FILE_LIMIT}: ulimit -n)"
        assert f"session store cannot be checked: {limit}" in problems, problems
        assert f"task store cannot be checked: {limit}" in problems, problems
        # The free descriptors may go to the state directory's check, or to the model's.
        assert all(f"({FILE_LIMIT}: ulimit -n)" in problem for problem in problems), problems
        assert await keel.terminate() == 0
    assert "not usable" not in keel.output.decode()


async def test_a_drain_that_cancels_hundreds_of_runs_waiting_for_the_model_ends_soon_after_its_timeout(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # 100 runs hold the model's connections and 200 wait for one. Each that stopped waiting had
    # the HTTP client look at all the others, and the 300 cancelled at the drain's end kept the
    # process busy 4 s past it (500: 9 s), as long again as a service manager may allow. How long
    # it takes now is not timed here (the machine may be loaded): each is recorded CANCELED, and
    # the process ends within the harness's bound.
    fake_model.default = Reply(text="never done", hang_after_chunks=1)
    fake_model.record = False
    drain_timeout_s = 0.5
    command = serve_command(tmp_path / "state", fake_model.base_url, "--drain-timeout-s", str(drain_timeout_s))
    async with started_keel(command) as keel, httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=20)) as client:
        async with trio.open_nursery() as sending:
            params = {"configuration": {"returnImmediately": True}}
            for _ in range(300):
                sending.start_soon(rpc, client, keel.url, "SendMessage", {"message": user_message("wait"), **params})
        assert await keel.terminate() == 0
    assert "shutting down: 300 task(s) did not finish within 0.5 s and are canceled" in keel.output.decode()


async def test_a_stalled_model_leaves_the_server_descriptors_for_livez_and_a_cancel(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # With as many model connections as were asked (100), the runs of a stalled model took every
    # descriptor: nothing was accepted, not even /livez or a CancelTask, until the model timed out.
    allowed = (FILE_LIMIT - 20) // 2
    fake_model.default = Reply(text="late", delay_s=60)
    async with started_keel(limited(tmp_path / "state", fake_model.base_url)) as keel:
        async with httpx.AsyncClient(timeout=DEADLINE_S, limits=httpx.Limits(max_connections=1)) as client:
            tasks = []
            for number in range(FILE_LIMIT):
                params = {"message": user_message(f"hello {number}"), "configuration": {"returnImmediately": True}}
                tasks.append((await rpc(client, keel.url, "SendMessage", params))["result"]["task"]["id"])
            with trio.fail_after(DEADLINE_S):
                while len(fake_model.bodies) < allowed:
                    await trio.sleep(0.01)  # polling what the model was sent against the deadline
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            alive = await client.get(keel.url + "livez")
            canceled = await rpc(client, keel.url, "CancelTask", {"id": tasks[-1]})
        assert alive.status_code == 200, alive.text
        assert canceled["result"]["status"]["state"] == "TASK_STATE_CANCELED", canceled
        assert len(fake_model.bodies) == allowed
        await keel.kill()
    output = keel.output.decode()
    said = f"at most {allowed} model connections, not AGENT_MAX_MODEL_CONNECTIONS=100"
    assert output.count(said) == 1 and f"may have {FILE_LIMIT} files open (ulimit -n)" in output, output
    assert "Too many open files" not in output, output
