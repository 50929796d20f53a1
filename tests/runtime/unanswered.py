"""A model server's address that never answers a connection request, as a host that is off, or
behind a firewall that drops what is sent to it, does: a listener whose backlog is full. The
kernel drops each new connection request to it, so a connect neither succeeds nor is refused,
and waits until its timeout (a closed port, by contrast, refuses at once)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def unanswered_model_url() -> Iterator[str]:
    """The base URL of a model server whose connects wait until they time out."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # room for one connection waiting to be accepted: the one below
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            yield f"http://127.0.0.1:{port}/v1"
