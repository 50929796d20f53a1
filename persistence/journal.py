"""The restore journal: the one record of which generation of the state directory is real.

``.restore-journal.json`` holds exactly ``format_version``, ``transaction_id``, ``phase``,
``staging_dir``, ``quarantine_dir``, ``old_inventory`` and ``new_inventory``. Every version of it
is written to ``.restore-journal.<txid>.tmp``, fsynced, the directory fsynced, and only then
renamed into place, so a reader sees a whole journal or the previous one, never a torn one.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import attrs

from persistence.manifest import is_sha256
from persistence.statedir import (
    PRIVATE_MODE,
    FileEvidence,
    RecoveryError,
    decode_document,
    encode_document,
    fsync_dir,
    is_db_name,
    is_state_file_name,
    write_new_file,
)

JOURNAL_NAME = ".restore-journal.json"
JOURNAL_FORMAT = 1
STAGING_PREFIX = ".restore-staged."
QUARANTINE_PREFIX = ".restore-quarantine."
INCOMPLETE = "Restore journal is incomplete or has unsupported fields."
_FIELDS = frozenset(
    {"format_version", "transaction_id", "phase", "staging_dir", "quarantine_dir", "old_inventory", "new_inventory"}
)
TRANSACTION_ID = re.compile(r"[0-9a-f]{32}")
TEMP_NAME = re.compile(r"\.restore-journal\.([0-9a-f]{32})\.tmp")

Phase = Literal["prepared", "rolling_back", "committed"]
PHASES: tuple[Phase, ...] = ("prepared", "rolling_back", "committed")
_PHASE_BY_NAME: dict[object, Phase] = {phase: phase for phase in PHASES}
Rename = Callable[[Path, Path], None]


def new_transaction_id() -> str:
    return secrets.token_hex(16)


def temp_name(transaction_id: str) -> str:
    return f".restore-journal.{transaction_id}.tmp"


@attrs.frozen
class Journal:
    transaction_id: str
    phase: Phase
    old_inventory: tuple[FileEvidence, ...]
    new_inventory: tuple[FileEvidence, ...]

    @property
    def staging_dir(self) -> str:
        return STAGING_PREFIX + self.transaction_id

    @property
    def quarantine_dir(self) -> str:
        return QUARANTINE_PREFIX + self.transaction_id

    @property
    def owned_names(self) -> frozenset[str]:
        """Every ``.restore-*`` name this transaction may leave in the state directory."""
        return frozenset({JOURNAL_NAME, temp_name(self.transaction_id), self.staging_dir, self.quarantine_dir})

    def with_phase(self, phase: Phase) -> Journal:
        return attrs.evolve(self, phase=phase)

    def to_json(self) -> dict[str, object]:
        def entries(inventory: tuple[FileEvidence, ...]) -> list[dict[str, object]]:
            return [{"filename": e.filename, "sha256": e.sha256, "size_bytes": e.size_bytes} for e in inventory]

        return {
            "format_version": JOURNAL_FORMAT,
            "transaction_id": self.transaction_id,
            "phase": self.phase,
            "staging_dir": self.staging_dir,
            "quarantine_dir": self.quarantine_dir,
            "old_inventory": entries(self.old_inventory),
            "new_inventory": entries(self.new_inventory),
        }

    @classmethod
    def from_json(cls, document: dict[str, object]) -> Journal:
        """Validate every field; raises RecoveryError naming the first one that is wrong (NewerJournal
        for a format a newer build writes, whatever its fields)."""
        version = document.get("format_version")
        if type(version) is int and version > JOURNAL_FORMAT:
            raise NewerJournal(version)
        if set(document) != _FIELDS:
            missing, unknown = sorted(_FIELDS - set(document)), sorted(set(document) - _FIELDS)
            said = [f"{what}: {', '.join(names)}" for what, names in (("Missing", missing), ("Unknown", unknown)) if names]
            raise RecoveryError(f"{INCOMPLETE} {'. '.join(said)}.")
        if type(version) is not int or version != JOURNAL_FORMAT:
            raise RecoveryError(
                f"Unsupported restore journal format {version!r}; this build supports format {JOURNAL_FORMAT}."
            )
        txid = document["transaction_id"]
        if not isinstance(txid, str) or not TRANSACTION_ID.fullmatch(txid):
            raise RecoveryError("Restore journal has an invalid transaction id.")
        phase = _PHASE_BY_NAME.get(document["phase"]) if isinstance(document["phase"], str) else None
        if phase is None:
            raise RecoveryError(f"Restore journal has an invalid phase: {document['phase']!r}")
        if document["staging_dir"] != STAGING_PREFIX + txid:
            raise RecoveryError("Restore journal has an invalid staging directory.")
        if document["quarantine_dir"] != QUARANTINE_PREFIX + txid:
            raise RecoveryError("Restore journal has an invalid quarantine directory.")
        old = _inventory(document["old_inventory"], "old", is_state_file_name)
        new = _inventory(document["new_inventory"], "new", is_db_name)
        if not new:
            raise RecoveryError("Restore journal has an invalid new inventory.")
        return cls(transaction_id=txid, phase=phase, old_inventory=old, new_inventory=new)


def _inventory(value: object, which: str, safe: Callable[[str], bool]) -> tuple[FileEvidence, ...]:
    if not isinstance(value, list):
        raise RecoveryError(f"Restore journal has an invalid {which} inventory.")
    seen: set[str] = set()
    result = []
    for item in value:
        if not isinstance(item, dict) or set(item) != {"filename", "sha256", "size_bytes"}:
            raise RecoveryError(f"Restore journal has incomplete {which} file evidence.")
        name, digest, size = item["filename"], item["sha256"], item["size_bytes"]
        if not isinstance(name, str) or not safe(name):
            raise RecoveryError(f"Restore journal has an unsafe {which} filename: {name!r}")
        if name in seen:
            raise RecoveryError(f"Restore journal repeats the {which} filename: {name}")
        if not is_sha256(digest):
            raise RecoveryError(f"Restore journal has an invalid {which} SHA-256 for {name}.")
        if type(size) is not int or size < 0:
            raise RecoveryError(f"Restore journal has an invalid {which} size for {name}.")
        seen.add(name)
        result.append(FileEvidence(filename=name, sha256=digest, size_bytes=size))
    return tuple(result)


class NewerJournal(RecoveryError):
    """A journal in a format only a newer build writes: that build can finish its restore."""

    def __init__(self, version: int) -> None:
        super().__init__(
            f"Restore journal format {version} was written by a newer Keel build; this build supports format"
            f" {JOURNAL_FORMAT}. Finish the restore with that build (python -m runtime state recover), then serve again."
        )


class UnreadableJournal(RecoveryError):
    """The journal's bytes are not a JSON document at all (a write that was torn by a crash)."""


