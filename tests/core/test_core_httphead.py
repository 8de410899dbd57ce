"""``deltasync/httphead.py``: the one reader of HTTP/1.1 answer heads, and its three callers.

The reader is fed valid heads whole, a byte at a time and at every split point (the same head each
time), every prefix (always "need more", never an error nor a head), every single-bit flip (a head,
"need more" or ``HeadError``, never another exception) and a table of hostile heads (each refused with
its reason). Then the disagreement issue 26 found: a repeated or conflicting ``Content-Length`` is
refused by all three callers (``client/blobrecv.py``, ``server/http/blobget.py``, ``client/plainhttp.py``)
through real loopback servers that send it."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.errors import DeltaSyncError, UpstreamError
from deltasync.httphead import MAX_HEAD, ContentRange, HeadError, ResponseHead, check_range, read_head

BODY = b"body bytes that follow the head"

VALID = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 31\r\nContent-Type: application/octet-stream\r\n\r\n",
    b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 100-130/131\r\nContent-Length: 31\r\n"
    b"Date: Thu, 03 Dec 2026 16:00:00 GMT\r\nServer: Python/3.11 aiohttp/3.9\r\n\r\n",
    b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n",
    b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */5\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n",
    b"HTTP/1.1 204\r\n\r\n",
    b"HTTP/1.1 503 \r\nRetry-After:\t7 \r\nX-A: 1\r\nx-a: 2\r\nX-Latin: caf\xe9\r\nConnection: close\r\n\r\n",
]


def _one_shot(data: bytes, **kw) -> tuple[ResponseHead, int] | None:
    return read_head(bytearray(data), **kw)


def _dripped(data: bytes, cuts, **kw) -> tuple[ResponseHead, int] | None:
    """Fed in pieces ending at ``cuts``: the bytes received so far and how many an earlier call searched."""
    buf = bytearray(len(data) + 16)  # a receive buffer larger than what is in it, searched in place
    scanned = 0
    for end in [*cuts, len(data)]:
        buf[scanned:end] = data[scanned:end]
        got = read_head(buf, filled=end, scanned=scanned, **kw)
        if got is not None:
            return got
        scanned = end
    return None


# -- valid heads ------------------------------------------------------------------------------------

def test_the_valid_heads_read_as_written():
    h, n = _one_shot(VALID[0] + BODY)
    assert n == len(VALID[0]) and (h.version, h.status, h.reason) == ("1.1", 200, "OK")
    assert (h.content_length, h.chunked, h.content_range, h.keep_alive) == (31, False, None, True)
    assert h.headers["CONTENT-TYPE"] == h.headers.get("content-type") == "application/octet-stream"
    h, _ = _one_shot(VALID[1])
    assert h.content_range == ContentRange(100, 130, 131) and check_range(h, 100) == (100, 131)
    h, _ = _one_shot(VALID[2])
    assert (h.status, h.content_length, h.chunked) == (404, None, True)  # an error answer may be chunked
    h, _ = _one_shot(VALID[3])
    assert h.content_range is None and h.headers["Content-Range"] == "bytes */5"  # a 416's, for RangeError
    h, _ = _one_shot(VALID[4])
    assert (h.version, h.keep_alive) == ("1.0", True)
    h, _ = _one_shot(VALID[5])
    assert (h.status, h.reason, h.content_length, dict(h.headers)) == (204, "", None, {})
    h, _ = _one_shot(VALID[6])
    assert (h.status, h.reason, h.keep_alive) == (503, "", False)
    assert h.headers["retry-after"] == "7" and h.headers["x-a"] == "1, 2" and h.headers.getall("X-A") == ["1", "2"]
    assert h.headers["x-latin"] == "caf\xe9"
    assert h.headers.fields[:2] == (("retry-after", "7"), ("x-a", "1"))


@pytest.mark.parametrize("head", VALID)
def test_every_split_point_and_a_byte_at_a_time_give_the_same_head(head):
    data = head + BODY
    want = _one_shot(data)
    assert want is not None and want[1] == len(head)
    assert _dripped(data, range(1, len(data))) == want
    for cut in range(1, len(data)):
        assert _dripped(data, [cut]) == want, cut


@pytest.mark.parametrize("head", VALID)
def test_every_prefix_needs_more(head):
    for n in range(len(head)):
        assert _one_shot(head[:n]) is None, n
    assert _one_shot(head[:-1] + b"\r") is None  # a CR where the last LF goes: still no end


@pytest.mark.parametrize("head", VALID)
def test_every_bit_flip_is_a_head_more_or_the_one_error(head):
    data = head + BODY
    heads = 0
    for i in range(len(head)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            try:
                got = read_head(flipped)
            except HeadError:
                continue
            if got is None:
                continue
            h, n = got
            heads += 1
            assert 0 < n <= len(flipped) and flipped[n - 4:n] == b"\r\n\r\n"
            assert 100 <= h.status <= 599 and h.version in ("1.0", "1.1")
            assert h.content_length is None or h.content_length >= 0
            assert not (h.chunked and h.content_length is not None)
            if h.status in (200, 206):
                assert h.content_length is not None
            if h.status == 206:
                r = h.content_range
                assert r.first <= r.last < r.total and h.content_length == r.last - r.first + 1
    assert heads  # some flips only change a letter of a value


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.lists(st.integers(1, 600), max_size=8))
def test_garbage_any_chunking_is_the_same_as_one_shot(data, cuts):
    def outcome(f):
        try:
            return f()
        except HeadError:
            return "error"

    one = outcome(lambda: _one_shot(data))
    many = outcome(lambda: _dripped(data, sorted(c for c in set(cuts) if c < len(data))))
    assert one == many


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(VALID), st.integers(0, 400), st.binary(min_size=1, max_size=4))
def test_a_valid_head_with_bytes_spliced_in_is_a_head_more_or_the_error(head, at, junk):
    at = min(at, len(head))
    data = head[:at] + junk + head[at:]
    try:
        read_head(data)
    except HeadError:
        pass


# -- the rules --------------------------------------------------------------------------------------

REFUSED = {
    "repeated Content-Length": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", "Content-Length"),
    "conflicting Content-Length": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\ncontent-length: 3\r\n\r\n",
                                   "Content-Length"),
    "Content-Length list": (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n", "Content-Length"),
    "signed Content-Length": (b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n", "Content-Length"),
    "non-ASCII digits": ("HTTP/1.1 200 OK\r\nContent-Length: \u0665\r\n\r\n".encode("utf-8"), "Content-Length"),
    "huge Content-Length": (b"HTTP/1.1 200 OK\r\nContent-Length: 1234567890123456789\r\n\r\n", "Content-Length"),
    "chunked 200": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "chunked"),
    "chunked 206": (b"HTTP/1.1 206 OK\r\nTransfer-Encoding: chunked\r\nContent-Range: bytes 0-1/2\r\n\r\n", "chunked"),
    "no length on a 200": (b"HTTP/1.1 200 OK\r\nContent-Type: x\r\n\r\n", "no Content-Length"),
    "both framings": (b"HTTP/1.1 404 x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", "both"),
    "gzip coding": (b"HTTP/1.1 404 x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "Transfer-Encoding"),
    "repeated Transfer-Encoding": (b"HTTP/1.1 404 x\r\nTransfer-Encoding: chunked\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n", "Transfer-Encoding"),
    "obs-fold": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: a\r\n b\r\n\r\n", "obs-fold"),
    "space before colon": (b"HTTP/1.1 200 OK\r\nContent-Length : 5\r\n\r\n", "malformed header"),
    "no colon": (b"HTTP/1.1 200 OK\r\nContent-Length 5\r\n\r\n", "malformed header"),
    "empty name": (b"HTTP/1.1 200 OK\r\n: 5\r\n\r\n", "malformed header"),
    "NUL in a value": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: a\x00b\r\n\r\n", "control character"),
    "bare LF in a value": (b"HTTP/1.1 200 OK\r\nX-A: a\nContent-Length: 5\r\n\r\n", "control character"),
    "bare CR in a value": (b"HTTP/1.1 200 OK\r\nX-A: a\rContent-Length: 5\r\n\r\n", "control character"),
    "HTTP/2": (b"HTTP/2 200 OK\r\nContent-Length: 5\r\n\r\n", "status line"),
    "HTTP/1.2": (b"HTTP/1.2 200 OK\r\nContent-Length: 5\r\n\r\n", "status line"),
    "status 999": (b"HTTP/1.1 999 OK\r\nContent-Length: 5\r\n\r\n", "status line"),
    "two-digit status": (b"HTTP/1.1 20 OK\r\nContent-Length: 5\r\n\r\n", "status line"),
    "lower-case version": (b"http/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", "status line"),
    "leading empty line": (b"\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", "status line"),
    "not HTTP": (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "status line"),
    "206 without Content-Range": (b"HTTP/1.1 206 OK\r\nContent-Length: 5\r\n\r\n", "Content-Range"),
    "206 range past its total": (b"HTTP/1.1 206 OK\r\nContent-Length: 5\r\nContent-Range: bytes 0-4/4\r\n\r\n",
                                 "impossible"),
    "206 range backwards": (b"HTTP/1.1 206 OK\r\nContent-Length: 5\r\nContent-Range: bytes 4-0/9\r\n\r\n",
                            "impossible"),
    "206 unknown total": (b"HTTP/1.1 206 OK\r\nContent-Length: 5\r\nContent-Range: bytes 0-4/*\r\n\r\n",
                          "Content-Range"),
    "206 range and length disagree": (b"HTTP/1.1 206 OK\r\nContent-Length: 4\r\nContent-Range: bytes 0-4/9\r\n\r\n",
                                      "Content-Length 4"),
    "206 two ranges": (b"HTTP/1.1 206 OK\r\nContent-Length: 5\r\nContent-Range: bytes 0-4/9\r\n"
                       b"Content-Range: bytes 0-4/9\r\n\r\n", "Content-Range"),
}


@pytest.mark.parametrize("head,why", REFUSED.values(), ids=REFUSED.keys())
def test_hostile_heads_are_refused_with_their_reason(head, why):
    with pytest.raises(HeadError, match=why) as e:
        read_head(head + BODY, where="http://h:1/v1/blobs/x")
    assert str(e.value).startswith("http://h:1/v1/blobs/x: ")  # the source is named
    assert isinstance(e.value, UpstreamError) and e.value.code == "upstream"  # the source's fault: failed over
    with pytest.raises(HeadError, match=why):
        _dripped(head + BODY, range(1, len(head) + len(BODY)))


def test_framed_false_reads_chunked_or_to_the_close_200s():
    """plainhttp's small JSON answers may be chunked or read to the close; the other rules hold."""
    h, _ = read_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", framed=False)
    assert h.chunked and h.content_length is None
    h, _ = read_head(b"HTTP/1.1 200 OK\r\n\r\n", framed=False)
    assert not h.chunked and h.content_length is None
    with pytest.raises(HeadError, match="Content-Length"):
        read_head(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n", framed=False)


@pytest.mark.parametrize("status_line,connection,keep", [
    (b"HTTP/1.1 200 OK", None, True),
    (b"HTTP/1.1 200 OK", b"close", False),
    (b"HTTP/1.1 200 OK", b"Keep-Alive, Close", False),
    (b"HTTP/1.1 200 OK", b"keep-alive", True),
    (b"HTTP/1.0 200 OK", None, False),
    (b"HTTP/1.0 200 OK", b"Keep-Alive", True),
    (b"HTTP/1.0 200 OK", b"close", False),
])
def test_keep_alive(status_line, connection, keep):
    head = status_line + b"\r\nContent-Length: 0\r\n" + (b"Connection: " + connection + b"\r\n" if connection else b"")
    assert read_head(head + b"\r\n")[0].keep_alive is keep


@pytest.mark.parametrize("head,start,want", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", 0, (0, 9)),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", 5, (0, 9)),  # the Range was ignored: the whole from 0
    (b"HTTP/1.1 206 OK\r\nContent-Length: 4\r\nContent-Range: bytes 5-8/9\r\n\r\n", 5, (5, 9)),
    (b"HTTP/1.1 206 OK\r\nContent-Length: 4\r\nContent-Range: bytes 5-8/9\r\n\r\n", 4, "asked for bytes 4-"),
    (b"HTTP/1.1 206 OK\r\nContent-Length: 3\r\nContent-Range: bytes 5-7/9\r\n\r\n", 5, "asked for bytes 5-"),
    (b"HTTP/1.1 404 x\r\nContent-Length: 0\r\n\r\n", 0, "no body range"),
])
def test_check_range_against_the_request(head, start, want):
    h, _ = read_head(head)
    if isinstance(want, str):
        with pytest.raises(HeadError, match=want):
            check_range(h, start)
    else:
        assert check_range(h, start) == want


