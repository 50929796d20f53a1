"""The root nursery and its startup order (DESIGN.md, "One process, one nursery").

1. recovery of an interrupted restore (a state it cannot account for stops everything);
2. the state directory, created only now, and held so that no restore runs under us and no
   other server serves it;
3. preflight, read-only: databases this build cannot use are refused before anything is written;
   and the listening address is taken (bound and listened on; a connection waits in the backlog
   until step 7 serves it), so that one in use stops the start before a task a dead process left
   is taken up;
4. (the dataset step arrives with the incident agent);
5. the session and task stores, migrated, with their group-commit writers in this nursery;
6. the runner, which adopts what a dead process left running;
7. the A2A surface on hypercorn (runtime.http_server); /healthz answers ready only from here on.

Shutdown (``shutdown`` set, e.g. by SIGTERM): refuse new tasks and answer /healthz unready, give
runs ``drain_timeout_s`` to finish, cancel the rest (each writes its terminal state), then close
HTTP and the stores. ``hurry`` set (the CLI's answer to a second signal) ends the drain at once:
the runs left are cancelled, and the clients waiting on them answered, before HTTP closes.
Cancelled instead (a third signal), the runs are cut short at once and still write their
terminal states: the stores' writers are shielded from the cancellation and close only after
the runner has stopped, each wait bounded.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import resource
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol

import attrs
import hypercorn
import trio
from hypercorn.config import Sockets
from hypercorn.utils import repr_socket_addr

from persistence.databases import SESSIONS_FILE, TASKS_FILE
from persistence.recovery import HeldStateDir, hold_state_dir
from persistence.sessions import SqliteSessionStore
from persistence.statelocks import acquire_serving, release_use
from persistence.tasks import SqliteTaskStore
from runtime.agent import AgentSpec, Model
from runtime.agents import agent_card, app_version, default_agent
from runtime.config import Config, preflight
from runtime.http_server import OneLine, serve_http
from runtime.models import ModelConfig, open_model_client
from runtime.runner import Runner, RunnerConfig
from runtime.starved import model_connections_allowed
from runtime.surface import Health, Readiness, SurfaceConfig, create_app
from runtime.surface.health import ModelCatalog

logger = logging.getLogger(__name__)

HTTP_GRACE_S = 2.0
# How long readiness waits for the model server's catalog once connected (a list, read at once).
PROBE_READ_TIMEOUT_S = 5.0
ONE_LINE = OneLine()


@attrs.frozen
class Started:
    """What ``serve`` reports once it answers: where it listens."""

    binds: tuple[str, ...]

    @property
    def url(self) -> str:
        return self.binds[0] + "/"


async def serve(
    config: Config,
    shutdown: trio.Event,
    *,
    hurry: trio.Event | None = None,
    agent: AgentSpec | None = None,
    model: InProcessModel | None = None,
    task_status: trio.TaskStatus[Started] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run Keel until ``shutdown`` is set, then drain and return; ``hurry``, set during the
    drain, ends it at once (the runs left are cancelled, and their clients answered).

    The model is the OpenAI-compatible server ``config`` names, unless ``model`` is given: an
    in-process model (the benchmarks' zero-latency one) that also answers the readiness probe.

    Raises RecoveryError, UnusableStateDir, StateBusy, a StoreError (SchemaError, DatabaseBusy...)
    or an OSError (the address cannot be listened on) before anything is served when the state
    directory or the address cannot be used; the CLI turns those into a message and a non-zero exit.
    """
    agent = agent or default_agent(max_model_calls=config.max_model_calls)
    held = await _hold_state_dir(config.state_dir)  # steps 1 and 2
    logger.info("state %s: %s", config.state_dir, held.outcome)
    try:
        serving = await trio.to_thread.run_sync(acquire_serving, config.state_dir)  # the only server
        try:
            older = await trio.to_thread.run_sync(preflight, config.state_dir)  # step 3
            await trio.to_thread.run_sync(app_version)  # read from disk once, for the agent card
            http_config = _http_config(config)
            await trio.to_thread.run_sync(http_config.take_address)  # a host name may be looked up
            for line in older:  # opened next
                logger.info("state %s: %s", config.state_dir, line)
            try:
                async with trio.open_nursery() as nursery:
                    await _serve_in(nursery, config, http_config, agent, model, shutdown, hurry, task_status)
            finally:
                http_config.release_address()
        finally:
            release_use(serving)
    finally:
        held.release()


