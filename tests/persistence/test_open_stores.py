"""``open_session_store`` and ``open_task_store`` as a program outside the server uses them: an
error raised in the block comes out as itself, not inside an exception group."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from persistence.session import Session
from persistence.sessions import open_session_store
from persistence.tasks import open_task_store
from persistence.transcript import Message

DEADLINE_S = 10.0


class Failed(Exception):
    pass


async def test_an_error_in_a_session_stores_block_comes_out_as_itself(tmp_path: Path) -> None:
    cause = KeyError("the caller's own")
    with trio.fail_after(DEADLINE_S), pytest.raises(Failed, match="the model failed") as caught:
        async with open_session_store(tmp_path / "runtime.db") as store:
            await Session.open("s", store).save([Message(role="user", text="Hi")])
            raise Failed("the model failed") from cause
    assert caught.value.__cause__ is cause  # left as it was raised
    # The store was closed all the same, what it wrote durable.
    async with open_session_store(tmp_path / "runtime.db") as store:
        assert await Session.open("s", store).messages() == [Message(role="user", text="Hi")]


async def test_an_error_in_a_task_stores_block_comes_out_as_itself(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S), pytest.raises(Failed, match="no luck"):
        async with open_task_store(tmp_path / "tasks.db"):
            raise Failed("no luck")


async def test_a_cancel_of_the_block_still_ends_it_quietly(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        with trio.CancelScope() as scope:
            async with open_session_store(tmp_path / "runtime.db"):
                scope.cancel()
                await trio.sleep_forever()
    assert scope.cancelled_caught
