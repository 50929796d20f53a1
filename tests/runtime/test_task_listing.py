"""ListTasks and GetTask as a client reads tasks back, through a real hypercorn server over real
SQLite files: pages that follow the request they came from, and dates a listing can trust."""

from __future__ import annotations

import base64
import json
import time
from datetime import datetime, timedelta

import pytest
from fake_model import Reply

import persistence.tasks
import runtime.tasks
from runtime.runner import ANONYMOUS
from tests.runtime.served import GATE_CALL, Served

WALK_MUST_MATCH = (
    "invalid params: 'pageToken' was given for a listing with another {}; send it with the filters of the request"
    " whose nextPageToken it was, or leave it out to list from the first page"
)


async def test_a_page_token_is_refused_with_filters_other_than_those_of_its_listing(keel: Served) -> None:
    keel.model.default = Reply(text="ok")
    for context in ("ctx-a", "ctx-a", "ctx-b", "ctx-b"):
        await keel.send("q", contextId=context)
    first = await keel.result("ListTasks", {"contextId": "ctx-a", "pageSize": 1})
    token = first["nextPageToken"]
    assert token
    # The same filters go on to the next page, however many tasks a page holds or how each is shown.
    rest = await keel.result("ListTasks", {"contextId": "ctx-a", "pageSize": 5, "historyLength": 0, "pageToken": token})
    assert [t["contextId"] for t in rest["tasks"]] == ["ctx-a"] and rest["nextPageToken"] == ""
    # Other filters would start after a task of another listing: a page of that listing, silently wrong.
    for params, changed in [
        ({"contextId": "ctx-b"}, "contextId"),
        ({}, "contextId"),
        ({"contextId": "ctx-a", "status": "TASK_STATE_COMPLETED"}, "status"),
        ({"contextId": "ctx-a", "statusTimestampAfter": "2000-01-01T00:00:00Z"}, "statusTimestampAfter"),
        ({"status": "TASK_STATE_WORKING"}, "contextId and status"),
    ]:
        error = await keel.error("ListTasks", {**params, "pageToken": token})
        assert error["code"] == -32602 and error["message"] == WALK_MUST_MATCH.format(changed), (params, error)


async def test_a_page_token_of_an_earlier_build_still_gives_the_next_page(keel: Served) -> None:
    # Tokens an earlier build gave ([status time in ms, task id]) carry no filters: a walk that a
    # server upgrade interrupted goes on with the filters the client sends, as it did.
    keel.model.default = Reply(text="ok")
    sent = [await keel.send("q", contextId="ctx") for _ in range(3)]
    first = await keel.result("ListTasks", {"contextId": "ctx", "pageSize": 1})
    (newest,) = first["tasks"]
    record = await keel.tasks.get(ANONYMOUS, newest["id"])
    earlier = base64.urlsafe_b64encode(json.dumps([record.updated_at_ms, record.id]).encode()).decode().rstrip("=")
    rest = await keel.result("ListTasks", {"contextId": "ctx", "pageToken": earlier})
    assert {t["id"] for t in rest["tasks"]} == {t["id"] for t in sent} - {newest["id"]}


async def test_a_task_made_after_the_clock_is_set_back_is_listed_as_the_newest_and_polled_from_the_newest_seen(
    keel: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An NTP correction sets the system clock back an hour between two tasks. Dated by that clock,
    # the second would be listed behind the first (ListTasks puts the most recent status first),
    # and a client polling from the newest status it has seen (statusTimestampAfter, as the
    # README says to poll) would not see it for an hour.
    keel.model.default = Reply(text="ok")
    first = await keel.send("before the clock is set back")
    clock = runtime.tasks.now
    monkeypatch.setattr(runtime.tasks, "now", lambda: clock() - timedelta(hours=1))
    second = await keel.send("after")
    stamps = [datetime.fromisoformat(t["status"]["timestamp"]) for t in (first, second)]
    assert stamps == sorted(stamps), stamps
    listed = await keel.result("ListTasks", {})
    assert [t["id"] for t in listed["tasks"]] == [second["id"], first["id"]]
    polled = await keel.result("ListTasks", {"statusTimestampAfter": first["status"]["timestamp"]})
    assert second["id"] in {t["id"] for t in polled["tasks"]}


async def test_tasks_of_a_conversation_left_unfinished_are_taken_up_in_the_order_they_came_though_the_clock_was_set_back(
    keel: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server stopped with two tasks of one conversation unfinished: the next one takes them up
    # in the order they were created (tasks.db's ``unfinished``). Dated by a clock set back
    # between the two, the second would take its turn first, its question answered before the first's.
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="first"), Reply(text="second")]
    first = await keel.send("first", blocking=False, contextId="conv")
    await keel.gate.wait_entered()
    wall_clock = runtime.tasks.now
    monkeypatch.setattr(runtime.tasks, "now", lambda: wall_clock() - timedelta(hours=1))
    monkeypatch.setattr(persistence.tasks, "now_ms", lambda: time.time_ns() // 1_000_000 - 3_600_000)
    second = await keel.send("second", blocking=False, contextId="conv")
    assert [record.id for record in await keel.tasks.unfinished()] == [first["id"], second["id"]]
    keel.gate.opened.set()
