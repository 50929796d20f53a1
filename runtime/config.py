"""One frozen Config, built at the edge from flags and AGENT_* variables.

Nothing below ``main`` reads the environment: the CLI builds a Config with ``Config.load`` and
passes it down. Every problem is collected, so ``python -m runtime check`` can print them all at
once; values of secrets never appear in a message. ``check`` also probes what only trying tells
(``Config.load(..., probe=True)``): that serve could listen on the host and create its state
directory, leaving nothing behind, with the room there that ``/healthz`` wants, and use the
databases there (read only, making nothing beside them where no server has them open).
"""

from __future__ import annotations

import difflib
import errno
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit

import attrs

from persistence.databases import SCHEMAS, check_servable, check_together
from persistence.errors import StoreError
from persistence.recovery import check_recoverable
from persistence.refusals import (
    WORKING_DIRECTORY_GONE,
    cannot_create,
    not_a_directory,
    not_a_directory_to_use,
    not_under,
    unreachable,
    working_directory_gone,
    write_refused,
)
from persistence.snapshot import anothers_backup_root
from persistence.statedir import SnapshotError, UnusableStateDir, nearest_existing, require_writable, too_full, try_state_dir
from runtime.models import DEFAULT_BASE_URL, DEFAULT_MODEL, url_credentials, without_credentials
from runtime.models.endpoint import MISPLACED_AT, misplaced_at, port_unusable

ORPHAN_POLICIES = ("resume", "fail")
MODEL_CHECKS = ("catalog", "off")  # what /healthz asks of the model server


