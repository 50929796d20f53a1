"""`python -m runtime serve` as a real process: startup order, restarts, SIGKILL, SIGTERM."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from fake_model import Call, ErrorReply, FakeModel, Reply
from persistence.journal import JOURNAL_NAME
from persistence.statedir import GENERATION_LOCK_NAME
from tests.e2e.harness import (
    SERVING,
    STARTUP_DEADLINE_S,
    KeelProcess,
    child_env,
    keel_process,
    rpc,
    serve_command,
    run_serve_to_exit,
    run_to_exit,
    started_keel,
    stored_task,
    stream,
    user_message,
    wait_stored_state,
)


async def test_serve_refuses_a_planted_prepared_journal_before_creating_any_database(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / JOURNAL_NAME).write_text(json.dumps({"phase": "prepared"}))
    refused = await run_serve_to_exit(state, fake_model.base_url)
    assert refused.returncode != 0
    assert "Restore journal is incomplete or has unsupported fields. Missing: " in refused.stderr
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in state.iterdir() if p.suffix == ".db") == []
    assert (state / JOURNAL_NAME).exists(), "the journal is evidence and stays for the operator"

    (state / JOURNAL_NAME).unlink()
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient() as client:
        assert (await client.get(keel.url + "livez")).json() == {"status": "alive"}
        assert await keel.terminate() == 0


async def test_serve_refuses_a_database_from_a_newer_keel_and_names_the_file(tmp_path: Path, fake_model: FakeModel) -> None:
    import sqlite3

    from persistence.schema import SchemaIdentity, write_identity_txn

    state = tmp_path / "state"
    state.mkdir()
    with sqlite3.connect(state / "tasks.db") as conn:
        write_identity_txn(conn, SchemaIdentity("keel.tasks", 99))
    refused = await run_serve_to_exit(state, fake_model.base_url)
    assert refused.returncode != 0
    assert "tasks.db" in refused.stderr and "keel.tasks@99" in refused.stderr and "Upgrade Keel" in refused.stderr
    assert not (state / "runtime.db").exists(), "preflight refuses before any store is opened"


async def test_a_new_task_in_the_same_context_after_a_restart_continues_the_conversation(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.script = [Reply(text="Paris."), Reply(text="About 2.1 million.")]
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(state, fake_model.base_url) as keel:
            first = await rpc(client, keel.url, "SendMessage", {"message": user_message("Capital of France?")})
            task = first["result"]["task"]
            assert task["status"]["state"] == "TASK_STATE_COMPLETED"
            assert await keel.terminate() == 0
        async with keel_process(state, fake_model.base_url) as keel:
            second = await rpc(
                client, keel.url, "SendMessage", {"message": user_message("And its population?", context_id=task["contextId"])}
            )
            assert second["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
            assert second["result"]["task"]["id"] != task["id"]
            await keel.terminate()
    seen = [m.get("content") for m in fake_model.bodies[1]["messages"] if m["role"] != "system"]
    assert seen == ["Capital of France?", "Paris.", "And its population?"]


async def killed_mid_answer(
    client: httpx.AsyncClient, state: Path, fake_model: FakeModel, sig: signal.Signals = signal.SIGKILL
) -> str:
    """A server killed (SIGKILL, or ``sig``) while the model streams a slow answer; the id of the
    task it leaves WORKING. The model's next answers are "The resumed answer."."""
    fake_model.script = [Reply(text="a slow answer that never finishes " * 4, chunk_chars=2, gap_s=0.2)]
    fake_model.default = Reply(text="The resumed answer.")
    async with keel_process(state, fake_model.base_url) as keel:
        sent = await rpc(
            client, keel.url, "SendMessage",
            {"message": user_message("Tell me slowly."), "configuration": {"returnImmediately": True}},
        )  # fmt: skip
        task_id: str = sent["result"]["task"]["id"]
        await wait_stored_state(state, task_id, ["TASK_STATE_WORKING"])
        with trio.fail_after(30):
            while not fake_model.bodies:
                await trio.sleep(0.02)
        assert await keel.terminate(sig) == -sig
    assert stored_task(state, task_id)[0] == "TASK_STATE_WORKING"  # type: ignore[index]
    return task_id


async def test_a_task_left_working_by_a_sigkill_is_resumed_by_the_next_process(tmp_path: Path, fake_model: FakeModel) -> None:
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        task_id = await killed_mid_answer(client, state, fake_model)
        fake_model.default = Reply(text="The resumed answer.", chunk_chars=2, gap_s=0.2)  # 2 s: time to subscribe
        async with keel_process(state, fake_model.base_url) as keel:
            # A client following the task again is taken to its end.
            request = {"jsonrpc": "2.0", "id": 1, "method": "SubscribeToTask", "params": {"id": task_id}}
            async with client.stream("POST", keel.url, json=request, headers={"A2A-Version": "1.0"}) as stream:
                frames = [json.loads(line[6:]) async for line in stream.aiter_lines() if line.startswith("data: ")]
            assert frames[0]["result"]["task"]["id"] == task_id
            assert frames[-1]["result"]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
            got = await rpc(client, keel.url, "GetTask", {"id": task_id})
            assert got["result"]["status"]["message"]["parts"] == [{"text": "The resumed answer."}]
            await keel.terminate()
    # The step in flight was redone from the saved transcript: the same question, asked again.
    assert [m.get("content") for m in fake_model.bodies[-1]["messages"] if m["role"] == "user"] == ["Tell me slowly."]


