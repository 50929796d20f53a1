"""Benchmark: the agent loop's cost per step, and how soon a cancelled run has exited.

The model is in process and answers at once, so what is timed is the loop itself plus, with a
session, taking the steers and saving the transcript before every request (a real SQLite session
store on a temporary file). Prints one JSON object as its last line:

- ``step_overhead_us``: median time of one step (StepStarted to the next StepStarted: the model's
  zero-latency answer, one tool call, the steers taken and the transcript saved), with a session
  at the product default ``synchronous=FULL``, in a new database. The same figure at NORMAL and
  with no session.
- ``step_overhead_us_steady``: the same, FULL, once SQLite has started the database's -wal over
  from its start (``wrap_log``: a checkpoint caught up), as in a server that has been running.
  The store writes a new database's -wal out with zeros to the size it reaches before that
  (persistence.sqlite.write_out_log), so that in both regimes commits write over what is there
  rather than grow the file (which syncs its new size too). ``log_written_through`` says
  whether the -wal had been started over (false: timed all the same, after 10,000 saves).
- ``steps_per_s``: steps over wall time across all timed runs, FULL.
- ``store_round_trip_us``: median of what the store alone takes per step (the save and the take
  of the steers in one transaction), so that the loop's own share is the difference.
- ``cancel_latency_ms_p99``: from ``cancel()`` to the run having exited, for runs blocked in a
  model stream that had already sent some text (so the partial answer is saved as it exits),
  over ``--cancels`` runs with a FULL session; also with no session.
- the floor under a step, measured in the same run: ``commit_floor_us`` (FULL; also NORMAL), the
  median of plain sqlite3 in one thread inserting a step's two events and committing, with the
  store's own settings, table and -wal written out (``commit_floor_us_growing_log``: FULL, with
  a -wal left to grow at each commit, as it was before the store wrote it out);
  ``thread_round_trip_us``, the median of a call that does nothing, made through a store's
  database thread and back, back to back; ``commit_round_trip_us``, the same plain commit made
  through a store's database thread and back with a step's own work between two, as a step
  makes its save (so the threads wake from idle, which on a virtual machine can cost more
  than the commit); and ``step_floor_us``, that plus the step with no session: what a step
  that saves before every model request would cost if the store added nothing to the commit
  and the hand-off.

    python scripts/bench/loop.py [--runs N] [--steps N] [--cancels N]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from instant_model import ARGUMENTS, InstantModel

from persistence.session import Session
from persistence.sessions import SESSIONS_SCHEMA, open_session_store
from persistence.sqlite import SqlitePool, connect, log_of, migrate, write_out_log
from persistence.transcript import Message, ToolCall
from runtime.agent import AgentEvent, AgentRun, AgentSpec, StepStarted, TextDelta, Tool

QUESTION = [Message(role="user", text="Why did the vault lease expire at 03:12?")]
TARGET_STEP_US = 500
TARGET_CANCEL_MS = 20


async def lookup(_arguments: dict[str, Any]) -> str:
    await trio.lowlevel.checkpoint()
    return "vault: lease TTL 24h, last renewed 25h ago"


SPEC_TOOLS = (Tool("lookup", "Look a service up.", {"type": "object", "properties": {"service": {"type": "string"}}}, lookup),)


def spec_for(steps: int) -> AgentSpec:
    return AgentSpec(system_prompt="You are the on-call assistant.", tools=SPEC_TOOLS, max_steps=steps, max_model_calls=steps)


async def time_steps(store: Any, runs: int, steps: int, label: str) -> tuple[list[float], float]:
    """Per-step durations (seconds) over ``runs`` runs, and the wall time of all of them."""
    durations: list[float] = []
    marks: list[float] = []

    def on_event(event: AgentEvent) -> None:
        if isinstance(event, StepStarted):
            marks.append(time.perf_counter())

    wall = 0.0
    for n in range(runs + 1):  # run 0 warms up
        marks.clear()
        session = None if store is None else Session.open(f"{label}-{n}", store)
        run = AgentRun(InstantModel(steps), spec_for(steps), QUESTION, session=session, on_event=on_event)
        start = time.perf_counter()
        await run.run()
        if n:
            wall += time.perf_counter() - start
            durations += [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return durations, wall


async def cancel_latencies(store: Any, runs: int) -> list[float]:
    """Seconds from cancel() to the run having exited, for runs blocked mid-stream."""
    latencies = []
    for n in range(runs + 1):  # run 0 warms up
        streaming = trio.Event()

        def on_event(event: AgentEvent, streaming: trio.Event = streaming) -> None:
            if isinstance(event, TextDelta):
                streaming.set()

        session = None if store is None else Session.open(f"cancel-{n}", store)
        run = AgentRun(InstantModel(2, hang=True), spec_for(2), QUESTION, session=session, on_event=on_event)
        scope = trio.CancelScope()
        exited_at = 0.0

        async def go(run: AgentRun = run, scope: trio.CancelScope = scope) -> None:
            nonlocal exited_at
            with scope:
                await run.run()
            exited_at = time.perf_counter()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(go)
            await streaming.wait()
            await trio.testing.wait_all_tasks_blocked()  # the run is parked in the stream
            cancelled_at = time.perf_counter()
            scope.cancel()
        assert run.messages[-1].partial, "the partial answer was kept"
        if n:
            latencies.append(exited_at - cancelled_at)
    return latencies


def step_messages(n: int) -> list[Message]:
    """What one step adds to the transcript: the model's tool call and the tool's result."""
    return [
        Message(role="assistant", text="Looking at the vault lease. ", tool_calls=[ToolCall(f"call_{n}", "lookup", ARGUMENTS)]),
        Message(role="tool", text="vault: lease TTL 24h, last renewed 25h ago", tool_call_id=f"call_{n}", name="lookup"),
    ]


async def store_round_trips(store: Any, count: int) -> list[float]:
    """Seconds for what the store alone does each step: save one more step and take the steers
    in one call, as the loop does (one transaction). The loop's own share is the rest."""
    session = Session.open("store-only", store)
    transcript = list(QUESTION)
    durations = []
    for n in range(count):
        transcript += step_messages(n)
        start = time.perf_counter()
        await session.save_and_take_steers(transcript)
        durations.append(time.perf_counter() - start)
    return durations


