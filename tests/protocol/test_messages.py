"""Messages and parts in both encodings, and what decoding says about bad input."""

from __future__ import annotations

from typing import Any

import pytest

from protocol import DataPart, FilePart, InvalidParams, Message, ProtocolVersion, Role, TextPart, part_from_json

V1, V03 = ProtocolVersion.V1_0, ProtocolVersion.V0_3


def bad(obj: Any, version: ProtocolVersion) -> str:
    with pytest.raises(InvalidParams) as caught:
        Message.from_json(obj, version)
    return caught.value.message


def test_message_encodes_protojson_names_in_1_0() -> None:
    message = Message(message_id="m-1", role=Role.USER, parts=[TextPart("hello")], context_id="c", task_id="t")
    assert message.to_json(V1) == {
        "messageId": "m-1",
        "contextId": "c",
        "taskId": "t",
        "role": "ROLE_USER",
        "parts": [{"text": "hello"}],
    }


def test_message_encodes_kind_and_plain_role_in_0_3() -> None:
    message = Message(message_id="o-1", role=Role.AGENT, parts=[TextPart("hi")], reference_task_ids=["t-0"])
    assert message.to_json(V03) == {
        "kind": "message",
        "messageId": "o-1",
        "role": "agent",
        "parts": [{"kind": "text", "text": "hi"}],
        "referenceTaskIds": ["t-0"],
    }


def test_message_without_message_id_names_the_field() -> None:
    assert bad({"role": "ROLE_USER", "parts": [{"text": "x"}]}, V1) == (
        "invalid params: 'message.messageId' must be a non-empty string, got nothing (the field is missing)"
    )


def test_message_role_from_the_other_version_is_rejected_saying_which_header_that_version_sends() -> None:
    assert bad({"messageId": "m", "role": "user", "parts": [{"text": "x"}]}, V1) == (
        "invalid params: 'message.role' must be 'ROLE_USER' or 'ROLE_AGENT' in A2A 1.0, got 'user', the A2A 0.3 spelling;"
        " an A2A 0.3 client sends its requests without an A2A-Version header"
    )
    assert bad({"kind": "message", "messageId": "m", "role": "ROLE_USER", "parts": [{"kind": "text", "text": "x"}]}, V03) == (
        "invalid params: 'message.role' must be 'user' or 'agent' in A2A 0.3, got 'ROLE_USER', the A2A 1.0 spelling;"
        " an A2A 1.0 client sends its requests with the header A2A-Version: 1.0"
    )
    assert bad({"messageId": "m", "role": "ROLE_ADMIN", "parts": [{"text": "x"}]}, V1) == (
        "invalid params: 'message.role' must be 'ROLE_USER' or 'ROLE_AGENT', got string 'ROLE_ADMIN'"
    )


def test_message_role_may_be_its_enum_number_in_1_0_only() -> None:
    assert Role.from_wire(1, V1, field="role") is Role.USER  # a2a.proto: ROLE_USER = 1
    assert Role.from_wire(2, V1, field="role") is Role.AGENT
    for version, number in ((V1, 0), (V1, True), (V03, 1)):  # unspecified; not a number; 0.3 has none
        with pytest.raises(InvalidParams, match="'role' must be"):
            Role.from_wire(number, version, field="role")


def test_message_without_parts_says_at_least_one_is_needed() -> None:
    assert "'message.parts' must be a non-empty array, got an empty array" in bad(
        {"messageId": "m", "role": "ROLE_USER", "parts": []}, V1
    )


def test_message_bad_part_is_named_by_index() -> None:
    message = {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "ok"}, {"text": 5}]}
    assert bad(message, V1) == "invalid params: 'message.parts[1].text' must be a string, got integer 5"


def test_message_0_3_with_the_wrong_kind_is_rejected() -> None:
    assert "'message.kind' must be 'message', got string 'task'" in bad(
        {"kind": "task", "messageId": "m", "role": "user", "parts": [{"kind": "text", "text": "x"}]}, V03
    )


def test_message_that_is_not_an_object_is_rejected() -> None:
    assert bad("hello", V1) == "invalid params: 'message' must be an object, got string 'hello'"


