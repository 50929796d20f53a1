"""A state directory an earlier build wrote, served by this one: its tasks read back, list and resume."""

from __future__ import annotations

from pathlib import Path

import trio
from fake_model import FakeModel, Reply

from tests.persistence.older_builds import make_older, store_question, store_task
from tests.runtime.served import DEADLINE_S, JsonObject, Served, serve_keel

# Builds before numbers past a double's range were refused stored them as json.dumps writes
# them by default: Infinity, -Infinity and NaN, which no JSON reader takes.
NON_FINITE_TASK = (
    '{"id":"t-old","contextId":"c-old","status":{"state":"TASK_STATE_COMPLETED","timestamp":"2026-11-30T07:00:00.123456Z"},'
    '"history":[{"messageId":"m-old","role":"ROLE_USER","parts":[{"data":{"big":Infinity,"small":-Infinity,"odd":NaN}}],'
    '"taskId":"t-old","contextId":"c-old"}]}'
)


async def test_a_task_an_older_build_stored_with_a_number_past_a_double_reads_and_lists(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state_dir = tmp_path / "state"
    make_older(state_dir / "tasks.db", "keel.tasks", 1)
    make_older(state_dir / "runtime.db", "keel.sessions", 1)
    store_task(state_dir / "tasks.db", "t-old", "c-old", "TASK_STATE_COMPLETED", NON_FINITE_TASK)
    async with serve_keel(state_dir, fake_model) as keel:
        task = await keel.result("GetTask", {"id": "t-old"})
        # Read as ProtoJSON spells the numbers JSON has no literal for.
        assert task["history"][0]["parts"][0]["data"] == {"big": "Infinity", "small": "-Infinity", "odd": "NaN"}
        listed = await keel.result("ListTasks", {})
        assert [t["id"] for t in listed["tasks"]] == ["t-old"]
        old = await keel.result("tasks/get", {"id": "t-old"}, version=None)
        assert old["history"][0]["parts"][0]["data"]["big"] == "Infinity"


WORKING_TASK = (
    '{"id":"t-work","contextId":"c-work","status":{"state":"TASK_STATE_WORKING","timestamp":"2026-11-30T07:00:00.123456Z"},'
    '"history":[{"messageId":"m-work","role":"ROLE_USER","parts":[{"text":"How big?"},{"data":{"size":Infinity}}],'
    '"taskId":"t-work","contextId":"c-work"}]}'
)


async def settled(keel: Served, task_id: str) -> JsonObject:
    with trio.fail_after(DEADLINE_S):
        while (task := await keel.result("GetTask", {"id": task_id}))["status"]["state"] == "TASK_STATE_WORKING":
            await trio.sleep(0.01)
    return task  # type: ignore[no-any-return]


async def test_a_task_an_older_build_left_working_is_resumed_from_its_transcript(tmp_path: Path, fake_model: FakeModel) -> None:
    state_dir = tmp_path / "state"
    make_older(state_dir / "tasks.db", "keel.tasks", 1)
    make_older(state_dir / "runtime.db", "keel.sessions", 1)
    store_task(state_dir / "tasks.db", "t-work", "c-work", "TASK_STATE_WORKING", WORKING_TASK)
    store_question(state_dir / "runtime.db", "c-work", 'How big?\n\n{"size": Infinity}', "t-work")
    fake_model.script = [Reply(text="Endless.")]
    async with serve_keel(state_dir, fake_model) as keel:
        task = await settled(keel, "t-work")
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
        assert task["artifacts"][0]["parts"] == [{"text": "Endless."}]
        [asked] = fake_model.bodies
        assert [m["role"] for m in asked["messages"]] == ["system", "user"]  # the question, asked once