class ConfigError(Exception):
    """Every problem found in the configuration, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("the configuration has problems:\n" + "\n".join(f"  - {p}" for p in problems))


@attrs.frozen
class Setting:
    field: str  # the Config attribute
    env: str  # its AGENT_* variable
    parse: Callable[[str], Any]
    flag: str | None  # its serve flag, or None for environment-only settings
    help: str
    secret: bool = False  # its value is never shown
    show: Callable[[str], str] = str  # how its value is shown (in `check`, and in problems)
    # What only trying tells about a parsed value (`check` runs it): raises ValueError saying
    # what is wrong, and leaves nothing behind.
    probe: Callable[[Any], None] | None = None


MAX_COUNT = 1_000_000  # far past any sensible count of model calls or connections


# Plain ASCII decimals: Python's int() and float() also read "1_000" and other scripts' digits,
# which no other program reading the same environment would take for these numbers.
WHOLE_NUMBER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _whole(text: str, low: int, high: int, what: str) -> int:
    text = text.strip()
    value = int(text) if WHOLE_NUMBER.fullmatch(text) else low - 1
    if not low <= value <= high:
        raise ValueError(what)
    return value


def _port(text: str) -> int:
    return _whole(text, 0, 65535, "a port is a whole number from 1 to 65535 (0 picks any free port)")


def _positive_int(text: str) -> int:
    return _whole(text, 1, MAX_COUNT, f"it must be a whole number from 1 to {MAX_COUNT}")


def _positive_float(text: str) -> float:
    text = text.strip()
    value = float(text) if _DECIMAL.fullmatch(text) else 0.0
    if not 0 < value < float("inf"):
        raise ValueError("it must be a finite number of seconds greater than 0")
    return value


def _url(text: str) -> str:
    if not _bare(text).isprintable():  # a URL parser drops a tab or a newline, and shows the URL without it
        raise ValueError("it holds a control character (a newline or a tab, say); remove it")
    parts = _split(text, "http://[::1]:11434/v1")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"it must be an http:// or https:// URL with a host, like {DEFAULT_BASE_URL}")
    if misplaced_at(text):
        raise ValueError(MISPLACED_AT)
    if port_unusable(parts):
        raise ValueError(f"its port must be a whole number from 1 to 65535, like {DEFAULT_BASE_URL}")
    return text.rstrip("/")


def _split(text: str, like: str) -> SplitResult:
    try:
        return urlsplit(text)
    except ValueError:  # a bracket that does not pair up ("Invalid IPv6 URL", in Python's words)
        raise ValueError(f"it cannot be read as a URL; write an IPv6 address in brackets, like {like}") from None


def _model_url(text: str) -> str:
    url = _url(text)
    if urlsplit(url).path.endswith("/chat/completions"):  # where Keel sends its requests, under the base
        raise ValueError(
            f"it ends with /chat/completions, which Keel adds itself; give the API's base URL, like {DEFAULT_BASE_URL}"
        )
    return url


def _public_url(text: str) -> str:
    parts = _split(text, "https://[::1]:8443/keel")
    # An '@' with nothing before it, or a password alone (`https://:pw@host`), is no user name
    # to urlsplit; and an empty query or fragment would be shown without its '?' or '#'.
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc or "?" in text or "#" in text:
        raise ValueError(
            "it must be an http:// or https:// URL with a host, and no credentials or query, like https://agents.example/keel"
        )
    return _url(text)


def _state_dir(text: str) -> Path:
    """A directory this user can write in, or one it can create (nothing is created here). Said
    in the words serve and the state commands use for a state directory they cannot use."""
    path = directory_given(text)
    try:
        return _writable_dir(path)
    except OSError as exc:  # a parent this user may not search, a name too long...
        raise ValueError(unreachable(path, exc)) from None


def _writable_dir(path: Path) -> Path:
    existing = nearest_existing(path)
    if existing == path.absolute():
        if why := not_a_directory(existing):
            raise ValueError(why)
        if why := write_refused(existing):
            raise ValueError(f"no file can be made in it ({why})")
        return path
    if not existing.is_dir():
        raise ValueError(not_under(existing))
    if why := write_refused(existing):
        raise ValueError(cannot_create(existing, why))
    return path


def preflight(state_dir: Path, *, thorough: bool = False) -> list[str]:
    """Refuse databases (with their SQLite files) this user may not read and write, and those
    this build cannot use, reading only (StoreError for one, and an ExceptionGroup of them when
    both are, so that each is named at once), and one missing or empty beside one that holds
    state; say, a line each, those an older build left, which serve brings up to date
    as it opens them. ``thorough``: damaged ones too, read whole (``check_servable``). Blocking: run
    it in a thread."""
    require_writable(state_dir, [name + suffix for name in SCHEMAS for suffix in ("", "-wal", "-shm")])
    unusable: list[StoreError] = []
    older = []
    versions = {}
    for name, schema in SCHEMAS.items():
        try:
            version = versions[name] = check_servable(state_dir / name, name, thorough=thorough)
        except StoreError as exc:
            unusable.append(exc)
            continue
        if 0 < version < schema.version:
            older.append(
                f"{name} holds {schema.name}@{version}; serve brings it up to {schema.name}@{schema.version} as it opens it,"
                " and an older build cannot open it after that"
            )
    if len(unusable) > 1:
        raise ExceptionGroup("databases this build cannot use", unusable)
    if unusable:
        raise unusable[0]
    check_together(state_dir, versions)
    return older


def _can_make_state_dir(path: Path) -> None:
    """What serve will do, tried, leaving nothing behind (persistence.statedir.try_state_dir);
    the room left there, which /healthz wants; what a restore cut short left, checked as serve's
    recovery checks it (moving nothing); and its databases read as serve's preflight reads them
    (making nothing beside them where no server has them open)."""
    try:
        try_state_dir(path)
        if why := too_full(nearest_existing(path)):
            raise ValueError(f"it is {why}")
        check_recoverable(path)  # what serve does first: finish or roll back a restore cut short
        preflight(path, thorough=True)  # and what only reading them whole finds: a damaged page
    except UnusableStateDir as exc:
        raise ValueError(exc.why) from None
    except StoreError as exc:  # a database this build cannot use (SchemaError), or cannot read now
        raise ValueError(str(exc)) from None
    except ExceptionGroup as group:  # both databases (preflight)
        raise ValueError("; ".join(map(str, group.exceptions))) from None


def os_error_text(exc: OSError) -> str:
    """An OSError in plain words, without its errno: ``[Errno 20] Not a directory: 'x/y'`` reads
    ``x/y: Not a directory``. One made with a message of its own is that message."""
    if exc.errno is None or not exc.strerror:
        return str(exc)
    paths = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    return f"{' -> '.join(paths)}: {exc.strerror}" if paths else exc.strerror


def _can_listen_on(host: str) -> None:
    """Bind a socket to the host as serve's HTTP server binds it, on a port the system picks: a
    name that does not resolve, or an address that is not this machine's, fails here as it
    would there. The port is serve's to try: another process may hold it now (a server this one
    is to replace) and not then."""
    try:
        _bind(host, 0)
    except OSError as exc:  # socket.gaierror included: a name that does not resolve
        raise ValueError(f"serve could not listen on it ({exc.strerror or exc})") from None


def _may_listen_at(host: str, port: int) -> None:
    """Bind the port itself on the host, as serve will: a port this user may not listen on (one
    below 1024, say) fails here as it would there. A port another process holds now passes: it
    may be a server this one is to replace, gone by the time serve starts."""
    if port == 0:
        return
    try:
        _bind(host, port)
    except OSError as exc:
        if exc.errno == errno.EACCES:
            raise ValueError(
                f"serve could not listen on it ({exc.strerror}; ports below 1024 need privileges): choose another"
                " port, or give the server the privilege (CAP_NET_BIND_SERVICE)"
            ) from None


def _bind(host: str, port: int) -> None:
    """Bind a socket as serve's HTTP server binds one (brackets dropped; IPv6 when the host
    holds a colon), and close it."""
    bare = host.replace("[", "").replace("]", "")
    with socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bare, port))


def _non_empty(text: str) -> str:
    if not text.strip():
        raise ValueError("it must not be empty")
    return text


UNEXPANDED_HOME = "it starts with '~', which only a shell expands, to a home directory; give the whole path"
SURROUNDING_SPACE = "it starts or ends with white space (a file read with its newline?); remove it"


def directory_given(text: str) -> Path:
    """A directory as a setting names it, refused where it would name another than the one
    meant: with white space at either end, or starting with a ``~`` no shell expanded (a
    service manager's environment, say); and a relative one where there is no working directory
    to find it in (removed, as a release directory a deploy replaced)."""
    if _bare(text).startswith("~"):
        raise ValueError(UNEXPANDED_HOME)
    path = Path(text)
    if working_directory_gone(path):
        raise ValueError(WORKING_DIRECTORY_GONE)
    return path


def _bare(text: str) -> str:
    """Text that is not empty and has no white space at either end: a value read from a file
    with its newline would otherwise name another directory, address or model than the one meant."""
    if _non_empty(text) != text.strip():
        raise ValueError(SURROUNDING_SPACE)
    return text


HOST_SHAPE = (
    "it must be a host name or an IP address, like 127.0.0.1, ::1 or [::1], with no scheme, path or port"
    " (the port is AGENT_PORT, or --port)"
)


def _host(text: str) -> str:
    """A name or an address to listen on, as serve's HTTP server reads it: a socket path or an
    inherited descriptor (hypercorn's ``unix:PATH`` and ``fd://N`` binds) is not one, nor an
    address with a port, which serve would join to its own. Only an IPv6 address holds a colon."""
    inner = text[1:-1] if _bare(text).startswith("[") and text.endswith("]") else text
    if any(c in inner for c in "[]/"):
        raise ValueError(HOST_SHAPE)
    if ":" in inner:
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise ValueError(HOST_SHAPE) from None
    return text


def _api_key(text: str) -> str:
    """A key that can be sent as it is in an Authorization header. What is wrong with one is
    said without showing it."""
    _bare(text)
    if not text.isascii() or not text.isprintable():
        raise ValueError("it holds a character an HTTP header cannot carry (a control character, or one outside ASCII)")
    if text.lower().startswith("bearer "):  # it would go as "Bearer Bearer ..." and be refused
        raise ValueError("it starts with 'Bearer ', which Keel sends itself; give the key alone")
    return text


MAX_KEY_FILE_BYTES = 64 << 10  # far past any key; a file larger is not a key file


def _key_file(text: str) -> Path:
    return Path(_bare(text))


def read_key_file(path: Path) -> str:
    """The key a key file holds (a Docker or Kubernetes secret, a systemd credential): its text,
    less the one line end that ``echo`` or an editor leaves after it. What is wrong with the key
    is said without showing it. Blocking; read once, as serve starts."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"it cannot be read ({os_error_text(exc)})") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"it holds more than {MAX_KEY_FILE_BYTES >> 10} KiB; a key file holds the key alone")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ValueError("it holds bytes that are not UTF-8 text; a key file holds the key alone, as text") from None
    key = text.removesuffix("\n").removesuffix("\r")
    bare = key.strip()
    if not bare:
        raise ValueError("it holds no key; write the key in it")
    # Said of the file's text: _api_key would take a second line for a control character, and a
    # space for a path read with its newline.
    if "\n" in bare or "\r" in bare:
        raise ValueError("it holds more than one line; write the key alone in it, on one line")
    if key != bare:
        raise ValueError("the key in it starts or ends with white space; remove it (one line end after the key is allowed)")
    return _api_key(key)


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"it must be one of: {', '.join(choices)}")
        return text

    return parse


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "AGENT_HOST", _host, "--host", "address to listen on", probe=_can_listen_on),
    Setting("port", "AGENT_PORT", _port, "--port", "port to listen on (0: any free port)"),
    Setting("state_dir", "AGENT_STATE_DIR", _state_dir, "--state-dir", "where the databases live", probe=_can_make_state_dir),
    Setting(
        "model_base_url", "AGENT_MODEL_BASE_URL", _model_url, "--model-base-url", "an OpenAI-compatible API",
        show=without_credentials,
    ),  # fmt: skip
    Setting("model", "AGENT_MODEL", _bare, "--model", "the model to ask"),
    Setting(
        "public_url", "AGENT_PUBLIC_URL", _public_url, "--public-url",
        "where clients reach this server, for the agent card (behind a proxy); unset: the address a request came in on",
        show=without_credentials,
    ),  # fmt: skip
    Setting("model_api_key", "AGENT_MODEL_API_KEY", _api_key, None, "bearer token for the model API", secret=True),
    Setting(
        "model_api_key_file", "AGENT_MODEL_API_KEY_FILE", _key_file, "--model-api-key-file",
        "a file holding the bearer token for the model API in place of AGENT_MODEL_API_KEY (read as serve starts)",
    ),  # fmt: skip
    Setting("drain_timeout_s", "AGENT_DRAIN_TIMEOUT_S", _positive_float, "--drain-timeout-s", "how long runs may finish after SIGTERM or SIGINT"),
    Setting("max_model_calls", "AGENT_MAX_MODEL_CALLS", _positive_int, "--max-model-calls", "model calls one turn may make"),
    Setting(
        "model_timeout_s", "AGENT_MODEL_TIMEOUT_S", _positive_float, "--model-timeout-s",
        "how long the model may send nothing (keep-alives are nothing): before its answer starts, or between two pieces of it",
    ),  # fmt: skip
    Setting(
        "model_connect_timeout_s", "AGENT_MODEL_CONNECT_TIMEOUT_S", _positive_float, "--model-connect-timeout-s",
        "how long a connection to the model server may take to be made (its name looked up and a TLS handshake included)",
    ),  # fmt: skip
    Setting(
        "max_model_connections", "AGENT_MAX_MODEL_CONNECTIONS", _positive_int, "--max-model-connections",
        "model requests open at once; more wait their turn",
    ),  # fmt: skip
    Setting(
        "orphans", "AGENT_ORPHANS", _one_of(ORPHAN_POLICIES), "--orphans",
        "what to do with tasks a dead process left running: resume or fail",
    ),  # fmt: skip
    Setting(
        "model_check", "AGENT_MODEL_CHECK", _one_of(MODEL_CHECKS), "--model-check",
        "what /healthz asks of the model server: catalog (that its catalog offers the model) or off (nothing: a server"
        " whose catalog lists other names than requests give, as Azure OpenAI's deployments, or that has none)",
    ),  # fmt: skip
    Setting(
        "send_timeout_s", "AGENT_SEND_TIMEOUT_S", _positive_float, "--send-timeout-s",
        "how long a client may take none of what it is sent before its connection is closed",
    ),  # fmt: skip
    Setting(
        "keep_alive_s", "AGENT_KEEP_ALIVE_S", _positive_float, "--keep-alive-s",
        "how long a client connection may wait idle for its next request; behind a proxy, more than the proxy's own",
    ),  # fmt: skip
)


