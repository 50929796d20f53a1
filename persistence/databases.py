"""The databases a server keeps in its state directory, by name, each with its schema, and the
check that one can be served: ``check`` and ``serve`` make it before they open them, ``state
snapshot`` before it publishes a copy, and ``state restore`` before it takes a snapshot's, so that
none of them refuses what another has taken."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from persistence.errors import RESTORE_FIX, SchemaError
from persistence.sessions import SESSIONS_SCHEMA
from persistence.sqlite import Schema, check_intact, holds_rows, inspect
from persistence.tasks import TASKS_SCHEMA

SESSIONS_FILE = "runtime.db"
TASKS_FILE = "tasks.db"
SCHEMAS: dict[str, Schema] = {SESSIONS_FILE: SESSIONS_SCHEMA, TASKS_FILE: TASKS_SCHEMA}

# What each database holds, and the table it is kept in: a server reads one for the other's.
_HOLDS = {SESSIONS_FILE: ("conversations", "sessions"), TASKS_FILE: ("tasks", "tasks")}


def check_servable(path: Path, name: str, *, thorough: bool = False) -> int:
    """Read the database ``path`` as serve reads the one it opens as ``name`` (``tasks.db``), making
    nothing beside it where nothing is: its schema version (0 for a name serve opens no database
    by). Raises SchemaError saying why serve would refuse it (DatabaseFailed if it cannot be read).
    ``thorough``: SchemaError too if SQLite's integrity check finds the file damaged, which reads
    it whole (``check`` does; serve's start does not, to take no longer as the state grows)."""
    schema = SCHEMAS.get(name)
    if schema is None:
        return 0
    version = inspect(path, schema)
    if version and thorough:
        check_intact(path)
    return version


def check_together(state_dir: Path, versions: Mapping[str, int], *, read_in: Path | None = None) -> None:
    """SchemaError if a database of ``state_dir`` is missing or empty (of version 0 in ``versions``,
    the one of each name) while the other holds conversations or tasks: it was emptied, replaced or
    removed, and opened as it is, a server would make it anew and answer for what it held as if it
    had never been (a message sent again would start its task a second time). The databases are
    read in ``read_in`` (copies of them) when given. Blocking."""
    for name, version in versions.items():
        if version:
            continue
        for other, other_version in versions.items():
            holds, table = _HOLDS[other]
            if other != name and other_version and holds_rows((read_in or state_dir) / other, table):
                path = state_dir / name
                raise SchemaError(
                    path,
                    f"{'is empty' if path.exists() else 'is missing'}, but {other} beside it holds {holds}, so what it"
                    " held has been lost (the file, or its -wal, was emptied, replaced or removed) and would be served"
                    " as if it had never been",
                    RESTORE_FIX,
                )
