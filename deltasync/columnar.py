"""The columnar fast path of :func:`~deltasync.codec.diff_states` and :func:`~deltasync.codec.encode_diff`.

A state of 70k small tensors (a large MoE in per-expert naming) cost ~5x what the same bytes cost in a
few tensors: the per-chunk path builds a ``ChunkDiff`` per tensor, fingerprints it in Python, and calls
two compiled kernels, adds a dict record and a ``ChunkRef`` per chunk. Here, for the common case (host
tensors, the compiled kernels, blob format 2, packing by tensor), the diff stays as the compare kernel
returns it: one positions / old / new array per word size and a table of chunks (:class:`FlatDiff`,
numpy columns), fingerprints are summed with numpy over the tensors, and the encoder codes every blob's
chunks in a few compiled calls (:mod:`deltasync.kernels.ansbatch`), blobs on the caller's executor,
rendering the blob headers' chunk records as text and building the manifest's records from columns.

The output is the per-chunk path's, byte for byte (manifest and blobs; ``tests/core/test_columnar.py``).
A :class:`~deltasync.codec.StateDiff` made here still offers ``chunks`` (built on first use) to every
other consumer (budgets, the base-conditioned coding, format 1, packing by cells).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import itemgetter

import numpy as np

from . import headercache, kernels
from .blob import ANS_VERSIONS, blob_id, newline_joined, pack_blob, pack_chunk_columns
from . import diffs as _diffs
from .diffs import (SHARD_CELLS, ChunkDiff, Encoded, StateDiff, _cell, _check_layout, _on_host, _span_words,
                    tensor_chunk_ranges)
from .dtypes import HostTensor, dtype_info, numpy_word_dtype, word_sizes_in
from .errors import FormatError
from .entropy import _RAW_LIMIT, AnsTables
from .fingerprint import StateLines, _ascending
from .gcpause import gc_paused
from .kernels import rans
from .kernels.fpkeys import C0, MASK64, T_NP
from .lazytuple import lazy_zip
from .manifest import SPANS_META_PREFIX, BlobRef, LazyMeta, LazyRecords, Manifest, remember_compact
from .parts import map_parts
from .tensortable import fp_texts, new_chunk, new_record, pack_columns
from .tensorfile import HeaderColumns, header_columns, same_header
from .zctx import compressor

__all__ = ["ENABLED", "FlatDiff", "diff_flat", "encode_flat", "takes_flat"]

#: False: ``diff_states`` and ``encode_diff`` take the per-chunk path (tests compare the two, byte for byte)
ENABLED = True

PIECE_WORDS = 1 << 21  # words compared per task (whole chunks; small tensors share a task), as codec's
# Below this many tensors (chunks), the diff addresses words as the per-chunk path does and the chunks are coded
# by the per-chunk encoder: a small state gains nothing here, and a fresh process would load more kernels (~3 ms
# each)
FLAT_MIN = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatDiff:
    """A state diff as columns: the changed chunks in packing order (tensors by name, then by start), each
    a range ``[lo, hi)`` of one segment's positions / old / new arrays."""

    names: list[str]  # every tensor, sorted
    dtypes: list[str]  # each tensor's dtype name
    shapes: list[tuple[int, ...]]
    tensor: np.ndarray  # int64 per chunk: index into names
    start: np.ndarray  # int64 per chunk: word span [start, stop) in its tensor
    stop: np.ndarray
    word_size: np.ndarray  # int64 per chunk
    seg: np.ndarray  # int64 per chunk: its segment (one compare task's output, one word size)
    lo: np.ndarray  # int64 per chunk: its changes are [lo, hi) of its segment's arrays
    hi: np.ndarray
    segs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per segment: positions (int64, absolute in the
    # tensor), the unsigned words before and after; as the compare kernel returned them (not copied)
    words: np.ndarray  # int64 per tensor: its word count
    fp_before: np.ndarray  # uint64 per tensor: its fingerprint before (StateDiff.fps_before's, masked)
    fp_after: np.ndarray  # ... and after
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # state_fps(), once made

    def state_fps(self) -> tuple[str, str]:
        """The state fingerprints before and after (the manifest's ``state_fp_before``, ``state_fp``), hashed once:
        a publisher checks the first against the origin's head before the encode writes both."""
        got = self.memo.get("state_fps")
        if got is None:
            lines = self._lines()
            got = self.memo["state_fps"] = (lines.digest(self.fp_before), lines.digest(self.fp_after))
        return got

    def _lines(self) -> StateLines:
        """The layout's StateLines: kept in the header cache beside the mapped files' header when the diff was
        of two such files (``lines_key``), else made (~0.03 s at 70,000 tensors, in each ``publish --base``)."""
        key = self.memo.get("lines_key")
        kept = headercache.load_lines(key, len(self.names)) if key is not None else None
        if kept is not None:
            lines = StateLines.of_parts(*kept)
            if lines.describes(self.names, self.dtypes, self.shapes):
                return lines
        lines = StateLines(self.names, self.dtypes, self.shapes)
        if key is not None:
            headercache.store_lines(key, lines.order, lines.hex_at, lines.template)
        return lines

    def chunk_diffs(self) -> dict[str, list]:
        """``StateDiff.chunks``: tensor name -> its ChunkDiffs."""
        out: dict[str, list] = {}
        names, segs = self.names, self.segs
        for t, s, e, g, a, b in zip(self.tensor.tolist(), self.start.tolist(), self.stop.tolist(),
                                    self.seg.tolist(), self.lo.tolist(), self.hi.tolist()):
            p, o, n = segs[g]
            out.setdefault(names[t], []).append(ChunkDiff(start=s, stop=e, positions=p[a:b], old=o[a:b], new=n[a:b]))
        return out


class LazyChunks(Mapping):
    """``StateDiff.chunks`` of a :class:`FlatDiff`: the ChunkDiffs built on first use (the fast encoder never
    asks for them)."""

    __slots__ = ("_flat", "_chunks")

    def __init__(self, flat: FlatDiff) -> None:
        self._flat = flat
        self._chunks: dict | None = None

    def _get(self) -> dict:
        if self._chunks is None:
            self._chunks = self._flat.chunk_diffs()
        return self._chunks

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __contains__(self, key) -> bool:
        return key in self._get()

    def get(self, key, default=None):
        return self._get().get(key, default)


# -- diff ----------------------------------------------------------------------------------------------

_INFOS: dict = {}  # tensor dtype (a name or a torch dtype) -> (dtype name, word size, lanes a word, is float)


#: dtype names whose element is one word (the compare reads a contiguous tensor's words at its data_ptr())
_ONE_WORD = frozenset(n for n in ("bfloat16", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16",
                                  "int32", "uint32", "int64", "uint64", "float8_e4m3fn", "float8_e5m2",
                                  "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"))


def _info(dtype):
    got = _INFOS.get(dtype)
    if got is None:
        info = dtype_info(dtype)
        got = _INFOS[dtype] = (info.name, info.word_size, max(info.word_size // 2, 1), info.is_float)
    return got


def diff_flat(old: Mapping, new: Mapping, *, base_fps: Mapping[str, int] | None, chunk_words: int,
              update_old: bool, progress: Callable[[int, int], None] | None, executor: Executor | None):
    """:func:`codec.diff_states` as a :class:`~deltasync.codec.StateDiff` holding a :class:`FlatDiff`, or None
    where this path does not apply (a tensor off the host, no compiled kernels): the caller then takes the
    per-chunk path. The same fingerprints and changes."""

    k = kernels.cpu_kernels()
    if k is None or not ENABLED:
        return None
    if not same_header(old, new) and old.keys() != new.keys():
        _check_layout(old, new)  # raises
    small = min(chunk_words, SHARD_CELLS * _diffs.MIN_CELL_WORDS - 1)  # a tensor of 1..small words is one chunk
    mapped = _mapped_jobs(old, new, small, chunk_words) if not update_old else None
    lines_key = None  # the header cache's key of two mapped files' header: their state lines are kept beside it
    if mapped is not None:
        names, dtypes, shapes, tables, owners, words_of, wsize_of, lines_key = mapped
    else:
        got_jobs = _jobs(old, new, small, chunk_words, update_old, k)
        if got_jobs is None:
            return None
        names, dtypes, shapes, tables, owners, words_of, wsize_of, keep = got_jobs  # keep: alive until compared
    got = _compare(names, dtypes, shapes, tables, owners, words_of, wsize_of, k, base_fps=base_fps,
                   update_old=update_old, progress=progress, executor=executor)
    if lines_key is not None and got is not None:
        got.flat.memo["lines_key"] = lines_key
    return got


def _mapped_jobs(old: Mapping, new: Mapping, small: int, chunk_words: int):
    """:func:`_jobs` of two mapped files of one header (``tensorfile.HostState``s whose entries are the same
    object: the header cache's), from the header's columns: every tensor is a span of its file at the same
    offsets, so the compare jobs' addresses are the maps' plus the entries' starts, with no Python per small
    tensor (~0.1 s of a 70k-tensor publish). None where that does not hold (then the tensor-by-tensor path)."""
    wo, wn = getattr(old, "whole", None), getattr(new, "whole", None)
    if wo is None or wn is None or not same_header(old, new):  # (a changed mapping: as it is now, tensor by tensor)
        return None
    entries = old.header.entries
    n = len(entries)
    if n < FLAT_MIN:
        return None
    cols = header_columns(old.header)  # a parsed header's columns (no entry made), else its entries'
    if cols is None:
        cols = HeaderColumns(names=[e.name for e in entries], dtypes=[e.dtype for e in entries],
                             shapes=[e.shape for e in entries], starts=np.fromiter((e.start for e in entries), np.int64, n),
                             stops=np.fromiter((e.stop for e in entries), np.int64, n))
    every = cols.names
    order = list(range(n)) if _ascending(every) else sorted(range(n), key=every.__getitem__)
    get = itemgetter(*order)  # n >= FLAT_MIN > 1: a tuple
    names, stored, shapes = list(get(every)), get(cols.dtypes), list(get(cols.shapes))
    infos = {d: _info(d) for d in set(stored)}
    dtypes = list(map(itemgetter(0), map(infos.__getitem__, stored)))
    wsize_of = np.fromiter(map(itemgetter(1), map(infos.__getitem__, stored)), np.int64, n)
    at = np.asarray(order, np.int64)
    starts = cols.starts[at]
    nbytes = cols.stops[at] - starts
    if (starts % wsize_of).any() or (nbytes % wsize_of).any() or int((starts + nbytes).max(initial=0)) > min(
            wo.size, wn.size):
        return None  # a tensor misaligned to its words (the maps' words are copied for it): tensor by tensor
    words_of = nbytes // wsize_of
    big = np.flatnonzero(words_of > small)
    per = (words_of > 0).astype(np.int64)  # jobs a tensor: one, or its chunk ranges
    groups = []  # (tensors of one shape and size, their chunk ranges' starts and stops): layers share a few
    if big.size:
        keys = list(zip(map(shapes.__getitem__, big.tolist()), words_of[big].tolist()))
        kinds = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        code = np.fromiter(map(kinds.__getitem__, keys), np.int64, len(keys))
        for (shape, words), c in kinds.items():
            got = tensor_chunk_ranges(shape, words, chunk_words)
            sel = big[code == c]
            per[sel] = len(got)
            groups.append((sel, np.array([x for x, _ in got], np.int64), np.array([y for _, y in got], np.int64)))
    job_t = np.repeat(np.arange(n, dtype=np.int64), per)
    s = np.zeros(job_t.size, np.int64)
    e = words_of[job_t]
    if groups:
        at = np.cumsum(per) - per
        for sel, rs, re_ in groups:
            rows = (at[sel][:, None] + np.arange(rs.size, dtype=np.int64)).reshape(-1)
            s[rows] = np.tile(rs, sel.size)
            e[rows] = np.tile(re_, sel.size)
    tab = np.empty((job_t.size, 5), np.int64)
    tab[:, 0] = wo.ctypes.data + starts[job_t]
    tab[:, 1] = wn.ctypes.data + starts[job_t]
    tab[:, 2] = words_of[job_t]
    tab[:, 3] = s
    tab[:, 4] = e
    job_w = wsize_of[job_t]
    tables, owners = {}, {}
    sizes = word_sizes_in(job_w)
    for w in sizes:
        if len(sizes) == 1:  # one word size (a bf16 state): the table as made, not a copy of it
            tables[w], owners[w] = tab, job_t
            break
        sel = np.flatnonzero(job_w == w)
        tables[w], owners[w] = tab[sel], job_t[sel]
    return names, dtypes, shapes, tables, owners, words_of, wsize_of, cols.key


def _jobs(old: Mapping, new: Mapping, small: int, chunk_words: int, update_old: bool, k):
    """The compare's per-tensor columns (names sorted, dtype names, shapes, words, word sizes) and, per word size,
    its jobs' rows (address old, address new, words, first, last) and each job's tensor; None where a tensor is
    off the host or its words not addressable (the per-chunk path then); last, the words made here for the
    compare (a non-contiguous tensor's copy), which must stay alive until it ran."""
    names = sorted(new)
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    rows: dict[int, list[int]] = {}  # word size -> its jobs' rows, flat: address old, address new, words, first, last
    owners: dict[int, list[int]] = {}  # word size -> tensor of each job
    words_l: list[int] = []
    wsize_l: list[int] = []
    range_cache: dict = {}
    keep: list = []  # words made here (the jobs hold only their addresses)
    if len(names) >= FLAT_MIN:
        from .kernels.ansbatch import pair_address as pair
    else:
        pair = None
        addr = k.address
    infos, host_type = _INFOS, HostTensor
    last_w, r, own = 0, None, None
    for t, name in enumerate(names):  # the Python a tensor costs here is most of the diff of a 70k-tensor state
        o_t = old[name]
        n_t = new[name]
        if type(o_t) is host_type and type(n_t) is host_type:
            dt = n_t.dtype
            shape = n_t.shape
            if o_t.dtype != dt or o_t.shape != shape:
                _check_layout(old, new)  # raises
            ow = o_t.words
            nw = n_t.words
            got = infos.get(dt) or _info(dt)
        else:
            if not (_on_host(o_t) and _on_host(n_t)):
                return None
            if o_t.dtype != n_t.dtype or tuple(o_t.shape) != tuple(n_t.shape):
                _check_layout(old, new)  # raises
            if update_old and not o_t.is_contiguous():
                raise ValueError(f"{name}: update_old needs a contiguous old tensor")
            got = _info(n_t.dtype)
            shape = tuple(n_t.shape)
            if pair is not None and got[0] in _ONE_WORD and o_t.is_contiguous() and n_t.is_contiguous():
                # contiguous CPU tensors of one-word elements: their words are at data_ptr(), no numpy view made
                # (two torch calls and a view a tensor: ~4 us, 0.6 s of a 70k-tensor publish's blocked time)
                n = n_t.numel()
                a, b = o_t.data_ptr(), n_t.data_ptr()
                ow = None
            else:
                ds = dtype_info(got[0])
                ow, nw = _span_words(o_t, ds), _span_words(n_t, ds)
                keep.append((ow, nw))  # a non-contiguous tensor's words are a copy: alive until compared
        if ow is None:
            pass  # addressed above
        elif pair is not None:
            a, b = pair(ow, nw)
            if a < 0:
                return None
        elif ow.flags.c_contiguous and nw.flags.c_contiguous:
            a, b = addr(ow), addr(nw)
        else:
            return None
        if ow is not None:
            if update_old and not ow.flags.writeable:
                return None
            n = nw.size
        dtypes.append(got[0])
        shapes.append(shape)
        w = got[1]
        words_l.append(n)
        wsize_l.append(w)
        if w != last_w:
            r = rows.get(w)
            if r is None:
                r = rows[w] = []
                owners[w] = []
            own = owners[w]
            last_w = w
        if 0 < n <= small:
            r.extend((a, b, n, 0, n))
            own.append(t)
        elif n:
            key = (shape, n)
            ranges = range_cache.get(key)
            if ranges is None:
                ranges = range_cache[key] = tensor_chunk_ranges(shape, n, chunk_words)
            for s, e in ranges:
                r.extend((a, b, n, s, e))
            own.extend([t] * len(ranges))
    tables = {w: np.array(js, dtype=np.int64).reshape(-1, 5) for w, js in rows.items() if js}
    return (names, dtypes, shapes, tables, {w: np.asarray(owners[w], np.int64) for w in tables},
            np.array(words_l, np.int64), np.array(wsize_l, np.int64), keep)


def _compare(names, dtypes, shapes, tables, owners, words_of, wsize_of, k, *, base_fps, update_old, progress,
             executor):
    """diff_flat's compare of the jobs ``tables`` (per word size) on ``executor``, and its :class:`FlatDiff`."""
    lanes_per = np.maximum(wsize_of // 2, 1)
    jobs = tables
    want = base_fps is None
    table = T_NP
    tasks = []  # (word size, job table rows)
    for w, tab in jobs.items():
        span = tab[:, 4] - tab[:, 3]
        ends = np.cumsum(span)
        cut = np.flatnonzero(np.diff((ends - 1) // PIECE_WORDS)) + 1 if tab.shape[0] > 1 else np.zeros(0, np.int64)
        bounds = [0, *cut.tolist(), tab.shape[0]]
        tasks.extend((w, tab[a:b]) for a, b in zip(bounds, bounds[1:]))
    total = int((words_of * wsize_of).sum())
    likes = {w: (np.empty(0, numpy_word_dtype(w)), np.empty(0, numpy_word_dtype(w) if w <= 2 else np.uint16))
             for w in jobs}

    def run(task):
        w, task_rows = task
        like, lane_like = likes[w]
        cap = 1024 + int((task_rows[:, 4] - task_rows[:, 3]).sum()) // 1024
        pos, ow, nw, offsets, fpds, totals = k.diff_jobs(task_rows, like, lane_like, table, 0 if w == 1 else w // 2, want,
                                                         update_old, cap)
        n = int(offsets[-1])
        if pos.size > 2 * n + 4096:  # mostly unused room (the outputs grow by projection): keep only what was found
            return pos[:n].copy(), ow[:n].copy(), nw[:n].copy(), offsets, fpds, totals
        return pos[:n], ow[:n], nw[:n], offsets, fpds, totals

    results = executor.map(run, tasks) if executor is not None and len(tasks) > 1 else map(run, tasks)
    got: dict[int, list] = {w: [] for w in jobs}
    done = 0
    for (w, task_rows), r in zip(tasks, results):
        got[w].append(r)
        if progress:
            done += int((task_rows[:, 4] - task_rows[:, 3]).sum()) * w
            progress(done, total)
    # columns per job, word size by word size, then the changed chunks among them
    fpd_t = np.zeros(len(names), np.uint64)
    lane_t = np.zeros(len(names), np.uint64)
    cols = []
    segs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for w in sorted(got):
        rs = got[w]
        counts = np.concatenate([np.diff(r[3]) for r in rs])
        fpds = np.concatenate([r[4] for r in rs])
        owner = np.asarray(owners[w], np.int64)
        first = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        ts = owner[first]
        fpd_t[ts] = np.add.reduceat(fpds, first)  # uint64: sums mod 2**64
        if want:
            lane_t[ts] = np.add.reduceat(np.concatenate([r[5] for r in rs]), first)
        seg = np.repeat(np.arange(len(segs), len(segs) + len(rs), dtype=np.int64), [r[3].size - 1 for r in rs])
        lo = np.concatenate([r[3][:-1] for r in rs])
        segs.extend((r[0], r[1], r[2]) for r in rs)
        hit = counts > 0
        tab = tables[w]
        cols.append((owner[hit], tab[hit, 3], tab[hit, 4], np.full(int(hit.sum()), w, np.int64), seg[hit], lo[hit],
                     (lo + counts)[hit]))
    if cols:
        tensor, start, stop, wsz, seg, lo, hi = (np.concatenate(c) for c in zip(*cols))
        if len(cols) > 1:  # word sizes interleave: packing order is by tensor, then start
            order = np.lexsort((start, tensor))
            tensor, start, stop, wsz, seg, lo, hi = (a[order] for a in (tensor, start, stop, wsz, seg, lo, hi))
    else:
        tensor = start = stop = wsz = seg = lo = hi = np.zeros(0, np.int64)
    if want:
        before = lane_t + words_of.astype(np.uint64) * lanes_per.astype(np.uint64) * np.uint64(C0)
        fps_before = lazy_zip(names, before)
    else:
        fps_before = dict(base_fps)
        try:
            before = np.array([base_fps[n] for n in names], dtype=np.uint64)
        except OverflowError:
            before = np.array([base_fps[n] & MASK64 for n in names], dtype=np.uint64)
    after = before + fpd_t
    layout = lazy_zip(names, zip(dtypes, shapes))
    flat = FlatDiff(names=names, dtypes=dtypes, shapes=shapes, tensor=tensor, start=start, stop=stop, word_size=wsz,
                    seg=seg, lo=lo, hi=hi, segs=segs, words=words_of, fp_before=before, fp_after=after)
    return StateDiff(layout=layout, chunks=LazyChunks(flat), fps_before=fps_before, fps_after=lazy_zip(names, after),
                     flat=flat)


# -- encode --------------------------------------------------------------------------------------------

def takes_flat(diff, options) -> bool:
    """Does :func:`encode_flat` encode ``diff`` under ``options`` (a :class:`FlatDiff` of ``FLAT_MIN`` chunks or
    more, blob format 2 or 4, packing by tensor, the compiled kernels)?"""
    flat = getattr(diff, "flat", None)
    return (ENABLED and flat is not None and flat.tensor.size >= FLAT_MIN and options.blob_format in ANS_VERSIONS
            and options.pack == "tensor" and kernels.cpu_kernels() is not None)


_PIECES = ('{"count":', ',"dtype":', ',"mode":"ans","na":', ',"mode":"dense","na":', ',"nr":', ',"start":', ',"stop":',
           ',"tensor":', "}")  # the text of a chunk record between its values (keys sorted)


def _record_texts(names: list[str], dtypes: list[str], dtype_of: np.ndarray) -> tuple:
    """What :func:`ansbatch.chunk_records` takes besides the chunks' columns: the tensor names and dtype names
    as ``json.dumps`` spells them (ASCII), each set as one buffer and offsets, each tensor's dtype, and the
    constant pieces of a record."""
    text = "".join(names)
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:  # each its own JSON body
        quoted = '"' + '""'.join(names) + '"' if names else ""
        lengths = np.fromiter(map(len, names), np.int64, len(names)) + 2
    else:
        each = [json.dumps(n) for n in names]
        quoted = "".join(each)
        lengths = np.fromiter(map(len, each), np.int64, len(each))
    name_at = np.zeros(len(names) + 1, np.int64)
    np.cumsum(lengths, out=name_at[1:])
    dq = [json.dumps(d) for d in dtypes]
    dtype_at = np.zeros(len(dq) + 1, np.int64)
    np.cumsum([len(d) for d in dq], out=dtype_at[1:])
    piece_at = np.zeros(len(_PIECES) + 1, np.int64)
    np.cumsum([len(p) for p in _PIECES], out=piece_at[1:])
    return (np.frombuffer(quoted.encode("ascii"), np.uint8), name_at, dtype_of,
            np.frombuffer("".join(dq).encode("ascii"), np.uint8), dtype_at,
            np.frombuffer("".join(_PIECES).encode("ascii"), np.uint8), piece_at)


def encode_flat(diff, *, model: str, version: int, parent: int, options, meta: Mapping[str, str] | None,
                executor: Executor | None):
    """:func:`codec.encode_diff` of a diff :func:`takes_flat` takes: the same manifest and blobs."""
    from .kernels import ansbatch

    flat: FlatDiff = diff.flat
    names, dtypes, shapes = flat.names, flat.dtypes, flat.shapes
    C = flat.tensor.size
    tensor, start, stop, wsz, seg, lo, hi = (flat.tensor, flat.start, flat.stop, flat.word_size, flat.seg, flat.lo,
                                             flat.hi)
    count = hi - lo
    segs = flat.segs
    # per segment: value symbols, BIG signs and magnitudes, raw words, laid out like its positions
    outs = [(np.empty(p.size, np.uint8), np.empty(p.size, np.bool_), np.empty(p.size, np.uint64), np.empty(p.size, o.dtype))
            for p, o, _ in segs]
    nb = np.zeros(C, np.int64)
    nr = np.zeros(C, np.int64)
    dt_codes = {d: i for i, d in enumerate(dict.fromkeys(dtypes))}
    t_code = np.fromiter(map(dt_codes.__getitem__, dtypes), np.int64, len(dtypes))
    is_float = np.array([dtype_info(d).is_float for d in dt_codes], np.bool_)[t_code][tensor]
    # symbols, segment by segment (a chunk's rows of nb/nr written in place where the chunks of each segment are
    # contiguous: one word size), in parts on the executor's threads (nogil)
    order = None if C < 2 or bool((seg[1:] >= seg[:-1]).all()) else np.argsort(seg, kind="stable")
    bounds = np.searchsorted(seg if order is None else seg[order], np.arange(len(segs) + 1)).tolist()
    work = []
    for g in range(len(segs)):
        a, b = bounds[g], bounds[g + 1]
        if a == b:
            continue
        if order is None:
            rows = (lo[a:b], hi[a:b], start[a:b], is_float[a:b], nb[a:b], nr[a:b])
        else:
            idx = order[a:b]
            rows = (lo[idx], hi[idx], start[idx], is_float[idx], np.zeros(b - a, np.int64), np.zeros(b - a, np.int64),
                    idx)
        work.append((g, rows))

    def symbols(item):
        g, (a, b, st, fl, nbv, nrv, *_) = item
        p, o, n = segs[g]
        sy, bn, bm, rw = outs[g]
        return ansbatch.word_symbols_chunks(p, o, n, a, b, st, fl, _RAW_LIMIT[o.itemsize], sy, bn, bm, rw, nbv, nrv)

    bad = list(map_parts(symbols, work, executor, weight=lambda item: int(item[1][1][-1] - item[1][0][0])))
    if any(x >= 0 for x in bad):
        raise ValueError("a zero step is not a change")
    if order is not None:
        for _, (_, _, _, _, nbv, nrv, idx) in work:
            nb[idx], nr[idx] = nbv, nrv
    # dense chunks (rewritten: every word changed, most of them raw) and each chunk's raw bytes in its blob
    length = stop - start
    dense = (count == length) & (2 * nr > count)
    nbytes = np.where(dense, length * wsz, 2 * count + nr * wsz)
    # the row cell of each chunk of a tensor cut into cells (codec.tensor_chunk_ranges: 2+ dims, 2+ rows, at
    # least SHARD_CELLS * MIN_CELL_WORDS words); 0 for the others
    cell = np.zeros(C, np.int64)
    tw = flat.words[tensor]
    for j in np.flatnonzero(tw >= SHARD_CELLS * _diffs.MIN_CELL_WORDS).tolist():
        shape = shapes[int(tensor[j])]
        if len(shape) >= 2 and shape[0] >= 2:
            cell[j] = _cell(shape, int(tw[j]), int(start[j]))
    keys = tensor * SHARD_CELLS + cell
    blob_of = ansbatch.blob_cuts(keys, nbytes, options.cell_blob_min, options.blob_target) if C else \
        np.zeros(0, np.int64)
    nblobs = int(blob_of[-1]) + 1 if C else 0
    firsts = np.searchsorted(blob_of, np.arange(nblobs + 1))
    level, blob_version = options.level, options.blob_format
    dt_names = list(dt_codes)
    # the state's names joined once: the table's names and each version-4 blob's chunk names are cut from it
    names_text = newline_joined(names) if C else None
    if blob_version == 4 and C and names_text is None:
        blob_version = 2  # a name holding a newline: version 4 cannot list it (the same chunks in JSON)
    name_at = None
    if blob_version == 4 and names_text is not None and (C < 2 or bool((tensor[1:] > tensor[:-1]).all())):
        name_at = np.zeros(len(names) + 1, np.int64)  # where each name starts in names_text (and one past the end)
        name_at[1:-1] = np.flatnonzero(np.frombuffer(names_text, np.uint8) == 10) + 1
        name_at[-1] = len(names_text) + 1
    texts = _record_texts(names, dt_names, t_code) if blob_version == 2 else None
    chunk_dtype = t_code[tensor].astype(np.uint8) if blob_version == 4 else None

    def blob(b: int) -> tuple[bytes, str]:
        c0, c1 = int(firsts[b]), int(firsts[b + 1])
        dn = dense[c0:c1]
        parts: dict[str, list[np.ndarray]] = {}
        na = np.zeros(c1 - c0, np.int64)
        ans = np.flatnonzero(~dn) + c0
        if ans.size:
            # runs of consecutive ans chunks in one segment: a compiled call each. Where segments interleave (an
            # FP8 state's weights and scales alternate by name: a run a chunk, ~1,500 runs a blob), the chunks are
            # taken segment by segment and their messages and raw words put back in chunk order after: the same
            # bytes (each message stands alone)
            sg = seg[ans]
            grouped = None
            if sg.size > 1 and bool((sg[1:] < sg[:-1]).any()):
                grouped = np.argsort(sg, kind="stable")
                ans, sg = ans[grouped], sg[grouped]
            cuts = [0, *(np.flatnonzero(sg[1:] != sg[:-1]) + 1).tolist(), ans.size]
            # the blob's counts (its ans chunks' gap buckets and value symbols), then its models
            g = np.zeros(rans.N_GAP, np.int64)
            v = np.zeros(rans.N_VAL, np.int64)
            for x, y in zip(cuts, cuts[1:]):
                sel = ans[x:y]
                ansbatch.chunk_histograms(segs[int(sg[x])][0], outs[int(sg[x])][0], lo[sel], hi[sel], start[sel], g, v)
            tables = AnsTables.from_freqs(rans.normalize(g), rans.normalize(v))
            (gf, gc, _), (vf, vc, _) = tables.g, tables.v
            parts["ansm"] = [tables.to_bytes()]
            coded: list[np.ndarray] = []
            raws: dict[int, list[np.ndarray]] = {}
            for x, y in zip(cuts, cuts[1:]):
                sel = ans[x:y]
                p, _, _ = segs[int(sg[x])]
                sy, bn, bm, rw = outs[int(sg[x])]
                a_lo = lo[sel]
                words, na_run = ansbatch.encode_chunks(p, a_lo, hi[sel], start[sel], nb[sel], sy, bn, bm, gf, gc, vf,
                                                       vc)
                na[sel - c0] = na_run
                coded.append(words)
                k = nr[sel]
                n = int(k.sum())
                if n:  # the run's raw words, chunk after chunk
                    ends = np.cumsum(k)
                    raws.setdefault(rw.itemsize, []).append(
                        rw[np.arange(n, dtype=np.int64) + np.repeat(a_lo - (ends - k), k)])
            if grouped is not None:  # back in chunk order: each chunk's message, and its raw words per word size
                back = np.empty_like(grouped)
                back[grouped] = np.arange(grouped.size)
                coded = [_in_order(np.concatenate(coded), na[ans - c0], back)]
                size_of = np.array([o.itemsize for _, o, _ in segs], np.int64)[sg]  # each chunk's raw word size
                raws = {w: [_in_order(np.concatenate(rs), np.where(size_of == w, nr[ans], 0), back)]
                        for w, rs in raws.items()}
            parts["ans"] = [w.astype("<u2", copy=False).view(np.uint8) for w in coded]
            for w in sorted(raws):
                parts[f"raw{w}"] = raws[w]
        if dn.any():
            for j in (np.flatnonzero(dn) + c0).tolist():
                _, _, n_words = segs[int(seg[j])]
                parts.setdefault(f"dense{int(wsz[j])}", []).append(n_words[int(lo[j]) : int(hi[j])])
        rng = slice(c0, c1)
        if blob_version == 4:
            ints = np.stack([start[rng], stop[rng], count[rng], na, np.where(dn, 0, nr[rng])])
            codes = chunk_dtype[rng]  # the blob's dtypes numbered in order of first appearance (as BlobWriter's)
            used, first = np.unique(codes, return_index=True)
            used = used[np.argsort(first)]
            renum = np.zeros(len(dt_names), np.uint8)
            renum[used] = np.arange(used.size, dtype=np.uint8)
            t0, t1 = int(tensor[c0]), int(tensor[c1 - 1])
            # one chunk a tensor, the tensors consecutive: the chunks' names are a piece of the state's, not joined
            chunk_names = memoryview(names_text)[name_at[t0] : name_at[t1 + 1] - 1] \
                if name_at is not None and t1 - t0 == c1 - c0 - 1 else list(map(names.__getitem__, tensor[rng].tolist()))
            block = pack_chunk_columns(chunk_names,
                                       [dt_names[u] for u in used.tolist()], renum[codes], dn.view(np.uint8),
                                       ints)  # (COLUMN_MODES: 0 ans, 1 dense)
        else:
            block = ansbatch.chunk_records(count[rng], na, np.where(dn, 0, nr[rng]), start[rng], stop[rng], dn,
                                           tensor[rng], *texts).tobytes()
        data = pack_blob(parts, block, version=blob_version, cctx=compressor(level))
        return data, blob_id(data)

    made = list(map_parts(blob, range(nblobs), executor,
                          weight=lambda b: int(count[int(firsts[b]) : int(firsts[b + 1])].sum())))
    # the symbols are coded: their memory (~12 bytes a changed word) is free for what follows (the table and its
    # compressed frame; at 70k tensors ~14 MB), not fresh pages on top of it
    del outs, work
    blobs: dict[str, bytes] = {}
    for data, bid in made:
        blobs.setdefault(bid, data)
    ids = [bid for _, bid in made]
    # the manifest's format-2 records and span entries, made from the columns only if used (a publish compacts
    # to the format-3 form packed below and makes neither: ~0.1 s at 70k tensors)
    index = (np.arange(C, dtype=np.int64) - firsts[blob_of]) if C else np.zeros(0, np.int64)
    heads = np.flatnonzero(np.r_[True, tensor[1:] != tensor[:-1]]) if C else np.zeros(0, np.int64)
    owner_rows = tensor[heads]  # (as lists only where the format-2 records or spans are made)
    single = heads.size == C  # one chunk a changed tensor (most states)
    sums = count if single else np.add.reduceat(count, heads) if C else np.zeros(0, np.int64)
    fp_before, fp_after = flat.fp_before, flat.fp_after  # (the closures below keep these columns, not the diff)

    def records() -> tuple:
        owners, bounds = owner_rows.tolist(), [*heads.tolist(), C]
        with gc_paused():  # 70k refs, tuples and records: the collector's passes over them cost more than making them
            bid_of = [ids[b] for b in blob_of.tolist()]
            refs = list(map(new_chunk, bid_of, index.tolist(), repeat(None), start.tolist(), stop.tolist()))
            chunks_of: list[tuple] = [()] * len(names)
            changed = [0] * len(names)
            if single:
                for t, r, n in zip(owners, refs, count.tolist()):
                    chunks_of[t] = (r,)
                    changed[t] = n
            else:
                for i, (t, n) in enumerate(zip(owners, sums.tolist())):
                    chunks_of[t] = tuple(refs[bounds[i] : bounds[i + 1]])
                    changed[t] = n
            hb, ha = fp_texts(fp_before), fp_texts(fp_after)
            return tuple(map(new_record, names, dtypes, shapes, hb, ha, changed, chunks_of))

    def spans():
        owners, bounds = owner_rows.tolist(), [*heads.tolist(), C]
        texts = list(map("{}:{}".format, start.tolist(), stop.tolist()))
        if not single:
            texts = [texts[a] if b - a == 1 else ",".join(texts[a:b]) for a, b in zip(bounds, bounds[1:])]
        return zip(map(SPANS_META_PREFIX.__add__, map(names.__getitem__, owners)), texts)

    meta3 = dict(meta or {})  # the format-3 form's: no spans (they are in its table)
    # with one blob there is nothing to select: no spans
    meta = LazyMeta(meta3, spans) if len(blobs) > 1 and C else dict(meta3)
    state_fp_before, state_fp = flat.state_fps()
    manifest = Manifest(
        model=model, version=version, parent=parent, kind="delta",
        tensors=LazyRecords.of(records, int(count.sum())),
        blobs=tuple(BlobRef(id=b, size=len(d)) for b, d in blobs.items()),
        state_fp=state_fp, state_fp_before=state_fp_before,
        meta=meta,
    )
    # its format-3 form's table, from the columns: Manifest.compact() then makes no record
    counts = np.ones(heads.size, np.int64) if single else np.diff(heads, append=C)
    position = {b: i for i, b in enumerate(blobs)}
    cblob = np.array([position[i] for i in ids], np.int64)[blob_of] if C else np.zeros(0, np.int64)
    try:
        every = owner_rows.size == len(names) and bool((owner_rows == np.arange(len(names))).all())
        table = _compact_table(None if every else owner_rows, names, dtypes, shapes, flat.fp_after, sums,
                               counts, cblob, index, start, stop, names_text=names_text, name_at=name_at)
    except FormatError:  # a name format 3 cannot carry (a newline): compact() says so where it is asked for
        pass
    else:
        remember_compact(manifest.tensors, tuple(blobs), meta, meta3, table)
    return Encoded(manifest=manifest, blobs=blobs, fps=lazy_zip(names, flat.fp_after))


def _in_order(data: np.ndarray, sizes: np.ndarray, back: np.ndarray) -> np.ndarray:
    """Pieces of ``data`` (laid end to end, ``sizes[g]`` items each, in a grouped order) put in the order where
    piece ``back[i]`` of the grouped order comes ``i``-th: one gather."""
    starts = np.cumsum(sizes) - sizes
    k = sizes[back]
    ends = np.cumsum(k)
    return data[np.arange(int(ends[-1]) if k.size else 0, dtype=np.int64) + np.repeat(starts[back] - (ends - k), k)]


def _compact_table(owners: np.ndarray | None, names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]],
                   fps: np.ndarray, changed, counts: np.ndarray, cblob: np.ndarray, cindex: np.ndarray,
                   start: np.ndarray, stop: np.ndarray, names_text: bytes | None = None,
                   name_at: np.ndarray | None = None) -> bytes:
    """The format-3 table of a delta whose changed tensors are ``owners`` (indices into the state's columns,
    ascending; None: every tensor, no list gathered), their chunks given per chunk: what ``pack_table`` packs of
    ``Manifest.compact()``'s records. ``names_text``: every tensor's names already joined (:func:`newline_joined`),
    ``name_at`` where each starts in it (and one past its end), if known."""
    every = owners is None
    if not every:
        ol = owners.tolist()
        dtypes, shapes = list(map(dtypes.__getitem__, ol)), list(map(shapes.__getitem__, ol))
        names_text = _names_of(names_text, owners, name_at) if names_text is not None else None
        names, fps = list(map(names.__getitem__, ol)), fps[owners]
    code = {d: i for i, d in enumerate(dict.fromkeys(dtypes))}  # numbered in order of first appearance
    return pack_columns("delta", names, list(code),
                        np.fromiter(map(code.__getitem__, dtypes), np.uint8, len(dtypes)),
                        np.fromiter(map(len, shapes), np.uint8, len(shapes)),
                        np.fromiter(chain.from_iterable(shapes), np.uint64),
                        fps, np.asarray(changed, np.uint64), counts, cblob, cindex=cindex, starts=start, stops=stop,
                        names_text=names_text)


def _names_of(names_text: bytes, rows: np.ndarray, first: np.ndarray | None = None) -> bytes:
    """The names of ``rows`` (ascending) joined by newlines, cut from every name's joined ``names_text`` (``first``:
    where each name starts in it, and one past its end + 1, as ``encode_flat``'s ``name_at``; found if None): a slice
    per run of consecutive rows (an AdamW step leaves a few small tensors unchanged: a few hundred runs at 70,000
    tensors, where joining the changed ones' names again was ~3.3 MB of text)."""
    if not rows.size:
        return b""
    if first is None:
        ends = np.flatnonzero(np.frombuffer(names_text, np.uint8) == 10)
        first = np.zeros(ends.size + 2, np.int64)
        first[1:-1] = ends + 1
        first[-1] = len(names_text) + 1
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    lo, hi = first[rows[np.r_[0, cut]]].tolist(), (first[rows[np.r_[cut - 1, rows.size - 1]] + 1] - 1).tolist()
    # bounds as Python ints and bytes slices, not memoryviews: an FP8 state's changed rows can run in ~70k pieces
    # (its small scale tensors mostly unchanged), where a memoryview slice each was ~70 ms
    text = bytes(names_text)
    return b"\n".join([text[a:b] for a, b in zip(lo, hi)])