STEP_WORK_S = 60e-6  # the loop's own work in a step, about (step_overhead_us_no_session)
LOG_CHUNK = 100  # saves between two looks at the -wal's header
MAX_LOG_CHUNKS = 100  # then it is taken as it is: a -wal that is never started over (a reader holds it)


LOG_SALTS = slice(16, 24)  # where a -wal's header holds its two salts (sqlite.org/fileformat2.html)


def log_salts(log: Path) -> bytes:
    """The salts in a -wal's header: new each time SQLite starts the -wal over from its start."""
    with log.open("rb") as file:
        return file.read(LOG_SALTS.stop)[LOG_SALTS]


async def wrap_log(store: Any, path: Path) -> bool:
    """Save steps until SQLite has started the -wal beside ``path`` over from its start (a
    checkpoint caught up), as it does in a server that has been running. False if it had not
    after MAX_LOG_CHUNKS chunks."""
    log = log_of(path)
    session = Session.open("wrap-log", store)
    transcript = list(QUESTION)
    salts = await trio.to_thread.run_sync(log_salts, log)
    for chunk in range(MAX_LOG_CHUNKS):
        for n in range(LOG_CHUNK):
            transcript += step_messages(chunk * LOG_CHUNK + n)
            await session.save(transcript)
        if await trio.to_thread.run_sync(log_salts, log) != salts:
            return True
    return False


def _insert_step(conn: sqlite3.Connection, n: int, contents: list[str]) -> None:
    """Insert step ``n``'s two events (plain sqlite3) and commit."""
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(
        "INSERT INTO events (session_id, seq, author, created_at_ms, content) VALUES ('floor', ?, 'agent', 0, ?)",
        [(2 * n + i, content) for i, content in enumerate(contents)],
    )
    conn.execute("COMMIT")


