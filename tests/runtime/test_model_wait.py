"""Resumed runs waiting together for a model server not reachable yet (after a reboot, every task
a dead process left): said in one line as the first begins to wait and in one at shutdown, not in
a line each; each resumes once the server answers."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

import pytest
import trio

from fake_model import FakeModel
from runtime.models import ModelConfig, open_model_client
from runtime.reachable import ModelWait
from tests.e2e.test_model_after_restart import free_port

WAITING = 5
DEADLINE_S = 20


def lines(caplog: pytest.LogCaptureFixture, about: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if about in record.getMessage()]


async def runs_waiting(port: int, stopping: trio.Event, then: Callable[[], Awaitable[object]]) -> list[bool]:
    """What ``until_reachable`` answered each of WAITING runs that began to wait together for a
    model server at ``port`` where nothing listens; ``then`` runs once every one of them waits."""
    config = ModelConfig(base_url=f"http://127.0.0.1:{port}/v1", max_retries=0)
    answers: list[bool] = []
    async with open_model_client(config) as catalog:
        wait = ModelWait(catalog, stopping, endpoint=config.endpoint)

        async def resumed(task_id: str) -> None:
            answers.append(await wait.until_reachable(task_id))

        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as runs:
                for number in range(WAITING):
                    runs.start_soon(resumed, f"task-{number}")
                while wait.waiting < WAITING:
                    await trio.sleep(0.01)  # polling against the deadline: each run asks the catalog first
                await then()
    assert wait.waiting == 0
    return answers


async def test_runs_waiting_together_are_said_in_one_line_and_so_is_their_end_at_shutdown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    stopping = trio.Event()

    async def shut_down() -> None:
        stopping.set()

    assert await runs_waiting(free_port(), stopping, shut_down) == [False] * WAITING
    [waits] = lines(caplog, "waits for the model server")
    assert "to be reachable to resume: the model server cannot be reached" in waits, waits
    [stopped] = lines(caplog, "shutting down")
    assert f"and {WAITING - 1} other task(s) waiting for the model server to resume are canceled" in stopped, stopped


async def test_runs_waiting_together_each_resume_once_the_model_server_answers(
    caplog: pytest.LogCaptureFixture, nursery: trio.Nursery
) -> None:
    caplog.set_level(logging.INFO)
    port = free_port()
    comes_up = functools.partial(nursery.start, functools.partial(FakeModel().serve, port=port))
    assert await runs_waiting(port, trio.Event(), comes_up) == [True] * WAITING
    assert len(lines(caplog, "waits for the model server")) == 1
    resumes = lines(caplog, "resumes: the model server is reachable after")
    assert sorted(line.split()[1] for line in resumes) == [f"task-{number}" for number in range(WAITING)], resumes
