"""`python -m runtime serve`, `check` and the state commands as a service manager or a container
runs them: real processes, in the environment, directories and permissions they are given."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import trio

from fake_model import FakeModel
from tests.e2e.harness import STARTUP_DEADLINE_S, child_env, keel_process, serve_command, started_keel

# What a Dockerfile often sets: stdout then writes UTF-8 strictly, as it does under a UTF-8 locale
# such as en_US.UTF-8 (only the C locale has Python write a file name's bytes as they are).
STRICT_UTF8 = ("env", "PYTHONIOENCODING=utf-8")


def not_utf8(directory: Path, name: bytes) -> Path:
    """``directory / name`` for a name that is not UTF-8 (a file system written under Latin-1, say)."""
    return Path(os.fsdecode(os.fsencode(directory) + b"/" + name))


async def run_bytes(command: list[str]) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(STARTUP_DEADLINE_S):
        return await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False, env=child_env())


async def test_serve_check_and_recover_print_a_state_directory_their_stdout_cannot_encode(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # The line saying where serve serves names the state directory: printed strictly as UTF-8,
    # it failed, and the server stopped with a traceback; check and recover did the same.
    state = not_utf8(tmp_path, b"state-\xff")
    async with started_keel(serve_command(state, fake_model.base_url, started_by=STRICT_UTF8)) as keel:
        returncode = await keel.terminate()
    said = bytes(keel.output)
    assert b"Traceback" not in said, said.decode(errors="replace")
    assert os.fsencode(f"keel serving A2A at {keel.url} (state in {state})\n") in said, said
    assert returncode == 0
    runtime = [*STRICT_UTF8, sys.executable, "-m", "runtime"]
    checked = await run_bytes([*runtime, "check", "--state-dir", str(state)])
    assert checked.returncode == 0 and b"Traceback" not in checked.stderr, checked.stderr
    assert os.fsencode(f"AGENT_STATE_DIR={state}\n") in checked.stdout
    recovered = await run_bytes([*runtime, "state", "recover", "--state-dir", str(state)])
    assert recovered.returncode == 0 and b"Traceback" not in recovered.stderr, recovered.stderr
    assert recovered.stdout.startswith(os.fsencode(f"{state}: ")), recovered.stdout


async def test_a_state_directory_whose_name_is_not_utf8_is_snapshotted_twice_and_restored(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # The backup root's claim (.keel-snapshots-of) was written as UTF-8: the snapshot failed with
    # a traceback, leaving the backup root made and empty.
    state = not_utf8(tmp_path, b"caf\xe9")
    async with keel_process(state, fake_model.base_url) as keel:
        assert await keel.terminate() == 0
    runtime = [sys.executable, "-m", "runtime"]
    snapshots, stamps = [], ("20260101T000000Z", "20260101T000001Z")
    for stamp in stamps:
        taken = await run_bytes([*runtime, "state", "snapshot", "--state-dir", str(state), "--timestamp", stamp])
        assert taken.returncode == 0, taken.stderr.decode(errors="replace")
        snapshots.append(os.fsdecode(taken.stdout.strip()))
    assert snapshots == [str(not_utf8(tmp_path, b"caf\xe9-backups/" + stamp.encode())) for stamp in stamps]
    restored = await run_bytes([*runtime, "state", "restore", "--state-dir", str(state), snapshots[0]])
    assert restored.returncode == 0, restored.stderr.decode(errors="replace")


def without_the_privilege_to_write_anywhere() -> list[str]:
    """A command prefix that runs a process as a user whom permissions bind: none for such a
    user; for root, ``setpriv`` dropping every capability (a container run as root with
    ``--cap-drop ALL``)."""
    if os.geteuid() != 0:
        return []
    assert shutil.which("setpriv"), "setpriv (util-linux) is needed to run a process as root without CAP_DAC_OVERRIDE"
    return ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]


async def test_serve_on_a_state_directory_made_read_only_since_it_last_served_says_so_as_check_does(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # Its lock files and databases are there, and writable; the directory takes no new file
    # (`chmod a-w`, or a volume given to another user with its files left to this one). serve
    # said "runtime.db: the database failed (OperationalError: attempt to write a readonly
    # database)", where check said why.
    state = tmp_path / "state"
    async with keel_process(state, fake_model.base_url) as keel:
        assert await keel.terminate() == 0
    state.chmod(0o555)
    try:
        refused = await run_bytes([*without_the_privilege_to_write_anywhere(), *serve_command(state, fake_model.base_url)])
    finally:
        state.chmod(0o750)
    said, logged = refused.stdout.decode(), refused.stderr.decode()
    assert refused.returncode == 1 and "keel serving" not in said, said
    why = "not even root may write in it" if os.geteuid() == 0 else "this user may not write in it"
    assert logged.strip().splitlines()[-1] == (
        f"error: the state directory {state} cannot be used: no file can be made in it ({why}); choose one this user can"
        " create, or make files in"
    ), logged


GONE = (
    "it is relative to the working directory, which has been removed since this process started in it; give an absolute"
    " path, or start it in a directory that exists"
)


async def test_commands_started_in_a_working_directory_since_removed_say_so_of_a_relative_state_directory(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # A service whose working directory was removed (a release directory replaced by a deploy)
    # takes the default state directory, .state, from it. check and serve said "it cannot be
    # reached (No such file or directory)", snapshot and restore only "error: No such file or directory".
    said = {}
    commands = {"check": ["check"], "serve": ["serve", "--port", "0"], "snapshot": ["state", "snapshot"]}
    commands["restore"] = ["state", "restore", str(tmp_path)]
    for name, command in commands.items():
        gone = tmp_path / "release"
        gone.mkdir()
        in_removed = ["sh", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "sh", str(gone)]
        ran = await run_bytes([*in_removed, sys.executable, "-m", "runtime", *command])
        said[name] = (ran.returncode, ran.stderr.decode().strip().splitlines()[-1])
    unset = f"AGENT_STATE_DIR='.state' (the default: it is not set) is not valid: {GONE}"
    assert said == {
        "check": (1, f"  - {unset}"),
        "serve": (1, f"error: the state directory .state cannot be used: {GONE}"),
        "snapshot": (1, f"error: {unset}"),
        "restore": (1, f"error: {unset}"),
    }
