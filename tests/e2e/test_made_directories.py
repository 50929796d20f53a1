"""The directories Keel makes for state it keeps (the state directory, a backup root) and those it
makes above them: real `python -m runtime` processes, run under the umask a user may have."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fake_model import FakeModel

from tests.e2e.harness import STARTUP_DEADLINE_S, child_env, serve_command, started_keel
from tests.persistence.older_builds import make_older


def modes(top: Path, path: Path) -> dict[str, str]:
    """The permission bits of ``path`` and of each directory between it and ``top``, by name."""
    return {str(p.relative_to(top)): oct(os.stat(p).st_mode & 0o777) for p in (path, *path.parents) if top in p.parents}


def under_umask(umask: int, command: list[str]) -> list[str]:
    return ["sh", "-c", f'umask {umask:03o} && exec "$@"', "sh", *command]


async def test_serve_makes_a_missing_state_directory_and_its_parents_for_its_owner_alone_whatever_the_umask(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Under umask 000 `mkdir -p` leaves the parents it makes open to every user, who could then
    # swap the state directory (conversations and tasks) for one of their own.
    state = tmp_path / "srv" / "keel" / "state"
    async with started_keel(under_umask(0o000, serve_command(state, fake_model.base_url))) as keel:
        made = modes(tmp_path, state)
        assert await keel.terminate(signal.SIGTERM) == 0
    assert made == {"srv/keel/state": "0o750", "srv/keel": "0o750", "srv": "0o750"}
    state = tmp_path / "home" / "state"
    async with started_keel(under_umask(0o077, serve_command(state, fake_model.base_url))) as keel:
        made = modes(tmp_path, state)
        assert await keel.terminate(signal.SIGTERM) == 0
    assert made == {"home/state": "0o700", "home": "0o700"}  # what the umask takes away stays away


def test_snapshot_makes_a_missing_backup_root_and_its_parents_for_its_owner_alone_whatever_the_umask(tmp_path: Path) -> None:
    make_older(tmp_path / "state" / "tasks.db", "keel.tasks", 2)  # something to snapshot
    backups = tmp_path / "backups" / "keel"
    command = [sys.executable, "-m", "runtime", "state", "snapshot", "--state-dir", "state", "--backup-root", str(backups)]
    result = subprocess.run(
        under_umask(0o000, command), cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=STARTUP_DEADLINE_S
    )
    assert result.returncode == 0, result.stderr
    assert modes(tmp_path, backups) == {"backups/keel": "0o750", "backups": "0o750"}
