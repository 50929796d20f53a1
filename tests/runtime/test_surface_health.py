"""/livez, /healthz and the agent card, through a real hypercorn server."""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fake_model import FakeModel

from persistence.sessions import open_session_store
from persistence.tasks import open_task_store
from persistence.transcript import Message
from runtime.models import ChatRequest, ModelClient, ModelConfig, ModelRejected, open_model_client
from runtime.surface import Health, SurfaceConfig
from tests.runtime.served import DEADLINE_S, SYSTEM_PROMPT, Served, serve_keel

CARD = "/.well-known/agent-card.json"
NOT_STARTED = {"status": "unready", "problems": ["the A2A server has not started"]}


async def get(keel: Served, path: str) -> httpx.Response:
    with trio.fail_after(DEADLINE_S):
        return await keel.http.get(path)


async def unready_problems(keel: Served) -> list[str]:
    response = await get(keel, "/healthz")
    assert response.status_code == 503, response.text
    assert "Traceback" not in response.text
    body = response.json()
    assert body["status"] == "unready"
    return body["problems"]  # type: ignore[no-any-return]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- liveness and readiness ---------------------------------------------------------------------


async def test_livez_answers_alive(keel: Served) -> None:
    response = await get(keel, "/livez")
    assert (response.status_code, response.json()) == (200, {"status": "alive"})


async def test_healthz_answers_ready(keel: Served) -> None:
    response = await get(keel, "/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ready"})
    assert not list(keel.state_dir.glob(".readiness-*"))  # the write probe cleans up after itself


async def test_every_route_answers_unready_until_startup_completes(fake_model: FakeModel, tmp_path: Path) -> None:
    async with serve_keel(tmp_path / "state", fake_model, ready=False) as keel:
        with trio.fail_after(DEADLINE_S):
            answers = [
                await keel.http.get("/livez"),
                await keel.http.get("/healthz"),
                await keel.http.get(CARD),
                await keel.http.post("/", json=keel.body("GetTask", {"id": "x"}), headers={"A2A-Version": "1.0"}),
                await keel.http.post("/nowhere", json={}),
            ]
        assert [(a.status_code, a.json()) for a in answers] == [(503, NOT_STARTED)] * len(answers)
        keel.readiness.set()
        assert (await get(keel, "/livez")).status_code == 200
        assert (await get(keel, "/healthz")).status_code == 200


async def test_healthz_accumulates_every_problem(keel: Served, tmp_path: Path) -> None:
    keel.model.models = ("some-other-model",)
    moved = tmp_path / "moved-away"
    keel.state_dir.rename(moved)  # the state directory disappears under the running server
    try:
        problems = await unready_problems(keel)
    finally:
        moved.rename(keel.state_dir)
    assert problems == [
        "state directory is not writable (the server log names it)",
        "session store is not initialized: runtime.db is missing",
        "task store is not initialized: tasks.db is missing",
        "model unavailable: 'qwen3:4b-instruct' is absent from the model server's catalog",
    ]


@pytest.mark.parametrize("null_when_empty", [False, True], ids=["empty-list", "null-as-ollama"])
async def test_healthz_says_the_model_is_absent_from_a_catalog_that_lists_none(
    fake_model: FakeModel, tmp_path: Path, null_when_empty: bool
) -> None:
    # A fresh Ollama, nothing pulled yet, lists its models as null: the catalog was read, and the
    # model is not in it, which `ollama pull` mends; the server is not failing.
    fake_model.models, fake_model.null_when_empty = (), null_when_empty
    problems = await model_problems(fake_model, tmp_path, ModelConfig(base_url=fake_model.base_url, max_retries=0))
    assert problems == ["model unavailable: 'qwen3:4b-instruct' is absent from the model server's catalog"]


