"""Benchmark: blocking A2A ``SendMessage`` over HTTP, Keel against the a2a-sdk reference server,
and how fast a CancelTask under that load is CANCELED on disk. Prints one JSON object as its
last line.

    .venv/bin/python scripts/bench/a2a.py [--clients 32] [--seconds 5] [--rounds 3] [--cancels 300]

Needs the ``test`` extra (a2a-sdk and uvicorn, for the reference). Everything runs on loopback,
each server in a process of its own so that no two share a GIL with the load:

- Keel (``keel_*``): the server ``python -m runtime serve`` runs, on a fresh state directory
  (SQLite, WAL, synchronous=FULL: every transition durable before it is reported), through
  scripts/bench/keel_instant.py, whose model is a zero-latency one in process. The reference
  calls no model (its executor echoes), so this is the like-for-like figure: the runtime's own
  cost, with the agent loop, the sessions and every task state written.
- Keel with its model over HTTP (``keel_http_model_*``): ``python -m runtime serve`` itself, its
  model the zero-latency test double scripts/bench/zero_model.py (real HTTP, answers at once),
  so the figure includes a model call's client and server cost on the same two cores.
- the reference: scripts/bench/ref_server.py, the a2a-sdk echo server on Starlette and uvicorn,
  once with its SQLite ``DatabaseTaskStore`` and once with its ``InMemoryTaskStore``.

Both sides get the same requests from the same load generator (scripts/bench/load.py): A2A 1.0
JSON-RPC ``SendMessage``, header ``A2A-Version: 1.0``, blocking, one new task per request.
Throughput phases take turns (Keel, Keel with its model over HTTP, reference SQLite, reference
memory; ``--rounds`` times) so
that whatever else the machine is doing falls on all of them alike; each side's best round is
reported, every round is listed, with what each server cost a request in its best round:
``cpu_ms_per_request`` (its process's CPU, Keel's model server's included) and
``disk_kb_per_request`` (what the kernel counted it as writing to disk; Linux, 0 elsewhere).

Then the cancel phase: the same load runs against Keel (in-process model) while ``--cancels`` long tasks are
cancelled one at a time. Each is sent with ``returnImmediately``, its row watched in tasks.db
(read-only) until WORKING, left working for a random 0-100 ms, then cancelled.
``cancel_ms_*`` runs from sending CancelTask until the row reads TASK_STATE_CANCELED
(``cancel_rpc_ms_*`` to the response alone; ``cancel_on_disk_at_response`` is the share whose
row already read CANCELED when the response came, as Keel's runner promises).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import attrs
import trio

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from load import A2A_HEADERS, cancel_task, percentile_ms, result_task, send_message  # noqa: E402
from rawhttp import Connection, HttpError  # noqa: E402

ROOT = BENCH.parent.parent
SLOW_MARKER = "[slow]"  # the zero model streams slowly for a request holding this
CANCELED = "TASK_STATE_CANCELED"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0  # Keel drains for up to 10 s by default; then it is killed
WAIT_WORKING_S = 10.0
CANCEL_VISIBLE_S = 10.0
TARGETS = {"vs_ref_sqlite": 10.0, "vs_ref_memory": 1.5, "cancel_ms_p99": 50.0}


@attrs.define(eq=False)
class Child:
    """A process this benchmark started; its stdout and stderr go to ``log``."""

    name: str
    process: trio.Process
    log: Path

    def cpu_s(self) -> float:
        """User plus system CPU seconds so far (Linux /proc; 0.0 elsewhere)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def disk_bytes(self) -> int:
        """Bytes it has had written to storage so far: its files' pages, as the kernel sends them
        to the disk, not its sockets' traffic (Linux /proc ``write_bytes``; 0 elsewhere)."""
        try:
            lines = Path(f"/proc/{self.process.pid}/io").read_text().splitlines()
        except OSError:
            return 0
        return next((int(line.split(":")[1]) for line in lines if line.startswith("write_bytes:")), 0)

    async def wait_line(self, pattern: str, timeout_s: float = START_TIMEOUT_S) -> re.Match[str]:
        """The first line of the log matching ``pattern``; RuntimeError if the process exits first."""
        regex = re.compile(pattern)
        with trio.move_on_after(timeout_s):
            while True:
                for line in self.log.read_text(errors="replace").splitlines():
                    if match := regex.search(line):
                        return match
                if self.process.returncode is not None:
                    break
                await trio.sleep(0.05)
        raise RuntimeError(f"{self.name} did not print /{pattern}/ (exit {self.process.returncode}):\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    async def stop(self, signum: int = signal.SIGTERM) -> None:
        """Signal the process, wait for it (bounded), kill it if it is still there."""
        if self.process.returncode is None:
            self.process.send_signal(signum)
            with trio.move_on_after(STOP_TIMEOUT_S, shield=True):
                await self.process.wait()
        if self.process.returncode is None:
            self.process.kill()
            with trio.move_on_after(STOP_TIMEOUT_S, shield=True):
                await self.process.wait()


@attrs.define(eq=False)
class Children:
    """Every process started, stopped (each by its own pid) when the benchmark ends, however."""

    logs: Path
    started: list[Child] = attrs.field(factory=list)

    async def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            process = await trio.lowlevel.open_process(
                [sys.executable, *args], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        child = Child(name, process, log)
        self.started.append(child)
        return child

    async def stop_all(self) -> None:
        for child in reversed(self.started):
            await child.stop()


@attrs.frozen
class Server:
    name: str
    url: str
    child: Child
    helpers: tuple[Child, ...] = ()  # processes doing its work elsewhere (Keel's model)
    stack: str = ""

    def cpu_s(self) -> float:
        return self.child.cpu_s() + sum(helper.cpu_s() for helper in self.helpers)

    def disk_bytes(self) -> int:
        return self.child.disk_bytes() + sum(helper.disk_bytes() for helper in self.helpers)


async def start_keel(children: Children, state_dir: Path) -> Server:
    """Keel with the in-process zero-latency model."""
    keel = await children.start(
        "keel", [str(BENCH / "keel_instant.py"), "--slow-marker", SLOW_MARKER, "--port", "0", "--state-dir", str(state_dir)]
    )
    url = (await keel.wait_line(r"keel serving A2A at (http://\S+)")).group(1)
    return Server("keel", url, keel)


async def start_keel_http_model(children: Children, state_dir: Path) -> Server:
    """``python -m runtime serve`` with the zero-latency model server over HTTP."""
    model = await children.start("zero_model", [str(BENCH / "zero_model.py"), "--port", "0", "--slow-marker", SLOW_MARKER])
    model_url = (await model.wait_line(r"serving (http://\S+)")).group(1)
    keel = await children.start(
        "keel_http_model",
        ["-m", "runtime", "serve", "--port", "0", "--state-dir", str(state_dir), "--model-base-url", model_url],
    )
    url = (await keel.wait_line(r"keel serving A2A at (http://\S+)")).group(1)
    return Server("keel_http_model", url, keel, (model,))


async def start_ref(children: Children, store: str, work: Path) -> Server:
    name = f"ref_{store}"
    db = ["--db", str(work / "ref-tasks.db")] if store == "sqlite" else []
    ref = await children.start(name, [str(BENCH / "ref_server.py"), "--store", store, "--port", "0", *db])
    ready = await ref.wait_line(r"ref serving A2A at (http://\S+) .*(uvicorn \S+ http=\S+ loop=\w+)")
    url = ready.group(1)
    connection = Connection(url)
    with trio.fail_after(START_TIMEOUT_S):
        while True:  # the URL is printed when the socket is bound; the card answers once uvicorn runs
            try:
                status, _ = await connection.request("GET", "/.well-known/agent-card.json")
                if status == 200:
                    break
            except HttpError:
                pass
            await trio.sleep(0.05)
    await connection.aclose()
    return Server(name, url, ref, stack=ready.group(2))


@attrs.frozen
class LoadRun:
    """One run of the load generator, started; ``finish()`` ends it and returns its report."""

    child: Child
    server: Server

    async def finish(self, *, early: bool = False) -> dict[str, Any]:
        if early:
            await self.child.stop(signal.SIGINT)
        with trio.move_on_after(600):
            await self.child.process.wait()
        if self.child.process.returncode != 0:
            raise RuntimeError(f"the load generator failed (exit {self.child.process.returncode}):\n{self.child.tail()}")
        report: dict[str, Any] = json.loads(self.child.log.read_text().splitlines()[-1])
        return report


async def start_load(children: Children, server: Server, args: argparse.Namespace, seconds: float, tag: str) -> LoadRun:
    child = await children.start(
        f"load_{server.name}_{tag}",
        [str(BENCH / "load.py"), "--url", server.url, "--clients", str(args.clients), "--warmup-s", str(args.warmup_s),
         "--seconds", str(seconds)],
    )  # fmt: skip
    await child.wait_line(r"^measuring$", timeout_s=args.warmup_s + START_TIMEOUT_S)
    return LoadRun(child, server)


async def throughput(children: Children, server: Server, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    run = await start_load(children, server, args, args.seconds, tag)
    cpu_start, disk_start = server.cpu_s(), server.disk_bytes()
    report = await run.finish()
    used, written = server.cpu_s() - cpu_start, server.disk_bytes() - disk_start
    # The server's CPU (Keel's includes its model's) over the window and the drain after it,
    # per request counted: an estimate that errs high. So are the bytes it wrote to disk (the
    # kernel writes pages out when it will, so a window also carries some of the one before).
    requests = max(1, report["requests"])
    report["cpu_ms_per_request"] = round(1000 * used / requests, 2)
    report["disk_kb_per_request"] = round(written / 1024 / requests, 1)
    return report


@attrs.define(eq=False)
class TaskRows:
    """Reads Keel's tasks.db read-only, in a thread, as another process would see it on disk."""

    path: Path
    _conn: sqlite3.Connection | None = None
    _limiter: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(1))

    def _state(self, task_id: str) -> str | None:
        if self._conn is None:
            self._conn = sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True, check_same_thread=False)
        row = self._conn.execute("SELECT state FROM tasks WHERE id = ?", (task_id,)).fetchone()
        return None if row is None else str(row[0])

    async def state(self, task_id: str) -> str | None:
        return await trio.to_thread.run_sync(self._state, task_id, limiter=self._limiter)

    async def wait_state(self, task_id: str, wanted: str, timeout_s: float, every_s: float) -> str | None:
        """Poll every ``every_s`` until the row reads ``wanted``; the last state read."""
        state = None
        with trio.move_on_after(timeout_s):
            while (state := await self.state(task_id)) != wanted:
                await trio.sleep(every_s)
        return state

    def counts(self) -> dict[str, int]:
        with sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True) as conn:
            return dict(conn.execute("SELECT state, count(*) FROM tasks GROUP BY state").fetchall())

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


