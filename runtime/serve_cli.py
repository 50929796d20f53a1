"""``python -m runtime serve`` and ``python -m runtime check``: the edge where Config is built."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import logging
import os
import queue
import resource
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

import attrs
import trio

from persistence.errors import StoreError
from runtime.config import (
    BACKUP_ROOT_ENV,
    SETTINGS,
    Config,
    ConfigError,
    backup_root,
    foreign_settings,
    ignored,
    os_error_text,
    preflight,
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve the agent over A2A until SIGTERM or SIGINT",
        description="Serve the agent over A2A (JSON-RPC, protocol 1.0 and 0.3). Each flag overrides its "
        "environment variable. SIGTERM or SIGINT: stop accepting, let runs finish for the drain "
        "timeout, cancel the rest, exit 0; a second signal cancels the runs at once (their clients "
        "still answered), a third stops at once.",
    )
    _add_setting_flags(serve)
    serve.set_defaults(func=_serve, parser=serve, takes_held_signals=True)  # see _watch_signals
    check = subparsers.add_parser(
        "check",
        help="validate the configuration and print every problem at once (exit 1 if any)",
        description="Validate the configuration as serve would take it, trying what only trying tells (the "
        "host and port, the state directory), and print every problem at once (exit 1), or every setting (exit 0).",
    )
    _add_setting_flags(check)
    check.epilog = (
        f"{check.epilog} It checks {BACKUP_ROOT_ENV} too, as state snapshot takes it (where snapshots go; default:"
        " beside the state directory, named after it with -backups)."
    )
    check.set_defaults(func=_check, parser=check)


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    defaults = {field.name: field.default for field in attrs.fields(Config)}
    for setting in SETTINGS:
        if setting.flag is not None:
            shown = f"{setting.help} ({_shown_default(defaults[setting.field])}${setting.env})"
            parser.add_argument(setting.flag, dest=setting.field, metavar="VALUE", help=shown)
    only = [f"{setting.env}, {setting.help}" for setting in SETTINGS if setting.flag is None]
    parser.epilog = f"Set in the environment only: {'; '.join(only)}."


def _shown_default(default: object) -> str:
    return "" if default is None else f"default {_as_written(default)}; "


def _as_written(value: object) -> str:
    """A setting's value as the README and ``--help`` write it: 10 for a float 10.0."""
    if isinstance(value, float) and float(f"{value:g}") == value:
        return f"{value:g}"
    return str(value)


def _load(args: argparse.Namespace, *, probe: bool = False) -> Config:
    flags = {s.field: getattr(args, s.field, None) for s in SETTINGS if s.flag is not None}
    return Config.load(os.environ, flags, probe=probe)


NOT_SET = "(not set)"


