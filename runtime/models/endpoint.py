"""Where the model server is and how long to wait for it: ``ModelConfig``, and the reading of its
base URL.

A base URL can carry secrets (credentials before its ``@``, a key among its query values), so
what reads it lives here with what hides it: the checks an operator's URL must pass, the URL as it
may be shown, and the masking of those secrets in whatever a server or the transport says. None of
it sends anything; ``runtime.config`` checks an operator's settings with the same rules before any
client exists, and the client and its error classification read the secrets from here.
"""

from __future__ import annotations

import base64
import hashlib
from urllib.parse import SplitResult, unquote, unquote_plus, urlsplit, urlunsplit

import attrs

DEFAULT_BASE_URL = "http://127.0.0.1:11434/v1"  # a local Ollama
DEFAULT_MODEL = "qwen3:4b-instruct"


def _check_base_url(_instance: object, _attribute: object, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the model base URL must be an http:// or https:// URL with a host, for example {DEFAULT_BASE_URL}")
    if misplaced_at(url):
        raise ValueError(MISPLACED_AT)
    if port_unusable(parts):
        raise ValueError(f"the model base URL's port must be a whole number from 1 to 65535, for example {DEFAULT_BASE_URL}")


def port_unusable(parts: SplitResult) -> bool:
    """Whether a URL names a port no server listens on: past 65535, or 0 (which urlsplit takes)."""
    try:
        return parts.port == 0
    except ValueError:
        return True


MISPLACED_AT = (
    "it holds an '@' after its host: credentials holding '/', '?' or '#' must be percent-encoded"
    " (%2F, %3F, %23) to be read as credentials rather than as the host and path; an '@' meant in the path is"
    " written %40"
)


def misplaced_at(url: str) -> bool:
    """Whether ``url`` holds an '@' that is not the end of its credentials: one in its path,
    query or fragment, where a password written with a '/', '?' or '#' puts it."""
    parts = urlsplit(url)
    return "@" in parts.path or "@" in parts.query or "@" in parts.fragment


# Stands in for a character a URL parser drops (see without_credentials): a private-use one,
# which it keeps.
_HELD = 0xE000


def without_credentials(url: str) -> str:
    """``url`` as it may be shown: what it carries before an ``@`` (a user name can be a key
    too, and a password is one), and the values of its query (where some APIs take their key),
    replaced by ``***``. What a URL parser drops (a tab or a newline within it, control
    characters and spaces at either end) is shown where it was: the URL shown is the one given."""
    held = "".join(chr(_HELD + ord(c)) if c <= " " else c for c in url)
    return "".join(chr(ord(c) - _HELD) if _HELD <= ord(c) <= _HELD + 0x20 else c for c in _masked(held))


def _masked(url: str) -> str:
    try:
        scheme, slashes, rest = url.partition("//")
        if slashes and "@" in rest:
            # Up to the last '@', wherever it is: a password may hold a '/', '?' or '#' that
            # was not percent-encoded, and then urlsplit takes part of it for the path or query.
            url = f"{scheme}//***@{rest.rpartition('@')[2]}"
        parts = urlsplit(url)
        query = "&".join(f"{name.partition('=')[0]}=***" for name in parts.query.split("&")) if parts.query else ""
        return urlunsplit(parts._replace(query=query))
    except ValueError:
        return "(not shown: it cannot be read as a URL)"


def url_credentials(url: str) -> tuple[str, str]:
    """The user name and password ``url`` carries before its ``@``, decoded: what httpx sends
    as HTTP Basic auth when either is not empty. ``("", "")`` when it carries none."""
    parts = urlsplit(url)
    return unquote(parts.username or ""), unquote(parts.password or "")


@attrs.frozen
class ModelConfig:
    """Where the model is and how long to wait for it.

    ``read_timeout_s`` bounds each wait for data: for the answer to start, and between two
    pieces of it (keep-alive comments and events with empty data in a stream, and whitespace in
    a whole JSON answer, are not data). A bound on the whole call is the caller's
    ``trio.fail_after``. At most ``max_connections`` requests are open at once; the others wait
    their turn for as long as it takes (as a model server queues what it cannot run yet), never
    failing for it.
    """

    base_url: str = attrs.field(default=DEFAULT_BASE_URL, validator=_check_base_url, repr=without_credentials)
    model: str = attrs.field(default=DEFAULT_MODEL, validator=attrs.validators.min_len(1))
    api_key: str | None = attrs.field(default=None, repr=False)
    connect_timeout_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    read_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    max_retries: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    backoff_base_s: float = attrs.field(default=0.5, validator=attrs.validators.ge(0))
    backoff_max_s: float = attrs.field(default=8.0, validator=attrs.validators.ge(0))
    max_connections: int = attrs.field(default=100, validator=attrs.validators.ge(1))

    def __attrs_post_init__(self) -> None:
        # httpx would send the URL's credentials as HTTP Basic auth in place of the key.
        if self.api_key and any(url_credentials(self.base_url)):
            raise ValueError(
                "the model base URL carries credentials (before its '@') and an API key is given too: only one can be"
                " sent; take them out of the URL to send the key, or give no key to send them as HTTP Basic auth"
            )

    def url(self, path: str) -> str:
        """``path`` under the base URL, its query (where some APIs take a version) kept."""
        parts = urlsplit(self.base_url)
        return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{path}"))

    @property
    def endpoint(self) -> str:
        """The base URL without credentials or query, fit for a log line or an operator."""
        parts = urlsplit(self.base_url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"

    @property
    def server(self) -> str:
        """Which model server this is, as a transcript marks the answers it attached something to
        (``Message.via``): a digest of the origin of ``endpoint`` (its scheme, host and port), so
        that no address is stored with them. Not of its path, which one server may be given spelt
        two ways (with ``/v1`` or without, for DeepSeek's), and must not be taken for two: DeepSeek
        refuses a conversation whose calls come back without their reasoning."""
        parts = urlsplit(self.endpoint)
        return hashlib.sha256(f"{parts.scheme}://{parts.netloc}".encode()).hexdigest()[:16]

    def scrub(self, text: str) -> str:
        """``text`` (what a server or the transport said) with the secrets of this config masked,
        in each form a server may repeat them: the API key; the base URL's credentials as the
        HTTP Basic token they are sent as, as ``user:password`` (decoded or as written), and the
        password alone, or the user name alone when it comes without one (a key, then)."""
        for secret, mask in self._secrets():
            text = text.replace(secret, mask)
        return text

    def _secrets(self) -> list[tuple[str, str]]:
        found = [(self.api_key, "[api key]")] if self.api_key else []
        user, password = url_credentials(self.base_url)
        if user or password:
            parts = urlsplit(self.base_url)
            written_user, written_password = parts.username or "", parts.password or ""
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            alone = (password, written_password) if password else (user, written_user)
            candidates = (token, token.rstrip("="), f"{user}:{password}", f"{written_user}:{written_password}", *alone)
            found.extend((secret, "[credentials]") for secret in candidates if secret)
        # The values of its query (where some APIs take their key), as written and decoded:
        # sent with every request, and hidden wherever the URL is shown. A value too short to
        # be a key (``v=1``) is left, or every "1" of what the server said would be masked.
        query = urlsplit(self.base_url).query
        values = {form for pair in query.split("&") for form in (pair.partition("=")[2], unquote_plus(pair.partition("=")[2]))}
        found.extend((value, "[query value]") for value in sorted(values, key=len, reverse=True) if len(value) >= 8)
        return found
