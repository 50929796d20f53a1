"""A state directory an older build left, taken up by this one as an operator does it, each step a
real process: `check`, a start killed in its migration, `serve`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import trio

from fake_model import FakeModel, Reply
from persistence.sessions import SESSIONS_SCHEMA
from persistence.tasks import TASKS_SCHEMA
from tests.e2e.harness import STARTUP_DEADLINE_S, keel_process, rpc, run_to_exit, user_message
from tests.persistence.older_builds import make_older, store_question, store_steer, store_task
from tests.persistence.test_other_builds import kill_in_last_migration


async def check(state: Path) -> subprocess.CompletedProcess[str]:
    return await run_to_exit([sys.executable, "-m", "runtime", "check", "--port", "0", "--state-dir", str(state)])


async def test_check_says_which_databases_serve_brings_up_to_date_and_serve_says_it_did(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    make_older(state / "runtime.db", "keel.sessions", 3)
    make_older(state / "tasks.db", "keel.tasks", 2)
    sessions_now, tasks_now = f"keel.sessions@{SESSIONS_SCHEMA.version}", f"keel.tasks@{TASKS_SCHEMA.version}"
    checked = await check(state)
    assert checked.returncode == 0, checked.stderr
    # After that start, a build of the older schema refuses the files: the operator is told before.
    assert f"runtime.db holds keel.sessions@3; serve brings it up to {sessions_now}" in checked.stdout
    assert f"tasks.db holds keel.tasks@2; serve brings it up to {tasks_now}" in checked.stdout
    assert "an older build cannot open it after that" in checked.stdout and "state snapshot" in checked.stdout
    assert checked.stdout.endswith("configuration ok\n")
    async with keel_process(state, fake_model.base_url) as keel:
        assert await keel.terminate() == 0
    log = keel.output.decode()
    assert f"runtime.db holds keel.sessions@3; serve brings it up to {sessions_now}" in log, log
    assert f"tasks.db holds keel.tasks@2; serve brings it up to {tasks_now}" in log, log
    checked = await check(state)
    assert checked.returncode == 0 and "brings it up to" not in checked.stdout, checked.stdout


# The task a build of keel.tasks@2 left working: its question, and the steer it recorded.
WORKING_TASK = (
    '{"id":"t-old","contextId":"c-old","status":{"state":"TASK_STATE_WORKING","timestamp":"2026-11-30T07:00:00.123Z"},'
    '"history":[{"messageId":"m-q","role":"ROLE_USER","parts":[{"text":"Count to three."}],"taskId":"t-old","contextId":"c-old"},'
    '{"messageId":"m-steer","role":"ROLE_USER","parts":[{"text":"In French."}],"taskId":"t-old","contextId":"c-old"}]}'
)


async def test_a_steer_an_older_build_left_pending_survives_a_migration_killed_midway_and_steers_once(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    make_older(state / "tasks.db", "keel.tasks", 2)
    make_older(state / "runtime.db", "keel.sessions", 3)
    store_task(state / "tasks.db", "t-old", "c-old", "TASK_STATE_WORKING", WORKING_TASK)
    store_question(state / "runtime.db", "c-old", "Count to three.", "t-old")
    store_steer(state / "runtime.db", "c-old", "t-old", "m-steer", "In French.")
    await kill_in_last_migration(state / "runtime.db", "persistence.sessions:SESSIONS_SCHEMA")
    assert (await check(state)).returncode == 0
    fake_model.default = Reply(text="Un, deux, trois.")
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=30) as client:
        with trio.fail_after(STARTUP_DEADLINE_S):
            while (task := (await rpc(client, keel.url, "GetTask", {"id": "t-old"}))["result"])["status"][
                "state"
            ] == "TASK_STATE_WORKING":
                await trio.sleep(0.02)
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
        assert [m["messageId"] for m in task["history"][:2]] == ["m-q", "m-steer"]
        [asked] = fake_model.bodies
        [question] = [m["content"] for m in asked["messages"] if m["role"] == "user"]
        assert question.count("Count to three.") == 1 and question.count("In French.") == 1, question
        # Sent again (its answer lost), the steer gets its task back, and steers nothing.
        again = user_message("In French.", context_id="c-old", task_id="t-old") | {"messageId": "m-steer"}
        resent = await rpc(client, keel.url, "SendMessage", {"message": again})
        assert resent["result"]["task"]["id"] == "t-old", resent
        assert [m["messageId"] for m in resent["result"]["task"]["history"]].count("m-steer") == 1
        assert len(fake_model.bodies) == 1
        assert await keel.terminate() == 0
