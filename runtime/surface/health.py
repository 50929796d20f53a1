"""Liveness and readiness: ``GET /livez`` and ``GET /healthz``.

``/livez`` depends on nothing, so a busy or broken dependency never gets a live process
restarted. ``/healthz`` runs every probe at once, each under its own timeout, and lists every
problem found (it never stops at the first). A problem names a class of failure and the file,
directory or model server it is about; what the failure said goes to the log, never to the
client, because it may hold a stack trace, a DSN or a model provider's words. A model problem
says why in the words the model client's errors use for A2A clients (``ModelError.reason``).

The probes only read: the stores are checked through ``persistence.sqlite.inspect``, which
opens its own read-only connection, so a probe never queues behind the traffic connection and
never migrates anything. The state directory probe creates and removes a ``.readiness-*``
file, the one way to know that the next write will succeed.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol, TypeVar, TypeVarTuple, runtime_checkable

import attrs
import trio

from persistence.databases import SESSIONS_FILE, TASKS_FILE
from persistence.errors import DatabaseDamaged, DatabaseFailed
from persistence.sessions import SESSIONS_SCHEMA
from persistence.sqlite import Schema, inspect
from persistence.statedir import MIN_FREE_BYTES, free_bytes, nearly_full
from persistence.tasks import TASKS_SCHEMA
from runtime.models.errors import ModelError
from runtime.starved import STARVED, starved_reason

logger = logging.getLogger(__name__)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

NOT_STARTED = "the A2A server has not started"
DEFAULT_PROBE_TIMEOUT_S = 5.0
# How long a request waits for the model catalog check it set going (an answer on a working link
# comes in milliseconds), before it answers with what the last check found: the check itself
# takes as long as a task's connection may (AGENT_MODEL_CONNECT_TIMEOUT_S), and a load balancer's
# probe may allow 1 s. The bound on the check itself, whatever the catalog client's timeouts.
MODEL_WAIT_S = 0.5
MODEL_CHECK_MAX_S = 30.0
MODEL_CHECK_PENDING = "the model catalog check has not finished yet"


class ModelCatalog(Protocol):
    """What readiness needs of a model client (runtime.models.ModelClient is one)."""

    @property
    def model(self) -> str:
        """The model it asks for, which the catalog must offer."""

    @property
    def endpoint(self) -> str:
        """Where it asks, as an operator may be shown it: no credentials, no query."""

    async def has_model(self, name: str | None = None) -> bool: ...


@runtime_checkable
class ListsModels(Protocol):
    """A catalog that can also say what it lists (runtime.models.ModelClient can): the log names
    that, when the model is absent from it, for the operator to give the name it knows."""

    async def list_models(self) -> tuple[str, ...]: ...


# How many of the catalog's names the log gives when the model is not among them.
LISTED_NAMES = 10


@attrs.define(eq=False)
class Readiness:
    """Whether startup has finished. Until ``set()``, every route answers 503 unready."""

    _started: trio.Event = attrs.field(init=False, factory=trio.Event)

    def set(self) -> None:
        self._started.set()

    def is_set(self) -> bool:
        return self._started.is_set()


@attrs.define(eq=False)
class _ModelCheck:
    """The model catalog check that runs apart from the requests: the one under way (set when
    it ends), and what the last one found (None: no problem; MODEL_CHECK_PENDING before the first)."""

    found: str | None = MODEL_CHECK_PENDING
    under_way: trio.Event | None = None


class _Missing(Exception):
    """A store file that is not there (after startup it always is)."""


@attrs.frozen(kw_only=True)
class Health:
    """What ``/healthz`` checks: the state directory, the two store files in it, and the model.

    ``model`` None skips the model probe. The file names are those the server opens. With
    ``background``, the model's catalog is asked there, one check at a time, so that it may take
    as long as a task's connection may and outlive the request that set it going: a request
    waits ``model_wait_s`` for it, then answers with what the last check found. Without it, the
    catalog is asked within the request, as the files are.
    """

    state_dir: Path
    model: ModelCatalog | None = None
    session_file: str = SESSIONS_FILE
    task_file: str = TASKS_FILE
    draining: Callable[[], bool] | None = None  # true once the server is shutting down
    # For each store file the server has open, by name, a blocking check that it is still the
    # file opened, and not found damaged (``SqlitePool.check_sound``): one removed or replaced
    # under it takes no writes.
    opened: Mapping[str, Callable[[], None]] = attrs.field(factory=dict)
    probe_timeout_s: float = attrs.field(default=DEFAULT_PROBE_TIMEOUT_S, validator=attrs.validators.gt(0))
    min_free_bytes: int = attrs.field(default=MIN_FREE_BYTES, validator=attrs.validators.ge(0))
    background: trio.Nursery | None = None
    model_wait_s: float = attrs.field(default=MODEL_WAIT_S, validator=attrs.validators.gt(0))
    _model_check: _ModelCheck = attrs.field(init=False, factory=_ModelCheck)
    # One worker thread per probe of a file at most: a check stuck on a stalled disk or on
    # another program's lock is abandoned, not stopped, and without these each poll would leave
    # one more thread waiting beside it, until Trio's shared threads (the model host's name
    # lookups wait for those) were all taken. A later poll waits for the stuck one instead.
    _threads: dict[str, trio.CapacityLimiter] = attrs.field(init=False, factory=dict)
    # The problems the last poll found: the log is told of one when it starts and when it ends,
    # not at every poll (a load balancer polling every few seconds would repeat it forever).
    _known: set[str] = attrs.field(init=False, factory=set)

    async def problems(self) -> list[str]:
        """Every problem found, in probe order; empty when ready.

        Blocks for at most ``probe_timeout_s`` (a probe that takes longer is itself a problem,
        and its worker thread is abandoned: it only reads, or removes its own file). Raises
        nothing but Cancelled.
        """
        if self.draining is not None and self.draining():
            return ["the server is shutting down: it takes no new tasks"]
        probes = self._probes()
        found: list[list[str]] = [[] for _ in probes]
        async with trio.open_nursery() as nursery:
            for index, (what, probe) in enumerate(probes):
                nursery.start_soon(self._run_probe, what, probe, found[index])
        problems = [problem for problems in found for problem in problems]
        for ended in sorted(self._known.difference(problems)):
            logger.info("readiness: resolved: %s", ended)
        self._known.clear()
        self._known.update(problems)
        return problems

    def _found(self, problem: str, line: str, *args: object, level: int = logging.WARNING, bug: bool = False) -> str:
        """``problem``, logged with ``line`` (and the traceback, for a ``bug``) if the last poll
        did not find it already."""
        if problem not in self._known:
            logger.log(level, line, *args, exc_info=bug)
        return problem

    def _probes(self) -> list[tuple[str, Callable[[], Awaitable[str | None]]]]:
        probes: list[tuple[str, Callable[[], Awaitable[str | None]]]] = [
            ("the state directory check", self._state_dir_problem),
            ("the session store check", lambda: self._store_problem("session store", self.session_file, SESSIONS_SCHEMA)),
            ("the task store check", lambda: self._store_problem("task store", self.task_file, TASKS_SCHEMA)),
        ]
        if self.model is not None:
            probes.append(("the model catalog check", self._model_problem))
        return probes

    async def _run_probe(self, what: str, probe: Callable[[], Awaitable[str | None]], into: list[str]) -> None:
        problem: str | None = None
        with trio.move_on_after(self.probe_timeout_s) as bound:
            try:
                problem = await probe()
            except Exception:  # a probe that breaks is a problem too; how it broke is for the log
                problem = self._found(f"{what} failed unexpectedly (the log says how)", "readiness: %s failed", what, bug=True)
        if bound.cancelled_caught:
            problem = self._found(
                f"{what} did not finish within {self.probe_timeout_s:g} s",
                "readiness: %s took longer than %g s", what, self.probe_timeout_s,
            )  # fmt: skip
        if problem is not None:
            into.append(problem)

    async def _state_dir_problem(self) -> str | None:
        try:
            free = await self._in_thread(_touch_and_measure, self.state_dir)
        except OSError as exc:  # a path is the machine's, not a client's
            if exc.errno in STARVED:
                return self._starved("the state directory", exc.errno)
            return self._found(
                "state directory is not writable (the server log names it)",
                "readiness: the state directory %s is not writable: %r", self.state_dir, exc,
            )  # fmt: skip
        if free < self.min_free_bytes:
            # An empty file can still be made on a full disk; a task or an answer cannot be stored.
            return self._found(
                f"state directory is {nearly_full(free, self.min_free_bytes)}",
                "readiness: the state directory %s has %d bytes free", self.state_dir, free,
            )  # fmt: skip
        return None

    async def _store_problem(self, label: str, name: str, schema: Schema) -> str | None:
        path = self.state_dir / name
        try:
            await self._in_thread(_inspect_existing, path, schema, self.opened.get(name))
        except _Missing:
            return f"{label} is not initialized: {name} is missing"
        except Exception as exc:  # SchemaError, sqlite3.Error, OSError: all mean "cannot use it"
            if isinstance(exc, OSError) and exc.errno in STARVED:  # ... but this one is the server's
                return self._starved(label, exc.errno)
            if isinstance(exc, DatabaseDamaged):  # found by a request, and logged then with what to do
                return f"{label} is damaged: {name} (the server log says what to do)"
            problem = f"{label} is not usable: {name} ({type(exc).__name__})"
            return self._found(problem, "readiness: %s %s is not usable: %r", label, path, exc)
        return None

    def _starved(self, what: str, code: int) -> str:
        """The problem of a probe that could not open a file for want of descriptors: the server's,
        not the file's."""
        reason = starved_reason(code, "this server")
        return self._found(f"{what} cannot be checked: {reason}", "readiness: %s cannot be checked: %s", what, reason)

    async def _in_thread(self, fn: Callable[[Path, *Ts], T], path: Path, *args: *Ts) -> T:
        """``fn(path, *args)`` in a worker thread, behind any earlier check of ``path`` still
        running; abandoned if cancelled (the probes only read, or remove their own file)."""
        threads = self._threads.setdefault(str(path), trio.CapacityLimiter(1))
        return await trio.to_thread.run_sync(fn, path, *args, limiter=threads, abandon_on_cancel=True)

    async def _model_problem(self) -> str | None:
        if self.background is None:
            return await self._catalog_problem()
        check = self._model_check
        if check.under_way is None:
            check.under_way = trio.Event()
            self.background.start_soon(self._check_model, check.under_way)
        with trio.move_on_after(self.model_wait_s):
            await check.under_way.wait()
        return check.found

    async def _check_model(self, ended: trio.Event) -> None:
        """One model catalog check, in the background: what it finds is kept for the requests."""
        found: str | None = MODEL_CHECK_PENDING
        try:
            with trio.move_on_after(MODEL_CHECK_MAX_S) as bound:
                found = await self._catalog_problem()
            if bound.cancelled_caught:
                found = self._found(
                    f"the model catalog check did not finish within {MODEL_CHECK_MAX_S:g} s",
                    "readiness: the model catalog check took longer than %g s", MODEL_CHECK_MAX_S,
                )  # fmt: skip
        except Exception:  # a probe that breaks is a problem too; how it broke is for the log
            found = self._found(
                "the model catalog check failed unexpectedly (the log says how)",
                "readiness: the model catalog check failed", bug=True,
            )  # fmt: skip
        finally:
            self._model_check.found = found
            self._model_check.under_way = None
            ended.set()

    async def _catalog_problem(self) -> str | None:
        assert self.model is not None, "only probed when configured"
        # Its address stays in the log and in `check`: to a client it is a connection string.
        name, endpoint = self.model.model, self.model.endpoint
        try:
            present = await self.model.has_model()
        except ModelError as exc:  # its detail may hold provider text: the log's alone
            said = f"; it said: {exc.detail}" if exc.detail else ""
            return self._found(
                f"model server unavailable: its catalog could not be read to find {name!r}: {exc.reason}",
                "readiness: the model server at %s: its catalog could not be read to find %r: %s%s",
                endpoint, name, exc.reason, said,
            )  # fmt: skip
        if present:
            return None
        problem = f"model unavailable: {name!r} is absent from the model server's catalog"
        if problem in self._known:  # logged as it began: the catalog is not read a second time at every poll
            return problem
        return self._found(
            problem,
            "readiness: model %r is absent from the catalog of the model server at %s%s", name, endpoint, await self._listed(),
        )  # fmt: skip

    async def _listed(self) -> str:
        """What the catalog lists, for the log line saying the model is not there: a server that
        answers with the one model it serves (llama.cpp's) is found under its name alone."""
        if not isinstance(self.model, ListsModels):
            return ""
        try:
            names = await self.model.list_models()
        except ModelError:  # read a moment ago; gone again, it is the next check's to say
            return ""
        if not names:
            return ", which lists no model"
        more = f" and {len(names) - LISTED_NAMES} more" if len(names) > LISTED_NAMES else ""
        return f", which lists {', '.join(map(repr, names[:LISTED_NAMES]))}{more}"


