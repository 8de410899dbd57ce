"""A static rANS entropy coder for the ``ans`` chunk mode (docs/FORMAT.md §4.3), compiled with numba.

State: 32 bits, lower bound ``L = 2**16``, renormalised 16 bits at a time. Each coded symbol has a
frequency ``f`` and start ``c`` out of ``2**p``: models use ``p = PREC = 12``; raw bits are coded
as a uniform symbol (``f = 1``, ``c = bits``, ``p = k`` for ``k <= 12`` bits at a time, low pieces
first). Encoding: ``while x >= ((L >> p) << 16) * f: emit(x & 0xffff); x >>= 16`` then
``x = (x // f << p) + x % f + c``. The encoder runs backwards over the message; the stream is
the final state (two 16-bit words, low first) followed by the emitted words in the order the
decoder reads them. The decoder starts from that state, and a valid stream ends with every word
read and the state back at ``L``.

One message per chunk (so chunks decode independently, on an executor's threads: the kernels
release the GIL). Per change, in order: the gap bucket ``b`` (model G: 0 for a gap of 0, else the
bit length of the gap), the ``b - 1`` bits of the gap below its top bit, then the value symbol
(model V: ``2*(|d|-1) + (d<0)`` for ``|d| <= SMALL``; ``BIG``: a sign bit, 7 bits of the bucket
``q`` of ``|d| - 1 - SMALL`` and its ``q - 1`` low bits; ``RAW``: the new word is the next word of
the chunk's raw stream).

Frequency tables (one G and one V per blob, shared by its chunks) come from counts by
:func:`normalize`; they are sent, not re-derived, so only the encoder's choice lives here.
"""

from __future__ import annotations

import numba
import numpy as np

PREC = 12
M = 1 << PREC
L = 1 << 16
SMALL = 8
BIG = 2 * SMALL
RAW = 2 * SMALL + 1
N_VAL = RAW + 1  # alphabet of model V
N_GAP = 49  # alphabet of model G: buckets 0..48 (gaps below 2**48)

# error codes of the kernels
OK, E_SHORT, E_SYMBOL, E_END, E_GAP = 0, 1, 2, 3, 4


def normalize(counts: np.ndarray) -> np.ndarray:
    """Counts -> frequencies summing to ``M``, every counted symbol at least 1 (deterministic)."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    freq = np.zeros(counts.size, dtype=np.int64)
    if total == 0:
        freq[0] = M
        return freq
    nz = counts > 0
    freq[nz] = np.maximum(1, counts[nz] * M // total)
    diff = M - int(freq.sum())
    order = np.argsort(-freq, kind="stable")
    i = 0
    while diff != 0:  # give the rounding error to the largest symbols, one at a time, never below 1
        s = order[i % int(nz.sum())]
        if diff > 0:
            freq[s] += 1
            diff -= 1
        elif freq[s] > 1:
            freq[s] -= 1
            diff += 1
        i += 1
    return freq


def tables(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(freq uint32, cumulative starts uint32, slot -> symbol lookup uint8) of a normalized model."""
    f = np.asarray(freq, dtype=np.uint32)
    cum = np.zeros(f.size + 1, dtype=np.uint32)
    np.cumsum(f, out=cum[1:])
    lut = np.repeat(np.arange(f.size, dtype=np.uint8), f)
    return f, cum, lut


@numba.njit(cache=True, nogil=True, inline="always")
def _bitlen(v):
    n = 0
    while v:
        n += 1
        v >>= np.uint64(1)
    return n