def test_the_head_size_and_field_count_are_capped():
    line = b"X-Pad: " + b"p" * 1000 + b"\r\n"
    big = b"HTTP/1.1 404 x\r\n" + line * 70 + b"\r\n"  # ~70 KiB
    assert len(big) > MAX_HEAD
    assert _one_shot(big[:MAX_HEAD - 1]) is None  # still under the cap: more, please
    with pytest.raises(HeadError, match="longer than"):
        _one_shot(big[:MAX_HEAD])
    with pytest.raises(HeadError, match="longer than"):
        _dripped(big, range(1000, len(big), 1000))
    small = b"HTTP/1.1 404 x\r\n" + line * 10 + b"\r\n"
    assert _one_shot(small, max_bytes=len(small))[1] == len(small)  # an end within the cap: read
    with pytest.raises(HeadError, match="longer than"):
        _one_shot(small, max_bytes=len(small) - 1)
    many = b"HTTP/1.1 404 x\r\n" + b"A: b\r\n" * 129 + b"\r\n"
    with pytest.raises(HeadError, match="129 header fields"):
        _one_shot(many)
    assert _one_shot(many, max_fields=129)[0].headers["a"].count("b") == 129


def test_hostile_heads_cost_linear_time():
    """A value of 60 KiB of blanks (what makes a backtracking field regex quadratic), and a 60 KiB head dripped
    a byte at a time (each call searches only the new bytes), are read in well under a second each."""
    blanks = b"HTTP/1.1 404 x\r\nX-A: a" + b" \t" * 30_000 + b"\x01\r\n\r\n"
    t = time.perf_counter()
    with pytest.raises(HeadError, match="control character"):
        read_head(blanks)
    assert time.perf_counter() - t < 0.5
    head = b"HTTP/1.1 404 x\r\nX-A: " + b"a" * 60_000 + b"\r\n\r\n"
    t = time.perf_counter()
    assert _dripped(head, range(1, len(head)))[0].headers["x-a"] == "a" * 60_000
    assert time.perf_counter() - t < 2.0


