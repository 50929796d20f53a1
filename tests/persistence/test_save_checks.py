"""A save checks the whole stored transcript against the messages the earlier saves were given:
any Sequence will do, the check stays a comparison by identity in the runner's use, and what it
keeps is what was stored, whatever the caller does with its list meanwhile."""

from __future__ import annotations

import collections
import threading
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from persistence.errors import InvalidEvent, TranscriptConflict
from persistence.memory import MemorySessionStore
from persistence.sessions import SessionLengths, open_session_store
from persistence.transcript import Message

DEADLINE_S = 10


def user(text: str) -> Message:
    return Message(role="user", text=text)


def answer(text: str) -> Message:
    return Message(role="assistant", text=text)


@asynccontextmanager
async def memory_store(_: Path) -> AsyncIterator[MemorySessionStore]:
    store = MemorySessionStore()
    try:
        yield store
    finally:
        await store.aclose()


def sqlite_store(tmp_path: Path) -> AbstractAsyncContextManager[Any]:
    return open_session_store(tmp_path / "runtime.db")


BACKENDS = pytest.mark.parametrize("open_store", [sqlite_store, memory_store], ids=["sqlite", "memory"])


@BACKENDS
async def test_a_transcript_held_in_a_deque_is_saved_and_a_failed_save_writes_nothing(open_store: Any, tmp_path: Path) -> None:
    # A deque is a Sequence, but it cannot be sliced; and a save that raises stores nothing.
    with trio.fail_after(DEADLINE_S):
        async with open_store(tmp_path) as store:
            transcript = collections.deque([user("q"), answer("a")])
            try:
                await store.save("s", transcript)
            except Exception:
                assert await store.length("s") == 0, "a save that raised stored its messages"
                raise
            transcript.append(user("q2"))
            await store.save("s", transcript)
            assert await store.messages("s") == list(transcript)


class CountingEq:
    """Counts the calls of Message.__eq__ (the list comparison makes one for each pair of
    messages that are equal but not the same object)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = Message.__eq__

        def counting(this: Message, other: object) -> bool:
            self.calls += 1
            return original(this, other)

        monkeypatch.setattr(Message, "__eq__", counting)


@BACKENDS
async def test_a_transcript_read_back_is_compared_by_identity_from_its_second_save_on(
    open_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every turn of the runner after a context's first reads the transcript back
    # (TurnTaker.take: `messages = await session.messages()`), so its first save gives objects
    # equal to, not the same as, the ones the store kept. From then on the store keeps the
    # caller's: its later saves are compared by identity, not message by message in Python (and
    # the store does not keep a second copy of every message alive besides the caller's).
    n = 500
    with trio.fail_after(DEADLINE_S):
        async with open_store(tmp_path) as store:
            await store.save("s", [user(f"m{i}") if i % 2 == 0 else answer(f"m{i}") for i in range(n)])
            transcript = await store.messages("s")  # a new turn: the same messages, new objects
            transcript.append(user("next question"))
            await store.save("s", transcript)  # compares the n messages read back once: fine
            transcript.append(answer("next answer"))
            counter = CountingEq(monkeypatch)
            await store.save("s", transcript)  # the same objects as the save before
            assert counter.calls < 10, f"{counter.calls} messages of {len(transcript)} compared by __eq__"


async def test_a_transcript_changed_while_its_save_is_in_flight_does_not_poison_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A save is checked, written and remembered in the pool's thread, where the Trio thread can
    # run between any two steps (the GIL is let go by every sqlite3 call), and a caller whose
    # save is in flight (cancelled while it waited, say: a write is not withdrawn) may change
    # its list meanwhile. What the store remembers must be what it wrote, or a later rewrite of
    # that message would pass the check. Here the pool's thread is held while it inserts
    # (inside SessionLengths.insert) to make the switch certain.
    stored_c, rewritten_c = answer("c as stored"), answer("c rewritten")
    entered, go = threading.Event(), threading.Event()
    original_insert = SessionLengths.insert

    def held_insert(self: SessionLengths, *args: Any, **kwargs: Any) -> None:
        entered.set()
        go.wait(DEADLINE_S)
        original_insert(self, *args, **kwargs)

    with trio.fail_after(DEADLINE_S):
        async with open_session_store(tmp_path / "runtime.db") as store:
            await store.save("s", [user("a"), answer("b")])
            transcript = [user("a"), answer("b"), stored_c]
            monkeypatch.setattr(SessionLengths, "insert", held_insert)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.save, "s", transcript)
                await trio.to_thread.run_sync(entered.wait, DEADLINE_S)
                transcript[2] = rewritten_c  # while the pool's thread is between plan_save and saved()
                go.set()
            monkeypatch.setattr(SessionLengths, "insert", original_insert)
            assert await store.messages("s") == [user("a"), answer("b"), stored_c]
            try:
                await store.save("s", [user("a"), answer("b"), rewritten_c, user("d")])
            except TranscriptConflict as exc:
                assert "message 2 " in str(exc), str(exc)
            else:
                stored = [m.text for m in await store.messages("s")]
                raise AssertionError(f"a save that rewrites message 2 was accepted; the session now holds {stored}")


@BACKENDS
async def test_a_save_refused_after_its_comparison_leaves_what_the_store_keeps_as_it_was(
    open_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_store(tmp_path) as store:
            transcript = [user("a"), answer("b")]
            await store.save("s", transcript)
            with pytest.raises(InvalidEvent, match="message 3 of session 's'"):
                await store.save("s", [*transcript, user("c"), answer("x" * (2 << 20))])
            with pytest.raises(TranscriptConflict, match="message 1 "):
                await store.save("s", [user("a"), answer("not b"), user("c")])
            transcript.append(user("c"))
            await store.save("s", transcript)  # (a store may have forgotten, and read back, the first two)
            transcript.append(answer("d"))
            counter = CountingEq(monkeypatch)
            await store.save("s", transcript)
            assert counter.calls == 0, "what the store kept is not what the last save was given"
            assert await store.messages("s") == transcript
