"""What a hostile client can make a real `python -m runtime serve` process write: its log, on the
terminal or file an operator reads, holds no line the client wrote."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from fake_model import ErrorReply, FakeModel
from tests.e2e.harness import keel_process, rpc, user_message

# A line of the server's log as `serve` writes it: "2026-01-31T12:00:00.000Z WARNING runtime.runner: ...".
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z [A-Z]+ ")
FORGED = "2001-01-01T00:00:00.000Z ERROR runtime.runner: forged by a client"


async def test_a_context_id_with_a_newline_or_an_escape_sequence_forges_no_line_of_the_log(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    fake_model.default = ErrorReply(status=400, body="bad request")  # the failed task is logged, naming its context
    context_id = f"ctx\n{FORGED}\r\u2028\x1b[2J\x1b]0;owned\x07\x85"
    async with httpx.AsyncClient(timeout=30) as client, keel_process(tmp_path / "state", fake_model.base_url) as keel:
        sent = await rpc(client, keel.url, "SendMessage", {"message": user_message("hi", context_id=context_id)})
        assert sent["result"]["task"]["status"]["state"] == "TASK_STATE_FAILED", sent
        assert sent["result"]["task"]["contextId"] == context_id  # the client gets its id back as it sent it
        assert await keel.terminate() == 0
    log = keel.output.decode()
    failed = [line for line in log.splitlines() if "failed" in line and sent["result"]["task"]["id"] in line]
    assert len(failed) == 1, log
    assert r"ctx\n2001-01-01" in failed[0], failed[0]  # named, with what it holds spelled out
    assert not [line for line in re.split(r"[\r\n\x85\u2028\u2029]", log) if line.startswith(FORGED[:10])], log
    assert all(LOG_LINE.match(line) or line.startswith("keel serving") for line in log.splitlines()), log
    assert "\x1b" not in log and "\x07" not in log, repr(log)