def test_message_ignores_unknown_fields_and_reads_empty_strings_as_unset() -> None:
    obj = {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": ""}], "contextId": "", "futureField": 1}
    assert Message.from_json(obj, V1) == Message(message_id="m", role=Role.USER, parts=[TextPart("")])


def test_part_1_0_shapes_decode_to_each_kind() -> None:
    assert part_from_json({"text": "hi", "mediaType": "text/markdown"}, V1, "p") == TextPart("hi", "text/markdown")
    assert part_from_json({"data": [1, 2]}, V1, "p") == DataPart([1, 2])
    assert part_from_json({"raw": "aGk=", "filename": "a.txt"}, V1, "p") == FilePart(raw=b"hi", filename="a.txt")
    assert part_from_json({"url": "https://x/y", "mediaType": "image/png"}, V1, "p") == FilePart(
        url="https://x/y", media_type="image/png"
    )


def test_part_1_0_needs_exactly_one_content_field() -> None:
    with pytest.raises(InvalidParams, match=r"'p' must be an object with exactly one of 'text', 'raw', 'url', 'data'"):
        part_from_json({"text": "a", "data": {}}, V1, "p")
    with pytest.raises(InvalidParams, match="got an object with keys 'mediaType'"):
        part_from_json({"mediaType": "text/plain"}, V1, "p")
    with pytest.raises(InvalidParams) as null:  # null reads as unset: say so, not "one of ... got 'text'"
        part_from_json({"text": None}, V1, "p")
    assert str(null.value) == (
        "invalid params: 'p.text' is null; give it a value (a part holds exactly one of 'text', 'raw', 'url', 'data')"
    )


def test_part_1_0_data_may_be_null_a_json_value_like_any_other() -> None:
    part = part_from_json({"data": None}, V1, "p")
    assert part == DataPart(None)
    assert part_from_json(part.to_json(V1), V1, "p") == part
    with pytest.raises(InvalidParams, match="exactly one of 'text', 'raw', 'url', 'data'"):
        part_from_json({"text": "a", "data": None}, V1, "p")


def test_part_0_3_shapes_decode_to_each_kind() -> None:
    assert part_from_json({"kind": "data", "data": {"a": 1}}, V03, "p") == DataPart({"a": 1})
    file = {"kind": "file", "file": {"bytes": "aGk=", "name": "a.txt", "mimeType": "text/plain"}}
    assert part_from_json(file, V03, "p") == FilePart(raw=b"hi", filename="a.txt", media_type="text/plain")
    assert part_from_json({"kind": "file", "file": {"uri": "https://x"}}, V03, "p") == FilePart(url="https://x")


@pytest.mark.parametrize(
    ("obj", "complaint"),
    [
        ({"text": "x"}, "'p.kind' must be one of 'text', 'file', 'data', got nothing"),
        ({"kind": "image"}, "'p.kind' must be one of 'text', 'file', 'data', got string 'image'"),
        ({"kind": "data", "data": [1]}, "'p.data' must be an object, got an array of 1 item"),
        ({"kind": "file", "file": {}}, "'p.file' must be an object with exactly one of 'bytes', 'uri'"),
        ({"kind": "file", "file": {"bytes": "!!"}}, "'p.file.bytes' must be a base64 string, got string '!!'"),
    ],
)
def test_part_0_3_bad_shapes_name_the_field(obj: Any, complaint: str) -> None:
    with pytest.raises(InvalidParams, match=complaint.replace("(", r"\(").replace(".", r"\.")):
        part_from_json(obj, V03, "p")


def test_part_data_that_is_not_an_object_is_wrapped_for_0_3_as_the_reference_wraps_it() -> None:
    wrapped = {"kind": "data", "data": {"value": [1, 2]}, "metadata": {"data_part_compat": True}}
    assert DataPart([1, 2]).to_json(V03) == wrapped
    assert part_from_json(wrapped, V03, "p") == DataPart([1, 2])
    kept = DataPart(None, metadata={"source": "form"})
    assert part_from_json(kept.to_json(V03), V03, "p") == kept
    assert DataPart({"a": 1}).to_json(V03) == {"kind": "data", "data": {"a": 1}}
    assert part_from_json({"kind": "data", "data": {"value": 1}}, V03, "p") == DataPart({"value": 1})


def test_part_0_3_data_marked_as_wrapped_without_its_value_names_the_field() -> None:
    with pytest.raises(InvalidParams, match=r"'p\.data\.value' is missing: the part's metadata says data_part_compat"):
        part_from_json({"kind": "data", "data": {"v": 1}, "metadata": {"data_part_compat": True}}, V03, "p")


def test_part_file_encodes_base64_and_uses_each_versions_names() -> None:
    part = FilePart(raw=b"\x00\xff", filename="b.bin", media_type="application/octet-stream")
    assert part.to_json(V1) == {"raw": "AP8=", "filename": "b.bin", "mediaType": "application/octet-stream"}
    assert part.to_json(V03) == {
        "kind": "file",
        "file": {"bytes": "AP8=", "name": "b.bin", "mimeType": "application/octet-stream"},
    }


def test_part_file_accepts_url_safe_base64() -> None:
    assert part_from_json({"raw": "AP8_"}, V1, "p") == FilePart(raw=b"\x00\xff?")  # "AP8/" in standard base64


@pytest.mark.parametrize(("raw", "decoded"), [("AP8", b"\x00\xff"), ("AA", b"\x00"), ("AA=", b"\x00"), ("AP8=", b"\x00\xff")])
def test_part_file_accepts_base64_with_or_without_its_padding_as_protojson_does(raw: str, decoded: bytes) -> None:
    assert part_from_json({"raw": raw}, V1, "p") == FilePart(raw=decoded)
    assert part_from_json({"kind": "file", "file": {"bytes": raw}}, V03, "p") == FilePart(raw=decoded)


@pytest.mark.parametrize("raw", ["A", "AP8==x", "A P8"])
def test_part_file_base64_that_no_padding_can_mend_is_refused(raw: str) -> None:
    with pytest.raises(InvalidParams, match="'p.raw' must be a base64 string"):
        part_from_json({"raw": raw}, V1, "p")


def test_part_file_needs_exactly_one_of_raw_and_url() -> None:
    with pytest.raises(ValueError, match="exactly one of raw= and url="):
        FilePart()
    with pytest.raises(ValueError, match="exactly one of raw= and url="):
        FilePart(raw=b"x", url="https://x")


def test_message_string_lists_refuse_a_bare_string() -> None:
    with pytest.raises(TypeError, match="wrap it in a list"):
        Message(message_id="m", role=Role.USER, parts=[TextPart("x")], extensions="https://ext")