@attrs.frozen
class Config:
    host: str = "127.0.0.1"
    port: int = 8080
    state_dir: Path = Path(".state")
    model_base_url: str = attrs.field(default=DEFAULT_BASE_URL, repr=without_credentials)
    model: str = DEFAULT_MODEL
    model_api_key: str | None = attrs.field(default=None, repr=False)
    model_api_key_file: Path | None = None  # where model_api_key was read from, if from a file
    drain_timeout_s: float = 10.0
    max_model_calls: int = 12
    max_model_connections: int = 100
    model_timeout_s: float = 60.0
    model_connect_timeout_s: float = 5.0
    public_url: str | None = None
    orphans: str = "resume"
    model_check: str = "catalog"
    send_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    cleanup_timeout_s: float = 5.0  # bound on every shielded write of a terminal state

    @classmethod
    def load(cls, env: Mapping[str, str], flags: Mapping[str, str | None] | None = None, *, probe: bool = False) -> Config:
        """Build from environment variables, each overridden by its flag when given.

        ``flags`` maps Config field names to the text given on the command line. Unknown
        AGENT_* variables are problems too (a misspelt setting must not be silently ignored).
        With ``probe``, each value read (the default ones too) is also tried as serve will use it.
        Raises ConfigError listing every problem.
        """
        flags = flags or {}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        problems: dict[str, str] = {}  # by field
        defaults = cls()
        for setting in SETTINGS:
            given = flags.get(setting.field)
            source = setting.flag if given is not None and setting.flag is not None else setting.env
            text = given if given is not None else env.get(setting.env)
            sources[setting.field] = source
            try:
                if text is not None and not text.strip():  # a compose file's `${VAR:-}`, say: meant as not set
                    undo = "leave the flag out" if given is not None else "unset it"
                    raise ValueError(f"it must not be empty; {undo} to use its default")
                if text is not None:
                    values[setting.field] = setting.parse(text)
                if probe and setting.probe is not None:
                    setting.probe(values.get(setting.field, getattr(defaults, setting.field)))
            except ValueError as exc:
                said = str(getattr(defaults, setting.field)) if text is None else text  # a default is probed too
                shown = "(hidden)" if setting.secret else repr(setting.show(said))
                unset = " (the default: it is not set)" if text is None else ""
                problems[setting.field] = f"{source}={shown}{unset} is not valid: {exc}"
        if probe and not problems.keys() & {"host", "port"}:
            port = values.get("port", defaults.port)
            try:
                _may_listen_at(values.get("host", defaults.host), port)
            except ValueError as exc:
                problems["port"] = f"{sources['port']}={str(port)!r} is not valid: {exc}"
        key_file = values.get("model_api_key_file")
        key_from = sources["model_api_key" if key_file is None else "model_api_key_file"]
        drop_key = f"unset {key_from}" if key_from.startswith(SETTING_PREFIX) else f"leave out {key_from}"
        if key_file is not None:
            if "model_api_key" in values or "model_api_key" in problems:
                problems["model_api_key_file"] = (
                    f"AGENT_MODEL_API_KEY and {key_from} are both set; give the key one way: unset AGENT_MODEL_API_KEY"
                    f" or {drop_key}"
                )
            else:
                try:
                    values["model_api_key"] = read_key_file(key_file)
                except ValueError as exc:
                    problems["model_api_key_file"] = f"{key_from}={str(key_file)!r} is not valid: {exc}"
        found = list(problems.values())
        url = values.get("model_base_url")
        if url is not None and values.get("model_api_key") is not None and any(url_credentials(url)):
            # httpx would send them as HTTP Basic auth, and the key would never be sent.
            found.append(
                f"{sources['model_base_url']}={without_credentials(url)!r} is not valid with {key_from} set: it"
                " carries credentials (before its '@'), which would be sent in place of the key; take them out of the URL"
                f" to send the key, or {drop_key} to send them (HTTP Basic auth)"
            )
        found.extend(unknown_settings(env))
        if found:
            raise ConfigError(found)
        return cls(**values)