def parse_journal_file(path: Path) -> Journal:
    """Read and validate a journal (or a journal temp); raises RecoveryError when it cannot be used."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise RecoveryError(f"Restore journal {path} disappeared while recovery was reading it") from None
    if not stat.S_ISREG(info.st_mode):
        raise RecoveryError(f"Restore journal must be a regular file: {path}")
    try:
        document = decode_document(path.read_bytes())
    except ValueError as exc:
        raise UnreadableJournal(f"Restore journal {path} is not a JSON document: {exc}") from exc
    return Journal.from_json(document)


def stage_journal(state_dir: Path, journal: Journal) -> Path:
    """Write the journal's temp file durably (file and directory fsynced) and return its path.

    Publishing it is the caller's rename onto ``JOURNAL_NAME`` followed by ``fsync_dir``; a crash
    before that rename leaves the previous journal authoritative.
    """
    temp = state_dir / temp_name(journal.transaction_id)
    temp.unlink(missing_ok=True)  # a phase update that an earlier attempt never published
    write_new_file(temp, encode_document(journal.to_json()), mode=PRIVATE_MODE)
    fsync_dir(state_dir)
    return temp


def publish_journal(state_dir: Path, journal: Journal, *, rename: Rename) -> None:
    """Make ``journal`` the durable journal: temp, fsyncs, rename, fsync of the directory."""
    temp = stage_journal(state_dir, journal)
    rename(temp, state_dir / JOURNAL_NAME)
    fsync_dir(state_dir)
