"""The serve command's own process settings, and what the command line says of a flag it does not know."""

from __future__ import annotations

import fcntl
import gc
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, cast

import pytest
import trio

from runtime.config import Config
from runtime.serve_cli import GC_YOUNG_THRESHOLD, _announce, _tune_collector
from runtime.server import _http_config
from tests.e2e.harness import AS_FROM_A_TERMINAL

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer


def test_the_server_freezes_what_it_made_to_start_and_collects_the_young_less_often() -> None:
    threshold = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    try:
        _tune_collector()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 10, 10)
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_an_address_a_server_still_starting_has_taken_is_refused_to_a_second() -> None:
    # Bound alone, with SO_REUSEADDR as hypercorn binds, a port could be bound twice; both servers
    # would then get as far as taking up what a dead process left before one failed to listen.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    first, second = (_http_config(Config.load({"AGENT_PORT": str(port)})) for _ in range(2))
    first.take_address()
    try:
        with warnings.catch_warnings():  # hypercorn leaves the socket whose bind failed to the collector
            warnings.simplefilter("ignore", ResourceWarning)
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: .*another process listens there"):
                second.take_address()
            gc.collect()
    finally:
        first.release_address()
        second.release_address()
    second.take_address()  # once the first has let go
    second.release_address()


@pytest.mark.parametrize(("host", "beyond"), [("0.0.0.0", True), ("127.0.0.1", False), ("::1", False)])
def test_listening_beyond_this_machine_warns_that_clients_are_not_authenticated(
    caplog: pytest.LogCaptureFixture, host: str, beyond: bool
) -> None:
    # Every client may read, steer and cancel every task: on loopback only this machine's users
    # can; on any other address, whoever reaches it. (Bound, listening, closed: nothing connects.)
    http = _http_config(Config.load({"AGENT_HOST": host, "AGENT_PORT": "0"}))
    http.take_address()
    http.release_address()
    said = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    if not beyond:
        assert said == []
        return
    [line] = said
    assert line.startswith(f"listening on {host}:") and line.endswith(
        ", beyond this machine: clients are not authenticated, so whoever reaches it may read, steer and cancel every task;"
        " serve others through a proxy that authenticates them, or listen on 127.0.0.1"
    ), line


@pytest.mark.parametrize(("given", "milliseconds"), [("1e306", 2**31 - 1), ("0.0001", 1), ("2.5", 2500)])
def test_any_send_timeout_check_accepts_is_one_the_listening_socket_takes(given: str, milliseconds: int) -> None:
    http = _http_config(Config.load({"AGENT_PORT": "0", "AGENT_SEND_TIMEOUT_S": given}))
    [listening] = http.create_sockets().insecure_sockets
    with listening:
        assert listening.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == milliseconds


@pytest.mark.parametrize(
    ("command", "usage"),
    [(["check"], "python -m runtime check"), (["serve"], "python -m runtime serve"), (["state", "reset"], "python -m runtime state reset")],
)
def test_an_unknown_flag_is_refused_with_the_usage_of_the_command_it_was_given_to(command: list[str], usage: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "runtime", *command, "--bogus"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"usage: {usage} ")
    assert result.stderr.rstrip().endswith(f"{usage}: error: unrecognized arguments: --bogus")


