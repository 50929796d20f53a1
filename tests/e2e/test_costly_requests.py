"""What one client's request can make a real `python -m runtime serve` process hold in memory,
measured as the process's peak resident set (VmHWM) before and after it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from fake_model import FakeModel, Reply
from persistence.sessions import open_session_store
from persistence.tasks import open_task_store
from protocol import MAX_DATA_VALUES, Message, Role, Task, TaskState, TaskStatus, TextPart
from runtime.runner import ANONYMOUS
from runtime.tasks import STORED_VERSION, encode, new_id, now
from tests.e2e.harness import KeelProcess, keel_process, rpc, user_message

MIB = 1 << 20


def peak_rss_bytes(keel: KeelProcess) -> int:
    """The most memory the server process has held at once (VmHWM), in bytes."""
    status = Path(f"/proc/{keel.process.pid}/status").read_text()
    (line,) = [line for line in status.splitlines() if line.startswith("VmHWM:")]
    return int(line.split()[1]) * 1024


async def store_tasks_with_long_histories(state: Path, count: int, messages: int) -> set[str]:
    """``count`` completed tasks in tasks.db, each with ``messages`` messages of 1 MiB of text."""
    state.mkdir()
    ids = set()
    async with open_session_store(state / "runtime.db"):  # beside it, as a server leaves it
        pass
    async with open_task_store(state / "tasks.db", synchronous="OFF") as tasks:
        for i in range(count):
            history = tuple(
                Message(message_id=new_id(), role=Role.USER, parts=(TextPart(f"{i}:{m}:" + "x" * MIB),)) for m in range(messages)
            )
            task = Task(
                id=new_id(), context_id=f"ctx-{i}", status=TaskStatus(state=TaskState.COMPLETED, timestamp=now()), history=history
            )  # fmt: skip
            state_name = task.status.state.wire_name(STORED_VERSION)
            await tasks.create(ANONYMOUS, task_id=task.id, context_id=task.context_id, state=state_name, task_json=encode(task))
            ids.add(task.id)
    return ids


async def test_a_list_of_tasks_with_long_histories_holds_a_bounded_page_in_memory(tmp_path: Path, fake_model: FakeModel) -> None:
    # 16 tasks of 4 MiB each: a page of 100 of them, read whole, is 64 MiB of JSON before a task is
    # trimmed to no history; a page ends early, with a nextPageToken, once its tasks pass 8 MiB.
    state = tmp_path / "state"
    ids = await store_tasks_with_long_histories(state, count=16, messages=4)
    async with httpx.AsyncClient(timeout=30) as client, keel_process(state, fake_model.base_url) as keel:
        before = peak_rss_bytes(keel)
        page = (await rpc(client, keel.url, "ListTasks", {"pageSize": 100, "historyLength": 0}))["result"]
        grown = peak_rss_bytes(keel) - before
        assert grown < 32 * MIB, f"the page took {grown / MIB:.0f} MiB"
        assert page["totalSize"] == 16 and 1 <= len(page["tasks"]) < 16 and page["nextPageToken"]
        seen = [task["id"] for task in page["tasks"]]
        token = page["nextPageToken"]
        while token:
            page = (await rpc(client, keel.url, "ListTasks", {"pageSize": 100, "pageToken": token}))["result"]
            assert all(len(task["history"]) == 4 for task in page["tasks"])  # the whole history, as asked
            seen.extend(task["id"] for task in page["tasks"])
            token = page["nextPageToken"]
        assert sorted(seen) == sorted(ids)  # every task once
        grown = peak_rss_bytes(keel) - before
        assert grown < 48 * MIB, f"pages with their histories took {grown / MIB:.0f} MiB"



@pytest.mark.parametrize("held_in", ["data parts", "metadata"])
async def test_many_small_values_are_refused_before_a_run_holds_them(tmp_path: Path, fake_model: FakeModel, held_in: str) -> None:
    # 250,000 empty objects are 1 MiB as sent, and about 20 MiB held by each run that has them: in
    # its data parts, or in its metadata, which its task's history keeps as well.
    fake_model.default = Reply(text="never done", hang_after_chunks=1)  # runs that stay in memory
    wide: list[dict[str, object]] = [{} for _ in range(250_000)]
    holding = {"parts": [{"data": wide}]} if held_in == "data parts" else {"metadata": {"hosts": wide}}
    async with httpx.AsyncClient(timeout=30) as client, keel_process(tmp_path / "state", fake_model.base_url) as keel:
        before = peak_rss_bytes(keel)
        for _ in range(8):
            message = {**user_message("x"), **holding}
            sent = await rpc(client, keel.url, "SendMessage", {"message": message, "configuration": {"returnImmediately": True}})
            assert sent.get("error", {}).get("code") == -32602, str(sent)[:300]
            assert f"more than {MAX_DATA_VALUES} JSON values" in sent["error"]["message"], sent
        grown = peak_rss_bytes(keel) - before
        assert grown < 64 * MIB, f"the refused messages took {grown / MIB:.0f} MiB"
        message = {**user_message("x"), "parts": [{"data": [{} for _ in range(MAX_DATA_VALUES - 1)]}]}
        sent = await rpc(client, keel.url, "SendMessage", {"message": message, "configuration": {"returnImmediately": True}})
        assert sent["result"]["task"]["status"]["state"] == "TASK_STATE_SUBMITTED"  # the list and its objects: the limit
