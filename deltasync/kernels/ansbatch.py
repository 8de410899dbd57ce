"""The encode side of format 2's ``ans`` chunks over many chunks per compiled call (numba, GIL released).

:mod:`deltasync.kernels.rans` codes one chunk a call (``word_symbols``, ``encode_chunk_pos``): on a state of
70k small tensors that is 140k calls and as many sets of small arrays. Here the chunks of a columnar diff
(:mod:`deltasync.columnar`: one positions / old / new array per word size, each chunk a ``[lo, hi)`` range of
them) go through in a few calls: :func:`word_symbols_chunks` writes every chunk's symbols into arrays laid
out like the positions, :func:`blob_cuts` places the blob boundaries, :func:`encode_chunks` codes a blob's
messages one after the other. The bytes are those of the per-chunk kernels (the same arithmetic, or a call
to them); ``tests/core/test_columnar.py`` checks it.
"""

from __future__ import annotations

import numba
import numpy as np

from .cache import load_cached_directly
from .rans import RAW, _recips, _step_symbol, bit_length, encode_chunk_into

_U = np.uint64


@numba.njit(cache=True, nogil=True)
def pair_address(o, n):
    """The addresses of two flat arrays' first elements (a compare job's old and new words), or (-1, -1) unless
    both are contiguous: one call a tensor of the columnar diff (two ``address`` calls and two ``flags`` looks
    cost twice as much)."""
    if (o.size > 1 and o.strides[0] != o.itemsize) or (n.size > 1 and n.strides[0] != n.itemsize):  # numpy's rule
        return np.int64(-1), np.int64(-1)
    return np.int64(o.ctypes.data), np.int64(n.ctypes.data)


@numba.njit(cache=True, nogil=True)
def word_symbols_chunks(pos, old, new, lo, hi, start, is_float, raw_limit, sym, bigneg, bigmag, raws, nb, nr):
    """:func:`rans.word_symbols` of chunks ``j`` = ``pos/old/new[lo[j]:hi[j]]`` (chunk start ``start[j]``, float
    dtype ``is_float[j]``), written in place: value symbols at the changes' own indices in ``sym``; a chunk's
    BIG signs / magnitudes and raw words at ``bigneg/bigmag/raws[lo[j]:lo[j] + nb[j]]`` (``nr[j]`` raw words).
    Returns the first chunk holding a zero step (equal old and new words: not a change), or -1. (A blob's symbol
    counts: :func:`chunk_histograms`, once its chunks are known.)"""
    bits = old.itemsize * 8
    top = _U(bits - 1)
    half = _U(1) << top
    mask = ~_U(0) if bits == 64 else (_U(1) << _U(bits)) - _U(1)
    lim = _U(raw_limit)
    bad = -1
    for j in range(lo.size):
        a0 = lo[j]
        b0 = hi[j]
        flt = is_float[j]
        k = a0  # next BIG entry
        r = a0  # next raw word
        for i in range(a0, b0):
            a = _U(old[i])
            b = _U(new[i])
            d = (b - a) & mask
            neg = d >= half
            mag = ((~d + _U(1)) & mask) if neg else d
            if mag > lim or (flt and ((a ^ b) >> top) & _U(1)):
                s = RAW
                raws[r] = new[i]
                r += 1
            elif mag == 0:
                if bad < 0:
                    bad = j
                s = 0
            else:
                s, k = _step_symbol(mag, neg, bigneg, bigmag, k)
            sym[i] = s
        nb[j] = k - a0
        nr[j] = r - a0
    return bad


@numba.njit(cache=True, nogil=True)
def chunk_histograms(pos, sym, lo, hi, start, g, v):
    """Adds to ``g`` the gap buckets and to ``v`` the value symbols of chunks ``j`` = ``pos/sym[lo[j]:hi[j]]``
    (chunk start ``start[j]``; ``sym`` from :func:`word_symbols_chunks`): a blob's counts, from which its models
    are made. Counted per blob, not kept per chunk (a row of 67 counts for each of 70k chunks was 19 MB of fresh
    pages a publish)."""
    for j in range(lo.size):
        prev = start[j] - 1
        for i in range(lo[j], hi[j]):
            p = pos[i]
            g[bit_length(_U(p - prev - 1))] += 1
            prev = p
            v[sym[i]] += 1


@numba.njit(cache=True, nogil=True)
def blob_cuts(keys, nbytes, cell_min, target):
    """The blob of each chunk, in packing order, as ``ChunkPacker`` closes them: before a chunk whose key (its
    tensor and row cell) differs from the previous chunk's once the open blob holds ``cell_min`` bytes, and
    after a chunk that brings it to ``target``. ``nbytes``: what each chunk adds to the blob's raw bytes."""
    out = np.empty(keys.size, np.int64)
    b = 0
    raw = 0
    pending = 0
    last = np.int64(-1)
    for j in range(keys.size):
        if keys[j] != last and pending and raw >= cell_min:
            b += 1
            raw = 0
            pending = 0
        last = keys[j]
        raw += nbytes[j]
        pending += 1
        out[j] = b
        if raw >= target:
            b += 1
            raw = 0
            pending = 0
    return out


