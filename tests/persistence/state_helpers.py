"""Real SQLite files, generations and snapshots for the snapshot/restore/recovery tests."""

from __future__ import annotations

import errno
import os
import select
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from persistence.schema import SchemaIdentity, write_identity_txn
from persistence.sessions import SESSIONS_SCHEMA
from persistence.snapshot import create_snapshot
from persistence.sqlite import transaction
from persistence.tasks import TASKS_SCHEMA
from persistence.statedir import LOCK_NAMES

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = SchemaIdentity("keel.sessions", 1)
TASKS = SchemaIdentity("keel.tasks", 1)
LOCKS = set(LOCK_NAMES)
CHILD_TIMEOUT_S = 60


NOBODY = 65534  # the uid and gid of "nobody" and "nogroup": a user other than the one running


def another_users(directory: Path, *, with_contents: bool = False) -> tuple[int, int]:
    """Make ``directory`` (and, ``with_contents``, what it holds) another user's, as a server run as
    a user of its own has it, and return its owner and group. As root, as an operator running a
    state command with `sudo` is, nobody's; any other user cannot give a directory away, and
    leaves it as it is: then what Keel makes there is that user's anyway, and must stay so."""
    if os.geteuid() == 0:
        for path in [directory, *(directory.iterdir() if with_contents else ())]:
            os.chown(path, NOBODY, NOBODY)
    owner = directory.stat()
    return owner.st_uid, owner.st_gid


def make_db(path: Path, identity: SchemaIdentity | None, label: str, *, rows: int = 3) -> None:
    """A small database whose rows say which generation it belongs to: in a table of another
    program's beside the tables of its Keel schema's version (as its migrations make them), if it
    has one this build knows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = None if identity is None else {s.name: s for s in (SESSIONS_SCHEMA, TASKS_SCHEMA)}.get(identity.name)
    if schema is not None and identity is not None and identity.version <= schema.version:
        with closing(sqlite3.connect(path, isolation_level=None)) as made:
            for migration in schema.migrations[: identity.version]:
                transaction(made, migration)
    conn = sqlite3.connect(path)
    try:
        with conn:
            if identity is not None:
                write_identity_txn(conn, identity)
            conn.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, label TEXT NOT NULL, body BLOB)")
            conn.executemany(
                "INSERT INTO items (label, body) VALUES (?, ?)",
                [(f"{label}-{i}", os.urandom(64)) for i in range(rows)],
            )
    finally:
        conn.close()


def labels(path: Path) -> list[str]:
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        return [row[0] for row in conn.execute("SELECT label FROM items ORDER BY id")]
    finally:
        conn.close()


def fingerprint(directory: Path) -> dict[str, bytes]:
    """Every entry but the lock files, byte for byte (a directory maps to its listing)."""
    result = {}
    for name in sorted(os.listdir(directory)):
        path = directory / name
        if name in LOCKS:
            continue
        result[name] = ("\n".join(sorted(os.listdir(path))).encode() + b"/") if path.is_dir() else path.read_bytes()
    return result


def residue(state_dir: Path) -> list[str]:
    return sorted(name for name in os.listdir(state_dir) if name.startswith(".restore-"))


def quarantine_dir(state_dir: Path) -> Path:
    (name,) = (name for name in residue(state_dir) if name.startswith(".restore-quarantine."))
    return state_dir / name


def leave_hot_sidecars(state_dir: Path, *, wal_db: str, journal_db: str) -> None:
    """Kill a writer mid-flight so ``wal_db`` keeps a ``-wal``/``-shm`` and ``journal_db`` a hot ``-journal``."""
    script = (
        "import os, sqlite3, sys\n"
        "wal = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "wal.execute('PRAGMA journal_mode=WAL'); wal.execute('PRAGMA wal_autocheckpoint=0')\n"
        "wal.execute(\"INSERT INTO items (label) VALUES ('old-in-the-wal')\")\n"
        "rollback = sqlite3.connect(sys.argv[2], isolation_level=None)\n"
        "rollback.execute('PRAGMA cache_size=1'); rollback.execute('BEGIN IMMEDIATE')\n"
        "rollback.execute(\"INSERT INTO items (label, body) VALUES ('uncommitted', randomblob(100000))\")\n"
        "os._exit(0)\n"
    )
    args = [sys.executable, "-c", script, str(state_dir / wal_db), str(state_dir / journal_db)]
    subprocess.run(args, check=True, timeout=CHILD_TIMEOUT_S)
    for sidecar in (f"{wal_db}-wal", f"{wal_db}-shm", f"{journal_db}-journal"):
        assert (state_dir / sidecar).stat().st_size > 0, sidecar


def old_generation(state_dir: Path) -> None:
    """The live generation a restore replaces: hot sidecars, and a database the snapshot lacks."""
    make_db(state_dir / "runtime.db", SESSIONS, "old")
    make_db(state_dir / "tasks.db", TASKS, "old")
    make_db(state_dir / "obsolete.db", None, "old")
    make_db(state_dir / "incidents.db", None, "old")
    leave_hot_sidecars(state_dir, wal_db="runtime.db", journal_db="incidents.db")


def live_databases(state_dir: Path) -> None:
    """A state directory's two databases, as a server that has stopped leaves them."""
    make_db(state_dir / "runtime.db", SESSIONS, "live")
    make_db(state_dir / "tasks.db", TASKS, "live")


