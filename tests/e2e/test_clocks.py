"""What a real `python -m runtime serve` process says of time, as an operator reads it: whatever
the machine's time zone, in UTC, saying so."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from fake_model import FakeModel
from tests.e2e.harness import keel_process, rpc, user_message

LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) [A-Z]+ ")


async def test_the_log_dates_its_lines_in_utc_saying_so_whatever_the_machines_time_zone(
    tmp_path: Path, fake_model: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TZ", "KST-9")  # nine hours east of UTC, as a server in Seoul would be set
    before = datetime.now(timezone.utc).replace(microsecond=0)
    async with httpx.AsyncClient(timeout=30) as client, keel_process(tmp_path / "state", fake_model.base_url) as keel:
        sent = await rpc(client, keel.url, "SendMessage", {"message": user_message("hi")})
        assert await keel.terminate() == 0
    after = datetime.now(timezone.utc)
    status_time = datetime.fromisoformat(sent["result"]["task"]["status"]["timestamp"])
    lines = [line for line in keel.output.decode().splitlines() if not line.startswith("keel serving")]
    assert lines, keel.output.decode()
    for line in lines:
        match = LOG_TIME.match(line)
        assert match is not None, line
        logged = datetime.fromisoformat(match.group(1))
        assert before <= logged <= after, line  # the time it was written, not nine hours off
        assert abs(logged - status_time) < timedelta(minutes=1), (line, status_time)  # comparable with a task's
