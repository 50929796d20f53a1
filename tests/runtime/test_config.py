"""Configuration: built at the edge, every problem reported at once, secrets never shown."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.agents import app_version
from runtime.config import Config, ConfigError, foreign_settings, without_credentials


def test_config_defaults_match_a_local_ollama() -> None:
    config = Config.load({})
    assert (config.host, config.port, config.state_dir) == ("127.0.0.1", 8080, Path(".state"))
    assert (config.model_base_url, config.model) == ("http://127.0.0.1:11434/v1", "qwen3:4b-instruct")
    assert (config.drain_timeout_s, config.max_model_calls, config.orphans) == (10.0, 12, "resume")
    assert (config.send_timeout_s, config.max_model_connections) == (30.0, 100)
    assert Config.load({"AGENT_MAX_MODEL_CONNECTIONS": "4"}).max_model_connections == 4
    assert (config.model_timeout_s, Config.load({}, {"model_timeout_s": "300"}).model_timeout_s) == (60.0, 300.0)
    assert config.model_connect_timeout_s == 5.0
    assert Config.load({"AGENT_MODEL_CONNECT_TIMEOUT_S": "0.5"}).model_connect_timeout_s == 0.5
    assert Config.load({"AGENT_MODEL_CONNECT_TIMEOUT_S": "0.5"}, {"model_connect_timeout_s": "20"}).model_connect_timeout_s == 20.0


def test_config_flags_override_their_environment_variables() -> None:
    env = {"AGENT_PORT": "9001", "AGENT_MODEL": "from-env", "AGENT_MAX_MODEL_CALLS": "3"}
    config = Config.load(env, {"port": "9002", "model": None})
    assert (config.port, config.model, config.max_model_calls) == (9002, "from-env", 3)


def test_config_reports_every_problem_at_once_and_hides_secrets() -> None:
    env = {
        "AGENT_PORT": "eighty",
        "AGENT_DRAIN_TIMEOUT_S": "-1",
        "AGENT_ORPHANS": "ignore",
        "AGENT_MODEL_BASE_URL": "ftp://models",
        "AGENT_MODEL_API_KEY": " ",
        "AGENT_MODLE": "typo",
        "AGENT_SEND_TIMEOUT_S": "0",
    }
    with pytest.raises(ConfigError) as caught:
        Config.load(env)
    problems = caught.value.problems
    assert len(problems) == 7
    text = str(caught.value)
    for words in (
        "AGENT_PORT='eighty'", "AGENT_DRAIN_TIMEOUT_S", "AGENT_SEND_TIMEOUT_S='0'", "resume, fail", "http:// or https://",
        "did you mean AGENT_MODEL?",
    ):  # fmt: skip
        assert words in text
    assert "AGENT_MODEL_API_KEY=(hidden)" in text


def test_the_model_check_is_the_catalog_unless_turned_off() -> None:
    assert (Config.load({}).model_check, Config.load({}, {"model_check": "off"}).model_check) == ("catalog", "off")
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_MODEL_CHECK": "none"})
    assert "AGENT_MODEL_CHECK='none' is not valid: it must be one of: catalog, off" in str(caught.value)


@pytest.mark.parametrize("given", ["0", "1000001", "many", "1_000", "\uff11\uff12", "\u0661\u0662"])
def test_a_count_out_of_range_is_refused_naming_the_range(given: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_MAX_MODEL_CALLS": given})
    assert f"AGENT_MAX_MODEL_CALLS={given!r} is not valid: it must be a whole number from 1 to 1000000" in str(caught.value)


@pytest.mark.parametrize("given", ["inf", "nan", "-1", "0", "soon", "1_0", "\uff11.5", "1e999"])
def test_a_timeout_must_be_a_finite_number_of_seconds_and_says_so(given: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_SEND_TIMEOUT_S": given})
    assert f"AGENT_SEND_TIMEOUT_S={given!r} is not valid: it must be a finite number of seconds greater than 0" in str(caught.value)


@pytest.mark.parametrize(("given", "read"), [(" 12 ", 12.0), ("0.5", 0.5), (".25", 0.25), ("3.", 3.0), ("2e1", 20.0)])
def test_a_timeout_is_read_as_a_plain_decimal_number(given: str, read: float) -> None:
    assert Config.load({"AGENT_SEND_TIMEOUT_S": given}).send_timeout_s == read


@pytest.mark.parametrize("setting", ["AGENT_MODEL_BASE_URL", "AGENT_PUBLIC_URL"])
@pytest.mark.parametrize("port", ["0", "99999"])
def test_a_url_whose_port_no_server_listens_on_is_refused_naming_the_range(setting: str, port: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Config.load({setting: f"http://127.0.0.1:{port}/v1"})
    assert f"{setting}='http://127.0.0.1:{port}/v1' is not valid: its port must be a whole number from 1 to 65535" in str(
        caught.value
    )


def test_config_never_prints_the_api_key() -> None:
    config = Config.load({"AGENT_MODEL_API_KEY": "sk-very-secret"})
    assert config.model_api_key == "sk-very-secret"
    assert "sk-very-secret" not in repr(config)


def test_config_never_prints_the_credentials_or_query_values_of_the_model_url() -> None:
    config = Config.load({"AGENT_MODEL_BASE_URL": "https://keel:pa55w0rd@models.example/v1?token=q-secret-1"})
    assert config.model_base_url == "https://keel:pa55w0rd@models.example/v1?token=q-secret-1"
    shown = repr(config)
    assert "pa55w0rd" not in shown and "keel:" not in shown and "q-secret-1" not in shown
    assert "models.example/v1?token=***" in shown


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    return subprocess.run(
        [sys.executable, "-m", "runtime", *args], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )


def test_check_command_prints_every_problem_and_exits_1() -> None:
    result = run_cli("check", "--port", "0x50", env={"AGENT_MAX_MODEL_CALLS": "0", "AGENT_MODEL_API_KEY": "sk-secret-1"})
    assert result.returncode == 1
    assert "--port='0x50'" in result.stderr and "AGENT_MAX_MODEL_CALLS='0'" in result.stderr
    assert "sk-secret-1" not in result.stderr + result.stdout


def test_check_command_accepts_a_good_configuration_without_echoing_secrets() -> None:
    result = run_cli("check", env={"AGENT_MODEL_API_KEY": "sk-secret-2", "AGENT_PORT": "8181"})
    assert result.returncode == 0, result.stderr
    assert "AGENT_PORT=8181" in result.stdout and "AGENT_MODEL_API_KEY=(set)" in result.stdout
    assert "sk-secret-2" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://127.0.0.1:11434/v1", "http://127.0.0.1:11434/v1"),
        ("https://keel:s3cret@models.example/v1", "https://***@models.example/v1"),
        ("https://sk-live-abc123@models.example/v1", "https://***@models.example/v1"),  # a key as the user name
        ("https://models.example/v1?key=s3cret&region=eu", "https://models.example/v1?key=***&region=***"),
        ("http://[::1]:11434/v1", "http://[::1]:11434/v1"),
    ],
)
def test_a_model_url_is_shown_without_its_credentials(url: str, shown: str) -> None:
    assert without_credentials(url) == shown


def test_check_command_shows_the_model_url_without_its_password_or_query() -> None:
    result = run_cli("check", env={"AGENT_MODEL_BASE_URL": "https://keel:pw-secret-3@models.example/v1?key=q-secret-4"})
    assert result.returncode == 0, result.stderr
    assert "AGENT_MODEL_BASE_URL=https://***@models.example/v1?key=***" in result.stdout
    result = run_cli("check", env={"AGENT_MODEL_BASE_URL": "https://keel:pw-secret-5@models.example:99999/v1"})
    assert result.returncode == 1
    assert "AGENT_MODEL_BASE_URL='https://***@models.example:99999/v1' is not valid: its port" in result.stderr
    assert "secret" not in result.stdout + result.stderr


def test_a_state_directory_that_is_a_file_or_under_one_is_a_problem(tmp_path: Path) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("not a directory")
    for state_dir, words in (
        (afile, f"AGENT_STATE_DIR='{afile}' is not valid: it is a file, not a directory"),
        (afile / "state", f"AGENT_STATE_DIR='{afile / 'state'}' is not valid: {afile} is a file, so no directory can be made under it"),
    ):
        with pytest.raises(ConfigError) as caught:
            Config.load({"AGENT_STATE_DIR": str(state_dir)})
        assert caught.value.problems == [words]
    fresh = tmp_path / "a" / "b"
    assert Config.load({"AGENT_STATE_DIR": str(fresh)}).state_dir == fresh
    assert not (tmp_path / "a").exists()  # checking creates nothing


def test_a_public_url_is_an_address_clients_can_reach() -> None:
    assert Config.load({"AGENT_PUBLIC_URL": "https://agents.example/keel/"}).public_url == "https://agents.example/keel"
    assert Config.load({}).public_url is None
    for bad in ("agents.example", "https://agents.example/?x=1", "https://user:pw@agents.example/"):
        with pytest.raises(ConfigError) as caught:
            Config.load({"AGENT_PUBLIC_URL": bad})
        assert "no credentials or query, like https://agents.example/keel" in str(caught.value)
        assert "pw" not in str(caught.value)


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("sk-from-a-file\n", "starts or ends with white space"),
        (" sk-pasted", "starts or ends with white space"),
        ("sk-s\u00e9cret", "a character an HTTP header cannot carry"),
        ("sk-tab\there", "a character an HTTP header cannot carry"),
        ("Bearer sk-whole-header", "starts with 'Bearer ', which Keel sends itself"),
    ],
)
def test_an_api_key_no_http_header_can_carry_is_refused_without_showing_it(key: str, said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_MODEL_API_KEY": key})
    assert caught.value.problems == [f"AGENT_MODEL_API_KEY=(hidden) is not valid: {caught.value.problems[0].split(': ', 1)[1]}"]
    assert said in str(caught.value) and key.strip() not in str(caught.value)


def test_a_default_that_will_not_do_is_said_to_be_the_default_not_a_value_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".state").write_text("not a directory")
    with pytest.raises(ConfigError) as caught:
        Config.load({}, probe=True)
    assert [problem.split(" is not valid")[0] for problem in caught.value.problems] == [
        "AGENT_STATE_DIR='.state' (the default: it is not set)"
    ]


def test_a_state_directory_starting_with_a_tilde_no_shell_expanded_is_refused_rather_than_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="AGENT_STATE_DIR='~/keel' is not valid: it starts with '~', which only a shell expands"):
        Config.load({"AGENT_STATE_DIR": "~/keel"}, probe=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "variable", ["AGENT_HOST", "AGENT_STATE_DIR", "AGENT_MODEL", "AGENT_MODEL_BASE_URL", "AGENT_PUBLIC_URL"]
)
def test_a_value_read_from_a_file_with_its_newline_is_refused_rather_than_taken_for_another(
    tmp_path: Path, variable: str
) -> None:
    # A secret mounted as a file keeps its newline: the state went to a directory named with it,
    # the agent card gave clients a URL ending in it, the model was asked for a name with it.
    meant = {
        "AGENT_HOST": "127.0.0.1", "AGENT_STATE_DIR": str(tmp_path / "state"), "AGENT_MODEL": "qwen3:4b-instruct",
        "AGENT_MODEL_BASE_URL": "http://127.0.0.1:11434/v1", "AGENT_PUBLIC_URL": "https://agents.example/keel",
    }[variable]  # fmt: skip
    given = meant + "\n"
    with pytest.raises(ConfigError) as caught:
        Config.load({variable: given})
    assert caught.value.problems == [
        f"{variable}={given!r} is not valid: it starts or ends with white space (a file read with its newline?); remove it"
    ]
    assert not (tmp_path / "state\n").exists()


def test_a_url_holding_a_control_character_is_refused_rather_than_shown_without_it() -> None:
    # A URL parser drops a tab or a newline inside a URL: `check` showed the URL without it, and
    # the agent card gave clients the URL with it.
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_PUBLIC_URL": "https://agents.\texample/keel"})
    assert caught.value.problems == [
        "AGENT_PUBLIC_URL='https://agents.\\texample/keel' is not valid: it holds a control character (a newline or a tab,"
        " say); remove it"
    ]


@pytest.mark.parametrize("host", ["unix:/run/keel.sock", "fd://3", "localhost:8080", "[::1]:8080", "[::1", "http://127.0.0.1"])
def test_a_host_that_is_a_socket_path_a_descriptor_or_carries_a_port_is_refused_saying_what_a_host_is(host: str) -> None:
    # serve's HTTP server read `unix:PATH` as a socket path (it listened on PATH:8080) and
    # `fd://N` as a descriptor (a traceback), and joined a port given here to its own.
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_HOST": host})
    assert caught.value.problems == [
        f"AGENT_HOST={host!r} is not valid: it must be a host name or an IP address, like 127.0.0.1, ::1 or [::1], with no"
        " scheme, path or port (the port is AGENT_PORT, or --port)"
    ]


@pytest.mark.parametrize("host", ["::1", "[::1]", "0.0.0.0", "::", "localhost", "127.0.0.1"])
def test_a_host_name_or_an_ip_address_bare_or_in_brackets_is_taken_as_given(host: str) -> None:
    assert Config.load({"AGENT_HOST": host}).host == host


def test_serve_refuses_a_host_it_would_read_as_a_descriptor_without_a_traceback(tmp_path: Path) -> None:
    result = run_cli("serve", "--host", "fd://3", "--state-dir", str(tmp_path / "state"), env={})
    assert result.returncode == 1, result.stdout
    assert result.stderr.startswith("error: the configuration has problems:\n  - --host='fd://3' is not valid: it must be")
    assert "Traceback" not in result.stderr and not (tmp_path / "state").exists()


def test_a_state_directory_that_cannot_be_reached_is_a_problem_with_the_others(tmp_path: Path) -> None:
    unreachable = tmp_path / ("x" * 300) / "state"  # a name longer than the file system takes
    result = run_cli("check", env={"AGENT_STATE_DIR": str(unreachable), "AGENT_PORT": "99999"})
    assert result.returncode == 1, result.stderr
    assert f"AGENT_STATE_DIR='{unreachable}' is not valid: it cannot be reached (File name too long)" in result.stderr
    assert "AGENT_PORT='99999'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("by_flag", [True, False], ids=["flag", "environment"])
def test_a_model_url_carrying_credentials_beside_an_api_key_is_refused_without_showing_them(by_flag: bool) -> None:
    url = "http://bob:pa55w0rd@127.0.0.1:8000/v1"
    env = {"AGENT_MODEL_API_KEY": "sk-RIGHTKEY"} | ({} if by_flag else {"AGENT_MODEL_BASE_URL": url})
    with pytest.raises(ConfigError) as caught:
        Config.load(env, {"model_base_url": url if by_flag else None})
    source = "--model-base-url" if by_flag else "AGENT_MODEL_BASE_URL"
    assert caught.value.problems == [
        f"{source}='http://***@127.0.0.1:8000/v1' is not valid with AGENT_MODEL_API_KEY set: it carries credentials"
        " (before its '@'), which would be sent in place of the key; take them out of the URL to send the key, or unset"
        " AGENT_MODEL_API_KEY to send them (HTTP Basic auth)"
    ]
    for secret in ("bob", "pa55w0rd", "sk-RIGHTKEY"):
        assert secret not in str(caught.value)
    # Either alone is as good as before: a gateway may take basic auth, a hosted API a key.
    assert Config.load({"AGENT_MODEL_BASE_URL": url}).model_base_url == url
    assert Config.load(env | {"AGENT_MODEL_BASE_URL": "http://127.0.0.1:8000/v1"}).model_api_key == "sk-RIGHTKEY"


def test_check_command_refuses_a_model_url_carrying_credentials_beside_an_api_key() -> None:
    result = run_cli("check", "--model-base-url", "http://bob:pa55w0rd@127.0.0.1:8000/v1", env={"AGENT_MODEL_API_KEY": "sk-RIGHTKEY"})
    assert result.returncode == 1
    assert "--model-base-url='http://***@127.0.0.1:8000/v1' is not valid with AGENT_MODEL_API_KEY set" in result.stderr
    assert "configuration ok" not in result.stdout
    for secret in ("bob", "pa55w0rd", "sk-RIGHTKEY"):
        assert secret not in result.stdout + result.stderr


def test_check_refuses_a_state_directory_serve_could_not_create_even_as_root(tmp_path: Path) -> None:
    where = "/proc/keel-state"  # /proc takes no new directories, whoever asks: permissions alone say yes to root
    result = run_cli("check", env={"AGENT_STATE_DIR": where})
    assert result.returncode == 1, result.stdout
    assert f"AGENT_STATE_DIR='{where}' is not valid: " in result.stderr
    assert "configuration ok" not in result.stdout and "Traceback" not in result.stderr


def test_check_tries_the_state_directory_and_leaves_nothing_behind(tmp_path: Path) -> None:
    existing = tmp_path / "state"
    existing.mkdir()
    for state_dir in (existing, tmp_path / "new" / "state"):
        result = run_cli("check", env={"AGENT_STATE_DIR": str(state_dir)})
        assert result.returncode == 0, result.stderr
        assert f"AGENT_STATE_DIR={state_dir}" in result.stdout
    assert [path.name for path in tmp_path.iterdir()] == ["state"]
    assert list(existing.iterdir()) == []


@pytest.mark.parametrize(
    ("host", "said"),
    [
        ("999.1.1.1", "serve could not listen on it ("),  # no address, so a name; none resolves so
        ("not.a.host.invalid", "serve could not listen on it ("),  # .invalid never resolves
        ("192.0.2.1", "serve could not listen on it (Cannot assign requested address)"),  # not this machine's
    ],
)
def test_check_refuses_a_host_serve_could_not_listen_on(tmp_path: Path, host: str, said: str) -> None:
    result = run_cli("check", env={"AGENT_HOST": host, "AGENT_STATE_DIR": str(tmp_path)})
    assert result.returncode == 1, result.stdout
    assert f"AGENT_HOST='{host}' is not valid: {said}" in result.stderr


def test_check_accepts_a_host_of_this_machine_whatever_holds_the_port(tmp_path: Path) -> None:
    with socket.socket() as holder:  # a server this one is to replace, say
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        result = run_cli("check", env={"AGENT_HOST": "localhost", "AGENT_PORT": port, "AGENT_STATE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "AGENT_HOST=localhost" in result.stdout and f"AGENT_PORT={port}" in result.stdout


def test_check_shows_every_setting_not_set_alike_and_where_snapshots_go(tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = run_cli("check", env={"AGENT_STATE_DIR": str(state)})
    assert result.returncode == 0, result.stderr
    assert "AGENT_PUBLIC_URL=(not set)" in result.stdout and "AGENT_MODEL_API_KEY=(not set)" in result.stdout
    assert "None" not in result.stdout
    assert f"AGENT_BACKUP_ROOT={tmp_path / 'state-backups'}" in result.stdout
    vault = tmp_path / "vault"
    result = run_cli("check", env={"AGENT_STATE_DIR": str(state), "AGENT_BACKUP_ROOT": str(vault)})
    assert f"AGENT_BACKUP_ROOT={vault}" in result.stdout


def test_check_shows_numbers_as_help_and_the_readme_write_them(tmp_path: Path) -> None:
    # 10.0 where --help and the README say 10: a reader comparing them takes it for another value.
    result = run_cli("check", "--drain-timeout-s", "2.5", env={"AGENT_STATE_DIR": str(tmp_path / "state")})
    assert result.returncode == 0, result.stderr
    shown = dict(line.split("=", 1) for line in result.stdout.splitlines() if line.startswith("AGENT_"))
    assert (shown["AGENT_DRAIN_TIMEOUT_S"], shown["AGENT_MODEL_TIMEOUT_S"], shown["AGENT_SEND_TIMEOUT_S"]) == ("2.5", "60", "30")


@pytest.mark.parametrize(
    ("root", "said"),
    [
        ("", "it must not be empty; unset it for the default, <state-dir>-backups beside the state directory"),
        ("{state}/backups", "it is inside the state directory; snapshots must go outside it"),
        ("{tmp}/a-file", "it is a file, not a directory"),
        ("{tmp}/a-loop", "it cannot be reached (Too many levels of symbolic links)"),
        ("{tmp}/others", "it holds the snapshots of another state directory, {tmp}/other-state; give each state directory its own"),
    ],
)
def test_check_refuses_a_backup_root_snapshot_would_refuse(tmp_path: Path, root: str, said: str) -> None:
    state = tmp_path / "state"
    (tmp_path / "a-file").write_bytes(b"")
    (tmp_path / "a-loop").symlink_to("a-loop")
    (tmp_path / "others").mkdir()
    (tmp_path / "others" / ".keel-snapshots-of").write_text(f"{os.path.realpath(tmp_path)}/other-state\n")
    said = said.format(tmp=os.path.realpath(tmp_path))
    root = root.format(state=state, tmp=tmp_path)
    result = run_cli("check", env={"AGENT_STATE_DIR": str(state), "AGENT_BACKUP_ROOT": root})
    assert result.returncode == 1, result.stdout
    assert f"AGENT_BACKUP_ROOT='{root}' is not valid: {said}" in result.stderr


AS_ROOT = os.geteuid() == 0  # root passes permission checks: what refuses it is the file system itself


@pytest.mark.parametrize(
    ("state_dir", "why"),
    [
        ("/dev/null", "it is a device, not a directory"),
        ("/dev/null/state", "/dev/null is a device, so no directory can be made under it"),
        ("/proc", f"no file can be made in it ({'its file system takes no new files' if AS_ROOT else 'this user may not write in it'})"),
        ("/proc/1", f"no file can be made in it ({'its file system takes no new files' if AS_ROOT else 'this user may not write in it'})"),
        (
            "/proc/keelstate",
            f"no directory can be made in /proc ({'its file system takes no new directories' if AS_ROOT else 'this user may not write in it'}),"
            " so it cannot be created",
        ),
    ],
)
def test_check_says_what_keeps_serve_from_using_a_state_directory_as_it_is(state_dir: str, why: str) -> None:
    result = run_cli("check", "--state-dir", state_dir, env={})
    assert result.returncode == 1, result.stdout
    assert f"--state-dir='{state_dir}' is not valid: {why}\n" in result.stderr
    assert "Errno" not in result.stderr and "No such file or directory" not in result.stderr


def test_check_refuses_a_symbolic_link_as_the_state_directory_as_serve_does(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    result = run_cli("check", "--state-dir", str(tmp_path / "link"), env={})
    assert result.returncode == 1, result.stdout
    assert "is not valid: it is a symbolic link; give the directory it points to\n" in result.stderr


@pytest.mark.parametrize("url", ["https://:pw-secret@agents.example/keel", "https://@agents.example/keel"])
def test_a_public_url_carrying_a_password_without_a_user_name_is_refused_rather_than_published(url: str) -> None:
    # The agent card gave every client `https://:pw-secret@agents.example/keel/`, while `check`
    # showed it masked and said the configuration was ok.
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_PUBLIC_URL": url})
    assert caught.value.problems == [
        "AGENT_PUBLIC_URL='https://***@agents.example/keel' is not valid: it must be an http:// or https:// URL with a host,"
        " and no credentials or query, like https://agents.example/keel"
    ]
    assert "pw-secret" not in str(caught.value)


@pytest.mark.parametrize("url", ["https://agents.example/keel?", "https://agents.example/keel#"])
def test_a_public_url_ending_in_an_empty_query_or_fragment_is_refused_rather_than_shown_without_it(url: str) -> None:
    # `check` showed https://agents.example/keel, and the card gave clients the URL with its '?'.
    with pytest.raises(ConfigError, match="no credentials or query, like https://agents.example/keel"):
        Config.load({"AGENT_PUBLIC_URL": url})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/"])
def test_a_model_url_naming_the_chat_endpoint_rather_than_the_api_is_refused_saying_what_to_give(path: str) -> None:
    # Keel adds /chat/completions (and /models) itself: every task failed with HTTP 404, and
    # /healthz said the endpoint did not exist, with no word of why.
    with pytest.raises(ConfigError) as caught:
        Config.load({}, {"model_base_url": f"http://127.0.0.1:11434{path}"})
    assert caught.value.problems == [
        f"--model-base-url='http://127.0.0.1:11434{path}' is not valid: it ends with /chat/completions, which Keel adds"
        " itself; give the API's base URL, like http://127.0.0.1:11434/v1"
    ]


@pytest.mark.parametrize(
    ("variable", "given"),
    [("AGENT_HOST", ""), ("AGENT_PORT", ""), ("AGENT_PUBLIC_URL", ""), ("AGENT_ORPHANS", " "), ("AGENT_DRAIN_TIMEOUT_S", "")],
)
def test_an_empty_variable_is_refused_saying_to_unset_it_for_its_default(variable: str, given: str) -> None:
    # A compose file's `AGENT_PUBLIC_URL: ${PUBLIC_URL:-}` means "none"; it was told to give an
    # http:// URL, and an empty AGENT_PORT that a port is a whole number.
    with pytest.raises(ConfigError) as caught:
        Config.load({variable: given})
    assert caught.value.problems == [f"{variable}={given!r} is not valid: it must not be empty; unset it to use its default"]


def test_an_empty_flag_is_refused_saying_to_leave_it_out_for_its_default() -> None:
    with pytest.raises(ConfigError) as caught:
        Config.load({}, {"port": "", "public_url": ""})
    assert caught.value.problems == [
        "--port='' is not valid: it must not be empty; leave the flag out to use its default",
        "--public-url='' is not valid: it must not be empty; leave the flag out to use its default",
    ]


def test_an_empty_api_key_is_refused_saying_to_unset_it_without_showing_it() -> None:
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_MODEL_API_KEY": ""})
    assert caught.value.problems == [
        "AGENT_MODEL_API_KEY=(hidden) is not valid: it must not be empty; unset it to use its default"
    ]


def test_a_setting_spelt_in_the_wrong_case_is_refused_naming_the_one_meant() -> None:
    # `agent_state_dir` was ignored, so serve and the state commands acted on .state in the current
    # directory; `AGENT_model` was reported without a word of AGENT_MODEL.
    with pytest.raises(ConfigError) as caught:
        Config.load({"agent_state_dir": "/srv/keel", "AGENT_model": "llama3", "PATH": "/bin", "agent": "x"})
    assert caught.value.problems == [
        "AGENT_model is not a setting Keel knows; did you mean AGENT_MODEL?",
        "agent_state_dir is not a setting Keel knows; did you mean AGENT_STATE_DIR?",
    ]


def test_a_state_command_refuses_a_setting_spelt_in_the_wrong_case_before_it_touches_the_default_state_dir(
    tmp_path: Path,
) -> None:
    (tmp_path / ".state").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "runtime", "state", "reset"],
        env={k: v for k, v in os.environ.items() if not k.upper().startswith("AGENT_")} | {"agent_state_dir": "elsewhere"},
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout
    assert "agent_state_dir is not a setting Keel knows; did you mean AGENT_STATE_DIR?" in result.stderr


def test_the_command_line_says_its_version() -> None:
    result = run_cli("--version", env={})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"python -m runtime {app_version()}\n"


@pytest.mark.parametrize(("setting", "like"), [("AGENT_MODEL_BASE_URL", "http://[::1]:11434/v1"), ("AGENT_PUBLIC_URL", "https://[::1]:8443/keel")])
def test_a_url_no_parser_can_read_is_refused_saying_how_one_is_written(setting: str, like: str) -> None:
    # It was refused in Python's own words ("Invalid IPv6 URL"), which say nothing of what to give.
    with pytest.raises(ConfigError) as caught:
        Config.load({setting: "http://[::1:11434/v1"})
    [problem] = caught.value.problems
    assert problem.endswith(f"is not valid: it cannot be read as a URL; write an IPv6 address in brackets, like {like}")


def test_check_whose_output_cannot_be_written_says_so_without_a_traceback(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    with open("/dev/full", "w") as full:  # a full disk, as a redirection to a file meets it
        result = subprocess.run(
            [sys.executable, "-m", "runtime", "check", "--state-dir", str(tmp_path / "state")],
            env=clean, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr == "error: the settings could not be written: No space left on device\n"


# What Azure Pipelines sets in every job's environment: a server run there (say, for a job's tests)
# was refused for variables that are no one's typo of a setting of Keel's.
AZURE_PIPELINES = {"AGENT_OS": "Linux", "AGENT_NAME": "Hosted Agent", "AGENT_TEMPDIRECTORY": "/agent/_temp", "AGENT_ID": "9"}


def test_agent_variables_like_no_setting_are_ignored_and_said_to_be_while_a_misspelt_one_is_refused() -> None:
    assert Config.load(AZURE_PIPELINES) == Config()
    assert foreign_settings({**AZURE_PIPELINES, "AGENT_MODEL": "llama3", "PATH": "/bin"}) == sorted(AZURE_PIPELINES)
    with pytest.raises(ConfigError) as caught:
        Config.load({**AZURE_PIPELINES, "AGENT_STATE_DRI": "/srv/keel", "AGENT_MODEL_BASEURL": "http://models/v1"})
    assert caught.value.problems == [
        "AGENT_MODEL_BASEURL is not a setting Keel knows; did you mean AGENT_MODEL_BASE_URL?",
        "AGENT_STATE_DRI is not a setting Keel knows; did you mean AGENT_STATE_DIR?",
    ]


def test_check_notes_the_agent_variables_it_ignores(tmp_path: Path) -> None:
    result = run_cli("check", "--port", "0", "--state-dir", str(tmp_path / "state"), env=AZURE_PIPELINES)
    assert result.returncode == 0, result.stderr
    for name in AZURE_PIPELINES:
        assert f"note: {name} is not a setting Keel knows, nor like one: it is ignored\n" in result.stdout


def test_an_at_sign_in_a_public_urls_path_is_refused_saying_how_to_write_it() -> None:
    # A password holding a '/' puts the end of the credentials in the path: the '@' there is read
    # as one, and the operator who meant it in the path is told how to write it.
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_PUBLIC_URL": "https://agents.example/@team/keel"})
    [problem] = caught.value.problems
    assert "an '@' meant in the path is written %40" in problem
    assert Config.load({"AGENT_PUBLIC_URL": "https://agents.example/%40team/keel"}).public_url == "https://agents.example/%40team/keel"


def test_a_state_command_notes_the_agent_variables_it_ignores_and_goes_on(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    result = run_cli("state", "recover", "--state-dir", str(tmp_path / "state"), env=AZURE_PIPELINES)
    assert result.returncode == 0, result.stderr
    for name in AZURE_PIPELINES:
        assert f"note: {name} is not a setting Keel knows, nor like one: it is ignored\n" in result.stderr


@pytest.mark.parametrize("written", ["sk-from-a-file", "sk-from-a-file\n", "sk-from-a-file\r\n"], ids=["bare", "lf", "crlf"])
@pytest.mark.parametrize("by_flag", [True, False], ids=["flag", "environment"])
def test_the_api_key_can_be_read_from_a_file_less_its_line_end(tmp_path: Path, written: str, by_flag: bool) -> None:
    key_file = tmp_path / "model-key"
    key_file.write_bytes(written.encode())
    env = {} if by_flag else {"AGENT_MODEL_API_KEY_FILE": str(key_file)}
    config = Config.load(env, {"model_api_key_file": str(key_file) if by_flag else None})
    assert (config.model_api_key, config.model_api_key_file) == ("sk-from-a-file", key_file)
    assert "sk-from-a-file" not in repr(config)


SPACED_KEY = "the key in it starts or ends with white space; remove it (one line end after the key is allowed)"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "it holds no key; write the key in it"),
        (b"\n", "it holds no key; write the key in it"),
        # The path is as it should be: what is wrong is the text in the file, past the one line end allowed.
        (b"sk-one\nsk-two\n", "it holds more than one line; write the key alone in it, on one line"),
        (b" sk-spaced\n", SPACED_KEY),
        (b"sk-spaced \n", SPACED_KEY),
        (b"sk-spaced\n\n", SPACED_KEY),
        (b"sk-\x7f\n", "it holds a character an HTTP header cannot carry"),
        (b"Bearer sk-prefixed\n", "it starts with 'Bearer ', which Keel sends itself"),
        (b"sk-\xff\xfe\n", "it holds bytes that are not UTF-8 text"),
        (b"k" * (65 << 10), "it holds more than 64 KiB; a key file holds the key alone"),
    ],
    ids=[
        "empty", "a-line-end", "two-lines", "spaced", "space-before-the-line-end", "two-line-ends", "control", "bearer",
        "binary", "huge",
    ],  # fmt: skip
)
def test_a_key_file_holding_no_usable_key_is_refused_naming_the_file_not_its_content(
    tmp_path: Path, content: bytes, said: str
) -> None:
    key_file = tmp_path / "model-key"
    key_file.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_MODEL_API_KEY_FILE": str(key_file)})
    (problem,) = caught.value.problems
    assert problem.startswith(f"AGENT_MODEL_API_KEY_FILE='{key_file}' is not valid: {said}"), problem
    for secret in ("sk-one", "sk-spaced", "sk-prefixed", "kkkk"):
        assert secret not in problem


def test_a_key_file_that_cannot_be_read_is_refused_saying_why(tmp_path: Path) -> None:
    for path, why in ((tmp_path / "absent", "No such file or directory"), (tmp_path, "Is a directory")):
        with pytest.raises(ConfigError) as caught:
            Config.load({}, {"model_api_key_file": str(path)})
        assert caught.value.problems == [f"--model-api-key-file='{path}' is not valid: it cannot be read ({path}: {why})"]


def test_a_key_given_both_in_the_environment_and_in_a_file_is_refused(tmp_path: Path) -> None:
    key_file = tmp_path / "model-key"
    key_file.write_text("sk-in-the-file\n")
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_MODEL_API_KEY": "sk-in-the-environment", "AGENT_MODEL_API_KEY_FILE": str(key_file)})
    assert caught.value.problems == [
        "AGENT_MODEL_API_KEY and AGENT_MODEL_API_KEY_FILE are both set; give the key one way: unset AGENT_MODEL_API_KEY"
        " or unset AGENT_MODEL_API_KEY_FILE"
    ]
    with pytest.raises(ConfigError) as caught:  # a flag is not unset: it is left out
        Config.load({"AGENT_MODEL_API_KEY": "sk-in-the-environment"}, {"model_api_key_file": str(key_file)})
    assert caught.value.problems == [
        "AGENT_MODEL_API_KEY and --model-api-key-file are both set; give the key one way: unset AGENT_MODEL_API_KEY"
        " or leave out --model-api-key-file"
    ]
    # A URL with credentials beside a key from a file is refused as beside one from the environment.
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_MODEL_API_KEY_FILE": str(key_file), "AGENT_MODEL_BASE_URL": "http://bob:pw@127.0.0.1:8000/v1"})
    assert "is not valid with AGENT_MODEL_API_KEY_FILE set" in str(caught.value)
    assert "unset AGENT_MODEL_API_KEY_FILE to send them" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        Config.load({"AGENT_MODEL_BASE_URL": "http://bob:pw@127.0.0.1:8000/v1"}, {"model_api_key_file": str(key_file)})
    assert "is not valid with --model-api-key-file set" in str(caught.value)
    assert "leave out --model-api-key-file to send them" in str(caught.value)


def test_check_shows_the_key_file_and_never_the_key(tmp_path: Path) -> None:
    key_file = tmp_path / "model-key"
    key_file.write_text("sk-checked-secret\n")
    result = run_cli(
        "check", "--model-api-key-file", str(key_file), env={"AGENT_STATE_DIR": str(tmp_path / "state"), "AGENT_PORT": "0"}
    )
    assert result.returncode == 0, result.stderr
    assert f"AGENT_MODEL_API_KEY_FILE={key_file}" in result.stdout and "AGENT_MODEL_API_KEY=(set)" in result.stdout
    assert "sk-checked-secret" not in result.stdout + result.stderr
    key_file.unlink()
    result = run_cli("check", env={"AGENT_MODEL_API_KEY_FILE": str(key_file), "AGENT_STATE_DIR": str(tmp_path / "state")})
    assert result.returncode == 1 and f"AGENT_MODEL_API_KEY_FILE='{key_file}' is not valid: it cannot be read" in result.stderr
