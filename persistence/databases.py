"""The databases a server keeps in its state directory, by name, each with its schema, and the
check that one can be served: ``check`` and ``serve`` make it before they open them, ``state
snapshot`` before it publishes a copy, and ``state restore`` before it takes a snapshot's, so that
none of them refuses what another has taken."""

from __future__ import annotations

from pathlib import Path

from persistence.sessions import SESSIONS_SCHEMA
from persistence.sqlite import Schema, inspect
from persistence.tasks import TASKS_SCHEMA

SESSIONS_FILE = "runtime.db"
TASKS_FILE = "tasks.db"
SCHEMAS: dict[str, Schema] = {SESSIONS_FILE: SESSIONS_SCHEMA, TASKS_FILE: TASKS_SCHEMA}


def check_servable(path: Path, name: str) -> int:
    """Read the database ``path`` as serve reads the one it opens as ``name`` (``tasks.db``), making
    nothing beside it where nothing is: its schema version (0 for a name serve opens no database
    by). Raises SchemaError saying why serve would refuse it (DatabaseFailed if it cannot be read)."""
    schema = SCHEMAS.get(name)
    return 0 if schema is None else inspect(path, schema)
