"""Seeded mutations of the captured A2A requests (tests/protocol/wire), both versions, through a
real hypercorn server: every answer is a JSON-RPC response with a known code and a message, names
nothing internal, logs no error, and the server still serves what it acknowledged."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import trio
from fake_model import FakeModel, Reply

from tests.runtime.served import DEADLINE_S, serve_keel

WIRE = Path(__file__).resolve().parents[1] / "protocol" / "wire"
METHODS = [
    "SendMessage", "SendStreamingMessage", "GetTask", "ListTasks", "CancelTask", "SubscribeToTask", "GetExtendedAgentCard",
    "message/send", "message/stream", "tasks/get", "tasks/cancel", "tasks/resubscribe", "agent/getAuthenticatedExtendedCard",
    "tasks/list", "", "NoSuch",
]  # fmt: skip
ODD: list[Any] = [
    None, True, 0, -1, 2**31, 2**64, 1.5, -0.0, 1e308, "", " ", "\x00", "\u200f\u202e", "e\u0301\u0301", "\U0001f600",
    "x" * 600, "ROLE_USER", "user", "TASK_STATE_WORKING", "2026-01-31T12:00:00", [], {}, [[[]]], {"a": {"b": None}},
]  # fmt: skip
VERSIONS = ["1.0", None, "0.3", "", "2.0", "1.0, 0.3"]
CODES = {-32700, -32600, -32601, -32602, -32001, -32002, -32003, -32004, -32005, -32007, -32009}
LEAKS = ["Traceback", 'File "', ".py", "0x", "Error:", "sqlite", "SECRET-PROMPT-MARKER"]


def captured_requests() -> list[tuple[str | None, Any]]:
    """Each request of each capture (one a line) with its version header; err_parse is not JSON."""
    return [
        ("1.0" if path.name.startswith("v1") else None, json.loads(line))
        for path in sorted(WIRE.glob("*.req.json"))
        if path.name != "err_parse.req.json"
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def mutated(rng: random.Random, body: Any, known_ids: list[str]) -> Any:
    """``body`` with one to three of its values removed, replaced or added to."""
    for _ in range(rng.randrange(1, 4)):
        paths: list[tuple[Any, ...]] = []
        stack: list[tuple[tuple[Any, ...], Any]] = [((), body)]
        while stack:
            path, value = stack.pop()
            paths.append(path)
            children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
            stack.extend((path + (key,), child) for key, child in children)
        path = rng.choice(paths)
        if not path:
            return rng.choice(ODD)
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        choice = rng.randrange(5)
        if choice == 0:
            del parent[path[-1]]
        elif choice == 1 and path[-1] == "method":
            parent["method"] = rng.choice(METHODS)
        elif choice == 2 and isinstance(parent, dict):
            key = rng.choice(["id", "taskId", "contextId", "message_id", "metadata", "kind", "extra"])
            parent[key] = rng.choice(known_ids + ODD)
        else:
            parent[path[-1]] = rng.choice(ODD)
    return body


def problems_in(answer: bytes, content_type: str) -> list[str]:
    text = answer.decode()
    found = [f"names {leak!r}" for leak in LEAKS if leak in text]
    if content_type.startswith("text/event-stream"):
        responses = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    else:
        assert content_type == "application/json", content_type
        responses = [json.loads(text)]
    for response in responses:
        error = response.get("error")
        if error is not None and (error["code"] not in CODES or not error["message"]):
            found.append(f"error {error}")
    return found


@pytest.mark.parametrize("seed", [1, 2])
async def test_mutated_requests_get_json_rpc_errors_and_the_server_serves_on(
    fake_model: FakeModel, tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    caplog.set_level(logging.WARNING)
    fake_model.default = Reply(text="fine")
    rng = random.Random(seed)
    seeds = captured_requests()
    async with serve_keel(tmp_path / "state", fake_model) as keel:
        first = await keel.send("before")
        known_ids = [first["id"], first["contextId"]]
        for index in range(150):
            version, body = rng.choice(seeds)
            body = mutated(rng, json.loads(json.dumps(body)), known_ids)
            sent = body.get("params") if isinstance(body, dict) else None
            if isinstance(sent, dict) and isinstance(sent.get("message"), dict):
                sent["message"]["messageId"] = f"fuzz-{seed}-{index}"  # each send a new message
            version = rng.choice(VERSIONS) if rng.random() < 0.2 else version
            headers = {"Content-Type": "application/json", **({} if version is None else {"A2A-Version": version})}
            request = keel.http.build_request("POST", "/", content=json.dumps(body), headers=headers)
            with trio.fail_after(DEADLINE_S):
                response = await keel.http.send(request, stream=True)
                try:
                    answer = await response.aread()
                finally:
                    await response.aclose()
            assert response.status_code == 200, (body, answer)
            problems = problems_in(answer, response.headers["content-type"])
            assert not problems, (headers, body, answer, problems)
            assert not [record for record in caplog.records if record.levelno >= logging.ERROR], (body, caplog.text)
        assert (await keel.http.get("/livez")).json() == {"status": "alive"}
        assert (await keel.result("GetTask", {"id": first["id"]}))["status"]["state"] == "TASK_STATE_COMPLETED"
        assert (await keel.send("after"))["status"]["state"] == "TASK_STATE_COMPLETED"