async def _hold_state_dir(state_dir: Path) -> HeldStateDir:
    """hold_state_dir, which may wait for a snapshot or a restore to finish. Cancelled meanwhile
    (a signal), it returns at once, and the hold the thread takes after is let go at once."""
    lock = threading.Lock()
    taken: list[HeldStateDir] = []
    given_up = False

    def hold() -> None:
        held = hold_state_dir(state_dir)
        with lock:
            if given_up:
                held.release()
            else:
                taken.append(held)

    try:
        await trio.to_thread.run_sync(hold, abandon_on_cancel=True)
    except BaseException:
        with lock:
            given_up = True
            for held in taken:  # taken, but its return not waited for
                held.release()
        raise
    return taken[0]


class InProcessModel(Model, ModelCatalog, Protocol):
    """A model that runs in this process: it streams answers and answers the catalog probe."""


async def _serve_in(
    nursery: trio.Nursery,
    config: Config,
    http_config: _HttpConfig,
    agent: AgentSpec,
    in_process: InProcessModel | None,
    shutdown: trio.Event,
    hurry: trio.Event | None,
    task_status: trio.TaskStatus[Started],
) -> None:
    state_dir = config.state_dir
    sessions = await SqliteSessionStore.open(state_dir / SESSIONS_FILE)  # step 5
    try:
        tasks = await SqliteTaskStore.open(state_dir / TASKS_FILE)
    except BaseException:
        with trio.move_on_after(config.cleanup_timeout_s, shield=True):
            await sessions.aclose()
        raise
    writers: list[trio.CancelScope] = []
    runner: Runner | None = None
    started = trio.Event()  # the server answers
    try:
        await nursery.start(_outliving_cancellation, sessions, writers)
        await nursery.start(_outliving_cancellation, tasks, writers)
        async with _model_clients(config, in_process) as (model, catalog):
            runner_config = RunnerConfig(
                orphans=config.orphans, drain_timeout_s=config.drain_timeout_s, cleanup_timeout_s=config.cleanup_timeout_s,
                model_endpoint=catalog.endpoint,
            )
            runner = await nursery.start(Runner(sessions, tasks, model, agent, runner_config, catalog=catalog).run)  # step 6
            try:
                await _serve_http(
                    nursery, config, http_config, runner, (sessions, tasks), catalog, shutdown, hurry, started, task_status
                )
            except BaseException:
                if not started.is_set():  # what the runner took up is left as it was, for the next process
                    runner.abandon()
                raise
    finally:
        # Cancelled (a third SIGTERM), the runs are cut short at once, but each still records
        # its end: the stores' writers stay up until the runner has stopped, then close.
        if runner is not None:
            with trio.move_on_after(config.cleanup_timeout_s, shield=True):
                await runner.wait_stopped()
        for store in (tasks, sessions):  # each with a bound of its own: one slow to close leaves the other its time
            with trio.move_on_after(config.cleanup_timeout_s, shield=True):
                await store.aclose()
        for scope in writers:  # what the bound left running
            scope.cancel()


async def _outliving_cancellation(
    store: SqliteSessionStore | SqliteTaskStore, scopes: list[trio.CancelScope], *, task_status: trio.TaskStatus[object]
) -> None:
    """Run ``store``'s writer shielded from the server's cancellation: it stops when the store
    is closed, or when its scope (added to ``scopes``) is cancelled."""
    with trio.CancelScope(shield=True) as scope:
        scopes.append(scope)
        await store.run(task_status=task_status)


