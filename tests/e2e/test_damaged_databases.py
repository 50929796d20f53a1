"""Databases of a state directory damaged as disks, people and tools damage them (a page of bytes
flipped, a file emptied or removed), with `check`, `serve` and the state commands as real processes
on real files: none of them serves or copies a damaged file as if it were sound, each names the file
and says what to do, and damage found while serving fails only what it touches."""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from fake_model import FakeModel, Reply
from persistence.tasks import open_task_store
from protocol import Message, Role, Task, TaskState, TaskStatus, TextPart
from runtime.runner import ANONYMOUS
from runtime.tasks import encode, new_id
from tests.e2e.harness import keel_process, rpc, run_serve_to_exit, run_to_exit, user_message
from tests.e2e.test_model_after_restart import free_port
from tests.persistence.state_helpers import fingerprint

PAGE = 4096
RESTORE = "python -m runtime state restore"


async def check(state: Path) -> str:
    """What `check` says of ``state``, which it must refuse."""
    checked = await run_to_exit([sys.executable, "-m", "runtime", "check", "--port", "0", "--state-dir", str(state)])
    assert checked.returncode == 1, checked.stdout
    assert "Traceback" not in checked.stderr
    return checked.stderr


async def refused_snapshot(state: Path, backups: Path) -> str:
    """What `state snapshot` says of ``state``, which it must refuse, publishing nothing."""
    command = [sys.executable, "-m", "runtime", "state", "snapshot", "--state-dir", str(state), "--backup-root", str(backups)]
    taken = await run_to_exit(command)
    assert taken.returncode == 1, taken.stdout
    assert "Traceback" not in taken.stderr and "no snapshot" in taken.stderr, taken.stderr
    assert not backups.exists() or os.listdir(backups) == []
    return taken.stderr


async def refused_by_serve(state: Path, model_url: str) -> str:
    served = await run_serve_to_exit(state, model_url)
    assert served.returncode == 1, served.stdout
    assert "Traceback" not in served.stderr and "keel serving" not in served.stdout
    return served.stderr


async def served_tasks(state: Path, fake_model: FakeModel, count: int) -> list[str]:
    """A state directory in which ``count`` tasks were answered, each its own conversation; their ids."""
    fake_model.script = [Reply(text=f"Answer {n}.") for n in range(count)]
    ids = []
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        for n in range(count):
            # Each question fills most of a page, so that each task is on pages of its own.
            sent = await rpc(client, keel.url, "SendMessage", {"message": user_message(f"Question {n} " + "x" * 2500)})
            ids.append(sent["result"]["task"]["id"])
        await keel.terminate()
    return ids


def pages_of(path: Path, table: str) -> list[int]:
    """The numbers of the leaf pages of ``table`` (or index) in the database ``path``."""
    with closing(sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)) as conn:  # nothing made beside it
        rows = conn.execute("SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf' ORDER BY pageno", (table,))
        return [row[0] for row in rows]


def page_holding(path: Path, text: str, table: str = "tasks") -> int:
    """The leaf page of ``table`` whose bytes hold ``text`` (a task's id, say)."""
    data = path.read_bytes()
    for page in pages_of(path, table):
        if text.encode() in data[(page - 1) * PAGE : page * PAGE]:
            return page
    raise AssertionError(f"no page of {table} holds {text!r}")


def flip(path: Path, page: int, offset: int, length: int) -> None:
    """Invert ``length`` bytes at ``offset`` of page ``page``: what a failing disk does."""
    with open(path, "r+b") as handle:
        handle.seek((page - 1) * PAGE + offset)
        data = handle.read(length)
        handle.seek((page - 1) * PAGE + offset)
        handle.write(bytes(byte ^ 0xFF for byte in data))


def no_longer_utf8(path: Path) -> None:
    """Flip a byte in the middle of question 0's text in the database ``path``: an "x" becomes a
    byte that starts no UTF-8 character, and every page stays sound."""
    data = bytearray(path.read_bytes())
    data[data.index(b"Question 0 " + b"x" * 100) + 50] ^= 0xFF
    path.write_bytes(data)


