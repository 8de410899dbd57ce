"""Encode two versions of a state dict into a sparse delta; decode it back.

``encode_delta(old, new, ...)`` compares each tensor's words chunk by chunk on
the tensors' own device, keeps only the changed positions and what they became
(:mod:`deltasync.values`), codes positions (:mod:`deltasync.positions`), and packs
chunks into content-addressed blobs (:mod:`deltasync.blob`). The result is an
unsigned :class:`~deltasync.manifest.Manifest` plus its blobs.

``decode_blob(data)`` turns a blob back into :class:`ChunkPatch` objects, which
:mod:`deltasync.apply` writes into live tensors.

Chunk modes (docs/FORMAT.md): ``gap`` and ``bitmap`` carry the changed positions
and one token per change; ``dense`` carries every new word of the chunk and is
chosen when that is smaller (e.g. a re-initialised tensor); ``ans`` (format 2) codes
positions and steps with rANS; ``ansx`` (format 3, ``EncodeOptions(coding="base-conditioned")``,
:mod:`deltasync.conditioned`) models them by the old word's exponent and needs the base to
decode: its :class:`ChunkPatch` is *pending* until :meth:`ChunkPatch.resolve` gets the old words.
"""

from __future__ import annotations

import contextlib
import operator
import sys
from itertools import chain, repeat
from operator import itemgetter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .blob import ANS_VERSIONS, BlobReader, BlobWriter, blob_id
from .dtypes import (DtypeInfo, HostTensor, dtype_info, host_words, numpy_word_dtype, word_count, word_view,
                     word_sizes_in)
from .errors import FormatError, UnsupportedError
from .frozen import maker
from .kernels.fpkeys import MASK64
from . import diffs as _diffs
from .diffs import (MIN_CELL_WORDS, SHARD_CELLS, ChunkDiff, Encoded, StateDiff, _cell, _check_layout,  # noqa: F401
                    _on_host, _span_words, chunk_ranges, tensor_chunk_ranges)
from .parts import map_parts
from .fingerprint import (fingerprint_delta, fingerprint_from_lane_sums, StateLines,
                          tensor_fingerprint, update_fingerprint, words_range_delta)
from .manifest import SPANS_META_PREFIX, BlobRef, ChunkRef, Manifest, TensorRecord, parse_spans
from .tensortable import fp_values
from .tensorfile import same_header
from .entropy import AnsBlobCoder, AnsTables, decode_ans_columns, decode_ans_rows, word_symbols
from .conditioned import (CODING_BASE_CONDITIONED, CODING_BASE_FREE, CODING_HISTORY, CODING_META, CODINGS, CondBlobCoder,
                          CondTables,
                          PendingChanges, chunk_ranks, context_spec)
from . import kernels
from .kernels import changes_from_words, decode_bitmap, decode_gaps, decode_values, encode_bitmap, encode_gaps, encode_values
from .positions import choose_position_mode
from .values import Changes
from .history import HISTORY_META, ChunkHistory, HistoryBlobCoder, PendingHistory, StateHistory

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_WORDS = 4 << 20
DEFAULT_BLOB_TARGET = 32 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodeOptions:
    level: int = 1  # zstd level; above 1 buys at most ~2% on weight deltas
    chunk_words: int = DEFAULT_CHUNK_WORDS  # words per chunk: bounds decode memory, unit of pipelining
    blob_target: int = DEFAULT_BLOB_TARGET  # pre-compression bytes at which a blob is closed
    cell_blob_min: int = 256 << 10  # a blob holding this many raw bytes also closes where a tensor or row cell begins
    # Blob packing order (docs/FORMAT.md 5.1): "tensor" = tensor by tensor; "cells" = row cell by row cell
    # across tensors (a TP rank's rows of every column-parallel tensor share blobs), with tensors whose name
    # ends with one of ``dim1_suffixes`` (sharded on dim 1 by engines: every rank needs all of them) after.
    pack: str = "tensor"
    # Blob format version written (docs/FORMAT.md §4): 4 = rANS-coded positions and steps (``ans`` chunks) under
    # binary chunk records; 2 = the same chunks under JSON records (what readers before version 4 understand);
    # 1 = the byte-token coding every older reader understands (publish 2 or 1 while a fleet still runs them).
    format: int = 4
    # "base-free" (formats 1/2: relays squash chains without the model), "base-conditioned" (blob format 3:
    # positions and steps modelled by the old word's exponent, ~30% smaller on AdamW traces; decoding needs the
    # base, so relays cannot squash the stream: subscribers walk its chain; docs/FORMAT.md §4.4) or "history"
    # (blob format 3: positions modelled by the deltas before, ~20% smaller, O(changed) at both ends, which both
    # hold the stream's history; relays cannot squash it either; §4.5).
    coding: str = CODING_BASE_FREE
    dim1_suffixes: tuple[str, ...] = ("o_proj.weight", "down_proj.weight", ".w2.weight", "experts.down_proj")

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_words <= 1 << 40:
            raise ValueError(f"chunk_words must be in [1, 2**40], got {self.chunk_words}")
        if self.blob_target < 1:
            raise ValueError(f"blob_target must be positive, got {self.blob_target}")
        if not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {self.level}")
        if self.pack not in ("tensor", "cells"):
            raise ValueError(f"pack must be 'tensor' or 'cells', got {self.pack!r}")
        if self.format not in (1, 2, 3, 4):
            raise ValueError(f"format must be 1, 2, 3 or 4, got {self.format!r}")
        if self.coding not in CODINGS:
            raise ValueError(f"coding must be one of {CODINGS}, got {self.coding!r}")
        if (self.format == 3) != (self.coding != CODING_BASE_FREE) and self.format not in ANS_VERSIONS:
            raise ValueError(f"blob format {self.format} cannot carry the {self.coding} coding "
                             "(base-conditioned and history are format 3; base-free is 1, 2 or 4)")

    @property
    def blob_format(self) -> int:
        """The blob version written: 3 for the base-conditioned and history codings, else ``format``."""
        return self.format if self.coding == CODING_BASE_FREE else 3


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkPatch:
    """One decoded chunk: words [start, stop) of a tensor."""

    tensor: str
    dtype: str
    start: int
    stop: int
    changes: Changes | None = None  # gap/bitmap/ans modes (and ansx once resolved)
    dense: np.ndarray | None = None  # dense mode: every new word of the chunk
    # ansx mode before :meth:`resolve` (needs the base's words); ansh before :meth:`resolve_history` (the history's)
    pending: PendingChanges | PendingHistory | None = None

    @property
    def count(self) -> int:
        if self.dense is not None:
            return self.stop - self.start
        return self.pending.count if self.changes is None and self.pending is not None else len(self.changes)

    def resolve(self, base: np.ndarray) -> "ChunkPatch":
        """This chunk with its changes decoded against ``base``: the old words [start, stop) of the tensor
        (host, unsigned). Reads every word given (O(chunk)); a chunk that needs no base returns itself."""
        if self.changes is not None or self.pending is None:
            return self
        if isinstance(self.pending, PendingHistory):
            raise UnsupportedError(f"{self.tensor}[{self.start}:{self.stop}] uses the history coding: decoding it "
                                   "needs the stream's history (prepare_delta(history=)), not the base")
        return ChunkPatch(tensor=self.tensor, dtype=self.dtype, start=self.start, stop=self.stop,
                          changes=self.pending.decode(base))

    def resolve_history(self, history: ChunkHistory) -> "ChunkPatch":
        """This ``ansh`` chunk with its changes decoded with ``history`` (the chunk's, at the delta's parent)."""
        if not isinstance(self.pending, PendingHistory):
            return self
        return ChunkPatch(tensor=self.tensor, dtype=self.dtype, start=self.start, stop=self.stop,
                          changes=self.pending.decode(history))

    def as_changes(self) -> Changes:
        if self.changes is not None:
            return self.changes
        if isinstance(self.pending, PendingHistory):
            raise UnsupportedError(
                f"{self.tensor}[{self.start}:{self.stop}] uses the history coding: decoding it needs the stream's "
                "history (prepare_delta(history=))")
        if self.pending is not None:
            raise UnsupportedError(
                f"{self.tensor}[{self.start}:{self.stop}] uses the base-conditioned coding: decoding it needs the "
                "base's words (ChunkPatch.resolve); this reader has none. Publish the stream with coding base-free "
                "to serve it")
        n = self.stop - self.start
        return Changes(positions=np.arange(self.start, self.stop, dtype=np.int64),
                       raw=np.ones(n, dtype=np.bool_), values=self.dense)