def rfc3339(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parsed_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


async def test_tasks_made_after_a_restart_with_the_clock_behind_are_dated_after_those_before_it(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # A machine whose clock is set back while its server is stopped (a clock that ran ahead, put
    # right; a VM restored from an image): its next tasks must still come after the last ones, or
    # ListTasks would list them behind, and a client polling from the newest status it saw would
    # not see them until the clock caught up.
    fake_model.default = Reply(text="Renew it.")
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(state, fake_model.base_url) as keel:
            first = (await rpc(client, keel.url, "SendMessage", {"message": user_message("first")}))["result"]["task"]
            assert await keel.terminate() == 0
        ahead = parsed_time(first["status"]["timestamp"]) + timedelta(hours=1)
        with closing(sqlite3.connect(state / "tasks.db")) as db, db:  # as if the clock was set back an hour since
            db.execute(
                "UPDATE tasks SET created_at_ms = created_at_ms + 3600000, updated_at_ms = updated_at_ms + 3600000,"
                " task = json_set(task, '$.status.timestamp', ?)",
                (rfc3339(ahead),),
            )
        async with keel_process(state, fake_model.base_url) as keel:
            second = (await rpc(client, keel.url, "SendMessage", {"message": user_message("second")}))["result"]["task"]
            listed = (await rpc(client, keel.url, "ListTasks", {}))["result"]["tasks"]
            polled = (await rpc(client, keel.url, "ListTasks", {"statusTimestampAfter": rfc3339(ahead)}))["result"]["tasks"]
            assert await keel.terminate() == 0
    assert parsed_time(second["status"]["timestamp"]) > ahead
    assert [task["id"] for task in listed] == [second["id"], first["id"]]
    assert [task["id"] for task in polled] == [second["id"], first["id"]]


@pytest.mark.parametrize(
    "stored_ms", [253402300799999, 2**62], ids=["last-date", "past-any-date"]
)
async def test_a_server_over_a_status_stored_at_the_end_of_time_starts_and_dates_its_tasks(
    tmp_path: Path, fake_model: FakeModel, stored_ms: int
) -> None:
    # A clock once set far ahead (9999-12-31), or a status time damaged on disk: there is no
    # millisecond after it to date the next task at, which must not stop the server making tasks.
    fake_model.default = Reply(text="Renew it.")
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(state, fake_model.base_url) as keel:
            await rpc(client, keel.url, "SendMessage", {"message": user_message("first")})
            assert await keel.terminate() == 0
        with closing(sqlite3.connect(state / "tasks.db")) as db, db:
            db.execute("UPDATE tasks SET updated_at_ms = ?", (stored_ms,))
        async with keel_process(state, fake_model.base_url) as keel:
            sent = await rpc(client, keel.url, "SendMessage", {"message": user_message("second")})
            assert sent.get("result", {}).get("task", {}).get("status", {}).get("state") == "TASK_STATE_COMPLETED", sent
            assert await keel.terminate() == 0


@pytest.mark.parametrize("sig", [signal.SIGQUIT, signal.SIGHUP], ids=["SIGQUIT", "SIGHUP"])
async def test_sigquit_or_sighup_ends_serve_at_once_as_a_crash_does_and_the_next_process_resumes_the_task(
    tmp_path: Path, fake_model: FakeModel, sig: signal.Signals
) -> None:
    # Ctrl-\ (SIGQUIT) is how the README's demo crashes the server by hand; a closed terminal sends SIGHUP.
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        task_id = await killed_mid_answer(client, state, fake_model, sig)
        async with keel_process(state, fake_model.base_url) as keel:
            assert await wait_stored_state(state, task_id, ["TASK_STATE_COMPLETED"]) == "TASK_STATE_COMPLETED"
            got = await rpc(client, keel.url, "GetTask", {"id": task_id})
            assert got["result"]["artifacts"][0]["parts"] == [{"text": "The resumed answer."}]
            assert await keel.terminate() == 0
        assert f"resuming task {task_id} left working by a process that stopped" in keel.output.decode()


async def test_serve_writes_only_the_line_saying_where_it_serves_on_stdout(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.default = Reply(text="Hello.")
    command = serve_command(tmp_path / "state", fake_model.base_url)
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=child_env())
    said = b""
    assert process.stdout is not None
    try:
        with trio.fail_after(STARTUP_DEADLINE_S):
            while b"\n" not in said:
                said += await process.stdout.receive_some(65536)
            serving = SERVING.search(said)
            assert serving, said
            url = serving.group(1).decode()
            async with httpx.AsyncClient(timeout=30) as client:
                answered = await rpc(client, url, "SendMessage", {"message": user_message("Hi")})
                assert answered["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
            process.send_signal(signal.SIGTERM)
            async for chunk in process.stdout:
                said += chunk
            assert await process.wait() == 0
    finally:
        if process.poll() is None:
            process.kill()
        with trio.move_on_after(10, shield=True):
            await process.wait()
    assert said.decode().splitlines() == [f"keel serving A2A at {url} (state in {tmp_path / 'state'})"]


async def test_a_message_that_failed_while_no_model_was_there_gets_that_task_back_once_the_model_is_there(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    with socket.socket() as unused:  # a port nothing listens on: no model server there
        unused.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{unused.getsockname()[1]}/v1"
    state = tmp_path / "state"
    question = user_message("Hi")
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(state, nowhere) as keel:
            failed = (await rpc(client, keel.url, "SendMessage", {"message": question}))["result"]["task"]
            assert failed["status"]["state"] == "TASK_STATE_FAILED"
            assert await keel.terminate() == 0
        async with keel_process(state, fake_model.base_url) as keel:
            again = (await rpc(client, keel.url, "SendMessage", {"message": question}))["result"]["task"]
            assert (again["id"], again["status"]) == (failed["id"], failed["status"])
            assert (await rpc(client, keel.url, "ListTasks", {}))["result"]["totalSize"] == 1
            assert await keel.terminate() == 0
    assert fake_model.bodies == []  # no second run: the model was not asked


async def test_the_served_agent_card_says_what_the_agent_reads_and_where_it_listens(tmp_path: Path, fake_model: FakeModel) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(tmp_path / "state", fake_model.base_url) as keel:
            response = await client.get(keel.url + ".well-known/agent-card.json")
            assert await keel.terminate() == 0
        card = response.json()
        assert card["name"] == "Keel"
        assert card["defaultInputModes"] == ["text/plain", "application/json"]  # text parts, and data parts
        assert card["capabilities"] == {"streaming": True, "pushNotifications": False}
        assert [(i["url"], i["protocolVersion"]) for i in card["supportedInterfaces"]] == [(keel.url, "1.0"), (keel.url, "0.3")]
        # Behind a proxy that ends TLS, the card names where clients reach the server.
        async with keel_process(tmp_path / "state", fake_model.base_url, "--public-url", "https://agents.example/keel/") as keel:
            card = (await client.get(keel.url + ".well-known/agent-card.json")).json()
            assert await keel.terminate() == 0
        assert {i["url"] for i in card["supportedInterfaces"]} == {"https://agents.example/keel/"}


async def test_the_model_settings_hold_calls_to_one_at_a_time_and_bound_a_silent_model(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.script = [Reply(text="first", delay_s=0.3), Reply(text="second", delay_s=0.3), Reply(text="late", delay_s=3)]
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(state, fake_model.base_url, "--max-model-connections", "1", "--model-timeout-s", "1") as keel:
            answers: list[dict[str, Any]] = []

            async def ask(text: str) -> None:
                answers.append(await rpc(client, keel.url, "SendMessage", {"message": user_message(text)}))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "one")
                nursery.start_soon(ask, "two")
            assert [a["result"]["task"]["status"]["state"] for a in answers] == ["TASK_STATE_COMPLETED"] * 2
            assert fake_model.most_answering == 1  # the second call waited for the first
            late = (await rpc(client, keel.url, "SendMessage", {"message": user_message("three")}))["result"]["task"]
            assert late["status"]["state"] == "TASK_STATE_FAILED"
            said = late["status"]["message"]["parts"][0]["text"]
            assert "timed out" in said and "1s" in said, said
            assert await keel.terminate() == 0


async def test_a_message_sent_again_after_a_crash_gets_the_task_it_started_not_a_second_one(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.script = [Reply(text="never done", hang_after_chunks=1)]
    fake_model.default = Reply(text="The one answer.")
    state = tmp_path / "state"
    question = user_message("Is checkout down?")
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(state, fake_model.base_url) as keel:
            sent = await rpc(client, keel.url, "SendMessage", {"message": question, "configuration": {"returnImmediately": True}})
            task_id = sent["result"]["task"]["id"]
            await wait_stored_state(state, task_id, ["TASK_STATE_WORKING"])
            with trio.fail_after(30):  # the model has the question (and hangs on it)
                while not fake_model.bodies:
                    await trio.sleep(0.02)
            assert await keel.kill() == -9  # as if before its answer reached the client
        async with keel_process(state, fake_model.base_url) as keel:
            again = (await rpc(client, keel.url, "SendMessage", {"message": question}))["result"]["task"]
            assert (again["id"], again["status"]["state"]) == (task_id, "TASK_STATE_COMPLETED")
            assert again["artifacts"][0]["parts"] == [{"text": "The one answer."}]
            assert (await rpc(client, keel.url, "ListTasks", {}))["result"]["totalSize"] == 1
            assert await keel.terminate() == 0
    # One run, resumed once: the question went to the model twice (the killed step, redone), not three times.
    assert len(fake_model.bodies) == 2


async def test_with_orphans_fail_a_task_left_working_by_a_sigkill_is_failed_with_the_reason(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.script = [Reply(text="never done", hang_after_chunks=1)]
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(state, fake_model.base_url) as keel:
            sent = await rpc(
                client, keel.url, "SendMessage", {"message": user_message("go"), "configuration": {"returnImmediately": True}}
            )
            task_id = sent["result"]["task"]["id"]
            await wait_stored_state(state, task_id, ["TASK_STATE_WORKING"])
            with trio.fail_after(30):  # asked before the kill: a request still on its way would be counted after it
                while not fake_model.bodies:
                    await trio.sleep(0.02)
            assert await keel.kill() == -9
        asked = len(fake_model.bodies)
        async with keel_process(state, fake_model.base_url, "--orphans", "fail") as keel:
            assert await wait_stored_state(state, task_id, ["TASK_STATE_FAILED"]) == "TASK_STATE_FAILED"
            got = await rpc(client, keel.url, "GetTask", {"id": task_id})
            said = got["result"]["status"]["message"]["parts"][0]["text"]
            assert "stopped before it finished" in said and "send the message again, with a new messageId" in said
            assert await keel.terminate() == 0
        assert f"failing task {task_id} left working by a process that stopped (orphans: fail)" in keel.output.decode()
    assert len(fake_model.bodies) == asked  # failed, not resumed: the model was not asked again


@pytest.mark.parametrize(
    ("reply", "drain_timeout_s", "settled"),
    [
        # A run that finishes within the drain is left to finish ...
        (Reply(text="finishing within the drain", chunk_chars=4, gap_s=0.05), "20", "TASK_STATE_COMPLETED"),
        # ... and one that outlives it is cancelled and recorded CANCELED.
        (Reply(text="never done", hang_after_chunks=1), "0.5", "TASK_STATE_CANCELED"),
    ],
    ids=["finishes", "outlives-the-drain"],
)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_sigterm_drains_the_running_task_then_exits_zero(
    tmp_path: Path, fake_model: FakeModel, reply: Reply, drain_timeout_s: str, settled: str, sig: signal.Signals
) -> None:
    fake_model.script = [reply]
    state = tmp_path / "state"
    async with (
        httpx.AsyncClient(timeout=30) as client,
        keel_process(state, fake_model.base_url, "--drain-timeout-s", drain_timeout_s) as keel,
    ):
        sent = await rpc(
            client, keel.url, "SendMessage", {"message": user_message("go"), "configuration": {"returnImmediately": True}}
        )
        task_id = sent["result"]["task"]["id"]
        await wait_stored_state(state, task_id, ["TASK_STATE_WORKING"])
        assert await keel.terminate(sig) == 0
    assert stored_task(state, task_id)[0] == settled  # type: ignore[index]
    cut = f"did not finish within {drain_timeout_s} s and are canceled: {task_id}" in keel.output.decode()
    assert cut == (settled == "TASK_STATE_CANCELED")


@asynccontextmanager
async def a_client_that_stopped_reading(keel: KeelProcess) -> AsyncIterator[str]:
    """A stream whose client reads its first event (the task, whose id this yields), then
    nothing: once the sockets between server and client are full (the answer the test scripts
    streams far more than they hold: its events take many times the text's size), the server's
    write to it blocks."""
    url = urlsplit(keel.url)
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage", "params": {"message": user_message("go")}}).encode()
    request = (
        f"POST {url.path or '/'} HTTP/1.1\r\nHost: {url.netloc}\r\nA2A-Version: 1.0\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    assert url.hostname is not None and url.port is not None
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window it offers
    await sock.connect((url.hostname, url.port))
    async with trio.SocketStream(sock) as stalled:
        await stalled.send_all(request)
        first = b""
        while b"\n\n" not in first.partition(b"data: ")[2]:  # the stream's first event, the task
            first += await stalled.receive_some(65536)
        yield json.loads(first.partition(b"data: ")[2].split(b"\n", 1)[0])["result"]["task"]["id"]


async def test_sigterm_stops_the_server_while_a_client_has_stopped_reading_its_stream(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # hypercorn's writes are shielded and unbounded: once the sockets between server and client
    # are full, only the send timeout, which has the kernel close the connection, frees the
    # request that SIGTERM's shutdown waits for.
    fake_model.script = [Reply(text="x" * 400_000, chunk_chars=32)]
    state = tmp_path / "state"
    async with (
        keel_process(state, fake_model.base_url, "--send-timeout-s", "2") as keel,
        a_client_that_stopped_reading(keel) as task_id,
    ):
        await wait_stored_state(state, task_id, ["TASK_STATE_COMPLETED"], deadline_s=60)
        assert await keel.terminate() == 0  # within the harness's bound; it hung before


async def test_a_third_sigterm_stops_the_process_though_a_client_that_stopped_reading_holds_the_server(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.script = [Reply(text="x" * 400_000, chunk_chars=4)]  # about 17 MB of events
    state = tmp_path / "state"
    async with (
        keel_process(state, fake_model.base_url, "--send-timeout-s", "600") as keel,
        a_client_that_stopped_reading(keel) as task_id,
    ):
        await wait_stored_state(state, task_id, ["TASK_STATE_COMPLETED"], deadline_s=60)
        for said in (b"shutting down", b"second SIGTERM", b"third SIGTERM"):
            keel.process.send_signal(signal.SIGTERM)  # one at a time: signals sent together may merge
            with trio.fail_after(10):
                while said not in keel.output:
                    await trio.sleep(0.01)
        start = trio.current_time()
        assert await keel.wait() == 1  # not the send timeout's 600 s
        assert trio.current_time() - start < 10
    assert "the server did not stop within 1 s (a client that takes nothing): exiting without it" in keel.output.decode()
    stored = stored_task(state, task_id)
    assert stored is not None and stored[0] == "TASK_STATE_COMPLETED"


async def test_a_second_sigterm_cancels_the_runs_at_once_and_the_clients_waiting_get_their_answers(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.script = [Reply(text="never done", hang_after_chunks=1)] * 3
    state = tmp_path / "state"
    async with (
        httpx.AsyncClient(timeout=30) as client,
        keel_process(state, fake_model.base_url, "--drain-timeout-s", "600") as keel,
        trio.open_nursery() as nursery,
    ):
        answers: dict[str, Any] = {}

        async def blocking() -> None:
            answers["blocking"] = await rpc(client, keel.url, "SendMessage", {"message": user_message("wait for me")})

        async def streaming() -> None:
            answers["stream"] = await stream(client, keel.url, "SendStreamingMessage", {"message": user_message("follow")})

        nursery.start_soon(blocking)
        nursery.start_soon(streaming)
        sent = await rpc(
            client, keel.url, "SendMessage", {"message": user_message("go"), "configuration": {"returnImmediately": True}}
        )
        task_id = sent["result"]["task"]["id"]
        with trio.fail_after(10):
            while len(fake_model.bodies) < 3:  # all three runs are answering, and hang there
                await trio.sleep(0.01)
        keel.process.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            while b"shutting down" not in keel.output:  # the first signal has started the drain
                await trio.sleep(0.01)
        start = trio.current_time()
        assert await keel.terminate() == 0  # the second: the drain's 600 s are not waited out
        assert trio.current_time() - start < 10
    # The clients still connected were answered, as a drain that times out answers them.
    assert answers["blocking"]["result"]["task"]["status"]["state"] == "TASK_STATE_CANCELED"
    last = answers["stream"][-1]["result"]["statusUpdate"]["status"]
    assert last["state"] == "TASK_STATE_CANCELED"
    stored = stored_task(state, task_id)
    assert stored is not None and stored[0] == "TASK_STATE_CANCELED"
    said = stored[1]["status"]["message"]["parts"][0]["text"]
    assert "the server shut down before it finished" in said  # not as a CancelTask's cancel says
    assert "shutting down: 3 task(s) are canceled at once, the drain cut short: " in keel.output.decode()
    assert task_id in keel.output.decode()


async def test_a_restart_that_cannot_listen_leaves_the_task_a_dead_process_left_for_the_next_one(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # The address is checked before the runner takes up what the dead process left: a restart
    # that cannot serve neither runs those tasks nor settles them.
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client:
        task_id = await killed_mid_answer(client, state, fake_model)
        asked = len(fake_model.bodies)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            refused = await run_serve_to_exit(state, fake_model.base_url, "--port", str(taken.getsockname()[1]))
        assert refused.returncode == 1 and "cannot listen on" in refused.stderr
        assert "resuming" not in refused.stderr + refused.stdout
        assert len(fake_model.bodies) == asked  # the model was not asked on its behalf
        assert stored_task(state, task_id)[0] == "TASK_STATE_WORKING"  # type: ignore[index]
        async with keel_process(state, fake_model.base_url) as keel:
            assert await wait_stored_state(state, task_id, ["TASK_STATE_COMPLETED"]) == "TASK_STATE_COMPLETED"
            await keel.terminate()


async def test_serve_on_a_port_in_use_says_so_and_what_to_do(tmp_path: Path, fake_model: FakeModel) -> None:
    async with keel_process(tmp_path / "first", fake_model.base_url) as keel:
        port = str(urlsplit(keel.url).port)
        second = await run_serve_to_exit(tmp_path / "second", fake_model.base_url, "--port", port)
    assert second.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port}: " in second.stderr
    assert "choose another --port (AGENT_PORT), or 0 for any free one" in second.stderr
    assert "Traceback" not in second.stderr and "ExceptionGroup" not in second.stderr and "nursery" not in second.stderr


async def test_a_second_server_on_the_same_state_directory_is_refused_and_leaves_the_first_ones_tasks_alone(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.script = [Reply(text="never done", hang_after_chunks=1)]
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client, keel_process(state, fake_model.base_url) as keel:
        sent = await rpc(
            client, keel.url, "SendMessage", {"message": user_message("go"), "configuration": {"returnImmediately": True}}
        )
        task_id = sent["result"]["task"]["id"]
        await wait_stored_state(state, task_id, ["TASK_STATE_WORKING"])
        # To a second server this WORKING task would look like one a dead process left.
        second = await run_serve_to_exit(state, fake_model.base_url)
        assert second.returncode == 1
        assert f"error: another Keel server is serving the state directory {state}; stop it first" in second.stderr
        assert "resuming task" not in second.stderr + second.stdout
        assert len(fake_model.bodies) == 1  # the first server's run, asked once
        assert stored_task(state, task_id)[0] == "TASK_STATE_WORKING"  # type: ignore[index]
        assert await keel.terminate() == 0


async def test_a_reset_after_the_server_stopped_removes_its_databases_and_keeps_its_three_lock_files(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    async with keel_process(state, fake_model.base_url) as keel:
        assert await keel.terminate() == 0
    locks = {name: (state / name).stat().st_ino for name in (".keel.lock", ".keel-generation.lock", ".keel-serve.lock")}
    assert {"runtime.db", "tasks.db"} <= set(os.listdir(state))

    with trio.fail_after(STARTUP_DEADLINE_S):
        reset = await trio.run_process(
            [sys.executable, "-m", "runtime", "state", "reset", "--state-dir", str(state)],
            capture_stdout=True, capture_stderr=True, check=False, env=child_env(),
        )  # fmt: skip

    assert reset.returncode == 0, reset.stderr.decode()
    assert reset.stdout.decode().startswith(f"{state}: removed runtime.db")
    assert {name: (state / name).stat().st_ino for name in os.listdir(state)} == locks  # each the file it was


AS_ROOT = os.geteuid() == 0  # root passes permission checks: what refuses it is the file system itself


@pytest.mark.parametrize(
    ("state_dir", "why"),
    [
        ("/proc", f"no file can be made in it ({'its file system takes no new files' if AS_ROOT else 'this user may not write in it'})"),
        ("/sys", f"no file can be made in it ({'not even root may write in it' if AS_ROOT else 'this user may not write in it'})"),
        (
            "/proc/keelstate",
            f"no directory can be made in /proc ({'its file system takes no new directories' if AS_ROOT else 'this user may not write in it'}),"
            " so it cannot be created",
        ),
    ],
)
async def test_serve_on_a_state_directory_it_cannot_use_says_which_and_why_in_plain_words(
    fake_model: FakeModel, state_dir: str, why: str
) -> None:
    refused = await run_serve_to_exit(Path(state_dir), fake_model.base_url)
    assert refused.returncode == 1
    said = refused.stderr.strip().splitlines()[-1]  # as root the state directory's message, else the configuration's
    assert said in (
        f"error: the state directory {state_dir} cannot be used: {why}; choose one this user can create, or make files in",
        f"  - --state-dir='{state_dir}' is not valid: {why}",
    )
    assert "Errno" not in refused.stderr and "Traceback" not in refused.stderr


async def test_the_model_call_budget_set_for_the_server_bounds_each_turn(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.default = Reply(tool_calls=[Call("clock", "{}")])  # a model that never concludes
    async with (
        httpx.AsyncClient(timeout=30) as client,
        keel_process(tmp_path / "state", fake_model.base_url, "--max-model-calls", "2") as keel,
    ):
        sent = await rpc(client, keel.url, "SendMessage", {"message": user_message("What time is it?")})
        await keel.terminate()
    status = sent["result"]["task"]["status"]
    assert status["state"] == "TASK_STATE_FAILED"
    assert "made its 2 model calls" in status["message"]["parts"][0]["text"]
    assert len(fake_model.bodies) == 2


async def test_credentials_in_the_model_url_are_never_logged_when_the_model_server_refuses_them(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.api_key = "sk-RIGHTKEY"  # it wants a key, and says back the Basic token it got instead
    url = fake_model.base_url.replace("http://", "http://bob:pa55w0rd@")
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(tmp_path / "state", url) as keel:
            health = (await client.get(keel.url + "healthz")).json()
            task = (await rpc(client, keel.url, "SendMessage", {"message": user_message("hi")}))["result"]["task"]
            assert await keel.terminate() == 0
    refused = "the credentials in the base URL were refused (HTTP 401)"
    assert health["problems"] == [
        f"model server unavailable: its catalog could not be read to find 'qwen3:4b-instruct': {refused}"
    ]
    assert task["status"]["message"]["parts"] == [{"text": f"The task failed: model 'qwen3:4b-instruct' rejected the request: {refused}"}]
    logged = keel.output.decode()
    assert "Incorrect API key provided: Basic [credentials]" in logged  # what the server said is kept, masked
    for secret in ("pa55w0rd", "Ym9iOnBhNTV3MHJk", "bob:"):
        assert secret not in logged
    assert {item.headers["authorization"] for item in fake_model.received} == {"Basic Ym9iOnBhNTV3MHJk"}


async def test_a_model_that_times_out_fails_the_task_saying_whether_any_of_the_answer_had_come(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.script = [
        Reply(text="never sent", gap_s=60),  # the opening chunk, then nothing of the answer
        Reply(text="The lease", chunk_chars=32, hang_after_chunks=2, keepalive_s=0.05),  # some, then keep-alives
    ]
    async with httpx.AsyncClient(timeout=30) as client:
        async with keel_process(tmp_path / "state", fake_model.base_url, "--model-timeout-s", "0.5") as keel:
            said = []
            for text in ("first", "second"):
                task = (await rpc(client, keel.url, "SendMessage", {"message": user_message(text)}))["result"]["task"]
                assert task["status"]["state"] == "TASK_STATE_FAILED"
                said.append(task["status"]["message"]["parts"][0]["text"])
            assert await keel.terminate() == 0
    timed_out = "The task failed: model 'qwen3:4b-instruct' timed out: nothing arrived within 0.5s while waiting for"
    again = "; this may pass: send the message again, with a new messageId, in a little while"
    assert said == [f"{timed_out} the answer to start{again}", f"{timed_out} the rest of the answer{again}"]


def blocked_on_a_lock(pid: int) -> bool:
    """Whether process ``pid`` waits for a file lock (the kernel lists its waiters in /proc/locks)."""
    return any(line.split()[1] == "->" and line.split()[5] == str(pid) for line in Path("/proc/locks").read_text().splitlines())


@asynccontextmanager
async def serve_kept_waiting(state: Path, model: FakeModel, *, started_by: tuple[str, ...] = ()) -> AsyncIterator[trio.Process]:
    """serve started on ``state`` (by ``started_by``, if given) while its generation lock is held,
    as a snapshot or a restore holds it: it waits its turn, and does not serve while the block
    lasts. Its output is piped."""
    state.mkdir()
    holder = os.open(state / GENERATION_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        process = await trio.lowlevel.open_process(
            serve_command(state, model.base_url, started_by=started_by),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
        try:
            yield process
        finally:
            if process.returncode is None:  # a test that failed midway: it must not serve once let go
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
    finally:
        os.close(holder)


async def test_a_start_waiting_for_the_state_directory_stops_at_the_first_signal(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    async with serve_kept_waiting(state, fake_model) as process:
        with trio.fail_after(STARTUP_DEADLINE_S):
            while not blocked_on_a_lock(process.pid):
                await trio.sleep(0.01)
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        assert process.stdout is not None
        said = (await process.stdout.receive_some(65536)).decode()
        assert "keel serving" not in said and "Traceback" not in said
        assert f"waiting for another process (a snapshot, a restore, or a server starting) to let go of {state / GENERATION_LOCK_NAME}" in said


async def test_a_log_reader_that_stalls_holds_neither_the_clients_nor_a_sigterm(tmp_path: Path, fake_model: FakeModel) -> None:
    # The log goes to stderr: a pipe whose reader has stopped taking it (a paused pager, a log
    # shipper that stalls) fills up. Written from the event loop, the next line blocked it: no
    # request was answered, /livez neither, and SIGTERM went unheeded until the reader read again.
    fake_model.default = ErrorReply(status=400, body="the model refuses: " + "x" * 500)  # each task logs a line of 600 bytes
    reader, writer = os.pipe()
    fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)  # the least a pipe holds: a few lines fill it
    try:
        process = await trio.lowlevel.open_process(
            serve_command(tmp_path / "state", fake_model.base_url), stdout=subprocess.PIPE, stderr=writer, env=child_env()
        )
        os.close(writer)
        writer = -1
        keel = KeelProcess(process)
        with trio.fail_after(STARTUP_DEADLINE_S):
            assert process.stdout is not None
            said = b""
            while not (served := SERVING.search(said)):
                said += await process.stdout.receive_some(65536)
        keel.url = served.group(1).decode()
        async with httpx.AsyncClient(timeout=10) as client:
            for n in range(20):  # 12 KB of log, three times what the pipe holds
                task = (await rpc(client, keel.url, "SendMessage", {"message": user_message(f"q{n}")}))["result"]["task"]
                assert task["status"]["state"] == "TASK_STATE_FAILED"
            assert (await client.get(keel.url + "livez")).status_code == 200
        assert await keel.terminate() == 0
        logged = await trio.to_thread.run_sync(os.read, reader, 4096)
        assert logged.startswith(b"20"), logged  # the log's first lines, the first one dated
    finally:
        if process.poll() is None:
            process.kill()
            await process.wait()
        for fd in (reader, writer):
            if fd >= 0:
                os.close(fd)


def has_open(process: trio.Process, path: Path) -> bool:
    """Whether ``process`` has ``path`` open. One that has exited never will: that fails at once."""
    assert process.poll() is None, f"serve exited with {process.returncode} before it opened {path}"
    found = []
    for fd in Path(f"/proc/{process.pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            found.append(Path(os.readlink(fd)))
    return path.resolve() in found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda sig: sig.name)
async def test_a_second_signal_while_a_stopped_start_finishes_the_step_under_way_is_taken_too(
    tmp_path: Path, fake_model: FakeModel, sig: signal.Signals
) -> None:
    # The first signal ends the start once the step under way (here the read of a database another
    # program holds, which SQLite waits up to 5 s for) lets go. A second, sent meanwhile, as an
    # impatient operator does, found no one watching: SIGINT ended it in "error: interrupted"
    # (exit 130), SIGTERM killed it (-15), rather than the start ending, saying so, with exit 0.
    state = tmp_path / "state"
    async with keel_process(state, fake_model.base_url) as keel:
        assert await keel.terminate() == 0

    def hold(database: Path) -> sqlite3.Connection:
        held = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
        held.execute("PRAGMA locking_mode = EXCLUSIVE")  # no other connection reads it meanwhile
        held.execute("BEGIN EXCLUSIVE")
        return held

    held = await trio.to_thread.run_sync(hold, state / "runtime.db")
    try:
        process = await trio.lowlevel.open_process(
            serve_command(state, fake_model.base_url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env()
        )
        said = bytearray()

        async def read_all() -> None:
            assert process.stdout is not None
            async for chunk in process.stdout:
                said.extend(chunk)

        async def wait_said(line: bytes, times: int) -> None:
            while said.count(line) < times:
                assert process.poll() is None, f"serve exited with {process.returncode}: {said.decode()}"
                await trio.sleep(0.01)  # polling against a deadline: the line comes within ms

        with trio.fail_after(STARTUP_DEADLINE_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all)
                while not has_open(process, state / "runtime.db"):  # its preflight waits for the database
                    await trio.sleep(0.01)
                for times in (1, 2):
                    process.send_signal(sig)
                    await wait_said(f"{sig.name} before the server was serving".encode(), times)
                await trio.to_thread.run_sync(held.close)  # in this locking mode, only closing lets go
                returncode = await process.wait()
    finally:
        await trio.to_thread.run_sync(held.close)  # a test that failed midway
    assert returncode == 0, said.decode()
    assert "Traceback" not in said.decode() and "error:" not in said.decode() and "keel serving" not in said.decode()


def has_loaded(process: trio.Process, library: str) -> bool:
    """Whether ``process`` has mapped a shared library whose path holds ``library``. One that has
    exited never will (its map reads empty until it is reaped): that fails at once, not at the
    deadline."""
    assert process.poll() is None, f"serve exited with {process.returncode} before it loaded {library}"
    return library in Path(f"/proc/{process.pid}/maps").read_text()


# How a script starts a background job (`serve &`) when it has no job control: with SIGINT (and
# SIGQUIT) ignored, so that a Ctrl-C meant for the script does not reach it.
IGNORING_SIGNALS = ("sh", "-c", 'trap "" INT TERM && exec "$@"', "sh")


@pytest.mark.parametrize("started_by", [(), IGNORING_SIGNALS], ids=["from-a-terminal", "ignoring-them"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda sig: sig.name)
@pytest.mark.parametrize(
    "loading",
    [
        "_sqlite3",  # imported with the configuration, before the event loop runs
        "markupsafe",  # imported with the HTTP surface, once the event loop runs
    ],
)
async def test_a_signal_while_serve_loads_its_modules_ends_the_start_as_one_a_moment_later_does(
    tmp_path: Path, fake_model: FakeModel, sig: signal.Signals, loading: str, started_by: tuple[str, ...]
) -> None:
    # A Ctrl-C in serve's first second ended in a KeyboardInterrupt traceback, and a SIGTERM
    # killed it without a word. The generation lock, held, keeps it from serving meanwhile.
    # Started with the two ignored, serve lost a SIGINT that came while its modules loaded: the
    # event loop, setting up, set SIGINT's handler to what it was (ignored), which drops a signal
    # held pending. It takes both once it serves, however it was started; so it does while it starts.
    said = b""
    async with serve_kept_waiting(tmp_path / "state", fake_model, started_by=started_by) as process:
        with trio.move_on_after(STARTUP_DEADLINE_S) as deadline:
            while not has_loaded(process, loading):
                await trio.sleep(0.002)  # polling against a deadline: the library is mapped within a second
            process.send_signal(sig)
            assert process.stdout is not None
            async for chunk in process.stdout:
                said += chunk
            returncode = await process.wait()
        assert not deadline.cancelled_caught, f"serve did not end within {STARTUP_DEADLINE_S} s; it said: {said.decode()!r}"
    assert returncode == 0, said.decode()
    assert "Traceback" not in said.decode() and "keel serving" not in said.decode()
    assert f"{sig.name} before the server was serving: not starting" in said.decode()


@pytest.mark.parametrize(
    ("started_by", "reason"),
    [
        ((), "Broken pipe"),  # `serve | head -0`, or stdout on a full disk
        (("sh", "-c", 'exec "$@" >&-', "sh"), "it is closed"),  # `serve >&-`: the line went nowhere, unlogged
    ],
    ids=["broken", "closed"],
)
async def test_serve_keeps_serving_when_its_standard_output_cannot_be_written(
    tmp_path: Path, fake_model: FakeModel, started_by: tuple[str, ...], reason: str
) -> None:
    # The line saying where it serves cannot be written. The server went down saying
    # "error: Broken pipe", as if its storage had failed.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        command = [*started_by, *serve_command(tmp_path / "state", fake_model.base_url)]
        process = await trio.lowlevel.open_process(command, stdout=write_end, stderr=subprocess.PIPE, env=child_env())
    finally:
        os.close(write_end)
    assert process.stderr is not None
    said = b""
    warned = re.compile(rb"standard output cannot be written \(" + reason.encode() + rb"\); keel serving A2A at (\S+) ")
    with trio.fail_after(STARTUP_DEADLINE_S):
        while not (found := warned.search(said)):
            chunk = await process.stderr.receive_some(65536)
            assert chunk, f"serve exited with {await process.wait()}:\n{said.decode()}"
            said += chunk
        async with httpx.AsyncClient() as client:
            assert (await client.get(found.group(1).decode() + "livez")).json() == {"status": "alive"}
        process.send_signal(signal.SIGTERM)
        async for chunk in process.stderr:
            said += chunk
        assert await process.wait() == 0, said.decode()
    assert "Traceback" not in said.decode()
    assert not [line for line in said.decode().splitlines() if line.startswith("error:")]


async def test_serve_raises_its_open_files_limit_to_the_most_it_may_have(tmp_path: Path, fake_model: FakeModel) -> None:
    # A shell leaves a soft limit of 1024 descriptors, a connection each; the hard limit is
    # what the operator allows. Go programs take the hard one as they start; so does serve.
    limited = ["sh", "-c", 'ulimit -Sn 64 && ulimit -Hn 2048 && exec "$@"', "sh"]
    async with started_keel([*limited, *serve_command(tmp_path / "state", fake_model.base_url)]) as keel:
        limits = Path(f"/proc/{keel.process.pid}/limits").read_text()
        assert await keel.terminate() == 0
    (open_files,) = [line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files")]
    assert open_files == ["2048", "2048"], limits


TOO_FEW_FILES = (
    "serve may have at most 16 files open (ulimit -n), and needs 32: it holds about 20 of its own, and one"
    " more for each client connection and each model connection; raise the limit"
)


async def test_serve_allowed_too_few_open_files_says_so_not_that_its_database_or_its_address_failed(tmp_path: Path) -> None:
    # Its start ran out of descriptors where it happened to: it said tasks.db had failed ("unable
    # to open database file"), or that it could not listen, to check the host and the port.
    limited = ["sh", "-c", 'ulimit -n 16 && exec "$@"', "sh"]
    result = await run_to_exit([*limited, *serve_command(tmp_path / "state", "http://127.0.0.1:9/v1")])
    assert (result.returncode, result.stdout, result.stderr) == (1, "", f"error: {TOO_FEW_FILES}\n")
    assert not (tmp_path / "state").exists()


async def test_check_says_when_serve_would_be_allowed_too_few_open_files(tmp_path: Path) -> None:
    # The hard limit is the one serve takes.
    limited = ["sh", "-c", 'ulimit -Sn 16 && ulimit -Hn 16 && exec "$@"', "sh"]
    check = [sys.executable, "-m", "runtime", "check", "--port", "0", "--state-dir", str(tmp_path / "state")]
    result = await run_to_exit([*limited, *check])
    assert result.returncode == 1, result
    assert f"  - {TOO_FEW_FILES}\n" in result.stderr, result.stderr
    raised = await run_to_exit(["sh", "-c", 'ulimit -Sn 16 && ulimit -Hn 64 && exec "$@"', "sh", *check])
    assert raised.returncode == 0, raised


async def test_a_server_out_of_file_descriptors_says_so_in_one_line_and_serves_again_once_some_close(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    limited = ["sh", "-c", 'ulimit -n 64 && exec "$@"', "sh", *serve_command(tmp_path / "state", fake_model.base_url)]
    async with started_keel(limited) as keel, httpx.AsyncClient(timeout=30) as client:
        address = urlsplit(keel.url)
        assert address.hostname is not None and address.port is not None
        held: list[trio.SocketStream] = []
        try:
            with trio.fail_after(STARTUP_DEADLINE_S):
                # Each one it takes holds a descriptor: past 64 in all, accept fails. The rest wait
                # in the listen queue, which is never filled, so the next client is queued at once.
                for _ in range(60):
                    held.append(await trio.open_tcp_stream(address.hostname, address.port))
                while b"cannot accept connections" not in keel.output:
                    await trio.sleep(0.01)  # polling the output against the deadline
        finally:
            for stream in held:
                await stream.aclose()
        assert (await client.get(keel.url + "livez")).json() == {"status": "alive"}
        assert await keel.terminate() == 0
    output = keel.output.decode()
    assert output.count("cannot accept connections") == 1, output
    # And when it can again: the operator reading the warning learns it has passed.
    assert output.count("accepting connections again") == 1, output
    assert output.index("cannot accept connections") < output.index("accepting connections again")
    assert "as many files open as its limit allows (64: ulimit -n)" in output and "Traceback" not in output


async def test_serve_in_an_azure_pipelines_job_starts_and_logs_the_agent_variables_it_ignores(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Azure Pipelines sets AGENT_OS, AGENT_NAME and more in every job: they are no typo of a setting.
    command = ["env", "AGENT_OS=Linux", "AGENT_NAME=Hosted Agent", *serve_command(tmp_path / "state", fake_model.base_url)]
    async with started_keel(command) as keel:
        assert b"ignoring AGENT_NAME, AGENT_OS: not settings Keel knows, nor like one" in keel.output


async def test_serve_sends_the_model_the_key_its_key_file_holds(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.api_key = "sk-from-a-secret-file"
    fake_model.script = [Reply(text="Authorised.")]
    key_file = tmp_path / "model-key"
    key_file.write_text("sk-from-a-secret-file\n")  # as `echo KEY > file` or a secret store writes it
    async with (
        httpx.AsyncClient(timeout=30) as client,
        keel_process(tmp_path / "state", fake_model.base_url, "--model-api-key-file", str(key_file)) as keel,
    ):
        sent = await rpc(client, keel.url, "SendMessage", {"message": user_message("hi")})
        assert await keel.terminate() == 0
    assert sent["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", sent
    assert {item.headers["authorization"] for item in fake_model.received} == {"Bearer sk-from-a-secret-file"}
    assert b"sk-from-a-secret-file" not in keel.output
