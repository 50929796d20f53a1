"""A running `python -m runtime serve` and what happens to its state directory meanwhile: other
processes reading its databases, files removed or replaced under it."""

from __future__ import annotations

import sqlite3
import sys
from contextlib import closing
from pathlib import Path

import httpx
from fake_model import FakeModel, Reply

from tests.e2e.harness import keel_process, rpc, run_to_exit, user_message


async def test_a_snapshot_after_a_readiness_poll_leaves_the_servers_log_and_loses_nothing_acknowledged(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # The server keeps a lock on each database it has open: the last process to close one moves
    # its -wal into it and removes it. A readiness poll must not let that lock go, or a snapshot
    # taken after it (another process, closing) removes the -wal the server goes on writing.
    state = tmp_path / "state"
    fake_model.script = [Reply(text="Rolled back."), Reply(text="Paged the on-call.")]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        first = (await rpc(client, keel.url, "SendMessage", {"message": user_message("Roll back the deploy")}))["result"]["task"]
        assert (await client.get(keel.url + "healthz")).json() == {"status": "ready"}
        snapshot = [sys.executable, "-m", "runtime", "state", "snapshot", "--state-dir", str(state)]
        taken = await run_to_exit(snapshot)
        assert taken.returncode == 0, taken.stderr
        assert sorted(p.name for p in state.glob("*.db-wal")) == ["runtime.db-wal", "tasks.db-wal"]
        second = (await rpc(client, keel.url, "SendMessage", {"message": user_message("Page the on-call")}))["result"]["task"]
        assert second["status"]["state"] == "TASK_STATE_COMPLETED"
        await keel.kill()  # a crash: what was acknowledged must be on disk

    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        for task in (first, second):
            found = await rpc(client, keel.url, "GetTask", {"id": task["id"]})
            assert found["result"]["status"]["state"] == "TASK_STATE_COMPLETED", found
        await keel.terminate()


async def test_a_removed_write_ahead_log_refuses_writes_says_so_and_keeps_what_was_acknowledged(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    fake_model.script = [Reply(text="Rolled back."), Reply(text="Paged the on-call.")]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        first = (await rpc(client, keel.url, "SendMessage", {"message": user_message("Roll back the deploy")}))["result"]["task"]
        for log in ("runtime.db-wal", "tasks.db-wal"):
            (state / log).unlink()  # a cleanup script that took them for leftovers
        page = user_message("Page the on-call")
        refused = await rpc(client, keel.url, "SendMessage", {"message": page})
        assert refused["error"]["code"] == -32603, refused
        health = await client.get(keel.url + "healthz")
        assert health.status_code == 503
        assert "task store is not usable: tasks.db (DatabaseGone)" in health.json()["problems"]
        await keel.terminate()  # as the log says: closing the databases moves what the removed logs hold into them
    assert "tasks.db-wal: the database's write-ahead log was removed or replaced" in keel.output.decode()

    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        found = await rpc(client, keel.url, "GetTask", {"id": first["id"]})
        assert found["result"]["status"]["state"] == "TASK_STATE_COMPLETED", found
        sent_again = await rpc(client, keel.url, "SendMessage", {"message": page})
        assert sent_again["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", sent_again
        await keel.terminate()


async def test_healthz_says_a_database_replaced_under_the_server_takes_no_writes(tmp_path: Path, fake_model: FakeModel) -> None:
    state = tmp_path / "state"
    fake_model.script = [Reply(text="Rolled back.")]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        await rpc(client, keel.url, "SendMessage", {"message": user_message("Roll back the deploy")})
        copy = tmp_path / "tasks-copy.db"
        with closing(sqlite3.connect(state / "tasks.db")) as live, closing(sqlite3.connect(copy)) as target:
            live.backup(target)
        copy.rename(state / "tasks.db")  # an operator putting back a copy under the running server
        refused = await rpc(client, keel.url, "SendMessage", {"message": user_message("Page the on-call")})
        assert refused["error"]["code"] == -32603, refused
        health = await client.get(keel.url + "healthz")
        assert (health.status_code, health.json()["problems"]) == (503, ["task store is not usable: tasks.db (DatabaseGone)"])
        await keel.terminate()
