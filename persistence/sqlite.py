"""One-connection SQLite pools: settings, schemas and migrations, and the pool itself.

Every call on a pool's connection runs in the pool's own worker thread, one call at a time, and a
whole transaction always runs inside one such call: the Trio thread never blocks on disk, and
BEGIN/COMMIT are never split across awaits. Calls are uncancellable once queued, so a
transaction that has started always finishes (or rolls back) before its caller sees a
cancellation.
"""

from __future__ import annotations

import os
import queue
import sqlite3
import threading
from contextlib import closing, suppress
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import outcome
import trio

from persistence.errors import (
    RESTORE_FIX, DatabaseBusy, DatabaseDamaged, DatabaseFailed, DatabaseGone, SchemaError, StoreClosed, StoreError,
)
from persistence.schema import KNOWN_SCHEMAS, META_DDL, SchemaIdentity, read_identity, write_identity_txn
from persistence.statedir import owned_as_directory

T = TypeVar("T")

BUSY_TIMEOUT_MS = 5000  # another process holding the write lock makes us queue, not fail
SYNCHRONOUS = ("FULL", "NORMAL", "OFF")
MIN_SQLITE = (3, 35, 0)  # UPDATE ... RETURNING


def check_sqlite_version(version: tuple[int, int, int] = sqlite3.sqlite_version_info) -> None:
    if version < MIN_SQLITE:
        raise RuntimeError(
            f"Keel needs SQLite {'.'.join(map(str, MIN_SQLITE))} or newer; this Python's sqlite3 module uses "
            f"{'.'.join(map(str, version))}. Run Keel with a Python built against a newer SQLite."
        )


def create_private(path: Path) -> None:
    """Make ``path`` readable and writable by its owner alone, creating it empty if it does not
    exist: the database SQLite then opens there, and the ``-wal`` and ``-shm`` files it makes
    beside it (with the database's permissions), hold conversations. A database (and its side
    files) made before Keel did this is narrowed to the same mode. Blocking."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        for existing in (path, *(path.with_name(path.name + suffix) for suffix in ("-wal", "-shm"))):
            try:
                if os.stat(existing).st_mode & 0o077:
                    os.chmod(existing, 0o600)
            except (FileNotFoundError, PermissionError):  # none there; or another user's, left to them
                pass
        return
    try:
        owned_as_directory(fd, path.parent)
    finally:
        os.close(fd)


def immutable_uri(path: Path) -> str | None:
    """A URI that reads the database ``path`` as an immutable file, making nothing beside it (no
    ``-wal``, no ``-shm``, not even in a directory this user may not write in) and taking no
    lock; None where that could miss what it holds. With no ``-wal`` beside it, no connection has
    it open in WAL mode (the last one to close checkpoints the WAL into it and removes it), and
    with no ``-journal``, no write is left to undo: the file alone is the whole database. (A
    process that opens it meanwhile writes to the WAL it makes, and to the file only when it
    checkpoints: a read that a checkpoint overtakes can find the file damaged, never change it.)"""
    if any(os.path.lexists(f"{path}{suffix}") for suffix in ("-wal", "-journal")):
        return None
    return f"{path.resolve().as_uri()}?mode=ro&immutable=1"


def connect(path: Path, *, synchronous: str = "FULL", readonly: bool = False) -> sqlite3.Connection:
    """A connection with Keel's settings. Blocking: call it from a worker thread. ``readonly``
    reads a database as it is, making nothing beside it where it can (``immutable_uri``)."""
    if synchronous not in SYNCHRONOUS:
        raise ValueError(f"synchronous must be one of {', '.join(SYNCHRONOUS)}, not {synchronous!r}")
    check_sqlite_version()
    if readonly:
        uri = immutable_uri(path) or f"{path.resolve().as_uri()}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    else:
        create_private(path)
        # isolation_level=None: no implicit transactions; every write says BEGIN IMMEDIATE itself.
        # A cache of prepared statements twice the default: the session store's batches insert
        # their events with a statement for each count of rows, some sixty of them.
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, cached_statements=256)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys = ON")
        if readonly:
            conn.execute("PRAGMA query_only = ON")
        else:
            # WAL: readers never block the writer; FULL fsyncs the WAL at every commit, so a
            # returned commit survives power loss (NORMAL only survives a process crash).
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {synchronous}")
    except BaseException:
        conn.close()
        raise
    return conn


def begin_immediate(conn: sqlite3.Connection) -> None:
    """BEGIN IMMEDIATE in one call into SQLite. End the transaction with ``conn.commit()`` or
    ``conn.rollback()``, one call each too.

    ``conn.execute`` makes about five calls for a statement (reset, step, column count, reset,
    last row id), and lets go of the GIL around every one. A database's thread must then take
    the GIL back five times, and while the event loop is busy each take waits: under load that
    wait, not the disk, was most of a transaction's time.
    """
    if conn.in_transaction:  # executescript would commit it silently
        raise RuntimeError(f"a transaction is already open on {conn!r}")
    conn.executescript("BEGIN IMMEDIATE")


def transaction(conn: sqlite3.Connection, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(conn, *args)`` inside BEGIN IMMEDIATE ... COMMIT, rolling back on any error."""
    begin_immediate(conn)
    try:
        result = fn(conn, *args)
    except BaseException:
        conn.rollback()
        raise
    conn.commit()
    return result


