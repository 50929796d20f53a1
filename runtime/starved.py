"""A process out of file descriptors (or the kernel out of memory for sockets): how to tell, and
what to say, naming the limit to raise."""

from __future__ import annotations

import errno
import os
import resource

# What a call that needs a new descriptor (accept, socket, open) answers when the process or the
# system is out of what it needs.
STARVED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def starved_reason(code: int, subject: str = "this process") -> str:
    """Why a call failed with ``code``, one of STARVED, in words for an operator."""
    if code == errno.EMFILE:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return f"{subject} has as many files open as its limit allows ({soft}: ulimit -n)"
    return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