@attrs.frozen
class CancelSample:
    rpc_s: float  # sending CancelTask -> its response
    visible_s: float  # sending CancelTask -> the row read CANCELED
    at_response: bool  # the first read after the response already said CANCELED


async def cancel_one(connection: Connection, rows: TaskRows, rng: random.Random, number: int) -> CancelSample:
    status, reply = await connection.post_json(
        send_message(f"{SLOW_MARKER} a long task to cancel, #{number}", return_immediately=True), A2A_HEADERS
    )
    task_id = result_task(reply)["id"]
    # Polled gently: the reads share the machine with the server under test.
    state = await rows.wait_state(task_id, "TASK_STATE_WORKING", WAIT_WORKING_S, every_s=0.005)
    if state != "TASK_STATE_WORKING":
        raise RuntimeError(f"task {task_id} read {state} on disk, not WORKING, {WAIT_WORKING_S:g} s after it was sent")
    await trio.sleep(rng.uniform(0.0, 0.1))
    sent = time.perf_counter()
    status, reply = await connection.post_json(cancel_task(task_id), A2A_HEADERS)
    answered = time.perf_counter()
    answer = result_task(reply)["status"].get("state")
    if answer != CANCELED:
        raise RuntimeError(f"CancelTask answered HTTP {status}, state {answer}: {json.dumps(reply)[:300]}")
    at_response = await rows.state(task_id) == CANCELED
    if not at_response and await rows.wait_state(task_id, CANCELED, CANCEL_VISIBLE_S, every_s=0.001) != CANCELED:
        raise RuntimeError(f"task {task_id} was answered CANCELED but its row did not say so within {CANCEL_VISIBLE_S:g} s")
    # Read after the response, so this bounds the moment the row became CANCELED from above.
    return CancelSample(rpc_s=answered - sent, visible_s=time.perf_counter() - sent, at_response=at_response)