def said_damaged_once(log: str, path: Path) -> None:
    """The server's ``log`` says once that the database ``path`` is damaged, and how to restore
    it, in its own words: not SQLite's ("malformed"), nor a traceback."""
    assert log.count(f"{path}: the database file is damaged") == 1, log
    assert RESTORE in log and "Traceback" not in log and "malformed" not in log, log


def emptied(name: str) -> Callable[[Path], None]:
    def damage(state: Path) -> None:
        (state / name).write_bytes(b"")  # replaced by an empty file, as a tool that "resets" it does

    return damage


def removed(name: str) -> Callable[[Path], None]:
    def damage(state: Path) -> None:
        (state / name).unlink()

    return damage


@pytest.mark.parametrize(
    ("damage", "name", "what", "other", "holds"),
    [
        (emptied("tasks.db"), "tasks.db", "is empty", "runtime.db", "conversations"),
        (removed("tasks.db"), "tasks.db", "is missing", "runtime.db", "conversations"),
        (emptied("runtime.db"), "runtime.db", "is empty", "tasks.db", "tasks"),
        (removed("runtime.db"), "runtime.db", "is missing", "tasks.db", "tasks"),
    ],
)
async def test_check_and_serve_refuse_a_database_emptied_or_removed_beside_one_that_holds_state_and_change_nothing(
    tmp_path: Path, fake_model: FakeModel, damage: Callable[[Path], None], name: str, what: str, other: str, holds: str
) -> None:
    # Served as it is, the file would be made anew and every task (or conversation) it held answered
    # for as if it had never been: a message sent again would start its task a second time.
    state = tmp_path / "state"
    await served_tasks(state, fake_model, 1)
    damage(state)
    before = fingerprint(state)

    said = f"{state / name}: {what}, but {other} beside it holds {holds}"
    assert said in await check(state)
    refused = await refused_by_serve(state, fake_model.base_url)
    assert said in refused and RESTORE in refused, refused
    # Nor is it snapshotted: kept, such a snapshot would take the place of one taken before the loss.
    not_taken = await refused_snapshot(state, tmp_path / "backups")
    assert f"{state / name} cannot be snapshotted as it is: it {what}, but {other}" in not_taken, not_taken
    assert fingerprint(state) == before  # nothing made, nothing brought up to date


@pytest.mark.parametrize(
    ("offset", "said"),
    [
        (0, "cannot be read as a database: it is damaged"),  # the page's header: its kind and its cells' places
        (PAGE - 40, "is damaged (SQLite's integrity check of it found: "),  # a key: the index no longer matches its table
    ],
    ids=["header", "key"],
)
async def test_check_and_snapshot_refuse_a_database_with_a_damaged_index_page_naming_it_and_the_restore(
    tmp_path: Path, fake_model: FakeModel, offset: int, said: str
) -> None:
    # tasks_by_message is what keeps a message sent again from starting a second task: served with
    # a damaged page, it could answer that the message started none. Only reading the file whole
    # finds it, which `check` does (serve's start does not: it would take longer as the state grows).
    state = tmp_path / "state"
    await served_tasks(state, fake_model, 2)
    [page] = pages_of(state / "tasks.db", "tasks_by_message")
    flip(state / "tasks.db", page, offset, 12)
    before = fingerprint(state)

    said = f"{state / 'tasks.db'}: {said}"
    checked = await check(state)
    assert said in checked and RESTORE in checked, checked
    assert "malformed" not in checked  # SQLite's words are not the explanation
    not_taken = await refused_snapshot(state, tmp_path / "backups")
    assert f"{state / 'tasks.db'} is damaged" in not_taken and RESTORE in not_taken, not_taken
    assert fingerprint(state) == before


