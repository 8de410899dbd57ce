"""History-conditioned coding: a delta's positions modelled by the deltas before it, O(changed) at both ends.

Why: under AdamW a bf16 word changes when its fp32 master crosses a rounding boundary, and the masters
move at a steady pace, so the words that changed in the last few steps are the ones most likely to change
in this one (on real MiniLM traces at 0.3% changed, a word that changed one step ago changes again with
~20% probability, 60x the average). The base-conditioned coding (:mod:`deltasync.conditioned`) gets the
same kind of gain from the old words' exponents, but a decoder must read every old word of each changed
chunk (O(chunk), and impossible on an engine rank that holds only a shard of the chunk). The history is
what both ends already hold: the positions each of the last ``depth`` deltas changed.

The model, per chunk: every position has a context, its **age** ``a`` (1 = changed by the previous delta,
..., ``depth``; 0 = not changed by any of them, "cold"). The chunk's changes are coded group by group
exactly as ``ansx`` codes its exponent groups (the same symbols, per-context models G_a and V_a, rANS,
tables: :func:`deltasync.conditioned.decode_groups`): the gap between consecutive ranks inside the group,
then the value symbol, then END. Only the groups differ: a hot group's members are the history's positions
of that age (an explicit sorted list), the cold group is every other position of the chunk. So the
encoder's ranks come from one merge of the changes with the history (:func:`history_ranks`), and the
decoder's positions from a merge of the decoded ranks with it (:func:`decode_chunk`): O(history + changes)
per chunk, never a read of the base.

A :class:`ChunkHistory` is a chunk's recent positions (relative to the chunk, sorted) and their ages;
:func:`advance` turns it into the next step's from the positions a delta changed.

This module is the codec (kernels, round trip, the bytes it reaches: ``benchmarks/bench_codec_ratio.py``).
It is not yet a blob mode: publishing a stream with it needs both ends to keep the history of the
deltas since the last keyframe (docs/ARCHITECTURE.md, "History-conditioned coding").
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from .conditioned import E_CTX, N_CTX, CondBlobCoder, CondTables, decode_groups
from .errors import FormatError
from .kernels import rans
from .values import Changes, changes_from_symbols

MAX_DEPTH = N_CTX - 1  # ages 1..depth are contexts; 0 is the cold group

_ERRORS = {
    rans.E_SHORT: "the message ends before its last change (truncated or corrupt)",
    rans.E_SYMBOL: "a BIG step's bucket is out of range",
    rans.E_END: "the message has words or state left after its last change (corrupt)",
    rans.E_GAP: "a rank leaves its age group, or the changes do not add up (corrupt, or decoded with the wrong "
                "history)",
    E_CTX: "an age group of the history has no model in this blob (decoded with the wrong history?)",
}


@dataclass(frozen=True, slots=True)
class ChunkHistory:
    """A chunk's recent changes: ``positions`` (int64, relative to the chunk, sorted, unique) and each one's
    ``ages`` (uint8, 1 = changed by the last delta)."""

    positions: np.ndarray
    ages: np.ndarray

    @classmethod
    def empty(cls) -> ChunkHistory:
        return cls(np.empty(0, np.int64), np.empty(0, np.uint8))

    def __len__(self) -> int:
        return int(self.positions.size)


# -- kernels --------------------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def _advance(hpos, hage, changed, depth):
    """The history after a delta that changed ``changed`` (sorted): those age 1, the rest one older, and
    those older than ``depth`` dropped."""
    out_p = np.empty(hpos.size + changed.size, dtype=np.int64)
    out_a = np.empty(hpos.size + changed.size, dtype=np.uint8)
    i = j = o = 0
    while i < hpos.size or j < changed.size:
        if j < changed.size and (i >= hpos.size or changed[j] <= hpos[i]):
            if i < hpos.size and hpos[i] == changed[j]:
                i += 1
            out_p[o] = changed[j]
            out_a[o] = 1
            o += 1
            j += 1
        else:
            a = np.int64(hage[i]) + 1
            if a <= depth:
                out_p[o] = hpos[i]
                out_a[o] = a
                o += 1
            i += 1
    return out_p[:o].copy(), out_a[:o].copy()


@numba.njit(cache=True, nogil=True)
def history_ranks(rel, hpos, hage, n):
    """Each change's (age group, rank inside it) and the group sizes: ``rel`` the chunk's sorted change
    positions (relative), ``hpos``/``hage`` its history, ``n`` its length. The shape of
    :func:`deltasync.conditioned.chunk_ranks`' answer, so :class:`~deltasync.conditioned.CondBlobCoder`
    codes it."""
    k = rel.size
    h = hpos.size
    grp = np.empty(k, dtype=np.uint8)
    rank = np.empty(k, dtype=np.int64)
    cnt = np.zeros(N_CTX, dtype=np.int64)
    for t in range(h):
        cnt[np.int64(hage[t])] += 1
    cnt[0] = n - h
    seen = np.zeros(N_CTX, dtype=np.int64)  # history positions of each age before the current change
    j = 0
    for t in range(k):
        p = rel[t]
        while j < h and hpos[j] < p:
            seen[np.int64(hage[j])] += 1
            j += 1
        if j < h and hpos[j] == p:
            a = np.int64(hage[j])
            grp[t] = a
            rank[t] = seen[a]
        else:
            grp[t] = 0
            rank[t] = p - j
    return grp, rank, cnt


@numba.njit(cache=True, nogil=True)
def _decode(words, hpos, hage, n, count, gf, gc, glut, vf, vc, vlut):
    """-> (positions, value symbols, BIG signs, BIG magnitudes, per change in position order; error)."""
    h = hpos.size
    pos = np.empty(count, dtype=np.int64)
    vsym_n = np.empty(count, dtype=np.uint8)
    bneg_n = np.zeros(count, dtype=np.bool_)
    bmag_n = np.zeros(count, dtype=np.uint64)
    cnt = np.zeros(N_CTX, dtype=np.int64)
    for t in range(h):
        a = np.int64(hage[t])
        if a == 0 or (t and hpos[t] <= hpos[t - 1]) or hpos[t] < 0 or hpos[t] >= n:
            return pos, vsym_n, bneg_n, bmag_n, rans.E_GAP
        cnt[a] += 1
    cnt[0] = n - h
    grank, vsym, bneg, bmag, gstart, err = decode_groups(words, cnt, count, gf, gc, glut, vf, vc, vlut)
    if err != rans.OK:
        return pos, vsym_n, bneg_n, bmag_n, err
    # hot changes: mark the history entry each one lands on (its rank-th of its age)
    hit = np.full(h, -1, dtype=np.int64)
    if h:
        start = np.zeros(N_CTX + 1, dtype=np.int64)
        for t in range(h):
            start[np.int64(hage[t]) + 1] += 1
        for a in range(N_CTX):
            start[a + 1] += start[a]
        at = start[:N_CTX].copy()
        where = np.empty(h, dtype=np.int64)  # age-major order -> index in the history
        for t in range(h):
            a = np.int64(hage[t])
            where[at[a]] = t
            at[a] += 1
        for a in range(1, N_CTX):
            for c in range(gstart[a], gstart[a + 1]):
                hit[where[start[a] + grank[c]]] = c
    # merge the cold changes (the rank-th position outside the history) with the hot ones, in position order
    o = 0
    j = 0  # history entries before the current cold position
    for c in range(gstart[0], gstart[1]):
        r = grank[c]
        p = r + j
        while j < h and hpos[j] <= p:
            if hit[j] >= 0:
                d = hit[j]
                pos[o] = hpos[j]
                vsym_n[o] = vsym[d]
                bneg_n[o] = bneg[d]
                bmag_n[o] = bmag[d]
                o += 1
            j += 1
            p = r + j
        pos[o] = p
        vsym_n[o] = vsym[c]
        bneg_n[o] = bneg[c]
        bmag_n[o] = bmag[c]
        o += 1
    while j < h:
        if hit[j] >= 0:
            d = hit[j]
            pos[o] = hpos[j]
            vsym_n[o] = vsym[d]
            bneg_n[o] = bneg[d]
            bmag_n[o] = bmag[d]
            o += 1
        j += 1
    if o != count:
        return pos, vsym_n, bneg_n, bmag_n, rans.E_GAP
    return pos, vsym_n, bneg_n, bmag_n, rans.OK


# -- the Python face ------------------------------------------------------------------------------

def advance(history: ChunkHistory, changed_rel: np.ndarray, depth: int) -> ChunkHistory:
    """The chunk's history after a delta that changed ``changed_rel`` (sorted positions relative to it)."""
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"history depth {depth} out of 1..{MAX_DEPTH}")
    p, a = _advance(history.positions, history.ages, np.ascontiguousarray(changed_rel, np.int64), depth)
    return ChunkHistory(p, a)