async def cancel_phase(children: Children, keel: Server, rows: TaskRows, args: argparse.Namespace) -> dict[str, Any]:
    run = await start_load(children, keel, args, seconds=600.0, tag="cancel")
    rng = random.Random(20261129)
    connection = Connection(keel.url)
    samples = []
    try:
        for number in range(args.cancels):
            samples.append(await cancel_one(connection, rows, rng, number))
    finally:
        await connection.aclose()
        load = await run.finish(early=True)
    rpc = [s.rpc_s for s in samples]
    visible = [s.visible_s for s in samples]
    return {
        "cancels": len(samples),
        "cancel_ms_p50": round(percentile_ms(visible, 0.50), 2),
        "cancel_ms_p99": round(percentile_ms(visible, 0.99), 2),
        "cancel_ms_max": round(max(visible) * 1000, 2),
        "cancel_rpc_ms_p50": round(percentile_ms(rpc, 0.50), 2),
        "cancel_rpc_ms_p99": round(percentile_ms(rpc, 0.99), 2),
        "cancel_on_disk_at_response": round(sum(s.at_response for s in samples) / len(samples), 3),
        "keel_rps_during_cancel": load["rps"],
        "keel_p99_ms_during_cancel": load["p99_ms"],
        "keel_errors_during_cancel": load["errors"],
    }


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return max(runs, key=lambda run: run["rps"])


