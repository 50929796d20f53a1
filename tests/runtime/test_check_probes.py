"""`check` and `serve` agree on a state directory, and what `check` makes to try one it removes, or names."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from functools import partial
from pathlib import Path

import pytest
import trio

from persistence.recovery import hold_state_dir
from persistence.sessions import open_session_store
from persistence.snapshot import create_snapshot
from persistence.statedir import StateError
from persistence.tasks import open_task_store
from runtime.config import Config, ConfigError
from tests.persistence.restore_child import AFTER_FIRST_QUARANTINE
from tests.persistence.state_helpers import TASKS, fingerprint, make_db, quarantine_dir, run_child
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


async def test_check_and_serve_name_every_database_they_cannot_use_at_once(tmp_path: Path) -> None:
    # Both files changed by another program: naming only runtime.db sent the operator back to
    # check, and then to serve, a second time to learn of tasks.db.
    state = tmp_path / "state"
    state.mkdir()
    async with open_session_store(state / "runtime.db"), open_task_store(state / "tasks.db"):
        pass
    for name, change in (("runtime.db", "ALTER TABLE sessions ADD COLUMN note TEXT"), ("tasks.db", "ALTER TABLE tasks ADD COLUMN priority INTEGER")):
        with closing(sqlite3.connect(state / name)) as conn:
            conn.execute(change)
    env = {"AGENT_STATE_DIR": str(state)}

    checked = await trio.to_thread.run_sync(partial(run_cli, "check", env=env))
    served = await trio.to_thread.run_sync(partial(run_cli, "serve", "--port", "0", env=env))

    named = [f"{state / 'runtime.db'}: has column sessions.note", f"{state / 'tasks.db'}: has column tasks.priority"]
    assert checked.returncode == 1 and all(said in checked.stderr for said in named), checked.stderr
    assert served.returncode == 1 and "keel serving" not in served.stdout, served.stdout
    assert all(said in served.stderr for said in named) and "Traceback" not in served.stderr, served.stderr


async def test_check_of_a_state_directory_a_stopped_server_left_makes_nothing_beside_its_databases(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    async with open_session_store(state / "runtime.db"), open_task_store(state / "tasks.db"):
        pass  # WAL databases as a server leaves them: its last connection closed removed each -wal and -shm
    before = sorted(path.name for path in state.iterdir())
    assert before == ["runtime.db", "tasks.db"]

    checked = await trio.to_thread.run_sync(partial(run_cli, "check", env={"AGENT_STATE_DIR": str(state)}))

    assert checked.returncode == 0, checked.stderr
    assert sorted(path.name for path in state.iterdir()) == before  # no runtime.db-wal, no tasks.db-shm


@pytest.mark.parametrize("exists", [True, False], ids=["the-directory", "where-it-would-be-created"])
def test_check_reports_a_state_directory_too_full_to_store_a_turn_as_healthz_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exists: bool
) -> None:
    # An empty file can be made on a full disk, so making one proves little; here "too full" is
    # set past what any disk has free, as the /healthz test sets it.
    monkeypatch.setattr("persistence.statedir.MIN_FREE_BYTES", 1 << 62)
    state = tmp_path / "state"
    if exists:
        state.mkdir()

    with pytest.raises(ConfigError) as refused:
        Config.load({"AGENT_STATE_DIR": str(state)}, probe=True)

    [problem] = refused.value.problems
    prefix = f"AGENT_STATE_DIR='{state}' is not valid: it is nearly full: "
    free, _, rest = problem.removeprefix(prefix).partition(" bytes free")
    assert problem.startswith(prefix) and int(free) > 0, problem
    assert rest == f", under the {1 << 62} a turn may need; free space on its disk, or give the server a state directory on one with room"
    assert sorted(tmp_path.iterdir()) == ([state] if exists else [])


async def test_check_and_serve_refuse_a_database_this_user_may_not_write(tmp_path: Path) -> None:
    # A server started as another user than the one its databases belong to read them, said it
    # was ready, and failed every request that stores something. Permissions do not bind root;
    # an immutable file (chattr +i) does.
    state = tmp_path / "state"
    state.mkdir()
    async with open_session_store(state / "runtime.db"), open_task_store(state / "tasks.db"):
        pass
    made_immutable = subprocess.run(["chattr", "+i", str(state / "tasks.db")], capture_output=True, text=True)
    assert made_immutable.returncode == 0, f"chattr +i failed (run the suite as root on ext4): {made_immutable.stderr}"
    try:
        checked = await trio.to_thread.run_sync(partial(run_cli, "check", env={"AGENT_STATE_DIR": str(state)}))
        served = await trio.to_thread.run_sync(partial(run_cli, "serve", "--port", "0", env={"AGENT_STATE_DIR": str(state)}))
    finally:
        subprocess.run(["chattr", "-i", str(state / "tasks.db")], check=True)
    why = "tasks.db in it cannot be written (not even root may write it)" if os.geteuid() == 0 else "tasks.db in it cannot be written (this user may not read and write it)"
    assert checked.returncode == 1, checked.stdout
    assert f"AGENT_STATE_DIR='{state}' is not valid: {why}\n" in checked.stderr
    assert served.returncode == 1 and "keel serving" not in served.stdout, served.stdout
    assert served.stderr.strip().splitlines()[-1] == (
        f"error: the state directory {state} cannot be used: {why}; run the server as a user who may write it, or make it"
        " writable by this one"
    )


def without_the_privilege_to_listen_below_1024() -> list[str]:
    """A command prefix that runs a process as a user who may not listen on a port below 1024:
    none for such a user; for root, ``setpriv`` dropping that capability."""
    if os.geteuid() != 0:
        return []
    assert shutil.which("setpriv"), "setpriv (util-linux) is needed to run a process as root without CAP_NET_BIND_SERVICE"
    return ["setpriv", "--bounding-set=-net_bind_service"]


def a_privileged_port() -> int:
    """The highest port only a privileged process may listen on, on this machine (1023 unless
    its ``ip_unprivileged_port_start`` was changed)."""
    start = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    assert start > 1, f"every port is unprivileged on this machine (ip_unprivileged_port_start is {start})"
    return start - 1


def test_check_and_serve_agree_on_a_port_this_user_may_not_listen_on(tmp_path: Path) -> None:
    # check bound the host on a port the system picked, and said the configuration was fine;
    # serve then could not listen on port 80.
    port = a_privileged_port()
    prefix = without_the_privilege_to_listen_below_1024()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")} | {"AGENT_STATE_DIR": str(tmp_path / "state")}
    checked, served = (
        subprocess.run(
            [*prefix, sys.executable, "-m", "runtime", command, "--port", str(port)], env=env, capture_output=True, text=True, timeout=60
        )
        for command in ("check", "serve")
    )
    assert checked.returncode == 1, checked.stdout
    assert checked.stderr == (
        f"error: the configuration has problems:\n  - --port='{port}' is not valid: serve could not listen on it (Permission"
        " denied; ports below 1024 need privileges): choose another port, or give the server the privilege"
        " (CAP_NET_BIND_SERVICE)\n"
    )
    assert served.returncode == 1 and "keel serving" not in served.stdout
    assert served.stderr.strip().splitlines()[-1] == (
        f"error: cannot listen on 127.0.0.1:{port}: Permission denied; this user may not listen there (ports below 1024 need"
        " privileges): choose another --port (AGENT_PORT)"
    )


async def real_state(state: Path) -> None:
    """A state directory as a stopped server leaves it."""
    state.mkdir()
    async with open_session_store(state / "runtime.db"), open_task_store(state / "tasks.db"):
        pass


@pytest.mark.parametrize("then", ["left as it was", "a file moved aside removed by hand"])
async def test_check_and_serve_agree_on_what_an_interrupted_restore_left(tmp_path: Path, then: str) -> None:
    # check read the databases it found and said the configuration was fine; serve, whose first
    # step is to finish or roll back the restore, refused what it could not account for.
    await real_state(tmp_path / "source")
    snapshot = create_snapshot(tmp_path / "source", tmp_path / "backups", keep=1, app_version="test")
    state = tmp_path / "state"
    await real_state(state)
    killed = await trio.to_thread.run_sync(run_child, "after-quarantine", snapshot, state)
    assert killed.returncode == AFTER_FIRST_QUARANTINE, killed.stderr
    if then != "left as it was":
        for moved in quarantine_dir(state).iterdir():
            moved.unlink()
    before = fingerprint(state)

    checked = await trio.to_thread.run_sync(partial(run_cli, "check", env={"AGENT_STATE_DIR": str(state)}))

    assert fingerprint(state) == before  # check reads only
    if then == "left as it was":  # serve rolls it back
        assert checked.returncode == 0, checked.stderr
        return
    served = await trio.to_thread.run_sync(partial(run_cli, "serve", "--port", "0", env={"AGENT_STATE_DIR": str(state)}))
    assert served.returncode == 1 and "keel serving" not in served.stdout, served.stdout
    refused = served.stderr.strip().splitlines()[-1].removeprefix("error: ")
    assert refused.startswith("Restore recovery is missing byte-identical old evidence for runtime.db."), refused
    assert checked.returncode == 1, checked.stdout
    assert f"AGENT_STATE_DIR='{state}' is not valid: {refused}\n" in checked.stderr