@numba.njit(cache=True, nogil=True, inline="always")
def _put(x, f, c, p, out, at):
    x_max = ((L >> p) << 16) * f
    while x >= x_max:
        at -= 1
        out[at] = x & 0xFFFF
        x >>= 16
    x = ((x // f) << p) + (x % f) + c
    return x, at


@numba.njit(cache=True, nogil=True, inline="always")
def _put_bits(x, v, k, out, at):
    # pieces of at most PREC bits; the decoder reads the low piece first, so encode the high piece first
    n = (k + PREC - 1) // PREC
    for j in range(n - 1, -1, -1):
        kk = min(PREC, k - j * PREC)
        piece = (v >> np.uint64(j * PREC)) & np.uint64((1 << kk) - 1)
        x, at = _put(x, 1, np.int64(piece), kk, out, at)
    return x, at


@numba.njit(cache=True, nogil=True)
def encode_chunk(gaps, vsym, bigneg, bigmag, gf, gc, vf, vc):
    """gaps int64[n], value symbols uint8[n], BIG signs/magnitudes (|d| - 1 - SMALL) in order -> uint16 words."""
    n = gaps.size
    out = np.empty(8 * n + 64, dtype=np.uint16)
    at = out.size
    x = np.int64(L)
    nb = bigmag.size
    for i in range(n - 1, -1, -1):
        s = vsym[i]
        if s == BIG:
            nb -= 1
            m = bigmag[nb]
            q = _bitlen(m)
            if q > 1:
                x, at = _put_bits(x, m, q - 1, out, at)
            x, at = _put_bits(x, np.uint64(q), 7, out, at)
            x, at = _put_bits(x, np.uint64(bigneg[nb]), 1, out, at)
        x, at = _put(x, np.int64(vf[s]), np.int64(vc[s]), PREC, out, at)
        g = np.uint64(gaps[i])
        b = _bitlen(g)
        if b > 1:
            x, at = _put_bits(x, g, b - 1, out, at)
        x, at = _put(x, np.int64(gf[b]), np.int64(gc[b]), PREC, out, at)
    at -= 2
    out[at] = x & 0xFFFF
    out[at + 1] = (x >> 16) & 0xFFFF
    return out[at:].copy()


@numba.njit(cache=True, nogil=True, inline="always")
def _get_bits(x, k, words, at):
    """Read k raw bits (any k <= 64, low pieces first) -> (x, at, value, ok)."""
    v = np.uint64(0)
    sh = 0
    while k > 0:
        kk = min(PREC, k)
        piece = x & ((1 << kk) - 1)
        x = x >> kk
        if x < L:
            if at >= words.size:
                return x, at, v, False
            x = (x << 16) | np.int64(words[at])
            at += 1
        v |= np.uint64(piece) << np.uint64(sh)
        sh += kk
        k -= kk
    return x, at, v, True


@numba.njit(cache=True, nogil=True, inline="always")
def _get_sym(x, f, c, lut, words, at):
    slot = x & (M - 1)
    s = np.int64(lut[slot])
    x = np.int64(f[s]) * (x >> PREC) + slot - np.int64(c[s])
    if x < L:
        if at >= words.size:
            return x, at, s, False
        x = (x << 16) | np.int64(words[at])
        at += 1
    return x, at, s, True


@numba.njit(cache=True, nogil=True)
def decode_chunk(words, count, length, gf, gc, glut, vf, vc, vlut):
    """-> (positions int64[count], value symbols uint8[count], BIG signs, BIG magnitudes (their first
    ``nbig`` entries), nbig, error code)."""
    pos = np.empty(count, dtype=np.int64)
    vsym = np.empty(count, dtype=np.uint8)
    bneg = np.empty(count, dtype=np.bool_)
    bmag = np.empty(count, dtype=np.uint64)
    kb = 0
    if words.size < 2:
        return pos, vsym, bneg, bmag, kb, E_SHORT
    x = np.int64(words[0]) | (np.int64(words[1]) << 16)
    at = 2
    p = np.int64(-1)
    for i in range(count):
        x, at, b, ok = _get_sym(x, gf, gc, glut, words, at)
        if not ok:
            return pos, vsym, bneg, bmag, kb, E_SHORT
        g = np.int64(0)
        if b >= 1:
            if b > 48:
                return pos, vsym, bneg, bmag, kb, E_GAP
            x, at, low, ok = _get_bits(x, b - 1, words, at)
            if not ok:
                return pos, vsym, bneg, bmag, kb, E_SHORT
            g = (np.int64(1) << (b - 1)) | np.int64(low)
        p = p + g + 1
        if p >= length:
            return pos, vsym, bneg, bmag, kb, E_GAP
        pos[i] = p
        x, at, s, ok = _get_sym(x, vf, vc, vlut, words, at)
        if not ok:
            return pos, vsym, bneg, bmag, kb, E_SHORT
        vsym[i] = s
        if s == BIG:
            x, at, sign, ok = _get_bits(x, 1, words, at)
            if not ok:
                return pos, vsym, bneg, bmag, kb, E_SHORT
            x, at, q, ok = _get_bits(x, 7, words, at)
            if not ok:
                return pos, vsym, bneg, bmag, kb, E_SHORT
            if q > 64:
                return pos, vsym, bneg, bmag, kb, E_SYMBOL
            m = np.uint64(0)
            if q >= 1:
                x, at, low, ok = _get_bits(x, np.int64(q) - 1, words, at)
                if not ok:
                    return pos, vsym, bneg, bmag, kb, E_SHORT
                m = (np.uint64(1) << np.uint64(q - 1)) | low
            bneg[kb] = sign == 1
            bmag[kb] = m
            kb += 1
    if at != words.size or x != L:
        return pos, vsym, bneg, bmag, kb, E_END
    return pos, vsym, bneg, bmag, kb, OK


@numba.njit(cache=True, nogil=True)
def encode_ops(freq, start, prec):
    """A message of arbitrary coded symbols (``freq``, ``start`` out of ``2**prec`` each, in decoding
    order) -> uint16 words; the general form of :func:`encode_chunk` (used to size other codings)."""
    out = np.empty(2 * freq.size + 64, dtype=np.uint16)
    at = out.size
    x = np.int64(L)
    for i in range(freq.size - 1, -1, -1):
        x, at = _put(x, np.int64(freq[i]), np.int64(start[i]), np.int64(prec[i]), out, at)
    at -= 2
    out[at] = x & 0xFFFF
    out[at + 1] = (x >> 16) & 0xFFFF
    return out[at:].copy()