def execute_ddl(conn: sqlite3.Connection, script: str) -> None:
    """Run a script of statements inside the current transaction.

    ``Connection.executescript`` would COMMIT first, breaking the one-transaction migration.
    """
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            conn.execute(statement)
            statement = ""
    if statement.strip():
        raise ValueError(f"incomplete SQL statement at the end of a migration: {statement.strip()[:80]!r}")


Migration = Callable[[sqlite3.Connection], None]


@attrs.frozen
class Schema:
    """A database's DDL as numbered migrations: ``migrations[i]`` takes version i to i + 1."""

    name: str
    migrations: tuple[Migration, ...]

    @property
    def version(self) -> int:
        return len(self.migrations)

    def check_identity(self, path: Path, found: SchemaIdentity | None, user_tables: Sequence[str]) -> int:
        """The version to migrate from (0 for an empty file), or SchemaError with the fix."""
        assert KNOWN_SCHEMAS[self.name] == self.version, "KNOWN_SCHEMAS is out of step with the migrations"
        if found is None:
            if user_tables:
                raise SchemaError(
                    path,
                    f"holds tables ({', '.join(sorted(user_tables)[:5])}) but no Keel schema identity, so it is not a {self.name} database",
                    "Move the file aside, or point the state directory at the right place",
                )
            return 0
        if found.name != self.name:
            if _log_is_other(path, found):
                raise SchemaError(
                    path,
                    f"is read as a {found.name} database, not {self.name}, because of the write-ahead log beside it"
                    f" ({path.name}-wal): the file alone is not one, so that log is another database's, copied or moved in"
                    " beside it, and what the file's own log held since its last checkpoint, if it had one, is not there",
                    RESTORE_FIX,
                )
            raise SchemaError(path, f"is a {found.name} database, not {self.name}", "Point the state directory at the right place")
        if found.version > self.version:
            raise SchemaError(
                path,
                f"has schema {found} but this build supports {self.name}@{self.version}",
                "Upgrade Keel, or restore a snapshot taken by this version",
            )
        if found.version < 1:
            raise SchemaError(path, f"records an impossible schema version {found.version}", "Restore a good snapshot")
        return found.version

    def check_tables(self, path: Path, conn: sqlite3.Connection, version: int | None = None) -> None:
        """SchemaError unless the database has the tables of ``version`` (the current one by
        default) with their columns and no others: one missing fails this build's reads or
        writes, and a column it does not know (a NOT NULL one it never fills) its writes, or says
        that another build or program changed the file; so does an index or a trigger of its own
        dropped. Tables, indexes, triggers and views of another program's, and SQLite's own
        (``sqlite_stat1`` of an ANALYZE), are not the schema's to refuse."""
        version = self.version if version is None else version
        expected, found = self.layout(version), layout_of(conn)
        missing = [f"table {t}" for t in expected if t not in found] + [
            f"column {t}.{c}" for t in expected if t in found for c in expected[t] if c not in found[t]
        ]
        # A table of another program's is left to it (Litestream, replicating the file, keeps
        # two): no write of this build goes near it. A column added to one of this schema's is.
        added = [f"column {t}.{c}" for t in found if t in expected for c in found[t] if c not in expected[t]]
        unknown = f"{', '.join(added)}, which {self.name}@{version} does not have (another program, or another build, changed it)"
        if missing and added:  # both named: a rename, say, is told for what it is
            raise SchemaError(
                path,
                f"has an incomplete {self.name} schema (missing {', '.join(missing)}, and has {unknown})",
                "Undo what was changed (ALTER TABLE ... RENAME COLUMN, ... DROP COLUMN), or restore a good snapshot",
            )
        if missing:
            raise SchemaError(
                path,
                f"has an incomplete {self.name} schema (missing {', '.join(missing)})",
                "Restore a good snapshot, or move the file aside to start empty",
            )
        if added:
            raise SchemaError(
                path, f"has {unknown}", "Remove what was added (ALTER TABLE ... DROP COLUMN), or restore a good snapshot"
            )
        self._check_own_objects(path, conn, version)

    def _check_own_objects(self, path: Path, conn: sqlite3.Connection, version: int) -> None:
        """SchemaError if an index or a trigger of ``version`` that this build keeps was dropped:
        a unique index is what keeps a message from starting two tasks, and a trigger what keeps
        the counts of tasks right. (One an upgrade drops is not missed.)"""
        kept = self._built(self.version)[1]
        own = {name: kind for name, kind in self._built(version)[1].items() if kind in ("index", "trigger")}
        own = {name: kind for name, kind in own.items() if kept.get(name) == kind}
        present = {name.lower() for _kind, name in conn.execute(_OBJECTS)}
        gone = [name for name in own if name not in present]
        if gone:
            made = "; ".join(self._built(self.version)[2][name] for name in gone)
            raise SchemaError(
                path,
                f"is missing {', '.join(f'{own[name]} {name}' for name in gone)} of its {self.name} schema (dropped by hand,"
                " or by another program)",
                f"Make {'it' if len(gone) == 1 else 'them'} again ({made}), or restore a good snapshot",
            )

    def check_upgrade(self, path: Path, conn: sqlite3.Connection, version: int) -> None:
        """SchemaError if the database, of ``version``, holds a table, index, trigger or view under
        a name that bringing it up to date gives one of the schema's own (another program's, or
        one made by hand): the migration would fail on it ("index ... already exists")."""
        made = self.made_after(version)
        taken = [(kind, name) for kind, name in conn.execute(_OBJECTS) if name.lower() in made]
        if not taken:
            return
        named = ", ".join(f"{kind} {name}" for kind, name in taken)
        renames = "; ".join(
            f"ALTER TABLE {name} RENAME TO <another name>" if kind == "table"
            else f"DROP {kind.upper()} {name}, then make it again under another name"
            for kind, name in taken
        )  # fmt: skip
        raise SchemaError(
            path,
            f"holds {named} (made by another program, or by hand), which {self.name}@{self.version} makes for its own,"
            " so the file cannot be brought up to date",
            f"Give {'it' if len(taken) == 1 else 'them'} another name ({renames}), or restore a good snapshot",
        )

    def layout(self, version: int) -> Mapping[str, tuple[str, ...]]:
        """The tables of ``version`` and their columns, as its migrations make them."""
        return self._built(version)[0]

    def made_after(self, version: int) -> Mapping[str, str]:
        """What bringing a database of ``version`` up to date makes: the type of each table,
        index, trigger and view, by its name in lower case (SQLite's names ignore case)."""
        made: dict[str, str] = {}
        for step in range(version, self.version):
            before = self._built(step)[1]
            made.update((name, kind) for name, kind in self._built(step + 1)[1].items() if name not in before)
        return made

    def _built(self, version: int) -> tuple[Mapping[str, tuple[str, ...]], Mapping[str, str], Mapping[str, str]]:
        key = (self.name, version)
        if key not in _BUILT:
            with closing(sqlite3.connect(":memory:", isolation_level=None)) as conn:
                for migration in self.migrations[:version]:
                    transaction(conn, migration)
                conn.execute(META_DDL)
                objects = conn.execute(f"SELECT type, name, sql FROM sqlite_master WHERE {_NOT_SQLITES}").fetchall()
                _BUILT[key] = (
                    layout_of(conn), {name.lower(): kind for kind, name, _sql in objects},
                    {name.lower(): " ".join(sql.split()) for _kind, name, sql in objects if sql},
                )  # fmt: skip
        return _BUILT[key]


