"""`check` and `serve` agree on a state directory, and what `check` makes to try one it removes, or names."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from persistence.recovery import hold_state_dir
from persistence.statedir import StateError
from tests.persistence.state_helpers import TASKS, make_db
from tests.runtime.test_config import run_cli


@pytest.mark.parametrize("points_to", ["a directory", "nothing yet"])
def test_check_and_serve_agree_on_a_state_directory_that_is_a_symlink(tmp_path: Path, points_to: str) -> None:
    # /var/lib/keel -> /data/keel, say: check makes and removes a file through the link, and
    # says the configuration is fine; serve's first step (hold_state_dir) refuses the link.
    target = tmp_path / "data"
    if points_to == "a directory":
        target.mkdir()
    link = tmp_path / "state"
    link.symlink_to(target)
    checked = run_cli("check", env={"AGENT_STATE_DIR": str(link)})
    try:
        hold_state_dir(link).release()
    except StateError as refused:
        served = f"serve refuses it: {refused}"
    else:
        served = "serve takes it"
    assert (checked.returncode == 0) == (served == "serve takes it"), (checked.stdout, checked.stderr, served)


def test_check_that_cannot_remove_its_probe_says_so_rather_than_that_nothing_can_be_made(tmp_path: Path) -> None:
    # An append-only directory (chattr +a) takes new files and lets none go: the probe's file is
    # made, its removal fails, and check reported that no file could be made, leaving it there.
    state = tmp_path / "state"
    state.mkdir()
    made_append_only = subprocess.run(["chattr", "+a", str(state)], capture_output=True, text=True)
    assert made_append_only.returncode == 0, f"chattr +a failed (run the suite as root on ext4): {made_append_only.stderr}"
    try:
        result = run_cli("check", env={"AGENT_STATE_DIR": str(state)})
        left = sorted(path.name for path in state.iterdir())
    finally:
        subprocess.run(["chattr", "-a", str(state)], check=True)
    assert "Traceback" not in result.stderr and "no file can be made in it" not in result.stderr, result.stderr
    assert left and all(name in result.stderr for name in left), (left, result.stderr)  # what it left is named
    assert "cannot be removed (the directory lets nothing be removed); remove it by hand" in result.stderr


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        ("tasks.db", b"this is not a database" * 100, "tasks.db: cannot be read as a database"),
        ("runtime.db", None, "is a keel.tasks database, not keel.sessions"),
    ],
    ids=["damaged", "another-kind"],
)
def test_check_reads_the_databases_as_serve_would_and_names_one_it_cannot_use(
    tmp_path: Path, name: str, content: bytes | None, said: str
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    if content is None:  # tasks.db where runtime.db belongs: a copy made by hand into the wrong name
        make_db(state / name, TASKS, "copied")
    else:
        (state / name).write_bytes(content)
    before = sorted(path.name for path in state.iterdir())
    checked = run_cli("check", env={"AGENT_STATE_DIR": str(state)})
    assert checked.returncode == 1
    assert f"AGENT_STATE_DIR='{state}' is not valid: " in checked.stderr and said in checked.stderr, checked.stderr
    assert "Traceback" not in checked.stderr
    assert sorted(path.name for path in state.iterdir()) == before  # read only: nothing made, nothing changed
