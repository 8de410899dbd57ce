"""The core's SSE decoder: any chunking, every line ending, the WHATWG rules we rely on; bad input raises FormatError."""

from __future__ import annotations

import random

import pytest

from deltasync.errors import FormatError
from deltasync.sse import SSEDecoder, SSEEvent, format_event


def _decode(stream: bytes, step: int | None = None, **kw) -> list[tuple[str, str, str | None]]:
    dec = SSEDecoder(**kw)
    events: list[SSEEvent] = []
    step = step or len(stream) or 1
    for i in range(0, len(stream), step):
        events += dec.feed(stream[i:i + step])
    return [(e.event, e.data, e.id) for e in events]


STREAM = (format_event("head", {"model": "m", "version": 1}) + b": keepalive\n\n"
          + format_event("version", {"model": "m", "version": 2}, id="2") + b"retry: 10\n\n"
          + b"event: x\r\ndata: a\r\ndata: b\r\n\r\n"
          + b"data: lone cr\rdata:no space\r\r"
          + b"data\n\n"  # a field name alone: data is empty, the event is still dispatched
          + b"id: bad\0id\ndata: keeps 2\n\n")
EXPECTED = [
    ("head", '{"model":"m","version":1}', None),
    ("version", '{"model":"m","version":2}', "2"),
    ("x", "a\nb", "2"),
    ("message", "lone cr\nno space", "2"),
    ("message", "", "2"),
    ("message", "keeps 2", "2"),
]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64, None])
def test_any_chunking_gives_the_same_events(step):
    assert _decode(STREAM, step) == EXPECTED


def test_random_chunking():
    rng = random.Random(7)
    for _ in range(50):
        dec, events, i = SSEDecoder(), [], 0
        while i < len(STREAM):
            n = rng.randint(1, 20)
            events += dec.feed(STREAM[i:i + n])
            i += n
        assert [(e.event, e.data, e.id) for e in events] == EXPECTED


def test_crlf_split_between_chunks_is_one_line_end():
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\ndata: b\r") == []
    assert [(e.data) for e in dec.feed(b"\n\r\n")] == ["a\nb"]


def test_bom_is_skipped_even_when_split():
    for step in (1, 2, 4, None):
        assert _decode(b"\xef\xbb\xbfdata: x\n\n", step) == [("message", "x", None)]


def test_an_event_cut_off_by_the_end_is_not_dispatched():
    assert _decode(b"data: whole\n\ndata: cut") == [("message", "whole", None)]
    assert _decode(b"event: only\n\n") == []  # no data: nothing to dispatch


def test_a_line_over_the_limit_raises_format_error():
    with pytest.raises(FormatError, match="limit"):
        _decode(b"data: " + b"x" * 100, max_line=50)
    with pytest.raises(FormatError, match="limit"):  # unterminated, fed piecewise
        _decode(b"data: " + b"x" * 100, 10, max_line=50)
    assert _decode(b"data: " + b"x" * 40 + b"\n\n", max_line=50) == [("message", "x" * 40, None)]


def test_json_of_an_event():
    assert SSEEvent(event="v", data='{"a": 1}').json() == {"a": 1}
    for bad in ("not json", "[1, 2]", ""):
        with pytest.raises(FormatError, match="event"):
            SSEEvent(event="v", data=bad).json()


def test_format_event_refuses_multiline_data():
    with pytest.raises(ValueError, match="one line"):
        format_event("x", b"a\nb")


def test_random_bytes_raise_nothing_but_format_error():
    rng = random.Random(3)
    for _ in range(200):
        blob = bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
        try:
            for e in SSEDecoder(max_line=64).feed(blob):
                assert isinstance(e.data, str) and isinstance(e.event, str)
        except FormatError:
            pass