def ranks(changes: Changes, start: int, length: int, history: ChunkHistory):
    """:func:`history_ranks` of one chunk's changes (absolute positions, chunk ``[start, start + length)``)."""
    return history_ranks(changes.positions - start, history.positions, history.ages, length)


class HistoryBlobCoder(CondBlobCoder):
    """:class:`~deltasync.conditioned.CondBlobCoder` fed with age groups (:func:`ranks`) instead of exponent
    groups: the same tables and messages, under their own stream names."""

    MODE, TABLES = "ansh", "anshm"


def decode_chunk(tables: CondTables, words: np.ndarray, raw: np.ndarray, count: int, start: int, length: int,
                 word_size: int, history: ChunkHistory) -> Changes:
    """A history-coded chunk's changes (absolute positions), given the history it was coded with."""
    pos, sym, bneg, bmag, err = _decode(words, history.positions, history.ages, length, count,
                                        tables.gf, tables.gc, tables.glut, tables.vf, tables.vc, tables.vlut)
    if err != rans.OK:
        raise FormatError(f"ansh chunk: {_ERRORS.get(err, f'error {err}')}")
    big = sym == rans.BIG
    return changes_from_symbols(pos + start, sym, bneg[big], bmag[big], raw, word_size,
                                rans.SMALL, rans.BIG, rans.RAW)
