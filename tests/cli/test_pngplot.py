"""The demo's PNG writer (cli/pngplot.py): a valid file (signature, IHDR, chunk CRCs, one zlib stream of
filter-0 scanlines) whose pixels are where the chart says."""

from __future__ import annotations

import struct
import zlib

import pytest

from deltasync.cli.pngplot import BLUE, WHITE, Canvas, Series, encode_png, line_chart


def _decode(png: bytes) -> tuple[int, int, bytes]:
    """A minimal reader for what encode_png writes: checks every chunk's CRC, returns width, height, RGB bytes."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos:pos + 4])
        kind, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", png[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + data) & 0xFFFFFFFF, kind
        chunks.append((kind, data))
        pos += 12 + n
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    w, h, depth, color, comp, filt, inter = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, comp, filt, inter) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == h * (1 + 3 * w)
    rows = [raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, b"".join(r[1:] for r in rows)


def _px(rgb: bytes, w: int, x: int, y: int) -> tuple[int, int, int]:
    i = 3 * (y * w + x)
    return tuple(rgb[i:i + 3])


def test_canvas_round_trips_through_png():
    c = Canvas(7, 5)
    c.line(0, 0, 6, 4, BLUE)
    w, h, rgb = _decode(c.png())
    assert (w, h) == (7, 5)
    assert _px(rgb, w, 0, 0) == BLUE and _px(rgb, w, 6, 4) == BLUE
    assert _px(rgb, w, 6, 0) == WHITE and _px(rgb, w, 0, 4) == WHITE


def test_line_chart_draws_the_series_where_the_axes_say():
    ys = [0.0, 0.5, 1.0]
    png = line_chart([Series(label="a", ys=ys, color=BLUE, width=1)], title="t", width=300, height=200)
    w, h, rgb = _decode(png)
    assert (w, h) == (300, 200)
    # the plot area: left 70, right w-20, top 40, bottom h-50; x = 0, 1, 2 -> 70, 175, 280; y -> 150, 95, 40
    for x, y in [(70, 150), (175, 95), (280, 40)]:
        assert _px(rgb, w, x, y) == BLUE, (x, y)
    assert _px(rgb, w, 175, 150) != BLUE  # below the line at the middle point


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="bytes of pixels"):
        encode_png(2, 2, b"\x00" * 5)
    with pytest.raises(ValueError, match="1..8192"):
        Canvas(0, 10)
    with pytest.raises(ValueError, match="ymax"):
        line_chart([], title="t", ymin=1.0, ymax=1.0)
