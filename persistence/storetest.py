"""The store contract, as checks any backend can be held to.

``await run_contract(make_backend)`` runs every check, each against a fresh, empty backend made
by ``make_backend()``. A backend hands out stores over its data: calling ``backend.sessions()``
twice gives two stores (think: two processes) over the same data. Test suites may instead
parametrize over ``SESSION_CHECKS`` and ``TASK_CHECKS`` to see each check by name.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import attrs
import trio
import trio.testing

from persistence.api import SessionStore, TaskStore
from persistence.errors import (
    InvalidEvent,
    InvalidPage,
    InvalidTask,
    MessageTaken,
    PageOfOtherListing,
    StoreClosed,
    TaskExists,
    TaskNotFound,
    TranscriptConflict,
    VersionConflict,
)
from persistence.session import Session
from persistence.tasks import MAX_PAGE_CHARS
from persistence.transcript import Message, ToolCall

DEADLINE_S = 30  # every check is bounded; none should come near it


class Backend(Protocol):
    def sessions(self) -> AbstractAsyncContextManager[Any]: ...

    def tasks(self) -> AbstractAsyncContextManager[Any]: ...


Check = Callable[[Backend], Awaitable[None]]
SESSION_CHECKS: list[Check] = []
TASK_CHECKS: list[Check] = []


def session_check(fn: Check) -> Check:
    SESSION_CHECKS.append(fn)
    return fn


def task_check(fn: Check) -> Check:
    TASK_CHECKS.append(fn)
    return fn


async def run_contract(make_backend: Callable[[], Backend]) -> None:
    """Run every check, each on a fresh backend; raises AssertionError naming the failed check."""
    for check in SESSION_CHECKS + TASK_CHECKS:
        try:
            with trio.fail_after(DEADLINE_S):
                await check(make_backend())
        except AssertionError as exc:
            raise AssertionError(f"{check.__name__}: {exc}") from exc


def user(text: str) -> Message:
    return Message(role="user", text=text)


def answer(text: str) -> Message:
    return Message(role="assistant", text=text)


# -- sessions -----------------------------------------------------------------------------------


@session_check
async def a_transcript_comes_back_in_the_order_it_went_in(backend: Backend) -> None:
    async with backend.sessions() as store:
        transcript = [user(f"m{i}") if i % 2 == 0 else answer(f"m{i}") for i in range(25)]
        await store.save("s", transcript)
        assert await store.messages("s") == transcript
        events = await store.events("s")
        assert [e.seq for e in events] == list(range(25))
        assert await store.events("s", after=-5) == events  # every event after position -5
        assert [e.seq for e in await store.events("s", after=20)] == [21, 22, 23, 24]


@session_check
async def saving_extends_and_never_duplicates(backend: Backend) -> None:
    async with backend.sessions() as store:
        first = [user("hello"), answer("hi")]
        await store.save("s", first)
        await store.save("s", first)
        await store.save("s", [*first, user("again")])
        assert await store.messages("s") == [*first, user("again")]
        assert await store.length("s") == 3


@session_check
async def a_save_that_does_not_extend_the_stored_transcript_is_refused(backend: Backend) -> None:
    async with backend.sessions() as store:
        await store.save("conv-7", [user("a"), answer("b")])
        for bad in ([user("a")], [user("a"), answer("different")], []):
            try:
                await store.save("conv-7", bad)
            except TranscriptConflict as exc:
                assert "conv-7" in str(exc)
            else:
                raise AssertionError(f"saving {bad!r} over a longer transcript was accepted")
        assert await store.messages("conv-7") == [user("a"), answer("b")]


@session_check
async def a_save_that_changes_an_earlier_message_is_refused_whoever_wrote_it(backend: Backend) -> None:
    stored = [user("q1"), answer("a1"), user("q2"), answer("a2")]
    edited = [user("q1"), answer("a different a1"), user("q2"), answer("a2"), user("q3")]
    async with backend.sessions() as one, backend.sessions() as two:
        await one.save("conv-9", stored)
        await one.append("conv-9", [user("q3").to_json()])  # an event no save of this store was given
        stored.append(user("q3"))
        for store in (one, two):  # the store that saved it, and one that has never seen it
            try:
                await store.save("conv-9", [*edited, answer("a3")])
            except TranscriptConflict as exc:
                assert "conv-9" in str(exc) and "message 1 " in str(exc), str(exc)
            else:
                raise AssertionError("a save that changes message 1 of the stored transcript was accepted")
            edited_last = [*stored[:-1], user("a different q3"), answer("a3")]
            try:  # the event appended, which the saving store never saved itself
                await store.save("conv-9", edited_last)
            except TranscriptConflict as exc:
                assert "message 4 " in str(exc), str(exc)
            else:
                raise AssertionError("a save that changes message 4 of the stored transcript was accepted")
        # Equal messages, not the same objects: the transcript extends what is stored.
        await two.save("conv-9", [Message.from_json(m.to_json()) for m in stored] + [answer("a3")])
        await one.save("conv-9", [*stored, answer("a3"), user("q4")])
        assert await one.messages("conv-9") == [*stored, answer("a3"), user("q4")]


@session_check
async def a_session_nobody_has_used_is_empty_rather_than_an_error(backend: Backend) -> None:
    async with backend.sessions() as store:
        assert await store.messages("nobody") == []
        assert await store.events("nobody") == []
        assert await store.length("nobody") == 0
        assert await store.take_steers("nobody") == []
        assert await store.get_state("nobody") == {}


@session_check
async def a_steer_is_handed_out_exactly_once_in_the_order_left(backend: Backend) -> None:
    async with backend.sessions() as store:
        for text in ("first", "second", "third"):
            await store.add_steer("s", text)
        assert await store.take_steers("s") == ["first", "second", "third"]
        assert await store.take_steers("s") == []
        await store.add_steer("s", "fourth")
        assert await store.take_steers("s") == ["fourth"]


@session_check
async def a_steer_left_again_with_its_message_id_is_not_left_twice(backend: Backend) -> None:
    async with backend.sessions() as one, backend.sessions() as two:
        assert await two.steer_receipt("s", "m-1") is None
        assert await one.add_steer("s", "use the staging runbook", message_id="m-1", task_id="task-1") is True
        receipt = await two.steer_receipt("s", "m-1")
        assert receipt is not None and receipt.task_id == "task-1"
        assert receipt.same("use the staging runbook") and not receipt.same("use the production runbook")
        assert await two.steer_receipt("t", "m-1") is None
        assert await two.add_steer("s", "use the staging runbook", message_id="m-1", task_id="task-1") is False
        assert await one.take_steers("s") == ["use the staging runbook"]
        # Taken since: sent again, even with other words, it is not left again; the receipt stays.
        assert await two.add_steer("s", "use the production runbook", message_id="m-1", task_id="task-2") is False
        assert await one.steer_receipt("s", "m-1") == receipt
        assert await one.take_steers("s") == []
        # The id is the session's: another session, another id, or none at all are other steers.
        assert await one.add_steer("t", "use the staging runbook", message_id="m-1") is True
        assert (await one.steer_receipt("t", "m-1")) == attrs.evolve(receipt, task_id=None)
        # Told how the message was sent, the receipt tells that apart, not the text.
        assert await one.add_steer("t", "use the staging runbook", message_id="m-5", sent_as='[{"text":"use the staging runbook"}]')
        sent = await two.steer_receipt("t", "m-5")
        assert sent is not None and sent.same('[{"text":"use the staging runbook"}]') and not sent.same("use the staging runbook")
        assert await one.add_steer("s", "and the renewals", message_id="m-2") is True
        assert await one.add_steer("s", "and the renewals") is True
        assert await one.add_steer("s", "and the renewals") is True
        assert await two.take_steers("s") == ["and the renewals"] * 3
        assert await two.take_steers("t") == ["use the staging runbook"] * 2
        # Sent again at the same moment through two stores (two processes): one of them leaves it.
        left: list[bool] = []

        async def leave(store: SessionStore) -> None:
            left.append(await store.add_steer("s", "check the renewals", message_id="m-3"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leave, one)
            nursery.start_soon(leave, two)
        assert sorted(left) == [False, True]
        assert await one.take_steers("s") == ["check the renewals"]
        for bad, words in (
            ({"message_id": ""}, "message id for session 's' must be a non-empty string"),
            ({"message_id": "id-" + LONE}, "surrogate"),
            ({"message_id": "m-4", "task_id": ""}, "task id for session 's' must be a non-empty string"),
        ):
            try:
                await one.add_steer("s", "x", **bad)
            except ValueError as exc:
                assert words in str(exc), str(exc)
            else:
                raise AssertionError(f"a steer with {bad!r} was accepted")
        assert await one.take_steers("s") == [] and await one.steer_receipt("s", "m-4") is None


@session_check
async def a_save_that_takes_the_steers_is_one_step_and_a_failed_one_takes_nothing(backend: Backend) -> None:
    async with backend.sessions() as store:
        await store.add_steer("s", "look at the lease")
        assert await store.save_and_take_steers("s", [user("q")]) == ["look at the lease"]
        assert await store.messages("s") == [user("q")]
        assert await store.save_and_take_steers("s", [user("q"), answer("a")]) == []
        await store.add_steer("s", "and the renewals")
        try:
            await store.save_and_take_steers("s", [user("a different question")])
        except TranscriptConflict:
            pass
        else:
            raise AssertionError("a save that does not extend the transcript was accepted")
        assert await store.messages("s") == [user("q"), answer("a")]
        assert await store.take_steers("s") == ["and the renewals"], "the failed save took the steer"


@session_check
async def a_save_that_places_the_steers_it_takes_keeps_them_after_the_transcript(backend: Backend) -> None:
    def placed(text: str) -> Message:
        return user(f"sent meanwhile: {text}")

    async with backend.sessions() as store:
        assert await store.save_and_take_steers("s", [user("q")], placed=placed) == []
        await store.add_steer("s", "look at the lease")
        await store.add_steer("s", "and the renewals")
        taken = await store.save_and_take_steers("s", [user("q"), answer("a")], placed=placed)
        assert taken == ["look at the lease", "and the renewals"]
        expected = [user("q"), answer("a"), placed("look at the lease"), placed("and the renewals")]
        assert await store.messages("s") == expected
        await store.add_steer("s", "use staging")
        try:  # a save that fails takes nothing and places nothing
            await store.save_and_take_steers("s", [user("a different question")], placed=placed)
        except TranscriptConflict:
            pass
        else:
            raise AssertionError("a save that does not extend the transcript was accepted")
        assert await store.messages("s") == expected
        assert await store.take_steers("s") == ["use staging"], "the failed save took the steer"


@session_check
async def a_task_run_takes_the_steers_left_for_it_or_for_none_and_drops_another_tasks(backend: Backend) -> None:
    async with backend.sessions() as one, backend.sessions() as two:
        await one.add_steer("s", "for the run that ended", message_id="m-1", task_id="task-1")
        await one.add_steer("s", "for whichever run", message_id="m-2")
        await one.add_steer("s", "for this run", message_id="m-3", task_id="task-2")
        await one.add_steer("s", "also for whichever run")
        taken = await two.save_and_take_steers("s", [user("q")], placed=user, for_task="task-2")
        assert taken == ["for whichever run", "for this run", "also for whichever run"]
        assert await two.messages("s") == [user("q"), *map(user, taken)]  # task-1's is not placed either
        assert await one.take_steers("s") == [], "another task's steer was left for a later run"
        await one.add_steer("s", "for the run that ended", task_id="task-1")
        assert await two.take_steers("s", for_task="task-3") == []
        assert await one.take_steers("s") == []
        await one.add_steer("s", "for task-4", task_id="task-4")
        assert await two.take_steers("s") == ["for task-4"]  # taken for no task in particular: all of them


@session_check
async def dropping_a_tasks_steers_forgets_those_alone_and_keeps_their_receipts(backend: Backend) -> None:
    async with backend.sessions() as one, backend.sessions() as two:
        await one.add_steer("s", "for the run that ended", message_id="m-1", task_id="task-1")
        await one.add_steer("s", "for whichever run", message_id="m-2")
        await one.add_steer("s", "for the next run", message_id="m-3", task_id="task-2")
        await one.add_steer("t", "another session's", message_id="m-4", task_id="task-1")
        await two.drop_steers("s", task_id="task-1")
        await two.drop_steers("s", task_id="task-9")  # none left for it: nothing to forget
        assert await one.take_steers("s") == ["for whichever run", "for the next run"]
        assert await one.take_steers("t") == ["another session's"]
        receipt = await one.steer_receipt("s", "m-1")
        assert receipt is not None and receipt.task_id == "task-1", "a dropped steer is still one sent before"
        assert not await one.add_steer("s", "for the run that ended", message_id="m-1", task_id="task-1")
        assert await one.take_steers("s") == []


@session_check
async def a_steer_left_with_a_record_is_pending_until_marked_recorded_whoever_reads(backend: Backend) -> None:
    async with backend.sessions() as one, backend.sessions() as two:
        assert await two.pending_steers() == []
        await one.add_steer("s", "use staging", message_id="m-1", task_id="task-1", record='{"m":1}')
        await one.add_steer("s", "no record", message_id="m-2", task_id="task-1")
        await one.add_steer("s", "for task-2", message_id="m-3", task_id="task-2", record='{"m":3}')
        await one.add_steer("t", "another session's", message_id="m-1", task_id="task-1", record='{"t":1}')
        assert not await one.add_steer("s", "use staging", message_id="m-1", task_id="task-1", record='{"again":1}')
        assert sorted((p.session_id, p.message_id, p.task_id, p.record) for p in await two.pending_steers()) == [
            ("s", "m-1", "task-1", '{"m":1}'), ("s", "m-3", "task-2", '{"m":3}'), ("t", "m-1", "task-1", '{"t":1}'),
        ]  # fmt: skip
        assert [p.message_id for p in await two.pending_steers(session_id="s", task_id="task-1")] == ["m-1"]
        assert sorted(p.session_id for p in await two.pending_steers(task_id="task-1")) == ["s", "t"]
        # Taken or dropped, a steer is still to be recorded: the record is the task's, not the run's.
        assert await one.take_steers("s") == ["use staging", "no record", "for task-2"]
        await two.steers_recorded("s", ["m-1", "m-9"])
        assert [p.message_id for p in await one.pending_steers(session_id="s")] == ["m-3"]
        assert [p.session_id for p in await one.pending_steers(task_id="task-1")] == ["t"]
        assert await one.steer_receipt("s", "m-1") is not None, "a steer recorded is still one sent before"
        try:
            await one.add_steer("s", "x", record="{}")
        except ValueError as exc:
            assert "needs its message id" in str(exc), str(exc)
        else:
            raise AssertionError("a steer with a record and no message id was accepted")


@session_check
async def two_sessions_do_not_see_each_other(backend: Backend) -> None:
    async with backend.sessions() as store:
        await store.save("a", [user("for a")])
        await store.save("b", [user("for b"), answer("b's")])
        await store.add_steer("a", "steer a")
        await store.set_state("a", {"k": "a"})
        assert await store.messages("a") == [user("for a")]
        assert await store.messages("b") == [user("for b"), answer("b's")]
        assert await store.take_steers("b") == []
        assert await store.get_state("b") == {}
        assert await store.take_steers("a") == ["steer a"]


@session_check
async def two_stores_taking_at_once_never_both_get_a_steer(backend: Backend) -> None:
    async with backend.sessions() as one, backend.sessions() as two:
        for round_ in range(20):
            await one.add_steer("s", f"steer {round_}")
            taken: list[str] = []

            async def take(store: SessionStore) -> None:
                taken.extend(await store.take_steers("s"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(take, one)
                nursery.start_soon(take, two)
            assert taken == [f"steer {round_}"], f"round {round_}: the takers got {taken!r}"


@session_check
async def a_steer_left_through_one_store_reaches_another(backend: Backend) -> None:
    async with backend.sessions() as one, backend.sessions() as two:
        await one.add_steer("s", "check the lease expiry")
        await one.save("s", [user("q")])
        assert await two.take_steers("s") == ["check the lease expiry"]
        assert await two.messages("s") == [user("q")]
        assert await one.take_steers("s") == []


@session_check
async def the_store_does_not_alias_the_callers_objects(backend: Backend) -> None:
    async with backend.sessions() as store:
        transcript = [user("q")]
        await store.save("s", transcript)
        transcript.append(answer("not saved"))
        assert await store.messages("s") == [user("q")]
        read = await store.messages("s")
        read.append(answer("not stored"))
        read.clear()
        assert await store.messages("s") == [user("q")]
        state: dict[str, object] = {"nested": {"n": 1}}
        await store.set_state("s", state)
        state["nested"] = "changed"
        got = await store.get_state("s")
        assert got == {"nested": {"n": 1}}
        got["nested"] = "changed again"
        assert await store.get_state("s") == {"nested": {"n": 1}}


@session_check
async def tool_arguments_and_event_content_come_back_byte_for_byte(backend: Backend) -> None:
    raw_arguments = '{"z":1,  "query" :"vault",\n"z":3 , "é":"\\u00e9"}'
    raw_event = '{ "b" : 1,"a":[2 ,3],"b":"dup" }'
    async with backend.sessions() as store:
        call = Message(role="assistant", tool_calls=(ToolCall(id="c1", name="read_file", arguments=raw_arguments),))
        await store.save("s", [user("q"), call])
        assert (await store.messages("s"))[1].tool_calls[0].arguments == raw_arguments
        await store.append("s", [raw_event], author="tool")
        event = (await store.events("s"))[-1]
        assert (event.seq, event.author, event.content) == (2, "tool", raw_event)


@session_check
async def concurrent_first_use_of_one_session_creates_one_session(backend: Backend) -> None:
    async with backend.sessions() as store:
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(store.create_session, "shared")
                nursery.start_soon(store.append, "shared", [json.dumps({"i": i})])
        assert await store.length("shared") == 6
        assert sorted(json.loads(e.content)["i"] for e in await store.events("shared")) == list(range(6))
        assert [e.seq for e in await store.events("shared")] == list(range(6))


@session_check
async def each_session_keeps_its_order_under_fifty_concurrent_appenders(backend: Backend) -> None:
    appenders, sessions, per_appender = 50, 10, 12
    async with backend.sessions() as store:

        async def appender(k: int) -> None:
            for i in range(per_appender):
                await store.append(f"s{k % sessions}", [json.dumps({"k": k, "i": i})])

        async with trio.open_nursery() as nursery:
            for k in range(appenders):
                nursery.start_soon(appender, k)
        for s in range(sessions):
            events = await store.events(f"s{s}")
            assert [e.seq for e in events] == list(range(len(events)))
            assert len(events) == per_appender * appenders // sessions
            seen: dict[int, list[int]] = {}
            for e in events:
                body = json.loads(e.content)
                seen.setdefault(body["k"], []).append(body["i"])
            assert all(order == list(range(per_appender)) for order in seen.values()), f"session s{s} reordered"


@session_check
async def bad_content_is_refused_with_its_index_and_nothing_is_written(backend: Backend) -> None:
    async with backend.sessions() as store:
        await store.append("conv-9", ['{"ok":1}'])
        for contents, index, words in (
            (['{"fine":true}', "not json"], 1, "not JSON"),
            (['{"fine":true}', '"' + "x" * (store.max_event_bytes + 1) + '"'], 1, "bytes"),
            (['{"fine":true}', "[" * 100_000 + "]" * 100_000], 1, "nested deeper than can be read"),
        ):
            try:
                await store.append("conv-9", contents, at=1)
            except InvalidEvent as exc:
                assert (exc.session_id, exc.index) == ("conv-9", index)
                assert "conv-9" in str(exc) and f"message {index}" in str(exc) and words in str(exc)
            else:
                raise AssertionError("bad content was accepted")
        huge = Message(role="user", text="x" * (store.max_event_bytes + 1))
        try:
            await store.save("conv-9-b", [user("fine"), huge])
        except InvalidEvent as exc:
            assert (exc.session_id, exc.index) == ("conv-9-b", 1)
        else:
            raise AssertionError("an oversize message was saved")
        for author in ("", None, "tool\ud800"):
            try:
                await store.append("conv-9", ['{"fine":true}'], author=author)
            except ValueError as exc:
                assert "conv-9" in str(exc) and "author" in str(exc)
            else:
                raise AssertionError(f"the author {author!r} was accepted")
        assert [e.content for e in await store.events("conv-9")] == ['{"ok":1}']
        assert await store.messages("conv-9-b") == []


LONE = "\ud800"  # a lone UTF-16 surrogate: a Python string can hold one (JSON's "\\ud800"), UTF-8 cannot


@session_check
async def text_utf8_cannot_hold_is_refused_by_name_and_index_and_fails_no_other_write(backend: Backend) -> None:
    async with backend.sessions() as store:
        bad_append: list[InvalidEvent] = []

        async def append_bad() -> None:
            try:
                await store.append("conv-u", ['{"fine":1}', '"' + LONE + '"'])
            except InvalidEvent as exc:
                bad_append.append(exc)

        # Queued together, so that a store with a group-commit writer puts them in one batch.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(append_bad)
            for k in range(5):
                nursery.start_soon(store.append, f"neighbour-{k}", ['{"kept":true}'])
        assert len(bad_append) == 1, "an append holding a lone surrogate was accepted"
        (exc,) = bad_append
        assert (exc.session_id, exc.index) == ("conv-u", 1)
        assert "surrogate" in str(exc) and "U+D800" in str(exc) and "nothing of this call was written" in str(exc)
        for k in range(5):
            assert [e.content for e in await store.events(f"neighbour-{k}")] == ['{"kept":true}']
        assert await store.events("conv-u") == []
        try:
            await store.save("conv-u", [user("fine"), answer("half " + LONE)])
        except InvalidEvent as exc:
            assert (exc.session_id, exc.index) == ("conv-u", 1)
        else:
            raise AssertionError("a message holding a lone surrogate was saved")
        for call, words in (
            (lambda: store.add_steer("conv-u", "steer " + LONE), "steer for session 'conv-u'"),
            (lambda: store.save("conv-" + LONE, [user("q")]), "session id"),
            (lambda: store.create_session("conv-v", user_id=LONE), "user id"),
            (lambda: store.set_app_state(LONE, {}), "app name"),
        ):
            try:
                await call()
            except ValueError as exc:
                assert words in str(exc) and "surrogate" in str(exc), str(exc)
            else:
                raise AssertionError(f"text holding a lone surrogate was accepted ({words})")
        assert await store.messages("conv-u") == [] and await store.take_steers("conv-u") == []
        # Nothing holding one is ever stored, so reading by one finds nothing.
        unheld = "conv-" + LONE
        assert (await store.events(unheld), await store.length(unheld), await store.take_steers(unheld)) == ([], 0, [])
        assert await store.get_state(unheld) == {} and await store.get_app_state(LONE) == {}


@session_check
async def a_closed_store_refuses_every_call(backend: Backend) -> None:
    async with backend.sessions() as store:
        await store.save("s", [user("q")])
    session = Session.open("conv-3", store)
    unread = "session {!r} was neither read nor written"
    calls: list[tuple[Callable[[], Awaitable[object]], str]] = [  # each call, and what its error must name
        (lambda: store.save("s", [user("q"), answer("a")]), unread.format("s") + " (none of messages 0 to 1 given"),
        (lambda: store.save_and_take_steers("s", [user("q")]), unread.format("s") + " (message 0 given"),
        (lambda: store.append("s", ["{}", "{}", "{}"]), unread.format("s") + " (none of messages 0 to 2 given"),
        (lambda: store.messages("s"), ""),
        (lambda: store.add_steer("s", "x"), ""),
        (lambda: store.take_steers("s"), ""),
        (lambda: store.set_state("s", {}), ""),
        # Through a Session, every error names it.
        (lambda: session.save([user("q"), answer("a"), user("q2")]), unread.format("conv-3") + " (none of messages 0 to 2"),
        (lambda: session.messages(), unread.format("conv-3")),
        (lambda: session.steer("x"), unread.format("conv-3")),
    ]
    for call, names in calls:
        try:
            await call()
        except StoreClosed as exc:
            assert "closed" in str(exc) and names in str(exc), str(exc)
        else:
            raise AssertionError("a closed store answered")
    async with backend.sessions() as reopened:
        assert await reopened.messages("s") == [user("q")]


@session_check
async def state_is_kept_per_session_app_and_user(backend: Backend) -> None:
    async with backend.sessions() as store:
        await store.set_state("s", {"step": 3})
        await store.set_app_state("keel", {"greeting": "hi"})
        await store.set_user_state("keel", "u1", {"tz": "UTC"})
        assert await store.get_state("s") == {"step": 3}
        assert await store.get_app_state("keel") == {"greeting": "hi"}
        assert await store.get_user_state("keel", "u1") == {"tz": "UTC"}
        assert await store.get_user_state("keel", "u2") == {}
        await store.set_state("s", {"step": 4})
        assert await store.get_state("s") == {"step": 4}
        # The default user id is "": its state is not the app's, nor a session's called "".
        await store.set_user_state("keel", "", {"tz": "CET"})
        assert await store.get_app_state("keel") == {"greeting": "hi"}
        assert await store.get_user_state("keel", "") == {"tz": "CET"}


@session_check
async def a_session_runs_one_turn_at_a_time_and_sessions_run_side_by_side(backend: Backend) -> None:
    async with backend.sessions() as store:
        inside: dict[str, int] = {"a": 0, "b": 0}
        peak: dict[str, int] = {"a": 0, "b": 0}
        both_sessions_inside = trio.Event()

        async def turn(session_id: str) -> None:
            async with store.turn_lock(session_id):
                inside[session_id] += 1
                peak[session_id] = max(peak[session_id], inside[session_id])
                if inside["a"] and inside["b"]:
                    both_sessions_inside.set()
                await trio.testing.wait_all_tasks_blocked()
                inside[session_id] -= 1

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(turn, "a")
                nursery.start_soon(turn, "b")
        assert peak == {"a": 1, "b": 1}
        assert both_sessions_inside.is_set(), "a turn on one session waited for another session"
        assert store.turn_locks_held() == 0, "idle sessions still hold lock entries"


# -- tasks --------------------------------------------------------------------------------------

SUBMITTED, WORKING, COMPLETED = "TASK_STATE_SUBMITTED", "TASK_STATE_WORKING", "TASK_STATE_COMPLETED"
CANCELED = "TASK_STATE_CANCELED"


async def make_task(store: TaskStore, task_id: str, *, owner: str = "alice", context_id: str = "ctx", state: str = SUBMITTED) -> Any:
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
            nursery.start_soon(attempt, lambda: store.update("alice", "t1", state=WORKING, task_json=bad_json, expected_version=1))
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
                await store.create("alice", task_id=f"again-{n}", context_id="c", state=SUBMITTED, task_json="{}", message_id="m1")
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
        # integers, before the epoch, or not a number at all; an id that is not text.
        forged = ([10**30, "t1"], [-1, "t1"], [True, "t1"], [1.5, "t1"], [1, 2], [1, "t1", 3], [1, "t\ud800"],
                  [1, "t1", None, None, 1.5], [1, "t1", 7, None, None], [1, "t1", None, None, None, None])
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
            ("update time", lambda: store.create("alice", task_id="t2", context_id="c", state=SUBMITTED, task_json="{}", updated_at_ms=-1)),
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
async def a_task_outlives_the_store_that_wrote_it(backend: Backend) -> None:
    async with backend.tasks() as store:
        await make_task(store, "t1")
        await store.update("alice", "t1", state=COMPLETED, task_json='{"done":true}', expected_version=1)
    async with backend.tasks() as reopened:
        record = await reopened.get("alice", "t1")
        assert (record.state, record.version, record.task_json) == (COMPLETED, 2, '{"done":true}')
