"""The command line: ``python -m runtime <command> ...``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

# Each command module exposes ``add_parser(subparsers)``; each command's parser sets ``func``
# to a callable taking the parsed namespace and returning an exit code, and ``parser`` to itself.
COMMAND_MODULES: tuple[str, ...] = ("runtime.serve_cli", "runtime.state_cli")


def build_parser(prog: str = "python -m runtime") -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog=prog, description="Keel, a durable A2A agent runtime.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    started_as = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    # The installed ``keel`` command names itself so; ``python -m runtime`` runs __main__.py.
    parser = build_parser(started_as if argv is None and started_as not in ("", "__main__.py") else "python -m runtime")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser (its ``parser`` default), with its usage
        command: argparse.ArgumentParser = getattr(args, "parser", parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
