"""Compiled CPU kernels (numba) for the codec's hot loops.

Every function here gives the same bytes, the same words and the same fingerprints as the
numpy/torch reference (``deltasync.positions``, ``deltasync.values``, ``deltasync.fingerprint``,
``deltasync.codec.diff_chunk``), bit for bit; ``tests/core/test_core_kernels.py`` and
``tests/core/test_kernels_encode.py`` (the whole-span kernels of the K section) check it.
Each kernel does O(1) compiled work per changed word plus, for the compare and the
fingerprint, one streaming pass over the words. All kernels are ``nogil``: a caller's
``ThreadPoolExecutor`` runs chunks in parallel (the core starts no thread of its own).

Arrays are numpy arrays of *unsigned* words (``uint8/16/32/64``); positions are int64.
Decoders validate like the reference and raise :class:`~deltasync.errors.FormatError`.

Compiled code is cached on disk (``cache=True``, numba's ``__pycache__`` next to this file, or
``NUMBA_CACHE_DIR``); where no cache directory is writeable the kernels compile in memory at
first use (about a second per kernel and word width) instead.
"""

from __future__ import annotations

import warnings

import numpy as np
from llvmlite import ir
from numba import carray, njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from .intrinsics import cttz as _cttz
from . import rans as _rans  # the rANS coding's constants, frozen into the kernels below


def _jit(fn):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # no writeable cache location: compile in memory
        return njit(nogil=True)(fn)


_U1 = np.uint64(1)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SEED_B = np.uint64(0xBB67AE8584CAA73B)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S16 = np.uint64(16)
_LO16 = np.uint64(0xFFFF)
_LO8 = np.uint64(0xFF)
_LO7 = np.uint64(0x7F)
_S7 = np.uint64(7)


@njit(nogil=True, cache=True, inline="always")
def _block_key(b):
    """O(b) of FORMAT §2 for a non-negative int64 block number (splitmix64 of b ^ seed, odd)."""
    z = (np.uint64(b) ^ _SEED_B) + _GOLD
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return (z ^ (z >> _S31)) | _U1


# -- fingerprints -------------------------------------------------------------------------------

@_jit
def lanes_sum(lanes, offset, table):
    """sum_i lane_i * K(offset + i) mod 2**64 over unsigned uint8/uint16 lanes (as uint64)."""
    n = lanes.size
    total = np.uint64(0)
    i = 0
    while i < n:
        idx = offset + i
        j0 = idx & 0xFFFF
        m = min(n - i, 65536 - j0)
        s = np.uint64(0)
        ui = np.uint64(i)  # unsigned indices: no negative-index wraparound test (keeps it vectorized)
        uj = np.uint64(j0)
        for j in range(m):
            uj_ = np.uint64(j)
            s += np.uint64(lanes[ui + uj_]) * table[uj + uj_]
        total += s * _block_key(idx >> 16)
        i += m
    return total


@_jit
def copy_lanes_sum(dst, src, offset, table):
    """``dst[:] = src`` and sum_i lane_i * K(offset + i) mod 2**64 of the lanes written, in one pass
    (unsigned uint8/uint16 lanes of equal size): a keyframe copied and fingerprinted without a second
    read of either side."""
    n = src.size
    total = np.uint64(0)
    i = 0
    while i < n:
        idx = offset + i
        j0 = idx & 0xFFFF
        m = min(n - i, 65536 - j0)
        s = np.uint64(0)
        ui = np.uint64(i)
        uj = np.uint64(j0)
        for j in range(m):
            uj_ = np.uint64(j)
            v = src[ui + uj_]
            dst[ui + uj_] = v
            s += np.uint64(v) * table[uj + uj_]
        total += s * _block_key(idx >> 16)
        i += m
    return total


@njit(nogil=True, cache=True, inline="always")
def _word_delta(p, a, b, per, table, lb, lk):
    """Fingerprint change of word p going from a to b (uint64). (lb, lk): the last block and its
    key, carried in registers by the caller; returns (change, lb, lk)."""
    d = np.uint64(0)
    if per == 0:  # one-byte words: one 8-bit lane per word
        blk = p >> 16
        if blk != lb:
            lb = blk
            lk = _block_key(blk)
        d += ((b & _LO8) - (a & _LO8)) * table[p & 0xFFFF] * lk
        return d, lb, lk
    for q in range(per):
        idx = p * per + q
        blk = idx >> 16
        if blk != lb:
            lb = blk
            lk = _block_key(blk)
        sh = np.uint64(16 * q)
        d += (((b >> sh) & _LO16) - ((a >> sh) & _LO16)) * table[idx & 0xFFFF] * lk
    return d, lb, lk


@_jit
def fingerprint_delta(positions, old, new, per, table):
    """Change of a tensor's fingerprint when words at ``positions`` go from old to new.
    ``per``: 16-bit lanes per word (0 for one-byte words)."""
    lb = np.int64(-1)
    lk = np.uint64(0)
    d = np.uint64(0)
    for k in range(positions.size):
        dd, lb, lk = _word_delta(positions[k], np.uint64(old[k]), np.uint64(new[k]), per, table, lb, lk)
        d += dd
    return d


# -- compare and compaction ----------------------------------------------------------------------

@_jit
def compare_words(o, n, out, first):
    """Indices ``i >= first`` where ``o[i] != n[i]``, written into ``out``; returns (how many,
    where to resume: ``o.size`` when done). Stops early when ``out`` could overflow, so a small
    reused buffer serves any density. Each block of 64 words is compared into a 64-bit mask (a
    vectorized pass); only its set bits cost more. ``first`` is a multiple of 64 (or o.size)."""
    length = o.size
    k = 0
    nfull = length // 64
    blk = first // 64
    while blk < nfull:
        room = (out.size - k) // 64  # blocks that fit whatever they hold: no check in the hot loop
        if room == 0:
            return k, blk * 64
        stop = min(nfull, blk + room)
        for b in range(blk, stop):
            b0 = b * 64
            u0 = np.uint64(b0)  # unsigned indices: no negative-index wraparound test in the hot loop
            m = np.uint64(0)
            for j in range(64):
                u = u0 + np.uint64(j)
                m |= np.uint64(o[u] != n[u]) << np.uint64(j)
            while m:
                out[k] = b0 + np.int64(_cttz(m))
                m &= m - _U1
                k += 1
        blk = stop
    if out.size - k < 64:
        return k, nfull * 64
    for i in range(max(nfull * 64, first), length):
        if o[i] != n[i]:
            out[k] = i
            k += 1
    return k, length


