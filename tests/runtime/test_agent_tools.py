"""Tools: schema checks, bad calls as tool errors, timeouts, failures, and the way errors reach
the model through the loop."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from fake_model import Call, FakeModel, Reply

from persistence.transcript import Message, ToolCall
from runtime.agent import AgentRun, AgentSpec, Tool
from runtime.agent.tools import DEFAULT_TOOL_TIMEOUT_S, call_tool, schema_problem
from runtime.models import open_model_client
from persistence.session import Session
from persistence.sessions import open_session_store
from tests.runtime.agent_support import (
    DEADLINE_S,
    LOOKUP_SCHEMA,
    config_for,
    lookup_tool,
    make_tool,
    question,
    run_turn,
    sent_messages,
    stored_messages,
)

ALERT_SCHEMA = {
    "type": "object",
    "properties": {
        "severity": {"type": "string", "enum": ["page", "ticket"]},
        "minutes": {"type": "integer"},
        "ratio": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "silence": {"type": ["boolean", "null"]},
    },
    "required": ["severity"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"severity": "page", "minutes": 5, "ratio": 0.5, "tags": ["db"], "silence": None}, None),
        ({"severity": "page", "ratio": 2}, None),  # an integer is a number
        ([], "arguments must be object, not array"),
        ({}, "arguments.severity is required"),
        ({"severity": "email"}, 'arguments.severity must be one of ["page", "ticket"]'),
        ({"severity": "page", "minutes": "5"}, "arguments.minutes must be integer, not string"),
        ({"severity": "page", "minutes": 2.5}, "arguments.minutes must be integer, not number"),
        ({"severity": "page", "minutes": True}, "arguments.minutes must be integer, not boolean"),
        ({"severity": "page", "tags": ["db", 3]}, "arguments.tags[1] must be string, not integer"),
        ({"severity": "page", "silence": "yes"}, "arguments.silence must be boolean or null, not string"),
        ({"severity": "page", "owner": "me"}, "arguments.owner is not a known field (known: severity, minutes, ratio, tags, silence)"),
    ],
)
def test_schema_problem_names_the_first_thing_wrong_and_where(value: Any, problem: str | None) -> None:
    assert schema_problem(ALERT_SCHEMA, value, "arguments") == problem


def test_schema_problem_allows_unknown_fields_unless_the_schema_forbids_them() -> None:
    assert schema_problem({"type": "object", "properties": {}}, {"anything": 1}, "arguments") is None


async def test_an_unknown_tool_is_a_tool_error_naming_the_tools_there_are() -> None:
    outcome = await call_tool({"lookup": lookup_tool()}, ToolCall("call_1", "restart_vault", "{}"))
    assert outcome.is_error
    assert outcome.text == "error: there is no tool named 'restart_vault'; the tools are: lookup"


async def test_arguments_that_are_not_json_are_a_tool_error_and_the_tool_is_not_run() -> None:
    calls: list[dict[str, Any]] = []
    outcome = await call_tool({"lookup": lookup_tool(calls)}, ToolCall("call_1", "lookup", '{"service": vault}'))
    assert outcome.is_error
    assert outcome.text.startswith("error: the arguments of lookup are not JSON (")
    assert calls == []


async def test_arguments_nested_past_what_json_reads_are_a_tool_error() -> None:
    calls: list[dict[str, Any]] = []
    nested = "[" * 100_000 + "]" * 100_000
    outcome = await call_tool({"lookup": lookup_tool(calls)}, ToolCall("call_1", "lookup", nested))
    assert outcome.is_error and outcome.text.startswith("error: the arguments of lookup are not JSON (")
    assert calls == []


async def test_a_tool_error_quoting_what_the_model_sent_is_text_the_transcript_can_store(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # "\ud800" in JSON is a lone surrogate once read: quoted back as is, it could not be saved.
    fake_model.script = [Reply(tool_calls=[Call("lookup", '{"service": "vault", "\\ud800": 1}')]), Reply(text="Done.")]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db") as store:
            result = await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), question(), session=Session.open("s", store))
    error = result.messages[2]
    assert result.output == "Done." and error.role == "tool"
    assert "arguments.\ufffd is not a known field" in error.text


async def test_arguments_that_are_not_an_object_are_a_tool_error_even_under_an_empty_schema() -> None:
    calls: list[dict[str, Any]] = []
    open_tool = make_tool("lookup", lookup_tool(calls).invoke, parameters={})
    outcome = await call_tool({"lookup": open_tool}, ToolCall("call_1", "lookup", '["vault"]'))
    assert (outcome.text, outcome.is_error) == ("error: the arguments of lookup must be a JSON object, not array", True)
    assert calls == []


async def test_arguments_that_do_not_match_the_schema_are_a_tool_error_and_the_tool_is_not_run() -> None:
    calls: list[dict[str, Any]] = []
    outcome = await call_tool({"lookup": lookup_tool(calls)}, ToolCall("call_1", "lookup", '{"service": 3}'))
    assert (outcome.text, outcome.is_error) == ("error: lookup was called with bad arguments: arguments.service must be string, not integer", True)
    assert calls == []


async def test_empty_arguments_mean_no_arguments() -> None:
    seen: list[dict[str, Any]] = []

    async def status(arguments: dict[str, Any]) -> str:
        seen.append(arguments)
        return "green"

    outcome = await call_tool({"status": make_tool("status", status)}, ToolCall("call_1", "status", ""))
    assert (outcome.text, outcome.is_error, seen) == ("green", False, [{}])


async def test_a_tool_that_raises_is_a_tool_error() -> None:
    async def flaky(_arguments: dict[str, Any]) -> str:
        raise ConnectionResetError("the incident database went away")

    outcome = await call_tool({"flaky": make_tool("flaky", flaky)}, ToolCall("call_1", "flaky", "{}"))
    assert (outcome.text, outcome.is_error) == ("error: flaky failed: the incident database went away", True)


async def test_a_tool_that_returns_no_text_is_a_tool_error() -> None:
    async def sloppy(_arguments: dict[str, Any]) -> str:
        return {"status": "green"}  # type: ignore[return-value]  # the mistake under test

    outcome = await call_tool({"sloppy": make_tool("sloppy", sloppy)}, ToolCall("call_1", "sloppy", "{}"))
    assert (outcome.text, outcome.is_error) == ("error: sloppy failed: it returned no text", True)


async def test_a_tool_that_runs_past_its_timeout_is_a_tool_error(autojump_clock: trio.testing.MockClock) -> None:
    async def hang(_arguments: dict[str, Any]) -> str:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    started = trio.current_time()
    outcome = await call_tool({"hang": make_tool("hang", hang, timeout_s=7.5)}, ToolCall("call_1", "hang", "{}"))
    assert (outcome.text, outcome.is_error) == ("error: hang did not finish within 7.5 s", True)
    assert trio.current_time() - started == pytest.approx(7.5)


def test_tools_carry_a_timeout_by_default() -> None:
    assert lookup_tool().timeout_s == DEFAULT_TOOL_TIMEOUT_S
    with pytest.raises(ValueError, match="timeout_s"):
        make_tool("lookup", lookup_tool().invoke, timeout_s=0)


async def test_cancelling_the_caller_is_not_a_tool_error(autojump_clock: trio.testing.MockClock) -> None:
    async def hang(_arguments: dict[str, Any]) -> str:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    outcomes = []
    with trio.move_on_after(1.0) as scope:  # well inside the tool's own 30 s
        outcomes.append(await call_tool({"hang": make_tool("hang", hang)}, ToolCall("call_1", "hang", "{}")))
    assert scope.cancelled_caught
    assert outcomes == []


async def untidy(_arguments: dict[str, Any]) -> str:
    """A tool of its own nursery, one of whose tasks fails as it is cancelled."""

    async def cleanup_fails() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise OSError("the scratch file was already gone")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cleanup_fails)
        await trio.sleep_forever()
    raise AssertionError("unreachable")


async def test_a_tool_whose_tasks_fail_as_its_timeout_cancels_them_is_a_timed_out_tool(
    autojump_clock: trio.testing.MockClock,
) -> None:
    outcome = await call_tool({"untidy": make_tool("untidy", untidy, timeout_s=2)}, ToolCall("call_1", "untidy", "{}"))
    assert (outcome.text, outcome.is_error) == ("error: untidy did not finish within 2 s", True)


async def test_cancelling_the_caller_of_a_tool_whose_tasks_fail_as_they_are_cancelled_is_a_clean_cancel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    outcomes = []
    with trio.move_on_after(1.0) as scope:
        outcomes.append(await call_tool({"untidy": make_tool("untidy", untidy)}, ToolCall("call_1", "untidy", "{}")))
    assert scope.cancelled_caught
    assert outcomes == []


def test_a_tool_name_the_model_api_would_refuse_is_refused_when_the_tool_is_made() -> None:
    with pytest.raises(ValueError, match="tool name 'look up'"):
        make_tool("look up", lookup_tool().invoke)


def test_an_agent_cannot_have_two_tools_of_one_name() -> None:
    with pytest.raises(ValueError, match="tool names must be unique"):
        AgentSpec(tools=[lookup_tool(), lookup_tool()])


async def test_bad_tool_calls_go_back_to_the_model_as_tool_errors_and_the_run_goes_on(fake_model: FakeModel) -> None:
    async def hang(_arguments: dict[str, Any]) -> str:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def broken(_arguments: dict[str, Any]) -> str:
        raise RuntimeError("the runbook index is rebuilding")

    tools: list[Tool] = [
        lookup_tool(),
        make_tool("hang", hang, timeout_s=0.01),
        make_tool("broken", broken),
    ]
    fake_model.script = [
        Reply(
            tool_calls=[
                Call("restart_vault", "{}"),
                Call("lookup", '{"service": vault'),
                Call("lookup", '{"service": 3}'),
                Call("hang", "{}"),
                Call("broken", "{}"),
                Call("lookup", '{"service": "vault"}'),
            ]
        ),
        Reply(text="One lookup worked; the rest failed."),
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(config_for(fake_model)) as client:
            result = await AgentRun(client, AgentSpec(tools=tools), question()).run()
    results = [message["content"] for message in sent_messages(fake_model.bodies[1]) if message["role"] == "tool"]
    assert [text.split(":")[0] if text.startswith("error") else text for text in results] == ["error"] * 5 + [
        "vault: lease TTL 24h, last renewed 25h ago"
    ]
    assert "no tool named 'restart_vault'" in results[0]
    assert "not JSON" in results[1]
    assert "arguments.service must be string" in results[2]
    assert "did not finish within 0.01 s" in results[3]
    assert "the runbook index is rebuilding" in results[4]
    assert result.output == "One lookup worked; the rest failed."
    assert LOOKUP_SCHEMA == fake_model.bodies[0]["tools"][0]["function"]["parameters"]


VAULT = '{ "service" :\t"vault" }'  # a good call, spaced as a model may space it


def object_as_a_strict_server_reads_it(text: str) -> dict[str, Any]:
    """``text`` read as Ollama (Go's JSON decoder, into a map) and vLLM (json.loads, for the chat
    template) read a replayed call's arguments: a JSON object, or the request is refused (400)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    value = json.loads(text, parse_constant=refuse)
    assert isinstance(value, dict), text
    return value