# By (schema name, version): its tables' columns, and the type and the SQL of every object, by its
# name in lower case.
_BUILT: dict[tuple[str, int], tuple[Mapping[str, tuple[str, ...]], Mapping[str, str], Mapping[str, str]]] = {}
_NOT_SQLITES = "name NOT LIKE 'sqlite_%'"
_OBJECTS = f"SELECT type, name FROM sqlite_master WHERE {_NOT_SQLITES}"


def layout_of(conn: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
    """The database's tables, SQLite's own left out, with the names of their columns."""
    return {
        table: tuple(row[0] for row in conn.execute("SELECT name FROM pragma_table_info(?)", (table,)))
        for table in _user_tables(conn)
    }


def _user_tables(conn: sqlite3.Connection) -> list[str]:
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    return [row[0] for row in rows]


def migrate(path: Path, conn: sqlite3.Connection, schema: Schema) -> None:
    """Bring the database to the schema's current version in one transaction. Blocking."""

    def txn(conn: sqlite3.Connection) -> None:
        start = schema.check_identity(path, read_identity(conn), _user_tables(conn))
        if start:
            schema.check_upgrade(path, conn, start)
        for step in schema.migrations[start:]:
            step(conn)
        if start < schema.version:
            write_identity_txn(conn, SchemaIdentity(schema.name, schema.version))
        schema.check_tables(path, conn)

    try:
        transaction(conn, txn)
    except sqlite3.DatabaseError as exc:
        raise _unusable(path, exc) from exc


def inspect(path: Path, schema: Schema) -> int:
    """Read-only preflight: the schema version the file holds (0 for no file, or an empty one),
    which opening it brings up to ``schema.version``; SchemaError if this build cannot use it
    (DatabaseBusy or DatabaseFailed if it cannot be read for now)."""
    if not path.exists():
        return 0
    try:
        conn = connect(path, readonly=True)
        try:
            version = schema.check_identity(path, read_identity(conn), _user_tables(conn))
            if version:
                schema.check_tables(path, conn, version)  # an older one gains the rest when opened
                schema.check_upgrade(path, conn, version)
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise _unusable(path, exc) from exc
    return version


def check_intact(path: Path) -> None:
    """SchemaError if SQLite's integrity check finds the database ``path`` damaged: a page that is
    not what it wrote (a disk that failed, bytes written by another program), an index that no
    longer matches its table. Served, such a file fails the requests that reach the damage, and
    a damaged index can answer wrongly (that a message started no task). Reads the whole file:
    ``check`` runs it, and ``serve`` does not, so that its start takes no longer as the state
    grows. Blocking."""
    try:
        with closing(connect(path, readonly=True)) as conn:
            problems = [str(row[0]) for row in conn.execute("PRAGMA integrity_check(3)")]
    except sqlite3.DatabaseError as exc:
        raise _unusable(path, exc) from exc
    if problems != ["ok"]:
        raise SchemaError(path, f"is damaged (SQLite's integrity check of it found: {'; '.join(problems)})", RESTORE_FIX)


def holds_rows(path: Path, table: str) -> bool:
    """Whether the table ``table`` of the database ``path`` (which has it) holds a row. Blocking."""
    try:
        with closing(connect(path, readonly=True)) as conn:
            return bool(conn.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        raise _unusable(path, exc) from exc


def damaged(exc: sqlite3.Error) -> bool:
    """Whether SQLite failed because the file is damaged (or is no database at all)."""
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT)


def log_of(path: Path) -> Path:
    """The -wal beside the database ``path``."""
    return path.with_name(path.name + "-wal")


# A -wal's layout (sqlite.org/fileformat2.html, "WAL File Format"): a header, then frames of a
# page each behind a header of their own.
LOG_HEADER = 32
FRAME_HEADER = 24
# Frames a -wal is written out for beyond the checkpoint's threshold: the batch that crosses it
# is committed whole before the checkpoint runs.
LOG_SLACK_FRAMES = 100
# Room a disk keeps after the zeros, or none are written: they must never be what fills it.
LOG_ROOM = 64 * 1024 * 1024
_ZEROS = memoryview(bytes(1024 * 1024))  # sliced without a copy


def log_size(conn: sqlite3.Connection) -> int:
    """The size ``write_out_log`` writes the -wal out to; 0 when checkpoints are not automatic."""
    (pages,) = conn.execute("PRAGMA wal_autocheckpoint").fetchone()
    (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    return LOG_HEADER + (pages + LOG_SLACK_FRAMES) * (page_size + FRAME_HEADER) if pages > 0 else 0


def write_out_log(path: Path, conn: sqlite3.Connection) -> None:
    """Write the database's -wal out with zeros to the size it reaches before a checkpoint starts
    it over (``log_size``), and sync it. Blocking.

    A commit that makes the -wal longer syncs the file's new size and blocks with its pages; one
    written where the file already is syncs its pages alone: on ext4, a two-row commit at
    ``synchronous=FULL`` took about 200 µs against 390. SQLite writes its frames from the start
    of the -wal again once a checkpoint has caught up, so without this only the commits of the
    first few megabytes after each start paid the difference; with it, none does. PostgreSQL
    fills its new WAL files with zeros for the same reason (``wal_init_zero``).

    Zeros are never read as frames: a frame counts only if it carries the salts of the -wal's
    header and a checksum that follows on from the frames before it. They are written under the
    write lock, so no other connection appends a frame meanwhile, and SQLite holds no lock on
    the -wal itself, so closing the descriptor used here drops none. A disk without ``LOG_ROOM``
    to spare after them gets none, and zeros the disk could not take are cut off again: this
    only saves time, and must never be what fills a disk.
    """
    size = log_size(conn)
    if not size:  # checkpoints by hand only: no size the -wal comes back to
        return
    try:
        begin_immediate(conn)
    except sqlite3.Error:  # another process writing past the busy timeout: its writes go on as before
        return
    try:
        _write_zeros(log_of(path), size)
    finally:
        conn.rollback()


def _write_zeros(log: Path, size: int) -> None:
    """Zeros from the end of ``log`` to ``size``, synced; none where the disk has not that and
    ``LOG_ROOM`` to spare, and those it could not take after all cut off again."""
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CLOEXEC)  # never made here: SQLite makes it
    except OSError:
        return
    try:
        start = end = os.lseek(fd, 0, os.SEEK_END)
        room = os.fstatvfs(fd)
        if end >= size or room.f_bavail * room.f_frsize < size - end + LOG_ROOM:
            return
        try:
            while end < size:
                end += os.pwrite(fd, _ZEROS[: size - end], end)
            os.fsync(fd)
        except OSError:  # the disk filled after all (another writer): the room is given back
            with suppress(OSError):  # zeros left there are harmless
                os.ftruncate(fd, start)
    finally:
        os.close(fd)


def _log_is_other(path: Path, found: SchemaIdentity) -> bool:
    """Whether the database ``path``, read as ``found``, is read so because of a -wal beside it
    that is another's: the file alone (read as immutable, which leaves the -wal out) is not a
    ``found`` database. Blocking."""
    if not os.path.isfile(log_of(path)):
        return False
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)) as conn:
            alone = read_identity(conn)
    except sqlite3.Error:  # the file alone is damaged, or no database: not the -wal's doing, as far as is known
        return False
    return alone is None or alone.name != found.name


