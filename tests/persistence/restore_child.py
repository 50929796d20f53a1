"""A restore (or a state holder) in its own interpreter, ended at a chosen seam.

``python -m tests.persistence.restore_child SCENARIO SNAPSHOT STATE_DIR``. The crash scenarios
replace the restore's rename seam (or, ``while-staging``, its copy of the snapshot in) with one
that calls ``os._exit(code)`` at the named point, the way a ``kill -9`` would stop it: no
``finally``, no unwinding. The pausing scenarios print a line
once they hold what the parent needs, and carry on when their stdin closes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import persistence.restore
from persistence.journal import JOURNAL_NAME, QUARANTINE_PREFIX, STAGING_PREFIX
from persistence.recovery import hold_state_dir
from persistence.restore import FileEvidence, restore_snapshot
from persistence.statedir import decode_document

# Exit codes the parent asserts; they match the Go suite's (docs 1.9).
AFTER_FIRST_QUARANTINE = 71
AFTER_COMMITTED_PUBLISHED = 72
BEFORE_COMMITTED_PUBLISHED = 74
BEFORE_ROLLING_BACK_PUBLISHED = 75
BEFORE_FIRST_JOURNAL = 76
WHILE_STAGING = 77


def _journal_phase(temp: Path) -> object:
    return decode_document(temp.read_bytes())["phase"]


class CrashingRename:
    def __init__(self, scenario: str) -> None:
        self.scenario = scenario
        self.published = 0
        self.journals = 0

    def __call__(self, source: Path, target: Path) -> None:
        into_journal = target.name == JOURNAL_NAME
        phase = _journal_phase(source) if into_journal else None
        if into_journal:
            self.journals += 1
            if self.scenario == "before-first-journal" and self.journals == 1:
                os._exit(BEFORE_FIRST_JOURNAL)
            if self.scenario == "before-committed" and phase == "committed":
                os._exit(BEFORE_COMMITTED_PUBLISHED)
            if self.scenario == "before-rolling-back" and phase == "rolling_back":
                os._exit(BEFORE_ROLLING_BACK_PUBLISHED)
        if source.parent.name.startswith(STAGING_PREFIX):
            self.published += 1
            if self.scenario == "before-rolling-back" and self.published == 2:
                raise OSError("injected failure publishing the second database")
        os.replace(source, target)
        if target.parent.name.startswith(QUARANTINE_PREFIX):
            if self.scenario == "after-quarantine":
                os._exit(AFTER_FIRST_QUARANTINE)
            if self.scenario == "pause-after-quarantine":
                self.scenario = "restore"  # pause once, at the first file
                print("paused", flush=True)
                sys.stdin.read()
        if self.scenario == "after-committed" and into_journal and phase == "committed":
            os._exit(AFTER_COMMITTED_PUBLISHED)


def main(scenario: str, snapshot: Path, state_dir: Path) -> int:
    if scenario == "hold":
        with hold_state_dir(state_dir):
            print("held", flush=True)
            sys.stdin.read()
        return 0
    if scenario == "while-staging":
        copy = persistence.restore._copy_durably

        def copy_one_then_die(source: Path, target: Path, state_dir: Path) -> FileEvidence:
            copy(source, target, state_dir)
            os._exit(WHILE_STAGING)

        persistence.restore._copy_durably = copy_one_then_die
    restore_snapshot(snapshot, state_dir, rename=CrashingRename(scenario))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
