"""Databases as earlier builds of Keel wrote them, made with plain sqlite3 (none of the current code):
``tasks.db`` and ``runtime.db`` at each schema version they had, to open, serve, snapshot and
restore with this build."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from contextlib import closing
from pathlib import Path

TASKS_DDL = (
    # keel.tasks@1
    """
    CREATE TABLE tasks (
        id TEXT PRIMARY KEY, context_id TEXT NOT NULL, owner TEXT NOT NULL, state TEXT NOT NULL,
        version INTEGER NOT NULL, created_at_ms INTEGER NOT NULL, updated_at_ms INTEGER NOT NULL, task TEXT NOT NULL
    );
    CREATE INDEX tasks_owner_recent ON tasks (owner, updated_at_ms DESC, id DESC);
    CREATE INDEX tasks_context ON tasks (context_id);
    CREATE INDEX tasks_state ON tasks (state);
    """,
    # keel.tasks@2
    """
    ALTER TABLE tasks ADD COLUMN message_id TEXT;
    CREATE UNIQUE INDEX tasks_by_message ON tasks (owner, message_id) WHERE message_id IS NOT NULL;
    """,
)

SESSIONS_DDL = (
    # keel.sessions@1
    """
    CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY, app_name TEXT NOT NULL, user_id TEXT NOT NULL, state TEXT NOT NULL DEFAULT '{}',
        created_at_ms INTEGER NOT NULL, updated_at_ms INTEGER NOT NULL
    );
    CREATE TABLE events (
        session_id TEXT NOT NULL REFERENCES sessions (session_id), seq INTEGER NOT NULL, author TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL, content TEXT NOT NULL, PRIMARY KEY (session_id, seq)
    );
    CREATE TABLE app_states (app_name TEXT PRIMARY KEY, state TEXT NOT NULL, updated_at_ms INTEGER NOT NULL);
    CREATE TABLE user_states (
        app_name TEXT NOT NULL, user_id TEXT NOT NULL, state TEXT NOT NULL, updated_at_ms INTEGER NOT NULL,
        PRIMARY KEY (app_name, user_id)
    );
    CREATE TABLE steers (
        id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, text TEXT NOT NULL, created_at_ms INTEGER NOT NULL
    );
    CREATE INDEX steers_by_session ON steers (session_id, id);
    """,
    # keel.sessions@2
    """
    CREATE TABLE steer_receipts (
        session_id TEXT NOT NULL, message_id TEXT NOT NULL, task_id TEXT, sent_sha256 TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL, PRIMARY KEY (session_id, message_id)
    ) WITHOUT ROWID;
    """,
    # keel.sessions@3
    """
    ALTER TABLE steers ADD COLUMN task_id TEXT;
    """,
)


def make_older(path: Path, name: str, version: int) -> None:
    """An empty database of schema ``name`` (``keel.tasks`` or ``keel.sessions``) at ``version``,
    in WAL mode, as the build of that version left it."""
    ddl = {"keel.tasks": TASKS_DDL, "keel.sessions": SESSIONS_DDL}[name]
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("BEGIN IMMEDIATE")
        for script in ddl[:version]:
            for statement in script.split(";"):
                if statement.strip():
                    conn.execute(statement)
        conn.execute("CREATE TABLE schema_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.executemany("INSERT INTO schema_meta VALUES (?, ?)", [("schema", name), ("version", str(version))])
        conn.execute("COMMIT")


def store_task(path: Path, task_id: str, context_id: str, state: str, task_json: str, *, updated_at_ms: int = 2) -> None:
    """A task row as a build of ``keel.tasks@1`` wrote it (no message id), owned by the one owner
    the server has."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "INSERT INTO tasks (id, context_id, owner, state, version, created_at_ms, updated_at_ms, task)"
            " VALUES (?, ?, 'anonymous', ?, 3, 1, ?, ?)",
            (task_id, context_id, state, updated_at_ms, task_json),
        )


def store_question(path: Path, session_id: str, question: str, turn_id: str) -> None:
    """A conversation of one question, as a build of ``keel.sessions@1`` saved a turn's first step."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "INSERT INTO sessions (session_id, app_name, user_id, created_at_ms, updated_at_ms) VALUES (?, 'keel', '', 1, 1)",
            (session_id,),
        )
        content = json.dumps({"role": "user", "text": question, "turn_id": turn_id}, ensure_ascii=False, separators=(",", ":"))
        conn.execute("INSERT INTO events VALUES (?, 0, 'agent', 1, ?)", (session_id, content))


def store_steer(path: Path, session_id: str, task_id: str, message_id: str, text: str) -> None:
    """A steer of one text part a build of ``keel.sessions@3`` stored for a working task and no run
    has taken yet: the steer, and its receipt (a digest of the parts as sent), of one millisecond."""
    sent = json.dumps([{"text": text}], sort_keys=True, separators=(",", ":"))
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "INSERT INTO steers (session_id, text, created_at_ms, task_id) VALUES (?, ?, 5, ?)", (session_id, text, task_id)
        )
        conn.execute(
            "INSERT INTO steer_receipts VALUES (?, ?, ?, ?, 5)",
            (session_id, message_id, task_id, hashlib.sha256(sent.encode()).hexdigest()),
        )