@pytest.mark.parametrize("command", ["serve", "check"])
def test_the_help_gives_each_setting_its_default_and_names_those_only_the_environment_gives(command: str) -> None:
    # The defaults, and the API key a hosted model needs, were in the README alone.
    helped = subprocess.run([sys.executable, "-m", "runtime", command, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0
    said = " ".join(helped.stdout.split())  # as argparse wraps it
    for shown in [
        "(default 127.0.0.1; $AGENT_HOST)",
        "(default 8080; $AGENT_PORT)",
        "(default .state; $AGENT_STATE_DIR)",
        "(default http://127.0.0.1:11434/v1; $AGENT_MODEL_BASE_URL)",
        "(default qwen3:4b-instruct; $AGENT_MODEL)",
        "on ($AGENT_PUBLIC_URL)",
        "(default 10; $AGENT_DRAIN_TIMEOUT_S)",
        "(default 12; $AGENT_MAX_MODEL_CALLS)",
        "(default 60; $AGENT_MODEL_TIMEOUT_S)",
        "(default 100; $AGENT_MAX_MODEL_CONNECTIONS)",
        "(default resume; $AGENT_ORPHANS)",
        "(default 30; $AGENT_SEND_TIMEOUT_S)",
        "(default 5; $AGENT_KEEP_ALIVE_S)",
        "Set in the environment only: AGENT_MODEL_API_KEY, bearer token for the model API.",
    ]:
        assert shown in said
    assert ("It checks AGENT_BACKUP_ROOT too, as state snapshot takes it" in said) is (command == "check")


def test_the_agent_card_reads_the_installed_version_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read from the package's metadata on disk: once (in a thread, as the server starts), never
    # on the event loop for each card request.
    from runtime import agents

    real, read = agents.metadata.version, []

    def version(name: str) -> str:
        read.append(name)
        return real(name)

    monkeypatch.setattr(agents.metadata, "version", version)
    agents.app_version.cache_clear()
    cards = [agents.agent_card("http://127.0.0.1:8080/") for _ in range(3)]
    assert {card.version for card in cards} == {real("keel")}
    assert read == ["keel"]


def test_the_installed_keel_command_names_itself_in_its_usage() -> None:
    keel = Path(sys.executable).parent / "keel"
    helped = subprocess.run([str(keel), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: keel "), helped.stdout
    refused = subprocess.run([str(keel), "serve", "--bogus"], capture_output=True, text=True, timeout=60)
    assert "usage: keel serve" in refused.stderr and "keel serve: error: unrecognized arguments: --bogus" in refused.stderr


async def test_a_start_given_up_while_it_waits_for_the_state_directory_lets_go_of_it_once_taken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # serve waits for a snapshot or a restore to let go of the state directory, in a thread a
    # signal abandons; the hold that thread takes after must not outlive the start given up on.
    from runtime import server

    entered, snapshot_done, released = threading.Event(), threading.Event(), threading.Event()

    class Held:
        def release(self) -> None:
            released.set()

    def hold_state_dir(_state_dir: Path) -> Held:
        entered.set()
        snapshot_done.wait(10)
        return Held()

    monkeypatch.setattr(server, "hold_state_dir", hold_state_dir)
    with trio.CancelScope() as start:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server._hold_state_dir, tmp_path)
            await trio.to_thread.run_sync(entered.wait, 10)
            start.cancel()  # a signal
    assert start.cancelled_caught
    snapshot_done.set()
    assert await trio.to_thread.run_sync(released.wait, 10), "the hold taken after the start was given up on was kept"


async def test_check_interrupted_while_it_loads_says_so_without_a_traceback(tmp_path: Path) -> None:
    process = await trio.lowlevel.open_process(
        [*AS_FROM_A_TERMINAL, sys.executable, "-m", "runtime", "check", "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={k: v for k, v in os.environ.items() if not k.startswith("AGENT_")},
    )  # fmt: skip
    with trio.fail_after(60):
        while "_sqlite3" not in Path(f"/proc/{process.pid}/maps").read_text():  # loaded with the configuration
            await trio.sleep(0.002)  # polling against a deadline: the library is mapped within a second
        process.send_signal(signal.SIGINT)
        assert process.stderr is not None
        said = b""
        async for chunk in process.stderr:
            said += chunk
        assert await process.wait() == 130
    assert said.decode() == "error: interrupted\n"


# A process logging through serve's handler, whose backlog is kept small to be filled quickly:
# it logs 1000 lines while its log's reader takes none, says so on stdout, and ends once told to
# (logging.shutdown closing the handler, as when serve exits).
LOGGING_CHILD = """
import logging, sys
from runtime import serve_cli
serve_cli.LOG_LINES_HELD = 100
logging.basicConfig(level=logging.INFO, handlers=[serve_cli.LogHandler()], format="%(message)s")
for n in range(1000):
    logging.info("line %d", n)
print("logged", flush=True)
sys.stdin.readline()
"""


async def test_the_lines_a_stalled_log_reader_missed_are_counted_where_they_went_missing() -> None:
    # Past the lines waiting for a reader that has stalled (a paused pager), lines are dropped and
    # counted. The count was written ahead of the next line the writer took, one that had waited
    # since before the gap: the log said lines went missing a few hundred lines before they did.
    reader, writer = os.pipe()
    fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)  # the least a pipe holds: a few hundred lines fill it
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", LOGGING_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=writer
        )
    finally:
        os.close(writer)
    logged = bytearray()
    async with trio.lowlevel.FdStream(reader) as log:
        with trio.fail_after(30):
            assert process.stdin is not None and process.stdout is not None
            said = b""
            while b"logged\n" not in said:
                chunk = await process.stdout.receive_some()
                assert chunk, f"the child ended before it had logged: {said!r}"
                said += chunk
            await process.stdin.send_all(b"\n")  # its reader takes the log again, and the process ends
            while chunk := await log.receive_some():
                logged += chunk
            assert await process.wait() == 0
    # Each count stands where its lines would have been: read in order, the log accounts for every line.
    expected, counted = 0, 0
    for line in logged.decode().splitlines():
        dropped = re.fullmatch(r"(\d+) log line\(s\) dropped while the log's reader took none", line)
        if dropped:
            expected += int(dropped.group(1))
            counted += int(dropped.group(1))
        else:
            assert line == f"line {expected}", f"{line!r} where 'line {expected}' was to come"
            expected += 1
    assert expected == 1000 and counted > 0, (expected, counted)



@pytest.mark.parametrize("command", [["check", "--state", "elsewhere"], ["state", "snapshot", "--ke", "2"]])
def test_a_flag_given_only_in_part_is_refused_not_taken_for_the_flag_it_begins(tmp_path: Path, command: list[str]) -> None:
    # argparse takes `--state` for `--state-dir` by default: a script written so would change its
    # meaning, or stop working, the day a flag beginning the same way is added.
    result = subprocess.run(
        [sys.executable, "-m", "runtime", *command], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr
    assert f"error: unrecognized arguments: {command[-2]}" in result.stderr
    assert list(tmp_path.iterdir()) == []


class _Writes(io.RawIOBase):
    """A stream that keeps each write it is given apart, as a pipe shared with the log's thread does."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        self.writes.append(bytes(data))
        return len(self.writes[-1])


def test_the_serving_line_reaches_an_unbuffered_stdout_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    # With PYTHONUNBUFFERED (usual under service managers and containers) each write goes out at
    # once; the line and its end written apart let a log line from another thread fall between them.
    raw = _Writes()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(cast(BinaryIO, raw), encoding="utf-8", write_through=True))
    _announce("keel serving A2A at http://127.0.0.1:8080/")
    assert raw.writes == [b"keel serving A2A at http://127.0.0.1:8080/\n"]
