"""Checks applied to content before anything of a call is written."""

from __future__ import annotations

import collections
import json
import json.scanner
import math
import re
from collections.abc import Callable, Sequence
from typing import NoReturn

from persistence.errors import InvalidEvent, InvalidTask, StoreError, TranscriptConflict
from persistence.transcript import Message

MAX_EVENT_BYTES = 1 << 20  # 1 MiB: a larger event is almost certainly a bug upstream


# The decoder's scanner parses one JSON value at a position; json.loads adds whitespace handling
# around it. Appends check every content, so the common case (no surrounding whitespace) skips
# that layer, and anything else takes the full path.
def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_STRICT = json.JSONDecoder(parse_constant=_reject_constant)
_scan_once = json.scanner.make_scanner(_STRICT)  # type: ignore[arg-type]


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text} is too large to be read as a number")
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    value = dict(pairs)
    if len(value) < len(pairs):
        twice = next(key for key, count in collections.Counter(key for key, _ in pairs).items() if count > 1)
        raise ValueError(f"the key {twice!r} is given twice")
    return value


# What a model wrote is read back by other servers: 1e309 is infinity here, and refused by Go's
# decoder (Ollama's); a key given twice is its last value here, and may be its first elsewhere.
_FINITE = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite)
_UNIQUE = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite, object_pairs_hook=_unique_keys)


def strict_json(text: str, *, unique_keys: bool = False) -> object:
    """``text`` as one strict JSON value: no NaN or Infinity, no number too large for a float,
    and with ``unique_keys`` no key twice in an object. json.JSONDecodeError if it is not JSON,
    ValueError if it is but breaks those rules (RecursionError if it is nested deeper than
    Python reads)."""
    return (_UNIQUE if unique_keys else _FINITE).decode(text)


def is_json(text: str) -> bool:
    """Whether text is one strict JSON value (no NaN or Infinity), whitespace allowed around it."""
    try:
        _, end = _scan_once(text, 0)
        if end == len(text):
            return True
    except (StopIteration, ValueError, RecursionError):
        pass
    try:
        _STRICT.decode(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python reads
        return False
    return True


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> str | None:
    """Why ``text`` cannot be stored (to follow the thing's name), or None if it can.

    A Python string can hold a lone UTF-16 surrogate (JSON's ``"\\ud800"`` escape decodes to
    one), which UTF-8, and so SQLite, cannot encode. Stores refuse such text before anything of
    the call is queued, so one bad write never fails the others committed with it.
    """
    if text.isascii():  # the common case, and an O(1) test
        return None
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (
        f"holds a lone UTF-16 surrogate (U+{ord(found.group()):04X}) at character {found.start()}, "
        "which is not Unicode text and cannot be stored as UTF-8; send the character as a surrogate pair, or drop it"
    )


def check_contents(session_id: str, contents: Sequence[str], *, first_index: int, max_bytes: int) -> None:
    """Raise InvalidEvent for the first content that is not storable JSON text of at most max_bytes."""
    for content in contents:  # the common case first: every content fine, checked cheaply
        if (
            type(content) is not str
            or len(content) * 4 > max_bytes
            or not is_json(content)
            or (not content.isascii() and _SURROGATE.search(content))
        ):
            break
    else:
        return
    for offset, content in enumerate(contents):
        index = first_index + offset
        if not isinstance(content, str):
            raise InvalidEvent(session_id, index, f"content must be JSON text (str), not {type(content).__name__}")
        check_sizes(session_id, (content,), first_index=index, max_bytes=max_bytes)
        check_text(session_id, (content,), first_index=index)
        if not is_json(content):
            try:
                _STRICT.decode(content)
            except ValueError as exc:
                raise InvalidEvent(session_id, index, f"content is not JSON ({exc})") from None
            except RecursionError:
                raise InvalidEvent(session_id, index, "content is JSON nested deeper than can be read") from None


def checked_append(session_id: str, contents: Sequence[str], *, max_bytes: int, author: str) -> list[str]:
    """The contents of an append, as a list, once the session id, the author and every content
    are checked."""
    check_session_id(session_id)
    if not isinstance(author, str) or not author:
        raise ValueError(f"the author of an append to session {session_id!r} must be a non-empty string, not {author!r}")
    reason = lone_surrogate(author)
    if reason is not None:
        raise ValueError(f"the author {author!r} of an append to session {session_id!r} {reason}")
    contents = list(contents)
    check_contents(session_id, contents, first_index=0, max_bytes=max_bytes)
    return contents


def check_session_id(session_id: str) -> None:
    if not isinstance(session_id, str) or not session_id:
        raise ValueError("a session id must be a non-empty string; an empty one would collect every conversation in one bucket")
    check_name("session id", session_id)


def check_name(what: str, name: str) -> None:
    """A name a store keys rows by (a session id, an app name, a user id) must be storable."""
    reason = lone_surrogate(name)
    if reason is not None:
        raise ValueError(f"{what} {name!r} {reason}")


def check_steer(session_id: str, text: str) -> None:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a steer for session {session_id!r} must be non-empty text")
    reason = lone_surrogate(text)
    if reason is not None:
        raise ValueError(f"a steer for session {session_id!r} {reason}")


def check_steer_params(
    session_id: str, text: str, message_id: str | None, task_id: str | None, record: str | None = None
) -> None:
    """What ``add_steer`` is given: a session id, a steer, the ids of the message it came in
    and of its task, if any, and what is to be recorded of it elsewhere (only with a message id)."""
    check_session_id(session_id)
    check_steer(session_id, text)
    for what, name in (("message id", message_id), ("task id", task_id)):
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"a steer's {what} for session {session_id!r} must be a non-empty string or None")
            check_name(what, name)
    if record is not None:
        if message_id is None:
            raise ValueError(f"a steer for session {session_id!r} left with a record needs its message id, to mark it recorded")
        check_steer(session_id, record)


