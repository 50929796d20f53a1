"""``GET /.well-known/agent-card.json``: the public agent card (spec 1.0 §8.2), also served at
A2A 0.2's ``/.well-known/agent.json``.

The server builds the card (name, description, skills, interfaces); this module only serves it.
``card_for`` receives the URL of the JSON-RPC endpoint as the client reached it, so the card
names an address that works from where the client stands. That URL comes from the request's
Host header: a card built from it is only ever shown to the client that sent that header. A
Host that is not a host (``a b``, ``[::1``, a port past 65535) gives way to the address the
request came in on. A server behind a proxy is given its public URL instead, and every card
names that.

Served with an ETag and a short ``Cache-Control`` (spec 1.0 §8.6.1), answering 304 Not Modified to
a client whose ``If-None-Match`` names the card it has, and with no CORS headers.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from urllib.parse import urljoin

import attrs
from quart import Response, request

from protocol import AgentCard, encode_json

CARD_PATH = "/.well-known/agent-card.json"
# Where A2A 0.2 put it: the a2a-sdk 0.3 servers served the card there too, and clients of that time
# (or that fall back to it, as the 0.3 TCK does) look for it there.
CARD_PATH_0_2 = "/.well-known/agent.json"

CardFor = Callable[[str], AgentCard]
"""Given the URL the JSON-RPC endpoint is reached at, the card to serve."""

CACHE_CONTROL = "public, max-age=300"
# A DNS name or IPv4 address, or an IPv6 address in brackets; then maybe a port.
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::(\d{1,5}))?")


@attrs.frozen
class CardEndpoint:
    card_for: CardFor
    rpc_path: str
    public_url: str | None = None

    async def handle(self) -> Response:
        base = _reached_at() if self.public_url is None else self.public_url.rstrip("/") + "/"
        endpoint_url = urljoin(base, self.rpc_path.lstrip("/"))
        body = encode_json(self.card_for(endpoint_url).well_known_json())
        response = Response(body, status=200, content_type="application/json")
        response.headers["Cache-Control"] = CACHE_CONTROL
        response.headers["Vary"] = "Host"
        response.set_etag(hashlib.sha256(body).hexdigest(), weak=True)
        return await response.make_conditional(request)  # 304 to an If-None-Match that matches


def _reached_at() -> str:
    """The server's base URL as this request reached it: by its Host header if that names a
    host, else by the address of the socket it came in on."""
    host = request.headers.get("Host", "")
    found = _HOST.fullmatch(host)
    if found is None or int(found.group(1) or 0) > 65535:
        address, port = request.scope.get("server") or (None, None)
        if address is None or port is None:  # not a TCP socket: nothing better to name
            return request.host_url
        host = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    return f"{request.scheme}://{host}/"
