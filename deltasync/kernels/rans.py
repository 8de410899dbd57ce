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
(model V: ``2*(|d|-1) + (d<0)`` for ``|d| <= SMALL``; ``BIG``: 8 raw bits ``sign | q << 1`` with ``q``
the bit length of ``|d| - 1 - SMALL``, then its ``q - 1`` bits below the top bit; ``RAW``: the new word is the next word of
the chunk's raw stream).

Frequency tables (one G and one V per blob, shared by its chunks) come from counts by
:func:`normalize`; they are sent, not re-derived, so only the encoder's choice lives here.
"""

from __future__ import annotations

import numba
import numpy as np

from .cache import load_cached_directly
from .intrinsics import clz as _clz, mulhi as _mulhi

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
    order = np.argsort(-freq, kind="stable").tolist()
    counted = int(nz.sum())
    i = 0
    while diff != 0:  # give the rounding error to the largest symbols, one at a time, never below 1
        s = order[i % counted]
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


@numba.njit(cache=True, nogil=True)
def _bitlen(v):
    n = 0
    while v:
        n += 1
        v >>= np.uint64(1)
    return n


@numba.njit(cache=True, nogil=True)
def _put(x, f, c, p, out, at):
    x_max = ((L >> p) << 16) * f
    while x >= x_max:
        at -= 1
        out[at] = x & 0xFFFF
        x >>= 16
    x = ((x // f) << p) + (x % f) + c
    return x, at


@numba.njit(cache=True, nogil=True)
def _putbit_length(x, v, k, out, at):
    # pieces of at most PREC bits; the decoder reads the low piece first, so encode the high piece first
    n = (k + PREC - 1) // PREC
    for j in range(n - 1, -1, -1):
        kk = min(PREC, k - j * PREC)
        piece = (v >> np.uint64(j * PREC)) & np.uint64((1 << kk) - 1)
        x, at = _put(x, 1, np.int64(piece), kk, out, at)
    return x, at


@numba.njit(cache=True, nogil=True, inline="always")
def push_bits(of, oc, op, k, v, r):
    """Append to the ops ``(of, oc, op)`` from index ``k`` the ``r`` low bits of ``v`` (a uint64) as raw symbols
    (``f = 1``) of at most ``PREC`` bits, low piece first (the order the decoder reads them); -> the next index.
    The escape coding of a gap's low bits and of a BIG step's magnitude, for every encoder that gathers ops
    (:func:`encode_chunk`, :mod:`deltasync.conditioned`)."""
    while r > 0:
        kk = r if r < PREC else PREC
        of[k] = 1
        oc[k] = np.int64(v & np.uint64((1 << kk) - 1))
        op[k] = kk
        k += 1
        v >>= np.uint64(kk)
        r -= kk
    return k


@numba.njit(cache=True, nogil=True, inline="always")
def push_big(of, oc, op, k, m, neg):
    """Append a BIG step's escape: 8 raw bits ``neg | q << 1`` (``q`` the bit length of the magnitude ``m``, a
    uint64), then the ``q - 1`` bits of ``m`` below its top bit (:func:`push_bits`); -> the next index."""
    q = bit_length(m)
    of[k] = 1
    oc[k] = (q << 1) | (1 if neg else 0)
    op[k] = 8
    return push_bits(of, oc, op, k + 1, m, q - 1)


@numba.njit(cache=True, nogil=True)
def encode_chunk(gaps, vsym, bigneg, bigmag, gf, gc, vf, vc):
    """gaps int64[n], value symbols uint8[n], BIG signs/magnitudes (|d| - 1 - SMALL) in order -> uint16 words.

    Written out by hand like :func:`decode_chunk`; ops are gathered per change (at most 8: bucket,
    4 pieces of gap bits, value, BIG's 8 bits and its pieces are bounded by 1 + 1 + 6) and put in reverse."""
    n = gaps.size
    out = np.empty(14 * n + 64, dtype=np.uint16)
    at = out.size
    x = np.int64(L)
    nb = bigmag.size
    of = np.empty(16, dtype=np.int64)
    oc = np.empty(16, dtype=np.int64)
    op = np.empty(16, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        k = 0  # ops of change i, in decoding order
        g = gaps[i]
        b = bit_length(np.uint64(g))
        of[k] = gf[b]
        oc[k] = gc[b]
        op[k] = PREC
        k += 1
        k = push_bits(of, oc, op, k, np.uint64(g), b - 1)
        s = vsym[i]
        of[k] = vf[s]
        oc[k] = vc[s]
        op[k] = PREC
        k += 1
        if s == BIG:
            nb -= 1
            k = push_big(of, oc, op, k, bigmag[nb], bigneg[nb])
        for j in range(k - 1, -1, -1):
            f = of[j]
            x_max = ((L >> op[j]) << 16) * f
            if x >= x_max:
                at -= 1
                out[at] = x & 0xFFFF
                x >>= 16
            if f == 1:  # raw bits: no division
                x = (x << op[j]) + oc[j]
            else:
                x = ((x // f) << op[j]) + (x % f) + oc[j]
    at -= 2
    out[at] = x & 0xFFFF
    out[at + 1] = (x >> 16) & 0xFFFF
    return out[at:].copy()


@numba.njit(cache=True, nogil=True, inline="always")
def read_bits(x, at, words, nw, k):
    """Read ``k`` raw bits (pieces of at most ``PREC``, low piece first, renormalising after each) from the
    state ``x`` at word ``at`` of ``words`` (``nw`` of them; a read past the end feeds zeros, caught by the
    caller's final check); -> (the bits as a uint64, x, at). The decoding side of :func:`push_bits`, for every
    decoder that reads escapes (:func:`decode_chunk`, :mod:`deltasync.conditioned`)."""
    v = np.uint64(0)
    sh = 0
    while k > 0:
        kk = k if k < PREC else PREC
        v |= np.uint64(x & ((np.int64(1) << kk) - 1)) << np.uint64(sh)
        x >>= kk
        if x < L:
            x <<= 16
            if at < nw:
                x |= np.int64(words[at])
            at += 1
        sh += kk
        k -= kk
    return v, x, at


@numba.njit(cache=True, nogil=True)
def decode_chunk(words, count, length, gf, gc, glut, vf, vc, vlut):
    """-> (positions int64[count], value symbols uint8[count], BIG signs, BIG magnitudes (their first
    ``nbig`` entries), nbig, error code).

    Written out by hand (no helper calls: they cost 3x here). A read past the message's end feeds
    zeros and is caught by the final check, so the loop has no early exits but the position check."""
    pos = np.empty(count, dtype=np.int64)
    vsym = np.empty(count, dtype=np.uint8)
    bneg = np.empty(count, dtype=np.bool_)
    bmag = np.empty(count, dtype=np.uint64)
    kb = 0
    nw = words.size
    if nw < 2:
        return pos, vsym, bneg, bmag, kb, E_SHORT
    x = np.int64(words[0]) | (np.int64(words[1]) << 16)
    at = 2
    p = np.int64(-1)
    mask = np.int64(M - 1)
    for i in range(count):
        slot = x & mask
        b = np.int64(glut[slot])
        x = np.int64(gf[b]) * (x >> PREC) + slot - np.int64(gc[b])
        if x < L:
            x <<= 16
            if at < nw:
                x |= np.int64(words[at])
            at += 1
        g = np.int64(0)
        if b >= 1:
            bits, x, at = read_bits(x, at, words, nw, b - 1)
            g = np.int64(bits) | (np.int64(1) << (b - 1))
        p += g + 1
        if p >= length or b > 48:
            return pos, vsym, bneg, bmag, kb, E_GAP
        pos[i] = p
        slot = x & mask
        s = np.int64(vlut[slot])
        x = np.int64(vf[s]) * (x >> PREC) + slot - np.int64(vc[s])
        if x < L:
            x <<= 16
            if at < nw:
                x |= np.int64(words[at])
            at += 1
        vsym[i] = s
        if s == BIG:
            # 1 sign bit, then 7 bits of q: 8 raw bits in one piece (low bit first = the sign)
            v8 = x & 0xFF
            x >>= 8
            if x < L:
                x <<= 16
                if at < nw:
                    x |= np.int64(words[at])
                at += 1
            sign = v8 & 1
            q = v8 >> 1
            if q > 64:
                return pos, vsym, bneg, bmag, kb, E_SYMBOL
            m = np.uint64(0)
            if q >= 1:
                m, x, at = read_bits(x, at, words, nw, q - 1)
                m |= np.uint64(1) << np.uint64(q - 1)
            bneg[kb] = sign == 1
            bmag[kb] = m
            kb += 1
    if at > nw:
        return pos, vsym, bneg, bmag, kb, E_SHORT
    if at != nw or x != L:
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


# -- K: the encode side in whole-chunk kernels ------------------------------------------------------
# Same bytes as values.step_symbols + entropy._buckets + np.bincount + encode_chunk (tests/core/test_kernels_encode.py
# checks it): one pass per chunk for the symbols and the model counts, one pass for the message. Written out by
# hand, like decode_chunk: inlined helper calls returning tuples cost ~3x here.

_U = np.uint64


@numba.njit(cache=True, nogil=True, inline="always")
def bit_length(v):
    """Bit length of a uint64 (0 for 0)."""
    return np.int64(64 - _clz(v)) if v else 0


@numba.njit(cache=True, nogil=True, inline="always")
def _symbol_buffers(n, dtype):
    """A chunk's symbol outputs for ``n`` changes: value symbols, BIG signs and magnitudes, raw words (of the chunk's
    word type, like ``dtype``), and its gap-bucket and symbol counts."""
    return (np.empty(n, np.uint8), np.empty(n, np.bool_), np.empty(n, np.uint64), np.empty(n, dtype.dtype),
            np.zeros(N_GAP, np.int64), np.zeros(N_VAL, np.int64))


@numba.njit(cache=True, nogil=True, inline="always")
def _step_symbol(mag, neg, bigneg, bigmag, nb):
    """The value symbol of a step of magnitude ``mag`` (> 0) and sign ``neg``; a BIG one's sign and ``|d| - 1 -
    SMALL`` go to ``bigneg``/``bigmag`` at ``nb``. -> (symbol, the next nb)."""
    if mag <= _U(SMALL):
        return np.int64(mag + mag - _U(2)) + (1 if neg else 0), nb
    bigneg[nb] = neg
    bigmag[nb] = mag - _U(1 + SMALL)
    return BIG, nb + 1


@numba.njit(cache=True, nogil=True, inline="always")
def _symbols_done(sym, bigneg, bigmag, raws, gl, vl, nb, nr, zero, gcount, vcount):
    """Add a coded chunk's counts to the blob's (not when a zero step was found) and trim its outputs."""
    if not zero:  # counted only when the chunk is coded
        for j in range(N_GAP):
            gcount[j] += gl[j]
        for j in range(N_VAL):
            vcount[j] += vl[j]
    return sym, bigneg[:nb].copy(), bigmag[:nb].copy(), raws[:nr].copy(), zero


@numba.njit(cache=True, nogil=True)
def chunk_symbols(positions, start, raw, values, gcount, vcount):
    """One chunk's changes -> (value symbols uint8, BIG signs, BIG magnitudes ``|d| - 1 - SMALL``, raw words,
    zero step found?), as ``values.step_symbols``; adds each gap's bucket (positions sorted, relative to
    ``start``) to ``gcount`` and each symbol to ``vcount`` (unless a zero step was found). ``raw``/``values``: a :class:`Changes`' arrays."""
    n = values.size
    bits = values.itemsize * 8
    half = _U(1) << _U(bits - 1)
    mask = ~_U(0) if bits == 64 else (_U(1) << _U(bits)) - _U(1)
    sym, bigneg, bigmag, raws, gl, vl = _symbol_buffers(n, values)
    nb = 0
    nr = 0
    zero = False
    prev = start - 1
    for i in range(n):
        p = positions[i]
        gl[bit_length(_U(p - prev - 1))] += 1
        prev = p
        if raw[i]:
            s = RAW
            raws[nr] = values[i]
            nr += 1
        else:
            v = _U(values[i])
            neg = v >= half
            mag = ((~v + _U(1)) & mask) if neg else v
            if mag == 0:
                zero = True
                s = 0
            else:
                s, nb = _step_symbol(mag, neg, bigneg, bigmag, nb)
        sym[i] = s
        vl[s] += 1
    return _symbols_done(sym, bigneg, bigmag, raws, gl, vl, nb, nr, zero, gcount, vcount)


@numba.njit(cache=True, nogil=True)
def word_symbols(positions, start, old, new, raw_limit, is_float, gcount, vcount):
    """:func:`chunk_symbols` straight from the changed words (``values.changes_from_words``'s step-or-raw
    choice fused in), same outputs; a word equal in ``old`` and ``new`` is a zero step (flagged)."""
    n = old.size
    bits = old.itemsize * 8
    top = _U(bits - 1)
    half = _U(1) << top
    mask = ~_U(0) if bits == 64 else (_U(1) << _U(bits)) - _U(1)
    lim = _U(raw_limit)
    sym, bigneg, bigmag, raws, gl, vl = _symbol_buffers(n, old)
    nb = 0
    nr = 0
    zero = False
    prev = start - 1
    for i in range(n):
        p = positions[i]
        gl[bit_length(_U(p - prev - 1))] += 1
        prev = p
        a = _U(old[i])
        b = _U(new[i])
        d = (b - a) & mask
        neg = d >= half
        mag = ((~d + _U(1)) & mask) if neg else d
        if mag > lim or (is_float and ((a ^ b) >> top) & _U(1)):
            s = RAW
            raws[nr] = new[i]
            nr += 1
        elif mag == 0:
            zero = True
            s = 0
        else:
            s, nb = _step_symbol(mag, neg, bigneg, bigmag, nb)
        sym[i] = s
        vl[s] += 1
    return _symbols_done(sym, bigneg, bigmag, raws, gl, vl, nb, nr, zero, gcount, vcount)


@numba.njit(cache=True, nogil=True)
def _recips(freq):
    """Per symbol (M - f, ceil(2**64 / f)): for f >= 2 and every x < 2**52, ``x // f == mulhi(x, r)``
    (x * r / 2**64 = x / f + x * e / (f * 2**64) with e = r * f - 2**64 < f, and x * e < 2**64).
    The coder's state stays below 2**32. Symbols with f < 2 are coded by a shift instead."""
    cm = np.empty(freq.size, np.uint64)
    rc = np.zeros(freq.size, np.uint64)
    for s in range(freq.size):
        f = _U(freq[s])
        cm[s] = _U(M) - f
        if f >= _U(2):
            rc[s] = ~_U(0) // f + _U(1)
    return cm, rc


@numba.njit(cache=True, nogil=True)
def encode_chunk_pos(positions, start, vsym, bigneg, bigmag, gf, gc, vf, vc):
    """:func:`encode_chunk` from the sorted positions (gaps taken on the fly), the same words
    (:func:`encode_chunk_into` in a buffer of its own).

    The renormalisations of the gap bucket, the gap's low bits and the value symbol are branch-free (whether a
    word is emitted is a coin toss the branch predictor loses): the state's low word is stored at ``at - 1``
    every time and ``at`` moves only when it is emitted, so a word not emitted is overwritten by the next one
    emitted or by the final state (``at`` never moves up): ~15% fewer ns per change."""
    gcm, grc = _recips(gf)
    vcm, vrc = _recips(vf)
    out = np.empty(14 * positions.size + 64, dtype=np.uint16)
    at = encode_chunk_into(out, out.size, positions, start, vsym, bigneg, bigmag, gf, gc, vf, vc, gcm, grc, vcm, vrc)
    return out[at:].copy()


@numba.njit(cache=True, nogil=True, inline="always")
def encode_chunk_into(out, end, positions, start, vsym, bigneg, bigmag, gf, gc, vf, vc, gcm, grc, vcm, vrc):
    """:func:`encode_chunk_pos`'s message written backwards into ``out`` (at least ``14 * n + 64`` words before
    ``end``), ending at ``end``, with the tables' reciprocals (:func:`_recips` of ``gf`` and ``vf``) made by the
    caller; returns where it starts. A caller coding many chunks under one blob's tables
    (``ansbatch.encode_chunks``: ~70,000 at 70,000 tensors) makes the reciprocals once and reuses one buffer."""
    n = positions.size
    at = end
    x = _U(L)
    nb = bigmag.size
    for i in range(n - 1, -1, -1):
        s = vsym[i]
        if s == BIG:  # last in decoding order: the magnitude's low bits, then the 8-bit sign | q << 1
            nb -= 1
            m = bigmag[nb]
            q = bit_length(m)
            r = q - 1
            if r > 0:
                for j in range((r + PREC - 1) // PREC - 1, -1, -1):
                    kk = min(PREC, r - j * PREC)
                    piece = (m >> _U(j * PREC)) & ((_U(1) << _U(kk)) - _U(1))
                    if x >= (_U(1) << _U(32 - kk)):
                        at -= 1
                        out[at] = np.uint16(x & _U(0xFFFF))
                        x >>= _U(16)
                    x = (x << _U(kk)) + piece
            if x >= (_U(1) << _U(24)):
                at -= 1
                out[at] = np.uint16(x & _U(0xFFFF))
                x >>= _U(16)
            x = (x << _U(8)) + _U((q << 1) | (1 if bigneg[nb] else 0))
        f = _U(vf[s])
        out[at - 1] = np.uint16(x & _U(0xFFFF))  # renormalise branch-free (see the docstring)
        e = x >= (f << _U(20))  # ((L >> PREC) << 16) * f
        at -= 1 if e else 0
        x = (x >> _U(16)) if e else x
        if f == _U(1):
            x = (x << _U(PREC)) + _U(vc[s])
        else:  # (x // f << PREC) + x % f + c, with x // f by reciprocal
            x = x + _U(vc[s]) + _mulhi(x, vrc[s]) * vcm[s]
        g = positions[i] - (positions[i - 1] if i > 0 else start - 1) - 1
        ug = _U(g)
        b = bit_length(ug)
        r = b - 1
        if r > 0:
            for j in range((r + PREC - 1) // PREC - 1, -1, -1):
                kk = min(PREC, r - j * PREC)
                piece = (ug >> _U(j * PREC)) & ((_U(1) << _U(kk)) - _U(1))
                out[at - 1] = np.uint16(x & _U(0xFFFF))
                e = x >= (_U(1) << _U(32 - kk))
                at -= 1 if e else 0
                x = (x >> _U(16)) if e else x
                x = (x << _U(kk)) + piece
        f = _U(gf[b])
        out[at - 1] = np.uint16(x & _U(0xFFFF))
        e = x >= (f << _U(20))
        at -= 1 if e else 0
        x = (x >> _U(16)) if e else x
        if f == _U(1):
            x = (x << _U(PREC)) + _U(gc[b])
        else:
            x = x + _U(gc[b]) + _mulhi(x, grc[b]) * gcm[b]
    at -= 2
    out[at] = np.uint16(x & _U(0xFFFF))
    out[at + 1] = np.uint16((x >> _U(16)) & _U(0xFFFF))
    return at


load_cached_directly(globals())  # the kernels above load their cached code directly