def busy(seconds: float) -> None:
    """Compute for ``seconds`` (standing for the loop's own work), not sleep."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _add_floor_session(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO sessions (session_id, app_name, user_id, created_at_ms, updated_at_ms) VALUES ('floor', 'keel', '', 0, 0)")


def commit_floor(path: Path, synchronous: str, count: int, *, written_out: bool = True) -> float:
    """Median seconds for plain sqlite3, in this thread, to insert a step's two events (the
    same contents the loop saves) and commit: the disk's and SQLite's share of a step. The -wal
    is written out first, as the store writes out its own, unless ``written_out`` is false."""
    contents = [message.to_json() for message in step_messages(0)]
    conn = connect(path, synchronous=synchronous)
    try:
        migrate(path, conn, SESSIONS_SCHEMA)
        if written_out:
            write_out_log(path, conn)
        _add_floor_session(conn)
        durations = []
        for n in range(count):
            start = time.perf_counter()
            _insert_step(conn, n, contents)
            durations.append(time.perf_counter() - start)
    finally:
        conn.close()
    return statistics.median(durations)


async def commit_round_trip(path: Path, count: int) -> float:
    """Median seconds of the same plain commit (FULL) made from the Trio thread as a step makes
    its save: through a store's database thread and back, one at a time with the loop's own
    work of a step between two (``STEP_WORK_S`` of computing in the Trio thread, while the
    database's thread idles). What a save would cost if the store added nothing to the commit
    and the hand-off: unlike ``commit_floor`` plus ``thread_round_trip``, each timed back to
    back, it pays for the threads waking from idle, as a step's save does."""
    contents = [message.to_json() for message in step_messages(0)]
    pool = await SqlitePool.open(path, SESSIONS_SCHEMA)
    try:
        await pool.run(_add_floor_session)
        durations = []
        for n in range(count):
            busy(STEP_WORK_S)
            start = time.perf_counter()
            await pool.run(_insert_step, n, contents)
            durations.append(time.perf_counter() - start)
    finally:
        await pool.aclose()
    return statistics.median(durations)


def _nothing(_conn: object) -> None:
    return None


async def thread_round_trip(path: Path, count: int) -> float:
    """Median seconds of a call that does nothing, through a store's database thread and back."""
    pool = await SqlitePool.open(path, SESSIONS_SCHEMA)
    try:
        durations = []
        for _ in range(count):
            start = time.perf_counter()
            await pool.run(_nothing)
            durations.append(time.perf_counter() - start)
    finally:
        await pool.aclose()
    return statistics.median(durations)


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def measure(tmp: Path, runs: int, steps: int, cancels: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for synchronous in ("FULL", "NORMAL"):
        path = tmp / f"runtime-{synchronous}.db"
        async with open_session_store(path, synchronous=synchronous) as store:
            durations, wall = await time_steps(store, runs, steps, synchronous)
            results[synchronous] = (statistics.median(durations), runs * steps / wall)
            results[f"store-{synchronous}"] = statistics.median(await store_round_trips(store, runs * steps // 2))
            if synchronous == "FULL":
                results["cancel"] = await cancel_latencies(store, cancels)
                results["wrapped"] = await wrap_log(store, path)
                durations, _ = await time_steps(store, runs, steps, "steady")
                results["steady"] = statistics.median(durations)
    durations, wall = await time_steps(None, runs, steps, "none")
    results["none"] = (statistics.median(durations), runs * steps / wall)
    count = runs * steps // 2
    for synchronous in ("FULL", "NORMAL"):
        results[f"floor-{synchronous}"] = await trio.to_thread.run_sync(commit_floor, tmp / f"floor-{synchronous}.db", synchronous, count)
    growing = functools.partial(commit_floor, tmp / "floor-growing.db", "FULL", count, written_out=False)
    results["floor-growing"] = await trio.to_thread.run_sync(growing)
    results["hop"] = await thread_round_trip(tmp / "hop.db", count)
    results["commit-round-trip"] = await commit_round_trip(tmp / "round-trip.db", count)
    results["cancel_none"] = await cancel_latencies(None, cancels)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="timed runs per configuration")
    parser.add_argument("--steps", type=int, default=20, help="model requests per run")
    parser.add_argument("--cancels", type=int, default=300, help="cancelled runs timed (at least 200)")
    args = parser.parse_args()
    if args.cancels < 200:
        parser.error("--cancels must be at least 200")
    import trio.testing  # noqa: F401, PLC0415  (wait_all_tasks_blocked, above)

    with tempfile.TemporaryDirectory() as tmp:
        r = trio.run(measure, Path(tmp), args.runs, args.steps, args.cancels)
    full_us, full_rate = r["FULL"][0] * 1e6, r["FULL"][1]
    result = {
        "step_overhead_us": round(full_us, 1),
        "steps_per_s": round(full_rate),
        "cancel_latency_ms_p99": round(p99(r["cancel"]) * 1e3, 3),
        "synchronous": "FULL",
        "store_round_trip_us": round(r["store-FULL"] * 1e6, 1),
        "step_overhead_us_steady": round(r["steady"] * 1e6, 1),
        "log_written_through": r["wrapped"],
        "step_overhead_us_normal": round(r["NORMAL"][0] * 1e6, 1),
        "store_round_trip_us_normal": round(r["store-NORMAL"] * 1e6, 1),
        "steps_per_s_normal": round(r["NORMAL"][1]),
        "step_overhead_us_no_session": round(r["none"][0] * 1e6, 1),
        "steps_per_s_no_session": round(r["none"][1]),
        "commit_floor_us": round(r["floor-FULL"] * 1e6, 1),
        "commit_floor_us_normal": round(r["floor-NORMAL"] * 1e6, 1),
        "commit_floor_us_growing_log": round(r["floor-growing"] * 1e6, 1),
        "thread_round_trip_us": round(r["hop"] * 1e6, 1),
        "commit_round_trip_us": round(r["commit-round-trip"] * 1e6, 1),
        "step_floor_us": round((r["commit-round-trip"] + r["none"][0]) * 1e6, 1),
        "cancel_latency_ms_median": round(statistics.median(r["cancel"]) * 1e3, 3),
        "cancel_latency_ms_p99_no_session": round(p99(r["cancel_none"]) * 1e3, 3),
        "cancel_runs": args.cancels,
        "steps_timed": args.runs * (args.steps - 1),
        "cpus": os.cpu_count(),
        "meets_step_target": full_us <= TARGET_STEP_US,
        "meets_cancel_target": p99(r["cancel"]) * 1e3 <= TARGET_CANCEL_MS,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