@pytest.mark.parametrize(
    ("bare_catalog", "catalog_prefix"),
    [
        # Together's GET /models answers with the array of its models, not an object holding them.
        (True, ""),
        # Gemini's OpenAI-compatible API lists models/gemini-2.5-flash, and is asked for gemini-2.5-flash.
        (False, "models/"),
    ],
    ids=["bare-array-as-together", "models-prefix-as-gemini"],
)
async def test_healthz_finds_the_model_in_a_hosted_apis_catalog(
    fake_model: FakeModel, tmp_path: Path, bare_catalog: bool, catalog_prefix: str
) -> None:
    fake_model.models = ("gemini-2.5-flash", "qwen3:4b-instruct")
    fake_model.bare_catalog, fake_model.catalog_prefix = bare_catalog, catalog_prefix
    async with serve_keel(tmp_path / "state", fake_model) as keel:
        response = await get(keel, "/healthz")
        assert (response.status_code, response.json()) == (200, {"status": "ready"})
        async with open_model_client(ModelConfig(base_url=fake_model.base_url, model="gemini-2.5-flash")) as client:
            assert await client.has_model() is True
            assert await client.has_model("gemini-2.0-flash") is False


async def test_healthz_finds_a_model_the_server_answers_for_by_name_though_its_catalog_does_not_list_it(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # Anthropic's catalog lists dated ids (20 to a page) and answers GET /v1/models/NAME for an
    # alias, or for a model past the first page, with the model it stands for; chat takes both.
    fake_model.models = ("claude-sonnet-4-5-20250929",)
    fake_model.aliases = {"claude-opus-4-1": "claude-opus-4-1-20250805", "qwen3:4b-instruct": "qwen3:4b-instruct-2507"}
    async with serve_keel(tmp_path / "state", fake_model) as keel:  # the model configured: qwen3:4b-instruct
        response = await get(keel, "/healthz")
        assert (response.status_code, response.json()) == (200, {"status": "ready"})
    async with open_model_client(ModelConfig(base_url=fake_model.base_url, model="claude-opus-4-1")) as client:
        assert await client.has_model() is True
        assert await client.has_model("claude-sonnet-4-5-20250929") is True  # listed: not asked for by name
        assert await client.has_model("claude-haiku-9") is False  # answered 404: absent
    asked = [received.path for received in fake_model.received if received.path.startswith("/v1/models/")]
    assert asked == ["/v1/models/qwen3:4b-instruct", "/v1/models/claude-opus-4-1", "/v1/models/claude-haiku-9"]


@pytest.mark.parametrize("status", [503, 429, 401, 403])
async def test_healthz_says_the_model_server_failed_when_its_answer_for_a_model_by_name_is_a_failure(
    fake_model: FakeModel, tmp_path: Path, status: int
) -> None:
    # The catalog does not list the model, and the server fails its answer for it by name: that
    # is no news that the model is absent (an operator would go looking for a misspelt name). A
    # key refused for the one model (401, 403) is the key's trouble, and said so.
    fake_model.models, fake_model.entry_status = ("another-model",), status
    problems = await model_problems(fake_model, tmp_path, ModelConfig(base_url=fake_model.base_url, max_retries=0))
    [problem] = problems
    assert problem.startswith("model server unavailable: its catalog could not be read to find 'qwen3:4b-instruct': "), problem
    assert "absent" not in problem and "the model service is unavailable" not in problem  # what it said is the log's
    if status in (401, 403):
        assert "API key" in problem, problem
    fake_model.entry_status = 404  # a server with no such route: the model is absent
    problems = await model_problems(fake_model, tmp_path, ModelConfig(base_url=fake_model.base_url, max_retries=0))
    assert problems == ["model unavailable: 'qwen3:4b-instruct' is absent from the model server's catalog"]


async def test_healthz_reports_a_state_directory_too_full_to_store_a_turn(fake_model: FakeModel, tmp_path: Path) -> None:
    # An empty file can be made on a full disk, so making one proves little; the room left is
    # what a turn needs. Here "too full" is set past what any disk has free.
    def health_for(state_dir: Path, model: ModelClient) -> Health:
        return Health(state_dir=state_dir, model=model, min_free_bytes=1 << 62)

    async with serve_keel(tmp_path / "state", fake_model, health_for=health_for) as keel:
        problems = await unready_problems(keel)
    [problem] = problems
    prefix = "state directory is nearly full: "
    free, _, rest = problem.removeprefix(prefix).partition(" bytes free")
    assert problem.startswith(prefix) and int(free) > 0
    assert rest == f", under the {1 << 62} a turn may need; free space on its disk, or give the server a state directory on one with room"


async def test_healthz_reports_damaged_and_foreign_databases(fake_model: FakeModel, tmp_path: Path) -> None:
    other = tmp_path / "other-state"
    other.mkdir()
    (other / "runtime.db").write_bytes(b"this is not a database file " * 64)
    with sqlite3.connect(other / "tasks.db") as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    conn.close()

    def health_for(_state_dir: Path, model: ModelClient) -> Health:
        return Health(state_dir=other, model=model)

    async with serve_keel(tmp_path / "state", fake_model, health_for=health_for) as keel:
        problems = await unready_problems(keel)
    assert problems == [
        "session store is not usable: runtime.db (SchemaError)",
        "task store is not usable: tasks.db (SchemaError)",
    ]


async def model_problems(fake_model: FakeModel, tmp_path: Path, config: ModelConfig) -> list[str]:
    """The problems /healthz reports with its model probe asking the server ``config`` names."""
    async with open_model_client(config) as catalog:

        def health_for(state_dir: Path, _model: ModelClient) -> Health:
            return Health(state_dir=state_dir, model=catalog)

        async with serve_keel(tmp_path / "state", fake_model, health_for=health_for) as keel:
            return await unready_problems(keel)


async def test_healthz_says_the_model_server_cannot_be_reached_without_its_address_or_credentials(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    port = closed_port()
    config = ModelConfig(base_url=f"http://bob:pa55w0rd@127.0.0.1:{port}/v1?key=q-secret", max_retries=0)
    problems = await model_problems(fake_model, tmp_path, config)
    assert problems == [
        f"model server unavailable: its catalog could not be read to find 'qwen3:4b-instruct': "
        "the model server cannot be reached"
    ]
    for leak in ("bob", "pa55w0rd", "q-secret", "Model", str(port)):
        assert leak not in problems[0]


async def test_healthz_says_the_api_key_was_refused_in_the_words_a_failed_task_uses(fake_model: FakeModel, tmp_path: Path) -> None:
    fake_model.api_key = "sk-right-key"  # its refusal repeats the key it was given
    config = ModelConfig(base_url=fake_model.base_url, api_key="sk-wrong-key-0002", max_retries=0)
    problems = await model_problems(fake_model, tmp_path, config)
    said = "the API key was refused (HTTP 401)"
    assert problems == [f"model server unavailable: its catalog could not be read to find 'qwen3:4b-instruct': {said}"]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config) as client:
            with pytest.raises(ModelRejected) as refused:
                await client.complete(ChatRequest([Message(role="user", text="hi")]))
    assert str(refused.value) == f"model 'qwen3:4b-instruct' rejected the request: {said}"
    for leak in ("sk-wrong", "Incorrect API key", "ModelRejected"):
        assert leak not in problems[0]


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b"HTTP/1.1 503 Busy\r\ncontent-length: 33\r\n\r\nGPU 0 out of memory at 0x7f3a2b10", "the server answered HTTP 503"),
        (b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n", "the model or the endpoint does not exist on the server (HTTP 404)"),
        (b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 15\r\n\r\n<html>hi</html>", "the server answered with a web page (text/html), not JSON"),
        (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n<html>hi</html>", "the body is not JSON"),
    ],
    ids=["a server error", "a refusal", "a web page", "not JSON"],
)
async def test_healthz_says_in_plain_words_what_the_model_server_answered(
    fake_model: FakeModel, tmp_path: Path, nursery: trio.Nursery, answer: bytes, said: str
) -> None:
    async def handle(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        await stream.send_all(answer)

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1"
    problems = await model_problems(fake_model, tmp_path, ModelConfig(base_url=url, max_retries=0))
    assert problems == [f"model server unavailable: its catalog could not be read to find 'qwen3:4b-instruct': {said}"]
    assert "GPU" not in problems[0] and "<html>" not in problems[0]


class StuckCatalog:
    model = "stuck-model"
    endpoint = "http://stuck.example/v1"

    async def has_model(self, name: str | None = None) -> bool:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_healthz_bounds_each_probe(fake_model: FakeModel, tmp_path: Path) -> None:
    def health_for(state_dir: Path, _model: ModelClient) -> Health:
        return Health(state_dir=state_dir, model=StuckCatalog(), probe_timeout_s=0.05)

    async with serve_keel(tmp_path / "state", fake_model, health_for=health_for) as keel:
        assert await unready_problems(keel) == ["the model catalog check did not finish within 0.05 s"]


class BrokenCatalog:
    model = "broken-model"
    endpoint = "http://broken.example/v1"

    async def has_model(self, name: str | None = None) -> bool:
        raise RuntimeError("a bug, at /srv/keel/secret-path")


async def test_healthz_says_a_probe_broke_without_naming_its_exception(fake_model: FakeModel, tmp_path: Path) -> None:
    def health_for(state_dir: Path, _model: ModelClient) -> Health:
        return Health(state_dir=state_dir, model=BrokenCatalog())

    async with serve_keel(tmp_path / "state", fake_model, health_for=health_for) as keel:
        assert await unready_problems(keel) == ["the model catalog check failed unexpectedly (the log says how)"]


async def test_healthz_answers_while_the_task_database_is_being_written(keel: Served) -> None:
    writer = sqlite3.connect(keel.state_dir / "tasks.db", isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")  # hold the write lock, as a long commit would
        response = await get(keel, "/healthz")
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert (response.status_code, response.json()) == (200, {"status": "ready"})


async def test_a_problem_that_lasts_is_logged_when_it_starts_and_when_it_ends_not_at_every_poll(
    fake_model: FakeModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_session_store(tmp_path / "runtime.db"), open_task_store(tmp_path / "tasks.db"):
        pass
    fake_model.models = ("another-model",)
    caplog.set_level(logging.INFO, logger="runtime.surface.health")
    async with open_model_client(ModelConfig(base_url=fake_model.base_url, max_retries=0)) as catalog:
        health = Health(state_dir=tmp_path, model=catalog)
        with trio.fail_after(DEADLINE_S):
            polls = [await health.problems() for _ in range(4)]
            fake_model.models = (catalog.model,)
            after = [await health.problems() for _ in range(3)]
    absent = f"model unavailable: {catalog.model!r} is absent from the model server's catalog"
    assert polls == [[absent]] * 4 and after == [[]] * 3
    said = [record.getMessage() for record in caplog.records if record.name == "runtime.surface.health"]
    assert len(said) == 2, said  # a poller every few seconds would otherwise write the same line forever
    assert "is absent from the catalog" in said[0] and caplog.records[0].levelname == "WARNING"
    assert said[1] == f"readiness: resolved: {absent}"


async def test_a_model_absent_from_the_catalog_has_the_catalog_read_once_a_poll_after_it_is_logged(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # What the catalog lists is for the log line written when the problem starts: a load balancer
    # polling every few seconds must not have the model server read its catalog twice a poll.
    async with open_session_store(tmp_path / "runtime.db"), open_task_store(tmp_path / "tasks.db"):
        pass
    fake_model.models = ("another-model",)
    async with open_model_client(ModelConfig(base_url=fake_model.base_url, max_retries=0)) as catalog:
        health = Health(state_dir=tmp_path, model=catalog)
        with trio.fail_after(DEADLINE_S):
            for _ in range(4):
                assert await health.problems() != []
    reads = [item for item in fake_model.received if item.path == "/v1/models"]
    assert len(reads) == 4 + 1, reads  # one a poll, and the first poll's listing for its log line


async def test_readiness_polled_while_a_store_is_held_elsewhere_keeps_one_thread_on_it(tmp_path: Path) -> None:
    """A probe stuck on another program's lock is abandoned, not stopped: later polls wait for
    it rather than each leaving one more thread stuck beside it in Trio's shared pool (where the
    model host's name lookups wait too)."""
    async with open_session_store(tmp_path / "runtime.db"), open_task_store(tmp_path / "tasks.db"):
        pass
    health = Health(state_dir=tmp_path, probe_timeout_s=0.1)
    holder = sqlite3.connect(tmp_path / "tasks.db", isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode = EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")  # as an open sqlite3 shell might: readers wait 5 s, then fail
        shared = trio.to_thread.current_default_thread_limiter()
        for _ in range(6):
            with trio.fail_after(DEADLINE_S):
                assert await health.problems() == ["the task store check did not finish within 0.1 s"]
            assert shared.borrowed_tokens == 0
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with trio.fail_after(DEADLINE_S):  # the stuck check gives up by itself, and the polls recover
        while await health.problems():
            await trio.sleep(0.05)


# -- the agent card -----------------------------------------------------------------------------


async def test_the_agent_card_says_who_the_agent_is_and_where_it_listens(keel: Served) -> None:
    response = await get(keel, CARD)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    card: dict[str, Any] = response.json()
    assert card["name"] == "Keel test agent"
    assert card["description"] and card["version"] == "0.1.0"
    assert card["supportedInterfaces"] == [
        {"url": keel.url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"},
        {"url": keel.url, "protocolBinding": "JSONRPC", "protocolVersion": "0.3"},
    ]
    assert card["capabilities"] == {"streaming": True, "pushNotifications": False}
    assert [skill["id"] for skill in card["skills"]] == ["triage"]
    assert (card["url"], card["preferredTransport"], card["protocolVersion"]) == (keel.url, "JSONRPC", "0.3")
    assert response.headers["etag"] and "max-age" in response.headers["cache-control"]


async def test_the_agent_card_is_not_sent_again_to_a_client_that_has_it(keel: Served) -> None:
    etag = (await get(keel, CARD)).headers["etag"]
    with trio.fail_after(DEADLINE_S):
        same = await keel.http.get(CARD, headers={"If-None-Match": etag})
        other = await keel.http.get(CARD, headers={"If-None-Match": 'W/"some-older-card"'})
    assert (same.status_code, same.content, same.headers["etag"]) == (304, b"", etag)
    assert other.status_code == 200 and other.json()["name"] == "Keel test agent"


async def test_the_agent_card_never_shows_the_system_prompt_and_sends_no_cors(keel: Served) -> None:
    response = await get(keel, CARD)
    assert SYSTEM_PROMPT not in response.text and "SECRET-PROMPT-MARKER" not in response.text
    assert not [name for name in response.headers if name.lower().startswith("access-control-")]


@pytest.mark.parametrize("host", ["[::1", "a b", "x:99999", "", "card.example/evil?", "\u00fc.example"])
async def test_an_agent_card_asked_for_with_a_host_that_is_no_host_names_the_address_it_came_in_on(
    keel: Served, host: str
) -> None:
    raw = await keel.exchange_raw(f"GET {CARD} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert {interface["url"] for interface in json.loads(body)["supportedInterfaces"]} == {keel.url}


async def test_an_agent_card_names_the_host_a_client_reached_it_by(keel: Served) -> None:
    for host, url in (("agents.example", "http://agents.example/"), ("[::1]:8080", "http://[::1]:8080/"), ("10.0.0.7:80", "http://10.0.0.7:80/")):
        with trio.fail_after(DEADLINE_S):
            card = (await keel.http.get(CARD, headers={"Host": host})).json()
        assert {interface["url"] for interface in card["supportedInterfaces"]} == {url}


async def test_the_agent_card_names_the_configured_endpoint(fake_model: FakeModel, tmp_path: Path) -> None:
    async with serve_keel(tmp_path / "state", fake_model, surface=SurfaceConfig(rpc_path="/a2a")) as keel:
        card = (await get(keel, CARD)).json()
    assert {interface["url"] for interface in card["supportedInterfaces"]} == {keel.url + "a2a"}


async def test_the_agent_card_refuses_other_methods(keel: Served) -> None:
    with trio.fail_after(DEADLINE_S):
        response = await keel.http.post(CARD, json={})
    assert response.status_code == 405
    assert "GET" in response.headers["allow"]


@pytest.mark.parametrize("path", ["/healthz/", "/.well-known/agent-cards.json", "/metrics"])
async def test_other_paths_are_a_plain_404(keel: Served, path: str) -> None:
    response = await get(keel, path)
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("text/plain")