async def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    logs = work / "logs"
    logs.mkdir()
    children = Children(logs)
    rows = TaskRows(work / "keel-state" / "tasks.db")
    try:
        keel = await start_keel(children, work / "keel-state")
        servers = [keel, await start_keel_http_model(children, work / "keel-http-model-state")]
        if not args.no_ref:
            servers += [await start_ref(children, "sqlite", work), await start_ref(children, "memory", work)]
        rounds: dict[str, list[dict[str, Any]]] = {server.name: [] for server in servers}
        for number in range(args.rounds):
            for server in servers:
                rounds[server.name].append(await throughput(children, server, args, f"round{number}"))
        cancel = await cancel_phase(children, keel, rows, args) if args.cancels else {}
        on_disk = rows.counts()
    except BaseException:
        for child in children.started:
            if child.process.returncode not in (None, 0):
                print(f"--- {child.name} (exit {child.process.returncode}):\n{child.tail()}", file=sys.stderr)
        raise
    finally:
        rows.close()
        await children.stop_all()
    return report(args, rounds, cancel, on_disk, servers[-1].stack)


def report(
    args: argparse.Namespace,
    rounds: dict[str, list[dict[str, Any]]],
    cancel: dict[str, Any],
    on_disk: dict[str, int],
    ref_stack: str,
) -> dict[str, Any]:
    keel, http_model = best(rounds["keel"]), best(rounds["keel_http_model"])
    none = {"rps": None, "p50_ms": None, "p99_ms": None}
    sqlite, memory = (best(rounds[name]) if name in rounds else none for name in ("ref_sqlite", "ref_memory"))
    result: dict[str, Any] = {
        "keel_rps": keel["rps"],
        "keel_p50_ms": keel["p50_ms"],
        "keel_p99_ms": keel["p99_ms"],
        "keel_model": "zero-latency, in process (scripts/bench/instant_model.py)",
        "keel_http_model_rps": http_model["rps"],
        "keel_http_model_p50_ms": http_model["p50_ms"],
        "keel_http_model_p99_ms": http_model["p99_ms"],
        "ref_sqlite_rps": sqlite["rps"],
        "ref_sqlite_p50_ms": sqlite["p50_ms"],
        "ref_sqlite_p99_ms": sqlite["p99_ms"],
        "ref_memory_rps": memory["rps"],
        "ref_memory_p50_ms": memory["p50_ms"],
        "ref_memory_p99_ms": memory["p99_ms"],
        "vs_ref_sqlite": round(keel["rps"] / sqlite["rps"], 3) if sqlite["rps"] else None,
        "vs_ref_memory": round(keel["rps"] / memory["rps"], 3) if memory["rps"] else None,
        **cancel,
        "clients": args.clients,
        "seconds": args.seconds,
        "warmup_s": args.warmup_s,
        "rounds": args.rounds,
        "errors": {name: sum(run["errors"] for run in runs) for name, runs in rounds.items()},
        "cpu_ms_per_request": {name: best(runs)["cpu_ms_per_request"] for name, runs in rounds.items()},
        "disk_kb_per_request": {name: best(runs)["disk_kb_per_request"] for name, runs in rounds.items()},
        "rps_by_round": {name: [run["rps"] for run in runs] for name, runs in rounds.items()},
        "keel_tasks_on_disk": on_disk,
        "protocol": "A2A 1.0 JSON-RPC SendMessage (blocking), header A2A-Version: 1.0, both sides",
        "ref": f"a2a-sdk {metadata.version('a2a-sdk')}, Starlette, {ref_stack}" if ref_stack else None,
        "cpus": os.cpu_count(),
    }
    met = {}
    for ratio, reference in (("vs_ref_sqlite", sqlite), ("vs_ref_memory", memory)):
        if reference["rps"]:  # judged unrounded: 1.4953 is shown as 1.495, and misses 1.5
            met[ratio] = keel["rps"] >= TARGETS[ratio] * reference["rps"]
    if cancel:
        met["cancel_ms_p99"] = cancel["cancel_ms_p99"] <= TARGETS["cancel_ms_p99"]
    result["targets_met"] = met
    for name, runs in rounds.items():
        for run in runs:
            if run["first_error"]:
                result.setdefault("first_errors", {})[name] = run["first_error"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients, one keep-alive connection each")
    parser.add_argument("--seconds", type=float, default=5.0, help="each throughput window")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="load before each window that is not counted")
    parser.add_argument("--rounds", type=int, default=3, help="throughput windows per server, taken in turns")
    parser.add_argument("--cancels", type=int, default=300, help="tasks cancelled one at a time under load (0: none); with 300 the p99 is the fourth slowest, not the second as with 100")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (state, logs) and print where")
    parser.add_argument("--no-ref", action="store_true", help="measure Keel alone (the ref_* fields are null)")
    args = parser.parse_args(argv)
    if not (1 <= args.clients <= 256 and 0 < args.seconds <= 120 and 1 <= args.rounds <= 20 and 0 <= args.cancels <= 10_000):
        parser.error("clients must be 1..256, seconds 0..120, rounds 1..20 and cancels 0..10000")
    work = Path(tempfile.mkdtemp(prefix="keel-bench-a2a-"))
    try:
        result = trio.run(bench, args, work)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