def new_snapshot(tmp_path: Path, *, stamp: str = "20260102T030405Z", label: str = "new") -> Path:
    """A published snapshot of another generation (runtime and tasks, and a memory.db the old one lacks)."""
    source = tmp_path / f"source-{stamp}"
    make_db(source / "runtime.db", SESSIONS, label, rows=5)
    make_db(source / "tasks.db", TASKS, label, rows=4)
    make_db(source / "memory.db", None, label)
    return create_snapshot(source, tmp_path / f"backups-{stamp}", keep=10, app_version="test", stamp=stamp)


def snapshot_databases(snapshot: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(snapshot.glob("*.db"))}


def run_child(scenario: str, snapshot: Path, state_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run a restore in a fresh interpreter whose rename seam may end the process."""
    args = [sys.executable, "-m", "tests.persistence.restore_child", scenario, str(snapshot), str(state_dir)]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


def start_child(scenario: str, snapshot: Path, state_dir: Path) -> subprocess.Popen[str]:
    """Start a child that pauses (``hold``, ``pause-after-quarantine``) until its stdin closes."""
    args = [sys.executable, "-m", "tests.persistence.restore_child", scenario, str(snapshot), str(state_dir)]
    return subprocess.Popen(
        args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_line(child: subprocess.Popen[str], expected: str) -> None:
    """Read the child's next line (it writes it once it holds what the test needs)."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], CHILD_TIMEOUT_S)
    line = child.stdout.readline().strip() if ready else "<nothing within the deadline>"
    if line != expected:
        child.kill()
        _, err = child.communicate(timeout=CHILD_TIMEOUT_S)
        raise AssertionError(f"child said {line!r}, expected {expected!r}; stderr: {err}")


def finish_child(child: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)  # closes stdin: the child lets go
    return child.returncode, out, err


def make_damaged_db(path: Path) -> None:
    """A database that opens but fails ``PRAGMA integrity_check``: its index disagrees with its table."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, label TEXT NOT NULL)")
            conn.execute("CREATE INDEX items_label ON items (label)")
            conn.executemany("INSERT INTO items (label) VALUES (?)", [(f"row-{i}",) for i in range(50)])
        conn.execute("PRAGMA writable_schema=ON")
        with conn:
            conn.execute(
                "UPDATE sqlite_master SET sql = 'CREATE INDEX items_label ON items (label DESC)' "
                "WHERE name = 'items_label'"
            )
    finally:
        conn.close()


def in_wal_mode(path: Path) -> None:
    """Switch a database to WAL, as Keel keeps its own; closed, it leaves no -wal or -shm beside it."""
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
    finally:
        conn.close()


def grow(path: Path, size_bytes: int) -> None:
    """Add ``size_bytes`` of random bytes to a database (in a table of its own), to fill a disk with."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute("CREATE TABLE padding (body BLOB NOT NULL)")
            conn.executemany("INSERT INTO padding (body) VALUES (?)", ((os.urandom(1 << 16),) for _ in range(size_bytes >> 16)))
    finally:
        conn.close()


@contextmanager
def small_disk(where: Path, size: str) -> Iterator[Path]:
    """A file system of ``size`` (``1m``) mounted at ``where`` (a tmpfs) for the block: a disk that fills."""
    where.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True)
    assert mounted.returncode == 0, f"mounting a {size} tmpfs at {where} failed (run the suite as root): {mounted.stderr}"
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def fill(directory: Path) -> None:
    """Write a file in ``directory`` until its file system is full, as another program may."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
