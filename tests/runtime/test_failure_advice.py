"""What a failed task and a refused request tell their client, followed through the server: a
failure that may pass says to send the message again, and sent again it is answered; one that
will not pass does not say so."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from fake_model import OLLAMA_ERROR, ErrorReply, Reply

from tests.runtime.agent_support import refuse_writes_of_events
from tests.runtime.served import Served

SEND = {"1.0": "SendMessage", None: "message/send"}
BOTH = pytest.mark.parametrize("version", ["1.0", None], ids=["1.0", "0.3"])
AGAIN = "send the message again, with a new messageId"
FAILED = {"1.0": "TASK_STATE_FAILED", None: "failed"}
COMPLETED = {"1.0": "TASK_STATE_COMPLETED", None: "completed"}


def said(task: dict[str, Any]) -> str:
    return task["status"]["message"]["parts"][0]["text"]  # type: ignore[no-any-return]


async def followed(keel: Served, failed: dict[str, Any], text: str, version: str | None) -> dict[str, Any]:
    """The advice followed at once: the same words, a new messageId, in the failed task's conversation."""
    return await keel.send(text, version=version, contextId=failed["contextId"])


@BOTH
@pytest.mark.parametrize(
    "down",
    [
        ErrorReply(503),
        ErrorReply(429),
        Reply(text="The lease expired because", chunk_chars=5, error_after_chunks=3),
        Reply(text="The lease expired because", chunk_chars=5, error_after_chunks=3, error_event=OLLAMA_ERROR, done_after_error=False),
    ],
    ids=["http-503", "http-429", "error-mid-answer", "ollama-error-mid-answer"],
)
async def test_a_model_server_failing_for_a_moment_fails_the_task_saying_to_send_again_which_is_then_answered(
    keel: Served, version: str | None, down: ErrorReply | Reply
) -> None:
    keel.model.script = [down, Reply(text="The vault lease expired.")]
    failed = await keel.send("Why is checkout down?", version=version)
    assert failed["status"]["state"] == FAILED[version]
    assert AGAIN in said(failed), said(failed)
    assert "cannot read" not in said(failed), said(failed)
    again = await followed(keel, failed, "Why is checkout down?", version)
    assert again["status"]["state"] == COMPLETED[version], again


@pytest.mark.parametrize("status", [400, 401, 404])
async def test_a_model_server_refusing_the_request_fails_the_task_without_saying_to_send_it_again(
    keel: Served, status: int
) -> None:
    keel.model.script = [ErrorReply(status)]
    failed = await keel.send("Why is checkout down?")
    assert failed["status"]["state"] == "TASK_STATE_FAILED"
    assert "send the message again" not in said(failed), said(failed)


def allow_writes_of_events(path: Path) -> None:
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER refuse_events")


@BOTH
async def test_a_conversation_that_cannot_be_saved_fails_the_task_naming_its_context_and_saying_to_send_again(
    keel: Served, version: str | None
) -> None:
    keel.model.script = [Reply(text="Noted."), Reply(text="The vault lease expired.")]
    first = await keel.send("Here is the incident log.", version=version)
    refuse_writes_of_events(keel.state_dir / "runtime.db")
    failed = await keel.send("Why is checkout down?", version=version, contextId=first["contextId"])
    assert failed["status"]["state"] == FAILED[version]
    assert f"context {first['contextId']!r}" in said(failed), said(failed)
    assert "session" not in said(failed), said(failed)  # no word of the client's names it
    assert f"{AGAIN}, once the server's storage is back" in said(failed), said(failed)
    allow_writes_of_events(keel.state_dir / "runtime.db")
    again = await followed(keel, failed, "Why is checkout down?", version)
    assert again["status"]["state"] == COMPLETED[version], again


async def test_an_answer_that_cannot_be_saved_fails_the_task_without_saying_its_end_is_not_stored(keel: Served) -> None:
    keel.model.script = [Reply(text="The vault lease expired."), Reply(text="The vault lease expired.")]
    path = keel.state_dir / "runtime.db"
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "CREATE TRIGGER refuse_events BEFORE INSERT ON events WHEN NEW.content LIKE '%vault lease%'"
            " BEGIN SELECT RAISE(ABORT, 'disk is full'); END"
        )
    failed = await keel.send("Why is checkout down?")
    assert failed["status"]["state"] == "TASK_STATE_FAILED"
    # The task's end is what the client reads: stored, whatever became of the answer.
    assert "not stored" not in said(failed), said(failed)
    assert f"context {failed['contextId']!r}" in said(failed), said(failed)
    assert f"{AGAIN}, once the server's storage is back" in said(failed), said(failed)
    allow_writes_of_events(path)
    again = await followed(keel, failed, "Why is checkout down?", "1.0")
    assert again["status"]["state"] == "TASK_STATE_COMPLETED", again
