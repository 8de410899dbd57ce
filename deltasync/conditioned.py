"""Base-conditioned coding: the ``ansx`` chunk mode of blob format 3 (docs/FORMAT.md §4.4).

A bf16 word moves in an AdamW step when the update crosses a rounding boundary, which happens far
more often for small magnitudes: the old word's *exponent* predicts whether a word changes and by
how much. This mode groups a chunk's words by the exponent of their **old** value (the context ``e``,
:func:`context_spec`), codes the changed words of each group as gaps between their ranks inside the
group, and models gaps (G_e) and value symbols (V_e) per context, under the same rANS as the ``ans``
mode (:mod:`deltasync.kernels.rans`). On real AdamW traces that is ~30% fewer bytes than ``ans``.

The price: **decoding needs the base**. A decoded chunk is a *pending* patch
(:class:`PendingChanges`) until it is given the chunk's old words; the decoder reads every old word of
the chunk twice (a histogram of contexts, then a merge pass that turns ranks into positions): O(chunk),
not O(changed). Relays cannot squash such chains without the model (:mod:`deltasync.squash` refuses);
the stream says so in its manifest (``meta["deltasync.coding"]``), so subscribers walk the chain.

Dtypes: bfloat16, float16 (and complex32's halves), float32 (and complex64's). Chunks of other dtypes
in a format-3 blob use the base-free ``ans`` mode.

Per chunk (group-major): for every context ``e`` present among the chunk's old words, ascending: per
changed word of the group, in position order, the gap bucket of ``rank - prev_rank - 1`` under G_e
(``prev_rank`` starts at -1), the gap's low bits, the value symbol under V_e (and a BIG step's bits,
as §4.3); then the END symbol (bucket 49) under G_e.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from .kernels import rans
from .errors import FormatError
from .values import Changes, changes_from_symbols, step_symbols
from .varint import decode_varints, encode_varints

CODING_BASE_FREE = "base-free"
CODING_BASE_CONDITIONED = "base-conditioned"
CODING_HISTORY = "history"  # deltasync.history: positions modelled by the deltas before (ansh chunks)
CODINGS = (CODING_BASE_FREE, CODING_BASE_CONDITIONED, CODING_HISTORY)
CODING_META = "deltasync.coding"  # manifest meta key; absent = base-free

N_CTX = 256
END = rans.N_GAP  # G_e's end-of-group symbol
N_G = rans.N_GAP + 1

#: dtype -> (shift, mask): context = (word >> shift) & mask = the old value's exponent field
_SPECS = {"bfloat16": (7, 0xFF), "float16": (10, 0x1F), "complex32": (10, 0x1F),
          "float32": (23, 0xFF), "complex64": (23, 0xFF)}

E_CTX = 5  # a context the blob's tables do not model
_ERRORS = {
    rans.E_SHORT: "the message ends before its last change (truncated or corrupt)",
    rans.E_SYMBOL: "a BIG step's bucket is out of range",
    rans.E_END: "the message has words or state left after its last change (corrupt)",
    rans.E_GAP: "a rank leaves its exponent group, or the changes do not add up (corrupt, or decoded against "
                "the wrong base)",
    E_CTX: "an exponent group of the base has no model in this blob (decoded against the wrong base?)",
}


def context_spec(dtype: str) -> tuple[int, int] | None:
    """(shift, mask) of a dtype's context, or None where the mode does not apply (use ``ans``)."""
    return _SPECS.get(dtype)


# -- kernels --------------------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def chunk_ranks(words, rel, old, shift, mask):
    """Each change's (context, rank inside its context group) and the group sizes, in one pass.

    ``words``: the chunk's words in any state that equals the base off the changed positions (the old
    state, the new one, or a reference patched in place); ``rel``: sorted change positions relative to
    the chunk; ``old``: the old words there."""
    n = words.size
    k = rel.size
    grp = np.empty(k, dtype=np.uint8)
    rank = np.empty(k, dtype=np.int64)
    cnt = np.zeros(N_CTX, dtype=np.int64)
    j = 0
    nxt = rel[0] if k else n
    for i in range(n):
        if i == nxt:
            e = (np.int64(old[j]) >> shift) & mask
            grp[j] = e
            rank[j] = cnt[e]
            j += 1
            nxt = rel[j] if j < k else n
        else:
            e = (np.int64(words[i]) >> shift) & mask
        cnt[e] += 1
    return grp, rank, cnt


