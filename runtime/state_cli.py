"""``python -m runtime state snapshot|restore|recover|reset``: the state directory's operator commands.

This is the edge: it reads ``AGENT_STATE_DIR`` and ``AGENT_BACKUP_ROOT`` and passes plain paths
down to persistence. Every failure prints ``error: <message>`` on stderr and exits 1. An unknown
``AGENT_*`` variable is refused before anything is done, as ``serve`` refuses it: a mistyped
``AGENT_STATE_DIR`` would otherwise have the command act on ``.state`` in the current directory.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from persistence.recovery import RecoveryAction, recover
from persistence.restore import reset_state, restore_snapshot
from persistence.snapshot import create_snapshot
from persistence.statedir import StateError, UnusableStateDir, is_db_name, try_state_dir
from runtime.agents import app_version
from runtime.config import (
    BACKUP_ROOT_ENV,
    WHOLE_NUMBER,
    ConfigError,
    default_backup_root,
    directory_given,
    foreign_settings,
    ignored,
    os_error_text,
    unknown_settings,
)

DEFAULT_STATE_DIR = ".state"
DEFAULT_KEEP = 7

Command = Callable[[argparse.Namespace], int]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    state = subparsers.add_parser(
        "state",
        help="snapshot, restore, recover or reset the state directory",
        description="Snapshot, restore, recover or reset the state directory. "
        "Stop every server before restore or reset.",
    )
    actions = state.add_subparsers(dest="state_command", required=True, metavar="ACTION")

    snapshot = actions.add_parser(
        "snapshot", help="write a consistent, hashed snapshot of every database (a server may keep running)"
    )
    _add_state_dir(snapshot)
    snapshot.add_argument(
        "--backup-root",
        help="where snapshots go (default: $AGENT_BACKUP_ROOT, else a sibling of the state directory "
        "named <state-dir>-backups, e.g. .state-backups; it must not be inside the state directory)",
    )
    snapshot.add_argument(
        "--keep", type=_positive, default=DEFAULT_KEEP, help=f"complete snapshots to keep (default {DEFAULT_KEEP})"
    )
    snapshot.add_argument("--timestamp", help="the snapshot's name, like 20260131T235959Z (default: now, UTC)")
    snapshot.set_defaults(func=_guarded(_snapshot), parser=snapshot)

    restore = actions.add_parser(
        "restore", help="replace the live databases with a snapshot's, all or nothing (servers must be stopped)"
    )
    restore.add_argument("snapshot", metavar="SNAPSHOT", help="a published snapshot directory")
    _add_state_dir(restore)
    restore.set_defaults(func=_guarded(_restore), parser=restore)

    recover_cmd = actions.add_parser(
        "recover", help="finish or roll back an interrupted restore, or say why the state cannot be accounted for"
    )
    _add_state_dir(recover_cmd)
    recover_cmd.set_defaults(func=_guarded(_recover), parser=recover_cmd)

    reset = actions.add_parser(
        "reset",
        help="delete everything in the state directory but its lock files, Keel's or not, without asking "
        "(refused while a process holds it, or where nothing is Keel's)",
    )
    _add_state_dir(reset)
    reset.set_defaults(func=_guarded(_reset), parser=reset)


def _add_state_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", help=f"the state directory (default: $AGENT_STATE_DIR, else {DEFAULT_STATE_DIR})"
    )


def _positive(text: str) -> int:
    # Plain digits, as the settings take them: int() also reads "1_0" (as 10) and the digits of other scripts.
    if not WHOLE_NUMBER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"must be a whole number in the digits 0-9, got {text!r}")
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class _UsageError(Exception):
    pass


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.strip():
        raise _UsageError(f"{name} must not be empty; unset the variable to use its default")
    return _bare_path(value, name)


def _flag_path(text: str | None, flag: str) -> Path | None:
    """A directory given on the command line; "" is refused, as an empty variable is, rather
    than read as the current directory."""
    if text is None:
        return None
    if not text.strip():
        raise _UsageError(f"{flag} must not be empty; leave it out to use its default")
    return _bare_path(text, flag)


def _bare_path(text: str, given_as: str) -> Path:
    """Refused as serve and check refuse it (config.directory_given)."""
    try:
        return directory_given(text)
    except ValueError as exc:
        raise _UsageError(f"{given_as}={text!r} is not valid: {exc}") from None


def _state_dir(args: argparse.Namespace) -> Path:
    return _flag_path(args.state_dir, "--state-dir") or _env_path("AGENT_STATE_DIR") or _default_state_dir()


def _default_state_dir() -> Path:
    try:
        return directory_given(DEFAULT_STATE_DIR)
    except ValueError as exc:  # in the words of check
        raise _UsageError(f"AGENT_STATE_DIR={DEFAULT_STATE_DIR!r} (the default: it is not set) is not valid: {exc}") from None


def _backup_root(args: argparse.Namespace, state_dir: Path) -> Path:
    return _flag_path(args.backup_root, "--backup-root") or _env_path(BACKUP_ROOT_ENV) or default_backup_root(state_dir)


def _guarded(command: Command) -> Command:
    def run(args: argparse.Namespace) -> int:
        if unknown := unknown_settings(os.environ):
            print(f"error: {ConfigError(unknown)}", file=sys.stderr)
            return 1
        for name in foreign_settings(os.environ):
            print(f"note: {ignored(name)}", file=sys.stderr)
        try:
            return command(args)
        except (StateError, _UsageError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:  # what the file system refused elsewhere (a backup root, a snapshot)
            print(f"error: {os_error_text(exc)}", file=sys.stderr)
            return 1

    return run


def _snapshot(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    target = create_snapshot(
        state_dir, _backup_root(args, state_dir), keep=args.keep, app_version=app_version(), stamp=args.timestamp
    )
    print(target)
    return 0


def _restore(args: argparse.Namespace) -> int:
    if not args.snapshot.strip():  # not the current directory
        raise _UsageError("SNAPSHOT must not be empty; give the snapshot directory that state snapshot printed")
    state_dir = _state_dir(args)
    result = restore_snapshot(Path(args.snapshot), state_dir)
    print(
        f"restored {', '.join(result.restored)} from {args.snapshot} into {state_dir} "
        f"(transaction {result.transaction_id}; replaced {len(result.replaced)} files)"
    )
    return 0


def _recover(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    outcome = recover(state_dir)
    first_boot = outcome.action is RecoveryAction.FIRST_BOOT
    if outcome.action is not RecoveryAction.CLEAN and not first_boot:
        print(f"{state_dir}: {outcome}")
        return 0
    # Recovery never opens a database; say which are there, and that what they hold is unchecked.
    databases = [] if first_boot else sorted(filter(is_db_name, os.listdir(state_dir)))
    if databases:
        print(f"{state_dir}: {outcome}; its databases ({', '.join(databases)}) were not opened: what they hold is not checked")
        return 0
    # What a server would begin with is promised only where one could begin: tried, as `check` tries it.
    try:
        try_state_dir(state_dir)
    except UnusableStateDir as exc:
        unusable = f"a server started by this user could not use it: {exc.why}"
        found = f"; {unusable}" if first_boot else f"; it holds no databases, and {unusable}"
    else:
        found = " (serve creates it)" if first_boot else NO_DATABASES
    print(f"{state_dir}: {outcome}{found}")
    return 0


NO_DATABASES = "; it holds no databases (a server started on it begins with no tasks or conversations)"


def _reset(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    removed = reset_state(state_dir)
    print(f"{state_dir}: removed {', '.join(removed)}" if removed else f"{state_dir}: nothing to remove")
    return 0