def _check(args: argparse.Namespace) -> int:
    """Every setting as serve would take it, tried where only trying tells (the host, the state
    directory), and AGENT_BACKUP_ROOT as `state snapshot` would take it; each printed, a value
    not set as (not set), with a note for each database serve would bring up to date (an older
    build cannot open it after that), or every problem on stderr and exit 1."""
    problems: list[str] = []
    config: Config | None = None
    try:
        config = _load(args, probe=True)
    except ConfigError as exc:
        problems.extend(exc.problems)
    try:
        backups = backup_root(os.environ, None if config is None else config.state_dir)
    except ValueError as exc:
        problems.append(f"{BACKUP_ROOT_ENV}={os.environ.get(BACKUP_ROOT_ENV)!r} is not valid: {exc}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if too_few := _too_few_files(soft if hard == resource.RLIM_INFINITY else hard):  # the limit serve takes
        problems.append(too_few)
    older: list[str] = []
    if config is not None and not problems:
        try:
            older = preflight(config.state_dir)  # as the probe read it: which databases serve will change
        except StoreError as exc:  # changed since
            problems.append(str(exc))
        except ExceptionGroup as group:  # both databases, changed since
            problems.extend(map(str, group.exceptions))
    if problems or config is None:
        print(f"error: {ConfigError(problems)}", file=sys.stderr)
        return 1
    lines = []
    for setting in SETTINGS:
        value = getattr(config, setting.field)
        if value is None:
            shown = NOT_SET
        else:
            shown = "(set)" if setting.secret else setting.show(_as_written(value))
        lines.append(f"{setting.env}={shown}")
    lines.append(f"{BACKUP_ROOT_ENV}={backups}")
    lines.extend(f"note: {line} (take a state snapshot first to keep a way back)" for line in older)
    lines.extend(f"note: {ignored(name)}" for name in foreign_settings(os.environ))
    try:
        print("\n".join([*lines, "configuration ok"]), flush=True)
    except OSError as exc:  # a full disk, a reader that has gone
        _drop_stdout()
        print(f"error: the settings could not be written: {os_error_text(exc)}", file=sys.stderr)
        return 1
    return 0


def serve_with(argv: Sequence[str], **options: Any) -> int:
    """``python -m runtime serve ARGV``, with ``options`` handed to ``runtime.server.serve`` (an
    in-process model, say: scripts/bench/keel_instant.py). Returns the exit status."""
    parser = argparse.ArgumentParser(prog="serve", allow_abbrev=False)
    _add_setting_flags(parser)
    return _serve(parser.parse_args(argv), **options)


def _serve(args: argparse.Namespace, **options: Any) -> int:
    try:
        config = _load(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _take_file_limit()
    if too_few := _too_few_files(resource.getrlimit(resource.RLIMIT_NOFILE)[0]):
        print(f"error: {too_few}", file=sys.stderr)
        return 1
    handler = LogHandler()
    handler.setFormatter(LogFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    for chatty in ("httpx", "httpcore"):  # a line per model request is noise, and costs CPU
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if foreign := foreign_settings(os.environ):
        logging.getLogger(__name__).warning("ignoring %s: not settings Keel knows, nor like one", ", ".join(foreign))
    failures: list[BaseException] = []
    try:
        trio.run(functools.partial(_main, config, **options))
    except* (StoreError, OSError) as group:  # startup refused: say why, no traceback
        failures.extend(_leaves(group))
    finally:
        handler.close()  # the log's last lines, before what is said of the failures
    for failure in failures:
        print(f"error: {os_error_text(failure) if isinstance(failure, OSError) else failure}", file=sys.stderr)
    return 1 if failures else 0


def _take_file_limit() -> None:
    """Raise the soft limit on open files to the hard one, as Go programs do as they start. Each
    client and each model connection holds a descriptor, and a shell's usual soft limit is 1024;
    the hard limit is what the operator allows (`ulimit -Hn`). Where the kernel will not take it
    (a hard limit of unlimited, say), the soft limit stays as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# Fewer open files than this, and serve's start would fail where it ran out of them (saying that a
# database failed, or that the address cannot be listened on), or it could serve hardly anyone.
MIN_FILE_LIMIT = 32


def _too_few_files(limit: int) -> str | None:
    """The problem of a limit on open files too low to serve with, if ``limit`` is one."""
    if limit == resource.RLIM_INFINITY or limit >= MIN_FILE_LIMIT:
        return None
    return (
        f"serve may have at most {limit} files open (ulimit -n), and needs {MIN_FILE_LIMIT}: it holds about 20 of"
        " its own, and one more for each client connection and each model connection; raise the limit"
    )


# Line breaks and terminal controls, spelled as Python spells them (\n, \x1b, \u2028). A log line names
# ids and text a client chose (a contextId, say), which must not start a line of their own, forging
# the server's, nor drive the terminal an operator reads the log on.
_CONTROLS = {code: repr(chr(code))[1:-1] for code in (*range(0x09), *range(0x0A, 0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029)}


class LogFormatter(logging.Formatter):
    """Each record on one line, its line breaks and terminal controls escaped; a traceback keeps
    its own lines, the controls inside them escaped. Its time is RFC 3339 in UTC, as a task's
    status time is, whatever the machine's time zone (a local time without its offset could not
    be told apart from one an hour away, and repeats itself when summer time ends)."""

    converter = staticmethod(time.gmtime)
    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(_CONTROLS)

    def formatException(self, ei: Any) -> str:
        return _escape_lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _escape_lines(super().formatStack(stack_info))


LOG_LINES_HELD = 10_000  # lines waiting for a log reader that has stalled; past them, lines are dropped
LOG_DRAIN_S = 1.0  # as the process ends, how long the lines still waiting may take to be written


class LogHandler(logging.StreamHandler["_LineWriter"]):
    """Log lines to stderr, written by a thread of their own (see _LineWriter). Closed (as the
    process ends, by ``_serve`` or ``logging.shutdown()``), it gives the lines still waiting
    LOG_DRAIN_S to be written."""

    def __init__(self) -> None:
        super().__init__(_LineWriter(sys.stderr))

    def close(self) -> None:
        self.stream.close_within(LOG_DRAIN_S)
        super().close()


class _LineWriter:
    """A text stream that a thread of its own writes to ``stream``. A log reader that stalls (it
    has stopped reading a pipe, which fills up) holds that thread alone: never the event loop, so
    the server goes on serving, and takes SIGTERM and SIGINT. Past LOG_LINES_HELD lines waiting,
    the lines are dropped, and how many is said where they would have been, once the reader takes
    lines again."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream  # None: started with stderr closed (`serve 2>&-`), where nothing is written
        self._lines: queue.Queue[str | None] = queue.Queue(LOG_LINES_HELD)
        self._lock = threading.Lock()
        self._dropped = 0  # since the last line taken
        self._closed = False
        self._thread = threading.Thread(target=self._write_lines, name="log writer", daemon=True)
        self._thread.start()

    def write(self, text: str) -> None:
        if self._closed:  # the process is ending: written here
            self._write(text)
            return
        with self._lock:
            try:  # the count of the lines dropped before it goes with it: in the log, it stands in their place
                self._lines.put_nowait(self._said_dropped() + text)
            except queue.Full:
                self._dropped += 1
            else:
                self._dropped = 0

    def flush(self) -> None:
        """Nothing to do: the thread flushes each line it writes."""

    def close_within(self, timeout_s: float) -> None:
        """Take no more lines, and give those waiting ``timeout_s`` to be written (and the count
        of those dropped last). Blocking."""
        if not self._closed:
            self._closed = True
            with self._lock:
                last = [self._said_dropped(), None] if self._dropped else [None]
            deadline = time.monotonic() + timeout_s
            with contextlib.suppress(queue.Full):
                for item in last:
                    self._lines.put(item, timeout=max(0.0, deadline - time.monotonic()))
            self._thread.join(timeout_s)

    def _said_dropped(self) -> str:
        return f"{self._dropped} log line(s) dropped while the log's reader took none\n" if self._dropped else ""

    def _write_lines(self) -> None:
        while (text := self._lines.get()) is not None:
            self._write(text)

    def _write(self, text: str) -> None:
        if self._stream is None:
            return
        with contextlib.suppress(OSError, ValueError):  # a reader that has gone, or stderr closed
            self._stream.write(text)
            self._stream.flush()


def _escape_lines(text: str) -> str:
    return "\n".join(line.translate(_CONTROLS) for line in text.split("\n"))


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions in a group, however deep the nurseries nested them."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


async def _main(config: Config, **options: Any) -> None:
    shutdown, hurry, serving, stopped = trio.Event(), trio.Event(), trio.Event(), trio.Event()
    # What a signal cancels: the server, not the watcher, which takes the signals that come while
    # the server stops (a step under way, such as a database read, finishes first).
    server = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, shutdown, hurry, server, serving, stopped)
        try:
            with server:
                # Imported here, once signals are watched (a Ctrl-C while it loads ends the start
                # without a traceback); and `check` must work without the server's imports.
                from runtime.server import serve

                async with trio.open_nursery() as serving_in:
                    started = await serving_in.start(functools.partial(serve, config, shutdown, hurry=hurry, **options))
                    serving.set()
                    _tune_collector()
                    _announce(f"keel serving A2A at {started.url} (state in {config.state_dir})")
        finally:
            stopped.set()
            nursery.cancel_scope.cancel()  # the signal watcher is all that is left


def _announce(line: str) -> None:
    """Print ``line`` on stdout. The server serves whether or not it can (a reader that has gone,
    a full disk, none at all): stdout carries this line alone, and the log says where it serves too."""
    cannot = "standard output cannot be written (%s); %s all the same"
    if sys.stdout is None:  # started with it closed (`serve >&-`): print would drop the line unsaid
        logging.getLogger(__name__).warning(cannot, "it is closed", line)
        return
    try:  # in one write: under PYTHONUNBUFFERED, print's line and its end go out apart, a log line between
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except OSError as exc:
        logging.getLogger(__name__).warning(cannot, os_error_text(exc), line)
        _drop_stdout()


def _drop_stdout() -> None:
    """Send what stdout still holds in its buffer nowhere, after a write to it failed, rather
    than fail again (with a traceback) as the process exits."""
    with contextlib.suppress(OSError, ValueError):  # a stdout with no descriptor has nothing to redirect
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


GC_YOUNG_THRESHOLD = 10_000  # allocations between young collections (CPython's default: 700)


def _tune_collector() -> None:
    """Once the server is up. What the process made to start (its imports, the app, the stores)
    lives as long as the process: frozen, it is left out of the collector's full passes, which
    otherwise walk it all again, 35-50 ms each under load, a pause that every request in flight
    waits out. A request makes thousands of short-lived objects; with the young generation
    collected every 10 000 allocations rather than 700, most are gone before a pass looks at
    them. Measured in scripts/bench/a2a.py's Keel process: a full pass went from 36 ms to 3.5 ms
    (median), the collector's time over the run from about 1 s to 0.1 s."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)


# After a third signal, how long the server may take to stop once cancelled before the process
# exits without it: only a write to a client that has stopped reading takes longer (hypercorn's
# writes are shielded from cancellation), and the third signal is not to wait for that.
HARD_STOP_S = 1.0
HARD_STOP_EXIT = 1


async def _watch_signals(
    shutdown: trio.Event,
    hurry: trio.Event,
    scope: trio.CancelScope,
    serving: trio.Event,
    stopped: trio.Event,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Before the server serves, SIGTERM or SIGINT ends the start at once (each one, until the step
    under way has let go: the signals that come meanwhile are taken too). Then the first starts
    a graceful shutdown; a second cancels the runs at once (their clients are still answered);
    a third stops at once: the server is cancelled, and if it has not stopped within
    HARD_STOP_S, held by a client that takes nothing, the process exits without it, as after
    a crash (every state written is durable; the next process resumes the rest). Started once
    it watches: the signals the command line held while it loaded (runtime.__main__) are let
    in then, so one that came meanwhile is taken as the first."""
    log = logging.getLogger(__name__)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if not serving.is_set():
                log.warning("%s before the server was serving: not starting", name)
                scope.cancel()
            elif hurry.is_set():
                log.warning("third %s: stopping now", name)
                scope.cancel()
                with trio.move_on_after(HARD_STOP_S, shield=True):
                    await stopped.wait()
                if not stopped.is_set():
                    log.error("the server did not stop within %g s (a client that takes nothing): exiting without it", HARD_STOP_S)
                    logging.shutdown()
                    sys.stdout.flush()
                    os._exit(HARD_STOP_EXIT)
            elif shutdown.is_set():
                log.warning("second %s: canceling the runs now; a third stops at once", name)
                hurry.set()
            shutdown.set()
