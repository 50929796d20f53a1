"""Tools: schema checks, bad calls as tool errors, timeouts, failures, and the way errors reach
the model through the loop."""

from __future__ import annotations

import argparse
import json
import os
import re
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
from tests.runtime.served import serve_keel

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


async def test_a_tool_that_is_not_async_is_said_to_be_so_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    def plain(_arguments: dict[str, Any]) -> str:  # the mistake under test: no async
        return "green"

    tool = make_tool("plain", plain)  # type: ignore[arg-type]
    outcome = await call_tool({"plain": tool}, ToolCall("call_1", "plain", "{}"))
    assert (outcome.text, outcome.is_error) == ("error: plain failed: it could not be run", True)
    [record] = [r for r in caplog.records if r.name == "runtime.agent.tools"]
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        "tool 'plain' is not async: calling it returned a str, which cannot be awaited; define it with async def"
    )


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


# -- schemas: every keyword a tool's schema uses is one its calls are checked against --------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"minutes": 0, "ratio": 1, "tags": ["db"], "owner": "ops"}, None),
        ({"minutes": -5}, "arguments.minutes must be at least 0"),
        ({"minutes": 1441}, "arguments.minutes must be at most 1440"),
        ({"ratio": 0}, "arguments.ratio must be more than 0"),
        ({"ratio": 1.5}, "arguments.ratio must be less than 1.5"),
        ({"tags": []}, "arguments.tags must hold at least 1 item"),
        ({"tags": ["a", "b", "c", "d"]}, "arguments.tags must hold at most 3 items"),
        ({"tags": [""]}, "arguments.tags[0] must be at least 1 character long"),
        ({"tags": ["x" * 33]}, "arguments.tags[0] must be at most 32 characters long"),
        ({"owner": 7}, "arguments.owner must be string, not integer"),
    ],
)
def test_schema_problem_checks_bounds_and_the_schema_of_other_fields(value: Any, problem: str | None) -> None:
    schema = {
        "type": "object",
        "properties": {
            "minutes": {"type": "integer", "minimum": 0, "maximum": 1440},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1.5},
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 32},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "additionalProperties": {"type": "string"},
    }
    make_tool("alert", lookup_tool().invoke, parameters=schema)  # a schema its calls are checked against in full
    assert schema_problem(schema, value, "arguments") == problem


def team(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"team": schema}}


@pytest.mark.parametrize(
    ("parameters", "mistake"),
    [
        (team({"anyOf": [{"type": "string"}, {"type": "null"}]}), "'anyOf' (at parameters.properties.team) is not checked"),
        (team({"oneOf": [{"type": "string"}]}), "'oneOf' (at parameters.properties.team)"),
        (team({"$ref": "#/$defs/Team"}), "'$ref' (at parameters.properties.team)"),
        (team({"type": "string", "nullable": True}), "'nullable' (at parameters.properties.team)"),
        (team({"type": "string", "format": "date-time"}), "'format' (at parameters.properties.team)"),
        (team({"type": "string", "pattern": "^[a-z]+$"}), "'pattern' (at parameters.properties.team)"),
        (team({"type": "array", "uniqueItems": True}), "'uniqueItems' (at parameters.properties.team)"),
        (team({"type": "int"}), "parameters.properties.team.type is 'int', which is not a JSON schema type"),
        ({**team({"type": "string"}), "required": "team"}, "parameters.required must be a list of names"),
        (team({"type": "array", "items": [{"type": "string"}]}), "parameters.properties.team.items must be a schema"),
        (team({"type": "number", "minimum": "0"}), "parameters.properties.team.minimum must be a number"),
    ],
)
def test_a_schema_its_calls_would_not_be_checked_against_is_refused_when_the_tool_is_made(
    parameters: dict[str, Any], mistake: str
) -> None:
    # Otherwise a call breaking the rule would reach the tool as if it had been checked.
    with pytest.raises(ValueError, match=re.escape(mistake)) as refused:
        make_tool("page", lookup_tool().invoke, parameters=parameters)
    assert str(refused.value).startswith("tool 'page': ")


async def test_a_call_outside_its_schemas_bounds_goes_back_to_the_model_and_the_tool_is_not_run(fake_model: FakeModel) -> None:
    calls: list[dict[str, Any]] = []
    minutes = {"type": "integer", "minimum": 1, "maximum": 60}
    schema = {"type": "object", "properties": {"minutes": minutes}, "required": ["minutes"]}
    snooze = make_tool("snooze", lookup_tool(calls).invoke, parameters=schema)
    fake_model.script = [
        Reply(tool_calls=[Call("snooze", '{"minutes": -5}'), Call("snooze", '{"minutes": 5}')]),
        Reply(text="Snoozed for 5 minutes."),
    ]
    with trio.fail_after(DEADLINE_S):
        result = await run_turn(fake_model, AgentSpec(tools=[snooze]), question())
    results = [message["content"] for message in sent_messages(fake_model.bodies[1]) if message["role"] == "tool"]
    assert results[0] == "error: snooze was called with bad arguments: arguments.minutes must be at least 1"
    assert calls == [{"minutes": 5}]
    assert result.output == "Snoozed for 5 minutes."


