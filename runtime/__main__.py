"""The command line: ``python -m runtime <command> ...``."""

from __future__ import annotations

import argparse
import codecs
import io
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

# Each command module exposes ``add_parser(subparsers)``; each command's parser sets ``func``
# to a callable taking the parsed namespace and returning an exit code, and ``parser`` to itself.
# A command that watches for SIGINT and SIGTERM itself also sets ``takes_held_signals`` (below).
COMMAND_MODULES: tuple[str, ...] = ("runtime.serve_cli", "runtime.state_cli")

# Held (blocked, so kept pending rather than lost) while the commands load, most of a second: a
# Ctrl-C then would end in a KeyboardInterrupt traceback, and a SIGTERM would kill the process
# without a word. `serve` lets them in once it watches for them, so one that came meanwhile ends
# the start as one a moment later does; the other commands let them in as they begin.
HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
INTERRUPTED_EXIT = 128 + signal.SIGINT  # what a shell reports for a command Ctrl-C ended


class _ExactParser(argparse.ArgumentParser):
    """A parser that takes a flag only as written in full: with argparse's default, ``--state``
    is taken for ``--state-dir``, and a script written so would change meaning the day another
    flag begins the same way. Its commands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})


def build_parser(prog: str = "python -m runtime") -> argparse.ArgumentParser:
    import importlib

    from runtime.agents import app_version

    parser = _ExactParser(prog=prog, description="Keel, a durable A2A agent runtime.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {app_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def _heed_held_signals() -> None:
    """For a command that watches for SIGINT and SIGTERM itself: handled as from a terminal though
    this process was started with them ignored (by a script with no job control, for a command it
    runs in the background), as the command will handle them once it watches. Meanwhile an
    ignored SIGINT held pending would be lost: Trio's event loop, setting up, sets SIGINT's
    handler to what it was, and setting a signal's handler to ignored drops it if pending."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _as_the_file_system_spells_it(exc: UnicodeError) -> tuple[str | bytes, int]:
    """A name that is not UTF-8 (a file's, held as surrogates) as its own bytes, as ``ls`` writes
    it; any other character the encoding lacks escaped (``\\xe9``)."""
    try:
        return codecs.lookup_error("surrogateescape")(exc)
    except UnicodeError:
        return codecs.backslashreplace_errors(exc)


STDOUT_ERRORS = "keel.stdout"
codecs.register_error(STDOUT_ERRORS, _as_the_file_system_spells_it)


def _spell_what_stdout_cannot() -> bool:
    """Have a strict stdout write what its encoding cannot (a state directory's name that is not
    UTF-8, under PYTHONIOENCODING=utf-8 or a UTF-8 locale; an accent under ASCII), rather than fail
    the command with a traceback as it prints the path, or the line saying where serve serves.
    Whether it did, for ``main`` to make it strict again."""
    if not isinstance(sys.stdout, io.TextIOWrapper) or sys.stdout.errors != "strict":
        return False
    sys.stdout.reconfigure(errors=STDOUT_ERRORS)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    handlers = {signum: signal.getsignal(signum) for signum in HELD_SIGNALS}
    spelling = _spell_what_stdout_cannot()
    try:
        started_as = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        # The installed ``keel`` command names itself so; ``python -m runtime`` runs __main__.py.
        parser = build_parser(started_as if argv is None and started_as not in ("", "__main__.py") else "python -m runtime")
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said by the command's own parser (its ``parser`` default), with its usage
            command: argparse.ArgumentParser = getattr(args, "parser", parser)
            command.error(f"unrecognized arguments: {' '.join(unknown)}")
        if getattr(args, "takes_held_signals", False):
            _heed_held_signals()
        else:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except KeyboardInterrupt:  # a Ctrl-C no command watches for
        print("error: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    finally:  # as it was, for a caller that goes on (and for the processes it starts)
        for signum, handler in handlers.items():
            if handler is not None and signal.getsignal(signum) != handler:
                signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if spelling and isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout.reconfigure(errors="strict")


if __name__ == "__main__":
    sys.exit(main())
