"""``GET /.well-known/agent-card.json``: the public agent card (spec 1.0 §8.2).

The server builds the card (name, description, skills, interfaces); this module only serves it.
``card_for`` receives the URL of the JSON-RPC endpoint as the client reached it, so the card
names an address that works from where the client stands. That URL comes from the request's
Host header: a card built from it is only ever shown to the client that sent that header. A
server behind a proxy is given its public URL instead, and every card names that.

Served with an ETag and a short ``Cache-Control`` (spec 1.0 §8.6.1), and no CORS headers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from urllib.parse import urljoin

import attrs
from quart import Response, request

from protocol import AgentCard, encode_json

CardFor = Callable[[str], AgentCard]
"""Given the URL the JSON-RPC endpoint is reached at, the card to serve."""

CACHE_CONTROL = "public, max-age=300"


@attrs.frozen
class CardEndpoint:
    card_for: CardFor
    rpc_path: str
    public_url: str | None = None

    async def handle(self) -> Response:
        base = request.host_url if self.public_url is None else self.public_url.rstrip("/") + "/"
        endpoint_url = urljoin(base, self.rpc_path.lstrip("/"))
        body = encode_json(self.card_for(endpoint_url).well_known_json())
        response = Response(body, status=200, content_type="application/json")
        response.headers["Cache-Control"] = CACHE_CONTROL
        response.headers["Vary"] = "Host"
        response.set_etag(hashlib.sha256(body).hexdigest(), weak=True)
        return response
