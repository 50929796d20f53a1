"""The stored form of a transcript message: its size, and cutting it to fit a store's limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persistence.transcript import Message, ToolCall

NOTE = "\n[cut]"


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=400), limit=st.integers(min_value=100, max_value=2000))
def test_a_message_cut_to_fit_keeps_the_longest_start_of_its_text_that_fits(text: str, limit: int) -> None:
    message = Message(role="tool", text=text, tool_call_id="call_1", name="read_log")
    cut = message.cut_to_fit(limit, NOTE)
    if message.stored_bytes() <= limit:
        assert cut is message
        assert message.oversize(limit) is None
        return
    assert message.oversize(limit) == message.stored_bytes()
    assert cut.text.endswith(NOTE) and text.startswith(cut.text.removesuffix(NOTE))
    assert cut.stored_bytes() <= limit
    kept = len(cut.text) - len(NOTE)
    one_more = Message(role="tool", text=text[: kept + 1] + NOTE, tool_call_id="call_1", name="read_log")
    assert one_more.stored_bytes() > limit


def test_the_stored_size_counts_escapes_and_utf8() -> None:
    # '{"role":"user","text":"..."}' holds 23 + 2 bytes around the text.
    assert Message(role="user", text="\x01é\"").stored_bytes() == 25 + 6 + 2 + 2
    assert Message(role="user", text="\x01" * 200).oversize(1000) == 25 + 1200


def test_a_message_that_cannot_fit_even_without_text_is_refused_saying_so() -> None:
    calls = (ToolCall(id="c", name="lookup", arguments="{" + " " * 500 + "}"),)
    with pytest.raises(ValueError, match=r"this assistant message \(5.. bytes\) cannot be cut to fit 100"):
        Message(role="assistant", text="hi", tool_calls=calls).cut_to_fit(100)


def test_a_message_nested_deeper_than_python_reads_is_not_a_message_rather_than_a_crash() -> None:
    with pytest.raises(ValueError, match="nested deeper than can be read"):
        Message.from_json('{"role":"user","text":' + "[" * 100_000 + "]" * 100_000 + "}")


_texts = st.text(max_size=40)
_calls = st.lists(st.builds(ToolCall, id=_texts, name=_texts, arguments=_texts, extra=_texts), max_size=2).map(tuple)
_messages = st.builds(
    Message,
    role=st.sampled_from(["user", "assistant", "tool"]),
    text=_texts,
    tool_calls=_calls,
    tool_call_id=_texts,
    name=_texts,
    partial=st.booleans(),
    turn_id=_texts,
    reasoning=_texts,
    reasoning_as=st.sampled_from(["reasoning_content", "reasoning", "reasoning_content reasoning", ""]),
    reasoning_details=_texts,
    via=_texts,
)


@settings(max_examples=300, deadline=None)
@given(message=_messages, limit=st.integers(min_value=0, max_value=2000))
def test_every_message_reads_back_equal_and_its_stored_size_is_bounded_by_oversize(message: Message, limit: int) -> None:
    assert Message.from_json(message.to_json()) == message
    size = message.stored_bytes()
    assert message.oversize(limit) == (size if size > limit else None)
