"""Whose turn it is in each conversation, and the order in which this process's runs take it.

A conversation has one turn at a time (its session's turn lock). The runner keeps here which of
its runs hold or wait for each conversation's turn, so that a steer can be told which run it
would reach, and the order in which the tasks resumed at startup queue for it. Apart from the
runner because both are the lock's bookkeeping, not a run's: the runner asks ``taking`` for a
turn and ``ahead_of`` for the run that has it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import attrs
import trio

from persistence.api import SessionStore
from persistence.errors import StoreError, told_before
from persistence.session import Session
from protocol import Task
from runtime.tasks import LiveTask

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class Turns:
    """The turns of the conversations this process runs, taken first come, first served."""

    sessions: SessionStore
    # Each conversation's runs that hold or wait for its turn, in the order they queued for it
    # (the turn lock's order: first come, first served). The first holds the turn, or is being
    # handed it: a run handed the turn goes on only at the scheduler's next pass, after the one
    # before it has let go.
    _lines: dict[str, list[LiveTask]] = attrs.field(init=False, factory=dict)
    # Tasks resumed at startup, by id: the event set once the task before it on its context has
    # queued for the turn lock, and the one this task sets when it has. So the turns of one
    # context are taken in the order they would have been (see ``line_up``).
    _in_line: dict[str, tuple[trio.Event | None, trio.Event]] = attrs.field(init=False, factory=dict)

    async def line_up(self, resumed: Iterable[Task]) -> None:
        """Have the tasks resumed at startup (oldest first) queue for their conversations' turns
        in the order they would have taken them, each once the one before it on its context has
        queued: those whose turn the conversation holds first, then the others, oldest first."""
        last_in_line: dict[str, trio.Event] = {}
        for task in await self._begun_first(resumed):
            queued = trio.Event()
            self._in_line[task.id] = (last_in_line.get(task.context_id), queued)
            last_in_line[task.context_id] = queued

    async def _begun_first(self, resumed: Iterable[Task]) -> list[Task]:
        """``resumed`` with, in each conversation, the tasks whose turn its transcript holds first,
        in the order of their turns. Two messages sent at once can take the turn in the other
        order than their tasks were made: the one that waited, resumed first, would answer the
        other's question with its own, and the other then fail, overtaken."""
        by_context: dict[str, list[Task]] = {}
        for task in resumed:
            by_context.setdefault(task.context_id, []).append(task)
        ordered = []
        for context_id, tasks in by_context.items():
            if len(tasks) > 1:
                try:
                    messages = await Session.open(context_id, self.sessions).messages()
                except StoreError as exc:  # each run reads it again, and fails saying why
                    said = told_before(exc) or exc
                    logger.warning("context %s: its transcript could not be read to order its resumed tasks: %s", context_id, said)
                    messages = []
                begun = {message.turn_id: index for index, message in enumerate(messages) if message.turn_id}
                tasks.sort(key=lambda task: begun.get(task.id, len(messages)))  # stable: the others stay oldest first
            ordered.extend(tasks)
        return ordered

    @asynccontextmanager
    async def taking(self, live: LiveTask) -> AsyncIterator[None]:
        """The turn of the task's conversation: one task's run at a time, the others waiting.
        A task resumed at startup first waits for the one before it to queue (see ``line_up``)."""
        await self._wait_in_line(live.task.id)
        context_id = live.task.context_id
        line = self._lines.setdefault(context_id, [])
        line.append(live)  # in the step that queues for the lock, so the line keeps the lock's order
        try:
            async with self.sessions.turn_lock(context_id):
                try:
                    yield
                finally:
                    live.turn_over = True
        finally:
            line.remove(live)  # in the step that lets the lock go (or gives up waiting for it)
            if not line:
                del self._lines[context_id]

    def ahead_of(self, live: LiveTask) -> LiveTask | None:
        """The task of this process whose run has its conversation's turn, or is being handed
        it, while ``live``'s run waits (or has not yet queued) for it; None if it is ``live``'s
        turn, or no run holds or waits for it."""
        line = self._lines.get(live.task.context_id)
        return line[0] if line and line[0] is not live else None

    async def _wait_in_line(self, task_id: str) -> None:
        """For a task resumed at startup: wait until the one before it on its context has queued
        for the turn lock. Then this one queues, in the same step as it returns (taking a lock
        does not pass through the scheduler before it queues), so the next one queues behind."""
        line = self._in_line.pop(task_id, None)
        if line is None:
            return
        ahead, queued = line
        try:
            if ahead is not None:
                await ahead.wait()
        finally:
            queued.set()  # cancelled while waiting too: the tasks behind it must not wait forever
