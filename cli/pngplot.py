"""A line chart written as a PNG file with zlib alone (``make demo-rl``'s reward curve; no plotting library).

The canvas is RGB bytes; lines are drawn with Bresenham's algorithm, text with a 5x7 pixel font (upper case,
digits and a little punctuation), and the image is encoded as one IDAT stream of filter-0 scanlines
(PNG, RFC 2083: signature, IHDR, IDAT, IEND, each chunk with its CRC-32).

    png = line_chart([Series(label="deltasync", ys=rewards, color=BLUE)], title="REWARD", ymax=1.0)
    Path("rewards.png").write_bytes(png)
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

RGB = tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
BLACK: RGB = (0, 0, 0)
GREY: RGB = (215, 215, 215)
BLUE: RGB = (31, 119, 180)
ORANGE: RGB = (255, 127, 14)

# 5x7 glyphs, column-major: five column bytes, bit 0 the top row (the HD44780's font)
_FONT: dict[str, tuple[int, ...]] = {
    " ": (0, 0, 0, 0, 0), "0": (0x3E, 0x51, 0x49, 0x45, 0x3E), "1": (0x00, 0x42, 0x7F, 0x40, 0x00),
    "2": (0x42, 0x61, 0x51, 0x49, 0x46), "3": (0x21, 0x41, 0x45, 0x4B, 0x31), "4": (0x18, 0x14, 0x12, 0x7F, 0x10),
    "5": (0x27, 0x45, 0x45, 0x45, 0x39), "6": (0x3C, 0x4A, 0x49, 0x49, 0x30), "7": (0x01, 0x71, 0x09, 0x05, 0x03),
    "8": (0x36, 0x49, 0x49, 0x49, 0x36), "9": (0x06, 0x49, 0x49, 0x29, 0x1E), "A": (0x7E, 0x11, 0x11, 0x11, 0x7E),
    "B": (0x7F, 0x49, 0x49, 0x49, 0x36), "C": (0x3E, 0x41, 0x41, 0x41, 0x22), "D": (0x7F, 0x41, 0x41, 0x22, 0x1C),
    "E": (0x7F, 0x49, 0x49, 0x49, 0x41), "F": (0x7F, 0x09, 0x09, 0x01, 0x01), "G": (0x3E, 0x41, 0x41, 0x51, 0x32),
    "H": (0x7F, 0x08, 0x08, 0x08, 0x7F), "I": (0x00, 0x41, 0x7F, 0x41, 0x00), "J": (0x20, 0x40, 0x41, 0x3F, 0x01),
    "K": (0x7F, 0x08, 0x14, 0x22, 0x41), "L": (0x7F, 0x40, 0x40, 0x40, 0x40), "M": (0x7F, 0x02, 0x04, 0x02, 0x7F),
    "N": (0x7F, 0x04, 0x08, 0x10, 0x7F), "O": (0x3E, 0x41, 0x41, 0x41, 0x3E), "P": (0x7F, 0x09, 0x09, 0x09, 0x06),
    "Q": (0x3E, 0x41, 0x51, 0x21, 0x5E), "R": (0x7F, 0x09, 0x19, 0x29, 0x46), "S": (0x46, 0x49, 0x49, 0x49, 0x31),
    "T": (0x01, 0x01, 0x7F, 0x01, 0x01), "U": (0x3F, 0x40, 0x40, 0x40, 0x3F), "V": (0x1F, 0x20, 0x40, 0x20, 0x1F),
    "W": (0x7F, 0x20, 0x18, 0x20, 0x7F), "X": (0x63, 0x14, 0x08, 0x14, 0x63), "Y": (0x03, 0x04, 0x78, 0x04, 0x03),
    "Z": (0x61, 0x51, 0x49, 0x45, 0x43), ".": (0x00, 0x60, 0x60, 0x00, 0x00), "-": (0x08, 0x08, 0x08, 0x08, 0x08),
    ":": (0x00, 0x36, 0x36, 0x00, 0x00), "(": (0x00, 0x1C, 0x22, 0x41, 0x00), ")": (0x00, 0x41, 0x22, 0x1C, 0x00),
    "/": (0x20, 0x10, 0x08, 0x04, 0x02), "=": (0x14, 0x14, 0x14, 0x14, 0x14), "+": (0x08, 0x08, 0x3E, 0x08, 0x08),
    ",": (0x00, 0x50, 0x30, 0x00, 0x00), "%": (0x23, 0x13, 0x08, 0x64, 0x62), "_": (0x40, 0x40, 0x40, 0x40, 0x40),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Series:
    """One line: ``ys[i]`` at x = i; ``dashed`` draws every other 6-pixel stretch; ``width`` in pixels."""

    label: str
    ys: Sequence[float]
    color: RGB
    dashed: bool = False
    width: int = 2


class Canvas:
    """An RGB image in memory (row-major bytes, origin top left)."""

    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        if not (0 < width <= 8192 and 0 < height <= 8192):
            raise ValueError(f"canvas size {width}x{height}: each side must be 1..8192 pixels")
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: RGB) -> None:
        """Filled, corners inclusive."""
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: RGB, *, width: int = 1, dashed: bool = False,
             phase: int = 0) -> int:
        """Bresenham; returns the dash phase after the line (so a dashed polyline keeps its rhythm)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = width // 2
        while True:
            if not dashed or (phase // 6) % 2 == 0:
                self.rect(x0 - half, y0 - half, x0 - half + width - 1, y0 - half + width - 1, color)
            phase += 1
            if x0 == x1 and y0 == y1:
                return phase
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color: RGB = BLACK, *, scale: int = 2) -> int:
        """``s`` upper-cased, its top left at (x, y); returns the x after it. Unknown characters draw as '?'-less
        blanks."""
        for ch in s.upper():
            cols = _FONT.get(ch, _FONT[" "])
            for cx, bits in enumerate(cols):
                for cy in range(7):
                    if bits >> cy & 1:
                        self.rect(x + cx * scale, y + cy * scale, x + (cx + 1) * scale - 1, y + (cy + 1) * scale - 1,
                                  color)
            x += 6 * scale
        return x

    def png(self) -> bytes:
        return encode_png(self.width, self.height, bytes(self.pixels))


