"""The snapshot format, and the validation a snapshot passes before anything live is touched.

A published snapshot is a visible directory holding its databases, ``manifest.json`` (format
version, creation time, application, and each database's filename, SHA-256, size and schema
identity) and ``.complete``, whose ``manifest_sha256`` signs the manifest's exact bytes.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path
from typing import Any

import attrs

from persistence.databases import check_servable
from persistence.errors import SchemaError, StoreError
from persistence.schema import KNOWN_SCHEMAS, SchemaIdentity, read_identity
from persistence.statedir import SnapshotError, decode_document, file_evidence, is_db_name

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MARKER_NAME = ".complete"
_HEX = frozenset("0123456789abcdef")


def is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def _exact_keys(obj: object, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not an object")
    if set(obj) != keys:
        raise ValueError(f"{what} has fields {sorted(obj)}; expected {sorted(keys)}")
    return obj


def _int(value: object, what: str) -> int:
    # type() rather than isinstance(): JSON true is not a size, and 1.0 is not a version.
    if type(value) is not int:
        raise ValueError(f"{what} is not an integer")
    return value


@attrs.frozen
class DatabaseEntry:
    filename: str
    sha256: str
    size_bytes: int
    schema: SchemaIdentity | None

    def to_json(self) -> dict[str, object]:
        schema = None if self.schema is None else {"name": self.schema.name, "version": self.schema.version}
        return {"filename": self.filename, "sha256": self.sha256, "size_bytes": self.size_bytes, "schema": schema}

    @classmethod
    def from_json(cls, obj: object) -> DatabaseEntry:
        fields = _exact_keys(obj, {"filename", "sha256", "size_bytes", "schema"}, "a database entry")
        name = fields["filename"]
        if not isinstance(name, str) or not is_db_name(name):
            raise ValueError(f"it names an unsafe database filename: {name!r}")
        if not is_sha256(fields["sha256"]):
            raise ValueError(f"the SHA-256 of {name} is not 64 lowercase hex digits")
        size = _int(fields["size_bytes"], f"the size of {name}")
        if size <= 0:
            raise ValueError(f"the size of {name} is not positive")
        schema = fields["schema"]
        if schema is not None:
            schema = _exact_keys(schema, {"name", "version"}, f"the schema of {name}")
            if not isinstance(schema["name"], str):
                raise ValueError(f"the schema name of {name} is not a string")
            version = _int(schema["version"], f"the schema version of {name}")
            schema = SchemaIdentity(name=schema["name"], version=version)
        return cls(filename=name, sha256=fields["sha256"], size_bytes=size, schema=schema)


@attrs.frozen
class Manifest:
    created_at: str
    application: str
    version: str
    databases: tuple[DatabaseEntry, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "format_version": FORMAT_VERSION,
            "created_at": self.created_at,
            "source": {"application": self.application, "version": self.version},
            "databases": [entry.to_json() for entry in self.databases],
        }

    @classmethod
    def from_json(cls, obj: dict[str, object]) -> Manifest:
        fields = _exact_keys(obj, {"format_version", "created_at", "source", "databases"}, "the manifest")
        source = _exact_keys(fields["source"], {"application", "version"}, "the source")
        strings = (fields["created_at"], source["application"], source["version"])
        if not all(isinstance(value, str) and value for value in strings):
            raise ValueError("created_at, source.application and source.version must be non-empty strings")
        if not isinstance(fields["databases"], list) or not fields["databases"]:
            raise ValueError("the manifest lists no databases")
        entries = tuple(DatabaseEntry.from_json(item) for item in fields["databases"])
        seen: set[str] = set()
        for entry in entries:
            if entry.filename in seen:
                raise ValueError(f"it repeats the database filename {entry.filename}")
            seen.add(entry.filename)
        return cls(
            created_at=fields["created_at"],
            application=source["application"],
            version=source["version"],
            databases=entries,
        )


def inspect_database(path: Path) -> SchemaIdentity | None:
    """Run ``PRAGMA integrity_check`` and read the schema identity, without writing anything.

    The file is opened ``immutable``, so SQLite creates no sidecar next to it. Raises ValueError
    with SQLite's own words when the check fails or the file is not a database.
    """
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
    try:
        problems = [row[0] for row in conn.execute("PRAGMA integrity_check(10)")]
        if problems != ["ok"]:
            raise ValueError("; ".join(str(problem) for problem in problems))
        return read_identity(conn)
    except sqlite3.DatabaseError as exc:
        raise ValueError(str(exc)) from exc
    finally:
        conn.close()


def check_supported(what: str, identity: SchemaIdentity | None, *, fix: str) -> None:
    # A database without an identity (a foreign file) is carried as it is; a Keel schema this
    # build does not know would be refused by the stores, so it is refused here, before it is live.
    if identity is not None and not identity.supported:
        known = ", ".join(f"{name}@{version}" for name, version in sorted(KNOWN_SCHEMAS.items()))
        raise SnapshotError(
            f"{what} has schema {identity}, which this build cannot use (it knows {known}); {fix}"
        )


def _read_format(data: bytes, path: Path) -> dict[str, object]:
    try:
        document = decode_document(data)
    except ValueError as exc:
        raise SnapshotError(f"{path} is not a valid snapshot document: {exc}") from exc
    version = document.get("format_version")
    if version != FORMAT_VERSION or type(version) is not int:
        newer = type(version) is int and version > FORMAT_VERSION
        raise SnapshotError(
            f"{path} uses snapshot format {version!r}; this build reads format {FORMAT_VERSION}"
            + (" (the snapshot was taken by a newer Keel build: restore it with that build, or a newer one)" if newer else "")
        )
    return document


def _read_regular(path: Path, what: str) -> bytes:
    if not path.is_file() or path.is_symlink():
        raise SnapshotError(
            f"Snapshot {path.parent} is incomplete: it has no {what} ({path.name}); it was never finished"
        )
    return path.read_bytes()


def read_snapshot(snapshot_dir: Path) -> Manifest:
    """Validate a whole snapshot without writing anything, and return its manifest.

    Raises SnapshotError naming the first problem: a missing, hidden or unfinished snapshot, a
    manifest whose hash does not match ``.complete``, an unknown format, an unsafe or repeated
    name, a missing or unlisted database, a size or SHA-256 mismatch, a failed integrity check or
    an unsupported schema.
    """
    if snapshot_dir.name.startswith("."):
        raise SnapshotError(
            f"Snapshot {snapshot_dir} is hidden, so it was never published"
        )
    if not snapshot_dir.is_dir() or snapshot_dir.is_symlink():
        raise SnapshotError(f"Snapshot {snapshot_dir} does not exist or is not a directory")
    marker_bytes = _read_regular(snapshot_dir / MARKER_NAME, "completion marker")
    manifest_bytes = _read_regular(snapshot_dir / MANIFEST_NAME, "manifest")
    marker = _read_format(marker_bytes, snapshot_dir / MARKER_NAME)
    if set(marker) != {"format_version", "manifest_sha256"} or not is_sha256(marker["manifest_sha256"]):
        raise SnapshotError(f"{snapshot_dir / MARKER_NAME} must hold exactly format_version and manifest_sha256")
    if hashlib.sha256(manifest_bytes).hexdigest() != marker["manifest_sha256"]:
        raise SnapshotError(f"Snapshot manifest hash does not match .complete: {snapshot_dir}")
    document = _read_format(manifest_bytes, snapshot_dir / MANIFEST_NAME)
    try:
        manifest = Manifest.from_json(document)
    except ValueError as exc:
        raise SnapshotError(f"Snapshot manifest {snapshot_dir / MANIFEST_NAME} is not valid: {exc}") from exc
    _check_files(snapshot_dir, manifest)
    return manifest


def _check_files(snapshot_dir: Path, manifest: Manifest) -> None:
    listed = {entry.filename for entry in manifest.databases}
    present = {name for name in os.listdir(snapshot_dir) if name.endswith(".db")}
    if unlisted := sorted(present - listed):
        raise SnapshotError(f"Snapshot {snapshot_dir} holds {', '.join(unlisted)}, which its manifest does not list")
    for entry in manifest.databases:
        path = snapshot_dir / entry.filename
        if entry.filename not in present:
            raise SnapshotError(f"Snapshot {snapshot_dir} is missing {entry.filename}, which its manifest lists")
        if not path.is_file() or path.is_symlink():
            raise SnapshotError(f"Snapshot database {path} must be a regular file")
        evidence = file_evidence(path)
        if evidence.size_bytes != entry.size_bytes:
            raise SnapshotError(
                f"Snapshot database {path} is {evidence.size_bytes} bytes; the manifest says {entry.size_bytes}"
            )
        if evidence.sha256 != entry.sha256:
            raise SnapshotError(f"Snapshot database {path} does not match its SHA-256 in the manifest")
        try:
            identity = inspect_database(path)
        except ValueError as exc:
            raise SnapshotError(f"Snapshot database {path} failed its integrity check: {exc}") from exc
        check_supported(f"Snapshot database {path}", identity, fix="restore it with a build that supports it")
        if identity != entry.schema:
            raise SnapshotError(f"Snapshot database {path} has schema {identity}; the manifest records {entry.schema}")
        try:
            check_servable(path, entry.filename)
        except SchemaError as exc:  # taken by a build that did not check what a server would refuse
            raise SnapshotError(f"Snapshot database {path} {exc.reason}; a server could not use it") from exc
        except StoreError as exc:
            raise SnapshotError(f"Snapshot database {path} could not be read: {exc.__cause__ or exc}") from exc
