"""The session store's transactions, and what the writer's connection knows of each session.

Each ``*_txn`` runs on the connection its caller hands it, in the pool's thread: inside a batch's
transaction of the group-commit writer, or (``length_txn``, ``events_txn``, ``messages_txn``,
``pending_steers_txn``, reads) as a call on the pool, between two batches.
Those that write events or take steers are given the writer's ``SessionLengths`` and keep it up
to date, so that an append is one INSERT and a save reads nothing back; so is ``messages_txn``,
so that a turn's read of its conversation decodes only what the connection has not seen. Apart from
``persistence.sessions``, which holds the schema and the store: the store checks what it is given
and submits these, and keeps to itself only its other reads and the states' one-statement writes.
A text of a session that is no longer UTF-8 (a byte of its row damaged) fails the read with
UnreadableSession, naming the row and never quoting it (``check_texts``).
``now_ms`` is the clock the stores stamp their rows with.
"""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence

import attrs

from persistence.api import DEFAULT_APP_NAME, SteerReceipt
from persistence.errors import TranscriptConflict, UnreadableSession
from persistence.transcript import Message
from persistence.validate import decode_messages, lone_surrogate, plan_save


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def ensure_txn(conn: sqlite3.Connection, session_id: str, app_name: str, user_id: str, now: int) -> int:
    """Create the session if it is new (concurrent first uses create one row); return its length."""
    created = conn.execute(
        "INSERT INTO sessions (session_id, app_name, user_id, created_at_ms, updated_at_ms) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT (session_id) DO NOTHING",
        (session_id, app_name, user_id, now, now),
    ).rowcount
    # A session created just now has no events (each event's row refers to its session's).
    return 0 if created else length_txn(conn, session_id)


def length_txn(conn: sqlite3.Connection, session_id: str) -> int:
    if lone_surrogate(session_id):  # never stored: refused on the way in (and unbindable)
        return 0
    # One seek in the primary key's index: a session's length is where its events end.
    (length,) = conn.execute(
        "SELECT coalesce(max(seq) + 1, 0) FROM events WHERE session_id = ?", (session_id,)
    ).fetchone()
    return int(length)


# A session's events after a seq: their texts as SQLite's driver decodes them, and as their bytes.
_EVENTS = "SELECT seq, author, created_at_ms, content FROM events WHERE session_id = ? AND seq > ? ORDER BY seq"
_EVENTS_AS_BYTES = (
    "SELECT seq, CAST(author AS BLOB), CAST(content AS BLOB) FROM events WHERE session_id = ? AND seq > ? ORDER BY seq"
)


def events_txn(conn: sqlite3.Connection, session_id: str, after: int) -> list[tuple[int, str, int, str]]:
    """The session's events after position ``after``: (seq, author, created_at_ms, content)."""
    if lone_surrogate(session_id):  # never stored: refused on the way in (and unbindable)
        return []
    try:
        return conn.execute(_EVENTS, (session_id, after)).fetchall()
    except sqlite3.OperationalError:
        check_texts(conn, session_id, "message", _EVENTS_AS_BYTES, (session_id, after))
        raise


def messages_txn(conn: sqlite3.Connection, lengths: SessionLengths, session_id: str) -> list[Message]:
    """The session's messages, for a turn that reads its conversation whole: those known to be
    its first events (the messages its saves were given, or an earlier read made), and only the
    events after them read and decoded, then known too. A conversation's every turn reads it, and
    a long one would otherwise be read back and decoded whole each time (and the turn's first
    save compare each message with what it knew). Run between batches, in the pool's thread."""
    if lone_surrogate(session_id):  # never stored: refused on the way in (and unbindable)
        return []
    lengths.check_current(conn)
    known = lengths.verified.setdefault(session_id, [])
    contents = [content for _, _, _, content in events_txn(conn, session_id, len(known) - 1)]
    if _data_version(conn) != lengths.data_version:  # another connection committed as it read: know nothing of it
        return decode_messages(session_id, [content for _, _, _, content in events_txn(conn, session_id, -1)])
    known += decode_messages(session_id, contents, first_index=len(known))  # all of them, or none
    lengths.kept(session_id, contents)
    return list(known)


def check_texts(conn: sqlite3.Connection, session_id: str, what: str, sql: str, params: tuple[object, ...]) -> None:
    """After a read of the session's rows failed: UnreadableSession naming the first row ``sql``
    reads (its key, then its texts as bytes) with a text that is not UTF-8, which SQLite's driver
    cannot decode (its error quotes the text). A row damaged so fails its session alone, and what
    it holds is not repeated; returns if there is none (the read failed otherwise). Only a read
    that failed is done again so: the driver decodes for nothing more than this would."""
    for key, *texts in conn.execute(sql, params):
        _check_decodes(session_id, f"its {what} {key}", texts)