@numba.njit(cache=True, nogil=True)
def context_order(ctx):
    """A stable counting sort by context: (``start[e]``: where context ``e`` begins, N_CTX + 1 of them; ``order``:
    the indices of ``ctx``, context-major)."""
    k = ctx.size
    start = np.zeros(N_CTX + 1, dtype=np.int64)
    for j in range(k):
        start[np.int64(ctx[j]) + 1] += 1
    for e in range(N_CTX):
        start[e + 1] += start[e]
    at = start[:N_CTX].copy()
    order = np.empty(k, dtype=np.int64)
    for j in range(k):
        e = np.int64(ctx[j])
        order[at[e]] = j
        at[e] += 1
    return start, order


@numba.njit(cache=True, nogil=True)
def _group_major(grp, rank, cnt, vsym):
    """-> (order of changes, group-major; gaps; gap buckets) and the counts of G and V per context."""
    k = grp.size
    _, order = context_order(grp)
    gaps = np.empty(k, dtype=np.int64)
    bkt = np.empty(k, dtype=np.int64)
    gcount = np.zeros((N_CTX, N_G), dtype=np.int64)
    vcount = np.zeros((N_CTX, rans.N_VAL), dtype=np.int64)
    prev_e = -1
    prev = -1
    for t in range(k):
        j = order[t]
        e = np.int64(grp[j])
        if e != prev_e:
            prev = -1
            prev_e = e
        g = rank[j] - prev - 1
        prev = rank[j]
        b = rans.bit_length(np.uint64(g))
        gaps[t] = g
        bkt[t] = b
        gcount[e, b] += 1
        vcount[e, vsym[j]] += 1
    for e in range(N_CTX):
        if cnt[e]:
            gcount[e, END] += 1
    return order, gaps, bkt, gcount, vcount