async def _serve_http(
    nursery: trio.Nursery,
    config: Config,
    http_config: _HttpConfig,
    runner: Runner,
    stores: tuple[SqliteSessionStore, SqliteTaskStore],
    catalog: ModelCatalog,
    shutdown: trio.Event,
    hurry: trio.Event | None,
    started: trio.Event,
    task_status: trio.TaskStatus[Started],
) -> None:
    """Step 7: the A2A surface on hypercorn, until the drain is over and HTTP has closed."""
    sessions, tasks = stores
    readiness = Readiness()
    # The model catalog checks /healthz sets going run here, over when HTTP is (the catalog
    # client closes after).
    async with trio.open_nursery() as checks:
        if config.model_check == "off":
            logger.info("AGENT_MODEL_CHECK=off: /healthz does not check that the model server offers %r", config.model)
        health = Health(
            state_dir=config.state_dir, model=catalog if config.model_check == "catalog" else None,
            session_file=SESSIONS_FILE, task_file=TASKS_FILE, draining=runner.stopping,
            background=checks, opened={SESSIONS_FILE: sessions.pool.check_sound, TASKS_FILE: tasks.pool.check_sound},
        )  # fmt: skip
        http_done = trio.Event()

        async def drain_then_close_http() -> None:
            # New tasks are refused from the signal on, and /healthz says unready so that a
            # load balancer moves away; the rest of the protocol keeps answering while runs
            # finish (a client can still follow, get or cancel its task). Once every run has
            # settled, HTTP closes, with a short grace for the requests still in flight.
            await shutdown.wait()
            running = runner.statistics().running
            drain = f"{running} task(s) running have {config.drain_timeout_s:g} s to finish" if running else "no task is running"
            logger.info("shutting down: no new tasks; %s", drain)
            runner.stop()
            async with trio.open_nursery() as watching:  # this trigger's own, over when the drain is
                if hurry is not None:
                    watching.start_soon(_hurry_when, hurry, runner)
                await runner.wait_stopped()
                watching.cancel_scope.cancel()

        async def http(*, task_status: trio.TaskStatus[list[str]]) -> None:
            try:
                await serve_http(
                    create_app(
                        runner=runner, card_for=agent_card, health=health, readiness=readiness,
                        config=SurfaceConfig(public_url=config.public_url),
                    ),  # fmt: skip
                    http_config,
                    shutdown_trigger=drain_then_close_http,
                    task_status=task_status,
                )
            finally:
                http_done.set()

        binds = await nursery.start(http)  # step 7
        readiness.set()
        started.set()
        task_status.started(Started(binds=tuple(binds)))
        await http_done.wait()
        runner.stop()
        await runner.wait_stopped()
        checks.cancel_scope.cancel()


async def _hurry_when(hurry: trio.Event, runner: Runner) -> None:
    await hurry.wait()
    runner.hurry()


@asynccontextmanager
async def _model_clients(config: Config, in_process: InProcessModel | None) -> AsyncIterator[tuple[Model, ModelCatalog]]:
    """The model the runs call, and the one readiness asks for its catalog."""
    if in_process is not None:
        yield in_process, in_process
        return
    file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    max_connections = model_connections_allowed(config.max_model_connections, file_limit)
    if max_connections < config.max_model_connections:
        logger.warning(
            "at most %d model connections, not AGENT_MAX_MODEL_CONNECTIONS=%d: this process may have %d files open"
            " (ulimit -n), and a model server that stalls must leave the clients as many; raise the limit for more",
            max_connections, config.max_model_connections, file_limit,
        )  # fmt: skip
    model_config = ModelConfig(
        base_url=config.model_base_url, model=config.model, api_key=config.model_api_key,
        max_connections=max_connections, read_timeout_s=config.model_timeout_s,
        connect_timeout_s=config.model_connect_timeout_s,
    )  # fmt: skip
    # Readiness asks the catalog once, not again with backoff, and with a task's connect timeout:
    # a model server that tasks reach is not called unreachable. A request for /healthz does not
    # wait for that (surface.health.MODEL_WAIT_S). A resumed run waiting for its model asks it too.
    probe_config = attrs.evolve(model_config, max_retries=0, read_timeout_s=PROBE_READ_TIMEOUT_S)
    logger.info("model %r at %s", model_config.model, model_config.endpoint)
    async with open_model_client(model_config) as model, open_model_client(probe_config) as catalog:
        yield model, catalog


_LISTEN_HINTS = {
    errno.EADDRINUSE: "another process listens there: choose another --port (AGENT_PORT), or 0 for any free one",
    errno.EADDRNOTAVAIL: "this machine has no such address: choose another --host (AGENT_HOST)",
    errno.EACCES: "this user may not listen there (ports below 1024 need privileges): choose another --port (AGENT_PORT)",
}


