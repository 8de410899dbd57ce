"""Coding the set of changed word positions inside one chunk.

Two encodings (docs/FORMAT.md, "positions"):

* **gap**: sorted positions as gaps ``g_k = p_k - p_{k-1} - 1`` (``p_{-1} = -1``).
  Each gap below 255 is one byte of the ``gap`` stream; a larger gap writes 255
  there and ``g - 255`` as a varint to the ``gapx`` stream.
* **bitmap**: one bit per word of the chunk, least significant bit first.

Gap coding wins for sparse changes, the bitmap once more than about one word in
ten changes; :func:`choose_position_mode` picks.
"""

from __future__ import annotations

import numpy as np

from .errors import FormatError
from .varint import decode_varints, encode_varints

ESCAPE = 255
BITMAP_DENSITY = 0.1


def choose_position_mode(count: int, length: int) -> str:
    return "bitmap" if length and count > BITMAP_DENSITY * length else "gap"


def encode_gaps(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique int64 positions -> (gap bytes, gapx varint bytes)."""
    if positions.size == 0:
        return np.empty(0, np.uint8), np.empty(0, np.uint8)
    gaps = np.diff(positions, prepend=-1) - 1
    small = np.minimum(gaps, ESCAPE).astype(np.uint8)
    big = gaps[gaps >= ESCAPE] - ESCAPE
    return small, encode_varints(big)


def decode_gaps(small: np.ndarray, big: np.ndarray, count: int, length: int) -> np.ndarray:
    if small.size != count:
        raise FormatError(f"gap stream: expected {count} gaps, found {small.size}")
    gaps = small.astype(np.int64)
    esc = small == ESCAPE
    n_esc = int(esc.sum())
    if n_esc:
        big_gaps = decode_varints(big, n_esc)
        if big_gaps.max() >= np.uint64(max(length, 1)):
            raise FormatError(f"gap stream: a gap leaves the chunk of {length} words")
        gaps[esc] = big_gaps.astype(np.int64) + ESCAPE
    else:
        decode_varints(big, 0)
    # Every gap is < length + 255 now, so the sum fits int64 for any chunk we accept (< 2**48 words).
    positions = np.cumsum(gaps + 1) - 1
    if count and (positions[-1] >= length or positions[-1] < 0):
        raise FormatError(f"gap stream: position {positions[-1]} outside a chunk of {length} words")
    return positions


def encode_bitmap(positions: np.ndarray, length: int) -> np.ndarray:
    mask = np.zeros(length, dtype=np.bool_)
    mask[positions] = True
    return np.packbits(mask, bitorder="little")


def decode_bitmap(packed: np.ndarray, count: int, length: int) -> np.ndarray:
    if packed.size != (length + 7) // 8:
        raise FormatError(f"bitmap: expected {(length + 7) // 8} bytes for {length} words, found {packed.size}")
    bits = np.unpackbits(packed, bitorder="little")
    if bits[length:].any():
        raise FormatError("bitmap: bits set past the end of the chunk")
    positions = np.flatnonzero(bits[:length])
    if positions.size != count:
        raise FormatError(f"bitmap: expected {count} set bits, found {positions.size}")
    return positions
