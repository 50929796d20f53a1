"""The state directory's three locks: ``fcntl.flock`` on lock files that are never removed.

* ``.keel-generation.lock`` (exclusive, blocking) serializes everything that reads a whole
  generation or replaces one: snapshot, restore, recovery, reset, and a server while it starts.
  A snapshot, which only reads, takes it through a descriptor opened to read where it may not
  open one to write, and not at all in a directory no one may write in (a read-only copy).
* ``.keel.lock`` is held *shared* by every process that uses the live state (several may), and
  taken *exclusively without waiting* by restore and reset, which refuse while anyone holds it.
* ``.keel-serve.lock`` is taken *exclusively without waiting* by the server: one per directory.
  A second would take the first's running tasks for ones a dead process left, and run them again.

None of the three is ever removed, not even by reset: a process may have one open, or be about to
open it, and one that locked a removed file and one that locked the new file made in its place
would each believe it held the lock alone.

Apart from ``persistence.statedir`` (the directory's names, errors, file operations and checks),
which they use and which knows nothing of them: who may read or replace a generation, and when,
is a question of its own. Every call here blocks the calling thread (flock); the runtime makes it
in a worker thread.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import overload

from persistence.refusals import refusal
from persistence.statedir import (
    CHOOSE_ANOTHER,
    GENERATION_LOCK_NAME,
    PRIVATE_MODE,
    SERVE_LOCK_NAME,
    USE_LOCK_NAME,
    AlreadyServed,
    StateBusy,
    StateError,
    UnusableStateDir,
    owned_as_directory,
    require_directory,
)

# Named after the state directory, as every line about it is, whichever module writes it.
logger = logging.getLogger("persistence.statedir")


@overload
def _open_lock_file(state_dir: Path, name: str) -> int: ...
@overload
def _open_lock_file(state_dir: Path, name: str, *, reading: bool) -> int | None: ...
def _open_lock_file(state_dir: Path, name: str, *, reading: bool = False) -> int | None:
    """The lock file ``name``, opened (and made, if it is not there yet). ``reading``: for a
    process that only reads the generation (a snapshot), which needs no more of a lock file than to
    read it (flock asks no more), and needs none in a directory no one may write in (a read-only
    copy, a backup volume: no restore and no server can change a thing there); None then."""
    path = state_dir / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateError(f"the state lock {path} must not be a symlink") from exc
        fix = CHOOSE_ANOTHER
        if reading and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                if written_by_no_one(state_dir):
                    return None
                fix = READ_AS_ITS_OWNER
            else:
                return _regular_lock_file(fd, path)
        if os.path.lexists(path):
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise StateError(f"the state lock {path} must be a regular file") from exc
            raise UnusableStateDir(state_dir, f"its lock file {name} cannot be opened ({exc.strerror or exc})", fix) from exc
        if os.path.lexists(state_dir):
            require_directory(state_dir)
        raise UnusableStateDir(state_dir, f"no file can be made in it ({refusal(exc, 'files', state_dir)})", fix) from exc
    fd = _regular_lock_file(fd, path)
    owned_as_directory(fd, state_dir)
    return fd


READ_AS_ITS_OWNER = (
    "run the snapshot as the user its server runs as or, for a copy no server uses, make the directory read-only"
    " (chmod a-w) and snapshot it then"
)


def _regular_lock_file(fd: int, path: Path) -> int:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StateError(f"the state lock {path} must be a regular file")
    return fd


def written_by_no_one(directory: Path) -> bool:
    """Whether no one may make or remove an entry in ``directory``, which exists: its file system
    is read-only, or its permissions let no one write in it (root, whom they do not bind, aside)."""
    return bool(os.statvfs(directory).f_flag & os.ST_RDONLY) or not os.stat(directory).st_mode & 0o222


def _release(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextmanager
def generation_lock(state_dir: Path, *, reading: bool = False) -> Iterator[None]:
    """Hold the generation lock; blocks while another process snapshots, restores or recovers
    (saying so in the log once, so that a wait is not taken for a hang). ``reading``: for a
    snapshot, which may read a directory it may not write in (see ``_open_lock_file``)."""
    fd = _open_lock_file(state_dir, GENERATION_LOCK_NAME, reading=reading)
    if fd is None:  # no one may write in it: nothing there can change, and nothing is to be held
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning(
                "waiting for another process (a snapshot, a restore, or a server starting) to let go of %s",
                state_dir / GENERATION_LOCK_NAME,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    try:
        yield
    finally:
        _release(fd)


def acquire_use(state_dir: Path, *, exclusive: bool) -> int:
    """Take ``.keel.lock`` without waiting and return its descriptor; raises StateBusy when held."""
    return _lock_now(state_dir, USE_LOCK_NAME, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, StateBusy)


def _lock_now(state_dir: Path, name: str, operation: int, busy: type[StateBusy | AlreadyServed]) -> int:
    """Take the lock file ``name`` without waiting; ``busy(state_dir)`` when another holds it."""
    fd = _open_lock_file(state_dir, name)
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise busy(state_dir) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def in_use(state_dir: Path) -> bool:
    """Whether a process holds ``.keel.lock`` (a server, which may have the databases open or be
    about to open them), for a caller holding the generation lock, under which none can take it
    meanwhile. One that cannot be told is taken as held."""
    try:
        fd = os.open(state_dir / USE_LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go at once, as the descriptor closes
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def release_use(fd: int) -> None:
    _release(fd)


def acquire_serving(state_dir: Path) -> int:
    """Take ``.keel-serve.lock`` without waiting and return its descriptor (release it with
    ``release_use``); raises AlreadyServed while another server holds it."""
    return _lock_now(state_dir, SERVE_LOCK_NAME, fcntl.LOCK_EX, AlreadyServed)


@contextmanager
def exclusive_use(state_dir: Path) -> Iterator[None]:
    """Hold ``.keel.lock`` exclusively: no server is running, and none can start meanwhile."""
    fd = acquire_use(state_dir, exclusive=True)
    try:
        yield
    finally:
        _release(fd)
