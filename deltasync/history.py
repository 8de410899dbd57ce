"""History-conditioned coding: a delta's positions modelled by the deltas before it, O(changed) at both ends.

Why: under AdamW a bf16 word changes when its fp32 master crosses a rounding boundary, and the masters
move at a steady pace, so the words that changed in the last few steps are the ones most likely to change
in this one (on real MiniLM traces at 0.3% changed, a word that changed one step ago changes again with
~20% probability, 60x the average). The base-conditioned coding (:mod:`deltasync.conditioned`) gets the
same kind of gain from the old words' exponents, but a decoder must read every old word of each changed
chunk (O(chunk), and impossible on an engine rank that holds only a shard of the chunk). The history is
what both ends already hold: the positions each of the last ``depth`` deltas changed.

The model, per chunk: every position the history holds has a context from its **age** (deltas since its
last change, 1..``depth``) and the **interval** between its last two changes (a master weight moving at a
steady pace changes at a steady interval, so the pair says how due the word is): 30 classes
(:meth:`ChunkHistory.contexts`); every other position is in the cold group, context 0. The chunk's changes
are coded group by group exactly as ``ansx`` codes its exponent groups (the same symbols, per-context
models G_c and V_c, rANS, tables: :func:`deltasync.conditioned.decode_groups`): the gap between
consecutive ranks inside the group, then the value symbol, then END. Only the groups differ: a hot group's
members are the history's positions of that context (an explicit sorted list), the cold group is every
other position of the chunk. So the
encoder's ranks come from one merge of the changes with the history (:func:`history_ranks`), and the
decoder's positions from a merge of the decoded ranks with it (:func:`decode_chunk`): O(history + changes)
per chunk, never a read of the base.

A :class:`ChunkHistory` is a chunk's recent positions (relative to the chunk, sorted) with their ages and
previous ages; :func:`advance` turns it into the next step's from the positions a delta changed.

This module is the codec (kernels, round trip, the bytes it reaches: ``benchmarks/bench_codec_ratio.py``).
It is not yet a blob mode: publishing a stream with it needs both ends to keep the history of the
deltas since the last keyframe (docs/ARCHITECTURE.md, "History-conditioned coding").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numba
import numpy as np

from .conditioned import E_CTX, N_CTX, CondBlobCoder, CondTables, PendingMessage, context_order, decode_groups
from .dtypes import dtype_info, word_count
from .errors import BaseMismatchError, FormatError
from .kernels import rans
from .values import Changes, changes_from_symbols

MAX_DEPTH = N_CTX - 1  # ages 1..depth are contexts; 0 is the cold group

_ERRORS = {
    rans.E_SHORT: "the message ends before its last change (truncated or corrupt)",
    rans.E_SYMBOL: "a BIG step's bucket is out of range",
    rans.E_END: "the message has words or state left after its last change (corrupt)",
    rans.E_GAP: "a rank leaves its context group, or the changes do not add up (corrupt, or decoded with the wrong "
                "history)",
    E_CTX: "a context group of the history has no model in this blob (decoded with the wrong history?)",
}


@dataclass(frozen=True, slots=True)
class ChunkHistory:
    """A chunk's recent changes: ``positions`` (int64, relative to the chunk, sorted, unique), each one's
    ``ages`` (uint8: deltas since its last change, 1 = the last delta) and ``prevs`` (uint8: deltas since the
    change before that, 0 where the history holds only one)."""

    positions: np.ndarray
    ages: np.ndarray
    prevs: np.ndarray
    ctx: np.ndarray | None = None  # :meth:`contexts`, where the maker computed them already

    @classmethod
    def empty(cls) -> ChunkHistory:
        return cls(np.empty(0, np.int64), np.empty(0, np.uint8), np.empty(0, np.uint8))

    def __len__(self) -> int:
        return int(self.positions.size)

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.ages.nbytes + self.prevs.nbytes

    def contexts(self) -> np.ndarray:
        """Each position's coding context, 1..:data:`N_HOT`: its age's class (1, 2, 3-4, 5-8, 9+) and the
        class of the interval between its last two changes (none, 1, 2, 3-4, 5-8, 9+). A word whose master
        weight moves at a steady pace changes at a steady interval: the pair says how due it is."""
        return self.ctx if self.ctx is not None else _contexts(self.ages, self.prevs, _CLASS)


# -- kernels --------------------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def _advance(hpos, hlast, hgap, changed, version, depth):
    """The history after the delta into ``version`` changed ``changed`` (sorted, unique). Columns: ``hlast`` the
    version of a position's last change modulo 256, ``hgap`` the deltas between its last two changes (0: none
    within the depth). A changed position's last change becomes ``version`` (its change before, if within
    ``depth``, gives its gap); an entry whose last change is ``depth`` or more deltas old is dropped, and a change
    before it that old forgotten. Ages stay under 256 (depth <= 255), so versions modulo 256 tell them apart."""
    m = hpos.size + changed.size
    out_p = np.empty(m, dtype=hpos.dtype)
    out_l = np.empty(m, dtype=np.uint8)
    out_g = np.empty(m, dtype=np.uint8)
    v8 = version & 0xFF
    i = j = o = 0
    while i < hpos.size or j < changed.size:
        if j < changed.size and (i >= hpos.size or changed[j] <= hpos[i]):
            gap = 0
            if i < hpos.size and hpos[i] == changed[j]:
                age = (v8 - np.int64(hlast[i])) & 0xFF  # deltas since its last change, as of ``version``
                if age < depth:
                    gap = age
                i += 1
            out_p[o] = changed[j]
            out_l[o] = v8
            out_g[o] = gap
            o += 1
            j += 1
        else:
            age = (v8 - np.int64(hlast[i])) & 0xFF
            if age < depth:
                g = np.int64(hgap[i])
                out_p[o] = hpos[i]
                out_l[o] = hlast[i]
                out_g[o] = g if g and age + g < depth else 0
                o += 1
            i += 1
    return out_p[:o].copy(), out_l[:o].copy(), out_g[:o].copy()


#: age (steps since the last change, 1..) -> class 1..5: 1, 2, 3-4, 5-8, 9+; likewise the interval between
#: the last two changes (0: one change in the history) -> 0..5
_CLASS = np.array([0, 1, 2, 3, 3, 4, 4, 4, 4] + [5] * 247, dtype=np.uint8)
N_HOT = 30  # contexts 1..30 = (age class - 1) * 6 + interval class + 1; 0 is the cold group


@numba.njit(cache=True, nogil=True)
def _contexts(hage, hprev, cls):
    out = np.empty(hage.size, dtype=np.uint8)
    for t in range(hage.size):
        a = np.int64(hage[t])
        v = np.int64(hprev[t])
        ic = cls[v - a] if v > a else 0
        out[t] = (np.int64(cls[a]) - 1) * 6 + ic + 1
    return out


@numba.njit(cache=True, nogil=True)
def _chunk_view(hpos, hlast, hgap, lo, hi, base, v8, cls):
    """Entries [lo, hi) of a :class:`StateHistory` as one chunk sees them: positions relative to ``base``, ages,
    previous ages and contexts, in one pass."""
    n = hi - lo
    pos = np.empty(n, dtype=np.int64)
    ages = np.empty(n, dtype=np.uint8)
    prevs = np.empty(n, dtype=np.uint8)
    ctx = np.empty(n, dtype=np.uint8)
    for t in range(n):
        k = lo + t
        a = ((v8 - np.int64(hlast[k])) & 0xFF) + 1
        g = np.int64(hgap[k])
        pos[t] = np.int64(hpos[k]) - base
        ages[t] = a
        prevs[t] = a + g if g else 0
        ctx[t] = (np.int64(cls[a]) - 1) * 6 + (cls[g] if g else 0) + 1
    return pos, ages, prevs, ctx


@numba.njit(cache=True, nogil=True)
def history_ranks(rel, hpos, hctx, n):
    """Each change's (age group, rank inside it) and the group sizes: ``rel`` the chunk's sorted change
    positions (relative), ``hpos`` its history's positions, ``n`` its length. The shape of
    :func:`deltasync.conditioned.chunk_ranks`' answer, so :class:`~deltasync.conditioned.CondBlobCoder`
    codes it. ``hctx``: each history position's context (1..255; :func:`contexts`)."""
    k = rel.size
    h = hpos.size
    grp = np.empty(k, dtype=np.uint8)
    rank = np.empty(k, dtype=np.int64)
    cnt = np.zeros(N_CTX, dtype=np.int64)
    for t in range(h):
        cnt[np.int64(hctx[t])] += 1
    cnt[0] = n - h
    seen = np.zeros(N_CTX, dtype=np.int64)  # history positions of each context before the current change
    j = 0
    for t in range(k):
        p = rel[t]
        while j < h and hpos[j] < p:
            seen[np.int64(hctx[j])] += 1
            j += 1
        if j < h and hpos[j] == p:
            a = np.int64(hctx[j])
            grp[t] = a
            rank[t] = seen[a]
        else:
            grp[t] = 0
            rank[t] = p - j
    return grp, rank, cnt


