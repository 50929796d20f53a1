"""The store contract, as checks any backend can be held to.

``await run_contract(make_backend)`` runs every check, each against a fresh, empty backend made
by ``make_backend()``. A backend hands out stores over its data: calling ``backend.sessions()``
twice gives two stores (think: two processes) over the same data. Test suites may instead
parametrize over ``SESSION_CHECKS`` and ``TASK_CHECKS`` to see each check by name.

What runs the checks is ``contract``; the checks are ``session_checks`` (transcripts, state and
turns), ``steer_checks`` and ``task_checks``, each registering its own as it is imported here.
"""

from __future__ import annotations

# Imported for the checks they register, in this order: sessions' first, then steers', then tasks'.
from persistence.storetest import session_checks, steer_checks, task_checks
from persistence.storetest.contract import SESSION_CHECKS, TASK_CHECKS, Backend, Check, run_contract

__all__ = ["SESSION_CHECKS", "TASK_CHECKS", "Backend", "Check", "run_contract"]