class _HttpConfig(hypercorn.Config):
    """hypercorn's settings, and one it lacks: a client that takes none of what it is sent for
    ``send_timeout_s`` loses its connection.

    hypercorn writes to a client shielded from cancellation and with no time limit, so a client
    that stops reading a stream, once the sockets' buffers are full, would hold its request, and
    a shutdown waiting for that request, for as long as it stays connected. TCP_USER_TIMEOUT, set
    on the listening socket and inherited by every connection accepted from it, has the kernel
    close a connection whose data has gone unacknowledged (or whose receive window has stayed
    shut) that long; the blocked write then fails and hypercorn ends the request. A client that
    reads slowly but reads is unaffected, and so is an idle keep-alive connection.

    An address it cannot listen on is an OSError naming the address and what to change. It is
    taken early (``take_address``), before anything is started that a failed start would undo.
    """

    _taken: Sockets | None = None

    send_timeout_s: float = 30.0

    def take_address(self) -> None:
        """Bind and listen now: an address another process holds, even one still starting (a
        bound socket alone does not tell, with SO_REUSEADDR), is refused here. Connections made
        before hypercorn serves wait in the backlog."""
        sockets = self._new_sockets()
        self._taken = sockets
        try:
            for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
                sock.listen(self.backlog)
        except OSError as exc:
            self.release_address()
            raise self._cannot_listen(exc) from exc
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
            _warn_if_beyond_this_machine(sock)

    def release_address(self) -> None:
        """Close the sockets taken and never handed to hypercorn (a start that failed)."""
        sockets, self._taken = self._taken, None
        if sockets is not None:
            for sock in (*sockets.secure_sockets, *sockets.insecure_sockets, *sockets.quic_sockets):
                sock.close()

    def create_sockets(self) -> Sockets:
        sockets, self._taken = self._taken, None
        return sockets if sockets is not None else self._new_sockets()

    def _new_sockets(self) -> Sockets:
        try:
            sockets = super().create_sockets()
        except OSError as exc:
            raise self._cannot_listen(exc) from exc
        if not hasattr(socket, "TCP_USER_TIMEOUT"):
            logger.warning("this platform has no TCP_USER_TIMEOUT: a client that stops reading keeps its connection")
            return sockets
        milliseconds = max(1, round(min(self.send_timeout_s * 1000, 2**31 - 1)))  # what the option holds
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)
        return sockets

    def _cannot_listen(self, exc: OSError) -> OSError:
        hint = _LISTEN_HINTS.get(exc.errno or 0, "check --host (AGENT_HOST) and --port (AGENT_PORT)")
        return OSError(f"cannot listen on {', '.join(self.bind)}: {exc.strerror or exc}; {hint}")


def _warn_if_beyond_this_machine(sock: socket.socket) -> None:
    """Keel authenticates no client: on an address other than loopback, whoever reaches it may
    read, steer and cancel every task. Said once, as the server takes the address."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    address = ipaddress.ip_address(sock.getsockname()[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    if address.is_loopback or (mapped is not None and mapped.is_loopback):
        return
    logger.warning(
        "listening on %s, beyond this machine: clients are not authenticated, so whoever reaches it may read, steer and"
        " cancel every task; serve others through a proxy that authenticates them, or listen on 127.0.0.1",
        repr_socket_addr(sock.family, sock.getsockname()),
    )


def _http_config(config: Config) -> _HttpConfig:
    http = _HttpConfig()
    http.send_timeout_s = config.send_timeout_s
    http.keep_alive_timeout = config.keep_alive_s  # a connection that has not sent its first request too
    http.bind = [f"{config.host}:{config.port}"]
    http.accesslog = None
    # Through our logging, printed once, under a name of Keel's: hypercorn's own, hypercorn.error,
    # puts "error" on its every line, "Running on ..." included, for a log search to find.
    errorlog = logging.getLogger("runtime.http")
    errorlog.addFilter(ONE_LINE)  # a request hypercorn failed on is no traceback in the log
    http.errorlog = errorlog
    # By the time HTTP closes every run has settled and its streams have had their last event;
    # what is left are short requests and idle keep-alive connections.
    http.graceful_timeout = HTTP_GRACE_S
    return http