@numba.njit(cache=True, nogil=True)
def _decode(words, hpos, hctx, n, count, gf, gc, glut, vf, vc, vlut):
    """-> (positions, value symbols, BIG signs, BIG magnitudes, per change in position order; error)."""
    h = hpos.size
    pos = np.empty(count, dtype=np.int64)
    vsym_n = np.empty(count, dtype=np.uint8)
    bneg_n = np.zeros(count, dtype=np.bool_)
    bmag_n = np.zeros(count, dtype=np.uint64)
    cnt = np.zeros(N_CTX, dtype=np.int64)
    for t in range(h):
        a = np.int64(hctx[t])
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
        start, where = context_order(hctx)  # context-major order -> index in the history
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

def ranks(changes: Changes, start: int, length: int, history: ChunkHistory):
    """:func:`history_ranks` of one chunk's changes (absolute positions, chunk ``[start, start + length)``)."""
    return history_ranks(changes.positions - start, history.positions, history.contexts(), length)


class HistoryBlobCoder(CondBlobCoder):
    """:class:`~deltasync.conditioned.CondBlobCoder` fed with age groups (:func:`ranks`) instead of exponent
    groups: the same tables and messages, under their own stream names."""

    MODE, TABLES = "ansh", "anshm"


def decode_chunk(tables: CondTables, words: np.ndarray, raw: np.ndarray, count: int, start: int, length: int,
                 word_size: int, history: ChunkHistory) -> Changes:
    """A history-coded chunk's changes (absolute positions), given the history it was coded with."""
    pos, sym, bneg, bmag, err = _decode(words, history.positions, history.contexts(), length, count,
                                        tables.gf, tables.gc, tables.glut, tables.vf, tables.vc, tables.vlut)
    if err != rans.OK:
        raise FormatError(f"ansh chunk: {_ERRORS.get(err, f'error {err}')}")
    big = sym == rans.BIG
    return changes_from_symbols(pos + start, sym, bneg[big], bmag[big], raw, word_size,
                                rans.SMALL, rans.BIG, rans.RAW)