async def test_arguments_the_model_got_wrong_go_back_to_it_as_an_object_the_server_can_read(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # The model's own arguments are sent back with its call on every later request. A server
    # that cannot read them as an object refuses the request, and with it every later turn of
    # the conversation: the bad call would end the run it should only have been told about.
    fake_model.script = [
        Reply(
            tool_calls=[
                Call("lookup", ""),
                Call("lookup", '{"service": vault'),
                Call("lookup", '["vault"]'),
                Call("lookup", '{"service": NaN}'),
                Call("lookup", VAULT),
            ]
        ),
        Reply(text="One lookup worked."),
        Reply(text="Still here."),
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db") as store:
            session = Session.open("s", store)
            first = await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), question(), session=session)
            follow_up = [*first.messages, Message(role="user", text="And now?")]
            await run_turn(fake_model, AgentSpec(tools=[lookup_tool()]), follow_up, session=session)
        stored = await stored_messages(tmp_path / "runtime.db", "s")
    for body in fake_model.bodies[1:]:
        [call_message] = [m for m in sent_messages(body) if m.get("tool_calls")]
        sent = [call["function"]["arguments"] for call in call_message["tool_calls"]]
        read = [object_as_a_strict_server_reads_it(arguments) for arguments in sent]
        assert read[0] == {}  # no arguments: what the tool was run with
        assert [json.dumps(value) for value in read[1:4]] == [
            json.dumps({"invalid_arguments": text}) for text in ('{"service": vault', '["vault"]', '{"service": NaN}')
        ]  # what the model wrote, for it to see beside the error it was sent
        assert sent[4] == VAULT  # a good call's arguments go byte for byte, as ever
    # The transcript keeps what the model wrote.
    assert [call.arguments for call in stored[1].tool_calls] == ["", '{"service": vault', '["vault"]', '{"service": NaN}', VAULT]