def check_task(task_id: str, **columns: str) -> None:
    """Raise InvalidTask if the task's id or any of its ``columns`` cannot be stored."""
    for column, text in {"id": task_id, **columns}.items():
        reason = lone_surrogate(text)
        if reason is not None:
            raise InvalidTask(task_id, f"its {_TASK_COLUMNS.get(column, column)} {reason}")


_TASK_COLUMNS = {"context_id": "context id", "task_json": "JSON", "message_id": "first message's id"}

MAX_INTEGER = 2**63 - 1  # the largest integer SQLite keeps


def check_task_write(task_id: str, *, expected_version: int | None = None, updated_at_ms: int | None = None) -> None:
    """Raise ValueError for a version or a time no backend would keep as given."""
    if expected_version is not None:
        check_integer(expected_version, f"the expected version of task {task_id!r}", minimum=1)
    if updated_at_ms is not None:
        check_integer(updated_at_ms, f"the update time (ms) of task {task_id!r}", minimum=0)


def check_integer(value: object, what: str, *, minimum: int) -> None:
    """Raise ValueError unless ``value`` (None for "not given" is the caller's to let through) is
    an int from ``minimum`` to what SQLite can keep: every backend then takes the same values."""
    if type(value) is not int or not minimum <= value <= MAX_INTEGER:
        raise ValueError(f"{what} must be an integer from {minimum} to {MAX_INTEGER}, not {value!r}")


def plan_save(
    session_id: str,
    given: Sequence[Message],
    *,
    stored: int,
    verified: list[Message],
    stored_from: Callable[[int], Sequence[str]],
    max_bytes: int,
) -> list[str]:
    """The contents a save must append, given what is stored: only the new messages.

    The whole stored transcript is checked, at a cost that does not grow with its length in
    the usual case. ``verified`` is the store's list of messages known to equal the first
    stored ones (the objects the saves were given): the caller's are compared with it as one
    list comparison, in C, by identity first. Only the stored events past it are read
    (``stored_from(k)``: the contents of events k to ``stored - 1``) and compared one by one;
    the first save a store sees of a session reads them all. On success ``verified`` holds the
    whole transcript as written (copies of the caller's list, whatever it holds meanwhile);
    on failure it is as it was. Raises TranscriptConflict or InvalidEvent.
    """
    if not isinstance(given, list):
        given = list(given)  # any Sequence will do: a deque, say, which cannot be sliced
    if len(given) < stored:
        raise TranscriptConflict(
            session_id, f"the transcript has {_count(len(given))} but {stored} are stored", hint=_EXTEND
        )
    known = len(verified)  # at most ``stored``: they are stored
    verified += given[known:]
    try:
        if known and (given[0] is not verified[0] or given[known - 1] is not verified[known - 1]):
            # Equal messages rather than the same ones (a transcript read back, say): compared one
            # by one this once, then kept, so that the next save compares by identity again.
            head = given[:known]
            if head != verified[:known]:
                _differs(session_id, head, verified)
            verified[:known] = head
        elif verified != given:
            _differs(session_id, given, verified)
        for index, content in enumerate(stored_from(known) if known < stored else (), start=known):
            try:
                same = Message.from_json(content) == verified[index]
            except ValueError:
                same = False
            if not same:
                raise _conflict(session_id, index)
        contents = []
        for index in range(stored, len(verified)):
            message = verified[index]
            if not isinstance(message, Message):
                raise InvalidEvent(session_id, index, f"expected a Message, got {type(message).__name__}")
            contents.append(message.to_json())
        check_sizes(session_id, contents, first_index=stored, max_bytes=max_bytes)
        check_text(session_id, contents, first_index=stored)
    except BaseException:
        del verified[known:]
        raise
    return contents


def _differs(session_id: str, given: Sequence[Message], verified: Sequence[Message]) -> NoReturn:
    raise _conflict(session_id, next(i for i, (mine, had) in enumerate(zip(given, verified)) if mine != had))


_EXTEND = "a save must extend what is stored"


def _count(messages: int) -> str:
    return "1 message" if messages == 1 else f"{messages} messages"


def _conflict(session_id: str, index: int) -> TranscriptConflict:
    return TranscriptConflict(session_id, f"message {index} differs from the stored one", hint=_EXTEND)


def check_text(session_id: str, contents: Sequence[str], *, first_index: int) -> None:
    for offset, content in enumerate(contents):
        reason = lone_surrogate(content)
        if reason is not None:
            raise InvalidEvent(session_id, first_index + offset, f"it {reason}")


def check_sizes(session_id: str, contents: Sequence[str], *, first_index: int, max_bytes: int) -> None:
    for offset, content in enumerate(contents):
        if len(content) * 4 <= max_bytes:  # no UTF-8 character takes more than 4 bytes
            continue
        size = len(content.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise InvalidEvent(session_id, first_index + offset, f"it is {size} bytes, over the limit of {max_bytes}")


def decode_messages(session_id: str, contents: Sequence[str], *, first_index: int = 0) -> list[Message]:
    messages = []
    for index, content in enumerate(contents, start=first_index):
        try:
            messages.append(Message.from_json(content))
        except ValueError as exc:
            raise StoreError(f"event {index} of session {session_id!r} is not a message: {exc}") from exc
    return messages