def _check_decodes(session_id: str, named: str, texts: Iterable[bytes | None]) -> None:
    """UnreadableSession saying that ``named`` (a row of the session) is not UTF-8, if one of
    ``texts`` (its texts, as bytes; None for a NULL) is not."""
    for text in texts:
        if text is None:
            continue
        try:
            text.decode()
        except UnicodeDecodeError as exc:
            raise UnreadableSession(session_id, f"{named} is not UTF-8: byte {exc.start} of it is damaged") from None


@attrs.define(eq=False)
class SessionLengths:
    """What the writer's connection knows of each session it wrote: its length, the messages its
    events hold (the objects the saves were given), and whether it has steers waiting. An append
    is then one INSERT, and a save (which checks that it extends what is stored, and takes the
    steers) reads nothing back.

    Batch hooks of the group-commit writer; touched only in the pool's thread. What is known is
    trusted only while no other connection has committed (``PRAGMA data_version`` changes when
    one has: another process's steer, say). A batch's events are inserted together: when none of
    its writes had to call into the database, in one statement that commits itself
    (``commit_alone``), else before COMMIT. Every statement spared is several calls into SQLite
    spared, each of which lets go of the GIL and must take it back, which under load is a wait.
    """

    data_version: int | None = None
    known: dict[str, int] = attrs.field(factory=dict)
    # The first events of a session, as messages a save was given and found (or made) them to be,
    # or a read of its conversation decoded.
    verified: dict[str, list[Message]] = attrs.field(factory=dict)
    no_steers: set[str] = attrs.field(factory=set)  # sessions with no steer waiting
    max_known: int = 10_000  # then forgotten: a cache, not a record of every session ever written
    max_verified_chars: int = 64 << 20  # likewise once the messages kept come to this many characters stored
    verified_chars: int = 0
    session_chars: dict[str, int] = attrs.field(factory=dict)  # of each session's, the characters kept
    rows: list[tuple[str, int, str, int, str]] = attrs.field(factory=list)  # events not yet inserted
    careful: bool = False  # a savepoint per write: insert at once, inside it
    now: int = 0

    def start(self, *, careful: bool) -> None:
        self._check_bounds()
        self.rows.clear()
        self.careful = careful
        self.now = now_ms()

    def begin(self, conn: sqlite3.Connection) -> bool:
        """Whether what is known still holds; forgotten if not. Only what another connection did
        is checked here, not the bounds: the batch's writes that ran already may have queued
        events that what is known accounts for, and only their transaction has them."""
        version = _data_version(conn)
        if version == self.data_version:
            return True
        self.forget()
        self.data_version = version
        return False

    def check_current(self, conn: sqlite3.Connection) -> None:
        """Forget what is known if another connection has committed since it was learnt, or if
        it has grown past its bounds; outside a batch, only between two of them."""
        self._check_bounds()
        self.begin(conn)

    def _check_bounds(self) -> None:
        if self.verified_chars > self.max_verified_chars:
            self._drop_largest()
        if (
            len(self.known) > self.max_known
            or len(self.verified) > self.max_known
            or len(self.no_steers) > self.max_known
            or self.verified_chars > self.max_verified_chars
        ):
            self.forget()

    def commit_alone(self, conn: sqlite3.Connection) -> bool:
        """Insert the events queued in one statement that commits itself, if no other
        connection has committed since what is known was learnt; False if nothing was written.
        The statement takes the write lock as it starts, as BEGIN IMMEDIATE does (it waits for
        another program's lock, up to the busy timeout, and never fails to upgrade a read)."""
        rows = self.rows
        if self.data_version is None or len(rows) > _ALONE_MAX:
            return False
        if not rows:
            return _data_version(conn) == self.data_version
        size = _alone_size(len(rows))
        params: list[object] = [value for row in rows for value in row]
        params.extend([None] * (5 * (size - len(rows))))
        params.append(self.data_version)
        inserted = conn.execute(_insert_alone(size), params).rowcount
        if inserted == 0:
            return False
        if inserted != len(rows):  # the statement inserts all of them or none
            raise RuntimeError(f"{inserted} of {len(rows)} events were inserted by one statement")
        rows.clear()
        return True

    def flush(self, conn: sqlite3.Connection) -> None:
        """Insert the events queued so far; before anything reads the events table."""
        if self.rows:
            # Taken off the queue first: rows whose insert fails belong to the write that fails
            # (careful mode undoes it alone), and must not be sent again with the next one's.
            rows, self.rows = self.rows, []
            conn.executemany(_INSERT_EVENT, rows)

    def finish(self, conn: sqlite3.Connection) -> None:
        self.flush(conn)

    def abort(self) -> None:
        self.data_version = None
        self.forget()
        self.rows.clear()

    def item_failed(self) -> None:
        # The failed write may have created a session row, or taken positions or steers, that
        # its savepoint undid; in careful mode the tables themselves are accurate, so ask them.
        self.forget()

    def forget(self) -> None:
        self.known.clear()
        self.verified.clear()
        self.verified_chars = 0
        self.session_chars.clear()
        self.no_steers.clear()

    def length(self, conn: sqlite3.Connection, session_id: str) -> int:
        length = self.known.get(session_id)
        if length is None:
            length = self.known[session_id] = ensure_txn(conn, session_id, DEFAULT_APP_NAME, "", self.now)
        return length

    def insert(self, conn: sqlite3.Connection, session_id: str, at: int, author: str, contents: Sequence[str]) -> None:
        """Write events at positions at, at+1, ...: queued for one INSERT of the whole batch, or
        at once in careful mode."""
        self.rows.extend((session_id, at + i, author, self.now, content) for i, content in enumerate(contents))
        if self.careful:
            self.flush(conn)
        self.known[session_id] = at + len(contents)

    def verified_prefix(self, session_id: str, stored: int) -> list[Message]:
        """The messages known to be the session's first events (of ``stored``, from ``length()``)."""
        verified = self.verified.get(session_id)
        if verified is None or len(verified) > stored:
            verified = self.verified[session_id] = []
            self.verified_chars -= self.session_chars.pop(session_id, 0)
        return verified

    def stored_from(self, conn: sqlite3.Connection, session_id: str, start: int) -> list[str]:
        """The contents of the session's events from position ``start`` on."""
        self.flush(conn)
        try:
            contents = [
                content
                for (content,) in conn.execute(
                    "SELECT content FROM events WHERE session_id = ? AND seq >= ? ORDER BY seq", (session_id, start)
                )
            ]
        except sqlite3.OperationalError:
            check_texts(conn, session_id, "message", _EVENTS_AS_BYTES, (session_id, start - 1))
            raise
        self.kept(session_id, contents)
        return contents

    def kept(self, session_id: str, contents: Sequence[str]) -> None:
        """The messages of ``contents`` (events of the session) are kept now: read, or just
        written (by ``plan_save``)."""
        chars = sum(map(len, contents))
        self.verified_chars += chars
        self.session_chars[session_id] = self.session_chars.get(session_id, 0) + chars

    def _drop_largest(self) -> None:
        """Past the bound on characters kept, forget first the sessions that hold more than half
        of it alone. Such a session is back past it at its next save (which reads it whole, as it
        is not kept), and forgetting every session then made every other conversation's saves
        read their transcripts back, batch after batch."""
        for session_id, chars in list(self.session_chars.items()):
            if chars > self.max_verified_chars // 2:
                del self.session_chars[session_id]
                self.verified.pop(session_id, None)
                self.verified_chars -= chars


