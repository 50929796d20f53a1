"""scripts/bench/conversation.py on a short conversation: it runs, and reports every figure it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_conversation_prints_its_report() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "conversation.py"), "--turns", "12", "--window", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["turns"] == 12 and report["window"] == 4
    for field in ("turn_ms_first", "turn_ms_last", "get_task_ms_first", "get_task_ms_last", "event_bytes_per_turn", "task_bytes_per_turn"):
        assert isinstance(report[field], float) and report[field] > 0, (field, report)
    for field in ("cpu_ms_per_turn_first", "cpu_ms_per_turn_last"):  # in clock ticks: 0 for a few quick turns
        assert isinstance(report[field], float) and report[field] >= 0, (field, report)
    assert report["events"] == 24  # each turn's question and answer
