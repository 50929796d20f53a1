"""nginx as an operator runs it in front of Keel: a real ``nginx`` process on a loopback port,
configured as the common guides say (HTTP/1.1 to an upstream with ``keepalive``, the default
``proxy_buffering on``), its config, logs and temporary files under a test's directory."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import trio

START_DEADLINE_S = 10
STOP_DEADLINE_S = 5
# Where a distribution puts nginx, searched too for a user whose PATH lacks the sbin directories.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])


def nginx_binary() -> str:
    found = shutil.which("nginx", path=SEARCH_PATH)
    if found is None:
        raise AssertionError("nginx is not installed; ./scripts/test installs it (apt-get install nginx-light)")
    return found


@attrs.frozen
class Nginx:
    """A running nginx: ``url`` is where clients reach it (with a trailing slash), ``error_log``
    the file it logs to."""

    url: str
    error_log: Path


def _free_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(directory: Path, port: int, upstream: str, *, read_timeout_s: float, upstream_idle_s: float) -> str:
    temp = "\n".join(f"    {kind}_temp_path {directory / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root root;\n" if os.geteuid() == 0 else ""  # workers otherwise run as nobody, locked out of tmp_path
    return f"""{user}worker_processes 1;
events {{ worker_connections 256; }}
http {{
    access_log {directory / "access.log"};
{temp}
    upstream keel {{
        server {upstream};
        keepalive 16;
        keepalive_timeout {round(upstream_idle_s * 1000)}ms;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://keel;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_read_timeout {round(read_timeout_s * 1000)}ms;
        }}
    }}
}}
"""


async def _wait_listening(port: int, process: trio.Process, error_log: Path) -> None:
    with trio.fail_after(START_DEADLINE_S):
        while True:
            if process.poll() is not None:
                raise AssertionError(f"nginx exited with {process.returncode}: {error_log.read_text(errors='replace')}")
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.02)  # polling interval against a deadline
                continue
            await stream.aclose()
            return


@asynccontextmanager
async def nginx_in_front_of(
    keel_url: str, directory: Path, *, read_timeout_s: float = 60, upstream_idle_s: float = 60
) -> AsyncIterator[Nginx]:
    """Run nginx proxying to ``keel_url`` until the block ends, then stop it by its pid.
    ``read_timeout_s`` is its ``proxy_read_timeout``; ``upstream_idle_s`` how long it keeps an
    idle connection to Keel (``keepalive_timeout`` in the upstream block)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    upstream = urlsplit(keel_url).netloc
    conf = directory / "nginx.conf"
    conf.write_text(_config(directory, port, upstream, read_timeout_s=read_timeout_s, upstream_idle_s=upstream_idle_s))
    error_log = directory / "error.log"
    command = [
        nginx_binary(), "-p", str(directory), "-c", str(conf),
        "-g", f"daemon off; pid {directory / 'nginx.pid'}; error_log {error_log} info;",
    ]  # fmt: skip
    process = await trio.lowlevel.open_process(command, stdin=subprocess.DEVNULL)
    try:
        await _wait_listening(port, process, error_log)
        yield Nginx(url=f"http://127.0.0.1:{port}/", error_log=error_log)
    finally:
        with trio.move_on_after(2 * STOP_DEADLINE_S, shield=True):
            process.terminate()  # SIGTERM: nginx's fast shutdown
            with trio.move_on_after(STOP_DEADLINE_S):
                await process.wait()
            process.kill()  # nothing, once it has exited
            await process.wait()
