"""The A2A load generator: N clients, each sending blocking ``SendMessage`` in a loop.

Every client holds one keep-alive connection (scripts/bench/rawhttp.py) and sends the next
request as soon as the last one is answered. After ``--warmup-s`` it prints ``measuring`` and
counts, for ``--seconds`` (or until SIGINT/SIGTERM, whichever comes first), every request that
was both sent and answered inside that window: a success is a JSON-RPC result whose task is
COMPLETED; anything else is an error. Requests still in flight at the end are finished (bounded)
but not counted. Loopback only, bounded in time. Prints one JSON object as its last line.

    python scripts/bench/load.py --url http://127.0.0.1:PORT/ [--clients 32] [--seconds 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import signal
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio
from rawhttp import Connection, HttpError

A2A_HEADERS = {"a2a-version": "1.0"}  # both servers get 1.0 JSON-RPC (spec 1.0 section 3.6)
DRAIN_TIMEOUT_S = 30.0  # bound on finishing the requests in flight when the window closes
_ids = itertools.count(1)


def send_message(text: str, *, return_immediately: bool = False) -> dict[str, Any]:
    """A 1.0 ``SendMessage`` request starting a new task (and a new context) with ``text``."""
    params: dict[str, Any] = {"message": {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": [{"text": text}]}}
    if return_immediately:
        params["configuration"] = {"returnImmediately": True}
    return {"jsonrpc": "2.0", "id": next(_ids), "method": "SendMessage", "params": params}


def cancel_task(task_id: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": next(_ids), "method": "CancelTask", "params": {"id": task_id}}


def result_task(reply: Any) -> dict[str, Any]:
    """The task a ``SendMessage`` or ``CancelTask`` result carries; HttpError for anything else."""
    result = reply.get("result") if isinstance(reply, dict) else None
    if not isinstance(result, dict):
        raise HttpError(f"not a JSON-RPC result: {json.dumps(reply)[:300]}")
    task = result.get("task", result)  # SendMessage wraps it ({"task": ...}); CancelTask does not
    if not isinstance(task, dict) or not isinstance(task.get("status"), dict):
        raise HttpError(f"the result holds no task: {json.dumps(reply)[:300]}")
    return task


@attrs.define
class Window:
    """What the clients saw while the window was open."""

    start: float = 0.0
    end: float = float("inf")
    latencies_s: list[float] = attrs.field(factory=list)
    errors: int = 0
    first_error: str = ""

    def open(self, now: float) -> bool:
        return self.start <= now < self.end


async def client(url: str, text: str, window: Window, stop: trio.Event) -> None:
    connection = Connection(url)
    try:
        while not stop.is_set():
            sent = time.perf_counter()
            failure = ""
            try:
                _status, reply = await connection.post_json(send_message(text), A2A_HEADERS)
                state = result_task(reply)["status"].get("state")
                if state != "TASK_STATE_COMPLETED":
                    failure = f"a blocking send ended {state}"
            except HttpError as exc:
                failure = str(exc)
            answered = time.perf_counter()
            if not (window.open(sent) and answered < window.end):
                continue
            if failure:
                window.errors += 1
                window.first_error = window.first_error or failure
            else:
                window.latencies_s.append(answered - sent)
    finally:
        await connection.aclose()


def percentile_ms(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values`` seconds, in milliseconds."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000


async def run_load(url: str, *, clients: int, warmup_s: float, seconds: float, text: str) -> dict[str, Any]:
    window = Window()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client, url, text, window, stop)
        await trio.sleep(warmup_s)
        window.start = time.perf_counter()
        print("measuring", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            with trio.move_on_after(seconds):
                async for _ in signals:
                    break
        window.end = time.perf_counter()
        stop.set()
        nursery.cancel_scope.deadline = trio.current_time() + DRAIN_TIMEOUT_S
    elapsed = window.end - window.start
    done = len(window.latencies_s)
    return {
        "url": url,
        "clients": clients,
        "seconds": round(elapsed, 3),
        "requests": done,
        "errors": window.errors,
        "first_error": window.first_error,
        "rps": round(done / elapsed, 1),
        "p50_ms": round(percentile_ms(window.latencies_s, 0.50), 2),
        "p99_ms": round(percentile_ms(window.latencies_s, 0.99), 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="N clients sending blocking A2A 1.0 SendMessage in a loop, on loopback.")
    parser.add_argument("--url", required=True, help="the JSON-RPC endpoint, e.g. http://127.0.0.1:8080/")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=5.0, help="the window's length at most (SIGINT ends it sooner)")
    parser.add_argument("--text", default="hello")
    args = parser.parse_args(argv)
    host = urlsplit(args.url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        parser.error(f"this load generator only targets loopback addresses, not {host!r}")
    if not (1 <= args.clients <= 1024 and 0 < args.seconds <= 600 and 0 <= args.warmup_s <= 60):
        parser.error("clients must be 1..1024, seconds 0..600 and warmup 0..60")
    report = trio.run(lambda: run_load(args.url, clients=args.clients, warmup_s=args.warmup_s, seconds=args.seconds, text=args.text))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