async def test_a_page_damaged_under_the_server_fails_only_the_tasks_on_it_says_so_once_and_readiness_says_why(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    damaged, sound = await served_tasks(state, fake_model, 2)
    fake_model.script = [Reply(text="Paged the on-call.")]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        flip(state / "tasks.db", page_holding(state / "tasks.db", damaged), 0, 12)  # a disk failing under it
        for _ in range(3):
            failed = await rpc(client, keel.url, "GetTask", {"id": damaged})
            assert failed["error"]["code"] == -32603, failed
            message = failed["error"]["message"]
            assert "damaged" in message and "Try again" not in message, message
            assert "tasks.db" not in message and str(state) not in message  # the machine's paths are the log's
        listed = await rpc(client, keel.url, "ListTasks", {"pageSize": 10})
        assert "damaged" in listed["error"]["message"], listed
        found = await rpc(client, keel.url, "GetTask", {"id": sound})
        assert found["result"]["status"]["state"] == "TASK_STATE_COMPLETED", found
        answered = await rpc(client, keel.url, "SendMessage", {"message": user_message("Page the on-call")})
        assert answered["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", answered
        health = await client.get(keel.url + "healthz")
        assert health.status_code == 503, health.text
        assert "task store is damaged: tasks.db" in " ".join(health.json()["problems"]), health.text
        await keel.terminate()
    said_damaged_once(keel.output.decode(), state / "tasks.db")


async def test_a_damaged_page_that_fails_a_batch_of_concurrent_writes_is_logged_once(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # A new task goes where the newest tasks are: that page damaged, every task a message would
    # start fails there, those sent at once in one write batch, and the file is logged once.
    state = tmp_path / "state"
    newest = (await served_tasks(state, fake_model, 2))[-1]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        flip(state / "tasks.db", page_holding(state / "tasks.db", newest), 0, 12)
        answers: list[dict[str, Any]] = []

        async def send(n: int) -> None:
            answers.append(await rpc(client, keel.url, "SendMessage", {"message": user_message(f"Page the on-call {n}")}))

        async with trio.open_nursery() as nursery:
            for n in range(8):
                nursery.start_soon(send, n)
        for answer in answers:
            assert answer["error"]["code"] == -32603 and "damaged" in answer["error"]["message"], answer
        await keel.terminate()
    said_damaged_once(keel.output.decode(), state / "tasks.db")


async def test_a_server_that_crashes_after_its_write_ahead_log_was_removed_is_not_started_again_on_what_is_left(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # What runtime.db holds is in its -wal until a checkpoint: removed under the server, and the
    # server killed before it closed the file, the conversations went with it. Started again on
    # what is left, a server would carry on each conversation as if it had just begun.
    state = tmp_path / "state"
    fake_model.script = [Reply(text="Rolled back.")]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        await rpc(client, keel.url, "SendMessage", {"message": user_message("Roll back the deploy")})
        (state / "runtime.db-wal").unlink()  # a cleanup script that took it for a leftover
        await keel.kill()

    refused = await refused_by_serve(state, fake_model.base_url)
    assert f"{state / 'runtime.db'}: is empty, but tasks.db beside it holds tasks" in refused, refused
    assert RESTORE in refused, refused


async def test_a_task_whose_stored_text_is_no_longer_utf8_is_named_as_unreadable_and_the_others_are_served(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # A byte flipped in the middle of a task's JSON leaves every page sound: the row is what is
    # damaged, for its operator to restore, and no outage that passes; nor is what it says logged.
    state = tmp_path / "state"
    damaged, sound = await served_tasks(state, fake_model, 2)
    no_longer_utf8(state / "tasks.db")

    fake_model.script = [Reply(text="Paged the on-call.")]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        for method, params in (("GetTask", {"id": damaged}), ("ListTasks", {"pageSize": 10})):
            failed = await rpc(client, keel.url, method, params)
            assert failed["error"]["code"] == -32603, failed
            assert f"task {damaged!r} is stored in a form this server cannot read" in failed["error"]["message"], failed
        found = await rpc(client, keel.url, "GetTask", {"id": sound})
        assert found["result"]["status"]["state"] == "TASK_STATE_COMPLETED", found
        await keel.terminate()
    log = keel.output.decode()
    assert f"task {damaged!r} in tasks.db cannot be read (its JSON is not UTF-8" in log, log
    assert RESTORE in log and "xxxxxxxx" not in log, log  # what the task says is not the log's


async def served_conversations(state: Path, fake_model: FakeModel, count: int) -> list[str]:
    """A state directory in which ``count`` conversations were each answered once; their context ids."""
    ids = await served_tasks(state, fake_model, count)
    with closing(sqlite3.connect(f"{(state / 'tasks.db').as_uri()}?mode=ro&immutable=1", uri=True)) as conn:
        found = dict(conn.execute("SELECT id, context_id FROM tasks").fetchall())
    return [found[task_id] for task_id in ids]


async def sent_on(client: httpx.AsyncClient, url: str, context_id: str, text: str) -> dict[str, Any]:
    """The task a message in the conversation ``context_id`` ended as."""
    sent = await rpc(client, url, "SendMessage", {"message": user_message(text, context_id=context_id)})
    task: dict[str, Any] = sent["result"]["task"]
    return task


def status_text(task: dict[str, Any]) -> str:
    return str(task["status"]["message"]["parts"][0]["text"])


async def fail_as_damaged_and_the_other_goes_on(
    client: httpx.AsyncClient, url: str, state: Path, damaged: str, sound: str, *, turns: int
) -> None:
    """Each of ``turns`` turns of the conversation ``damaged`` fails saying it is damaged, naming
    no file of the machine; a turn of the conversation ``sound`` is answered."""
    for _ in range(turns):
        failed = await sent_on(client, url, damaged, "And then?")
        assert failed["status"]["state"] == "TASK_STATE_FAILED", failed
        said = status_text(failed)
        assert f"the conversation of context {damaged!r} is damaged in the server's storage" in said, said
        assert "storage is back" not in said and "runtime.db" not in said and str(state) not in said, said
    carried_on = await sent_on(client, url, sound, "And then?")
    assert carried_on["status"]["state"] == "TASK_STATE_COMPLETED", carried_on


async def test_a_conversation_whose_stored_text_is_no_longer_utf8_fails_its_own_turns_named_and_the_others_go_on(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # A byte flipped in the middle of a message of runtime.db leaves every page sound: the row is
    # what is damaged, for its operator to restore, and no outage that passes; nor is what it says logged.
    state = tmp_path / "state"
    damaged, sound = await served_conversations(state, fake_model, 2)
    no_longer_utf8(state / "runtime.db")

    fake_model.script = [Reply(text="Carried on.")]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        await fail_as_damaged_and_the_other_goes_on(client, keel.url, state, damaged, sound, turns=2)
        await keel.terminate()
    log = keel.output.decode()
    assert f"session {damaged!r} in runtime.db cannot be read (its message 0 is not UTF-8" in log, log
    assert RESTORE in log and "xxxxxxxx" not in log and "Could not decode" not in log, log
    assert "Traceback" not in log, log
    assert len(fake_model.bodies) == 3, fake_model.bodies  # the two answered before, and the sound one's


async def test_a_page_of_a_conversation_damaged_under_the_server_fails_its_turns_and_is_logged_once(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    state = tmp_path / "state"
    damaged, sound = await served_conversations(state, fake_model, 2)
    fake_model.script = [Reply(text="Carried on.")]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        runtime_db = state / "runtime.db"
        flip(runtime_db, page_holding(runtime_db, "Question 0 ", "events"), 0, 12)  # a disk failing under it
        await fail_as_damaged_and_the_other_goes_on(client, keel.url, state, damaged, sound, turns=3)
        health = await client.get(keel.url + "healthz")
        assert "session store is damaged: runtime.db" in " ".join(health.json()["problems"]), health.text
        await keel.terminate()
    said_damaged_once(keel.output.decode(), runtime_db)


async def test_a_turn_whose_save_meets_a_damaged_page_fails_saying_so_and_is_logged_once(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # A new conversation's first message goes where the newest events are: that page damaged,
    # every turn's save fails there, until the file is restored.
    state = tmp_path / "state"
    await served_conversations(state, fake_model, 2)
    fake_model.default = Reply(text="Never stored.")
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        runtime_db = state / "runtime.db"
        flip(runtime_db, pages_of(runtime_db, "events")[-1], 0, 12)
        for _ in range(2):
            sent = await rpc(client, keel.url, "SendMessage", {"message": user_message("Page the on-call")})
            failed = sent["result"]["task"]
            assert failed["status"]["state"] == "TASK_STATE_FAILED", failed
            said = status_text(failed)
            assert f"for context {failed['contextId']!r} failed: the server's storage is damaged where" in said, said
            assert "storage is back" not in said and "runtime.db" not in said, said
        await keel.terminate()
    said_damaged_once(keel.output.decode(), runtime_db)


async def left_to_run(path: Path, count: int) -> str:
    """``count`` tasks stored in the tasks.db ``path`` as submitted, as a process that stopped
    before their runs began leaves them, each in a conversation of its own; the oldest's id."""
    ids = []
    async with open_task_store(path) as tasks:
        for n in range(count):
            task_id, context_id = new_id(), new_id()
            question = Message(message_id=new_id(), role=Role.USER, parts=(TextPart(f"Question {n}"),), task_id=task_id)
            task = Task(id=task_id, context_id=context_id, status=TaskStatus(state=TaskState.SUBMITTED), history=(question,))
            await tasks.create(
                ANONYMOUS, task_id=task_id, context_id=context_id, state="TASK_STATE_SUBMITTED", task_json=encode(task),
                updated_at_ms=1_000_000 + n,
            )  # fmt: skip
            ids.append(task_id)
    return ids[0]


async def test_a_run_whose_working_state_meets_a_damaged_page_fails_saying_the_storage_is_damaged(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # By state, a working task is listed after the oldest task still to run: that page damaged,
    # a new task's WORKING write fails there, and its end, stored where the failed tasks are,
    # says the storage is damaged, not that it comes back. (The tasks left to run wait for a
    # model server that cannot be reached, and write nothing meanwhile.)
    state = tmp_path / "state"
    await served_tasks(state, fake_model, 1)
    tasks_db = state / "tasks.db"
    oldest = await left_to_run(tasks_db, 150)
    flip(tasks_db, page_holding(tasks_db, oldest, "tasks_state_recent"), 0, 12)
    async with (
        keel_process(state, f"http://127.0.0.1:{free_port()}/v1") as keel,
        httpx.AsyncClient(timeout=10) as client,
    ):
        sent = await rpc(client, keel.url, "SendMessage", {"message": user_message("Page the on-call")})
        failed = sent["result"]["task"]
        assert failed["status"]["state"] == "TASK_STATE_FAILED", failed
        said = status_text(failed)
        assert f"task {failed['id']!r} could not be stored as working: the server's storage is damaged" in said, said
        assert "storage is back" not in said and "tasks.db" not in said and str(state) not in said, said
        await keel.terminate()
    said_damaged_once(keel.output.decode(), tasks_db)


async def test_a_write_ahead_log_of_the_other_database_beside_one_is_named_as_the_cause(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # After a crash each database's -wal holds what it committed since its last checkpoint: one
    # copied over the other's (by hand, or by a tool that took them for the same), SQLite reads it
    # as the file's, and tasks.db reads as a conversations database. The file is not the cause.
    state = tmp_path / "state"
    fake_model.script = [Reply(text="Rolled back.")]
    async with keel_process(state, fake_model.base_url) as keel, httpx.AsyncClient(timeout=10) as client:
        await rpc(client, keel.url, "SendMessage", {"message": user_message("Roll back the deploy")})
        await keel.kill()
    (state / "tasks.db-wal").write_bytes((state / "runtime.db-wal").read_bytes())
    before = fingerprint(state)

    said = f"{state / 'tasks.db'}: is read as a keel.sessions database, not keel.tasks, because of the write-ahead log"
    checked = await check(state)
    assert said in checked and RESTORE in checked and "right place" not in checked, checked
    refused = await refused_by_serve(state, fake_model.base_url)
    assert said in refused and RESTORE in refused, refused
    # Nor is it snapshotted, nor its -wal moved into it (closing what it copies from would), to be lost.
    not_taken = await refused_snapshot(state, tmp_path / "backups")
    assert f"{state / 'tasks.db'} cannot be snapshotted as it is: it is read as a keel.sessions database" in not_taken
    assert RESTORE in not_taken, not_taken
    after = fingerprint(state)  # a reader rebuilds the index of a -wal in its -shm: the rest is as it was
    assert [name for name in after if after[name] != before.get(name) and not name.endswith("-shm")] == [], sorted(after)
