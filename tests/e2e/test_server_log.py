"""What runtime.server.serve logs of the failures an operator meets: each once, in one line
naming what it is about (the task and its context, the file, the model and where it is served),
never the API key."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from fake_model import Call, FakeModel, Reply
from runtime.agent import AgentSpec, Tool
from runtime.models import ModelConfig
from tests.e2e.harness import rpc, user_message
from tests.e2e.served_server import running_server
from tests.runtime.served import GATE_CALL, Gate
from tests.runtime.unanswered import unanswered_model_url

SECRET = "sk-keel-log-SECRET-4242"
MODEL = "qwen3:4b-instruct"
DEADLINE_S = 10
ANSWERED_S = 3  # within a load balancer's probe timeout, and well before the model's 5 s connect timeout


def said(caplog: pytest.LogCaptureFixture, about: str) -> list[logging.LogRecord]:
    """The records whose line mentions ``about``."""
    return [record for record in caplog.records if about in record.getMessage()]


async def test_the_start_up_log_names_where_it_serves_the_state_directory_and_the_model(
    tmp_path: Path, fake_model: FakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with_credentials = fake_model.base_url.replace("http://", "http://gateway-user:gateway-password@")
    async with running_server(tmp_path / "state", with_credentials) as server:
        log = "\n".join(record.getMessage() for record in caplog.records)
        assert server.url.rstrip("/") in log
        assert str(tmp_path / "state") in log
        assert f"model {MODEL!r} at {fake_model.base_url}" in log
        # The HTTP server's lines are named as Keel's: none looks like an error when there is none.
        [running] = said(caplog, "Running on")
        assert (running.name, running.levelname) == ("runtime.http", "INFO")
        assert not [record for record in caplog.records if "error" in record.name]
    assert "gateway-password" not in caplog.text and "gateway-user" not in caplog.text


@pytest.mark.parametrize(
    ("answer", "settings"),
    [
        pytest.param({"api_key": "another-key"}, {}, id="key-refused"),
        pytest.param({"default": Reply(text="never whole", hang_after_chunks=1)}, {"model_timeout_s": 0.5}, id="timed-out"),
    ],
)
async def test_a_task_the_model_fails_is_logged_once_as_a_warning_naming_it_its_context_and_the_model_server(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, answer: dict[str, Any], settings: dict[str, Any]
) -> None:
    caplog.set_level(logging.INFO)
    model: FakeModel = await nursery.start(FakeModel(**answer).serve)
    async with (
        httpx.AsyncClient(timeout=30) as client,
        running_server(tmp_path / "state", model.base_url, model_api_key=SECRET, **settings) as server,
    ):
        sent = await rpc(client, server.url, "SendMessage", {"message": user_message("hi")})
    task = sent["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    [line] = said(caplog, task["id"])
    assert line.levelno == logging.WARNING, line.getMessage()
    assert task["contextId"] in line.getMessage() and model.base_url in line.getMessage(), line.getMessage()
    assert SECRET not in caplog.text and SECRET not in str(sent)


async def test_a_task_the_model_left_silent_is_logged_naming_the_setting_that_bounds_the_silence(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    model: FakeModel = await nursery.start(FakeModel(default=Reply(text="never whole", hang_after_chunks=1)).serve)
    async with (
        httpx.AsyncClient(timeout=30) as client,
        running_server(tmp_path / "state", model.base_url, model_timeout_s=0.5) as server,
    ):
        sent = await rpc(client, server.url, "SendMessage", {"message": user_message("hi")})
    task = sent["result"]["task"]
    assert "nothing arrived within 0.5s" in str(task["status"])
    [line] = said(caplog, task["id"])
    assert "AGENT_MODEL_TIMEOUT_S (--model-timeout-s) is 0.5s" in line.getMessage(), line.getMessage()
    assert "AGENT_MODEL_TIMEOUT_S" not in str(sent)  # the operator's to change, not the client's


async def test_healthz_whose_model_server_never_answers_a_connection_says_so_after_a_tasks_connect_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Its host off, or a firewall dropping what is sent to it: no refusal comes, the connect waits.
    # It waited 1 s, where a task's waits 5 s: a model server 2 s away was unreachable to /healthz
    # alone. Each answer comes at once all the same, with what the last check found.
    connect_timeout_s = ModelConfig().connect_timeout_s
    answers: list[str] = []
    with unanswered_model_url() as url:
        async with httpx.AsyncClient(timeout=30) as client, running_server(tmp_path / "state", url) as server:
            with trio.fail_after(connect_timeout_s + DEADLINE_S):
                while not answers or "no connection to the model server" not in answers[-1]:
                    with trio.fail_after(ANSWERED_S):
                        health = await client.get(server.url + "healthz")
                    assert health.status_code == 503, health.text
                    answers.append(health.text)
    assert f"no connection to the model server was made within {connect_timeout_s:g}s" in answers[-1], answers[-1]
    assert "the model catalog check has not finished yet" in answers[0], answers[0]
    [line] = said(caplog, "readiness: the model server")
    assert url.removesuffix("/v1") in line.getMessage() and "not a refusal" in line.getMessage(), line.getMessage()
    assert "Cancelled" not in caplog.text and "deadline" not in caplog.text


async def test_a_task_whose_model_server_makes_no_connection_fails_within_the_connect_timeout_set(tmp_path: Path) -> None:
    # AGENT_MODEL_CONNECT_TIMEOUT_S: a connect that is not answered is given up on after it (and
    # tried once more), where the default 5 s would have held the task for 10 s and more.
    with unanswered_model_url() as url:
        async with (
            httpx.AsyncClient(timeout=30) as client,
            running_server(tmp_path / "state", url, model_connect_timeout_s=0.3) as server,
        ):
            with trio.fail_after(ModelConfig().connect_timeout_s):
                sent = await rpc(client, server.url, "SendMessage", {"message": user_message("hi")})
    status = sent["result"]["task"]["status"]
    assert status["state"] == "TASK_STATE_FAILED", status
    said_to_client = status["message"]["parts"][0]["text"]
    assert "no connection to the model server was made within 0.3s" in said_to_client, said_to_client


@pytest.mark.parametrize(
    ("serving", "problem"),
    [
        pytest.param({"models": ("another-model",)}, "absent from the model server's catalog", id="not-in-catalog"),
        pytest.param({"api_key": "another-key"}, "the API key was refused", id="key-refused"),
    ],
)
async def test_a_model_healthz_finds_unusable_is_logged_naming_it_and_its_server(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, serving: dict[str, Any], problem: str
) -> None:
    model: FakeModel = await nursery.start(FakeModel(**serving).serve)
    async with (
        httpx.AsyncClient(timeout=30) as client,
        running_server(tmp_path / "state", model.base_url, model_api_key=SECRET) as server,
    ):
        health = await client.get(server.url + "healthz")
    assert health.status_code == 503 and problem in health.text
    [line] = said(caplog, "readiness")
    assert line.levelno == logging.WARNING
    assert repr(MODEL) in line.getMessage() and model.base_url in line.getMessage(), line.getMessage()
    assert SECRET not in caplog.text and SECRET not in health.text


@pytest.mark.parametrize(
    ("listed", "named"),
    [
        # llama.cpp's server lists the one model it serves by its file's path, unless given an alias.
        pytest.param(("models/Qwen3-4B-Instruct-Q4_K_M.gguf",), "which lists 'models/Qwen3-4B-Instruct-Q4_K_M.gguf'", id="llama.cpp"),
        pytest.param(tuple(f"model-{number}:latest" for number in range(12)), "'model-9:latest' and 2 more", id="many"),
        pytest.param((), "which lists no model", id="none"),
    ],
)
async def test_a_model_absent_from_the_catalog_is_logged_with_what_the_catalog_lists(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, listed: tuple[str, ...], named: str
) -> None:
    model: FakeModel = await nursery.start(FakeModel(models=listed).serve)
    async with httpx.AsyncClient(timeout=30) as client, running_server(tmp_path / "state", model.base_url) as server:
        health = await client.get(server.url + "healthz")
    assert health.status_code == 503 and "absent from the model server's catalog" in health.text
    [line] = said(caplog, "readiness")
    assert named in line.getMessage(), line.getMessage()
    assert not listed or listed[0] not in health.text  # the server's words are the log's alone


async def test_a_store_that_fails_under_a_send_is_logged_once(
    tmp_path: Path, fake_model: FakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    fake_model.default = Reply(text="ok")
    state = tmp_path / "state"
    async with httpx.AsyncClient(timeout=30) as client, running_server(state, fake_model.base_url) as server:
        await rpc(client, server.url, "SendMessage", {"message": user_message("hi")})
        for path in state.glob("*.db*"):  # deleted under the server, as an operator's cleanup might
            path.unlink()
        refused = await rpc(client, server.url, "SendMessage", {"message": user_message("hi again")})
    assert refused["error"]["code"] == -32603 and "tasks.db" not in str(refused)
    [line] = said(caplog, "tasks.db")
    assert line.levelno == logging.ERROR and line.exc_info is None, line.getMessage()


async def test_a_drain_its_runs_finish_says_so(tmp_path: Path, fake_model: FakeModel, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    gate = Gate()
    agent = AgentSpec(system_prompt="test", tools=(gate.tool(),))
    fake_model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="done after the gate")]
    async with (
        httpx.AsyncClient(timeout=30) as client,
        running_server(tmp_path / "state", fake_model.base_url, agent=agent) as server,
    ):
        hold = {"message": user_message("hold"), "configuration": {"returnImmediately": True}}
        sent = await rpc(client, server.url, "SendMessage", hold)
        await gate.wait_entered()
        server.shutdown.set()
        with trio.fail_after(10):
            while not said(caplog, "shutting down"):
                await trio.sleep(0.01)
        gate.opened.set()
        with trio.fail_after(30):
            await server.stopped.wait()
    assert sent["result"]["task"]["id"]
    lines = [record.getMessage() for record in said(caplog, "shutting down")]
    assert "1 task(s) running" in lines[0], lines
    assert "every task that was running has ended" in lines[-1], lines


async def test_a_drain_names_every_task_it_cancels_however_many(
    tmp_path: Path, fake_model: FakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    # The README promises the runs a shutdown cancels are named in the log, so that an operator
    # can tell their clients which to send again. Past twenty, the line ended with "...".
    caplog.set_level(logging.INFO)
    fake_model.default = Reply(text="never done", hang_after_chunks=1)
    count = 45
    async with (
        httpx.AsyncClient(timeout=30) as client,
        running_server(tmp_path / "state", fake_model.base_url, drain_timeout_s=0.5) as server,
    ):
        at_once = {"configuration": {"returnImmediately": True}}
        sent = [await rpc(client, server.url, "SendMessage", {"message": user_message(f"q{n}"), **at_once}) for n in range(count)]
        with trio.fail_after(20):
            while fake_model.answering < count:  # every run is answering, and hangs there
                await trio.sleep(0.01)
        server.shutdown.set()
        with trio.fail_after(30):
            await server.stopped.wait()
    cut = [record.getMessage() for record in said(caplog, "are canceled")]
    assert f"shutting down: {count} task(s) did not finish within 0.5 s and are canceled: " in cut[0], cut
    named = ", ".join(cut)
    missing = [answer["result"]["task"]["id"] for answer in sent if answer["result"]["task"]["id"] not in named]
    assert not missing, f"{len(missing)} task(s) cancelled but not named: {cut}"
    assert all(len(line) < 4096 for line in cut)  # one line a record, each of a length a log reader takes


async def test_a_tool_that_fails_or_runs_out_of_time_is_logged_once_naming_the_task(
    tmp_path: Path, fake_model: FakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    async def broken(_arguments: dict[str, Any]) -> str:
        raise OSError("the tool's disk is gone")

    async def stuck(_arguments: dict[str, Any]) -> str:
        await trio.sleep_forever()
        raise AssertionError("cancelled by its timeout")

    schema = {"type": "object", "properties": {}}
    tools = (Tool("broken", "Fails.", schema, broken), Tool("stuck", "Hangs.", schema, stuck, timeout_s=0.2))
    fake_model.script = [Reply(tool_calls=[Call("broken")]), Reply(tool_calls=[Call("stuck")]), Reply(text="done")]
    agent = AgentSpec(system_prompt="test", tools=tools)
    async with (
        httpx.AsyncClient(timeout=30) as client,
        running_server(tmp_path / "state", fake_model.base_url, agent=agent) as server,
    ):
        sent = await rpc(client, server.url, "SendMessage", {"message": user_message("use the tools")})
    task_id = sent["result"]["task"]["id"]
    assert sent["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    for tool in ("broken", "stuck"):
        [line] = [record for record in said(caplog, tool) if record.name == "runtime.agent.tools"]
        assert task_id in line.getMessage(), line.getMessage()