def _unusable(path: Path, exc: sqlite3.DatabaseError) -> StoreError:
    """Why a database could not be opened: the file is damaged (not a database, or corrupt), or
    only held by another program for now, or SQLite failed otherwise. Only a damaged file is
    worth replacing."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # the primary code of an extended one
    if damaged(exc):
        return SchemaError(path, "cannot be read as a database: it is damaged, or it is not a SQLite file", RESTORE_FIX)
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return DatabaseBusy(path, exc)
    return DatabaseFailed(path, exc)


class _Job:
    __slots__ = ("fn", "args", "token", "then")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], token: trio.lowlevel.TrioToken,
        then: Callable[[outcome.Outcome[Any]], object],
    ) -> None:  # fmt: skip
        self.fn = fn
        self.args = args
        self.token = token
        self.then = then


def _deliver(job: _Job, result: outcome.Outcome[Any]) -> None:  # in the pool's thread
    try:
        job.token.run_sync_soon(job.then, result)
    except trio.RunFinishedError:  # the caller's Trio run ended while it waited
        pass


def _uncancellable(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED  # the call finishes; a cancellation lands after it


def _close(conn: sqlite3.Connection) -> None:
    """The last job a pool's thread runs."""
    conn.close()


# Where Linux names what a descriptor of this process refers to: a file's path while it is at
# that path, its new one once moved, and its old one with " (deleted)" after it once removed.
_FD_NAMES = "/proc/self/fd"


