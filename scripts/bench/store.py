"""Benchmark: the session store's group-commit appends against plain sqlite3, and save cost
against transcript length. Prints one JSON object as its last line.

The same run also measures a plain group commit under the same appenders: a list, a thread, an
event per append, and each batch one transaction of the same rows and SQL (``executemany``), with
no validation, no session bookkeeping and no error handling. ``ratio_vs_plain`` is the store over
it; ``plain_ratio_vs_raw`` is how near to plain sqlite3 that design comes on this machine.

    python scripts/bench/store.py [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import queue
import tempfile
import threading
import time
from pathlib import Path

import trio

from persistence.session import Session
from persistence.sessions import SESSIONS_SCHEMA, open_session_store
from persistence.sqlite import connect, migrate, write_out_log
from persistence.transcript import Message

APPENDERS = 64
RAW_BATCH = 100
CONTENT = json.dumps({"role": "tool", "text": "x" * 180})  # ~200-byte event, the same for both


async def store_appends_per_s(path: Path, seconds: float) -> float:
    count = 0
    async with open_session_store(path, synchronous="FULL") as store:
        await store.append("warm-up", [CONTENT])
        deadline = trio.current_time() + seconds

        async def appender(k: int) -> None:
            nonlocal count
            while trio.current_time() < deadline:
                await store.append(f"session-{k}", [CONTENT])
                count += 1

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for k in range(APPENDERS):
                nursery.start_soon(appender, k)
        elapsed = time.perf_counter() - start
    return count / elapsed


INSERT_EVENT = "INSERT INTO events (session_id, seq, author, created_at_ms, content) VALUES (?, ?, 'agent', ?, ?)"


def plain_database(path: Path) -> sqlite3.Connection:
    """The very tables the store writes, indexes and all, with the appenders' sessions, in a
    file set up as the store sets up its own (settings, and the -wal written out)."""
    conn = connect(path, synchronous="FULL")
    migrate(path, conn, SESSIONS_SCHEMA)
    write_out_log(path, conn)
    conn.executemany(
        "INSERT INTO sessions (session_id, app_name, user_id, created_at_ms, updated_at_ms) VALUES (?, 'keel', '', 0, 0)",
        [(f"session-{k}",) for k in range(APPENDERS)],
    )
    return conn


def raw_batched_per_s(path: Path, seconds: float) -> float:
    conn = plain_database(path)
    count, seq = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            INSERT_EVENT,
            [(f"session-{i % APPENDERS}", seq + i, int(time.time() * 1000), CONTENT) for i in range(RAW_BATCH)],
        )
        conn.execute("COMMIT")
        seq += RAW_BATCH
        count += RAW_BATCH
    elapsed = time.perf_counter() - start
    conn.close()
    return count / elapsed


async def plain_appends_per_s(path: Path, seconds: float) -> float:
    """The same appenders over a plain group commit: each queues its row and an event, the
    first of a batch wakes the database thread, which commits whatever is queued and sets the
    events from the Trio thread."""
    conn = await trio.to_thread.run_sync(plain_database, path)
    token = trio.lowlevel.current_trio_token()
    lock = threading.Lock()
    queued: list[tuple[tuple[str, int, int, str], trio.Event]] = []
    wake: queue.SimpleQueue[bool] = queue.SimpleQueue()  # True: commit what is queued; False: stop
    flushing = False

    def done(events: list[trio.Event]) -> None:  # in the Trio thread
        nonlocal flushing
        for event in events:
            event.set()
        with lock:
            flushing = bool(queued)
            if flushing:
                wake.put(True)

    def database_thread() -> None:
        while wake.get():
            with lock:
                batch = queued.copy()
                queued.clear()
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(INSERT_EVENT, [row for row, _ in batch])
            conn.commit()
            token.run_sync_soon(done, [event for _, event in batch])

    count = 0
    deadline = trio.current_time() + seconds

    async def appender(k: int) -> None:
        nonlocal count, flushing
        seq = 0
        while trio.current_time() < deadline:
            event = trio.Event()
            with lock:
                queued.append(((f"session-{k}", seq, int(time.time() * 1000), CONTENT), event))
                post, flushing = not flushing, True
            if post:
                wake.put(True)
            await event.wait()
            seq += 1
            count += 1

    thread = threading.Thread(target=database_thread, name="plain group commit")
    thread.start()
    try:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for k in range(APPENDERS):
                nursery.start_soon(appender, k)
        elapsed = time.perf_counter() - start
    finally:
        wake.put(False)
        await trio.to_thread.run_sync(thread.join)
        stored = await trio.to_thread.run_sync(_count_and_close, conn)
    if stored != count:  # a reference that skipped work would flatter every ratio against it
        raise RuntimeError(f"the plain group commit counted {count} appends but committed {stored} rows")
    return count / elapsed


def _count_and_close(conn: sqlite3.Connection) -> int:
    try:
        (count,) = conn.execute("SELECT count(*) FROM events").fetchone()
        return int(count)
    finally:
        conn.close()


async def save_us(path: Path, lengths: tuple[int, ...], samples: int) -> dict[int, float]:
    """Median microseconds to save one new message onto transcripts of each length.

    The lengths take turns, sample by sample, so the machine's noise falls on all of them alike.
    """
    async with open_session_store(path, synchronous="FULL") as store:
        sessions = {n: Session.open(f"conv-{n}", store) for n in lengths}
        transcripts = {
            n: [Message(role="user" if i % 2 else "assistant", text=f"message {i} " + "y" * 100) for i in range(n)]
            for n in lengths
        }
        for n in lengths:
            await sessions[n].save(transcripts[n])
        timings: dict[int, list[float]] = {n: [] for n in lengths}
        for i in range(samples):
            for n in lengths:
                transcripts[n].append(Message(role="user", text=f"new {i}"))
                start = time.perf_counter()
                await sessions[n].save(transcripts[n])
                timings[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) * 1e6 for n, t in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=1.0, help="how long each throughput run lasts")
    parser.add_argument("--rounds", type=int, default=5, help="store and raw runs, taking turns")
    parser.add_argument("--samples", type=int, default=300, help="saves timed at each transcript length")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        # Store and raw take turns, and the ratio is the median of each round's own ratio, so
        # that the noise of a shared machine falls on both sides of every comparison.
        raws, stores, plains, ratios, plain_ratios, store_plain_ratios = [], [], [], [], [], []
        for round_ in range(args.rounds):
            raws.append(raw_batched_per_s(tmp_path / f"raw-{round_}.db", args.seconds))
            stores.append(trio.run(store_appends_per_s, tmp_path / f"runtime-{round_}.db", args.seconds))
            plains.append(trio.run(plain_appends_per_s, tmp_path / f"plain-{round_}.db", args.seconds))
            ratios.append(stores[-1] / raws[-1])
            plain_ratios.append(plains[-1] / raws[-1])
            store_plain_ratios.append(stores[-1] / plains[-1])
        raw, store = statistics.median(raws), statistics.median(stores)
        saves = trio.run(save_us, tmp_path / "saves.db", (10, 10000), args.samples)
        at_10, at_10000 = saves[10], saves[10000]
    result = {
        "appends_per_s": round(store),
        "raw_sqlite_batched_per_s": round(raw),
        "ratio_vs_raw": round(statistics.median(ratios), 3),
        "plain_appends_per_s": round(statistics.median(plains)),
        "plain_ratio_vs_raw": round(statistics.median(plain_ratios), 3),
        "ratio_vs_plain": round(statistics.median(store_plain_ratios), 3),
        "append_us_at_10_events": round(at_10, 1),
        "append_us_at_10000_events": round(at_10000, 1),
        "growth_ratio": round(at_10000 / at_10, 3),
        "appenders": APPENDERS,
        "rounds": args.rounds,
        "synchronous": "FULL",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
