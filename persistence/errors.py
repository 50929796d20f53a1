"""The persistence layer's errors. Each names the thing it is about.

StoreError
├── StoreClosed          the store was closed; nothing was written
├── InvalidEvent         content that cannot be stored (not JSON, too large); nothing was written
├── TranscriptConflict   a save that does not extend the stored transcript
├── InvalidTask          a task whose id or columns cannot be stored; nothing was written
├── UnreadableTask       a stored task whose JSON cannot be read: its row was damaged, or written by hand
├── UnreadableSession    a stored session whose text cannot be read: a row of it was damaged, or written by hand
├── TaskExists           create() with an id that is already taken
├── MessageTaken         create() with a first message id the owner's other task already has
├── TaskNotFound         no such task for this owner
├── VersionConflict      update() with a stale version
├── InvalidPage          a page size or page token that cannot be used
│   └── PageOfOtherListing   a page token sent with filters other than those it was given with
├── SchemaError          a database file whose schema this build cannot use
├── DatabaseFailed       SQLite failed (disk full, I/O error, locked too long); the call wrote nothing
│   ├── DatabaseDamaged  SQLite found a page of the file damaged: it stays so until the file is restored
│   └── DatabaseBusy     opening: another program held the file past the busy timeout
└── StateError           (persistence.statedir) snapshots, restore and recovery
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType


class StoreError(Exception):
    """Base class for every error the stores raise."""


class StoreClosed(StoreError):
    def __init__(self, what: str, *, session_id: str | None = None, given: int = 0) -> None:
        self.what = what
        self.session_id = session_id
        self.given = given  # messages (or events) the call was given, none of them stored
        about = "" if session_id is None else f", so session {session_id!r} was neither read nor written"
        if given > 1:
            about += f" (none of messages 0 to {given - 1} given was written)"
        elif given:
            about += " (message 0 given was not written)"
        super().__init__(f"{what} is closed{about}; open a new store to read or write it")


class naming_session:  # noqa: N801  # a context manager, named as contextlib's are
    """A closed store's error, naming the session a call was about and the messages it was given
    (the store's writer knows only its file). A class rather than a generator: every append and
    save goes through it, and a generator's context manager costs several times as much."""

    __slots__ = ("session_id", "given")

    def __init__(self, session_id: str, *, given: int = 0) -> None:
        self.session_id = session_id
        self.given = given

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, StoreClosed) and exc.session_id is None:
            raise StoreClosed(exc.what, session_id=self.session_id, given=self.given) from None


class InvalidEvent(StoreError):
    def __init__(self, session_id: str, index: int, reason: str) -> None:
        self.session_id = session_id
        self.index = index
        super().__init__(f"message {index} of session {session_id!r} cannot be stored: {reason}; nothing of this call was written")


class TranscriptConflict(StoreError):
    """``reason`` says how the transcript or append differs from what is stored, in counts and
    positions alone (no text of the messages, no path)."""

    def __init__(self, session_id: str, reason: str, *, hint: str = "") -> None:
        self.session_id = session_id
        self.reason = reason
        super().__init__(f"session {session_id!r}: {reason}" + (f"; {hint}" if hint else ""))


class InvalidTask(StoreError):
    def __init__(self, task_id: str, reason: str) -> None:
        self.task_id = task_id
        super().__init__(f"task {task_id!r} cannot be stored: {reason}; nothing was written")


class UnreadableTask(StoreError):
    """A task whose stored JSON this build cannot read: the row was damaged, or written by hand."""

    def __init__(self, task_id: str, problem: str) -> None:
        self.task_id = task_id
        super().__init__(
            f"task {task_id!r} in tasks.db cannot be read ({problem}); restore a snapshot taken before it was"
            " damaged (python -m runtime state restore)"
        )


class UnreadableSession(StoreError):
    """A session (an A2A context's conversation) a text of which this build cannot read: a row of
    it was damaged, or written by hand. ``problem`` names the row, never quotes it."""

    def __init__(self, session_id: str, problem: str) -> None:
        self.session_id = session_id
        super().__init__(
            f"session {session_id!r} in runtime.db cannot be read ({problem}); restore a snapshot taken before it was"
            " damaged (python -m runtime state restore)"
        )


class TaskExists(StoreError):
    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        super().__init__(f"task {task_id!r} already exists")


class MessageTaken(StoreError):
    def __init__(self, message_id: str, task_id: str) -> None:
        self.message_id = message_id
        self.task_id = task_id  # the task that has it
        super().__init__(f"message {message_id!r} already started task {task_id!r}")


