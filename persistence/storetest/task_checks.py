"""The task store's checks: versions and conflicts, the task a message starts, owners kept apart,
listing and its pages, update times, unfinished tasks, and text or numbers no backend can keep.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from persistence.api import TaskStore
from persistence.errors import (
    InvalidPage,
    InvalidTask,
    MessageTaken,
    PageOfOtherListing,
    TaskExists,
    TaskNotFound,
    VersionConflict,
)
from persistence.storetest.contract import LONE, Backend, task_check
from persistence.tasks import MAX_PAGE_CHARS

SUBMITTED, WORKING, COMPLETED = "TASK_STATE_SUBMITTED", "TASK_STATE_WORKING", "TASK_STATE_COMPLETED"
CANCELED = "TASK_STATE_CANCELED"


async def make_task(
    store: TaskStore, task_id: str, *, owner: str = "alice", context_id: str = "ctx", state: str = SUBMITTED
) -> Any:
    return await store.create(owner, task_id=task_id, context_id=context_id, state=state, task_json=json.dumps({"id": task_id}))


@task_check
async def a_task_starts_at_version_one_and_an_id_is_taken_once(backend: Backend) -> None:
    async with backend.tasks() as store:
        record = await make_task(store, "t1")
        assert (record.version, record.state, record.owner, record.context_id) == (1, SUBMITTED, "alice", "ctx")
        assert await store.get("alice", "t1") == record
        try:
            await make_task(store, "t1", owner="bob")
        except TaskExists as exc:
            assert "t1" in str(exc)
        else:
            raise AssertionError("a duplicate task id was accepted")


@task_check
async def an_update_bumps_the_version_and_a_stale_one_is_a_conflict(backend: Backend) -> None:
    async with backend.tasks() as store:
        await make_task(store, "t1")
        updated = await store.update("alice", "t1", state=WORKING, task_json='{"w":1}', expected_version=1)
        assert (updated.version, updated.state, updated.task_json) == (2, WORKING, '{"w":1}')
        try:
            await store.update("alice", "t1", state=COMPLETED, task_json="{}", expected_version=1)
        except VersionConflict as exc:
            assert (exc.task_id, exc.expected, exc.actual) == ("t1", 1, 2)
            assert "t1" in str(exc) and "1" in str(exc) and "2" in str(exc)
        else:
            raise AssertionError("a stale version was accepted")
        unchecked = await store.update("alice", "t1", state=COMPLETED, task_json="{}", expected_version=None)
        assert unchecked.version == 3
        assert (await store.get("alice", "t1")).state == COMPLETED
        try:  # an urgent write is the same write, only sooner
            await store.update("alice", "t1", state=CANCELED, task_json="{}", expected_version=2, urgent=True)
        except VersionConflict as exc:
            assert (exc.expected, exc.actual) == (2, 3)
        else:
            raise AssertionError("a stale urgent write was accepted")
        urgent = await store.update("alice", "t1", state=CANCELED, task_json='{"c":1}', expected_version=3, urgent=True)
        assert (urgent.version, urgent.state) == (4, CANCELED) and await store.get("alice", "t1") == urgent


@task_check
async def a_task_utf8_cannot_hold_is_refused_by_name_and_fails_no_other_write(backend: Backend) -> None:
    async with backend.tasks() as store:
        await make_task(store, "t1")
        refused: list[InvalidTask] = []

        async def attempt(call: Callable[[], Awaitable[object]]) -> None:
            try:
                await call()
            except InvalidTask as exc:
                refused.append(exc)

        async with trio.open_nursery() as nursery:  # queued together, as one batch would be
            bad_json = '"' + LONE + '"'
            nursery.start_soon(
                attempt, lambda: store.update("alice", "t1", state=WORKING, task_json=bad_json, expected_version=1)
            )
            nursery.start_soon(attempt, lambda: make_task(store, "t2", context_id="ctx-" + LONE))
            for k in range(5):
                nursery.start_soon(make_task, store, f"neighbour-{k}")
        assert sorted(exc.task_id for exc in refused) == ["t1", "t2"], refused
        assert all("surrogate" in str(exc) and "nothing was written" in str(exc) for exc in refused)
        assert "context id" in str(next(exc for exc in refused if exc.task_id == "t2"))
        assert (await store.get("alice", "t1")).version == 1
        assert (await store.list("alice")).total_size == 6  # t1 and the five neighbours; no t2
        try:
            await store.get("alice", "t-" + LONE)
        except TaskNotFound:
            pass
        else:
            raise AssertionError("a task id no store can hold was found")
        assert (await store.list("alice", context_id="ctx-" + LONE)).total_size == 0


@task_check
async def a_message_starts_one_task_per_owner_and_a_second_start_names_the_first(backend: Backend) -> None:
    async with backend.tasks() as one, backend.tasks() as two:
        first = await one.create("alice", task_id="t1", context_id="c", state=SUBMITTED, task_json="{}", message_id="m1")
        outcomes: list[object] = []

        async def start(store: TaskStore, n: int) -> None:
            try:
                await store.create(
                    "alice", task_id=f"again-{n}", context_id="c", state=SUBMITTED, task_json="{}", message_id="m1"
                )
                outcomes.append("created")
            except MessageTaken as exc:
                outcomes.append((exc.message_id, exc.task_id))

        async with trio.open_nursery() as nursery:  # two stores, as two processes would be
            for n in range(4):
                nursery.start_soon(start, one if n % 2 else two, n)
        assert outcomes == [("m1", "t1")] * 4
        assert "'m1'" in str(MessageTaken("m1", "t1")) and "'t1'" in str(MessageTaken("m1", "t1"))
        # Another owner's message of that id, another id, and tasks with none are all free.
        await two.create("bob", task_id="b1", context_id="c", state=SUBMITTED, task_json="{}", message_id="m1")
        await two.create("alice", task_id="t2", context_id="c", state=SUBMITTED, task_json="{}", message_id="m2")
        for n in range(2):
            await one.create("alice", task_id=f"none-{n}", context_id="c", state=SUBMITTED, task_json="{}")
        assert await one.get("alice", "t1") == first
        assert (await two.list("alice")).total_size == 4
        # Which task a message started, as either store finds it; another owner's is not said.
        assert (await two.started_by("alice", "m1"), await one.started_by("bob", "m1")) == ("t1", "b1")
        assert (await one.started_by("alice", "m3"), await one.started_by("carol", "m1")) == (None, None)
        assert await one.started_by("alice", LONE) is None
        try:  # a taken task id is still TaskExists, whatever the message
            await one.create("alice", task_id="t1", context_id="c", state=SUBMITTED, task_json="{}", message_id="m9")
        except TaskExists:
            pass
        else:
            raise AssertionError("a duplicate task id was accepted")


@task_check
async def concurrent_updates_of_one_version_let_exactly_one_through(backend: Backend) -> None:
    async with backend.tasks() as one, backend.tasks() as two:
        await make_task(one, "t1")
        outcomes: list[str] = []

        async def update(store: TaskStore, n: int) -> None:
            try:
                await store.update("alice", "t1", state=WORKING, task_json=json.dumps({"n": n}), expected_version=1)
                outcomes.append("ok")
            except VersionConflict:
                outcomes.append("conflict")

        async with trio.open_nursery() as nursery:
            for n in range(10):
                nursery.start_soon(update, one if n % 2 else two, n)
        assert sorted(outcomes) == ["conflict"] * 9 + ["ok"]
        assert (await two.get("alice", "t1")).version == 2


@task_check
async def another_owners_task_is_indistinguishable_from_a_missing_one(backend: Backend) -> None:
    async with backend.tasks() as store:
        await make_task(store, "mine", owner="alice")
        messages = []
        for call in (
            lambda: store.get("bob", "mine"),
            lambda: store.get("bob", "nothing"),
            lambda: store.update("bob", "mine", state=COMPLETED, task_json="{}", expected_version=None),
        ):
            try:
                await call()
            except TaskNotFound as exc:
                messages.append(str(exc).replace("nothing", "mine"))
            else:
                raise AssertionError("another owner's task was visible")
        assert len(set(messages)) == 1
        assert (await store.list("bob")).records == ()
        assert (await store.get("alice", "mine")).state == SUBMITTED


@task_check
async def listing_filters_orders_newest_first_and_pages_through_everything_once(backend: Backend) -> None:
    async with backend.tasks() as store:
        for i in range(23):
            await make_task(store, f"t{i:02}", context_id="even" if i % 2 == 0 else "odd")
        await make_task(store, "other-owner", owner="bob")
        for i in range(0, 23, 3):
            await store.update("alice", f"t{i:02}", state=WORKING, task_json="{}", expected_version=None)
        seen: list[str] = []
        token = ""
        while True:
            page = await store.list("alice", page_size=5, page_token=token)
            assert page.total_size == 23
            seen.extend(r.id for r in page.records)
            keys = [(r.updated_at_ms, r.id) for r in page.records]
            assert keys == sorted(keys, reverse=True)
            token = page.next_page_token
            if not token:
                break
        assert sorted(seen) == [f"t{i:02}" for i in range(23)] and len(seen) == 23
        even = await store.list("alice", context_id="even", page_size=100)
        assert {r.id for r in even.records} == {f"t{i:02}" for i in range(0, 23, 2)} and even.total_size == 12
        working = await store.list("alice", state=WORKING)
        assert {r.id for r in working.records} == {f"t{i:02}" for i in range(0, 23, 3)}
        newest = max((r for r in (await store.list("alice", page_size=100)).records), key=lambda r: r.updated_at_ms)
        later = await store.list("alice", updated_after_ms=newest.updated_at_ms)
        assert later.records == () and later.total_size == 0
        earlier = await store.list("alice", updated_after_ms=newest.updated_at_ms - 10**9)
        assert earlier.total_size == 23


@task_check
async def a_listings_later_pages_give_the_total_its_first_page_counted(backend: Backend) -> None:
    listings: list[dict[str, Any]] = [{}, {"context_id": "ctx"}, {"state": SUBMITTED}, {"updated_after_ms": 0}]
    async with backend.tasks() as store:
        for k, filters in enumerate(listings):
            owner = f"owner-{k}"
            for i in range(6):
                await make_task(store, f"{owner}-t{i}", owner=owner)
            first = await store.list(owner, page_size=4, **filters)
            assert first.total_size == 6 and first.next_page_token, filters
            await make_task(store, f"{owner}-late", owner=owner)
            later = await store.list(owner, page_size=4, page_token=first.next_page_token, **filters)
            assert later.total_size == 6, filters  # as the listing's first page counted it
            assert (await store.list(owner, **filters)).total_size == 7, filters  # a listing begun anew counts anew
            # A token of an earlier build carries no total: its page counts the tasks as they are.
            token = first.next_page_token
            fields = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
            earlier = base64.urlsafe_b64encode(json.dumps(fields[:-1]).encode()).decode().rstrip("=")
            assert (await store.list(owner, page_size=4, page_token=earlier, **filters)).total_size == 7, filters


@task_check
async def a_page_ends_early_once_its_tasks_pass_the_page_limit_and_the_next_goes_on_from_there(backend: Backend) -> None:
    async with backend.tasks() as store:
        big = json.dumps({"history": "x" * (MAX_PAGE_CHARS // 3)})
        for i in range(5):
            await store.create("alice", task_id=f"t{i}", context_id="ctx", state=SUBMITTED, task_json=big, updated_at_ms=1000 + i)
        await store.create("alice", task_id="huge", context_id="ctx", state=SUBMITTED, task_json=big * 4, updated_at_ms=999)
        pages: list[list[str]] = []
        token = ""
        while not pages or token:
            page = await store.list("alice", page_size=100, page_token=token)
            assert page.total_size == 6
            pages.append([r.id for r in page.records])
            token = page.next_page_token
        assert pages == [["t4", "t3"], ["t2", "t1"], ["t0"], ["huge"]]  # one task larger than a page is a page


@task_check
async def a_bad_page_size_or_token_is_a_clear_error(backend: Backend) -> None:
    async with backend.tasks() as store:
        for size in (0, 101, -1):
            try:
                await store.list("alice", page_size=size)
            except InvalidPage as exc:
                assert "between 1 and 100" in str(exc) and str(size) in str(exc)
            else:
                raise AssertionError(f"page size {size} was accepted")
        # Not base64; base64 of what is not a token; tokens forged with a time past SQLite's
        # integers, before the epoch, or not a number at all; an id that is not text; a total
        # that is no count.
        forged = ([10**30, "t1"], [-1, "t1"], [True, "t1"], [1.5, "t1"], [1, 2], [1, "t1", 3], [1, "t\ud800"],
                  [1, "t1", None, None, 1.5], [1, "t1", 7, None, None], [1, "t1", None, None, None, None],
                  [1, "t1", None, None, None, -1], [1, "t1", None, None, None, 2.5], [1, "t1", None, None, None, 10**30],
                  [1, "t1", None, None, None, 3, 4])
        tokens = ["%%%not-a-token", "bm90IGpzb24", *(base64.urlsafe_b64encode(json.dumps(f).encode()).decode() for f in forged)]
        for token in tokens:
            try:
                await store.list("alice", page_token=token)
            except InvalidPage as exc:
                assert "malformed" in str(exc) and "nextPageToken" in str(exc)
            else:
                raise AssertionError(f"a malformed page token was accepted: {token}")


@task_check
async def a_page_token_goes_on_only_with_the_filters_it_was_given_with(backend: Backend) -> None:
    async with backend.tasks() as store:
        for i, context in enumerate(("a", "a", "b", "b")):
            await store.create(
                "alice", task_id=f"t{i}", context_id=context, state=SUBMITTED, task_json="{}", updated_at_ms=1000 + i
            )
        token = (await store.list("alice", context_id="a", page_size=1)).next_page_token
        assert [r.id for r in (await store.list("alice", context_id="a", page_size=9, page_token=token)).records] == ["t0"]
        cases: list[tuple[dict[str, Any], tuple[str, ...]]] = [
            ({"context_id": "b"}, ("context_id",)),
            ({"context_id": "a", "state": SUBMITTED}, ("state",)),
            ({"updated_after_ms": 0}, ("context_id", "updated_after_ms")),
        ]
        for filters, changed in cases:
            try:
                await store.list("alice", page_token=token, **filters)
            except PageOfOtherListing as exc:
                assert exc.changed == changed, (filters, exc.changed)
            else:
                raise AssertionError(f"a page token of context 'a' was taken with {filters}")


@task_check
async def a_task_keeps_the_update_time_it_is_given_and_is_listed_by_it(backend: Backend) -> None:
    async with backend.tasks() as store:
        made = await store.create("alice", task_id="t1", context_id="ctx", state=SUBMITTED, task_json="{}", updated_at_ms=2000)
        assert made.updated_at_ms == 2000 and (await store.get("alice", "t1")).updated_at_ms == 2000
        await store.create("alice", task_id="t2", context_id="ctx", state=SUBMITTED, task_json="{}", updated_at_ms=1000)
        changed = await store.update("alice", "t2", state=WORKING, task_json="{}", expected_version=1, updated_at_ms=3000)
        assert changed.updated_at_ms == 3000
        assert [r.id for r in (await store.list("alice")).records] == ["t2", "t1"]  # by the times given, newest first
        assert [r.id for r in (await store.list("alice", updated_after_ms=2000)).records] == ["t2"]  # strictly after
        assert [r.id for r in (await store.list("alice", updated_after_ms=1999)).records] == ["t2", "t1"]


@task_check
async def a_version_or_time_no_backend_keeps_as_given_is_refused_alike(backend: Backend) -> None:
    async with backend.tasks() as store, backend.sessions() as sessions:
        await make_task(store, "t1")
        def updating(**changes: Any) -> Callable[[], Awaitable[object]]:
            fields = {"state": WORKING, "task_json": "{}", "expected_version": 1, **changes}
            return lambda: store.update("alice", "t1", **fields)

        calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("expected version", updating(expected_version="1")),
            ("expected version", updating(expected_version=True)),
            ("update time", updating(updated_at_ms=2**63)),
            ("update time", updating(updated_at_ms=5.5)),
            (
                "update time",
                lambda: store.create("alice", task_id="t2", context_id="c", state=SUBMITTED, task_json="{}", updated_at_ms=-1),
            ),
            ("listed after", lambda: store.list("alice", updated_after_ms=2**63)),
            ("read", lambda: sessions.events("s", after=-0.5)),
        ]
        for words, call in calls:
            try:
                await call()
            except ValueError as exc:
                assert words in str(exc), str(exc)
            else:
                raise AssertionError(f"a bad {words} was taken")
        record = await store.get("alice", "t1")
        assert (record.state, record.version) == (SUBMITTED, 1)  # nothing written
        assert [r.id for r in (await store.list("alice")).records] == ["t1"]


@task_check
async def unfinished_tasks_are_found_across_owners(backend: Backend) -> None:
    async with backend.tasks() as store:
        await make_task(store, "a", owner="alice")
        await make_task(store, "b", owner="bob", state=WORKING)
        await make_task(store, "c", owner="bob", state=COMPLETED)
        assert {r.id for r in await store.unfinished()} == {"a", "b"}


@task_check
async def the_newest_status_time_is_found_across_owners(backend: Backend) -> None:
    async with backend.tasks() as store:
        assert await store.newest_status_ms() is None
        await store.create("alice", task_id="a", context_id="c", state=SUBMITTED, task_json="{}", updated_at_ms=3000)
        await store.create("bob", task_id="b", context_id="c", state=SUBMITTED, task_json="{}", updated_at_ms=1000)
        await store.update("bob", "b", state=WORKING, task_json="{}", expected_version=1, updated_at_ms=5000)
        await store.create("carol", task_id="c", context_id="c", state=SUBMITTED, task_json="{}", updated_at_ms=4000)
        assert await store.newest_status_ms() == 5000


@task_check
async def a_task_outlives_the_store_that_wrote_it(backend: Backend) -> None:
    async with backend.tasks() as store:
        await make_task(store, "t1")
        await store.update("alice", "t1", state=COMPLETED, task_json='{"done":true}', expected_version=1)
    async with backend.tasks() as reopened:
        record = await reopened.get("alice", "t1")
        assert (record.state, record.version, record.task_json) == (COMPLETED, 2, '{"done":true}')
