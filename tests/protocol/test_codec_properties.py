"""Property tests: every value survives encode -> JSON text -> decode, in both versions, and
decoding arbitrary JSON fails only with InvalidParams."""

from __future__ import annotations

import json
from datetime import timezone
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Artifact,
    DataPart,
    FilePart,
    InvalidParams,
    Message,
    ProtocolVersion,
    RequestRejected,
    Role,
    SendConfiguration,
    SendMessageParams,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
    TextPart,
    encode_json,
    parse_request,
    stream_event_from_json,
    stream_event_to_json,
)

V1, V03 = ProtocolVersion.V1_0, ProtocolVersion.V0_3
PROPERTY = settings(deadline=None, max_examples=75, suppress_health_check=[HealthCheck.too_slow])

names = st.text(min_size=1, max_size=12)
optional_names = st.none() | names
scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
objects = st.dictionaries(st.text(max_size=5), json_values, min_size=1, max_size=3)
metadata = st.none() | objects
timestamps = st.none() | st.datetimes(timezones=st.just(timezone.utc))
string_lists = st.lists(st.text(max_size=8), max_size=2)


def parts(version: ProtocolVersion) -> st.SearchStrategy[Any]:
    v1 = version is V1
    media = optional_names if v1 else st.none()
    text = st.builds(TextPart, st.text(max_size=20), media, metadata)
    data = st.builds(DataPart, json_values.filter(lambda v: v is not None), media, metadata)
    inline = st.builds(
        FilePart, raw=st.binary(max_size=16), filename=optional_names, media_type=optional_names, metadata=metadata
    )
    linked = st.builds(FilePart, url=names, filename=optional_names, media_type=optional_names, metadata=metadata)
    return text | data | inline | linked


def messages(version: ProtocolVersion) -> st.SearchStrategy[Message]:
    return st.builds(
        Message,
        message_id=names,
        role=st.sampled_from(Role),
        parts=st.lists(parts(version), min_size=1, max_size=3),
        task_id=optional_names,
        context_id=optional_names,
        metadata=metadata,
        extensions=string_lists,
        reference_task_ids=string_lists,
    )


def statuses(version: ProtocolVersion) -> st.SearchStrategy[TaskStatus]:
    return st.builds(
        TaskStatus, state=st.sampled_from(TaskState), message=st.none() | messages(version), timestamp=timestamps
    )


def artifacts(version: ProtocolVersion) -> st.SearchStrategy[Artifact]:
    return st.builds(
        Artifact,
        artifact_id=names,
        parts=st.lists(parts(version), min_size=1, max_size=2),
        name=optional_names,
        description=optional_names,
        metadata=metadata,
        extensions=string_lists,
    )


def tasks(version: ProtocolVersion) -> st.SearchStrategy[Task]:
    return st.builds(
        Task,
        id=names,
        context_id=names,
        status=statuses(version),
        artifacts=st.lists(artifacts(version), max_size=2),
        history=st.lists(messages(version), max_size=2),
        metadata=metadata,
    )


def stream_events(version: ProtocolVersion) -> st.SearchStrategy[Any]:
    status = st.builds(
        TaskStatusUpdateEvent, task_id=names, context_id=names, status=statuses(version), metadata=metadata
    )
    chunk = st.builds(
        TaskArtifactUpdateEvent,
        task_id=names,
        context_id=names,
        artifact=artifacts(version),
        append=st.booleans(),
        last_chunk=st.booleans(),
        metadata=metadata,
    )
    return tasks(version) | messages(version) | status | chunk


def through_text(obj: Any) -> Any:
    return json.loads(encode_json(obj))


def versioned(build: Any) -> st.SearchStrategy[tuple[ProtocolVersion, Any]]:
    return st.sampled_from([V1, V03]).flatmap(lambda version: st.tuples(st.just(version), build(version)))


@PROPERTY
@given(versioned(messages))
def test_message_round_trips_through_json_text(case: tuple[ProtocolVersion, Message]) -> None:
    version, message = case
    assert Message.from_json(through_text(message.to_json(version)), version) == message


@PROPERTY
@given(versioned(tasks))
def test_task_round_trips_through_json_text(case: tuple[ProtocolVersion, Task]) -> None:
    version, task = case
    assert Task.from_json(through_text(task.to_json(version)), version) == task


@PROPERTY
@given(versioned(stream_events))
def test_stream_event_round_trips_through_json_text(case: tuple[ProtocolVersion, Any]) -> None:
    version, event = case
    assert stream_event_from_json(through_text(stream_event_to_json(event, version)), version) == event


@PROPERTY
@given(
    versioned(
        lambda version: st.builds(
            SendMessageParams,
            message=messages(version),
            configuration=st.builds(
                SendConfiguration,
                accepted_output_modes=string_lists,
                history_length=st.none() | st.integers(0, 50),
                return_immediately=st.booleans(),
                push_notification_config=metadata,
            ),
            metadata=metadata,
        )
    )
)
def test_send_params_round_trip_through_json_text(case: tuple[ProtocolVersion, SendMessageParams]) -> None:
    version, params = case
    assert SendMessageParams.from_json(through_text(params.to_json(version)), version) == params


interfaces = st.builds(
    AgentInterface,
    url=names,
    protocol_binding=st.sampled_from(["JSONRPC", "HTTP+JSON", "GRPC"]),
    protocol_version=st.sampled_from(["1.0", "0.3"]),
    tenant=optional_names,
)
cards = st.builds(
    AgentCard,
    name=names,
    description=st.text(max_size=20),
    version=names,
    supported_interfaces=st.lists(interfaces, min_size=1, max_size=3),
    capabilities=st.builds(
        AgentCapabilities,
        streaming=st.none() | st.booleans(),
        push_notifications=st.none() | st.booleans(),
        extended_agent_card=st.none() | st.booleans(),
    ),
    default_input_modes=string_lists,
    default_output_modes=string_lists,
    skills=st.lists(
        st.builds(
            AgentSkill, id=names, name=names, description=st.text(max_size=10), tags=string_lists, examples=string_lists
        ),
        max_size=2,
    ),
)


@PROPERTY
@given(cards)
def test_card_round_trips_in_1_0(card: AgentCard) -> None:
    assert AgentCard.from_json(through_text(card.to_json(V1)), V1) == card


@PROPERTY
@given(st.sampled_from([V1, V03]), json_values)
def test_decoding_any_json_fails_only_with_invalid_params(version: ProtocolVersion, obj: Any) -> None:
    for decode in (Message.from_json, Task.from_json, stream_event_from_json):
        try:
            decode(obj, version)
        except InvalidParams as exc:
            assert exc.message.startswith("invalid params: '")


@PROPERTY
@given(st.binary(max_size=64) | json_values.map(encode_json))
def test_parse_request_fails_only_with_request_rejected(body: bytes) -> None:
    try:
        parse_request(body)
    except RequestRejected as rejected:
        assert rejected.error.message