# -- arguments that are JSON but cannot be taken as the model meant them ---------------------------


TWICE = '{"service": "vault", "service": 3}'


@pytest.mark.parametrize(
    ("arguments", "problem", "sent_back"),
    [
        (TWICE, "the key 'service' is given twice", TWICE),
        ('{"service": "vault", "ttl": 1e309}', "the number 1e309 is too large", None),
        ('{"service": "vault", "ttl": -1e400}', "the number -1e400 is too large", None),
    ],
)
async def test_arguments_json_reads_other_than_the_model_meant_are_a_tool_error_and_the_tool_is_not_run(
    fake_model: FakeModel, arguments: str, problem: str, sent_back: str | None
) -> None:
    # Python reads a key given twice as its last value (another reader may take the first) and
    # 1e309 as infinity. The call goes back as written, but for 1e309, which Go's decoder
    # (Ollama's) refuses, failing every later request of the conversation.
    calls: list[dict[str, Any]] = []
    open_lookup = make_tool("lookup", lookup_tool(calls).invoke, parameters={"type": "object"})
    fake_model.script = [Reply(tool_calls=[Call("lookup", arguments)]), Reply(text="Done.")]
    with trio.fail_after(DEADLINE_S):
        await run_turn(fake_model, AgentSpec(tools=[open_lookup]), question())
    [call_message, error] = sent_messages(fake_model.bodies[1])[1:]
    assert error["content"].startswith(f"error: the arguments of lookup cannot be read ({problem}")
    assert calls == []
    [sent] = call_message["tool_calls"]
    assert sent["function"]["arguments"] == (sent_back or json.dumps({"invalid_arguments": arguments}))


# -- a tool that ends more than its call ----------------------------------------------------------


@pytest.mark.parametrize(
    ("ending", "said"),
    [(SystemExit(2), "it exited with status 2"), (SystemExit(), "it exited"), (GeneratorExit(), "GeneratorExit")],
)
async def test_a_tool_that_raises_system_exit_or_generator_exit_is_a_tool_error(ending: BaseException, said: str) -> None:
    async def cli(_arguments: dict[str, Any]) -> str:
        raise ending

    outcome = await call_tool({"cli": make_tool("cli", cli)}, ToolCall("call_1", "cli", "{}"))
    assert (outcome.text, outcome.is_error) == (f"error: cli failed: {said}", True)


async def test_a_tool_that_calls_sys_exit_fails_its_call_not_the_server(fake_model: FakeModel, tmp_path: Path) -> None:
    # argparse exits the process on arguments it cannot parse: a tool wrapping a command's parser
    # must not take the server, and every task it runs, down with it.
    async def run_command(arguments: dict[str, Any]) -> str:
        parser = argparse.ArgumentParser(prog="vaultctl", exit_on_error=False)
        parser.add_argument("--lease", required=True)
        return str(parser.parse_args(arguments.get("argv", [])))

    command = make_tool("vaultctl", run_command)
    fake_model.script = [Reply(tool_calls=[Call("vaultctl", '{"argv": ["renew"]}')]), Reply(text="The command failed.")]
    fake_model.default = Reply(text="Still serving.")
    agent = AgentSpec(tools=[command])
    with trio.fail_after(DEADLINE_S):
        async with serve_keel(tmp_path / "state", fake_model, agent=agent) as keel:
            first = await keel.send("Renew the vault lease.")
            second = await keel.send("Are you there?")
    assert (first["status"]["state"], second["status"]["state"]) == ("TASK_STATE_COMPLETED", "TASK_STATE_COMPLETED")
    [error] = [m["content"] for m in sent_messages(fake_model.bodies[1]) if m["role"] == "tool"]
    assert error == "error: vaultctl failed: it exited with status 2"


# -- many calls in one answer ---------------------------------------------------------------------


async def test_an_answer_calling_more_tools_than_one_answer_may_runs_the_first_and_tells_the_model(
    fake_model: FakeModel,
) -> None:
    # Each call may take its tool's whole timeout and return a whole message: without a bound on
    # the calls of one answer, one answer of 1,000 calls would hold the run for hours.
    calls: list[dict[str, Any]] = []
    fake_model.script = [
        Reply(tool_calls=[Call("lookup", f'{{"service": "s{n}"}}') for n in range(1000)], chunk_chars=4096),
        Reply(text="Looked up the first ones."),
    ]
    with trio.fail_after(DEADLINE_S):
        result = await run_turn(fake_model, AgentSpec(tools=[lookup_tool(calls)]), question())
    limit = 32  # AgentSpec's default
    assert calls == [{"service": f"s{n}"} for n in range(limit)]
    results = [m for m in sent_messages(fake_model.bodies[1]) if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [f"call_1_{n}" for n in range(1000)]  # every call answered
    assert results[limit]["content"] == (
        f"error: lookup was not run: one answer may make at most {limit} tool calls; make the rest in your next answer"
    )
    assert result.output == "Looked up the first ones."
