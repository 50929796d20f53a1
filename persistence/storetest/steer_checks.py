"""The session store's checks of its steers: handed out once and in order, left once per message
id with a receipt that outlives them, taken with a save in one step, kept for the task they were
left for, and pending until their task has recorded them; through one store or several.
"""

from __future__ import annotations

import attrs
import trio

from persistence.api import SessionStore
from persistence.errors import TranscriptConflict
from persistence.storetest.contract import LONE, Backend, answer, session_check, user
from persistence.transcript import Message


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
        sent_as = '[{"text":"use the staging runbook"}]'
        assert await one.add_steer("t", "use the staging runbook", message_id="m-5", sent_as=sent_as)
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
