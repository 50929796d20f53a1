"""Tasks as the runner keeps them: A2A values in the task store, and their live broadcast."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

import attrs
import trio

import persistence.errors as store_errors
from persistence.api import TaskRecord, TaskStore
from persistence.errors import UnreadableTask
from persistence.locks import holding
from protocol import (
    END_NOT_STORED,
    Artifact,
    ContentTypeNotSupported,
    DataPart,
    FilePart,
    InvalidParams,
    Message,
    ProtocolError,
    ProtocolVersion,
    Role,
    StreamCut,
    StreamEvent,
    Task,
    TaskArtifactUpdateEvent,
    TaskNotFound,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
    TextPart,
    UnsupportedOperation,
    check_transition,
)
from protocol.errors import clipped, quoted
from runtime.agent import SteerGate

if TYPE_CHECKING:
    from persistence.transcript import Message as Transcribed

logger = logging.getLogger(__name__)

STORED_VERSION = ProtocolVersion.V1_0  # the encoding of the task JSON column
SUBSCRIBER_BUFFER = 4096  # events a subscriber may fall behind before it is dropped
ANSWER_ARTIFACT = "answer"  # the artifact that carries a task's answer
# What a subscription carries: the task's events, and last, if it is cut short, why.
StreamItem = StreamEvent | ProtocolError


def now() -> datetime:
    """The time for a task's status, to the millisecond: the precision tasks.db keeps it in, so
    that ListTasks' statusTimestampAfter compares exactly what clients are shown."""
    moment = datetime.now(timezone.utc)
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def epoch_ms(moment: datetime) -> int:
    """Whole milliseconds since the Unix epoch, rounded down (exact: no floating point)."""
    return (moment - _EPOCH) // timedelta(milliseconds=1)