# -- the three callers, through real loopback servers --------------------------------------------------

TWO_LENGTHS = {
    "repeated": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    "conflicting": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 3\r\n\r\nhello",
}


async def _answering(answer: bytes):
    """A loopback server that reads one request head and sends ``answer``, then closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray(64)

    def buffer(self, offset: int) -> memoryview:
        return memoryview(self.data)[offset:]

    def received(self, offset: int, n: int) -> None:
        pass

    def restart(self) -> None:
        pass


@pytest.mark.parametrize("answer", TWO_LENGTHS.values(), ids=TWO_LENGTHS.keys())
async def test_blobrecv_refuses_two_content_lengths(answer):
    from deltasync.client import blobrecv

    server, url = await _answering(answer)
    try:
        with pytest.raises(HeadError, match="Content-Length") as e:
            await blobrecv.receive(url, "/v1/blobs/" + "a" * 32, _Sink(), 0, size=None, headers={}, connect=5, ttfb=5,
                                   read=5, total=10)
        assert url in str(e.value)
    finally:
        server.close()


@pytest.mark.parametrize("answer", [*TWO_LENGTHS.values(),
                                    b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-4/5\r\n"
                                    b"Content-Length: 5\r\n\r\nhello"],
                         ids=[*TWO_LENGTHS.keys(), "206 not from the offset asked"])
async def test_blobget_refuses_two_content_lengths_and_a_range_not_asked(answer):
    from deltasync.server.http.blobget import BlobGetter

    server, url = await _answering(answer)
    g = BlobGetter(connect_timeout=5, read_timeout=5, user_agent="test")
    try:
        with pytest.raises(HeadError, match="Content-Length|asked for bytes 3-") as e:
            await g.get(url, "a" * 32, 3, on_head=lambda resp: True, on_body=lambda piece: None)
        assert url in str(e.value)
    finally:
        g.close()
        server.close()


@pytest.mark.parametrize("answer", TWO_LENGTHS.values(), ids=TWO_LENGTHS.keys())
async def test_plainhttp_refuses_two_content_lengths(answer):
    from deltasync.client.httpbase import Timeouts
    from deltasync.client.plainhttp import PlainOrigin

    server, url = await _answering(answer)
    try:
        async with PlainOrigin(url, timeouts=Timeouts(connect=5, read=5, ttfb=5, request=10)) as p:
            with pytest.raises(UpstreamError, match="Content-Length") as e:
                await p.get_head("m")
            assert isinstance(e.value, DeltaSyncError) and url in str(e.value)
    finally:
        server.close()
