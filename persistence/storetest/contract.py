"""What runs the store contract's checks: the backend they are given, their registers, and the
words they share.

A check is an async function of a ``Backend``; ``session_check`` and ``task_check`` register it
in ``SESSION_CHECKS`` or ``TASK_CHECKS``, in the order the check modules define them, and
``run_contract`` runs every registered check, each on a fresh backend. Apart from the checks
themselves (``persistence.storetest.session_checks``, ``steer_checks`` and ``task_checks``),
so that each of those modules holds checks alone, and none imports another. The package imports
every one of them, so the registers are full however this module is reached.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import trio

from persistence.transcript import Message

DEADLINE_S = 30  # every check is bounded; none should come near it


class Backend(Protocol):
    def sessions(self) -> AbstractAsyncContextManager[Any]: ...

    def tasks(self) -> AbstractAsyncContextManager[Any]: ...


Check = Callable[[Backend], Awaitable[None]]
SESSION_CHECKS: list[Check] = []
TASK_CHECKS: list[Check] = []


def session_check(fn: Check) -> Check:
    SESSION_CHECKS.append(fn)
    return fn


def task_check(fn: Check) -> Check:
    TASK_CHECKS.append(fn)
    return fn


async def run_contract(make_backend: Callable[[], Backend]) -> None:
    """Run every check, each on a fresh backend; raises AssertionError naming the failed check."""
    for check in SESSION_CHECKS + TASK_CHECKS:
        try:
            with trio.fail_after(DEADLINE_S):
                await check(make_backend())
        except AssertionError as exc:
            raise AssertionError(f"{check.__name__}: {exc}") from exc


def user(text: str) -> Message:
    return Message(role="user", text=text)


def answer(text: str) -> Message:
    return Message(role="assistant", text=text)


LONE = "\ud800"  # a lone UTF-16 surrogate: a Python string can hold one (JSON's "\\ud800"), UTF-8 cannot