async def test_a_tool_text_that_is_not_unicode_is_stored_and_sent_with_replacement_characters(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    # A file name that is not UTF-8, read as Python reads one: its bad byte becomes a lone
    # surrogate, which no store can hold. The run goes on, and stores what the model was sent.
    name = os.fsdecode(b"report-\xe9.txt")

    async def list_files(_arguments: dict[str, Any]) -> str:
        return f"files: {name}"

    async def open_file(_arguments: dict[str, Any]) -> str:
        raise FileNotFoundError(f"no such file: {name}")

    fake_model.script = [Reply(tool_calls=[Call("list_files", "{}"), Call("open_file", "{}")]), Reply(text="One file.")]
    tools = [make_tool("list_files", list_files), make_tool("open_file", open_file)]
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db") as store:
            result = await run_turn(fake_model, AgentSpec(tools=tools), question(), session=Session.open("s", store))
    results = [message["content"] for message in sent_messages(fake_model.bodies[1]) if message["role"] == "tool"]
    assert results == ["files: report-\ufffd.txt", "error: open_file failed: no such file: report-\ufffd.txt"]
    assert result.output == "One file."
    assert await stored_messages(tmp_path / "runtime.db", "s") == list(result.messages)


async def test_a_tool_output_larger_than_a_message_may_be_is_cut_short_saying_so_and_the_run_goes_on(
    fake_model: FakeModel, tmp_path: Path
) -> None:
    log = "".join(f"03:{minute % 60:02d} renew failed: permission denied\n" for minute in range(500))

    async def read_log(_arguments: dict[str, Any]) -> str:
        return log

    fake_model.script = [Reply(tool_calls=[Call("read_log", "{}")]), Reply(text="Renewals failed all night.")]
    path = tmp_path / "runtime.db"
    with trio.fail_after(DEADLINE_S):
        async with open_session_store(path, max_event_bytes=4096) as store:
            spec = AgentSpec(tools=[make_tool("read_log", read_log)])
            result = await run_turn(fake_model, spec, question(), session=Session.open("s", store))
        stored = await stored_messages(path, "s")
    assert result.output == "Renewals failed all night."
    assert stored == list(result.messages)
    cut = stored[2]
    kept, note = cut.text.split("\n[", 1)
    assert log.startswith(kept) and len(kept) > 3000
    size = len(log.encode()) + len('{"role":"tool","text":"","tool_call_id":"call_1_0","name":"read_log"}') + log.count("\n")
    assert note == f"output cut here: the tool returned {size} bytes, more than the 4096 one message may hold]"
    assert 4096 - 100 < cut.stored_bytes() <= 4096
    # The model read what was kept, and the note.
    assert [m["content"] for m in sent_messages(fake_model.bodies[1]) if m["role"] == "tool"] == [cut.text]