@attrs.frozen
class _Watch:
    """How a pool tells whether a file its writes go to (the database, or its -wal) is still the
    one at its path.

    Where the platform allows (Linux), by a descriptor held on the file opened (``O_PATH``: it
    neither reads nor locks) and the name the kernel gives it, read again at each check; the
    file's own attributes are never asked for after it is opened. Since Linux 6.13 a stat of a
    file makes the next write to it stamp its times at fine grain, an inode update: with the
    -wal stat-ed before each batch, every commit to it (written and synced, ``synchronous=FULL``)
    took a third longer on ext4 (240 against 180 µs a commit, measured). Elsewhere, by a stat of
    the path compared with the device and inode opened."""

    path: str
    log: bool  # the -wal, rather than the database file itself
    # Where descriptors are not named: the (device, inode) of the file opened; None, not known
    # to have been there.
    opened: tuple[int, int] | None = None
    fd: int | None = None  # held on the file opened, where the platform names descriptors (Linux)
    name: str | None = None  # what the kernel named ``fd`` as it was opened

    @classmethod
    def opened_at(cls, path: Path, *, log: bool) -> _Watch:
        """The watch of the file now at ``path``. Blocking; raises OSError if there is none."""
        if not hasattr(os, "O_PATH") or not os.path.isdir(_FD_NAMES):
            found = os.stat(path)
            return cls(os.fspath(path), log, opened=(found.st_dev, found.st_ino))
        fd = os.open(path, os.O_PATH)
        try:
            name = os.readlink(f"{_FD_NAMES}/{fd}")
        except BaseException:
            os.close(fd)
            raise
        return cls(os.fspath(path), log, fd=fd, name=name)

    def there(self) -> bool:
        """Whether the file opened is still at its path. Blocking: one readlink, or one stat."""
        if self.fd is not None:
            try:
                return os.readlink(f"{_FD_NAMES}/{self.fd}") == self.name
            except OSError:
                return False
        try:
            now = os.stat(self.path)
        except OSError:
            return self.log and self.opened is None  # a -wal not known to have been there
        return self.opened is None or (now.st_dev, now.st_ino) == self.opened

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