@_jit
def gather_changes(o, n, rel, start, per, table):
    """(absolute positions, old words, new words, fingerprint change) at indices ``rel``."""
    count = rel.size
    pos = np.empty(count, np.int64)
    ow = np.empty(count, o.dtype)
    nw = np.empty(count, o.dtype)
    lb = np.int64(-1)
    lk = np.uint64(0)
    fpd = np.uint64(0)
    for k in range(count):
        i = rel[k]
        a = o[i]
        b = n[i]
        p = start + i
        pos[k] = p
        ow[k] = a
        nw[k] = b
        dd, lb, lk = _word_delta(p, np.uint64(a), np.uint64(b), per, table, lb, lk)
        fpd += dd
    return pos, ow, nw, fpd


# -- values (today's step/raw token coding, docs/FORMAT.md "values") -----------------------------

@_jit
def changes_from_words(old, new, raw_limit, is_float):
    """Step or raw for each change: (raw bool, values) exactly as ``values.changes_from_words``."""
    count = old.size
    bits = old.itemsize * 8
    raw = np.empty(count, np.bool_)
    values = np.empty(count, old.dtype)
    top = np.uint64(bits - 1)
    half = np.uint64(1) << top
    mask = ~np.uint64(0) if bits == 64 else (np.uint64(1) << np.uint64(bits)) - _U1
    lim = np.uint64(raw_limit)
    for k in range(count):
        a = np.uint64(old[k])
        b = np.uint64(new[k])
        d = (b - a) & mask
        mag = ((~d + _U1) & mask) if d >= half else d
        r = mag > lim
        if is_float and ((a ^ b) >> top) & _U1:
            r = True
        raw[k] = r
        if r:
            values[k] = new[k]
        else:
            values[k] = d
    return raw, values


@_jit
def _varint_len(v):
    n = 1
    v >>= _S7
    while v:
        n += 1
        v >>= _S7
    return n