def unknown_settings(env: Mapping[str, str]) -> list[str]:
    """The problems of variables meant as settings of Keel's that are none: in the wrong case
    (`agent_state_dir`), or misspelt (`AGENT_STATE_DRI`). Ignored, they would leave their setting
    at its default: a state directory of `.state` in the current directory, say."""
    return [f"{name} is not a setting Keel knows; did you mean {meant}?" for name, meant in _not_settings(env) if meant]


def foreign_settings(env: Mapping[str, str]) -> list[str]:
    """The AGENT_* variables like no setting of Keel's: another program's (Azure Pipelines sets
    AGENT_OS, AGENT_NAME and more in every job), ignored, and said to be (``check``, ``serve``)."""
    return [name for name, meant in _not_settings(env) if not meant]


def ignored(name: str) -> str:
    """What ``check`` and the state commands note of a variable ``foreign_settings`` gives."""
    return f"{name} is not a setting Keel knows, nor like one: it is ignored"


def _not_settings(env: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    """Each variable named as a setting would be that is none, with the setting it is most like
    ("" if none)."""
    known = {s.env for s in SETTINGS} | EXTRA_KNOWN
    meant_by = {name.removeprefix(SETTING_PREFIX): name for name in known}
    for name in sorted(env):
        if name in known:
            continue
        if name.upper() in known:
            yield name, name.upper()
        elif name.startswith(SETTING_PREFIX):
            # Like a setting's name after the prefix they share: the prefix alone makes every
            # AGENT_* look like one.
            close = difflib.get_close_matches(name.removeprefix(SETTING_PREFIX), meant_by, n=1, cutoff=0.7)
            yield name, meant_by[close[0]] if close else ""


SETTING_PREFIX = "AGENT_"


BACKUP_ROOT_ENV = "AGENT_BACKUP_ROOT"  # read by `state snapshot`, shown and checked by `check`

# AGENT_* variables read by other commands (state snapshots), valid in the environment too.
EXTRA_KNOWN = {BACKUP_ROOT_ENV}


def default_backup_root(state_dir: Path) -> Path:
    """Where snapshots of ``state_dir`` go unless told otherwise: beside it, ``<state-dir>-backups``."""
    absolute = state_dir.absolute()
    return absolute.parent / f"{absolute.name}-backups"


def backup_root(env: Mapping[str, str], state_dir: Path | None) -> Path | None:
    """Where ``state snapshot`` puts snapshots without ``--backup-root``: AGENT_BACKUP_ROOT, else
    the default beside ``state_dir`` (None when the state directory is not known). Raises
    ValueError for a value snapshot would refuse: empty, or inside the state directory."""
    text = env.get(BACKUP_ROOT_ENV)
    if text is None:
        return None if state_dir is None else default_backup_root(state_dir)
    if not text.strip():
        raise ValueError("it must not be empty; unset it for the default, <state-dir>-backups beside the state directory")
    root = directory_given(text)
    if why := not_a_directory_to_use(root):
        raise ValueError(why)
    if state_dir is not None and Path(os.path.realpath(root)).is_relative_to(os.path.realpath(state_dir)):
        raise ValueError("it is inside the state directory; snapshots must go outside it")
    try:
        theirs = None if state_dir is None else anothers_backup_root(root, state_dir)
    except SnapshotError as exc:
        raise ValueError(str(exc)) from exc
    if theirs:
        raise ValueError(f"it holds the snapshots of another state directory, {theirs}; give each state directory its own")
    return root
