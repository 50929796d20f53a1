"""Schema identity shared by every Keel database file.

Each database Keel writes carries a ``schema_meta`` table with two rows:
``('schema', NAME)`` and ``('version', N)``. Snapshots record this identity; preflight,
stores and restore refuse a file whose identity this build does not know.
"""

from __future__ import annotations

import sqlite3

import attrs

KEEL_SCHEMA_PREFIX = "keel."  # every Keel schema's name starts so, those of newer builds too

# The schemas this build can open, with the newest version it understands.
KNOWN_SCHEMAS: dict[str, int] = {
    "keel.sessions": 4,  # runtime.db
    "keel.tasks": 3,  # tasks.db
}

META_DDL = "CREATE TABLE IF NOT EXISTS schema_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"


@attrs.frozen
class SchemaIdentity:
    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def supported(self) -> bool:
        return KNOWN_SCHEMAS.get(self.name, 0) >= self.version >= 1


def read_identity(conn: sqlite3.Connection) -> SchemaIdentity | None:
    """The identity recorded in an open database, or None when it has none (empty or foreign).

    Raises sqlite3.DatabaseError when the file is not a database or is damaged.
    """
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_meta'").fetchone()
    if row is None:
        return None
    values = dict(conn.execute("SELECT key, value FROM schema_meta").fetchall())
    try:
        return SchemaIdentity(name=values["schema"], version=int(values["version"]))
    except (KeyError, ValueError):
        return None


def write_identity_txn(conn: sqlite3.Connection, identity: SchemaIdentity) -> None:
    conn.execute(META_DDL)
    conn.executemany(
        "INSERT INTO schema_meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        [("schema", identity.name), ("version", str(identity.version))],
    )
