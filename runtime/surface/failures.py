"""What a client is told of a failure under its request that is not the protocol's own error.

A store that fails (a full disk, say) is an outage: logged in one line, and answered -32603
saying so. A damaged database file is logged once, the first time it is found so, with what to
do, and answered -32603 saying that trying again will not help. A stored task this server cannot
read is named, for its operator to repair.
Anything else is a bug: logged with its traceback, and answered -32603 naming nothing internal.
"""

from __future__ import annotations

import logging

from persistence.errors import DatabaseDamaged, DatabaseFailed, StoreClosed, UnreadableTask
from protocol import InternalError, ProtocolError, StorageDamaged, StorageFailed, TaskUnreadable

logger = logging.getLogger(__name__)


def answer_to(method: str, exc: Exception) -> ProtocolError:
    """The error to answer ``method`` with, given what it raised; logged as said above."""
    if isinstance(exc, ProtocolError):
        return exc
    if isinstance(exc, DatabaseDamaged):  # every request that reaches the damage: one line for them all
        if exc.first():
            logger.error("JSON-RPC %s failed: %s", method, exc)
        return StorageDamaged(f"{method!r}")
    if isinstance(exc, (DatabaseFailed, StoreClosed, TimeoutError)):  # or a stalled disk
        logger.error("JSON-RPC %s failed: %s", method, exc)
        return StorageFailed(f"{method!r}")
    if isinstance(exc, UnreadableTask):  # a damaged row: the operator's to repair, as the log says
        logger.error("JSON-RPC %s failed: %s", method, exc)
        return TaskUnreadable(exc.task_id)
    logger.error("JSON-RPC %s failed", method, exc_info=exc)
    return InternalError(f"{method!r}")
