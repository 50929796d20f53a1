"""Every backend keeps the store contract of persistence.storetest."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import attrs
import pytest

import persistence.sessionwrites
from persistence import storetest
from persistence.memory import MemorySessionData, MemorySessionStore, MemoryTaskStore
from persistence.sessions import SqliteSessionStore, open_session_store
from persistence.tasks import SqliteTaskStore, open_task_store
from persistence.api import TaskRecord


@attrs.define
class SqliteBackend:
    directory: Path

    def sessions(self) -> AbstractAsyncContextManager[SqliteSessionStore]:
        return open_session_store(self.directory / "runtime.db")

    def tasks(self) -> AbstractAsyncContextManager[SqliteTaskStore]:
        return open_task_store(self.directory / "tasks.db")


@attrs.define
class MemoryBackend:
    session_data: MemorySessionData = attrs.Factory(MemorySessionData)
    task_data: dict[str, TaskRecord] = attrs.Factory(dict)
    started_by: dict[tuple[str, str], str] = attrs.Factory(dict)

    @asynccontextmanager
    async def sessions(self) -> AsyncIterator[MemorySessionStore]:
        store = MemorySessionStore(self.session_data)
        try:
            yield store
        finally:
            await store.aclose()

    @asynccontextmanager
    async def tasks(self) -> AsyncIterator[MemoryTaskStore]:
        store = MemoryTaskStore(self.task_data, self.started_by)
        try:
            yield store
        finally:
            await store.aclose()


CHECKS = storetest.SESSION_CHECKS + storetest.TASK_CHECKS


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
async def test_sqlite_stores_keep_the_contract(check: storetest.Check, tmp_path: Path) -> None:
    await check(SqliteBackend(tmp_path))


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
async def test_memory_stores_keep_the_contract(check: storetest.Check) -> None:
    await check(MemoryBackend())


async def test_run_contract_runs_every_check_and_names_a_failure() -> None:
    await storetest.run_contract(MemoryBackend)

    @attrs.define
    class ForgetfulBackend(MemoryBackend):
        @asynccontextmanager
        async def sessions(self) -> AsyncIterator[MemorySessionStore]:
            yield MemorySessionStore()  # a fresh store each time: nothing is shared or kept

    shared = "a_save_that_changes_an_earlier_message|two_stores_taking_at_once|a_steer_left_through_one_store|a_steer_left_again"
    with pytest.raises(AssertionError, match=shared):
        await storetest.run_contract(ForgetfulBackend)


async def test_sqlite_steers_pending_for_a_task_come_in_the_order_left_though_the_clock_steps_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each steer's record failed to reach its task (a full disk, say) and waits to be recorded in
    # its history, in the order the run took them. The clock is set back an hour between the
    # first two (an NTP step), and stands still for the last two (one millisecond).
    clock = [10_000_000_000]
    monkeypatch.setattr(persistence.sessionwrites, "now_ms", lambda: clock[0])
    async with open_session_store(tmp_path / "runtime.db") as store:
        for message_id, step_ms in (("m-3", -3_600_000), ("m-2", 0), ("m-1", 0), ("m-0", 0)):
            await store.add_steer("ctx", f"steer {message_id}", message_id=message_id, task_id="task-1", record=message_id)
            clock[0] += step_ms
        assert await store.take_steers("ctx", for_task="task-1") == ["steer m-3", "steer m-2", "steer m-1", "steer m-0"]
        pending = await store.pending_steers(session_id="ctx", task_id="task-1")
        assert [steer.message_id for steer in pending] == ["m-3", "m-2", "m-1", "m-0"]