@attrs.define(eq=False)
class SqlitePool:
    """One connection to one database file, used only by the pool's own thread.

    ``await pool.run(fn, *args)`` queues ``fn(conn, *args)`` to that thread; calls run one at a
    time, in the order they were made. The thread starts with the first call and ends with
    ``aclose()``. A thread of its own rather than ``trio.to_thread`` with a limiter of one: the
    hand-off is one queue put and one wake-up of the Trio thread, which on a small virtual
    machine takes about a third off every round trip, and every store write pays it.
    """

    path: Path
    _conn: sqlite3.Connection = attrs.field(alias="conn")
    # The file opened and its -wal, as check_file checks them; a pool given none checks the
    # paths for files, whichever they are.
    _watched: tuple[_Watch, ...] = attrs.field(default=(), alias="watched")
    _jobs: queue.SimpleQueue[_Job] = attrs.field(init=False, factory=queue.SimpleQueue)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _closed: bool = attrs.field(init=False, default=False)
    _damaged: bool = attrs.field(init=False, default=False)  # SQLite found the file damaged since it opened
    # Whether that was logged: claimed once (``claim_first``), from whichever thread asks first.
    _told: bool = attrs.field(init=False, default=False)
    _told_lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def __attrs_post_init__(self) -> None:
        if not self._watched:
            self._watched = (_Watch(os.fspath(self.path), False), _Watch(os.fspath(log_of(self.path)), True))

    @classmethod
    async def open(cls, path: Path, schema: Schema, *, synchronous: str = "FULL") -> SqlitePool:
        """Open (creating if needed) and migrate. Raises SchemaError naming the file and the fix
        (DatabaseBusy or DatabaseFailed when the file cannot be used for now)."""

        def open_sync() -> SqlitePool:
            inspect(path, schema)  # refuse before anything (even the switch to WAL) touches the file
            try:
                conn = connect(path, synchronous=synchronous)
            except (sqlite3.Error, OSError) as exc:
                raise DatabaseFailed(path, exc) from exc
            watched: list[_Watch] = []
            try:
                migrate(path, conn, schema)
                write_out_log(path, conn)
                watched.append(_Watch.opened_at(path, log=False))
                watched.append(_Watch.opened_at(log_of(path), log=True))  # migrate's transaction made the -wal
            except BaseException:
                conn.close()
                for watch in watched:
                    watch.release()
                raise
            return cls(path=path, conn=conn, watched=tuple(watched))

        return await trio.to_thread.run_sync(open_sync)

    def check_file(self) -> None:
        """Raise DatabaseGone if the file opened, or its -wal, is no longer at its path (removed,
        or replaced: a state directory deleted under the server, say). SQLite goes on writing to
        the -wal it has open, which no process reads after this one. Blocking: two readlinks
        (two stats where the platform names no descriptors)."""
        gone = self._gone()
        if gone is not None:
            raise gone

    def _gone(self) -> DatabaseGone | None:
        for watch in self._watched:
            if not watch.there():
                return DatabaseGone(self.path, log=watch.log)
        return None

    def check_sound(self) -> None:
        """``check_file``, and DatabaseDamaged if a call found the file damaged since it opened:
        the readiness probe's check of the file the server has open; StoreClosed once the pool
        is closed. Blocking, as check_file; callable from any thread."""
        gone = self._gone()
        # Asked after the check: a pool closed meanwhile closed the descriptors checked, and their
        # numbers may since name other files, so what the check found says nothing of this one.
        if self._closed:
            raise StoreClosed(str(self.path))
        if gone is not None:
            raise gone
        if self._damaged:
            raise DatabaseDamaged(self.path)  # as logged when a call found it so

    def failure(self, exc: sqlite3.Error) -> DatabaseFailed:
        """SQLite's error on a call, named for the file: DatabaseDamaged when the file is damaged,
        which asks ``claim_first`` whether it is the first to be logged. Called from any thread."""
        if damaged(exc):
            self._damaged = True
            failure: DatabaseFailed = DatabaseDamaged(self.path, first=self.claim_first)
        else:
            failure = DatabaseFailed(self.path, exc)
        failure.__cause__ = exc
        return failure

    def claim_first(self) -> bool:
        """Whether this is the first ask, of all the threads and requests that found the file
        damaged: the one to log it in full. True once."""
        with self._told_lock:
            first, self._told = not self._told, True
        return first

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` in the pool's thread and return what it returns.

        A caller cancelled before the call is queued raises Cancelled and nothing runs; once it
        is queued the call runs to its end and the cancellation is delivered after it.
        """
        if self._closed:
            raise StoreClosed(str(self.path))
        await trio.lowlevel.checkpoint_if_cancelled()
        return await self._submit(fn, args)  # type: ignore[no-any-return]  # fn's result, from the thread

    def post(
        self, fn: Callable[..., Any], *args: Any, token: trio.lowlevel.TrioToken, then: Callable[[outcome.Outcome[Any]], object]
    ) -> None:
        """Queue ``fn(conn, *args)`` without waiting for it; ``then(its outcome)`` is called in
        ``token``'s Trio thread when it has run. Callable from any thread, the pool's own
        included. On a closed pool nothing runs and the outcome is StoreClosed."""
        if self._closed:
            token.run_sync_soon(then, outcome.Error(StoreClosed(str(self.path))))
        else:
            self._put(_Job(fn, args, token, then))

    def _put(self, job: _Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"sqlite {self.path.name}", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    async def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        task = trio.lowlevel.current_task()
        self._put(_Job(fn, args, trio.lowlevel.current_trio_token(), lambda result: trio.lowlevel.reschedule(task, result)))
        return await trio.lowlevel.wait_task_rescheduled(_uncancellable)

    def _work(self) -> None:  # the pool's thread
        while True:
            job = self._jobs.get()
            if job.fn is _close:  # runs even though the pool is marked closed
                closed = outcome.capture(_close, self._conn)
                for watch in self._watched:
                    watch.release()
                _deliver(job, closed)
                break
            _deliver(job, outcome.capture(self._call, job.fn, job.args))
        while True:  # posted by this thread while the close was queued: never to run
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            _deliver(job, outcome.Error(StoreClosed(str(self.path))))

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        if self._closed:  # closed while this call waited in the queue
            raise StoreClosed(str(self.path))
        try:
            return fn(self._conn, *args)
        except sqlite3.Error as exc:  # the driver's errors stop here, named for the file
            raise self.failure(exc) from exc

    async def aclose(self) -> None:
        """Close the connection once the calls already queued have run (they raise StoreClosed).

        Cancellable, unlike a call: cancelled (a shutdown's bound, past a stalled disk), it
        returns at once, and the pool's thread still closes the connection when it gets there.
        A pool no call has used starts its thread for the close: closing the last connection
        checkpoints the WAL, disk work like any write, and the close is handed over before the
        first checkpoint, so a cancellation can neither hold this call nor lose the close."""
        if self._closed:
            return
        self._closed = True
        task = trio.lowlevel.current_task()
        waiting = True

        def closed(result: outcome.Outcome[Any]) -> None:  # in the Trio thread
            if waiting:
                trio.lowlevel.reschedule(task, result)

        def abort(_: Any) -> trio.lowlevel.Abort:
            nonlocal waiting
            waiting = False
            return trio.lowlevel.Abort.SUCCEEDED

        self._put(_Job(_close, (), trio.lowlevel.current_trio_token(), closed))  # starts the thread if need be
        assert self._thread is not None
        await trio.lowlevel.wait_task_rescheduled(abort)
        await trio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)