class TaskNotFound(StoreError):
    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        super().__init__(f"task {task_id!r} not found")


class VersionConflict(StoreError):
    def __init__(self, task_id: str, expected: int, actual: int) -> None:
        self.task_id = task_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"task {task_id!r} was changed by someone else: expected version {expected}, found {actual}; "
            "read it again and retry"
        )


class InvalidPage(StoreError):
    pass


class PageOfOtherListing(InvalidPage):
    """A page token sent with other filters than the listing it was given for: it would start that
    listing after a task of another, a page silently wrong."""

    def __init__(self, token: str, changed: Sequence[str]) -> None:
        self.changed = tuple(changed)  # the filters (``list``'s argument names) that differ
        super().__init__(
            f"page token {token[:40]!r} was given for a listing with another {' and '.join(changed)}; list with the"
            " filters it was given with, or with no token from the first page"
        )


class SchemaError(StoreError):
    def __init__(self, path: object, reason: str, fix: str) -> None:
        self.path = path
        self.reason = reason  # what is wrong with the file, to follow its name
        self.fix = fix
        super().__init__(f"{path}: {reason}. {fix}")


class DatabaseFailed(StoreError):
    """SQLite itself failed. The message names the file; the driver's error is the cause."""

    def __init__(self, path: object, exc: BaseException) -> None:
        self.path = path
        super().__init__(f"{path}: the database failed ({type(exc).__name__}: {exc})")


class DatabaseGone(DatabaseFailed):
    """The file, or its -wal, was removed or replaced under an open connection: SQLite would go on
    writing to the old one, which nothing reads again, so a write there would be acknowledged and lost."""

    def __init__(self, path: object, *, log: bool = False) -> None:
        self.path = path
        self.log = log  # its -wal, rather than the file itself
        if log:
            message = (
                f"{path}-wal: the database's write-ahead log was removed or replaced while the server had it open, so no"
                " write is taken (it would be lost); stop the server with SIGTERM (closing the database moves what the"
                " removed log holds into it) and start it again"
            )
        else:
            message = (
                f"{path}: the database file was removed or replaced while the server had it open, so no write is taken"
                " (it would be lost); put the file back, or restart the server to use the file now there"
            )
        StoreError.__init__(self, message)


# What to do about a database file that is damaged, or that lost what it held.
RESTORE_FIX = (
    "Restore a good snapshot with the server stopped (python -m runtime state restore SNAPSHOT), or start again with no"
    " state at all (python -m runtime state reset)"
)


class DatabaseDamaged(DatabaseFailed):
    """SQLite found a page of the file damaged (a disk that failed, a file written by something
    else): not an outage that passes, and what is stored there stays unreadable until the file
    is restored. The message names the file and what to do; SQLite's words are the cause.

    The damage can be met by several requests and runs at once, in the pool's thread and in
    Trio's: ``first`` asks, when the failure is about to be logged, whether it is the first time
    this server found the file damaged, which one asker alone is told."""

    def __init__(self, path: object, *, first: Callable[[], bool] | None = None) -> None:
        self.path = path
        self._first = first  # the file's once-flag, claimed by the first to ask; None: never the first
        StoreError.__init__(
            self,
            f"{path}: the database file is damaged (a page of it is not what SQLite wrote), so what is stored on that"
            f" page can be neither read nor written. {RESTORE_FIX}",
        )

    def first(self) -> bool:
        """Whether to log this failure in full, with what to do: true for the first ask this
        server made of its file, and never again. Ask once, only to log."""
        return self._first is not None and self._first()


def told_before(exc: BaseException | None) -> str | None:
    """For a log line about to be written: a file found damaged again (``DatabaseDamaged`` not
    ``first``) in a few words, naming it, since the log said what to do the first time; None
    for any other failure, whose own words the line gives each time."""
    if isinstance(exc, DatabaseDamaged) and not exc.first():
        return f"{exc.path} is damaged, as logged when it was first found"
    return None


def is_damage(exc: BaseException) -> bool:
    """Whether a store failed because what it read or wrote is damaged (a page of its file, or a
    row): no outage that passes, but its operator's to restore."""
    return isinstance(exc, (DatabaseDamaged, UnreadableSession))


class DatabaseBusy(DatabaseFailed):
    """Opening, another program held the database past the busy timeout: nothing is wrong with
    the file, and it can be used once that program lets go."""

    def __init__(self, path: object, exc: BaseException) -> None:
        self.path = path
        StoreError.__init__(
            self,
            f"{path}: another program is holding the database ({exc}); wait until it lets go"
            " (an open sqlite3 shell, a backup tool), then try again",
        )