@_jit
def encode_values(raw, values):
    """(packed 2-bit symbols, tokens, ext varint bytes, raw words), as ``values.encode_values``.
    Returns an error flag instead of raising on a zero step."""
    count = values.size
    bits = values.itemsize * 8
    mask = ~np.uint64(0) if bits == 64 else (np.uint64(1) << np.uint64(bits)) - _U1
    half = np.uint64(1) << np.uint64(bits - 1)
    packed = np.zeros((count + 3) // 4, np.uint8)
    n_tok = 0
    n_raw = 0
    ext_bytes = 0
    for k in range(count):
        v = np.uint64(values[k])
        if raw[k]:
            s = 2
            n_raw += 1
        else:
            t = (v + _U1) & mask
            s = 0 if t == 2 else (2 if t > 2 else 1)
        if s == 2:
            n_tok += 1
            if not raw[k]:
                mag = ((~v + _U1) & mask) if v >= half else v
                if mag >= np.uint64(127):
                    ext_bytes += _varint_len(mag - np.uint64(127))
        packed[k >> 2] |= np.uint8(s << (2 * (k & 3)))
    tokens = np.empty(n_tok, np.uint8)
    ext = np.empty(ext_bytes, np.uint8)
    raw_words = np.empty(n_raw, values.dtype)
    err = False
    it = 0
    ir = 0
    ie = 0
    for k in range(count):
        if (packed[k >> 2] >> np.uint8(2 * (k & 3))) & np.uint8(3) != 2:
            continue
        if raw[k]:
            tokens[it] = 254
            raw_words[ir] = values[k]
            ir += 1
        else:
            v = np.uint64(values[k])
            neg = v >= half
            mag = ((~v + _U1) & mask) if neg else v
            if mag == 0:
                err = True
                mag = _U1
            m = mag - _U1
            if m < np.uint64(126):
                tokens[it] = np.uint8(m + m + np.uint64(1 if neg else 0))
            else:
                tokens[it] = 253 if neg else 252
                x = m - np.uint64(126)
                while x >= np.uint64(0x80):
                    ext[ie] = np.uint8((x & _LO7) | np.uint64(0x80))
                    ie += 1
                    x >>= _S7
                ext[ie] = np.uint8(x)
                ie += 1
        it += 1
    return packed, tokens, ext, raw_words, err


# decode_values error codes -> messages (the wrapper in kernels/__init__ raises FormatError)
E_OK, E_SYMBYTES, E_PADDING, E_SYM3, E_NTOK, E_TOKRES, E_NRAW, E_VARINT, E_VARLONG, E_STEPBIG = range(10)


@_jit
def _decode_varints(data, count, out):
    """Exactly ``count`` LEB128 varints filling ``data``; 0 on success, else an error code."""
    nb = data.size
    if count == 0:
        return E_OK if nb == 0 else E_VARINT
    k = 0
    i = 0
    while i < nb:
        v = np.uint64(0)
        sh = 0
        ln = 0
        while True:
            if i >= nb:
                return E_VARINT
            b = data[i]
            i += 1
            ln += 1
            if ln <= 10:
                v |= (np.uint64(b) & _LO7) << np.uint64(sh)
            sh += 7
            if b < 0x80:
                break
        if ln > 10:
            return E_VARLONG
        if k >= count:
            return E_VARINT
        out[k] = v
        k += 1
    return E_OK if k == count else E_VARINT


@_jit
def decode_values(packed, tokens, ext, raw_words, count, bits):
    """Inverse of :func:`encode_values` with the reference's checks: (raw, values, error code, detail)."""
    mask = ~np.uint64(0) if bits == 64 else (np.uint64(1) << np.uint64(bits)) - _U1
    raw = np.zeros(count, np.bool_)
    values = np.empty(count, raw_words.dtype)
    if packed.size != (count + 3) // 4:
        return raw, values, E_SYMBYTES, packed.size
    for k in range(count, packed.size * 4):
        if (packed[k >> 2] >> np.uint8(2 * (k & 3))) & np.uint8(3):
            return raw, values, E_PADDING, 0
    n_other = 0
    for k in range(count):
        s = (packed[k >> 2] >> np.uint8(2 * (k & 3))) & np.uint8(3)
        if s == 3:
            return raw, values, E_SYM3, 0
        if s == 2:
            n_other += 1
    if tokens.size != n_other:
        return raw, values, E_NTOK, n_other
    n_raw = 0
    n_big = 0
    for t in tokens:
        if t > 254:
            return raw, values, E_TOKRES, t
        if t == 254:
            n_raw += 1
        elif t >= 252:
            n_big += 1
    if n_raw != raw_words.size:
        return raw, values, E_NRAW, n_raw
    big = np.empty(n_big, np.uint64)
    e = _decode_varints(ext, n_big, big)
    if e != E_OK:
        return raw, values, e, n_big
    limit = (np.uint64(1) << np.uint64(bits - 1)) if bits < 64 else np.uint64((1 << 63) - 127)
    for x in big:
        if (bits < 64 and x >= limit) or (bits == 64 and x > limit):
            return raw, values, E_STEPBIG, 0
    it = 0
    ir = 0
    ib = 0
    for k in range(count):
        s = (packed[k >> 2] >> np.uint8(2 * (k & 3))) & np.uint8(3)
        if s == 0:
            values[k] = 1
        elif s == 1:
            values[k] = mask
        else:
            t = tokens[it]
            it += 1
            if t == 254:
                raw[k] = True
                values[k] = raw_words[ir]
                ir += 1
                continue
            if t >= 252:
                m = big[ib] + np.uint64(127)
                ib += 1
                neg = t == 253
            else:
                m = np.uint64(t >> 1) + _U1
                neg = (t & 1) == 1
            v = ((~m + _U1) & mask) if neg else (m & mask)
            values[k] = v
    return raw, values, E_OK, 0


# -- positions (docs/FORMAT.md "positions") ------------------------------------------------------

@_jit
def encode_gaps(rel):
    """Sorted unique positions -> (gap bytes, gapx varint bytes)."""
    n = rel.size
    small = np.empty(n, np.uint8)
    nx = 0
    prev = -1
    for k in range(n):
        g = rel[k] - prev - 1
        prev = rel[k]
        if g >= 255:
            small[k] = 255
            nx += _varint_len(np.uint64(g - 255))
        else:
            small[k] = np.uint8(g)
    big = np.empty(nx, np.uint8)
    ie = 0
    prev = -1
    for k in range(n):
        g = rel[k] - prev - 1
        prev = rel[k]
        if g >= 255:
            x = np.uint64(g - 255)
            while x >= np.uint64(0x80):
                big[ie] = np.uint8((x & _LO7) | np.uint64(0x80))
                ie += 1
                x >>= _S7
            big[ie] = np.uint8(x)
            ie += 1
    return small, big


E_GAPCOUNT, E_GAPLEAVES, E_GAPOUT = 20, 21, 22


@_jit
def decode_gaps(small, big, count, length):
    """(positions, error code, detail), with the checks of ``positions.decode_gaps``."""
    out = np.empty(count, np.int64)
    if small.size != count:
        return out, E_GAPCOUNT, small.size
    n_esc = 0
    for s in small:
        if s == 255:
            n_esc += 1
    bg = np.empty(n_esc, np.uint64)
    e = _decode_varints(big, n_esc, bg)
    if e != E_OK:
        return out, e, n_esc
    lim = np.uint64(max(length, 1))
    for x in bg:
        if x >= lim:
            return out, E_GAPLEAVES, 0
    p = -1
    ib = 0
    for k in range(count):
        s = small[k]
        if s == 255:
            g = np.int64(bg[ib]) + 255
            ib += 1
        else:
            g = np.int64(s)
        p += g + 1
        out[k] = p
    if count and (p >= length or p < 0):
        return out, E_GAPOUT, p
    return out, E_OK, 0


@_jit
def encode_bitmap(rel, length):
    out = np.zeros((length + 7) // 8, np.uint8)
    for p in rel:
        out[p >> 3] |= np.uint8(1 << (p & 7))
    return out


E_BMBYTES, E_BMPAST, E_BMCOUNT = 30, 31, 32


@_jit
def decode_bitmap(packed, count, length):
    """(positions, error code, detail), with the checks of ``positions.decode_bitmap``."""
    out = np.empty(count, np.int64)
    if packed.size != (length + 7) // 8:
        return out, E_BMBYTES, packed.size
    if length & 7 and packed.size and packed[-1] >> np.uint8(length & 7):
        return out, E_BMPAST, 0
    k = 0
    nbytes = packed.size
    for w0 in range(0, nbytes, 8):
        m = np.uint64(0)
        for j in range(min(8, nbytes - w0)):
            m |= np.uint64(packed[w0 + j]) << np.uint64(8 * j)
        while m:
            if k < count:
                out[k] = w0 * 8 + np.int64(_cttz(m))
            k += 1
            m &= m - _U1
    if k != count:
        return out, E_BMCOUNT, k
    return out, E_OK, 0


# -- patching ------------------------------------------------------------------------------------

@_jit
def patch_words(words, positions, raw, values, per, table):
    """Write each change into ``words`` in place (raw: the value; else old + step, wrapping).

    Returns (old words for undo, fingerprint change from the old words and the words read back
    after writing, index of the first out-of-range position or -1: nothing is written then)."""
    count = positions.size
    n = words.size
    old = np.empty(count, words.dtype)
    for k in range(count):
        p = positions[k]
        if p < 0 or p >= n:
            return old, np.uint64(0), k
    for k in range(count):
        p = positions[k]
        a = words[p]
        old[k] = a
        if raw[k]:
            words[p] = values[k]
        else:
            words[p] = a + values[k]
    lb = np.int64(-1)
    lk = np.uint64(0)
    fpd = np.uint64(0)
    for k in range(count):  # read back: verify what landed, not what we meant
        dd, lb, lk = _word_delta(positions[k], np.uint64(old[k]), np.uint64(words[positions[k]]), per, table, lb, lk)
        fpd += dd
    return old, fpd, -1


@_jit
def apply_changes(words, positions, raw, values):
    """``values.apply_changes_np``: patch unsigned words in place (no fingerprint)."""
    for k in range(positions.size):
        p = positions[k]
        if raw[k]:
            words[p] = values[k]
        else:
            words[p] = words[p] + values[k]


@_jit
def copy_range_delta(dst, src, start, per, table):
    """dst[:] = src with the fingerprint change of words [start, start+len) (dense chunks)."""
    lb = np.int64(-1)
    lk = np.uint64(0)
    fpd = np.uint64(0)
    for i in range(dst.size):
        a = dst[i]
        b = src[i]
        if a != b:
            dd, lb, lk = _word_delta(start + i, np.uint64(a), np.uint64(b), per, table, lb, lk)
            fpd += dd
            dst[i] = b
    return fpd


# -- D: a 64-word compare as one vector compare --------------------------------------------------

@intrinsic
def _neq_mask64(typingctx, o, n, i):
    """Bit j set where ``o[i + j] != n[i + j]``, j < 64 (C-contiguous 1-D arrays of one integer dtype; the
    caller keeps ``i + 64 <= size``): two 64-lane vector loads, a vector compare and its mask as a uint64
    (LLVM's own lowering: ``vpcmpneq`` into a mask register on AVX-512, compare + movemask on AVX2),
    where a loop of 64 scalar compares and shifts did not vectorize inside the span kernel."""
    if not (isinstance(o, types.Array) and isinstance(n, types.Array) and o.ndim == 1 and n.ndim == 1
            and o.layout == "C" and n.layout == "C" and isinstance(o.dtype, types.Integer) and o.dtype == n.dtype
            and isinstance(i, types.Integer)):
        return None
    bits = o.dtype.bitwidth

    def codegen(context, builder, signature, args):
        ao = context.make_array(signature.args[0])(context, builder, args[0])
        an = context.make_array(signature.args[1])(context, builder, args[1])
        idx = context.cast(builder, args[2], signature.args[2], types.intp)
        vt = ir.VectorType(ir.IntType(bits), 64).as_pointer()
        vo = builder.load(builder.bitcast(builder.gep(ao.data, [idx]), vt), align=bits // 8)
        vn = builder.load(builder.bitcast(builder.gep(an.data, [idx]), vt), align=bits // 8)
        return builder.bitcast(builder.icmp_unsigned("!=", vo, vn), ir.IntType(64))

    return types.uint64(o, n, i), codegen


# -- K: whole-span compare, gather and base fingerprint in one pass ------------------------------

@_jit
def _grow(a, size):
    b = np.empty(size, a.dtype)
    b[: a.size] = a
    return b


@_jit
def _lanes_range(ol, l0, l1, table):
    """lanes_sum of ol[l0:l1] at lane offset l0 (the unaligned head or tail of a span)."""
    total = np.uint64(0)
    for i in range(l0, l1):
        total += np.uint64(ol[i]) * table[i & 0xFFFF] * _block_key(i >> 16)
    return total


@_jit
def diff_span(o, n, ol, dst, first, last, per, table, want_lanes, update_old, cap):
    """Changed words of ``o``/``n`` (one tensor's unsigned words) in [first, last), in one streaming pass:
    (positions, old words, new words, how many, fingerprint change, lanes sum of the old words). The
    outputs hold at least ``how many`` entries (they grow by doubling from ``cap``; the caller trims).

    ``ol``: ``o``'s fingerprint lanes (``o`` itself for 1- and 2-byte words, its uint16 view for wider
    ones). ``want_lanes``: also ``lanes_sum`` the old words' lanes (L = max(per, 1) per word, at lane
    offset ``first * L``), so a base fingerprint costs no second read. ``update_old``: write each
    changed new word into ``dst`` (``o`` itself; any writeable array otherwise, so ``o`` may be read-only). Words are compared 64 at a time into a bit mask; only set bits cost
    more; output room is checked per batch of blocks, not per block."""
    size = max(cap, 128)
    return _diff_span_into(o, n, ol, dst, first, last, per, table, want_lanes, update_old,
                           np.empty(size, np.int64), np.empty(size, o.dtype), np.empty(size, o.dtype), 0, 0,
                           last - first)


@_jit
def _diff_span_into(o, n, ol, dst, first, last, per, table, want_lanes, update_old, pos, ow, nw, k, before, words):
    """:func:`diff_span` appending to ``pos``/``ow``/``nw`` from index ``k``: (positions, old words, new words,
    index past the last entry, fingerprint change, lanes sum). When they run short they grow to the count
    projected from the share found so far (``before`` words compared ahead of this span out of ``words`` in
    all), with a quarter more room, and at least by half."""
    L = max(per, 1)
    if pos.size - k < 64:  # the unaligned head below writes without a check
        size = max(2 * pos.size, k + 64)
        pos = _grow(pos, size)
        ow = _grow(ow, size)
        nw = _grow(nw, size)
    lb = np.int64(-1)  # fingerprint-delta block cache (_word_delta)
    lk = np.uint64(0)
    fpd = np.uint64(0)
    total = np.uint64(0)  # lanes sum of the old words
    b_first = min((first + 63) // 64 * 64, last)
    b_last = max(last // 64 * 64, b_first)
    if want_lanes:  # before any word is updated
        total += _lanes_range(ol, first * L, b_first * L, table) + _lanes_range(ol, b_last * L, last * L, table)
    for p in range(first, b_first):  # head, up to the first 64-word boundary (< 64 words: fits)
        if o[p] != n[p]:
            a = o[p]
            b = n[p]
            pos[k] = p
            ow[k] = a
            nw[k] = b
            k += 1
            dd, lb, lk = _word_delta(p, np.uint64(a), np.uint64(b), per, table, lb, lk)
            fpd += dd
            if update_old:
                dst[p] = b
    cb = np.int64(-1)  # lane block being summed, and its partial sum
    acc = np.uint64(0)
    nl = 64 * L
    blk = b_first // 64
    end = b_last // 64
    while blk < end:
        room = (pos.size - k) // 64  # blocks that fit whatever they hold
        if room == 0:
            seen = max(before + blk * 64 - first, 1)
            size = max(pos.size + pos.size // 2, min((k + 1) * words // seen, k + words - seen + 64) * 5 // 4 + 4096)
            pos = _grow(pos, size)
            ow = _grow(ow, size)
            nw = _grow(nw, size)
            continue
        stop = min(end, blk + room)
        if per <= 1:  # one lane per word: lane index = word index
            for bb in range(blk, stop):
                b0 = bb * 64
                u0 = np.uint64(b0)
                if want_lanes:
                    lblk = b0 >> 16
                    if lblk != cb:
                        if cb >= 0:
                            total += acc * _block_key(cb)
                        cb = lblk
                        acc = np.uint64(0)
                    j0 = np.uint64(b0 & 0xFFFF)
                    s = np.uint64(0)
                    for j in range(64):
                        uj = np.uint64(j)
                        s += np.uint64(ol[u0 + uj]) * table[j0 + uj]
                    acc += s
                m = _neq_mask64(o, n, b0)
                while m:
                    p = b0 + np.int64(_cttz(m))
                    m &= m - _U1
                    a = o[p]
                    b = n[p]
                    pos[k] = p
                    ow[k] = a
                    nw[k] = b
                    k += 1
                    wb = p >> 16
                    if wb != lb:
                        lb = wb
                        lk = _block_key(wb)
                    fpd += (np.uint64(b) - np.uint64(a)) * table[p & 0xFFFF] * lk
                    if update_old:
                        dst[p] = b
        else:
            for bb in range(blk, stop):
                b0 = bb * 64
                if want_lanes:
                    l0 = b0 * L
                    lblk = l0 >> 16
                    if lblk != cb:
                        if cb >= 0:
                            total += acc * _block_key(cb)
                        cb = lblk
                        acc = np.uint64(0)
                    j0 = np.uint64(l0 & 0xFFFF)
                    ul0 = np.uint64(l0)
                    s = np.uint64(0)
                    for j in range(nl):
                        uj = np.uint64(j)
                        s += np.uint64(ol[ul0 + uj]) * table[j0 + uj]
                    acc += s
                m = _neq_mask64(o, n, b0)
                while m:
                    p = b0 + np.int64(_cttz(m))
                    m &= m - _U1
                    a = o[p]
                    b = n[p]
                    pos[k] = p
                    ow[k] = a
                    nw[k] = b
                    k += 1
                    dd, lb, lk = _word_delta(p, np.uint64(a), np.uint64(b), per, table, lb, lk)
                    fpd += dd
                    if update_old:
                        dst[p] = b
        blk = stop
    if want_lanes and cb >= 0:
        total += acc * _block_key(cb)
    if pos.size - k < 64:
        size = pos.size + 64
        pos = _grow(pos, size)
        ow = _grow(ow, size)
        nw = _grow(nw, size)
    for p in range(b_last, last):  # tail (< 64 words)
        if o[p] != n[p]:
            a = o[p]
            b = n[p]
            pos[k] = p
            ow[k] = a
            nw[k] = b
            k += 1
            dd, lb, lk = _word_delta(p, np.uint64(a), np.uint64(b), per, table, lb, lk)
            fpd += dd
            if update_old:
                dst[p] = b
    return pos, ow, nw, k, fpd, total


@_jit
def address(a):
    """The address of an array's first element: ``a.ctypes.data`` in ~0.2 µs instead of ~1.5 (numpy builds a
    ctypes helper object a call), for the job tables of :func:`diff_jobs` (two arrays a tensor, 70k tensors)."""
    return a.ctypes.data


@_jit
def diff_jobs(jobs, like, lane_like, table, per, want_lanes, update_old, cap):
    """:func:`diff_span` of many spans (of many tensors of one word dtype) in one call, into shared outputs.
    ``jobs`` int64[J, 5] rows: (address of the old words, of the new words, the tensor's word count, first,
    last); ``like``/``lane_like``: empty arrays of the word and lane dtypes (``diff_span``'s ``ol``: the words
    themselves for 1- and 2-byte words, their uint16 lanes for wider ones). With ``update_old`` the changed
    new words are written into the old words (which must be writeable). Returns (positions, old words,
    new words, offsets int64[J + 1]: job j's entries are [offsets[j], offsets[j + 1]), fingerprint changes
    uint64[J], lanes sums uint64[J]); the outputs start at ``cap`` entries and grow to the count projected
    from the share of changed words found so far."""
    J = jobs.shape[0]
    size = max(cap, 128)
    pos = np.empty(size, np.int64)
    ow = np.empty(size, like.dtype)
    nw = np.empty(size, like.dtype)
    offsets = np.zeros(J + 1, np.int64)
    fpds = np.zeros(J, np.uint64)
    totals = np.zeros(J, np.uint64)
    L = max(per, 1)
    k = 0
    words = 0
    for j in range(J):
        words += jobs[j, 4] - jobs[j, 3]
    before = 0
    for j in range(J):
        nwords = jobs[j, 2]
        o = carray(_addr_as(jobs[j, 0], like), nwords)
        n = carray(_addr_as(jobs[j, 1], like), nwords)
        ol = carray(_addr_as(jobs[j, 0], lane_like), nwords * L)
        pos, ow, nw, k, fpd, total = _diff_span_into(o, n, ol, o, jobs[j, 3], jobs[j, 4], per, table, want_lanes,
                                                     update_old, pos, ow, nw, k, before, words)
        before += jobs[j, 4] - jobs[j, 3]
        offsets[j + 1] = k
        fpds[j] = fpd
        totals[j] = total
    return pos, ow, nw, offsets, fpds, totals


# -- A: whole-chunk decode, fused patch and journal kernels --------------------------------------
# The ``ans`` chunk mode (docs/FORMAT.md §4.3) decoded straight into Changes, chunk after chunk in
# one call; the patch of a chunk in one pass over its positions; the journal's old words gathered.


_A_PREC = _rans.PREC
_A_SLOTS = (1 << _rans.PREC) - 1
_A_L = _rans.L
_A_SMALL = _rans.SMALL
_A_BIG = _rans.BIG
_A_RAW = _rans.RAW
# error codes of ans_decode_chunks beyond rans's (OK, E_SHORT, E_SYMBOL, E_END, E_GAP)
E_ANS_NRAW, E_ANS_STEPBIG = 40, 41


def ans_slot_table(freq: np.ndarray, cum: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """A model's decode table, one int32 per slot: symbol | freq << 6 | (slot - start) << 19, so one load
    gives all three (rans.tables' freq, cumulative starts and slot lookup). One compiled loop (two per blob:
    numpy's six passes over the 4096 slots cost ~15 us each)."""
    return _ans_slot_table(freq, cum, lut)


@_jit
def _ans_slot_table(freq, cum, lut):
    out = np.empty(lut.size, np.int32)
    for slot in range(lut.size):
        s = np.int64(lut[slot])
        out[slot] = np.int32(s | (np.int64(freq[s]) << 6) | ((slot - np.int64(cum[s])) << 19))
    return out


@_jit
def ans_decode_chunks(ans, jobs, gtab, vtab, raws, pos, rawf, vals, bits):
    """Decode ans chunks into Changes arrays: ``jobs`` int64[n, 8] rows of (word offset in ``ans``, word
    count, change count, chunk length, chunk start, offset in ``raws``, raw word count, offset in the
    outputs). Writes absolute positions, raw flags and values (unsigned words) at each chunk's output
    offset. Returns (error code, job index, detail): the first failing chunk in job order, with the checks
    (and their order) of ``rans.decode_chunk`` then ``values.changes_from_symbols``.

    Renormalisation is branch-free (a select: whether a symbol crosses a 16-bit word is a coin toss the
    branch predictor loses), and a gap's low bits take one step unless the gap is 2**13 or more."""
    mask_w = ~np.uint64(0) if bits == 64 else (np.uint64(1) << np.uint64(bits)) - _U1
    bigmax = (np.uint64(1) << np.uint64(bits - 1)) - np.uint64(1 + _A_SMALL)
    for j in range(jobs.shape[0]):
        w0 = jobs[j, 0]
        nw = jobs[j, 1]
        count = jobs[j, 2]
        length = jobs[j, 3]
        start = jobs[j, 4]
        r0 = jobs[j, 5]
        nr = jobs[j, 6]
        o = jobs[j, 7]
        if nw < 2:
            return _rans.E_SHORT, j, 0
        last = w0 + nw - 1
        x = np.int64(ans[w0]) | (np.int64(ans[w0 + 1]) << 16)
        at = w0 + 2  # absolute index of the next word; past ``last``: zeros are fed, caught at the end
        p = np.int64(-1)
        ir = 0
        too_big = False
        for i in range(count):
            e = np.int64(gtab[x & _A_SLOTS])
            b = e & 63
            x = ((e >> 6) & 0x1FFF) * (x >> _A_PREC) + (e >> 19)
            nx = (x << 16) | (np.int64(ans[min(at, last)]) if at <= last else np.int64(0))
            lo = x < _A_L
            x = nx if lo else x
            at += 1 if lo else 0
            # the gap's b - 1 low bits, low pieces of at most PREC bits first
            k = b - 1 if b >= 1 else 0
            kk = k if k < _A_PREC else _A_PREC
            g = x & ((np.int64(1) << kk) - 1)
            x >>= kk
            nx = (x << 16) | (np.int64(ans[min(at, last)]) if at <= last else np.int64(0))
            lo = x < _A_L
            x = nx if lo else x
            at += 1 if lo else 0
            k -= kk
            sh = kk
            while k > 0:  # gaps of 2**13 words or more
                kk = k if k < _A_PREC else _A_PREC
                g |= (x & ((np.int64(1) << kk) - 1)) << sh
                x >>= kk
                if x < _A_L:
                    x <<= 16
                    if at <= last:
                        x |= np.int64(ans[at])
                    at += 1
                sh += kk
                k -= kk
            if b >= 1:
                g |= np.int64(1) << (b - 1)
            p += g + 1
            if p >= length or b > 48:
                return _rans.E_GAP, j, 0
            pos[o + i] = start + p
            e = np.int64(vtab[x & _A_SLOTS])
            s = e & 63
            x = ((e >> 6) & 0x1FFF) * (x >> _A_PREC) + (e >> 19)
            nx = (x << 16) | (np.int64(ans[min(at, last)]) if at <= last else np.int64(0))
            lo = x < _A_L
            x = nx if lo else x
            at += 1 if lo else 0
            if s < _A_BIG:
                rawf[o + i] = False
                mag = np.uint64(s >> 1) + _U1
                vals[o + i] = ((~mag + _U1) & mask_w) if (s & 1) == 1 else mag
                continue
            if s == _A_RAW:
                rawf[o + i] = True
                if ir < nr:
                    vals[o + i] = raws[r0 + ir]
                ir += 1
                continue
            rawf[o + i] = False
            v8 = x & 0xFF  # BIG: 1 sign bit and 7 bits of q, then q - 1 bits
            x >>= 8
            if x < _A_L:
                x <<= 16
                if at <= last:
                    x |= np.int64(ans[at])
                at += 1
            q = v8 >> 1
            if q > 64:
                return _rans.E_SYMBOL, j, 0
            m = np.uint64(0)
            if q >= 1:
                k = q - 1
                sh = 0
                while k > 0:
                    kk = k if k < _A_PREC else _A_PREC
                    m |= np.uint64(x & ((np.int64(1) << kk) - 1)) << np.uint64(sh)
                    x >>= kk
                    if x < _A_L:
                        x <<= 16
                        if at <= last:
                            x |= np.int64(ans[at])
                        at += 1
                    sh += kk
                    k -= kk
                m |= np.uint64(1) << np.uint64(q - 1)
            if m > bigmax:
                too_big = True
            mag = m + np.uint64(1 + _A_SMALL)
            vals[o + i] = ((~mag + _U1) & mask_w) if (v8 & 1) == 1 else (mag & mask_w)
        if at > last + 1:
            return _rans.E_SHORT, j, 0
        if at != last + 1 or x != _A_L:
            return _rans.E_END, j, 0
        if ir != nr:
            return E_ANS_NRAW, j, ir
        if too_big:
            return E_ANS_STEPBIG, j, 0
    return _rans.OK, -1, 0


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Prefetch ``arr[idx]`` for a write (llvm.prefetch; a hint: never faults, no effect on results).
    The patch loops below touch one cache line per change in ascending but irregular order; asking for
    the line 32 changes ahead keeps enough misses in flight to halve their time."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False, boundscheck=False)
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        i32 = ir.IntType(32)
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


_AHEAD = 32


@njit(nogil=True, cache=True, inline="always")
def _patch_word(words, p, r, v, per, table, lb, lk):
    """One change of a patch (position in range: the caller checked): ``words[p]`` becomes ``v`` (``r``: a raw
    value) or ``words[p] + v``, read back. -> (the old word, its fingerprint change, the block cache ``lb, lk``)."""
    a = words[p]
    if r:
        words[p] = v
    else:
        words[p] = a + v
    b = words[p]  # read back: the fingerprint of what landed
    if per == 1:  # 2-byte words (bf16, fp16): one lane, the block key carried in registers
        blk = p >> 16
        if blk != lb:
            lb = blk
            lk = _block_key(blk)
        return a, (np.uint64(b) - np.uint64(a)) * table[p & 0xFFFF] * lk, lb, lk
    dd, lb, lk = _word_delta(p, np.uint64(a), np.uint64(b), per, table, lb, lk)
    return a, dd, lb, lk


@_jit
def _patch_run(words, positions, raw, values, old, o, per, table):
    """The one-pass patch of :func:`patch_chunk` (positions in range: the caller checked), old words into
    ``old[o:]``: returns the fingerprint change."""
    count = positions.size
    lb = np.int64(-1)
    lk = np.uint64(0)
    fpd = np.uint64(0)
    for k in range(count):
        if k + _AHEAD < count:
            _prefetch(words, positions[k + _AHEAD])
        a, d, lb, lk = _patch_word(words, positions[k], raw[k], values[k], per, table, lb, lk)
        old[o + k] = a
        fpd += d
    return fpd


@njit(nogil=True, cache=True, inline="always")
def _next_change(counts, j, k):
    """The change after change ``k`` of row ``j`` in rows of ``counts[j]`` changes each, empty rows skipped:
    (row, index), row ``counts.size`` past the last. (``k = -1``: the first change of row ``j`` or later.)"""
    k += 1
    while j < counts.size and k >= counts[j]:
        j += 1
        k = 0
    return j, k


@_jit
def patch_chunk(words, positions, raw, values, old, per, table):
    """:func:`patch_words` in one pass over the positions (gather the old word into ``old``, write the new
    one, read it back and add its fingerprint change), prefetching ahead. Returns (fingerprint change,
    index of the first out-of-range position or -1: nothing is written then)."""
    count = positions.size
    n = words.size
    for k in range(count):
        p = positions[k]
        if p < 0 or p >= n:
            return np.uint64(0), k
    return _patch_run(words, positions, raw, values, old, 0, per, table), -1


@intrinsic
def _addr_as(typingctx, addr, like):
    """A pointer to ``like``'s dtype at the integer address ``addr`` (for ``numba.carray``): the arrays of
    :func:`patch_jobs` are passed as addresses, so one call patches any number of tensors."""
    if not (isinstance(like, types.Array) and isinstance(addr, types.Integer)):
        return None
    ptrty = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptrty))

    return ptrty(addr, like), codegen


@_jit
def array_addresses(a, b, c):
    """The addresses of three arrays' first elements (``arr.ctypes.data`` each, ~7x less per call than
    numpy's ctypes objects: the patch_jobs table is built per chunk)."""
    return a.ctypes.data, b.ctypes.data, c.ctypes.data


@_jit
def patch_jobs(jobs, like, old, fpds, per, table):
    """:func:`patch_chunk` of many chunks (of many tensors of one word dtype) in one call. ``jobs`` int64[J, 7]
    rows: (address of word 0 of the tensor's words, the end of its writable words, address of the chunk's int64
    positions, of its raw flags (bytes), of its values (words like ``like``), change count, the first writable
    word): a job writes words [first, end) only (a tensor's: first 0; a rank's run of a stream tensor's words,
    which its parameter holds from some word on: its first stream word, word 0's address then lies before the
    parameter and is never read). Old words go to ``old`` one job after the other, each job's fingerprint
    change to ``fpds[j]``. Jobs run in order; returns (-1, 0), or (j, k) at the first job whose position k is
    out of range: that job writes nothing, later ones do not run. The caller keeps every addressed array alive
    and contiguous."""
    pos_like = np.empty(0, np.int64)
    raw_like = np.empty(0, np.uint8)
    counts = jobs[:, 5]
    # the prefetch cursor runs _AHEAD changes ahead of the patch across jobs: a state of many small tensors has
    # jobs of a few changes each, too short to prefetch inside one (70k tensors: ~4x the time without it)
    ja, ka = _next_change(counts, 0, -1)
    for _ in range(_AHEAD):
        if ja >= counts.size:
            break
        _prefetch_job(jobs, ja, ka, like, pos_like)
        ja, ka = _next_change(counts, ja, ka)
    o = 0
    for j in range(jobs.shape[0]):
        n = jobs[j, 1]
        first = jobs[j, 6]
        count = jobs[j, 5]
        words = carray(_addr_as(jobs[j, 0], like), n)
        positions = carray(_addr_as(jobs[j, 2], pos_like), count)
        raw = carray(_addr_as(jobs[j, 3], raw_like), count)
        values = carray(_addr_as(jobs[j, 4], like), count)
        for k in range(count):
            p = positions[k]
            if p < first or p >= n:
                return j, k
        lb = np.int64(-1)
        lk = np.uint64(0)
        fpd = np.uint64(0)
        own = count - _AHEAD  # changes whose look-ahead lies in this job: prefetched from its own positions
        if own > 0:
            ja, ka = _next_change(counts, j + 1, -1)
        for k in range(count):
            if k < own:
                _prefetch(words, positions[k + _AHEAD])
            elif ja < counts.size:
                _prefetch_job(jobs, ja, ka, like, pos_like)
                ja, ka = _next_change(counts, ja, ka)
            a, d, lb, lk = _patch_word(words, positions[k], raw[k], values[k], per, table, lb, lk)
            old[o + k] = a
            fpd += d
        fpds[j] = fpd
        o += count
    return -1, 0


@njit(nogil=True, cache=True, inline="always")
def _prefetch_job(jobs, j, k, like, pos_like):
    """Prefetch the word of :func:`patch_jobs`'s job ``j``, change ``k`` (a hint: an out-of-range position,
    refused when its job runs, never faults)."""
    words = carray(_addr_as(jobs[j, 0], like), jobs[j, 1])
    _prefetch(words, carray(_addr_as(jobs[j, 2], pos_like), jobs[j, 5])[k])


@_jit
def gather_words(words, positions, out):
    """``out[k] = words[positions[k]]`` (positions checked in range by the caller), prefetching ahead."""
    count = positions.size
    for k in range(count):
        if k + _AHEAD < count:
            _prefetch(words, positions[k + _AHEAD])
        out[k] = words[positions[k]]


@_jit
def scatter_words(words, positions, src):
    """``words[positions[k]] = src[k]``: an undo record written back."""
    count = positions.size
    for k in range(count):
        if k + _AHEAD < count:
            _prefetch(words, positions[k + _AHEAD])
        words[positions[k]] = src[k]


# -- Q: the --out undo journal's sparse records, one pass ----------------------------------------

@_jit
def journal_gather(words, positions, start, stop, rel, old):
    """One sparse chunk's undo record in one prefetching pass: ``rel[k] = positions[k] - start`` (uint32
    offsets in the chunk) and ``old[k] = words[positions[k]]``. Returns the index of the first position
    outside ``[start, stop)`` (the record is then unfinished: the caller raises) or -1. The caller's:
    ``stop <= words.size`` and ``stop - start <= 2**32``."""
    count = positions.size
    for k in range(count):
        p = positions[k]
        if p < start or p >= stop:
            return k
        if k + _AHEAD < count:
            _prefetch(words, positions[k + _AHEAD])  # a hint: an out-of-range one never faults
        rel[k] = p - start
        old[k] = words[p]
    return -1


# -- rank maps (deltasync.rankmap) ------------------------------------------------------------------------

@_jit
def rank_translate(first, width, run_src, run_len, run_dst, src_cols, src_row0, rows, src_col0, cols, dst_cols,
                   dst_row0, dst_col0, param, n_params, tids, pos, out_i, out_r, out_d):
    """Every (change, region) placement of changes (stream tensor id ``tids``, word position ``pos``) through a
    RankMap's offset tables, written grouped by parameter (ascending; in change order within one): change index,
    region row, parameter word. Returns how many. ``out_*`` hold ``len(tids) * width``. Regions with
    ``run_len == 0`` and ``rows == 0`` (general ones) are left to the caller."""
    n = tids.size
    tmp_r = np.empty(n * width, np.int64)
    tmp_d = np.empty(n * width, np.int64)
    tmp_i = np.empty(n * width, np.int64)
    counts = np.zeros(n_params + 1, np.int64)
    m = 0
    for i in range(n):
        t = tids[i]
        p = pos[i]
        for r in range(first[t], first[t + 1]):
            ln = run_len[r]
            if ln > 0:
                d = p - run_src[r]
                if d < 0 or d >= ln:
                    continue
                dst = d + run_dst[r]
            else:
                row = p // src_cols[r] - src_row0[r]
                col = p % src_cols[r] - src_col0[r]
                if row < 0 or row >= rows[r] or col < 0 or col >= cols[r]:
                    continue
                dst = (dst_row0[r] + row) * dst_cols[r] + dst_col0[r] + col
            tmp_i[m] = i
            tmp_r[m] = r
            tmp_d[m] = dst
            counts[param[r] + 1] += 1
            m += 1
    for k in range(n_params):
        counts[k + 1] += counts[k]
    for k in range(m):
        q = param[tmp_r[k]]
        at = counts[q]
        counts[q] = at + 1
        out_i[at] = tmp_i[k]
        out_r[at] = tmp_r[k]
        out_d[at] = tmp_d[k]
    return m


# -- R: the state fingerprint's lines ---------------------------------------------------------------

@_jit
def state_hex(buf, hex_at, fps, order):
    """``StateLines.digest``'s digits in one pass, in place: line ``i``'s 16 lowercase hex digits of
    ``fps[order[i]]`` (uint64) at ``buf[hex_at[i]:hex_at[i] + 16]`` (no array per digit column, no copy of the
    lines)."""
    for i in range(order.size):
        v = fps[order[i]]
        at = hex_at[i]
        for k in range(16):
            d = np.uint8((v >> np.uint64(60 - 4 * k)) & np.uint64(15))
            buf[at + k] = d + np.uint8(48) if d < 10 else d + np.uint8(87)


# -- S: a safetensors header's entries --------------------------------------------------------------

@_jit
def header_entries(out, names, name_at, order, prefixes, prefix_at, code, starts, ends):
    """``tensorfile._build_columns``' entries in one pass: entry ``i`` (of ``order.size``), comma-separated, is
    ``"NAME":PREFIX START,END]}`` with NAME ``names[name_at[order[i]]:name_at[order[i] + 1]]`` (printable ASCII
    without quotes or backslashes: the caller checked), PREFIX ``prefixes[prefix_at[code[i]]:prefix_at[code[i] +
    1]]`` and START/END (int64, >= 0) in decimal. Written into ``out`` (large enough: the caller sized it); returns
    the bytes written."""
    at = 0
    digits = np.empty(20, np.uint8)
    for i in range(order.size):
        if i:
            out[at] = 44  # ,
            at += 1
        out[at] = 34  # "
        at += 1
        t = order[i]
        for j in range(name_at[t], name_at[t + 1]):
            out[at] = names[j]
            at += 1
        out[at] = 34
        out[at + 1] = 58  # ":
        at += 2
        c = code[i]
        for j in range(prefix_at[c], prefix_at[c + 1]):
            out[at] = prefixes[j]
            at += 1
        for v, tail in ((starts[i], 44), (ends[i], 93)):  # START, then END]
            k = 0
            while True:
                digits[k] = 48 + v % 10
                v //= 10
                k += 1
                if v == 0:
                    break
            while k:
                k -= 1
                out[at] = digits[k]
                at += 1
            out[at] = tail
            at += 1
        out[at] = 125  # }
        at += 1
    return at