@numba.njit(cache=True, nogil=True)
def encode_chunks(pos, lo, hi, start, nb, sym, bigneg, bigmag, gf, gc, vf, vc):
    """The rANS messages of chunks ``j`` (positions ``pos[lo[j]:hi[j]]``, starting at ``start[j]``, their symbols
    at the same indices of ``sym`` and their ``nb[j]`` BIG entries from ``lo[j]`` of ``bigneg/bigmag``) under one
    blob's tables, one after the other: (uint16 words, words of each message). Each message is
    :func:`rans.encode_chunk_pos`'s."""
    J = lo.size
    total = 0
    for j in range(J):
        total += hi[j] - lo[j]
    out = np.empty(3 * total + 4 * J + 64, np.uint16)
    na = np.empty(J, np.int64)
    gcm, grc = _recips(gf)  # the tables' reciprocals, once for every chunk
    vcm, vrc = _recips(vf)
    most = 0
    for j in range(J):
        most = max(most, hi[j] - lo[j])
    scratch = np.empty(14 * most + 64, np.uint16)  # each message coded backwards here, then copied out
    end = scratch.size
    at = 0
    for j in range(J):
        a = lo[j]
        b = hi[j]
        s = encode_chunk_into(scratch, end, pos[a:b], start[j], sym[a:b], bigneg[a : a + nb[j]],
                              bigmag[a : a + nb[j]], gf, gc, vf, vc, gcm, grc, vcm, vrc)
        size = end - s
        if at + size > out.size:
            grown = np.empty(max(2 * out.size, at + size + 64), np.uint16)
            grown[:at] = out[:at]
            out = grown
        out[at : at + size] = scratch[s:end]
        na[j] = size
        at += size
    return out[:at], na


@numba.njit(cache=True, nogil=True, inline="always")
def _put_uint(out, at, v):
    """The decimal digits of ``v`` (>= 0) at ``out[at:]``; -> the index past them."""
    n = 1
    x = v // 10
    while x > 0:
        n += 1
        x //= 10
    e = at + n
    x = v
    for i in range(n):
        out[e - 1 - i] = 48 + x % 10
        x //= 10
    return e


@numba.njit(cache=True, nogil=True, inline="always")
def _put_piece(out, at, src, a, b):
    for i in range(a, b):
        out[at] = src[i]
        at += 1
    return at


@numba.njit(cache=True, nogil=True)
def chunk_records(count, na, nr, start, stop, dense, tensor, names, name_at, dtype_of, dtypes, dtype_at, text, text_at):
    """A blob header's chunk records, as ``json.dumps(records, separators=(",", ":"), sort_keys=True)`` writes
    them (ASCII bytes): per chunk ``{"count":..,"dtype":..,"mode":"ans"|"dense","na":..,"nr":..,"start":..,
    "stop":..,"tensor":..}``. The numbers are non-negative; ``names`` / ``dtypes`` hold every tensor name / dtype
    name already JSON-quoted (``name_at`` / ``dtype_at``: offsets, ``dtype_of``: each tensor's dtype), ``text``
    the constant pieces between the fields (``text_at``: 10 offsets: ``{"count":``, ``,"dtype":``,
    ``,"mode":"ans","na":``, ``,"mode":"dense","na":``, ``,"nr":``, ``,"start":``, ``,"stop":``,
    ``,"tensor":``, ``}``)."""
    J = count.size
    size = 2 + J
    for j in range(J):
        t = tensor[j]
        d = dtype_of[t]
        size += (name_at[t + 1] - name_at[t]) + (dtype_at[d + 1] - dtype_at[d]) + (text_at[9] - text_at[0]) + 5 * 20
    out = np.empty(size, np.uint8)
    out[0] = 91  # [
    at = 1
    for j in range(J):
        if j:
            out[at] = 44  # ,
            at += 1
        t = tensor[j]
        d = dtype_of[t]
        at = _put_piece(out, at, text, text_at[0], text_at[1])
        at = _put_uint(out, at, count[j])
        at = _put_piece(out, at, text, text_at[1], text_at[2])
        at = _put_piece(out, at, dtypes, dtype_at[d], dtype_at[d + 1])
        if dense[j]:
            at = _put_piece(out, at, text, text_at[3], text_at[4])
        else:
            at = _put_piece(out, at, text, text_at[2], text_at[3])
        at = _put_uint(out, at, na[j])
        at = _put_piece(out, at, text, text_at[4], text_at[5])
        at = _put_uint(out, at, nr[j])
        at = _put_piece(out, at, text, text_at[5], text_at[6])
        at = _put_uint(out, at, start[j])
        at = _put_piece(out, at, text, text_at[6], text_at[7])
        at = _put_uint(out, at, stop[j])
        at = _put_piece(out, at, text, text_at[7], text_at[8])
        at = _put_piece(out, at, names, name_at[t], name_at[t + 1])
        at = _put_piece(out, at, text, text_at[8], text_at[9])
    out[at] = 93  # ]
    return out[: at + 1]


load_cached_directly(globals())  # the kernels above load their cached code directly
