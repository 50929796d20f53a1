"""Snapshot, restore and no-op recovery timings on a generated ~200 MB state directory.

Run with the project's venv: ``.venv/bin/python scripts/bench/restore.py [--mb 200]``. Prints one
JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from persistence.recovery import recover
from persistence.restore import restore_snapshot
from persistence.schema import SchemaIdentity, write_identity_txn
from persistence.snapshot import create_snapshot

BLOB_BYTES = 1 << 20
# How the generated state is shared between its databases (fractions of --mb).
LAYOUT = (
    ("runtime.db", SchemaIdentity("keel.sessions", 3), 0.5),
    ("tasks.db", SchemaIdentity("keel.tasks", 1), 0.3),
    ("memory.db", None, 0.2),
)
RECOVER_RUNS = 201
T = TypeVar("T")


def generate(state_dir: Path, total_mb: int) -> int:
    """Fill the databases with incompressible 1 MiB blobs, in one transaction each; returns bytes."""
    state_dir.mkdir(parents=True)
    for name, identity, share in LAYOUT:
        conn = sqlite3.connect(state_dir / name)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            with conn:
                if identity is not None:
                    write_identity_txn(conn, identity)
                conn.execute("CREATE TABLE blobs (id INTEGER PRIMARY KEY, body BLOB NOT NULL)")
                blobs = ((os.urandom(BLOB_BYTES),) for _ in range(int(total_mb * share)))
                conn.executemany("INSERT INTO blobs (body) VALUES (?)", blobs)
        finally:
            conn.close()
    return sum((state_dir / name).stat().st_size for name, _, _ in LAYOUT)


def timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[float, T]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=200, help="size of the generated state (default 200)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-bench-restore-") as tmp:
        state_dir, backups = Path(tmp) / "state", Path(tmp) / "backups"
        size = generate(state_dir, args.mb)
        mb = size / 1e6
        snapshot_s, snapshot = timed(create_snapshot, state_dir, backups, keep=2, app_version="bench")
        restore_s, _ = timed(restore_snapshot, snapshot, state_dir)
        noop_ms = [timed(recover, state_dir)[0] * 1000 for _ in range(RECOVER_RUNS)]
    result = {
        "bench": "restore",
        "state_mb": round(mb, 1),
        "databases": len(LAYOUT),
        "snapshot_s": round(snapshot_s, 3),
        "snapshot_mb_s": round(mb / snapshot_s, 1),
        "restore_s": round(restore_s, 3),
        "restore_mb_s": round(mb / restore_s, 1),
        "recover_noop_ms": round(statistics.median(noop_ms), 3),
        "recover_noop_p99_ms": round(sorted(noop_ms)[int(len(noop_ms) * 0.99)], 3),
        "recover_noop_runs": RECOVER_RUNS,
        "recover_noop_target_ms": 20,
    }
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
