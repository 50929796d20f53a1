"""Benchmark: one long conversation through ``python -m runtime serve``, and what a turn costs the
server at its start and at its end. Prints one JSON object as its last line.

    .venv/bin/python scripts/bench/conversation.py [--turns 600] [--window 50]

Keel runs on a fresh state directory with the zero-latency model server over HTTP
(scripts/bench/zero_model.py, a test double). One client sends ``--turns`` blocking
``SendMessage`` in one ``contextId``, each once the one before is answered. Every turn reads its
conversation and sends all of it to the model, so part of a turn's cost grows with it (the model's
request); the rest should not. Reported: the server's CPU a turn (Linux /proc) over the first and
the last ``--window`` turns and their ratio (``cpu_growth``), a turn's latency the same way,
``GetTask`` on the first and the last task, and what ``runtime.db`` and ``tasks.db`` hold a turn.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

import trio

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from a2a import Children, start_keel_http_model  # noqa: E402
from load import A2A_HEADERS, result_task  # noqa: E402
from rawhttp import Connection  # noqa: E402

QUESTION = "What did we decide about the rollout, and what comes next? " * 3


def send_in(context_id: str | None, number: int) -> dict[str, Any]:
    message: dict[str, Any] = {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": [{"text": QUESTION}]}
    if context_id is not None:
        message["contextId"] = context_id
    return {"jsonrpc": "2.0", "id": number, "method": "SendMessage", "params": {"message": message}}


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


async def get_ms(connection: Connection, task_id: str, times: int = 20) -> float:
    taken = []
    for number in range(times):
        started = time.perf_counter()
        _, reply = await connection.post_json(
            {"jsonrpc": "2.0", "id": number, "method": "GetTask", "params": {"id": task_id}}, A2A_HEADERS
        )
        taken.append(time.perf_counter() - started)
        if "result" not in reply:
            raise RuntimeError(f"GetTask failed: {json.dumps(reply)[:300]}")
    return ms(statistics.median(taken))


def stored_bytes(state_dir: Path) -> dict[str, float]:
    """What the databases hold a turn (a message's event, a task's JSON), read-only."""
    with closing(sqlite3.connect(f"file:{state_dir / 'runtime.db'}?mode=ro", uri=True)) as sessions:
        events, event_chars = sessions.execute("SELECT count(*), sum(length(content)) FROM events").fetchone()
    with closing(sqlite3.connect(f"file:{state_dir / 'tasks.db'}?mode=ro", uri=True)) as tasks:
        count, task_chars = tasks.execute("SELECT count(*), sum(length(task)) FROM tasks").fetchone()
    return {
        "events": events, "event_bytes_per_turn": round(event_chars / count, 1),
        "task_bytes_per_turn": round(task_chars / count, 1),
    }  # fmt: skip


async def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    children = Children(work)
    try:
        keel = await start_keel_http_model(children, work / "state")
        connection = Connection(keel.url)
        latencies: list[float] = []
        cpu: list[float] = []  # the server's CPU seconds before each turn, and after the last
        context_id: str | None = None
        task_ids: list[str] = []
        for number in range(args.turns):
            cpu.append(keel.child.cpu_s())
            started = time.perf_counter()
            _, reply = await connection.post_json(send_in(context_id, number), A2A_HEADERS)
            latencies.append(time.perf_counter() - started)
            task = result_task(reply)
            if task["status"]["state"] != "TASK_STATE_COMPLETED":
                raise RuntimeError(f"turn {number} ended {task['status']['state']}: {json.dumps(task)[:300]}")
            context_id = task["contextId"]
            task_ids.append(task["id"])
        cpu.append(keel.child.cpu_s())
        window: int = args.window

        def cpu_ms(first: int) -> float:
            return round((cpu[first + window] - cpu[first]) * 1000 / window, 2)

        first, last = cpu_ms(0), cpu_ms(args.turns - window)
        report: dict[str, Any] = {
            "turns": args.turns,
            "window": window,
            "cpu_ms_per_turn_first": first,
            "cpu_ms_per_turn_last": last,
            "cpu_growth": round(last / first, 3) if first else None,
            "turn_ms_first": ms(statistics.median(latencies[:window])),
            "turn_ms_last": ms(statistics.median(latencies[-window:])),
            "get_task_ms_first": await get_ms(connection, task_ids[0]),
            "get_task_ms_last": await get_ms(connection, task_ids[-1]),
        }
        await connection.aclose()
        report.update(stored_bytes(work / "state"))
        return report
    finally:
        await children.stop_all()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=600, help="turns of the one conversation")
    parser.add_argument("--window", type=int, default=50, help="turns measured at its start and at its end")
    args = parser.parse_args(argv)
    if not 1 <= args.window <= args.turns:
        parser.error("--window must be between 1 and --turns")
    with tempfile.TemporaryDirectory(prefix="keel-bench-conversation-") as work:
        print(json.dumps(trio.run(bench, args, Path(work))))


if __name__ == "__main__":
    main()
