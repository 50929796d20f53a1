"""scripts/bench/store.py and loop.py on tiny inputs: each runs, and reports every figure it names."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return report


def positive(report: dict[str, Any], *fields: str) -> None:
    for field in fields:
        value = report[field]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (field, value)


def test_the_store_benchmark_reports_its_ratio_growth_and_a_plain_group_commit_beside_it() -> None:
    report = run_bench("store.py", "--seconds", "0.1", "--rounds", "1", "--samples", "5")
    positive(
        report, "appends_per_s", "raw_sqlite_batched_per_s", "ratio_vs_raw", "plain_appends_per_s",
        "plain_ratio_vs_raw", "ratio_vs_plain", "append_us_at_10_events", "append_us_at_10000_events", "growth_ratio",
    )  # fmt: skip
    # One round: each ratio is that round's own.
    assert abs(report["ratio_vs_raw"] - report["appends_per_s"] / report["raw_sqlite_batched_per_s"]) < 0.002
    assert abs(report["plain_ratio_vs_raw"] - report["plain_appends_per_s"] / report["raw_sqlite_batched_per_s"]) < 0.002
    assert abs(report["ratio_vs_plain"] - report["appends_per_s"] / report["plain_appends_per_s"]) < 0.002
    assert abs(report["growth_ratio"] - report["append_us_at_10000_events"] / report["append_us_at_10_events"]) < 0.002
    assert report["synchronous"] == "FULL"


def test_the_loop_benchmark_reports_steps_cancels_and_the_floor_under_a_step() -> None:
    report = run_bench("loop.py", "--runs", "2", "--steps", "3", "--cancels", "200")
    positive(
        report, "step_overhead_us", "steps_per_s", "cancel_latency_ms_p99", "step_overhead_us_steady", "step_overhead_us_normal",
        "step_overhead_us_no_session", "store_round_trip_us", "commit_floor_us", "commit_floor_us_normal",
        "thread_round_trip_us", "commit_round_trip_us", "step_floor_us", "commit_floor_us_growing_log",
    )  # fmt: skip
    assert report["cancel_runs"] == 200
    assert report["log_written_through"] is True
    # The floor is the plain commit through a database's thread, plus the step with no session.
    expected = report["commit_round_trip_us"] + report["step_overhead_us_no_session"]
    assert abs(report["step_floor_us"] - expected) <= 0.2
    assert isinstance(report["meets_step_target"], bool) and isinstance(report["meets_cancel_target"], bool)