def text_width(s: str, scale: int = 2) -> int:
    return len(s) * 6 * scale - scale


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """8-bit RGB pixels (row-major, ``3 * width * height`` bytes) as a PNG file."""
    if len(rgb) != 3 * width * height:
        raise ValueError(f"{len(rgb)} bytes of pixels for a {width}x{height} RGB image (want {3 * width * height})")
    stride = 3 * width
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def line_chart(series: Sequence[Series], *, title: str, xlabel: str = "", ylabel: str = "", ymin: float = 0.0,
               ymax: float = 1.0, width: int = 720, height: int = 400) -> bytes:
    """The series on one pair of axes (x: the index, 0 .. longest - 1; y: ``ymin`` .. ``ymax``), a legend at the
    top left inside the plot, the title above it. Returns the PNG file's bytes."""
    if ymax <= ymin:
        raise ValueError(f"ymax {ymax} must be above ymin {ymin}")
    c = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 50
    n = max((len(s.ys) for s in series), default=0)
    xmax = max(n - 1, 1)

    def px(i: float) -> int:
        return round(left + (right - left) * i / xmax)

    def py(v: float) -> int:
        v = min(max(v, ymin), ymax)
        return round(bottom - (bottom - top) * (v - ymin) / (ymax - ymin))

    for v in _ticks(ymin, ymax):  # horizontal grid and y tick labels
        c.line(left, py(v), right, py(v), GREY)
        label = f"{v:.2f}"
        c.text(left - 8 - text_width(label), py(v) - 7, label)
    step = max(1, round(xmax / 8))
    for i in range(0, xmax + 1, step):  # x ticks
        c.line(px(i), bottom, px(i), bottom + 5, BLACK)
        c.text(px(i) - text_width(str(i)) // 2, bottom + 10, str(i))
    c.line(left, top, left, bottom, BLACK)
    c.line(left, bottom, right, bottom, BLACK)
    if ylabel:
        c.text(8, 12, ylabel)
    c.text(max((width - text_width(title)) // 2, 8 + (text_width(ylabel) + 24 if ylabel else 0)), 12, title)
    if xlabel:
        c.text((left + right - text_width(xlabel)) // 2, height - 20, xlabel)
    for s in series:
        phase = 0
        pts = [(px(i), py(v)) for i, v in enumerate(s.ys)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            phase = c.line(x0, y0, x1, y1, s.color, width=s.width, dashed=s.dashed, phase=phase)
        if len(pts) == 1:
            c.rect(pts[0][0] - 2, pts[0][1] - 2, pts[0][0] + 2, pts[0][1] + 2, s.color)
    ly = top + 8
    for s in series:  # legend
        c.line(left + 12, ly + 7, left + 42, ly + 7, s.color, width=s.width, dashed=s.dashed)
        c.text(left + 50, ly, s.label)
        ly += 22
    return c.png()


__all__ = ["BLACK", "BLUE", "Canvas", "GREY", "ORANGE", "Series", "WHITE", "encode_png", "line_chart", "text_width"]
