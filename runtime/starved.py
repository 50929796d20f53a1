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


# The descriptors a server holds of its own: its databases and their journals, the state
# directory's locks, the listening sockets, the log, Python's own.
OWN_DESCRIPTORS = 20


def model_connections_allowed(wanted: int, file_limit: int) -> int:
    """How many model connections a process whose limit on open files is ``file_limit`` may open:
    ``wanted``, but at most half of the descriptors left beside the server's own (and at least
    one). A model server that stalls holds each connection open until its timeout; were it to
    hold every descriptor, the server could accept nothing, not even ``/livez`` or a
    ``tasks/cancel``, until then. The other half is the clients'."""
    if file_limit == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (file_limit - OWN_DESCRIPTORS) // 2))
