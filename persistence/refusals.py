"""Why a path is no directory Keel can use, in plain words: what it is instead of a directory,
why the file system would not make an entry in it, what its permissions forbid.

These only look and say: each returns its words, or None when nothing stands in the way, and
makes nothing. Apart from ``persistence.statedir``, which acts on them (makes a directory, tries
it, refuses it with ``UnusableStateDir``), so that the checks of a configuration
(``runtime.config``) and of a backup root (``persistence.snapshot``) say what a refused state
directory says, and none of them names an errno.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def kind_of(mode: int) -> str:
    """What a directory entry of this ``st_mode`` is, in words: "a file", "a device"..."""
    for test, kind in (
        (stat.S_ISREG, "a file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "a special file"


SYMLINK = "it is a symbolic link; give the directory it points to"


def not_a_directory(path: Path) -> str | None:
    """Why ``path``, which exists, cannot be a state directory, or None when it is a directory.

    A symbolic link is refused even when it points to a directory, as every state command and
    the server refuse it.
    """
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode):
        return None
    if stat.S_ISLNK(mode):
        try:
            target = os.stat(path).st_mode
        except OSError:
            return "it is a symbolic link to nothing, not a directory"
        return SYMLINK if stat.S_ISDIR(target) else f"it is a symbolic link to {kind_of(target)}, not a directory"
    return f"it is {kind_of(mode)}, not a directory"


def not_a_directory_to_use(path: Path) -> str | None:
    """Why ``path``, followed through its links, is no directory to make entries in, or None when
    it is one or is not there yet (to be made)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "it is a symbolic link to nothing, not a directory" if os.path.islink(path) else None
    except OSError as exc:  # a link that leads to itself, a parent that is a file
        return f"it cannot be reached ({exc.strerror or exc})"
    return None if stat.S_ISDIR(mode) else f"it is {kind_of(mode)}, not a directory"


WORKING_DIRECTORY_GONE = (
    "it is relative to the working directory, which has been removed since this process started in it; give an"
    " absolute path, or start it in a directory that exists"
)


def working_directory_gone(path: Path) -> bool:
    """Whether ``path`` is relative to a working directory that no longer exists (a release
    directory a deploy replaced under a service still started in it)."""
    if path.is_absolute():
        return False
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


def unreachable(path: Path, exc: OSError) -> str:
    """Why ``path`` cannot be reached (a parent this user may not search, a name too long...)."""
    return WORKING_DIRECTORY_GONE if working_directory_gone(path) else f"it cannot be reached ({exc.strerror or exc})"


def refusal(exc: OSError, made: str, where: Path) -> str:
    """Why the file system would not make new ``made`` ("files", "directories") in the directory
    ``where``, in plain words: no errno, and no "No such file or directory" for a directory that
    is there (what /proc answers)."""
    code = exc.errno
    if code == errno.ENOENT and not os.path.isdir(where):
        return "it no longer exists"
    if code in (errno.ENOENT, errno.EOPNOTSUPP, errno.ENOTSUP):
        return f"its file system takes no new {made}"
    if code == errno.EROFS:
        return "its file system is read-only"
    if code == errno.ENOSPC:
        return "its file system is full"
    if code == errno.EDQUOT:
        return "this user's disk quota is used up"
    if code in (errno.EACCES, errno.EPERM):
        return "not even root may write in it" if os.geteuid() == 0 else "this user may not write in it"
    return exc.strerror or str(exc)


def write_refused(directory: Path) -> str | None:
    """Why the permissions of ``directory`` (which exists) keep this user from making entries in
    it, without trying; None when they allow it, and for root, whom permissions do not bind
    (only trying tells: /proc takes no new file whoever asks)."""
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    if os.statvfs(directory).f_flag & os.ST_RDONLY:
        return "its file system is read-only"
    return None if os.geteuid() == 0 else "this user may not write in it"


def cannot_create(existing: Path, why: str) -> str:
    """Why a directory to be made in ``existing`` (its nearest existing parent) cannot be."""
    return f"no directory can be made in {existing} ({why}), so it cannot be created"


def not_under(existing: Path) -> str:
    """Why nothing can be made under ``existing``, which is not a directory."""
    try:
        mode = os.stat(existing).st_mode
    except OSError:  # a symbolic link to nothing
        mode = os.lstat(existing).st_mode
    return f"{existing} is {kind_of(mode)}, so no directory can be made under it"
