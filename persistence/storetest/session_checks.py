"""The session store's checks of its transcripts, state and turns: what a save, an append and a
read keep and refuse, sessions kept apart, concurrent writers, a closed store, and one turn at a
time per session.

The steers a session is left are checked apart (``persistence.storetest.steer_checks``): they
have receipts, owners and a life of their own after a run takes them.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import trio
import trio.testing

from persistence.errors import InvalidEvent, StoreClosed, TranscriptConflict
from persistence.session import Session
from persistence.storetest.contract import LONE, Backend, answer, session_check, user
from persistence.transcript import Message, ToolCall


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