# -- a stream's history ---------------------------------------------------------------------------

DEFAULT_DEPTH = 8  # deltas remembered: 16 buys ~1% more on real traces for ~1.5x the memory
HISTORY_META = "deltasync.history"  # manifest meta: "SINCE:DEPTH", the history a history-coded delta was coded with


class StateHistory:
    """One end's history of a stream: every position the deltas since version ``since`` changed within the last
    ``depth`` of them, with the versions of its last two changes, as three flat columns over the layout's words
    (tensors in name order, each at its offset): advancing by a delta is one compiled merge of its changed
    positions, O(history + changes), whatever the tensor count.

    Both ends hold one and must hold the same: the publisher advances it by each delta it publishes
    (:meth:`advance_diff`), a subscriber by each delta it applies (:meth:`advance_patches`); a history-coded
    delta names the history it was coded with (``meta[HISTORY_META]``, :meth:`check`). Memory: 6 bytes per
    position held (10 where the layout has 2**32 words or more): a position, the version of its last change
    modulo 256 and the gap to the change before; about ``depth`` x 0.6 x a step's changes are held on AdamW
    traces."""

    def __init__(self, layout: Mapping[str, tuple[str, Sequence[int]]], *, since: int,
                 depth: int = DEFAULT_DEPTH) -> None:
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"history depth {depth} out of 1..{MAX_DEPTH}")
        self.since, self.depth, self.version = int(since), int(depth), int(since)
        self.offsets: dict[str, int] = {}
        at = 0
        for name in sorted(layout):
            dt, shape = layout[name]
            self.offsets[name] = at
            at += word_count(tuple(shape), dtype_info(dt))
        self.words = at
        self.positions = np.empty(0, np.uint32 if at < 1 << 32 else np.int64)
        self.last = np.empty(0, np.uint8)  # version of the last change, modulo 256
        self.gap = np.empty(0, np.uint8)  # deltas between the last two changes (0: one change within the depth)

    def __len__(self) -> int:
        return int(self.positions.size)

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.last.nbytes + self.gap.nbytes

    def ages(self) -> np.ndarray:
        """Each position's age as the next delta sees it (1: changed by the last one taken in)."""
        return ((np.uint8(self.version & 0xFF) - self.last) + np.uint8(1)).astype(np.uint8)

    @property
    def meta(self) -> str:
        """``meta[HISTORY_META]`` of a delta coded with this history: ``"SINCE:DEPTH"``."""
        return f"{self.since}:{self.depth}"

    def check(self, manifest) -> None:
        """Raise unless ``manifest`` (history-coded) was coded with this history at its parent."""
        since, depth = history_meta(manifest)
        if manifest.version != manifest.parent + 1:  # a history takes in one delta a version
            raise FormatError(f"v{manifest.version}: a history-coded delta steps one version, not from "
                              f"v{manifest.parent}")
        if (since, depth) != (self.since, self.depth) or manifest.parent != self.version:
            raise BaseMismatchError(
                f"v{manifest.version} was coded with the history of the deltas since v{since} (depth {depth}) at "
                f"v{manifest.parent}; this end holds the history since v{self.since} (depth {self.depth}) at "
                f"v{self.version}: start again from a keyframe at or after v{since}")

    def copy(self) -> StateHistory:
        """Another history at the same point (the columns are shared: an advance replaces them, never writes)."""
        other = object.__new__(StateHistory)
        other.since, other.depth, other.version = self.since, self.depth, self.version
        other.offsets, other.words = self.offsets, self.words
        other.positions, other.last, other.gap = self.positions, self.last, self.gap
        return other

    def restricted(self, since: int, depth: int) -> StateHistory:
        """This history as an end that started at ``since`` (later than this one's) with ``depth`` (at most this
        one's) would hold it: the same positions, less what is older than either."""
        if since < self.since or depth > self.depth:
            raise ValueError(f"the history since v{self.since} (depth {self.depth}) cannot give the one since "
                             f"v{since} (depth {depth})")
        other = self.copy()
        other.since, other.depth = int(since), int(depth)
        span = self.version - max(since, self.version - depth)  # a change this many deltas old or more is left out
        age0 = self.ages().astype(np.int64) - 1  # deltas since the last change
        keep = age0 < span
        other.positions, other.last = self.positions[keep], self.last[keep]
        g = self.gap[keep]
        other.gap = np.where((g > 0) & (age0[keep] + g < span), g, 0).astype(np.uint8)
        return other

    def chunk(self, name: str, start: int, stop: int) -> ChunkHistory:
        """The history of words [start, stop) of tensor ``name``, as coding the next delta sees it."""
        base = self.offsets[name] + start
        lo, hi = np.searchsorted(self.positions, np.array((base, self.offsets[name] + stop), self.positions.dtype))
        pos, ages, prevs, ctx = _chunk_view(self.positions, self.last, self.gap, lo, hi, np.int64(base),
                                            np.int64(self.version & 0xFF), _CLASS)
        return ChunkHistory(pos, ages, prevs, ctx)

    def ranks(self, diff) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per changed chunk ``(tensor, start)`` of a :class:`~deltasync.diffs.StateDiff`: :func:`history_ranks`,
        what :func:`deltasync.codec.encode_diff` codes a history-coded delta with."""
        out = {}
        for name, chunks in diff.chunks.items():
            for c in chunks:
                h = self.chunk(name, c.start, c.stop)
                out[(name, c.start)] = history_ranks(c.positions - c.start, h.positions, h.contexts(), c.stop - c.start)
        return out

    def advance(self, version: int, changed: Iterable[tuple[str, np.ndarray]]) -> None:
        """Take in the delta into ``version`` (this history's version + 1): ``changed`` gives each tensor it
        changed with its changed word positions (sorted), in any tensor order."""
        if version != self.version + 1:
            raise ValueError(f"the history is at v{self.version}; it cannot take in the delta into v{version}")
        parts = sorted((self.offsets[name], pos) for name, pos in changed if len(pos))
        flat = np.concatenate([pos + off for off, pos in parts]) if parts else np.empty(0, np.int64)
        self.positions, self.last, self.gap = _advance(self.positions, self.last, self.gap,
                                                       flat.astype(self.positions.dtype, copy=False), np.int64(version),
                                                       np.int64(self.depth))
        self.version = version

    def advance_diff(self, version: int, diff) -> None:
        """:meth:`advance` by a :class:`~deltasync.diffs.StateDiff` (the publisher's side)."""
        self.advance(version, ((name, cs[0].positions if len(cs) == 1 else
                                np.concatenate([c.positions for c in cs])) for name, cs in diff.chunks.items() if cs))

    def advance_patches(self, version: int, patches: Mapping[str, Sequence]) -> None:
        """:meth:`advance` by a prepared delta's patches (name -> ChunkPatch list; the subscriber's side)."""
        def positions(chunks):
            ps = [c.as_changes().positions for c in chunks]
            return ps[0] if len(ps) == 1 else np.concatenate(ps)
        self.advance(version, ((name, positions(cs)) for name, cs in patches.items() if cs))


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingHistory(PendingMessage):
    """An ``ansh`` chunk as read from its blob: :meth:`decode` needs the history it was coded with."""

    def decode(self, history: ChunkHistory) -> Changes:
        return decode_chunk(self.tables, self.words, self.raw, self.count, self.start, self.length,
                            self.word_size, history)


class HistoryKeeper:
    """A subscriber's histories, for a driver that prepares the steps of a chain in order (ahead of applying
    them): the history at each version prepared and not yet left behind. Nothing is kept for a stream that is
    not history-coded; a keyframe starts an empty history at its version.

    :meth:`at` gives the history a history-coded delta needs (at its parent, restricted to its ``since`` and
    depth), or raises :class:`~deltasync.errors.BaseMismatchError` when this end did not take in the deltas it
    needs (it started later, or restarted): only a keyframe at or after the delta's ``since`` helps.
    :meth:`took` records the history after a prepared delta; :meth:`forget` drops what is older than the live
    version (a refetch or a resync goes back to a version still kept)."""

    def __init__(self, layout: Callable[[], Mapping[str, tuple[str, Sequence[int]]]]) -> None:
        self._layout = layout  # the target's layout, asked for when a history is first made
        self._at: dict[int, StateHistory | None] = {}  # version -> history there (None: empty since that version)

    def keyframe(self, version: int) -> None:
        self._at = {version: None}

    def has(self, manifest) -> bool:
        """Can :meth:`at` give ``manifest``'s history?"""
        try:
            self.at(manifest)
        except BaseMismatchError:
            return False
        return True

    def install(self, history: StateHistory) -> None:
        """Keep ``history`` (rebuilt from the deltas since its ``since``) as the one at its version."""
        self._at[history.version] = history

    def at(self, manifest) -> StateHistory:
        since, depth = history_meta(manifest)
        parent = manifest.parent
        have = self._at.get(parent, _MISSING)
        if since == parent and (have is None or have is _MISSING):
            return StateHistory(self._layout(), since=parent, depth=depth)  # what any end at the parent holds
        if isinstance(have, StateHistory) and have.since <= since and have.depth >= depth:
            return have if (have.since, have.depth) == (since, depth) else have.restricted(since, depth)
        held = ("no history" if have is _MISSING else "the history since v" + str(
            parent if have is None else have.since))
        raise BaseMismatchError(f"v{manifest.version} was coded with the history of the deltas since v{since} "
                                f"(depth {depth}); at v{parent} this subscriber holds {held}: start again from a "
                                f"keyframe at or after v{since}")

    def took(self, manifest, patches, history: StateHistory | None) -> None:
        """Record the history after the prepared delta ``manifest`` (``history``: the one it was prepared with,
        None for a delta of another coding: then only a stream already followed is advanced)."""
        if history is None:
            prev = self._at.get(manifest.parent)
            if not isinstance(prev, StateHistory):
                return
            history = prev
        after = history.copy()
        after.advance_patches(manifest.version, patches)
        self._at[manifest.version] = after

    def forget(self, live: int | None) -> None:
        """Drop the histories of versions before ``live`` (None: keep all)."""
        if live is not None:
            for v in [v for v in self._at if v < live]:
                del self._at[v]

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self._at.values() if h is not None)


_MISSING = object()
REBUILD_MAX = 256  # deltas a subscriber fetches to rebuild a history it did not keep, before a keyframe is cheaper


def history_meta(manifest) -> tuple[int, int]:
    """``(since, depth)`` of a history-coded delta (``meta[HISTORY_META]``), checked."""
    text = manifest.meta.get(HISTORY_META, "")
    try:
        since, depth = (int(x) for x in text.split(":"))
    except ValueError:
        raise FormatError(f"v{manifest.version}: history coding without a valid {HISTORY_META} ({text!r})") from None
    if not 1 <= depth <= MAX_DEPTH or since > manifest.parent:
        raise FormatError(f"v{manifest.version}: {HISTORY_META} {text!r} is out of range for parent v{manifest.parent}")
    return since, depth


CODING_AUTO = "auto"  # a publisher's default: :func:`default_coding`


#: the most tensors a state may have for :func:`default_coding` to pick the history coding: its encoder and decoder
#: work chunk by chunk (~0.1 ms of Python and compiled calls a changed chunk at each end), so at seed scale (70k
#: per-expert tensors) a step would cost ~8x the base-free coding's columnar path at the publisher, ~5x at a subscriber
AUTO_MAX_TENSORS = 4096


def default_coding(signer, *, budget=None, keeps_history: bool = True, tensors: int | None = None) -> str:
    """The coding a publisher uses when it is not told one: ``history`` for a lossless stream signed with Ed25519
    by a publisher that keeps its history (the in-process Publisher, the sidecar) — relays cannot sign a squash of
    such a stream, so its subscribers walk the chain anyway, and the history coding is ~15-25% smaller there at
    O(changed) cost on both ends (docs/FORMAT.md §4.5) — for a state of at most :data:`AUTO_MAX_TENSORS` tensors
    (``tensors``: None, not known yet); else ``base-free`` (relays squash it for late joiners)."""
    from .conditioned import CODING_BASE_FREE, CODING_HISTORY
    from .signing import Ed25519Signer

    small = tensors is None or tensors <= AUTO_MAX_TENSORS
    return CODING_HISTORY if isinstance(signer, Ed25519Signer) and budget is None and keeps_history and small \
        else CODING_BASE_FREE
