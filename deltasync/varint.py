"""Vectorized LEB128 varints (unsigned, little-endian groups of 7 bits), on numpy arrays."""

from __future__ import annotations

import numpy as np

from .errors import FormatError

MAX_BYTES = 10  # a uint64 needs at most 10 groups of 7 bits


def encode_varints(values: np.ndarray) -> np.ndarray:
    """uint64-compatible values -> uint8 array of concatenated varints."""
    v = np.asarray(values, dtype=np.uint64)
    if v.size == 0:
        return np.empty(0, dtype=np.uint8)
    n = np.ones(v.size, dtype=np.int64)
    t = v >> np.uint64(7)
    while t.any():
        n += t > 0
        t >>= np.uint64(7)
    ends = np.cumsum(n)
    starts = ends - n
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    for k in range(int(n.max())):
        sel = n > k
        group = ((v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        more = (n[sel] > k + 1).astype(np.uint8) << 7
        out[starts[sel] + k] = group | more
    return out


def decode_varints(data: np.ndarray, count: int) -> np.ndarray:
    """Exactly ``count`` varints filling ``data`` exactly -> uint64 array; else FormatError."""
    b = np.asarray(data, dtype=np.uint8)
    if count == 0:
        if b.size:
            raise FormatError(f"varint stream: expected no values, found {b.size} stray bytes")
        return np.empty(0, dtype=np.uint64)
    ends = np.flatnonzero(b < 0x80)
    if ends.size != count or ends[-1] != b.size - 1:
        raise FormatError(
            f"varint stream: expected {count} values in {b.size} bytes, "
            f"found {ends.size} terminators (truncated or corrupt)"
        )
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if lengths.max() > MAX_BYTES:
        raise FormatError("varint stream: a value is longer than 10 bytes")
    out = np.zeros(count, dtype=np.uint64)
    for k in range(int(lengths.max())):
        sel = lengths > k
        out[sel] |= (b[starts[sel] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return out