# -- finding changes -------------------------------------------------------------------

def _host_words(t: torch.Tensor | HostTensor, info: DtypeInfo | None = None) -> np.ndarray:
    """The unsigned host words of a CPU tensor or a :class:`HostTensor` (numpy over a mapped file: no torch)."""
    return host_words(t)


def _chunk_words(t):
    """What :func:`diff_chunk` reads of a tensor: host words (numpy) for a HostTensor or a CPU tensor,
    a flat signed word view on its device otherwise."""
    if isinstance(t, HostTensor) or kernels.on_host(t.device):
        return host_words(t)
    t = t.detach()
    return word_view(t if t.is_contiguous() else t.contiguous())


def _no_grad():
    """``torch.no_grad()`` once torch is loaded (device tensors), else nothing: host words need none."""
    torch = sys.modules.get("torch")
    return torch.no_grad() if torch is not None else contextlib.nullcontext()


DENSE_FP = 16  # above one change in this many words, fingerprint the range instead of each change


def state_layout(state: Mapping[str, torch.Tensor | HostTensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in state.items()}


def same_layout(a: Mapping[str, torch.Tensor | HostTensor], b: Mapping[str, torch.Tensor | HostTensor]) -> bool:
    """``state_layout(a) == state_layout(b)``, without building either (a state of 70k tensors is checked
    more than once a publish): tensors of one kind compare their dtype and shape as they are."""
    if same_header(a, b):  # mapped files of one header (its cache), as made
        return True
    if a.keys() != b.keys():
        return False
    for name, t in a.items():
        u = b[name]
        if type(t) is not type(u):
            if dtype_info(t.dtype).name != dtype_info(u.dtype).name or tuple(t.shape) != tuple(u.shape):
                return False
        elif t.dtype != u.dtype or t.shape != u.shape:
            return False
    return True


def diff_chunk(old_words: torch.Tensor, new_words: torch.Tensor, start: int, stop: int, word_size: int,
               *, update_old: bool = False) -> tuple[ChunkDiff | None, int]:
    """Changed words in [start, stop) of two flat word views, and the fingerprint change.

    Compares on the tensors' device (numpy on CPU; torch compare + nonzero on a GPU), so only
    the sparse result reaches the host. ``update_old=True`` also writes the new words into
    ``old_words`` (a publisher's reference copy, patched in place instead of re-copied).
    """
    ndt = numpy_word_dtype(word_size)
    sdt = np.dtype(f"i{word_size}")
    host = isinstance(old_words, np.ndarray)  # host words (_chunk_words); else a word view on a device
    if host and kernels.cpu_kernels() is not None:  # one fused compiled pass
        found = kernels.diff_words(old_words[start:stop].view(ndt), new_words[start:stop].view(ndt),
                                   start, word_size, update_old)
        if found is None:
            return None, 0
        p, ow, nw, fpd = found
        return ChunkDiff(start=start, stop=stop, positions=p, old=ow, new=nw), fpd
    if host:
        import torch

        o = old_words[start:stop].view(ndt)
        n = new_words[start:stop].view(ndt)
        rel = np.flatnonzero(o != n)
        if rel.size == 0:
            return None, 0
        p = rel + start
        ow, nw = o[rel], n[rel]
        if rel.size * DENSE_FP > stop - start:
            fpd = words_range_delta(torch.from_numpy(np.require(o.view(sdt), requirements="W")),
                                    torch.from_numpy(np.require(n.view(sdt), requirements="W")), start, word_size)
        else:
            fpd = fingerprint_delta(torch.from_numpy(p), torch.from_numpy(ow.view(sdt)),
                                    torch.from_numpy(nw.view(sdt)), word_size)
        if update_old:
            o[rel] = nw
        return ChunkDiff(start=start, stop=stop, positions=p, old=ow, new=nw), fpd
    cds, fpd = diff_device_words(old_words, new_words, [(start, stop)], word_size, update_old=update_old)
    return (cds[0] if cds else None), fpd


def diff_device_words(old_words: torch.Tensor, new_words: torch.Tensor, ranges: list[tuple[int, int]],
                      word_size: int, *, update_old: bool = False) -> tuple[list[ChunkDiff], int]:
    """:func:`diff_chunk` of every chunk ``ranges`` cuts a device tensor's flat word views into, in a few
    device passes over the whole tensor (compare + compaction, gathers, the fingerprint change of the changes)
    and one copy of the changes to the host, split into the chunks there: (chunk diffs, fingerprint change).
    Per chunk, each of those was a kernel launch and a synchronisation (~10 a chunk, ~1 s a step for a 250 MB
    model on a GPU). ``ranges``: consecutive."""
    if not ranges:
        return [], 0
    start, stop = ranges[0][0], ranges[-1][1]
    o = old_words[start:stop]
    n = new_words[start:stop]
    g = kernels.gpu_kernels(o)
    rel = g.changed_positions(o, n) if g is not None else (o != n).nonzero().squeeze(1)
    if rel.numel() == 0:
        return [], 0
    ow, nw = o.index_select(0, rel), n.index_select(0, rel)
    p = rel + start
    if rel.numel() * DENSE_FP > stop - start:  # many changes: two streaming passes beat per-change keys
        fpd = words_range_delta(o, n, start, word_size)
    else:
        fpd = fingerprint_delta(p, ow, nw, word_size)
    if update_old:
        o.index_copy_(0, rel, nw)
    ndt = numpy_word_dtype(word_size)
    pos, old_w, new_w = p.cpu().numpy(), ow.cpu().numpy().view(ndt), nw.cpu().numpy().view(ndt)
    if len(ranges) == 1:
        return [ChunkDiff(start=start, stop=stop, positions=pos, old=old_w, new=new_w)], fpd
    out = []
    lo = 0
    for (s, e), hi in zip(ranges, np.searchsorted(pos, [e for _, e in ranges]).tolist()):
        if hi > lo:
            out.append(ChunkDiff(start=s, stop=e, positions=pos[lo:hi], old=old_w[lo:hi], new=new_w[lo:hi]))
        lo = hi
    return out, fpd


PIECE_WORDS = 1 << 21  # with an executor: words compared per task (whole chunks; small tensors share a task)


def diff_states(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    base_fps: Mapping[str, int] | None = None,
    chunk_words: int = DEFAULT_CHUNK_WORDS,
    update_old: bool = False,
    progress: Callable[[int, int], None] | None = None,
    executor: Executor | None = None,
) -> StateDiff:
    """Diff two states of the same layout chunk by chunk; the new fingerprints are derived from the
    changes (``base_fps`` are the old ones when the caller tracks them, else computed: on the host with the
    compiled kernels, in the same pass as the compare, so checking a base costs no second read).
    ``executor``: compare on its threads (the compiled CPU kernels release the GIL); the result is the
    same as without."""
    if kernels.cpu_kernels() is not None:  # host tensors: the changes as columns (deltasync.columnar), same result
        from .columnar import diff_flat

        got = diff_flat(old, new, base_fps=base_fps, chunk_words=chunk_words, update_old=update_old,
                        progress=progress, executor=executor)
        if got is not None:
            return got
    _check_layout(old, new)
    names = sorted(new)
    fps_before = dict(base_fps) if base_fps is not None else {}
    fps_after: dict[str, int] = {}
    chunks: dict[str, list[ChunkDiff]] = {}
    total = sum(new[n].numel() * new[n].element_size() for n in names)
    fast = kernels.cpu_kernels() is not None
    with _no_grad():
        prepared = []  # (name, info, old words, new words, chunk ranges, host arrays or None)
        range_cache: dict[tuple[tuple[int, ...], int], list[tuple[int, int]]] = {}  # layers share shapes
        for name in names:
            o_t, n_t = old[name], new[name]
            info = dtype_info(n_t.dtype)
            if update_old and not o_t.is_contiguous():
                raise ValueError(f"{name}: update_old needs a contiguous old tensor")
            if isinstance(o_t, HostTensor) or isinstance(n_t, HostTensor):
                on_host = _on_host(o_t) and _on_host(n_t)
            else:  # two torch tensors: each device looked up once (a torch call per lookup)
                od, nd = o_t.device, n_t.device
                if od != nd:
                    n_t = n_t.to(od)
                on_host = kernels.on_host(od)
            host = None
            if fast and on_host:
                host = (_span_words(o_t, info), _span_words(n_t, info))
                ow, nw = host
            else:
                ow, nw = _chunk_words(o_t), _chunk_words(n_t)
            key = (tuple(n_t.shape), len(nw))
            ranges = range_cache.get(key)
            if ranges is None:
                ranges = range_cache[key] = tensor_chunk_ranges(key[0], key[1], chunk_words)
            if host is None and name not in fps_before:
                fps_before[name] = tensor_fingerprint(o_t, executor=executor)
            prepared.append((name, info, ow, nw, ranges, host))
        pieces = _host_pieces(prepared, executor is not None, progress is None)
        want = base_fps is None

        def run(task):
            # one compiled call per word size for the whole task (kernels.diff_jobs), results in task order
            by_size: dict[int, list[int]] = {}
            for i, (t, _, _) in enumerate(task):
                by_size.setdefault(prepared[t][1].word_size, []).append(i)
            out = [None] * len(task)
            for w, idx in by_size.items():
                spans = []
                for i in idx:
                    t, a, b = task[i]
                    spans.append((prepared[t][5][0], prepared[t][5][1], prepared[t][4][a][0], prepared[t][4][b - 1][1]))
                for i, r in zip(idx, kernels.diff_jobs(spans, w, want_lanes=want, update_old=update_old)):
                    out[i] = r
            return out

        if executor is not None and len(pieces) > 1:
            results = (r for rs in executor.map(run, pieces) for r in rs)
        else:
            results = (r for task in pieces for r in run(task))
        flat = [p for task in pieces for p in task]
        chunk_diff = _chunk_diff  # 70k a state: without the keyword __init__
        at = 0
        done = 0
        for t, (name, info, ow, nw, ranges, host) in enumerate(prepared):
            out: list[ChunkDiff] = []
            if host is not None:
                fpd_total = 0
                lanes = 0
                while at < len(flat) and flat[at][0] == t:
                    _, a, b = flat[at]
                    at += 1
                    pos, old_w, new_w, fpd, lane_sum = next(results)
                    fpd_total += fpd
                    if want:
                        lanes += lane_sum
                    if pos.size and b - a == 1:  # one chunk: all of it (most tensors)
                        s, e = ranges[a]
                        out.append(chunk_diff(start=s, stop=e, positions=pos, old=old_w, new=new_w))
                    elif pos.size:
                        cuts = np.searchsorted(pos, [e for _, e in ranges[a:b]]).tolist()
                        lo = 0
                        for (s, e), hi in zip(ranges[a:b], cuts):
                            if hi > lo:
                                out.append(ChunkDiff(start=s, stop=e, positions=pos[lo:hi], old=old_w[lo:hi],
                                                     new=new_w[lo:hi]))
                            lo = hi
                    done += (ranges[b - 1][1] - ranges[a][0]) * info.word_size
                    if progress:
                        progress(done, total)
                if want:
                    fps_before[name] = fingerprint_from_lane_sums([lanes], host[0].size * max(info.word_size // 2, 1))
                fps_after[name] = update_fingerprint(fps_before[name], fpd_total)
            elif not isinstance(ow, np.ndarray):  # a device's words: the whole tensor at once
                cds, fpd = diff_device_words(ow, nw, ranges, info.word_size, update_old=update_old)
                out.extend(cds)
                fps_after[name] = update_fingerprint(fps_before[name], fpd)
                done += (ranges[-1][1] - ranges[0][0]) * info.word_size if ranges else 0
                if progress:
                    progress(done, total)
            else:
                fp = fps_before[name]
                if executor is not None and len(ranges) > 1:
                    res = executor.map(lambda r: diff_chunk(ow, nw, r[0], r[1], info.word_size, update_old=update_old),
                                       ranges)
                else:
                    res = (diff_chunk(ow, nw, s, e, info.word_size, update_old=update_old) for s, e in ranges)
                for (s, e), (cd, fpd) in zip(ranges, res):
                    if cd is not None:
                        fp = update_fingerprint(fp, fpd)
                        out.append(cd)
                    done += (e - s) * info.word_size
                    if progress:
                        progress(done, total)
                fps_after[name] = fp
            if out:
                chunks[name] = out
    if base_fps is None:
        fps_before = {n: fps_before[n] for n in names}
    return StateDiff(layout=state_layout({n: new[n] for n in names}), chunks=chunks,
                     fps_before=fps_before, fps_after=fps_after)


def _host_pieces(prepared, threaded: bool, whole: bool = False) -> list[list[tuple[int, int, int]]]:
    """Tasks of (tensor index, first chunk, end chunk) for the host tensors: without threads one piece per
    tensor, in one task when ``whole`` (one compiled call for the state) else in tasks of about
    ``PIECE_WORDS // 2`` words (progress after each); with threads, pieces of whole chunks of about ``PIECE_WORDS`` words, small ones grouped
    into a task."""
    tasks: list[list[tuple[int, int, int]]] = []
    group: list[tuple[int, int, int]] = []
    words = 0
    for t, (_, _, _, _, ranges, host) in enumerate(prepared):
        if host is None or not ranges:
            continue
        if not threaded:
            if whole and tasks:
                tasks[0].append((t, 0, len(ranges)))
            elif not whole and tasks and words < PIECE_WORDS // 2:
                # progress after each group of about PIECE_WORDS // 2 words, not after each tensor: a state of
                # 70k small tensors was 70k compiled calls
                tasks[-1].append((t, 0, len(ranges)))
                words += ranges[-1][1]
            else:
                tasks.append([(t, 0, len(ranges))])
                words = ranges[-1][1]
            continue
        a = 0
        while a < len(ranges):
            b = a
            w = 0
            while b < len(ranges) and (w == 0 or w + ranges[b][1] - ranges[b][0] <= PIECE_WORDS):
                w += ranges[b][1] - ranges[b][0]
                b += 1
            group.append((t, a, b))
            words += w
            a = b
            if words >= PIECE_WORDS // 2:
                tasks.append(group)
                group, words = [], 0
    if group:
        tasks.append(group)
    return tasks


# -- packing chunks into blobs ------------------------------------------------------------

_RAW_STREAM = {w: f"raw{w}" for w in (1, 2, 4, 8)}


class ChunkPacker:
    """Turns per-chunk Changes into chunk records and streams, and closes blobs at the target size.

    Not thread-safe; one per encoding job.
    """

    def __init__(self, options: EncodeOptions, *, executor: Executor | None = None) -> None:
        self.options = options
        self.writer = BlobWriter(level=options.level, version=options.blob_format)
        self.blobs: dict[str, bytes] = {}
        self.order: list[str] = []
        self.refs: dict[str, list[ChunkRef]] = {}
        self._pending: list[tuple[str, int, int, int]] = []  # (tensor, index in open blob, span start, stop)
        self._ans = AnsBlobCoder(executor)  # v2: the open blob's ans chunks, coded when it closes (on executor's threads)
        # v3: the open blob's ansx chunks (or ansh: the same coder over the history's groups)
        self._cond = HistoryBlobCoder() if options.coding == CODING_HISTORY else CondBlobCoder()

    def add(self, name: str, info: DtypeInfo, start: int, stop: int, changes: Changes,
            ranks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """``ranks``: :func:`conditioned.chunk_ranks` of the chunk against its base (format 3 codes the
        chunk ``ansx`` with them; without them, or for a dtype the mode does not cover, ``ans``), or with the
        history coding :func:`history.history_ranks` against its history (``ansh``, any dtype)."""
        length = stop - start
        count = len(changes)
        if count == 0:
            return
        w = info.word_size
        record: dict = {"tensor": name, "dtype": info.name, "start": start, "stop": stop, "count": count}
        if count == length and changes.raw.all():
            self.add_dense(name, info, start, stop, changes.values)
            return
        fmt = self.options.blob_format
        if fmt == 3 and ranks is not None and (self.options.coding == CODING_HISTORY
                                               or context_spec(info.name) is not None):
            raw = self._cond.add(record, ranks, changes)
            self.writer.raw_bytes += 2 * count
            self._add(name, record, {f"raw{w}": raw})
            return
        if fmt >= 2:
            raw = self._ans.add(record, changes.positions - start, changes)
            self.writer.raw_bytes += 2 * count  # the ans words are appended when the blob closes
            self._add(name, record, {f"raw{w}": raw})
            return
        sym, tokens, ext, raw = encode_values(changes)
        mode = choose_position_mode(count, length)
        rel = changes.positions - start
        streams: dict[str, np.ndarray] = {"sym": sym, "tok": tokens, "ext": ext, f"raw{w}": raw}
        if mode == "gap":
            small, big = encode_gaps(rel)
            streams["gap"], streams["gapx"] = small, big
            record.update(mode="gap", ng=int(small.size), ngx=int(big.size))
        else:
            streams["bitmap"] = encode_bitmap(rel, length)
            record.update(mode="bitmap", ng=0, ngx=0)
        record.update(nt=int(tokens.size), ne=int(ext.size), nr=int(raw.size))
        self._add(name, record, streams)

    def takes_words(self, c: ChunkDiff) -> bool:
        """Does :meth:`add_words` apply to this chunk (compiled kernels, format 2, not a rewrite)?"""
        return (self.options.blob_format in ANS_VERSIONS and 0 < c.positions.size < c.stop - c.start
                and kernels.cpu_kernels() is not None)

    def add_words(self, name: str, info: DtypeInfo, c: ChunkDiff, symbols=None, *, checked: bool = False) -> bool:
        """:meth:`add` of a chunk's changed words, ``ans``-coded straight from them (one compiled pass;
        the bytes :meth:`add` writes from ``changes_from_words``). Returns False, doing nothing, where
        that path does not apply (:meth:`takes_words`): call :meth:`add`. ``symbols``:
        ``entropy.word_symbols`` of the chunk, computed ahead (on another thread). ``checked``: the caller
        knows :meth:`takes_words` holds."""
        if not checked and not self.takes_words(c):
            return False
        count = c.positions.size
        record: dict = {"tensor": name, "dtype": info.name, "start": c.start, "stop": c.stop, "count": count}
        raw = self._ans.add_words(record, c.positions, c.start, c.old, c.new, is_float=info.is_float, symbols=symbols)
        writer = self.writer
        writer.raw_bytes += 2 * count
        # self._add(name, record, {raw stream: raw}) without the stream-name check (format 2 has raw{w})
        if raw.size:
            parts = writer._parts
            key = _RAW_STREAM[info.word_size]
            if key in parts:
                parts[key].append(raw)
            else:
                parts[key] = [raw]
            writer.raw_bytes += raw.nbytes
        writer.chunks.append(record)
        self._pending.append((name, len(writer.chunks) - 1, c.start, c.stop))
        if writer.raw_bytes >= self.options.blob_target:
            self.close_blob()
        return True

    def add_dense(self, name: str, info: DtypeInfo, start: int, stop: int, words: np.ndarray) -> None:
        record = {"tensor": name, "dtype": info.name, "start": start, "stop": stop, "count": stop - start,
                  "mode": "dense"}
        record.update({"na": 0, "nr": 0} if self.options.blob_format >= 2 else {"ng": 0, "ngx": 0, "nt": 0, "ne": 0, "nr": 0})
        self._add(name, record, {f"dense{info.word_size}": np.ascontiguousarray(words)})

    def _add(self, name: str, record: dict, streams: dict[str, np.ndarray]) -> None:
        idx = self.writer.add_chunk(record, streams)
        self._pending.append((name, idx, record["start"], record["stop"]))
        if self.writer.raw_bytes >= self.options.blob_target:
            self.close_blob()

    def close_blob(self) -> None:
        if not self._pending:
            return
        self._ans.finish(self.writer)
        self._cond.finish(self.writer)
        data = self.writer.finish()
        bid = blob_id(data)
        if bid not in self.blobs:
            self.blobs[bid] = data
            self.order.append(bid)
        refs, ref = self.refs, _chunk_ref
        for name, idx, start, stop in self._pending:  # a ref a chunk (70k): built without the keyword __init__
            r = ref(blob=bid, index=idx, key=None, start=start, stop=stop)
            if name in refs:
                refs[name].append(r)
            else:
                refs[name] = [r]
        self._pending = []


def encode_spans(spans: list[tuple[int, int]]) -> str:
    return ",".join(f"{s}:{e}" for s, e in spans)


def chunk_spans(manifest: Manifest) -> dict[str, list[tuple[int, int]]]:
    """Tensor name -> word span of each of its chunks (in the order of its record's chunks): format 3 records
    them with the chunks (checked by the parser), format 2 in ``deltasync.spans.<name>`` meta entries.
    Tensors whose spans are absent or do not match their record are left out (a reader then needs every
    blob of that tensor)."""
    out: dict[str, list[tuple[int, int]]] = {}
    meta = manifest.meta
    for rec in manifest.tensors:
        if not rec.chunks:
            continue
        if manifest.format >= 3:  # the parser checked them (a format-2 manifest says its spans in meta)
            if rec.chunks[0].start is not None:
                out[rec.name] = [(c.start, c.stop) for c in rec.chunks]
            continue
        spans = parse_spans(meta.get(SPANS_META_PREFIX + rec.name), len(rec.chunks), rec.words)
        if spans is not None:
            out[rec.name] = spans
    return out


def encode_delta(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    model: str,
    version: int,
    parent: int,
    base_fps: Mapping[str, int] | None = None,
    options: EncodeOptions | None = None,
    meta: Mapping[str, str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    executor: Executor | None = None,
    history: StateHistory | None = None,
) -> Encoded:
    """Delta from ``old`` (version ``parent``) to ``new`` (``version``): :func:`diff_states`
    then :func:`encode_diff`.

    ``base_fps`` are the old tensors' fingerprints when the caller tracks them (the
    publisher does); otherwise they are computed. The new fingerprints are derived
    incrementally from the changes, so encoding reads each tensor once.
    ``progress(done_bytes, total_bytes)`` is called after each chunk; ``executor``: compare
    chunks and code them on its threads (:func:`diff_states`, :func:`encode_diff`). ``history``: the
    stream's history at ``parent``, for the history coding (the caller advances it once the delta is out).
    """
    options = options or EncodeOptions()
    diff = diff_states(old, new, base_fps=base_fps, chunk_words=options.chunk_words, progress=progress,
                       executor=executor)
    conditioned = options.coding == CODING_BASE_CONDITIONED
    return encode_diff(diff, model=model, version=version, parent=parent, options=options, meta=meta,
                       base=old if conditioned else None, executor=executor, history=history)


RankTable = dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _chunk_symbols(packer: ChunkPacker, order, infos, executor: Executor | None) -> Iterator:
    """Per chunk of ``order``, in order: its ``entropy.word_symbols`` where :meth:`ChunkPacker.takes_words`,
    else None; on ``executor``'s threads when one is given (a chunk's symbols depend on it alone)."""
    def one(item):
        _, name, c = item
        return word_symbols(c.positions, c.start, c.old, c.new, is_float=infos[name].is_float) \
            if packer.takes_words(c) else None

    return iter(list(map_parts(one, order, executor, weight=lambda item: item[2].positions.size)))


def diff_ranks(diff: StateDiff, base: Mapping[str, torch.Tensor]) -> RankTable:
    """What the base-conditioned coding needs of the base, O(changed) to keep: per changed chunk
    ``(tensor, start)``, :func:`conditioned.chunk_ranks` (each change's exponent group and rank in it).

    ``base``: the state before, or any state equal to it off the changed positions (the new state, or a
    publisher's reference patched in place); read once per changed chunk. Call it before that state
    moves on: :func:`encode_diff` may then run later, on any thread."""
    out: RankTable = {}
    for name, chunks in diff.chunks.items():
        info = dtype_info(diff.layout[name][0])
        spec = context_spec(info.name)
        if spec is None:
            continue
        words = _chunk_words(base[name])
        for c in chunks:
            part = words[c.start : c.stop]
            host = part if isinstance(part, np.ndarray) else part.cpu().numpy()
            out[(name, c.start)] = chunk_ranks(host.view(numpy_word_dtype(info.word_size)), c.positions - c.start,
                                               c.old, *spec)
    return out


def encode_diff(diff: StateDiff, *, model: str, version: int, parent: int, options: EncodeOptions | None = None,
                meta: Mapping[str, str] | None = None, base: Mapping[str, torch.Tensor] | None = None,
                ranks: RankTable | None = None, executor: Executor | None = None,
                history: StateHistory | None = None) -> Encoded:
    """The delta ``parent → version`` from a :class:`StateDiff` (any thread; host only); unsigned.

    The base-conditioned coding (``options.coding``) also needs ``ranks`` (:func:`diff_ranks`) or the
    ``base`` state to compute them from; the history coding needs ``history`` (the stream's
    :class:`~deltasync.history.StateHistory` at ``parent``), which it does not advance. ``executor``: code chunks
    on its threads (the compiled kernels release the GIL); the bytes are the same as without."""
    options = options or EncodeOptions()
    if options.coding == CODING_HISTORY:
        if history is not None:
            if history.version != parent:
                raise ValueError(f"the history is at v{history.version}, not at the delta's parent v{parent}")
            ranks = history.ranks(diff)
            meta = {**(meta or {}), HISTORY_META: history.meta}
        elif ranks is None or HISTORY_META not in (meta or {}):
            raise ValueError("the history coding needs the stream's history: pass history= (a StateHistory), or "
                             f"ranks=history.ranks(diff) with meta[{HISTORY_META!r}]=history.meta")
    if options.coding == CODING_BASE_CONDITIONED and ranks is None:
        if base is None:
            raise ValueError("the base-conditioned coding needs the base: pass base= (the state before) or "
                             "ranks=diff_ranks(diff, base)")
        ranks = diff_ranks(diff, base)
    if diff.flat is not None:
        from .columnar import encode_flat, takes_flat

        if takes_flat(diff, options):  # blob format 2 packed by tensor: whole blobs a compiled call, same bytes
            return encode_flat(diff, model=model, version=version, parent=parent, options=options, meta=meta,
                               executor=executor)
    packer = ChunkPacker(options, executor=executor)
    names = sorted(diff.layout)
    # A blob holding at least ``cell_blob_min`` raw bytes closes where a tensor or one of its row cells
    # begins, so a tensor-parallel rank finds its rows of a tensor in few blobs of their own.
    order: list[tuple[int, str, ChunkDiff]] = []  # (cell, tensor, chunk) in packing order
    layout, chunks, cut = diff.layout, diff.chunks, SHARD_CELLS * _diffs.MIN_CELL_WORDS  # (tests lower it)
    sizes: dict[tuple, int] = {}  # (dtype, shape) -> words: layers share shapes
    for name in names:
        cs = chunks.get(name)
        if not cs:
            continue
        key = layout[name]
        words = sizes.get(key)
        if words is None:
            words = sizes[key] = word_count(key[1], dtype_info(key[0]))
        shape = key[1]
        if len(shape) < 2 or shape[0] < 2 or words < cut:  # not cut into cells: all in cell 0 (_cell)
            order.extend([(0, name, c) for c in cs])
        else:
            order.extend((_cell(shape, words, c.start), name, c) for c in cs)
    if options.pack == "cells":
        late = tuple(options.dim1_suffixes)
        order.sort(key=lambda x: (x[1].endswith(late), 0 if x[1].endswith(late) else x[0]))  # stable
    infos = {name: dtype_info(diff.layout[name][0]) for name in names}
    symbols = _chunk_symbols(packer, order, infos, executor)
    last = None
    writer = packer.writer
    cell_min, by_tensor, late = options.cell_blob_min, options.pack == "tensor", options.dim1_suffixes
    for cell, name, c in order:
        if (name, cell) != last and writer.raw_bytes >= cell_min \
                and (by_tensor or last is None or cell != last[1] or name.endswith(late)):
            packer.close_blob()
            writer = packer.writer
        last = (name, cell)
        info = infos[name]
        sym = next(symbols)
        if sym is not None:  # _chunk_symbols asked takes_words already
            packer.add_words(name, info, c, sym, checked=True)
            continue
        ch = changes_from_words(c.positions, c.old, c.new, is_float=info.is_float)
        if c.positions.size == c.stop - c.start and ch.raw.mean() > 0.5:  # a rewritten chunk: ship it whole
            packer.add_dense(name, info, c.start, c.stop, c.new)
        else:
            packer.add(name, info, c.start, c.stop, ch, ranks.get((name, c.start)) if ranks is not None else None)
    packer.close_blob()
    tensors = []
    layout, fps_before, fps_after, refs, chunks = diff.layout, diff.fps_before, diff.fps_after, packer.refs, diff.chunks
    record, mask = _record, MASK64
    for name in names:  # 70k tensors: the record built without its keyword __init__ (values checked here)
        dtype, shape = layout[name]
        cs = chunks.get(name)
        tensors.append(record(
            name=name, dtype=dtype, shape=shape, fp_before=f"{fps_before[name] & mask:016x}",
            fp_after=f"{fps_after[name] & mask:016x}",
            changed=(cs[0].positions.size if len(cs) == 1 else sum([c.positions.size for c in cs])) if cs else 0,
            chunks=tuple(refs[name]) if name in refs else ()))
    meta = dict(meta or {})
    if options.coding != CODING_BASE_FREE:
        meta[CODING_META] = options.coding  # readers (relays, subscribers) know before fetching a blob
    if len(packer.order) > 1:  # with one blob there is nothing to select: no spans
        for name in names:
            cs = chunks.get(name)
            if cs:
                meta[SPANS_META_PREFIX + name] = f"{cs[0].start}:{cs[0].stop}" if len(cs) == 1 else \
                    encode_spans([(c.start, c.stop) for c in cs])
    lines = StateLines([t.name for t in tensors], [t.dtype for t in tensors], [t.shape for t in tensors])
    manifest = Manifest(
        model=model, version=version, parent=parent, kind="delta", tensors=tuple(tensors),
        blobs=tuple(BlobRef(id=b, size=len(packer.blobs[b])) for b in packer.order),
        state_fp=lines.digest(fp_values(t.fp_after for t in tensors)),
        state_fp_before=lines.digest(fp_values(t.fp_before for t in tensors)),
        meta=meta,
    )
    return Encoded(manifest=manifest, blobs=packer.blobs, fps=dict(diff.fps_after))


# -- decoding ---------------------------------------------------------------------------------

_CHUNK_KEYS = {"tensor", "dtype", "start", "stop", "count", "mode", "ng", "ngx", "nt", "ne", "nr"}
_CHUNK_KEYS_V2 = {"tensor", "dtype", "start", "stop", "count", "mode", "na", "nr"}
_CHUNK_BASE = {"tensor", "dtype", "start", "stop", "count", "mode"}  # the rest count stream items


#: The chunk modes of each blob format (docs/FORMAT.md §4), each with the stream items a chunk record of that mode
#: takes (stream -> items; the items of ``raw{w}`` and ``dense{w}`` are words of the chunk's dtype, the others bytes):
#: what :func:`decode_blob` accepts and what ``deltasync inspect`` counts.
CHUNK_MODES: dict[int, dict[str, Callable[[dict, int], dict[str, int]]]] = {
    1: {
        "dense": lambda r, w: {f"dense{w}": r["stop"] - r["start"]},
        "gap": lambda r, w: {"gap": r["ng"], "gapx": r["ngx"], "sym": (r["count"] + 3) // 4, "tok": r["nt"],
                             "ext": r["ne"], f"raw{w}": r["nr"]},
        "bitmap": lambda r, w: {"bitmap": (r["stop"] - r["start"] + 7) // 8, "sym": (r["count"] + 3) // 4,
                                "tok": r["nt"], "ext": r["ne"], f"raw{w}": r["nr"]},
    },
    2: {
        "dense": lambda r, w: {f"dense{w}": r["stop"] - r["start"]},
        "ans": lambda r, w: {"ans": 2 * r["na"], f"raw{w}": r["nr"]},
    },
}
CHUNK_MODES[3] = {**CHUNK_MODES[2], "ansx": lambda r, w: {"ansx": 2 * r["na"], f"raw{w}": r["nr"]},
                  "ansh": lambda r, w: {"ansh": 2 * r["na"], f"raw{w}": r["nr"]}}
CHUNK_MODES[4] = CHUNK_MODES[2]  # version 2's chunks, their records as binary columns


def chunk_bytes(version: int, rec: dict, word_size: int) -> int:
    """The raw (decompressed) stream bytes a valid chunk record of blob format ``version`` takes."""
    items = CHUNK_MODES[version][rec["mode"]](rec, word_size)
    return sum(n * word_size if s[-1].isdigit() else n for s, n in items.items())


MAX_WORDS = 1 << 48  # the largest tensor (in words) a chunk may address


def _nonneg(rec: dict, key: str) -> int:
    v = rec[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > MAX_WORDS:
        raise FormatError(f"blob chunk: {key} must be an integer in [0, 2**48], found {v!r}")
    return v


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedBlob:
    """A delta blob's chunks decoded and validated, its ``ans`` chunks as columns (no object per chunk; with the
    compiled kernels): chunk ``i`` is words ``[starts[i], stops[i])`` of tensor ``tensors[i]`` (``dtypes[i]``,
    ``word_sizes[i]``-byte words) with ``counts[i]`` changes; where ``at[i] >= 0`` those changes are
    ``columns[word_sizes[i]]``'s (positions, raw flags, values) ``[at[i] : at[i] + counts[i]]`` (absolute
    positions, strictly increasing), else the chunk is ``others[i]`` (dense, base-conditioned, format 1).
    :meth:`patch` / :meth:`patches`: the same chunks as :class:`ChunkPatch` objects (views of the columns)."""

    tensors: list[str]
    dtypes: list[str]
    starts: np.ndarray  # int64, per chunk
    stops: np.ndarray
    counts: np.ndarray
    word_sizes: np.ndarray
    at: np.ndarray  # int64: offset of the chunk's changes in its word size's columns, -1: in ``others``
    columns: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
    others: dict[int, ChunkPatch]

    def __len__(self) -> int:
        return len(self.tensors)

    def patch(self, i: int) -> ChunkPatch:
        other = self.others.get(i)
        if other is not None:
            return other
        a = int(self.at[i])
        b = a + int(self.counts[i])
        pos, raw, vals = self.columns[int(self.word_sizes[i])]
        ch = _changes(positions=pos[a:b], raw=raw[a:b], values=vals[a:b])
        return _new_patch(self.tensors[i], self.dtypes[i], int(self.starts[i]), int(self.stops[i]), ch)

    def patches(self) -> list[ChunkPatch]:
        return [self.patch(i) for i in range(len(self.tensors))]


def decode_blob(data: bytes | bytearray | memoryview, *, executor: Executor | None = None) -> list[ChunkPatch]:
    """Every chunk of a delta blob, decoded and validated. Raises FormatError on any malformed input.

    The header and stream lengths are checked first, in order; the chunks are then decoded
    independently, on ``executor``'s threads when one is given (numpy and zstd release the GIL)."""
    return decode_blob_columns(data, executor=executor).patches()


def decode_blob_columns(data: bytes | bytearray | memoryview, *, executor: Executor | None = None) -> DecodedBlob:
    """:func:`decode_blob` as a :class:`DecodedBlob`: the same checks, the same errors, the ans chunks' changes
    left in the flat arrays their compiled decode wrote (with the reference kernels every chunk is a
    :class:`ChunkPatch` in ``others``)."""
    reader = BlobReader(data)
    fast = _ans_blob_rows(reader)
    if fast is not None:  # every chunk an ans chunk, every record and stream length checked as arrays
        names, dtype_names, rows, tables, raws = fast
        at = np.full(len(names), -1, dtype=np.int64)
        columns: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for w, (idx, offsets, pos, rawf, vals) in decode_ans_columns(tables, reader.stream("ans"), raws, rows,
                                                                     executor=executor).items():
            at[idx] = offsets[:-1]
            columns[w] = (pos, rawf, vals)
        return DecodedBlob(tensors=names, dtypes=dtype_names, starts=rows[:, 4], stops=rows[:, 4] + rows[:, 3],
                           counts=rows[:, 2], word_sizes=rows[:, 7], at=at, columns=columns, others={})
    cursors: dict[str, int] = {}

    def take(stream: str, n: int, dtype: np.dtype | None = None) -> np.ndarray:
        arr = reader.stream(stream, dtype)
        at = cursors.get(stream, 0)
        if at + n > arr.size:
            raise FormatError(f"blob stream {stream!r} is shorter than its chunks need (truncated or corrupt)")
        cursors[stream] = at + n
        return arr[at : at + n]

    keys = _CHUNK_KEYS if reader.version == 1 else _CHUNK_KEYS_V2
    modes = CHUNK_MODES[reader.version]
    tables: list[AnsTables] = []  # the blob's models, parsed at its first ans chunk
    ctables: list[CondTables] = []  # v3: the blob's per-context models, parsed at its first ansx chunk
    htables: list[CondTables] = []  # v3: the same for its ansh chunks

    jobs: list[Callable[[], ChunkPatch] | None] = []
    # ans chunks: (index in jobs, tensor, dtype, stop) and their kernel rows (entropy.decode_ans_rows)
    ans_batch: list[tuple[int, str, str, int]] = []
    ans_rows: list[tuple[int, int, int, int, int, int, int, int]] = []
    dtypes: dict[str, tuple] = {}  # dtype name -> (info, word size, numpy word dtype, raw stream name)
    sizes: dict[str, int] = {}  # stream -> its size in items (ans chunks' cursors move without slicing)
    c_names: list[str] = []  # every chunk's tensor, dtype name, start, stop, count, word size
    c_dtypes: list[str] = []
    c_ints: list[tuple[int, int, int, int]] = []
    for rec in reader.chunks:
        if rec.keys() != keys:
            raise FormatError(f"blob chunk fields must be {sorted(keys)} (blob format version {reader.version}), "
                              f"found {sorted(rec)}")
        name, dtname, mode = rec["tensor"], rec["dtype"], rec["mode"]
        if type(name) is not str or type(dtname) is not str:
            if not isinstance(name, str) or not isinstance(dtname, str):
                raise FormatError("blob chunk: tensor and dtype must be strings")
        d = dtypes.get(dtname)
        if d is None:
            info = dtype_info(dtname)
            d = dtypes[dtname] = (info, info.word_size, numpy_word_dtype(info.word_size), f"raw{info.word_size}")
        info, w, wdt, rawname = d
        start, stop, count = rec["start"], rec["stop"], rec["count"]
        if type(start) is not int or type(stop) is not int or type(count) is not int or not (
                0 <= start <= MAX_WORDS and 0 <= stop <= MAX_WORDS and 0 <= count <= MAX_WORDS):
            start, stop, count = _nonneg(rec, "start"), _nonneg(rec, "stop"), _nonneg(rec, "count")
        length = stop - start
        if length <= 0 or count == 0 or count > length:
            raise FormatError(f"blob chunk {name}[{start}:{stop}] with {count} changes is inconsistent")
        if type(mode) is not str or mode not in modes:
            raise FormatError(f"blob chunk: unknown mode {mode!r} (format {reader.version} has "
                              f"{', '.join(sorted(modes))})")
        c_names.append(name)
        c_dtypes.append(info.name)
        c_ints.append((start, stop, count, w))
        if mode == "dense":
            if count != length or any(_nonneg(rec, k) for k in sorted(keys - _CHUNK_BASE)):
                raise FormatError("blob chunk: a dense chunk changes every word and has no position or value streams")
            patch = ChunkPatch(tensor=name, dtype=info.name, start=start, stop=stop, dense=take(f"dense{w}", length, wdt))
            jobs.append(lambda patch=patch: patch)
            continue
        if mode in ("ansx", "ansh"):  # context-grouped: by the base's exponents (§4.4) or the history's (§4.5)
            if mode == "ansx" and context_spec(info.name) is None:
                raise FormatError(f"blob chunk: mode 'ansx' does not apply to {info.name}")
            got = ctables if mode == "ansx" else htables
            if not got:
                got.append(CondTables.parse(reader.stream(mode + "m"), mode + "m"))
                cursors[mode + "m"] = reader.stream(mode + "m").size
            words = np.array(take(mode, 2 * _nonneg(rec, "na"))).view("<u2")
            raw = take(f"raw{w}", _nonneg(rec, "nr"), wdt)
            if int(words.size) < 2:
                raise FormatError(f"{mode} chunk: its message is shorter than the 2-word state")
            msg = dict(tables=got[0], words=words, raw=raw, count=count, start=start, length=length, word_size=w)
            pending = PendingChanges(**msg, dtype=info.name) if mode == "ansx" else PendingHistory(**msg)
            patch = ChunkPatch(tensor=name, dtype=info.name, start=start, stop=stop, pending=pending)
            jobs.append(lambda patch=patch: patch)
            continue
        if mode == "ans":
            if not tables:
                tables.append(AnsTables.parse(reader.stream("ansm")))
                cursors["ansm"] = reader.stream("ansm").size
            na, nr = rec["na"], rec["nr"]
            if type(na) is not int or type(nr) is not int or not (0 <= na <= MAX_WORDS and 0 <= nr <= MAX_WORDS):
                na, nr = _nonneg(rec, "na"), _nonneg(rec, "nr")
            # take("ans", 2 * na) and take(raw, nr, wdt) without the slices (the kernel addresses the streams)
            at, r0 = cursors.get("ans", 0), cursors.get(rawname, 0)
            for stream, n, dt in (("ans", 2 * na, None), (rawname, nr, wdt)):
                size = sizes.get(stream)
                if size is None:
                    size = sizes[stream] = reader.stream(stream, dt).size
                end = cursors.get(stream, 0) + n
                if end > size:
                    raise FormatError(f"blob stream {stream!r} is shorter than its chunks need (truncated or corrupt)")
                cursors[stream] = end
            ans_batch.append((len(jobs), name, info.name, stop))
            ans_rows.append((at, na, count, length, start, r0, nr, w))
            jobs.append(None)  # decoded with the blob's other ans chunks, below
            continue
        if mode == "gap":
            pos = ("gap", take("gap", _nonneg(rec, "ng")), take("gapx", _nonneg(rec, "ngx")))
        else:  # bitmap
            pos = ("bitmap", take("bitmap", (length + 7) // 8), None)
        parts = (take("sym", (count + 3) // 4), take("tok", _nonneg(rec, "nt")), take("ext", _nonneg(rec, "ne")),
                 take(f"raw{w}", _nonneg(rec, "nr"), wdt))
        jobs.append(lambda name=name, info=info, start=start, stop=stop, count=count, pos=pos, parts=parts:
                    _decode_chunk(name, info, start, stop, count, pos, parts))
    for stream, at in cursors.items():
        if at != reader.stream(stream).size:
            raise FormatError(f"blob stream {stream!r} has bytes no chunk uses")
    for stream in reader.stream_names:
        if stream not in cursors:
            raise FormatError(f"blob stream {stream!r} has bytes no chunk uses")
    ints = np.array(c_ints, dtype=np.int64).reshape(-1, 4)
    at = np.full(len(jobs), -1, dtype=np.int64)
    columns: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    others: dict[int, ChunkPatch] = {}
    if ans_batch:  # (format 2 blobs have no gap/bitmap chunks, so errors still come in chunk order)
        raws = {w: reader.stream(f"raw{w}", numpy_word_dtype(w)) for w in {r[-1] for r in ans_rows}}
        if kernels.cpu_kernels() is not None:
            which = np.fromiter((b[0] for b in ans_batch), dtype=np.int64, count=len(ans_batch))
            got = decode_ans_columns(tables[0], reader.stream("ans"), raws,
                                     np.array(ans_rows, dtype=np.int64).reshape(-1, 8), executor=executor)
            for w, (idx, offsets, pos, rawf, vals) in got.items():
                at[which[idx]] = offsets[:-1]
                columns[w] = (pos, rawf, vals)
        else:
            decoded = decode_ans_rows(tables[0], reader.stream("ans"), raws, ans_rows, executor=executor)
            new = _new_patch
            for (i, name, dtname, stop), (_, _, _, _, start, _, _, _), ch in zip(ans_batch, ans_rows, decoded):
                others[i] = new(name, dtname, start, stop, ch)
    todo = [i for i, job in enumerate(jobs) if job is not None]
    for i, p in zip(todo, map_parts(lambda i: jobs[i](), todo, executor)):
        others[i] = p
    return DecodedBlob(tensors=c_names, dtypes=c_dtypes, starts=ints[:, 0], stops=ints[:, 1], counts=ints[:, 2],
                       word_sizes=ints[:, 3], at=at, columns=columns, others=others)


_patch = maker(ChunkPatch)
_changes = maker(Changes)


_MODE, _TENSOR, _DTYPE = itemgetter("mode"), itemgetter("tensor"), itemgetter("dtype")
_INTS = itemgetter("start", "stop", "count", "na", "nr")


def _ans_blob_rows(reader: BlobReader):
    """A format-2/3/4 blob whose chunks are all ``ans`` chunks, its records checked as columns: (tensor names,
    dtype names, int64 kernel rows ``(at, na, count, length, start, r0, nr, word size)``, its tables, its raw
    word streams); None for any other blob or where any check fails (the record-by-record loop then raises
    the error, in chunk order). The same checks as that loop: fields, types, ranges, stream lengths."""
    if reader.version < 2 or kernels.cpu_kernels() is None:
        return None
    cols = reader.columns
    n = len(cols) if cols is not None else len(reader.chunks)
    if not n:
        return None
    try:
        if cols is not None:  # version 4: the records are columns already
            if (cols.mode != 0).any():  # COLUMN_MODES[0] == "ans"
                return None
            names = cols.names
            infos = {d: dtype_info(d) for d in set(cols.dtype_names)}
            code_ws = np.array([infos[d].word_size for d in cols.dtype_names], dtype=np.int64)
            canon_of = [infos[d].name for d in cols.dtype_names]
            dtn_list = [canon_of[i] for i in cols.dtype.tolist()] if len(canon_of) > 1 else [canon_of[0]] * n
            ws = code_ws[cols.dtype]
            arr = cols.ints.view(np.int64)  # past 2**63: negative, refused below as past MAX_WORDS is
        else:
            chunks = reader.chunks
            if not all(map(operator.eq, map(dict.keys, chunks), repeat(_CHUNK_KEYS_V2))):
                return None
            if set(map(_MODE, chunks)) != {"ans"}:
                return None
            names = list(map(_TENSOR, chunks))
            dtns = list(map(_DTYPE, chunks))
            if set(map(type, names)) != {str} or set(map(type, dtns)) != {str}:
                return None
            ints = list(map(_INTS, chunks))  # (start, stop, count, na, nr) of each record
            if set(map(type, chain.from_iterable(ints))) != {int}:
                return None
            arr = np.array(ints, dtype=np.int64).reshape(n, 5).T
            infos = {d: dtype_info(d) for d in set(dtns)}
            canon = {d: i.name for d, i in infos.items()}
            dtn_list = [canon[d] for d in dtns]
            ws = np.array([infos[d].word_size for d in dtns], dtype=np.int64)
        if (arr < 0).any() or (arr > MAX_WORDS).any():
            return None
        start, stop, count, na, nr = arr
        length = stop - start
        if ((length <= 0) | (count == 0) | (count > length)).any():
            return None
        wsizes = word_sizes_in(ws)
        if not set(reader.stream_names) <= {"ans", "ansm", *(f"raw{w}" for w in wsizes)}:
            return None  # a stream no chunk uses
        ans = reader.stream("ans")
        if int(na.sum()) * 2 != ans.size:
            return None
        raws = {}
        r0 = np.zeros(n, dtype=np.int64)
        for w in wsizes:
            raw = reader.stream(f"raw{w}", numpy_word_dtype(w))
            sel = np.flatnonzero(ws == w) if len(wsizes) > 1 else slice(None)
            k = nr[sel]
            if int(k.sum()) != raw.size:
                return None
            r0[sel] = np.cumsum(k) - k
            raws[w] = raw
        tables = AnsTables.parse(reader.stream("ansm"))
    except Exception:  # noqa: BLE001 - anything odd: the record-by-record loop says what, in its order
        return None
    rows = np.empty((n, 8), dtype=np.int64)
    rows[:, 0] = np.cumsum(2 * na) - 2 * na
    rows[:, 1] = na
    rows[:, 2] = count
    rows[:, 3] = length
    rows[:, 4] = start
    rows[:, 5] = r0
    rows[:, 6] = nr
    rows[:, 7] = ws
    return names, dtn_list, rows, tables, raws


_record, _chunk_ref, _chunk_diff = maker(TensorRecord), maker(ChunkRef), maker(ChunkDiff)
def _new_patch(tensor: str, dtype: str, start: int, stop: int, changes: Changes) -> ChunkPatch:
    """``ChunkPatch(tensor=..., dtype=..., start=..., stop=..., changes=...)`` without the keyword
    ``__init__`` of a frozen dataclass (decode_blob makes one per chunk)."""
    return _patch(tensor=tensor, dtype=dtype, start=start, stop=stop, changes=changes, dense=None, pending=None)


def _decode_chunk(name: str, info: DtypeInfo, start: int, stop: int, count: int, pos, parts) -> ChunkPatch:
    length = stop - start
    mode, a, b = pos
    rel = decode_gaps(a, b, count, length) if mode == "gap" else decode_bitmap(a, count, length)
    sym, tokens, ext, raw = parts
    changes = decode_values(rel + start, sym, tokens, ext, raw, info.word_size)
    return ChunkPatch(tensor=name, dtype=info.name, start=start, stop=stop, changes=changes)
