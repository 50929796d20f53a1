from __future__ import annotations

import json

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from protocol import SseEvent, SseLines, SseParser, encode_comment, encode_event
from protocol.sse import LineTooLong
from protocol.sse import CONTENT_TYPE, HEADERS


def parse_all(stream: bytes, chunk_size: int | None = None) -> list[SseEvent]:
    parser = SseParser()
    step = chunk_size or max(len(stream), 1)
    events = [event for start in range(0, len(stream), step) for event in parser.feed(stream[start : start + step])]
    assert parser.close()
    return events


def test_encode_event_is_one_data_line_and_a_blank_line() -> None:
    response = {"jsonrpc": "2.0", "id": 9, "result": {"statusUpdate": {"text": "a\nb"}}}
    framed = encode_event(response)
    assert framed == b'data: {"jsonrpc":"2.0","id":9,"result":{"statusUpdate":{"text":"a\\nb"}}}\n\n'


@given(st.text())
@example("first\u2028second\u2029third\x85fourth")  # what st.text() rarely draws
def test_an_event_stays_one_line_for_a_client_that_splits_lines_as_python_does(text: str) -> None:
    # httpx's aiter_lines() (the a2a-sdk client's reader) breaks where str.splitlines() does:
    # also at U+2028, U+2029, U+0085 and a few control characters.
    framed = encode_event({"jsonrpc": "2.0", "id": 1, "result": {"text": text}})
    lines = framed.decode("utf-8", errors="surrogatepass").splitlines()
    assert len(lines) == 2 and lines[1] == ""
    assert json.loads(lines[0].removeprefix("data: "))["result"]["text"] == text


def test_encode_comment_is_ignored_by_the_parser() -> None:
    assert encode_comment("keep-alive") == b": keep-alive\n\n"
    assert encode_comment() == b":\n\n"
    assert parse_all(encode_comment("ping") + encode_event({"a": 1})) == [SseEvent('{"a":1}')]


def test_encode_comment_refuses_a_newline() -> None:
    with pytest.raises(ValueError, match="one line"):
        encode_comment("a\nb")


def test_stream_headers_match_the_reference_server() -> None:
    assert dict(HEADERS) == {"content-type": CONTENT_TYPE, "cache-control": "no-store", "x-accel-buffering": "no"}


def test_parser_reads_events_split_anywhere() -> None:
    stream = b"".join(encode_event({"n": n, "text": "caf\u00e9 \u2603"}) for n in range(3))
    whole = parse_all(stream)
    assert [json.loads(event.data)["n"] for event in whole] == [0, 1, 2]
    for size in (1, 2, 3, 7):
        assert parse_all(stream, size) == whole


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_parser_accepts_every_line_ending(newline: bytes) -> None:
    stream = b"data: one" + newline + b"data: two" + newline + newline
    assert parse_all(stream) == [SseEvent("one\ntwo")]
    assert parse_all(stream, 1) == [SseEvent("one\ntwo")]


def test_parser_reads_event_id_and_retry_fields() -> None:
    stream = b"event: update\nid: 42\nretry: 1500\ndata:no-space\n\ndata: next\n\n"
    assert parse_all(stream) == [SseEvent("no-space", "update", "42", 1500), SseEvent("next", "message", "42", 1500)]


def test_parser_skips_a_leading_byte_order_mark_and_unknown_fields() -> None:
    assert parse_all(b"\xef\xbb\xbfdata: x\nfoo: bar\nbare\n\n") == [SseEvent("x")]


def test_parser_ignores_blank_lines_without_data() -> None:
    assert parse_all(b"\n\nevent: lonely\n\n") == []


def test_parser_close_reports_a_cut_off_event() -> None:
    parser = SseParser()
    assert parser.feed(b'data: {"partial": tr') == []
    assert not parser.close()
    unfinished = SseParser()
    assert unfinished.feed(b"data: whole line\n") == []
    assert not unfinished.close()


@given(st.lists(st.text(st.characters(blacklist_categories=["Cs"]), max_size=40), max_size=5), st.integers(1, 9))
def test_parser_round_trips_any_json_text_in_any_chunking(texts: list[str], chunk_size: int) -> None:
    responses = [{"jsonrpc": "2.0", "id": i, "result": {"text": text}} for i, text in enumerate(texts)]
    stream = b"".join(encode_event(response) for response in responses)
    assert [json.loads(event.data) for event in parse_all(stream, chunk_size)] == responses


@given(
    lines=st.lists(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n")), max_size=8),
    endings=st.lists(st.sampled_from(["\n", "\r", "\r\n"]), min_size=8, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_stream_lines_come_out_whole_however_the_bytes_are_cut(lines: list[str], endings: list[str], cuts: list[int]) -> None:
    # A CR at the end of one read and the LF that starts the next are one line ending.
    pairs = list(zip(lines, endings))
    # A CR ending, then an empty line ended by LF, is one CRLF: the lines would not be these.
    assume(not any(e == "\r" and not nxt and f == "\n" for (_, e), (nxt, f) in zip(pairs, pairs[1:])))
    raw = "".join(line + ending for line, ending in pairs).encode()
    bounds = sorted({0, len(raw), *(cut for cut in cuts if cut < len(raw))})
    splitter = SseLines()
    got = [line for start, end in zip(bounds, bounds[1:]) for line in splitter.feed(raw[start:end])]
    assert splitter.close() == ""
    assert got == [line.removeprefix("\ufeff") if i == 0 else line for i, line in enumerate(lines)]


def test_a_line_longer_than_the_limit_is_refused_rather_than_held() -> None:
    splitter = SseLines(max_line_chars=10)
    assert splitter.feed(b"data: 1234\n") == ["data: 1234"]  # 10 characters: held, then ended
    splitter.feed(b"data: ")
    with pytest.raises(LineTooLong, match="longer than 10 characters"):
        splitter.feed(b"12345")