def _data_version(conn: sqlite3.Connection) -> int:
    """Changes whenever another connection has committed to the database (never for this one's)."""
    (version,) = conn.execute("PRAGMA data_version").fetchone()
    return int(version)


_INSERT_EVENT = "INSERT INTO events (session_id, seq, author, created_at_ms, content) VALUES (?, ?, ?, ?, ?)"

# commit_alone's statement: the events as the rows of a VALUES clause, inserted only if the
# database's data_version is still the one known. One statement for each count of rows up to
# _ALONE_EXACT, past it for each multiple of it, padded with NULLs (a padded row costs about half
# a real one): few enough for the connection's cache of prepared statements.
_ALONE_EXACT, _ALONE_MAX = 64, 256


def _alone_size(rows: int) -> int:
    return rows if rows <= _ALONE_EXACT else -(-rows // _ALONE_EXACT) * _ALONE_EXACT


@functools.cache
def _insert_alone(size: int) -> str:
    values = ", ".join(["(?, ?, ?, ?, ?)"] * size)
    return (
        "INSERT INTO events (session_id, seq, author, created_at_ms, content)"
        f" SELECT column1, column2, column3, column4, column5 FROM (VALUES {values})"
        " WHERE column1 IS NOT NULL AND (SELECT data_version FROM pragma_data_version) = ?"
    )


def append_txn(
    conn: sqlite3.Connection, lengths: SessionLengths, session_id: str, contents: Sequence[str], at: int | None, author: str
) -> int:
    start = lengths.length(conn, session_id)
    if at is not None and start != at:
        raise TranscriptConflict(session_id, f"an append at position {at} does not follow the {start} stored events")
    lengths.insert(conn, session_id, start, author, contents)
    return start


def save_txn(
    conn: sqlite3.Connection, lengths: SessionLengths, session_id: str, messages: Sequence[Message], max_bytes: int
) -> None:
    stored = lengths.length(conn, session_id)
    contents = plan_save(
        session_id,
        messages,
        stored=stored,
        verified=lengths.verified_prefix(session_id, stored),
        stored_from=lambda start: lengths.stored_from(conn, session_id, start),
        max_bytes=max_bytes,
    )
    if contents:
        lengths.insert(conn, session_id, stored, "agent", contents)
        lengths.kept(session_id, contents)


def take_steers_txn(
    conn: sqlite3.Connection, lengths: SessionLengths, session_id: str, for_task: str | None = None
) -> list[str]:
    if session_id in lengths.no_steers or lone_surrogate(session_id):
        return []
    try:
        rows = conn.execute("SELECT id, text, task_id FROM steers WHERE session_id = ? ORDER BY id", (session_id,)).fetchall()
    except sqlite3.OperationalError:
        check_texts(conn, session_id, "steer", _STEERS_AS_BYTES, (session_id,))
        raise
    if rows:
        conn.execute("DELETE FROM steers WHERE session_id = ? AND id <= ?", (session_id, rows[-1][0]))
    lengths.no_steers.add(session_id)
    return [text for _, text, task_id in rows if for_task is None or task_id is None or task_id == for_task]


_OF_PENDING = (
    " FROM steer_receipts WHERE record IS NOT NULL AND (?1 IS NULL OR session_id = ?1) AND (?2 IS NULL OR task_id = ?2)"
    " ORDER BY created_at_ms, message_id"
)
_PENDING = "SELECT session_id, message_id, task_id, record" + _OF_PENDING
_PENDING_RECORDS_AS_BYTES = "SELECT session_id, message_id, CAST(record AS BLOB)" + _OF_PENDING


def pending_steers_txn(
    conn: sqlite3.Connection, session_id: str | None, task_id: str | None
) -> list[tuple[str, str, str | None, str]]:
    """The steers still to be recorded in their tasks (of the session and the task, where given):
    (session_id, message_id, task_id, record)."""
    try:
        return conn.execute(_PENDING, (session_id, task_id)).fetchall()
    except sqlite3.OperationalError:
        for session, message_id, record in conn.execute(_PENDING_RECORDS_AS_BYTES, (session_id, task_id)):
            _check_decodes(session, f"the record of its steer {message_id!r}", (record,))
        raise


_STEERS_AS_BYTES = "SELECT id, CAST(text AS BLOB), CAST(task_id AS BLOB) FROM steers WHERE session_id = ? ORDER BY id"


def drop_steers_txn(conn: sqlite3.Connection, session_id: str, task_id: str) -> None:
    if not (lone_surrogate(session_id) or lone_surrogate(task_id)):  # never stored
        conn.execute("DELETE FROM steers WHERE session_id = ? AND task_id = ?", (session_id, task_id))


# The time of the session's newest steer still to be recorded in its task: the next is dated after
# it, so that they are recorded in the order they were left, though the clock was set back
# between them, or they came within one millisecond (their message ids, a client's, would then order them).
_NEWEST_PENDING = "SELECT max(created_at_ms) FROM steer_receipts WHERE session_id = ? AND record IS NOT NULL"


def add_steer_txn(
    conn: sqlite3.Connection,
    lengths: SessionLengths,
    session_id: str,
    text: str,
    message_id: str | None,
    receipt: SteerReceipt,
    record: str | None,
) -> bool:
    now = now_ms()
    if record is not None:  # pending_steers gives them oldest first: by this time, whatever the clock says
        (newest,) = conn.execute(_NEWEST_PENDING, (session_id,)).fetchone()
        now = now if newest is None else max(now, newest + 1)
    if message_id is not None and not conn.execute(
        "INSERT INTO steer_receipts (session_id, message_id, task_id, sent_sha256, created_at_ms, record)"
        " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        (session_id, message_id, receipt.task_id, receipt.sent_sha256, now, record),
    ).rowcount:
        return False
    conn.execute(
        "INSERT INTO steers (session_id, text, task_id, created_at_ms) VALUES (?, ?, ?, ?)",
        (session_id, text, receipt.task_id, now),
    )
    lengths.no_steers.discard(session_id)
    return True


def steers_recorded_txn(conn: sqlite3.Connection, session_id: str, message_ids: Sequence[str]) -> None:
    conn.executemany(
        "UPDATE steer_receipts SET record = NULL WHERE session_id = ? AND message_id = ?",
        [(session_id, message_id) for message_id in message_ids],
    )


def save_and_take_txn(
    conn: sqlite3.Connection,
    lengths: SessionLengths,
    session_id: str,
    messages: Sequence[Message],
    max_bytes: int,
    placed: Callable[[str], Message] | None,
    for_task: str | None,
) -> list[str]:
    # Taken first, to be saved with the transcript; a save that fails undoes the take with it.
    taken = take_steers_txn(conn, lengths, session_id, for_task)
    if placed is not None and taken:
        messages = [*messages, *map(placed, taken)]
    save_txn(conn, lengths, session_id, messages, max_bytes)
    return taken
