"""What a client reads of a task: from this process's run of it while there is one, or as stored.

GetTask, ListTasks, a subscription and a blocking send's wait answer from the task's ``LiveTask``
when a run of this process holds it (its newest durable snapshot, with the answer streamed so
far), and from tasks.db when none does. Apart from the runner because none of them starts, ends
or orders a run: they need the task store and the runs by task id, nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import attrs
import trio

import persistence.errors as store_errors
from persistence.api import TaskStore
from protocol import (
    DEFAULT_PAGE_SIZE,
    EndNotStored,
    InvalidParams,
    ListTasksParams,
    ListTasksResult,
    StreamCut,
    Task,
    trim_history,
)
from runtime.tasks import STORED_VERSION, LiveTask, StreamItem, decode, epoch_ms_up, load


# The ListTasks fields of the task store's filters (persistence.tasks.FILTERS).
_FILTER_FIELDS = {"context_id": "contextId", "state": "status", "updated_after_ms": "statusTimestampAfter"}


@attrs.define(eq=False)
class Reads:
    """The tasks of ``tasks`` as their owners see them: ``live`` is the runner's runs, by task id,
    read as it changes."""

    tasks: TaskStore
    live: Mapping[str, LiveTask]

    async def get(self, owner: str, task_id: str) -> Task:
        """The task as it stands; TaskNotFound when it is not the owner's."""
        live = self.live.get(task_id)
        if live is not None and live.owner == owner:
            return live.as_seen()
        task, _ = await load(self.tasks, owner, task_id)
        return task

    async def list_tasks(self, owner: str, params: ListTasksParams) -> ListTasksResult:
        """One page of the owner's tasks, as ListTasks asks for it, each with its answer so far
        while a run of this process writes it; InvalidParams for a page token not given here."""
        after = params.status_timestamp_after
        try:
            page = await self.tasks.list(
                owner,
                context_id=params.context_id,
                state=None if params.status is None else params.status.wire_name(STORED_VERSION),
                # At or after (a2a.proto ListTasksRequest.status_timestamp_after: "greater than or
                # equal"): a status time in whole milliseconds is at or after ``after`` exactly when
                # it is after the millisecond before ``after`` rounded up to its millisecond.
                updated_after_ms=None if after is None else epoch_ms_up(after) - 1,
                page_size=params.page_size or DEFAULT_PAGE_SIZE,
                page_token=params.page_token or "",
            )
        except store_errors.PageOfOtherListing as exc:
            changed = " and ".join(_FILTER_FIELDS[name] for name in exc.changed)
            problem = (
                f"was given for a listing with another {changed}; send it with the filters of the request whose"
                " nextPageToken it was, or leave it out to list from the first page"
            )
            raise InvalidParams("pageToken", problem=problem) from exc
        except store_errors.InvalidPage as exc:  # the page size was checked with the request
            problem = "is not a token this server gave; pass the nextPageToken of the previous page, or none for the first"
            raise InvalidParams("pageToken", problem=problem) from exc
        tasks = []
        for record in page.records:
            task = self._with_answer_so_far(decode(record))
            if params.history_length is not None:
                task = trim_history(task, params.history_length, STORED_VERSION)
            if not params.include_artifacts:
                task = attrs.evolve(task, artifacts=())
            tasks.append(task)
        return ListTasksResult(
            tasks=tasks, next_page_token=page.next_page_token, page_size=params.page_size or DEFAULT_PAGE_SIZE,
            total_size=page.total_size,
        )

    def _with_answer_so_far(self, task: Task) -> Task:
        """``task`` with what the streams have of its answer so far, for a client that polls,
        while a run of this process works on it and has stored no answer yet."""
        live = self.live.get(task.id)
        return task if live is None else live.as_seen(task)

    @asynccontextmanager
    async def subscribe(self, owner: str, task_id: str) -> AsyncIterator[trio.MemoryReceiveChannel[StreamItem]]:
        """The task's events: its run's while it has one here; else the task as stored, and, unless
        it has settled, a StreamCut saying that no run of it here will tell its end."""
        live = self.live.get(task_id)
        if live is None or live.owner != owner:
            task, _ = await load(self.tasks, owner, task_id)
            send, receive = trio.open_memory_channel[StreamItem](2)
            send.send_nowait(task)
            if not task.status.state.ends_stream:  # not settled, and not run here
                why = (
                    "no run of it is in this server (it was left for the next server to take up), and a stream"
                    " follows only the runs of the server serving it; poll GetTask to see it end"
                )
                send.send_nowait(StreamCut(task_id, why))
            send.close()
            with receive:
                yield receive
            return
        receive = live.subscribe()
        try:
            yield receive
        finally:
            live.unsubscribe(receive)

    async def wait_settled(self, owner: str, task_id: str) -> tuple[Task, str | None]:
        """The task once its run here has settled it (at once, as stored, if none runs it here),
        with its JSON as that run stored it (None when read from the store); EndNotStored if the
        run's final state could not be written."""
        live = self.live.get(task_id)
        if live is None or live.owner != owner:
            return await self.get(owner, task_id), None
        await live.settled.wait()
        if not live.end_stored:
            raise EndNotStored(task_id, live.end_not_stored)
        # The run's snapshot is what its last write stored (LiveTask changes it only once that
        # write is durable), so it is not read back: a store read and a decode less per blocking
        # send, about a seventh of its CPU in scripts/bench/a2a.py.
        return live.task, live.task_json
