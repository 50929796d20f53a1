"""Tasks, stream events and history trimming in both encodings."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import attrs
import pytest

from protocol import (
    Artifact,
    InvalidParams,
    Message,
    ProtocolVersion,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
    TextPart,
    ends_stream,
    send_result_from_json,
    send_result_to_json,
    stream_event_from_json,
    stream_event_to_json,
    trim_history,
)

V1, V03 = ProtocolVersion.V1_0, ProtocolVersion.V0_3
AT = datetime(2026, 11, 29, 22, 16, 56, 297322, tzinfo=timezone.utc)


def msg(n: int) -> Message:
    return Message(message_id=f"m-{n}", role=Role.USER if n % 2 else Role.AGENT, parts=[TextPart(f"text {n}")])


def task(history: int = 3, state: TaskState = TaskState.COMPLETED) -> Task:
    return Task(
        id="t-1",
        context_id="c-1",
        status=TaskStatus(state=state, timestamp=AT),
        artifacts=[Artifact(artifact_id="a-1", name="echo", parts=[TextPart("out")])],
        history=[msg(n) for n in range(history)],
    )


def test_task_encodes_without_kind_in_1_0_and_with_kind_in_0_3() -> None:
    assert "kind" not in task().to_json(V1)
    assert task().to_json(V03)["kind"] == "task"
    assert task().to_json(V1)["status"] == {"state": "TASK_STATE_COMPLETED", "timestamp": "2026-11-29T22:16:56.297322Z"}


@pytest.mark.parametrize(
    ("moment", "text"),
    [
        (AT, "2026-11-29T22:16:56.297322Z"),
        (AT.replace(microsecond=0), "2026-11-29T22:16:56Z"),
        (AT.replace(microsecond=120000), "2026-11-29T22:16:56.120Z"),
        (datetime(2026, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=2))), "2025-12-31T23:00:00Z"),
    ],
)
def test_task_status_timestamp_is_utc_rfc3339(moment: datetime, text: str) -> None:
    status = TaskStatus(state=TaskState.WORKING, timestamp=moment)
    assert status.to_json(V1)["timestamp"] == text
    assert TaskStatus.from_json(status.to_json(V1), V1, "status") == status


def test_task_status_refuses_a_naive_timestamp() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        TaskStatus(state=TaskState.WORKING, timestamp=datetime(2026, 1, 1))


@pytest.mark.parametrize("text", ["2026-11-29", "2026-11-29T22:16:56", "yesterday", 17])
def test_task_status_bad_timestamp_names_the_field(text: object) -> None:
    with pytest.raises(InvalidParams, match=r"'result\.status\.timestamp' must be an RFC 3339 timestamp"):
        Task.from_json({"id": "t", "contextId": "c", "status": {"state": "working", "timestamp": text}}, V03, "result")


def test_task_without_context_id_names_the_field() -> None:
    with pytest.raises(InvalidParams, match=r"'task\.contextId' must be a non-empty string"):
        Task.from_json({"id": "t", "status": {"state": "TASK_STATE_WORKING"}}, V1)


def test_status_update_0_3_final_follows_the_state() -> None:
    def final(state: TaskState) -> object:
        event = TaskStatusUpdateEvent(task_id="t", context_id="c", status=TaskStatus(state=state))
        return event.to_json(V03)["final"]

    assert [final(s) for s in (TaskState.WORKING, TaskState.INPUT_REQUIRED, TaskState.COMPLETED)] == [False, True, True]


def test_status_update_1_0_has_no_final_and_no_kind() -> None:
    event = TaskStatusUpdateEvent(task_id="t", context_id="c", status=TaskStatus(state=TaskState.COMPLETED))
    assert event.to_json(V1) == {"taskId": "t", "contextId": "c", "status": {"state": "TASK_STATE_COMPLETED"}}


def test_status_update_0_3_final_of_the_wrong_type_is_rejected() -> None:
    obj = {"kind": "status-update", "taskId": "t", "contextId": "c", "status": {"state": "working"}, "final": "no"}
    with pytest.raises(InvalidParams, match=r"'result\.final' must be true or false"):
        stream_event_from_json(obj, V03)


def test_artifact_update_flags_are_omitted_when_false_in_1_0_and_always_sent_in_0_3() -> None:
    event = TaskArtifactUpdateEvent(
        task_id="t", context_id="c", artifact=Artifact(artifact_id="a", parts=[TextPart("x")])
    )
    assert {"append", "lastChunk"}.isdisjoint(event.to_json(V1))
    assert event.to_json(V03)["append"] is False and event.to_json(V03)["lastChunk"] is False
    chunk = attrs.evolve(event, append=True, last_chunk=True)
    assert chunk.to_json(V1)["append"] is True and chunk.to_json(V1)["lastChunk"] is True


def test_stream_event_1_0_is_wrapped_by_kind() -> None:
    status = TaskStatusUpdateEvent(task_id="t", context_id="c", status=TaskStatus(state=TaskState.WORKING))
    assert list(stream_event_to_json(status, V1)) == ["statusUpdate"]
    assert list(stream_event_to_json(task(), V1)) == ["task"]
    assert list(stream_event_to_json(msg(1), V1)) == ["message"]


def test_stream_event_1_0_needs_exactly_one_wrapper_key() -> None:
    with pytest.raises(InvalidParams, match="exactly one of 'task', 'message', 'statusUpdate', 'artifactUpdate'"):
        stream_event_from_json({"task": {}, "message": {}}, V1)


def test_stream_event_0_3_unknown_kind_is_rejected() -> None:
    with pytest.raises(InvalidParams, match=r"'result\.kind' must be one of 'task', 'message', 'status-update'"):
        stream_event_from_json({"kind": "progress"}, V03)


def test_send_result_is_a_task_or_a_message() -> None:
    assert send_result_to_json(msg(1), V1) == {"message": msg(1).to_json(V1)}
    assert send_result_from_json(send_result_to_json(task(), V03), V03) == task()
    status = TaskStatusUpdateEvent(task_id="t", context_id="c", status=TaskStatus(state=TaskState.WORKING))
    with pytest.raises(InvalidParams, match="'result' must be a task or a message"):
        send_result_from_json(stream_event_to_json(status, V1), V1)


def test_ends_stream_after_a_message_or_a_terminal_or_interrupted_status() -> None:
    def update(state: TaskState) -> TaskStatusUpdateEvent:
        return TaskStatusUpdateEvent(task_id="t", context_id="c", status=TaskStatus(state=state))

    chunk = TaskArtifactUpdateEvent(task_id="t", context_id="c", artifact=Artifact(artifact_id="a", parts=[]))
    assert (
        ends_stream(msg(1)) and ends_stream(update(TaskState.AUTH_REQUIRED)) and ends_stream(update(TaskState.FAILED))
    )
    assert not ends_stream(update(TaskState.WORKING)) and not ends_stream(chunk)
    assert not ends_stream(task(state=TaskState.SUBMITTED)) and ends_stream(task(state=TaskState.CANCELED))


@pytest.mark.parametrize(("length", "kept"), [(None, 5), (1, 1), (3, 3), (9, 5)])
@pytest.mark.parametrize("version", list(ProtocolVersion))
def test_trim_history_keeps_the_last_n(length: int | None, kept: int, version: ProtocolVersion) -> None:
    trimmed = trim_history(task(history=5), length, version)
    assert trimmed.history == task(history=5).history[5 - kept :]


def test_trim_history_zero_omits_history_in_1_0() -> None:
    trimmed = trim_history(task(history=5), 0, V1)
    assert trimmed.history == ()
    assert "history" not in trimmed.to_json(V1)


def test_trim_history_zero_keeps_everything_in_0_3() -> None:
    assert trim_history(task(history=5), 0, V03) == task(history=5)


def test_trim_history_refuses_a_negative_length() -> None:
    with pytest.raises(ValueError, match="at least 0, got -1"):
        trim_history(task(), -1, V1)