@numba.njit(cache=True, nogil=True)
def _encode(order, grp, gaps, bkt, vsym, bigneg, bigmag, bigidx, cnt, gf, gc, vf, vc):
    """The chunk's rANS message (uint16 words), coded in reverse of the decoding order."""
    k = order.size
    out = np.empty(14 * k + 2 * N_CTX + 64, dtype=np.uint16)
    at = out.size
    x = np.int64(rans.L)
    of = np.empty(16, dtype=np.int64)
    oc = np.empty(16, dtype=np.int64)
    op = np.empty(16, dtype=np.int64)
    t = k - 1
    for e in range(N_CTX - 1, -1, -1):
        if cnt[e] == 0:
            continue
        # END of group e (the last symbol of the group in decoding order: the first one encoded)
        nops = 1
        of[0] = gf[e, END]
        oc[0] = gc[e, END]
        op[0] = rans.PREC
        while True:
            for jj in range(nops - 1, -1, -1):
                f = of[jj]
                x_max = ((rans.L >> op[jj]) << 16) * f
                if x >= x_max:
                    at -= 1
                    out[at] = x & 0xFFFF
                    x >>= 16
                if f == 1:
                    x = (x << op[jj]) + oc[jj]
                else:
                    x = ((x // f) << op[jj]) + (x % f) + oc[jj]
            if t < 0 or np.int64(grp[order[t]]) != e:
                break
            j = order[t]
            nops = 0
            b = bkt[t]
            of[nops] = gf[e, b]
            oc[nops] = gc[e, b]
            op[nops] = rans.PREC
            nops += 1
            nops = rans.push_bits(of, oc, op, nops, np.uint64(gaps[t]), b - 1)
            s = vsym[j]
            of[nops] = vf[e, s]
            oc[nops] = vc[e, s]
            op[nops] = rans.PREC
            nops += 1
            if s == rans.BIG:
                ib = bigidx[j]
                nops = rans.push_big(of, oc, op, nops, bigmag[ib], bigneg[ib])
            t -= 1
    at -= 2
    out[at] = x & 0xFFFF
    out[at + 1] = (x >> 16) & 0xFFFF
    return out[at:].copy()


Q = 4  # the decoder walks a chunk's base as Q interleaved quarters: independent counter chains, ~3x faster


@numba.njit(cache=True, nogil=True)
def decode_groups(words, cnt, count, gf, gc, glut, vf, vc, vlut):
    """The symbol stage of an ``ansx``-style message, shared by every context source (the base's exponents
    here, a history's ages in :mod:`deltasync.history`): given each context's group size ``cnt``, ->
    (each change's rank inside its group, value symbol, BIG sign, BIG magnitude, in group-major order; the
    first change of each group (``gstart``, N_CTX + 1); error)."""
    grank = np.empty(count, dtype=np.int64)
    vsym = np.empty(count, dtype=np.uint8)
    bneg = np.zeros(count, dtype=np.bool_)
    bmag = np.zeros(count, dtype=np.uint64)
    gstart = np.zeros(N_CTX + 1, dtype=np.int64)
    nw = words.size
    if nw < 2:
        return grank, vsym, bneg, bmag, gstart, rans.E_SHORT
    x = np.int64(words[0]) | (np.int64(words[1]) << 16)
    at = 2
    mk = np.int64(rans.M - 1)
    kk_ = 0  # changes decoded so far
    for e in range(N_CTX):
        gstart[e] = kk_
        if cnt[e] == 0:
            continue
        if gf[e, END] == 0:
            return grank, vsym, bneg, bmag, gstart, E_CTX
        rank = np.int64(-1)
        while True:
            slot = x & mk
            b = np.int64(glut[e, slot])
            x = np.int64(gf[e, b]) * (x >> rans.PREC) + slot - np.int64(gc[e, b])
            if x < rans.L:
                x <<= 16
                if at < nw:
                    x |= np.int64(words[at])
                at += 1
            if b == END:
                break
            g = np.int64(0)
            if b >= 1:
                bits, x, at = rans.read_bits(x, at, words, nw, b - 1)
                g = np.int64(bits) | (np.int64(1) << (b - 1))
            rank += g + 1
            if rank >= cnt[e] or kk_ >= count:
                return grank, vsym, bneg, bmag, gstart, rans.E_GAP
            grank[kk_] = rank
            if vf[e, rans.RAW + 1] == 0:  # no value model for this context (sentinel column: see tables)
                return grank, vsym, bneg, bmag, gstart, E_CTX
            slot = x & mk
            s = np.int64(vlut[e, slot])
            x = np.int64(vf[e, s]) * (x >> rans.PREC) + slot - np.int64(vc[e, s])
            if x < rans.L:
                x <<= 16
                if at < nw:
                    x |= np.int64(words[at])
                at += 1
            vsym[kk_] = s
            if s == rans.BIG:
                v8 = x & 0xFF
                x >>= 8
                if x < rans.L:
                    x <<= 16
                    if at < nw:
                        x |= np.int64(words[at])
                    at += 1
                q8 = v8 >> 1
                if q8 > 64:
                    return grank, vsym, bneg, bmag, gstart, rans.E_SYMBOL
                m = np.uint64(0)
                if q8 >= 1:
                    m, x, at = rans.read_bits(x, at, words, nw, q8 - 1)
                    m |= np.uint64(1) << np.uint64(q8 - 1)
                bneg[kk_] = (v8 & 1) == 1
                bmag[kk_] = m
            kk_ += 1
    gstart[N_CTX] = kk_
    if at > nw:
        return grank, vsym, bneg, bmag, gstart, rans.E_SHORT
    if at != nw or x != rans.L:
        return grank, vsym, bneg, bmag, gstart, rans.E_END
    if kk_ != count:
        return grank, vsym, bneg, bmag, gstart, rans.E_GAP
    return grank, vsym, bneg, bmag, gstart, rans.OK


@numba.njit(cache=True, nogil=True)
def _decode(words, base, count, shift, mask, gf, gc, glut, vf, vc, vlut):
    """-> (positions, value symbols, BIG signs, BIG magnitudes (per change, natural order), error).

    Two passes over ``base`` (a histogram of contexts per quarter of the chunk, then the merge that turns
    each group's ranks into positions), each over the Q quarters side by side, so that the counters of
    consecutive words (often of one context) do not form one long chain of dependent increments."""
    n = base.size
    pos = np.empty(count, dtype=np.int64)
    vsym_n = np.empty(count, dtype=np.uint8)
    bneg_n = np.zeros(count, dtype=np.bool_)
    bmag_n = np.zeros(count, dtype=np.uint64)
    bq = np.empty(Q + 1, dtype=np.int64)
    for q in range(Q + 1):
        bq[q] = n * q // Q
    short = n // Q  # every quarter has at least this many words (and at most one more)
    cntq = np.zeros((Q, N_CTX), dtype=np.int64)
    for j in range(short):
        for q in range(Q):
            cntq[q, (np.int64(base[bq[q] + j]) >> shift) & mask] += 1
    for q in range(Q):
        for i in range(bq[q] + short, bq[q + 1]):
            cntq[q, (np.int64(base[i]) >> shift) & mask] += 1
    cnt = np.zeros(N_CTX, dtype=np.int64)
    for q in range(Q):
        for e in range(N_CTX):
            cnt[e] += cntq[q, e]
    grank, vsym, bneg, bmag, gstart, err = decode_groups(words, cnt, count, gf, gc, glut, vf, vc, vlut)
    if err != rans.OK:
        return pos, vsym_n, bneg_n, bmag_n, err
    # merge, per quarter: its first change of group e is the first decoded rank at or past the words of
    # group e in the quarters before it; the changes of quarter q follow those of the quarters before it
    ptr = np.empty((Q, N_CTX), dtype=np.int64)
    end = np.empty((Q, N_CTX), dtype=np.int64)
    nxt = np.full((Q, N_CTX), -1, dtype=np.int64)
    seen = np.empty((Q, N_CTX), dtype=np.int64)
    outq = np.zeros(Q + 1, dtype=np.int64)
    for e in range(N_CTX):
        lo = gstart[e]
        hi = gstart[e + 1]
        pre = 0
        p = lo
        for q in range(Q):
            seen[q, e] = pre
            while p < hi and grank[p] < pre:
                p += 1
            ptr[q, e] = p
            pre += cntq[q, e]
        for q in range(Q):
            end[q, e] = ptr[q + 1, e] if q + 1 < Q else hi
            if ptr[q, e] < end[q, e]:
                nxt[q, e] = grank[ptr[q, e]]
            outq[q + 1] += end[q, e] - ptr[q, e]
    for q in range(Q):
        outq[q + 1] += outq[q]
    out = outq[:Q].copy()
    for j in range(short + 1):
        for q in range(Q):
            i = bq[q] + j
            if j == short and i >= bq[q + 1]:  # the quarters one word longer than the rest
                continue
            e = (np.int64(base[i]) >> shift) & mask
            c = seen[q, e]
            seen[q, e] = c + 1
            if c == nxt[q, e]:
                p = ptr[q, e]
                o = out[q]
                pos[o] = i
                vsym_n[o] = vsym[p]
                bneg_n[o] = bneg[p]
                bmag_n[o] = bmag[p]
                out[q] = o + 1
                p += 1
                ptr[q, e] = p
                nxt[q, e] = grank[p] if p < end[q, e] else -1
    for q in range(Q):
        if out[q] != outq[q + 1]:
            return pos, vsym_n, bneg_n, bmag_n, rans.E_GAP
    return pos, vsym_n, bneg_n, bmag_n, rans.OK


# -- tables ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class CondTables:
    """A blob's per-context models G_e and V_e: dense arrays over all 256 contexts (absent = zeros).

    ``vf`` has one sentinel column past V's alphabet: nonzero where V_e exists."""

    gf: np.ndarray  # int64 [256, 50]
    gc: np.ndarray  # int64 [256, 51]
    glut: np.ndarray  # uint8 [256, 4096]
    vf: np.ndarray  # int64 [256, 19]
    vc: np.ndarray
    vlut: np.ndarray
    gfreq: dict[int, np.ndarray]
    vfreq: dict[int, np.ndarray]

    @classmethod
    def from_freqs(cls, gfreq: dict[int, np.ndarray], vfreq: dict[int, np.ndarray]) -> "CondTables":
        gf = np.zeros((N_CTX, N_G), np.int64)
        gc = np.zeros((N_CTX, N_G + 1), np.int64)
        glut = np.zeros((N_CTX, rans.M), np.uint8)
        vf = np.zeros((N_CTX, rans.N_VAL + 1), np.int64)
        vc = np.zeros((N_CTX, rans.N_VAL + 1), np.int64)
        vlut = np.zeros((N_CTX, rans.M), np.uint8)
        for e, f in gfreq.items():
            gf[e] = f
            gc[e, 1:] = np.cumsum(f)
            glut[e] = np.repeat(np.arange(N_G, dtype=np.uint8), f)
        for e, f in vfreq.items():
            vf[e, : rans.N_VAL] = f
            vf[e, rans.N_VAL] = 1
            vc[e, 1:] = np.cumsum(f)
            vlut[e] = np.repeat(np.arange(rans.N_VAL, dtype=np.uint8), f)
        return cls(gf=gf, gc=gc, glut=glut, vf=vf, vc=vc, vlut=vlut, gfreq=dict(gfreq), vfreq=dict(vfreq))

    def to_bytes(self) -> np.ndarray:
        """The ``ansxm`` stream (varints): the number of contexts, then per context ascending: ``e``,
        G's nonzero (symbol, frequency) pairs (count first), V's likewise (0 pairs: no V_e)."""
        out = [len(self.gfreq)]
        for e in sorted(self.gfreq):
            out.append(e)
            for f in (self.gfreq[e], self.vfreq.get(e)):
                nz = np.flatnonzero(f) if f is not None else np.empty(0, np.int64)
                out.append(nz.size)
                for s in nz:
                    out += [int(s), int(f[s])]
        return encode_varints(np.array(out, dtype=np.uint64))

    @classmethod
    def parse(cls, data: np.ndarray, stream: str = "ansxm") -> "CondTables":
        """The tables of stream ``stream`` (``ansxm``, or ``anshm``: the same layout), checked."""
        vals = _varints_all(data, stream)
        at = 0

        def nxt() -> int:
            nonlocal at
            if at >= vals.size:
                raise FormatError(f"{stream} stream ends early")
            at += 1
            return int(vals[at - 1])

        n = nxt()
        if n > N_CTX:
            raise FormatError(f"{stream} stream: {n} contexts (at most {N_CTX})")
        gfreq: dict[int, np.ndarray] = {}
        vfreq: dict[int, np.ndarray] = {}
        last = -1
        for _ in range(n):
            e = nxt()
            if not last < e < N_CTX:
                raise FormatError(f"{stream} stream: context {e} out of order or range")
            last = e
            for name, size, into in (("G", N_G, gfreq), ("V", rans.N_VAL, vfreq)):
                pairs = nxt()
                if pairs > size:
                    raise FormatError(f"{stream} stream: model {name}_{e} has {pairs} symbols (at most {size})")
                if pairs == 0:
                    if name == "G":
                        raise FormatError(f"{stream} stream: model G_{e} is empty")
                    continue
                f = np.zeros(size, np.int64)
                prev = -1
                for _ in range(pairs):
                    s, fr = nxt(), nxt()
                    if not prev < s < size or not 1 <= fr <= rans.M:
                        raise FormatError(f"{stream} stream: model {name}_{e}: bad symbol {s} or frequency {fr}")
                    prev = s
                    f[s] = fr
                if int(f.sum()) != rans.M:
                    raise FormatError(f"{stream} stream: model {name}_{e}'s frequencies sum to {int(f.sum())}, "
                                      f"expected {rans.M}")
                into[e] = f
        if at != vals.size:
            raise FormatError(f"{stream} stream has values past its last context")
        return cls.from_freqs(gfreq, vfreq)


def _varints_all(data: np.ndarray, stream: str) -> np.ndarray:
    ends = int(np.count_nonzero(data < 0x80))
    if data.size and data[-1] >= 0x80:
        raise FormatError(f"{stream} stream: a varint runs past the end")
    try:
        return decode_varints(data, ends)
    except FormatError as e:
        raise FormatError(f"{stream} stream: {e}") from None


# -- the blob-level coder -------------------------------------------------------------------------

class CondBlobCoder:
    """Collects the ansx chunks of the open blob; :meth:`finish` counts, writes the tables and codes them.

    Not thread-safe (one per :class:`~deltasync.codec.ChunkPacker`)."""

    MODE, TABLES = "ansx", "ansxm"  # the chunks' mode and the blob's streams (messages, tables)

    def __init__(self) -> None:
        self._chunks: list[tuple] = []
        self._gcount = np.zeros((N_CTX, N_G), dtype=np.int64)
        self._vcount = np.zeros((N_CTX, rans.N_VAL), dtype=np.int64)

    def add(self, record: dict, ranks: tuple[np.ndarray, np.ndarray, np.ndarray], changes: Changes) -> np.ndarray:
        """Queue one chunk (``ranks`` = :func:`chunk_ranks`); sets ``record``'s mode and ``nr`` now and
        its ``na`` when the blob closes. Returns the raw words for the ``raw{w}`` stream."""
        grp, rank, cnt = ranks
        if grp.size != len(changes):
            raise ValueError(f"{grp.size} ranks for {len(changes)} changes")
        sym, bigneg, bigmag, raw = step_symbols(changes, rans.SMALL, rans.BIG, rans.RAW)
        order, gaps, bkt, gcount, vcount = _group_major(grp, rank, cnt, sym)
        self._gcount += gcount
        self._vcount += vcount
        bigidx = np.cumsum(sym == rans.BIG) - 1
        record.update(mode=self.MODE, na=0, nr=int(raw.size))
        self._chunks.append((record, order, grp, gaps, bkt, sym, bigneg, bigmag, bigidx, cnt))
        return raw

    def finish(self, writer) -> None:
        """Append the tables (``ansxm``) and each queued chunk's message (``ansx``, in chunk order) to
        ``writer``; reset."""
        if not self._chunks:
            return
        gfreq = {int(e): rans.normalize(self._gcount[e]) for e in np.flatnonzero(self._gcount.sum(1))}
        vfreq = {int(e): rans.normalize(self._vcount[e]) for e in np.flatnonzero(self._vcount.sum(1))}
        tables = CondTables.from_freqs(gfreq, vfreq)
        writer.append(self.TABLES, tables.to_bytes())
        for record, order, grp, gaps, bkt, sym, bigneg, bigmag, bigidx, cnt in self._chunks:
            words = _encode(order, grp, gaps, bkt, sym, bigneg, bigmag, bigidx, cnt,
                            tables.gf, tables.gc, tables.vf, tables.vc)
            record["na"] = int(words.size)
            writer.append(self.MODE, words.astype("<u2").view(np.uint8))
        self.__init__()


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingMessage:
    """A context-grouped chunk (``ansx``, ``ansh``) as read from its blob: its message and raw words, decoded
    once what gives its groups is at hand."""

    tables: CondTables
    words: np.ndarray  # uint16 message
    raw: np.ndarray  # raw words of the chunk
    count: int
    start: int
    length: int
    word_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingChanges(PendingMessage):
    """An ``ansx`` chunk decoded as far as it goes without the base: :meth:`decode` finishes it."""

    dtype: str

    def decode(self, base: np.ndarray) -> Changes:
        """Changes (absolute positions) given the chunk's ``length`` old words (unsigned, host)."""
        spec = context_spec(self.dtype)
        if base.size != self.length or base.dtype.itemsize != self.word_size:
            raise FormatError(f"ansx chunk: needs its {self.length} base words of {self.word_size} bytes, "
                              f"given {base.size} of {base.dtype.itemsize}")
        shift, mask = spec
        t = self.tables
        pos, sym, bneg, bmag, err = _decode(self.words, base, self.count, shift, mask,
                                            t.gf, t.gc, t.glut, t.vf, t.vc, t.vlut)
        if err != rans.OK:
            raise FormatError(f"ansx chunk: {_ERRORS.get(err, f'error {err}')}")
        big = sym == rans.BIG
        return changes_from_symbols(pos + self.start, sym, bneg[big], bmag[big], self.raw, self.word_size,
                                    rans.SMALL, rans.BIG, rans.RAW)