def _touch_and_measure(state_dir: Path) -> int:
    """Create and remove a file in ``state_dir``; return the bytes free there. Blocking."""
    fd, name = tempfile.mkstemp(prefix=".readiness-", dir=state_dir)
    os.close(fd)
    os.unlink(name)
    return free_bytes(state_dir)


def _inspect_existing(path: Path, schema: Schema, still_opened: Callable[[], None] | None) -> None:
    """``inspect`` passes an absent file (first boot); after startup an absent file is a fault,
    and so is one that is not the file the server has open (``still_opened`` raises)."""
    if not path.is_file():
        raise _Missing(path)
    if still_opened is not None:
        still_opened()
    _descriptors_free(path.parent)
    try:
        inspect(path, schema)
    except DatabaseFailed:
        # Descriptors another check held a moment ago (or a client's) may have been what SQLite
        # could not open: with as many free now, the file is tried once more, and its failure stands.
        _descriptors_free(path.parent)
        inspect(path, schema)


# What inspect's read-only connection opens: the database, its -wal and its -shm.
INSPECT_DESCRIPTORS = 3


def _descriptors_free(directory: Path) -> None:
    """Raise OSError (EMFILE) unless this process can open as many descriptors as ``inspect``
    needs: sqlite3 says only that it cannot open the file, and a process out of descriptors is
    told here. By opening the file's directory, never the file: closing a descriptor of the file
    would let go of every POSIX lock this process holds on it, the server's connection's among
    them, and the next process to close the database (a snapshot) would then take the -wal for
    unused and remove it while the server goes on writing there."""
    opened: list[int] = []
    try:
        for _ in range(INSPECT_DESCRIPTORS):
            opened.append(os.open(directory, os.O_RDONLY | os.O_DIRECTORY))
    finally:
        for fd in opened:
            os.close(fd)