def epoch_ms_up(moment: datetime) -> int:
    """Whole milliseconds since the Unix epoch, rounded up (exact: no floating point)."""
    return -((_EPOCH - moment) // timedelta(milliseconds=1))


def status_ms(task: Task) -> int | None:
    """The time of the task's status, as tasks.db keeps it (ListTasks orders and filters by it)."""
    return None if task.status.timestamp is None else epoch_ms(task.status.timestamp)


_IDS_AT_ONCE = 256
_ids: list[int] = []  # random draws, 16 bytes each, taken by new_id
_ids_lock = threading.Lock()
os.register_at_fork(after_in_child=_ids.clear)  # a forked child must not repeat its parent's ids
_MS_BITS = 48


def new_id() -> str:
    """A version-7 UUID (RFC 9562), as 32 hex digits: the time in milliseconds, then 74 random bits.

    Time-ordered, so the tasks and conversations a server starts go in at the end of every index
    keyed by their ids (tasks.db's by task and by context, runtime.db's sessions and their
    events), rather than each on a page of its own anywhere in it: with version-4 ids a blocking
    send made twice the bytes of writes (46 KB a request against 23, measured under load), each
    page of them synced and later checkpointed. The random bits keep ids unguessable and
    distinct however many are made in one millisecond; what an id tells is when it was made.

    Drawn from the OS's random source 256 at a time. That system call lets go of the GIL, and
    under load each let-go can hand it to a database thread and leave the event loop waiting to
    get it back: with one call per id, a runner driven in process (no HTTP) ran a tenth fewer
    turns a second."""
    with _ids_lock:
        if not _ids:
            raw = os.urandom(16 * _IDS_AT_ONCE)
            _ids.extend(int.from_bytes(raw[i : i + 16], "big") for i in range(0, len(raw), 16))
        drawn = _ids.pop()
    ms = time.time_ns() // 1_000_000 & (1 << _MS_BITS) - 1
    random_a, random_b = drawn >> 62 & 0xFFF, drawn & (1 << 62) - 1  # 12 and 62 bits
    return f"{ms << 80 | 0x7 << 76 | random_a << 64 | 0b10 << 62 | random_b:032x}"


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # made once, not each call


def encode(task: Task) -> str:
    return _ENCODER.encode(task.to_json(STORED_VERSION))


def _non_finite(name: str) -> str:
    """Infinity, -Infinity or NaN, which earlier builds stored for a number past a double's range (a
    client's ``1e999``): read as ProtoJSON spells them, a string, so the task reads, lists and is
    written again; read as floats, no answer holding it could be encoded."""
    return name


def decode(record: TaskRecord) -> Task:
    try:
        obj = json.loads(record.task_json, parse_constant=_non_finite)
    except ValueError as exc:
        raise UnreadableTask(record.id, f"its JSON does not parse: {exc}") from exc
    try:
        return Task.from_json(obj, STORED_VERSION)
    except ProtocolError as exc:
        raise UnreadableTask(record.id, str(exc).removeprefix("invalid params: ")) from exc


def agent_message(task: Task, text: str) -> Message:
    return Message(
        message_id=new_id(), role=Role.AGENT, parts=(TextPart(text),), task_id=task.id, context_id=task.context_id
    )


# What message_text reads (the agent card's defaultInputModes): text parts, and data parts as JSON.
INPUT_MODES = ("text/plain", "application/json")


def _text_type(part: FilePart) -> bool:
    """Whether a file part's media type is one of the card's input modes."""
    return (part.media_type or "").split(";")[0].strip().lower() in INPUT_MODES


def readable_text(message: Message) -> str:
    """A client's message as text for the model. A file part is refused unless it is inline text
    in one of the card's input modes (ContentTypeNotSupported for another type, UnsupportedOperation
    for a text file by URL, which the agent does not fetch): the model would never see it, and an
    answer that silently left it out would mislead. So is a message with nothing to read
    (InvalidParams)."""
    for index, part in enumerate(message.parts):
        if not isinstance(part, FilePart):
            continue
        named = f" {quoted(part.filename)}" if part.filename else ""
        if _text_type(part):
            if part.raw is None:
                raise UnsupportedOperation(
                    f"message.parts[{index}] is a file{named} given by URL, which this agent does not fetch; send what"
                    " it says inline (as raw bytes, or as text)"
                )
            try:
                part.raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidParams(
                    f"message.parts[{index}]",
                    problem=f"is a text file{named} that is not UTF-8 (byte {exc.start} is not); send it as UTF-8",
                ) from None
        else:
            media_type = part.media_type or "application/octet-stream"
            raise ContentTypeNotSupported(
                media_type, INPUT_MODES,
                problem=f"message.parts[{index}] is a file{named} ({clipped(media_type)}), which this agent cannot read; "
                "it reads text and data parts: send what the file says as text",
            )  # fmt: skip
    text = message_text(message)
    if not text.strip():
        raise InvalidParams("message.parts", problem="hold nothing to read: every text part is empty or blank; send the question as text")
    return text


def message_text(message: Message) -> str:
    """What a message says, as text for the model: text parts as they are, data parts as JSON,
    inline text files as their text."""
    pieces = []
    for part in message.parts:
        if isinstance(part, TextPart):
            pieces.append(part.text)
        elif isinstance(part, FilePart):
            if part.raw is not None and _text_type(part):
                pieces.append(part.raw.decode("utf-8", "replace"))
        elif isinstance(part, DataPart):
            pieces.append(json.dumps(part.data, ensure_ascii=False))
    return "\n".join(pieces)


def refuse_oversize(message: Transcribed, limit: int) -> None:
    """A message the conversation could not hold (more than ``limit`` bytes, the session store's
    largest event) is refused before anything of it is stored: taken, its task would only fail
    when the run first saved the transcript."""
    size = message.oversize(limit)
    if size is not None:
        raise InvalidParams(
            "message.parts",
            problem=f"come to {size} bytes as the conversation keeps them (text parts as they are, data parts as JSON), "
            f"more than the {limit} one message may hold; send less in one message",
        )


def answer_artifact(text: str) -> Artifact:
    """The artifact that carries a task's answer (or, streamed, a piece of it)."""
    return Artifact(artifact_id=ANSWER_ARTIFACT, name="answer", parts=(TextPart(text),))


def with_status(task: Task, state: TaskState, message: Message | None = None) -> Task:
    """``task`` moved to ``state`` now (never before its last status); InvalidTransition for a move
    the task state machine forbids (out of a terminal state, say): every status a task is given passes here."""
    check_transition(task.id, task.status.state, state)
    moment = status_time(task.status.timestamp)
    return attrs.evolve(task, status=TaskStatus(state=state, message=message, timestamp=moment))


_newest_status = _EPOCH  # the latest time status_time has given in this process
_LAST = datetime.max.replace(microsecond=999000, tzinfo=timezone.utc)  # the last millisecond a status can be dated
_LAST_MS = (_LAST - _EPOCH) // timedelta(milliseconds=1)


def dated_after(newest_ms: int | None) -> None:
    """Status times from now on come after ``newest_ms``, the latest a task was stored with (by
    an earlier process): a server started while the clock is behind it (set back since) dates its
    tasks after those before it, as status_time does in one process."""
    global _newest_status
    if newest_ms is not None and newest_ms <= _LAST_MS:  # one past any date was given by no clock: damaged
        _newest_status = max(_newest_status, _EPOCH + timedelta(milliseconds=newest_ms))


def status_time(previous: datetime | None = None) -> datetime:
    """The time for a status given now: a millisecond after ``previous`` (the task's last status)
    while the clock is not past it, and, while the clock is behind the latest time given in this
    process, a millisecond after that. A clock set back (an NTP step) would otherwise date a
    task made or changed later as earlier: ListTasks, which sorts and filters by that date, would
    list it behind tasks it came after, a client polling from the newest status it has seen
    would not see it until the clock caught up, and a restart would take up one conversation's
    unfinished tasks in another order than they came. (An earlier process's: dated_after.)"""
    global _newest_status
    moment = now()
    if moment < _newest_status:
        moment = _later(_newest_status)
    if previous is not None and moment <= previous:
        moment = _later(previous)
    _newest_status = max(moment, _newest_status)
    return moment


def _later(moment: datetime) -> datetime:
    """A millisecond after ``moment``, or ``moment`` itself at the last millisecond a date can hold
    (a clock once set there): the status times after it are then all that one."""
    return moment if moment >= _LAST else moment + timedelta(milliseconds=1)


async def load(tasks: TaskStore, owner: str, task_id: str) -> tuple[Task, int]:
    """The stored task and its version; protocol TaskNotFound when missing or not the owner's."""
    try:
        record = await tasks.get(owner, task_id)
    except store_errors.TaskNotFound:
        raise TaskNotFound(task_id) from None
    return decode(record), record.version


# A write of a task takes it as stored and tries again when a write given up on has landed
# meanwhile; more conflicts than this in a row mean something else writes the task.
WRITE_ATTEMPTS = 3


@attrs.define(eq=False)
class LiveTask:
    """A task this process is running: its cancel scope, its newest persisted snapshot, and the
    channels of whoever is subscribed. The runner changes ``task`` only after it is durable."""

    owner: str
    task: Task
    version: int
    write_timeout_s: float = 5.0
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    settled: trio.Event = attrs.field(factory=trio.Event)  # a terminal state is on disk, or could not be written
    end_stored: bool = True  # False once the run's final state could not be written
    end_not_stored: str = END_NOT_STORED  # then, what its clients are told of it
    turn_over: bool = False  # its run has let the turn go: it is ending (its end being written)
    steers: SteerGate = attrs.field(factory=SteerGate)  # where its run and the steers sent to it meet
    steered: bool = False  # steers may be stored for its run, which may end without taking them
    # Taken up after a restart, its run has not yet read where its turn stands: whether a request
    # is left to carry a steer (none is, when its answer was stored before the process stopped).
    resuming: bool = False
    # ``task`` as its last write here stored it (STORED_VERSION), or None (as read back): a
    # blocking send's answer carries it as it is rather than encode the task again.
    task_json: str | None = attrs.field(init=False, default=None)
    # Each subscriber's receive side -> its send side, so that leaving drops both at once.
    _subscribers: dict[trio.MemoryReceiveChannel[StreamItem], trio.MemorySendChannel[StreamItem]] = attrs.field(
        init=False, factory=dict
    )
    _writing: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    # The answer's text streamed so far (one buffer: a long answer comes in many tiny pieces).
    _answer: io.StringIO = attrs.field(init=False, factory=io.StringIO)
    _answered: bool = attrs.field(init=False, default=False)  # and that is the whole answer
    _answer_frozen: bool = attrs.field(init=False, default=False)  # see freeze_answer
    _replace_answer: bool = attrs.field(init=False, default=False)  # see next_request

    async def persist(self, tasks: TaskStore, change: Callable[[Task], Task], *, urgent: bool = False) -> Task:
        """Apply ``change`` to the newest task, write the result (version-checked), then tell the
        subscribers of its new status, if it has one; returns the task as written. A ``change``
        that returns the task it was given writes nothing. Once a terminal state is written the task has settled (see ``close``).
        ``urgent`` asks the store to commit this write ahead of those queued (a cancel).

        One write at a time (the run and a steering request may both write), and ``change`` is
        applied under that lock to the task as it stands then, never to a copy read before the
        wait: otherwise a steer's message, or the run's new state, would be lost to whichever
        write came second. Shielded, with a bound (TimeoutError). A write given up on when its
        bound ran out is still queued, and may land after all: the next write then finds the
        stored version newer than the one known here, takes the task as stored, and applies its
        ``change`` to that.
        """
        task = self.task
        with trio.move_on_after(self.write_timeout_s, shield=True) as bound:
            async with holding(self._writing):
                told = self.task.status  # what its subscribers were told (a write past its bound told them nothing)
                for attempt in range(1, WRITE_ATTEMPTS + 1):
                    task = change(self.task)
                    if task is self.task:  # nothing to write; a reload may still have news for the subscribers
                        break
                    task_json = encode(task)
                    try:
                        record = await tasks.update(
                            self.owner, task.id, state=task.status.state.wire_name(STORED_VERSION),
                            task_json=task_json, expected_version=self.version, urgent=urgent,
                            updated_at_ms=status_ms(task),
                        )  # fmt: skip
                    except store_errors.VersionConflict:
                        if attempt == WRITE_ATTEMPTS:
                            raise
                        self.task, self.version = await load(tasks, self.owner, task.id)
                        self.task_json = None
                        continue
                    self.version = record.version
                    self.task, self.task_json = task, task_json
                    break
        if bound.cancelled_caught:
            raise TimeoutError(f"storing task {task.id!r} took longer than {self.write_timeout_s:g} s")
        if task.status != told:  # a steer's message added to the history is no news to a stream
            self.publish(TaskStatusUpdateEvent(task_id=task.id, context_id=task.context_id, status=task.status))
        if task.status.state.is_terminal:
            self.close()
        return task

    def subscribe(self) -> trio.MemoryReceiveChannel[StreamItem]:
        """A channel that starts with the task as it stands, then carries every event. It ends
        after the task settles, or, cut short, with a StreamCut saying why."""
        # One slot more than a subscriber may fall behind: room for the StreamCut that drops it.
        send, receive = trio.open_memory_channel[StreamItem](SUBSCRIBER_BUFFER + 1)
        send.send_nowait(self.as_seen())  # joining mid-answer: the text so far in it, then the pieces to come
        if self.settled.is_set():
            if not self.end_stored:
                send.send_nowait(StreamCut(self.task.id, self.end_not_stored))
            send.close()
            return receive
        self._subscribers[receive] = send
        return receive

    def as_seen(self, task: Task | None = None) -> Task:
        """``task`` (by default the task as last stored) with the answer its streams have sent so
        far, while it has none stored: the task as it stands for a client that polls or joins now."""
        task = self.task if task is None else task
        if task.artifacts or task.status.state.is_terminal:
            return task
        streamed = self.streamed_answer()
        return task if streamed is None else attrs.evolve(task, artifacts=(streamed,))

    def stream_answer(self, text: str) -> None:
        """Send the subscribers the next piece of the answer as the model writes it. Each piece
        is appended to the answer artifact, but the first of a model request after
        ``next_request()`` replaces it; a subscriber that comes later gets all the text so far in
        the task it starts with (``as_seen``)."""
        if self._answer_frozen:
            return
        first = not self._answer.tell() or self._replace_answer
        if self._replace_answer:
            self._answer = io.StringIO()
            self._replace_answer = False
        self._answer.write(text)
        self.publish(self._answer_update(text, append=not first))

    def next_request(self) -> None:
        """The run asks the model again (after a tool's result, or a steer): the text it writes
        now is another answer, which replaces what the artifact holds rather than run on from it."""
        self._replace_answer = True

    def drop_answer(self) -> None:
        """The run ends with no answer begun (the model was still calling tools when the turn's
        limit ran out): the text streamed before those calls is no answer, and is dropped, its
        streams sent an empty answer in its place, so that neither they nor GetTask take it for one."""
        if self._answer_frozen or not self._answer.tell():
            return
        self._answer = io.StringIO()
        self.publish(self._answer_update("", append=False))

    def freeze_answer(self) -> None:
        """The answer stops here (a cancel): what the run says after this is sent to no one."""
        self._answer_frozen = True

    def streamed_answer(self) -> Artifact | None:
        """The answer artifact as the subscribers have it so far, if any of it was sent."""
        return answer_artifact(self._answer.getvalue()) if self._answer.tell() or self._answered else None

    def finish_answer(self, text: str) -> None:
        """Send the whole answer, the last piece of the artifact, replacing what was streamed."""
        if self._answer_frozen:
            return
        self._answer = io.StringIO()
        self._answer.write(text)
        self._answered = True
        self.publish(self._answer_update(text, append=False, last=True))

    def _answer_update(self, text: str, *, append: bool, last: bool = False) -> TaskArtifactUpdateEvent:
        return TaskArtifactUpdateEvent(
            task_id=self.task.id, context_id=self.task.context_id, artifact=answer_artifact(text), append=append, last_chunk=last
        )

    def unsubscribe(self, receive: trio.MemoryReceiveChannel[StreamItem]) -> None:
        self._drop(receive)
        receive.close()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, event: StreamEvent) -> None:
        for receive, send in list(self._subscribers.items()):
            if send.statistics().current_buffer_used >= SUBSCRIBER_BUFFER:
                logger.warning("task %s: a subscriber fell %d events behind and was dropped", self.task.id, SUBSCRIBER_BUFFER)
                why = (
                    f"this client fell {SUBSCRIBER_BUFFER} events behind. The task goes on: subscribe again"
                    " (SubscribeToTask; tasks/resubscribe in A2A 0.3) to follow it from where it stands"
                )
                self._drop(receive, StreamCut(self.task.id, why))
                continue
            try:
                send.send_nowait(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._drop(receive)

    def close(self, *, end_stored: bool = True, why: str = END_NOT_STORED) -> None:
        """The task has settled: end every subscription after what was already sent. The run may
        still be ending (saving a partial answer); nothing it publishes now is sent. With
        ``end_stored=False`` (the run's final state could not be written) each subscription ends
        instead with a StreamCut saying ``why``, and a blocking send is told the same (EndNotStored),
        until a later write of the end succeeds and closes it again."""
        cut = None
        self.end_stored = end_stored
        if not end_stored:
            self.end_not_stored = why
            cut = StreamCut(self.task.id, why)
        self.settled.set()
        for receive in list(self._subscribers):
            self._drop(receive, cut)

    def _drop(self, receive: trio.MemoryReceiveChannel[StreamItem], cut: StreamCut | None = None) -> None:
        send = self._subscribers.pop(receive, None)
        if send is not None:
            if cut is not None:
                with contextlib.suppress(trio.BrokenResourceError):  # a subscriber that already left
                    send.send_nowait(cut)  # never blocks: a slot is kept free for it
            send.close()
