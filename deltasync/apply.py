"""Patch live tensors in place, verified, all or nothing.

Two phases, so the expensive part can run while inference goes on:

1. :func:`prepare_delta` (host only, any thread): decode every blob of a version,
   check that the chunks match the manifest exactly. Touches no live tensor.
2. :func:`stage_prepared` / :func:`apply_prepared` (between batches): refuse unless every tensor's tracked
   fingerprint equals the manifest's ``fp_before``; then patch each chunk in place
   (gather old words, write new ones, keep the old words for undo), read the
   written words back and update the fingerprint incrementally (O(changed)); on
   any mismatch or exception, restore every word touched, in reverse order, and
   raise. No second copy of the model is made: undo memory is O(changed words).

:func:`stage_prepared` leaves the undo log open (:class:`StagedPatch`: ``commit()`` drops it,
``rollback()`` restores every word), so a caller can check more (the signed state
fingerprint, a vote across ranks) before the version is final; :func:`apply_prepared`
is stage + commit. ``prepare_delta(..., only=ids)`` decodes a subset of the blobs (a
target that holds part of the model); tensors whose chunks all lie outside it are
left out (listed in ``PreparedDelta.skipped``).

Targets are a ``dict`` of tensors or an ``nn.Module`` (parameters and buffers by
their state-dict names), on CPU or GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, itemgetter

import weakref

import numpy as np
import torch

from .codec import DENSE_FP, ChunkPatch, DecodedBlob, chunk_spans, decode_blob_columns
from . import kernels
from .dtypes import dtype_info, host_words, numpy_word_dtype, signed_word_dtype, word_count, word_view, word_sizes_in
from .blob import verify_blob
from .parts import split_counts
from .conditioned import CODING_HISTORY, CODINGS
from .errors import (ApplyError, BaseMismatchError, DeltaSyncError, FormatError, IntegrityError, NotFoundError,
                     UnsupportedError)
from .history import HISTORY_META, PendingHistory, StateHistory
from .fingerprint import (FingerprintTable, NameIndex, StateLines, fingerprint_delta, words_range_delta, fp_hex,
                          state_fingerprint, tensor_fingerprint, update_fingerprint)
from .kernels.fpkeys import MASK64
from .manifest import Manifest, TensorRecord, table_columns
from .tensortable import fp_values
from .tensorfile import TensorViews
from .values import Changes

BlobSource = Mapping[str, bytes] | Callable[[str], bytes]


def live_tensors(target) -> dict[str, torch.Tensor]:
    """Name -> tensor sharing storage with the target (a dict or an nn.Module)."""
    if isinstance(target, torch.nn.Module):
        out = {}
        for name, t in target.state_dict(keep_vars=True).items():
            out[name] = t.detach()
        return out
    if isinstance(target, TensorViews):  # a mapped file's views, made as they are asked for: not all up front
        return target
    if isinstance(target, Mapping):
        return dict(target)
    raise TypeError(f"target must be a dict of tensors or an nn.Module, found {type(target).__name__}")


def get_blob(blobs: BlobSource, bid: str, size: int) -> bytes:
    """A blob from a dict or a callable, checked against its id and size before anything decodes it."""
    try:
        data = blobs(bid) if callable(blobs) else blobs[bid]
    except KeyError:
        raise NotFoundError(f"blob {bid} is not available") from None
    if len(data) != size:
        raise IntegrityError(f"blob {bid}: {len(data)} bytes, manifest says {size}")
    verify_blob(bid, data)
    return data


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedDelta:
    manifest: Manifest
    patches: Mapping[str, list[ChunkPatch]]  # tensor name -> chunks in word order (a ColumnarPatches: as columns)
    decoded_bytes: int
    skipped: frozenset[str] = frozenset()  # tensors left out by ``prepare_delta(only=...)``


def prepare_delta(manifest: Manifest, blobs: BlobSource, *, executor: Executor | None = None,
                  only: set[str] | frozenset[str] | None = None, history: StateHistory | None = None,
                  wanted: Callable[[str, int, int], bool] | None = None) -> PreparedDelta:
    """Decode a delta's blobs and check them against its manifest. Raises FormatError/IntegrityError.

    ``executor``: decode chunks on its threads (the caller owns it; the core starts none).
    ``only``: decode just these blob ids (None: all). A tensor with no chunk in them is left
    out (``skipped``); a tensor with chunks both in and out of them raises FormatError.
    ``history``: the stream's history at the delta's parent, which a history-coded delta needs (docs/FORMAT.md
    §4.5; not advanced here: the caller takes the delta in once it is applied). ``wanted(tensor, start, stop)``: with
    a history-coded delta, decode only the chunks it accepts (the others are left out as with ``only``): a target
    that holds part of the model (an engine rank) asks for the same chunk spans every step, so its history of
    them is whole."""
    if manifest.kind != "delta":
        raise FormatError(f"v{manifest.version} is a {manifest.kind}, not a delta")
    if manifest.coding not in CODINGS:
        raise UnsupportedError(f"v{manifest.version} uses the {manifest.coding!r} coding, which this reader does not "
                               f"know (it reads {', '.join(CODINGS)}): upgrade deltasync")
    by_history = manifest.coding == CODING_HISTORY
    if by_history:
        if history is None:
            raise UnsupportedError(f"v{manifest.version} uses the history coding: decoding it needs the stream's "
                                   f"history of the deltas since v{manifest.meta.get(HISTORY_META, '?').split(':')[0]} "
                                   "(prepare_delta(history=))")
        history.check(manifest)
    if only is not None:
        unknown = set(only) - {ref.id for ref in manifest.blobs}
        if unknown:
            raise FormatError(f"v{manifest.version} has no blobs {sorted(unknown)[:3]} (asked for in only=)")
    decs: dict[str, DecodedBlob] = {}
    total = 0
    skipped: set[str] = set()
    for ref in manifest.blobs:
        if only is not None and ref.id not in only:
            continue
        data = get_blob(blobs, ref.id, ref.size)
        decs[ref.id] = decode_blob_columns(data, executor=executor)
        total += len(data)
    if only is None and any(d.columns for d in decs.values()):
        cols = _columns_of(manifest, decs)  # None: a check failed; the reference below says which
        if cols is not None:
            return PreparedDelta(manifest=manifest, patches=cols, decoded_bytes=total)
    decoded = {bid: d.patches() for bid, d in decs.items()}
    used: set[tuple[str, int]] = set()
    patches: dict[str, list[ChunkPatch]] = {}
    spans = chunk_spans(manifest) if only is not None else {}
    for rec in manifest.tensors:
        info = dtype_info(rec.dtype)
        if not rec.chunks:  # unchanged (most tensors of a sparse step): nothing to decode or check but its count
            if rec.changed != 0:
                raise FormatError(f"{rec.name}: chunks carry 0 changes, manifest says {rec.changed}")
            continue
        words = rec.words
        if only is not None:
            inside = [ref.blob in decoded for ref in rec.chunks]
            if inside and not any(inside):
                skipped.add(rec.name)
                continue
            partial = not all(inside)
            if partial and rec.name not in spans:
                missing = sorted({ref.blob for ref in rec.chunks if ref.blob not in decoded})
                raise FormatError(f"{rec.name}: its chunks are also in blobs {missing[:3]}, which only= leaves out; "
                                  "a target must ask for every blob of each tensor it holds (or the manifest must "
                                  "record the tensor's chunk spans)")
        else:
            partial = False
        out = []
        count = 0
        last_stop = 0
        for k, ref in enumerate(rec.chunks):
            if partial and ref.blob not in decoded:
                continue  # a row range this target does not hold (chunk spans, docs/FORMAT.md 5.1)
            chunks = decoded[ref.blob]
            if by_history and wanted is not None and ref.index is not None and ref.index < len(chunks):
                c = chunks[ref.index]
                if c.tensor == rec.name and not wanted(rec.name, c.start, c.stop):
                    partial = True  # not this target's: neither decoded nor taken into its history
                    used.add((ref.blob, ref.index))
                    continue
            if ref.index is None or ref.index >= len(chunks):
                raise FormatError(f"{rec.name}: chunk {ref.index} not in blob {ref.blob}")
            p = chunks[ref.index]
            if p.tensor != rec.name or p.dtype != info.name:
                raise FormatError(f"{rec.name}: chunk {ref.index} of blob {ref.blob} belongs to {p.tensor} ({p.dtype})")
            if p.start < last_stop or p.stop > words:
                raise FormatError(f"{rec.name}: chunk [{p.start}:{p.stop}] overlaps or leaves the tensor of {words} words")
            if isinstance(p.pending, PendingHistory):
                if not by_history:
                    raise FormatError(f"{rec.name}: chunk {ref.index} of blob {ref.blob} is history-coded (ansh), "
                                      f"the manifest says the {manifest.coding} coding")
                p = p.resolve_history(history.chunk(rec.name, p.start, p.stop))
            if partial and rec.name in spans and (p.start, p.stop) != spans[rec.name][k]:
                raise FormatError(f"{rec.name}: chunk {k} covers [{p.start}:{p.stop}], its recorded span is "
                                  f"{spans[rec.name][k]}")
            last_stop = p.stop
            count += p.count
            used.add((ref.blob, ref.index))
            out.append(p)
        if count != rec.changed and not partial:
            raise FormatError(f"{rec.name}: chunks carry {count} changes, manifest says {rec.changed}")
        if out:
            patches[rec.name] = out
    n_chunks = sum(len(v) for v in decoded.values())
    if len(used) != n_chunks:
        raise FormatError(f"blobs hold {n_chunks} chunks but the manifest uses {len(used)}")
    return PreparedDelta(manifest=manifest, patches=patches, decoded_bytes=total, skipped=frozenset(skipped))


class ColumnarPatches(Mapping):
    """``PreparedDelta.patches`` of a delta whose chunks are all columns (``ans`` chunks decoded by the compiled
    kernels, :class:`~deltasync.codec.DecodedBlob`): no object per chunk. Tensor ``names[t]`` (dtype
    ``dtypes[t]``) has chunk rows ``[first[t], first[t + 1])``, in word order; row ``r`` is words
    ``[starts[r], stops[r])`` of tensor ``tensor[r]`` with ``counts[r]`` changes at ``[at[r], at[r] + counts[r])``
    of segment ``seg[r]`` of ``columns[word_sizes[r]]`` (a list of (positions, raw flags, values) arrays: one
    segment per blob, as its decode wrote them, not copied together), or, where ``at[r] < 0``, the chunk is
    ``others[r]`` (a dense or base-conditioned one). As a mapping: name -> ChunkPatch list (views of the columns,
    made on demand) for the callers that take chunks one by one."""

    __slots__ = ("names", "dtypes", "first", "tensor", "starts", "stops", "counts", "word_sizes", "at", "seg",
                 "columns", "others", "_where", "_made", "_pure")

    def __init__(self, *, names, dtypes, first, tensor, starts, stops, counts, word_sizes, at, seg, columns,
                 others=None) -> None:
        self.names, self.dtypes, self.first, self.tensor = names, dtypes, first, tensor
        self.starts, self.stops, self.counts, self.word_sizes, self.at = starts, stops, counts, word_sizes, at
        self.seg = seg
        self.columns: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = columns
        self.others: dict[int, ChunkPatch] = others or {}
        self._where: dict[str, int] | None = None
        self._made: dict[str, list[ChunkPatch]] = {}
        self._pure: tuple | None = None

    def pure(self) -> tuple["ColumnarPatches", np.ndarray, list[int]]:
        """(the tensors whose chunks are all columns, as ColumnarPatches; their indices here; the indices of the
        others, in order): the columnar paths take the first, the chunk-by-chunk ones the rest."""
        if self._pure is not None:
            sub, kept, dropped = self._pure
            return (self if sub is None else sub), kept, dropped
        n = len(self.names)
        if not self.others:
            self._pure = (None, np.arange(n, dtype=np.int64), [])  # (None: itself; no cycle through self)
            return self, self._pure[1], self._pure[2]
        keep = np.ones(n, dtype=np.bool_)
        keep[self.tensor[np.fromiter(self.others, dtype=np.int64, count=len(self.others))]] = False
        rows = keep[self.tensor]
        kept = np.flatnonzero(keep)
        first = np.zeros(kept.size + 1, dtype=np.int64)
        np.cumsum(np.diff(self.first)[keep], out=first[1:])
        renumber = np.cumsum(keep) - 1
        sub = ColumnarPatches(names=[self.names[t] for t in kept.tolist()], dtypes=[self.dtypes[t] for t in kept.tolist()],
                              first=first, tensor=renumber[self.tensor[rows]], starts=self.starts[rows],
                              stops=self.stops[rows], counts=self.counts[rows], word_sizes=self.word_sizes[rows],
                              at=self.at[rows], seg=self.seg[rows], columns=self.columns)
        self._pure = (sub, kept, np.flatnonzero(~keep).tolist())
        return self._pure

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self):
        return iter(self.names)

    def __contains__(self, name) -> bool:
        if self._where is None:
            self._where = {n: t for t, n in enumerate(self.names)}
        return name in self._where

    def __getitem__(self, name: str) -> list[ChunkPatch]:
        made = self._made.get(name)
        if made is not None:
            return made
        if self._where is None:
            self._where = {n: t for t, n in enumerate(self.names)}
        t = self._where[name]
        out = []
        for r in range(int(self.first[t]), int(self.first[t + 1])):
            other = self.others.get(r)
            if other is not None:
                out.append(other)
                continue
            a = int(self.at[r])
            b = a + int(self.counts[r])
            pos, raw, vals = self.columns[int(self.word_sizes[r])][int(self.seg[r])]
            out.append(ChunkPatch(tensor=name, dtype=self.dtypes[t], start=int(self.starts[r]), stop=int(self.stops[r]),
                                  changes=Changes(positions=pos[a:b], raw=raw[a:b], values=vals[a:b])))
        self._made[name] = out
        return out


def _columns_of(manifest: Manifest, decs: dict[str, DecodedBlob]) -> ColumnarPatches | None:
    """prepare_delta's checks of every chunk against the manifest, as arrays: the chunks in manifest order as a
    :class:`ColumnarPatches`, or None when any check fails (the caller's reference loop then raises the error)."""
    blob_ids = list(decs)
    bpos = {b: i for i, b in enumerate(blob_ids)}
    got = _chunk_columns(manifest, bpos)
    if got is None:
        return None
    names, rec_dtypes, keys, want_changed, n_refs, ref_blob, ref_index = got  # keys: word counts, from a table
    n_list = n_refs.tolist()
    single = n_refs.size == int(n_refs.sum())  # one chunk a tensor (most tensors of a sparse step)
    sizes = np.array([len(decs[b]) for b in blob_ids], dtype=np.int64)
    row0 = np.zeros(len(blob_ids) + 1, dtype=np.int64)
    np.cumsum(sizes, out=row0[1:])
    if (ref_index < 0).any() or (ref_index >= sizes[ref_blob]).any():
        return None
    g = row0[ref_blob] + ref_index  # each reference's row among all blobs' chunks
    if g.size != int(row0[-1]) or not (g.size < 2 or bool((g[1:] > g[:-1]).all()) or np.unique(g).size == g.size):
        return None  # a chunk used twice or not at all (a writer's are in blob order: ascending, no sort)
    # every blob's chunk columns, one after the other (the changes: each blob's arrays, a segment per word size)
    all_names: list[str] = []
    all_dtypes: list[str] = []
    for b in blob_ids:
        all_names += decs[b].tensors
        all_dtypes += decs[b].dtypes
    cat = {k: np.concatenate([getattr(decs[b], k) for b in blob_ids])
           for k in ("starts", "stops", "counts", "word_sizes")}
    seg_parts = []
    flat: dict[int, list] = {}
    for b in blob_ids:
        d = decs[b]
        seg = np.zeros(len(d), dtype=np.int64)
        for w, arrays in d.columns.items():
            segs = flat.setdefault(w, [])
            seg[d.word_sizes == w] = len(segs)
            segs.append(arrays)
        seg_parts.append(seg)
    seg_all = np.concatenate(seg_parts)
    at_all = np.concatenate([decs[b].at for b in blob_ids])
    # the checks of prepare_delta's reference loop, as list and array compares
    if isinstance(keys, np.ndarray):  # a table's columns: canonical dtype names, words counted and checked
        want_dtypes, words = rec_dtypes, keys
    else:
        try:
            infos = {d: dtype_info(d) for d in set(rec_dtypes)}
            words_of = {k: word_count(k[1], infos[k[0]]) for k in set(keys)}
        except Exception:  # noqa: BLE001 - the reference loop says what
            return None
        canon = {d: i.name for d, i in infos.items()}
        want_dtypes = list(map(canon.__getitem__, rec_dtypes))
        words = np.fromiter(map(words_of.__getitem__, keys), dtype=np.int64, count=len(keys))
    got = itemgetter(*g.tolist())
    got_names, got_dtypes = got(all_names), got(all_dtypes)
    if len(g) == 1:
        got_names, got_dtypes = (got_names,), (got_dtypes,)
    if single:
        if got_names != tuple(names) or got_dtypes != tuple(want_dtypes):
            return None
    elif (got_names != tuple(chain.from_iterable(map(repeat, names, n_list)))
          or got_dtypes != tuple(chain.from_iterable(map(repeat, want_dtypes, n_list)))):
        return None
    first = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(n_refs, out=first[1:])
    tensor = np.repeat(np.arange(len(names), dtype=np.int64), n_refs)
    starts, stops, counts = cat["starts"][g], cat["stops"][g], cat["counts"][g]
    later = np.ones(g.size, dtype=np.bool_)
    later[first[:-1]] = False  # each tensor's first chunk starts at 0 or later: its start is never negative
    if (starts[1:][later[1:]] < stops[:-1][later[1:]]).any():
        return None
    if (stops > words[tensor]).any():
        return None
    if (np.add.reduceat(counts, first[:-1]) != want_changed).any():
        return None
    at = at_all[g]
    others = {}
    if any(d.others for d in decs.values()):
        for r in np.flatnonzero(at < 0).tolist():
            others[r] = decs[blob_ids[int(ref_blob[r])]].others[int(ref_index[r])]
    return ColumnarPatches(names=names, dtypes=want_dtypes, first=first, tensor=tensor, starts=starts, stops=stops,
                           counts=counts, word_sizes=cat["word_sizes"][g], at=at, seg=seg_all[g], columns=flat,
                           others=others)


def _chunk_columns(manifest: Manifest, bpos: Mapping[str, int]):
    """What :func:`_columns_of` checks of the manifest, as columns: of the tensors with chunks (None where a
    changed tensor has none) their names, dtype names, word counts (int64 array; or their (dtype, shape) keys: the
    caller counts), change counts (int64) and chunk counts,
    and per chunk its blob's position in ``bpos`` and its index there; None where a chunk's blob is not decoded
    or its index is not an integer. From a parsed format-3 manifest's table columns (no record made) or from
    its records."""
    cols = table_columns(manifest)
    if cols is not None and cols.kind == "delta":
        has = cols.counts > 0
        if not has.all() and (cols.changed[~has] > 0).any():
            return None
        rows = np.flatnonzero(has)
        if not rows.size:
            return None
        names, dtypes = cols.names, cols.dtypes()  # canonical dtype names; the words the table checked
        if rows.size != len(names):
            keep = rows.tolist()
            names, dtypes = [names[i] for i in keep], [dtypes[i] for i in keep]
        pos = np.array([bpos.get(b, -1) for b in cols.blob_ids], dtype=np.int64)
        ref_blob = pos[cols.cblob] if cols.cblob.size else np.zeros(0, np.int64)
        if (ref_blob < 0).any():
            return None  # a blob not decoded
        return (names, dtypes, cols.words[rows], cols.changed[rows].astype(np.int64),
                cols.counts[rows].astype(np.int64), ref_blob, cols.cindex)
    recs = [r for r in manifest.tensors if r.chunks]
    if len(recs) != len(manifest.tensors) and any(r.changed for r in manifest.tensors if not r.chunks):
        return None
    if not recs:
        return None
    chunk_lists = list(map(_get_chunks, recs))
    n_refs = np.fromiter(map(len, chunk_lists), dtype=np.int64, count=len(recs))
    flat_refs = [c for cl in chunk_lists for c in cl] if n_refs.size != int(n_refs.sum()) else \
        [cl[0] for cl in chunk_lists]
    try:
        ref_blob = np.fromiter(map(bpos.__getitem__, map(_get_blob, flat_refs)), dtype=np.int64, count=len(flat_refs))
        ref_index = np.fromiter(map(_get_index, flat_refs), dtype=np.int64, count=len(flat_refs))
        want_changed = np.fromiter(map(_get_changed, recs), dtype=np.int64, count=len(recs))
    except (KeyError, TypeError, ValueError, OverflowError):  # a blob not decoded, an index None or out of range
        return None
    dtypes = list(map(_get_dtype, recs))
    return (list(map(_get_name, recs)), dtypes, list(zip(dtypes, map(_get_shape, recs))), want_changed, n_refs,
            ref_blob, ref_index)


_get_chunks, _get_blob, _get_index = attrgetter("chunks"), attrgetter("blob"), attrgetter("index")
_get_dtype, _get_shape, _get_name, _get_changed = (attrgetter("dtype"), attrgetter("shape"), attrgetter("name"),
                                                   attrgetter("changed"))
_get_fp_before, _get_fp_after = attrgetter("fp_before"), attrgetter("fp_after")

_BATCHED = "batched"  # marks an undo entry of _patch_batched
_COLUMNS = "columns"  # marks an undo entry of _patch_columns


class _Undo:
    """Old words of everything patched so far, to restore in reverse order.

    Entries are torch records ``(words, where, old, live, work)``, from the compiled CPU path host
    records ``(None, host words, positions or a slice, old words, live, work)``, or from the batched
    path (:func:`_patch_batched`) ``(_BATCHED, contiguous CPU tensor, positions, old words)``."""

    def __init__(self) -> None:
        self.entries: list[tuple] = []

    def rollback(self) -> None:
        for entry in reversed(self.entries):
            if entry[0] is _COLUMNS:  # jobs of patch_jobs run again, each writing its old words back (raw)
                _, jobs, old, offsets, w, keep = entry
                kernels.unpatch_jobs(jobs, old, offsets, w)
                continue
            if entry[0] is _BATCHED:  # a contiguous CPU tensor patched in place: its words shared with numpy
                _, t, positions, old = entry
                kernels.scatter_words(host_words(t), positions, old)
                continue
            if entry[0] is None:  # host words, restored by the compiled scatter
                _, host, where, old, live, work = entry
                if isinstance(where, slice):
                    host[where] = old
                else:
                    kernels.scatter_words(host, where, old)
            else:
                words, where, old, live, work = entry
                if isinstance(where, slice):
                    words[where] = old
                else:
                    words.index_copy_(0, where, old)
            if live is not None:
                live.copy_(work)
        self.entries.clear()


_ALIASES: list = []  # [(names, addresses, shapes, aliases)] of the last target asked about


def find_aliases(tensors: Mapping[str, torch.Tensor], *, check: Callable[[], None] | None = None) -> dict[str, str]:
    """Names whose tensor is the very same memory as an earlier name's (tied weights) -> that name.

    Tensors that overlap in memory without being identical views cannot be patched safely
    and raise ApplyError. ``check``: called every ``CHECK_EVERY`` tensors (see :func:`stage_prepared`).
    The answer for the last target is kept while its names are the same tensor objects at the same data addresses
    and sizes (an engine's tensors stay put between steps; the full check costs ~14 µs a tensor, a second at 70k
    tensors, on every apply)."""
    names = list(tensors)
    values = list(tensors.values())
    ptrs = [t.data_ptr() for t in values]
    sizes = [t.numel() for t in values]
    if _ALIASES:
        n0, refs, p0, z0, found = _ALIASES[0]
        # the very same tensor objects (alive: weak references), at the same addresses with the same sizes: an
        # engine's tensors between steps. Reading every shape, stride and dtype again cost ~0.3 s at 70k tensors;
        # only an in-place metadata change of a live tensor (resize_, as_strided_) could slip past, not a new one
        if n0 == names and p0 == ptrs and z0 == sizes and all(r() is t for r, t in zip(refs, values)):
            return dict(found)
    found = _find_aliases(tensors, check)
    try:
        refs = [weakref.ref(t) for t in values]
    except TypeError:  # not weak-referenceable: no cache
        _ALIASES.clear()
        return dict(found)
    _ALIASES[:] = [(names, refs, ptrs, sizes, found)]
    return dict(found)


def _find_aliases(tensors: Mapping[str, torch.Tensor], check: Callable[[], None] | None) -> dict[str, str]:
    seen: dict[tuple, str] = {}
    spans: dict[int, list[tuple[int, int, str]]] = {}
    aliases: dict[str, str] = {}
    for k, name in enumerate(sorted(tensors)):
        if check is not None and not k % CHECK_EVERY:
            check()
        t = tensors[name]
        if t.numel() == 0:
            continue
        storage = t.untyped_storage().data_ptr()
        key = (t.device, storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        lo = t.storage_offset() * t.element_size()
        hi = lo + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        spans.setdefault(storage, []).append((lo, hi, name))
    # overlaps, per storage, in one sorted sweep (all of a mapped file's tensors share one storage: comparing
    # each with every earlier one was quadratic, ~40 s at 20k tensors)
    for group in spans.values():
        group.sort()
        reach, last = -1, ""
        for lo, hi, name in group:
            if lo < reach:
                raise ApplyError(f"{name} and {last} overlap in memory without being the same tensor; "
                                 "cannot patch them independently")
            if hi > reach:
                reach, last = hi, name
    return aliases


_INFO: dict[torch.dtype, object] = {}


def _info(dtype: torch.dtype):
    """``dtype_info`` of a torch dtype, memoised (the apply path asks once per tensor, several times)."""
    info = _INFO.get(dtype)
    if info is None:
        info = _INFO[dtype] = dtype_info(dtype)
    return info


class LayoutColumns:
    """A layout (name -> (dtype name, shape)) as arrays, made once per layout (``subscribe --out``'s file): a parsed
    table's records are checked against it with no tuple made per record (~0.025 s a step at 70,000 tensors).
    ``names``: the rows to keep them in (a :class:`~deltasync.fingerprint.NameIndex` of the layout's names, whose
    memory of the lists it mapped the step's other readers share); else the layout's order."""

    def __init__(self, layout: Mapping[str, tuple[str, tuple[int, ...]]], names: NameIndex | None = None) -> None:
        self.names = names if names is not None else NameIndex(list(layout))
        vals = list(map(layout.__getitem__, self.names.names))
        dtypes = list(map(itemgetter(0), vals))
        self.dtype_code = {d: i for i, d in enumerate(dict.fromkeys(dtypes))}
        self.codes = np.fromiter(map(self.dtype_code.__getitem__, dtypes), np.int64, len(dtypes))
        shapes = list(map(itemgetter(1), vals))
        self.ranks = np.fromiter(map(len, shapes), np.int64, len(shapes))
        self.dims = np.fromiter(chain.from_iterable(shapes), np.int64)
        self.at = np.cumsum(self.ranks) - self.ranks  # each tensor's first dimension in ``dims``

    def matches(self, cols) -> bool:
        """Every record of ``cols`` (a :class:`~deltasync.tensortable.TableColumns`) names a tensor of this layout,
        of its dtype and shape."""
        rows = self.names.rows(cols.names)
        if rows is None:
            return False
        code = np.array([self.dtype_code.get(d, -1) for d in cols.dtype_names] or [0], np.int64)
        if (code[cols.codes] != self.codes[rows]).any():
            return False
        ranks = np.diff(cols.starts)
        if (ranks != self.ranks[rows]).any():
            return False
        gather = np.repeat(self.at[rows] - cols.starts[:-1], ranks) + np.arange(int(ranks.sum()), dtype=np.int64)
        return bool((self.dims[gather] == cols.dims.astype(np.int64)).all())


def check_base(manifest: Manifest, tensors: Mapping[str, torch.Tensor], fps: Mapping[str, int], *,
               layout: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
               state_lines: tuple[list[str], StateLines] | None = None,
               layout_columns: LayoutColumns | None = None) -> None:
    """Refuse unless the tracked state is exactly the delta's base.

    ``layout``: the tensors' (dtype name, shape) by name, as the caller knows them (a mapped file's header),
    with ``state_lines``: their names sorted and the :class:`~deltasync.fingerprint.StateLines` of the layout in
    that order, made once per layout: the checks then compare lists and arrays, no torch call per tensor (a failing check is made again
    tensor by tensor below, for its message). ``layout_columns``: the layout's :class:`LayoutColumns`, made once
    too: a parsed table's records are checked against it as arrays."""
    if layout is None and kernels.cpu_kernels() is not None:  # the tensors' layout read once, checked as lists
        layout = _layout_of(tensors)
        if layout is not None:
            names = sorted(layout)
            state_lines = layout_lines(layout)
    if layout is not None and state_lines is not None and _base_matches(manifest, layout, state_lines, fps,
                                                                        layout_columns):
        return
    for rec in manifest.tensors:
        t = tensors.get(rec.name)
        if t is None:
            raise BaseMismatchError(f"{rec.name}: in the delta but not in the target")
        if _info(t.dtype).name != rec.dtype or tuple(t.shape) != rec.shape:
            raise BaseMismatchError(
                f"{rec.name}: target is {dtype_info(t.dtype).name} {tuple(t.shape)}, delta expects {rec.dtype} {rec.shape}")
        if rec.name not in fps:
            raise BaseMismatchError(f"{rec.name}: no tracked fingerprint for it; scrub the target first")
        if rec.fp_before is not None and fp_hex(fps[rec.name]) != rec.fp_before:  # format 3: the state check below
            raise BaseMismatchError(
                f"{rec.name}: target fingerprint {fp_hex(fps[rec.name])} is not the delta's base {rec.fp_before} "
                f"(state is not v{manifest.parent}; already applied, or diverged: resync from a keyframe)")
    have = state_fingerprint((n, _info(t.dtype).name, tuple(t.shape), fps[n]) for n, t in tensors.items())
    if have != manifest.state_fp_before:
        raise BaseMismatchError(
            f"target state {have} is not v{manifest.parent} ({manifest.state_fp_before}): not the delta's base "
            "(already applied, diverged, or another tensor set: resync from a keyframe)")


def _base_matches(manifest: Manifest, layout: Mapping[str, tuple[str, tuple[int, ...]]],
                  state_lines: tuple[list[str], StateLines], fps: Mapping[str, int],
                  layout_columns: LayoutColumns | None = None) -> bool:
    """:func:`check_base`'s checks, as list and array comparisons: True when all hold."""
    cols = table_columns(manifest)
    if cols is not None:  # a parsed format-3 manifest: its columns, no record made
        if layout_columns is not None:
            if not layout_columns.matches(cols):
                return False
        elif list(map(layout.get, cols.names)) != list(zip(cols.dtypes(), cols.shapes())):
            return False
        names = before = []  # format 3 keeps no fingerprint before: the state's is compared below
    else:
        recs = manifest.tensors
        names = list(map(_get_name, recs))
        if list(map(layout.get, names)) != list(zip(map(_get_dtype, recs), map(_get_shape, recs))):
            return False
        before = list(map(_get_fp_before, recs))
    if None in before:  # format 3 lists fingerprints before only where asked: those compared
        keep = [i for i, b in enumerate(before) if b is not None]
        before, names = [before[i] for i in keep], [names[i] for i in keep]
    have = fp_array(fps, names)
    if have is None:
        return False
    if before:
        want = fp_values(before)
        if want is None or (have != want).any():
            return False
    sorted_names, lines = state_lines
    if len(sorted_names) != len(layout):
        return False
    every = fp_array(fps, sorted_names)
    if every is None:
        return False
    return lines.digest(every) == manifest.state_fp_before


def layout_lines(layout: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[list[str], StateLines]:
    """A layout's names sorted and its :class:`~deltasync.fingerprint.StateLines` in that order: what
    :func:`check_base` takes as ``state_lines`` (made once per layout by a caller that keeps its layout)."""
    names = sorted(layout)
    return names, StateLines(names, [layout[n][0] for n in names], [layout[n][1] for n in names])

_get_torch_shape = attrgetter("shape")


def _layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """{name: (dtype name, shape)} of torch tensors, a dtype looked up once per dtype; None for other objects."""
    try:
        dtypes = list(map(attrgetter("dtype"), tensors.values()))
        names = {d: _info(d).name for d in set(dtypes)}
        return dict(zip(tensors, zip(map(names.__getitem__, dtypes),
                                     map(tuple, map(_get_torch_shape, tensors.values())))))
    except Exception:  # noqa: BLE001 - the tensor-by-tensor check below says what
        return None


def fp_array(fps: Mapping[str, int], names: list[str]) -> np.ndarray | None:
    """The fingerprints of ``names`` as uint64 (masked as fp_hex masks them); None if one is missing. A
    :class:`~deltasync.fingerprint.FingerprintTable` gives them as arrays (no Python int per tensor)."""
    if type(fps) is FingerprintTable:
        return fps.take(names)
    try:
        return np.fromiter(map(fps.__getitem__, names), dtype=np.uint64, count=len(names))
    except KeyError:
        return None
    except (OverflowError, TypeError, ValueError):  # a fingerprint outside [0, 2**64): masked first
        try:
            return np.array([fps[n] & MASK64 for n in names], dtype=np.uint64)
        except (KeyError, TypeError):
            return None


class StagedPatch:
    """A delta written into the live tensors and verified tensor by tensor, its undo log still kept.

    ``fps``: the fingerprints after the patch. ``commit()`` drops the undo log;
    ``rollback()`` restores every word written (idempotent; a no-op after commit)."""

    __slots__ = ("fps", "_undo")

    def __init__(self, fps: dict[str, int], undo: _Undo) -> None:
        self.fps = fps
        self._undo: _Undo | None = undo

    def commit(self) -> None:
        self._undo = None

    def rollback(self) -> None:
        if self._undo is not None:
            with torch.no_grad():
                self._undo.rollback()
            self._undo = None


def apply_prepared(target, prepared: PreparedDelta, fps: Mapping[str, int] | None = None, *, verify: str = "incremental",
                   executor: Executor | None = None) -> dict[str, int]:
    """Patch ``target`` in place from v(parent) to v(version); returns the new fingerprints.

    :func:`stage_prepared` then ``commit()``: see there."""
    staged = stage_prepared(target, prepared, fps, verify=verify, executor=executor)
    staged.commit()
    return staged.fps


def stage_prepared(target, prepared: PreparedDelta, fps: Mapping[str, int] | None = None, *, verify: str = "incremental",
                   executor: Executor | None = None, check: Callable[[], None] | None = None,
                   base_checked: bool = False, disjoint: bool = False,
                   addresses: Callable[[list[str]], tuple | None] | None = None) -> StagedPatch:
    """Patch ``target`` in place from v(parent) to v(version), keeping the undo log (a :class:`StagedPatch`).

    ``fps``: the target's current fingerprints as tracked by the caller; computed
    (a full scrub) when None. ``verify``: ``"incremental"`` (O(changed)) or
    ``"full"`` (recompute every patched tensor after writing). ``executor``: patch
    tensors on its threads (they are disjoint in memory; the caller owns the pool). On
    any failure every word written is restored and the error raised: never a
    half-applied version. ``check``: called between pieces of the work (every
    ``CHECK_EVERY`` tensors, each word size of a batched patch); what it raises
    (``ApplyInterrupted``: a signal, a deadline) rolls back like any failure. ``base_checked``: the caller ran
    :func:`check_base` on these tensors and ``fps`` already (before its own I/O): not again (a state fingerprint
    over every tensor: ~1 s at 200,000 tensors). ``disjoint``: the caller's tensors are known not to share
    memory (a mapped file's, whose header was checked for overlaps): no alias search (its cache check alone
    reads every tensor's address, shape and strides: ~0.3 s at 70,000 tensors). ``addresses``: names -> (word
    addresses, word counts, word sizes) as int64 arrays of the caller's host tensors (a mapped file knows them
    without a torch call per tensor), for a delta prepared as columns (:class:`ColumnarPatches`).
    """
    manifest = prepared.manifest
    records = _Records(manifest)
    tensors = live_tensors(target)
    if type(fps) is not FingerprintTable:  # (a table is immutable: the new fingerprints are a new one)
        fps = dict(fps) if fps is not None else {n: tensor_fingerprint(t) for n, t in tensors.items()}
    if not base_checked:
        check_base(manifest, tensors, fps)
    if check is not None:
        check()
    aliases = {} if disjoint else find_aliases(tensors, check=check)
    for alias, primary in aliases.items():
        a, p = records.get(alias), records.get(primary)
        if a is None and p is None:
            continue  # neither changes (format 3 lists only changed tensors)
        if a is None or p is None or (a.fp_before, a.fp_after) != (p.fp_before, p.fp_after):
            raise BaseMismatchError(
                f"{alias} shares memory with {primary} (tied weights) but the delta changes them differently")
    undo = _Undo()

    def patch_one(name: str, chunks: list[ChunkPatch]) -> int:
        with torch.no_grad():
            fp = _patch_tensor(tensors[name], chunks, fps[name], undo)
            if verify == "full":
                fp = tensor_fingerprint(tensors[name])
        if fp_hex(fp) != records.fp_after_hex(name):
            raise IntegrityError(
                f"{name}: fingerprint after patching is {fp_hex(fp)}, manifest says {records.fp_after_hex(name)}; "
                "rolled back")
        return fp

    cols = prepared.patches if type(prepared.patches) is ColumnarPatches else None
    if cols is not None and verify == "incremental" and not any(n in cols for n in aliases):
        try:
            pure, kept, rest = cols.pure()  # the tensors whose chunks are all columns; the others (dense chunks)
            got = _patch_columns(tensors, pure, fps, records, undo, executor, check, addresses)
            if got is not None:
                after, failure = got
                done: dict[str, int] = {}  # the other tensors' fingerprints after
                first = (int(kept[failure[0]]), failure[1]) if failure is not None else None
                for k, t in enumerate(rest):  # chunk by chunk, in order, up to the first failure
                    if first is not None and t > first[0]:
                        break
                    if check is not None and not k % CHECK_EVERY:
                        check()
                    name = cols.names[t]
                    try:
                        done[name] = patch_one(name, cols[name])
                    except Exception as e:  # noqa: BLE001 - raised below, after the columns' failure if earlier
                        first = (t, e) if first is None or t < first[0] else first
                        break
                if first is not None:
                    raise first[1]
        except BaseException as e:
            undo.rollback()
            if isinstance(e, DeltaSyncError):
                raise
            if isinstance(e, Exception):
                raise ApplyError(f"patching v{manifest.version} failed ({type(e).__name__}: {e}); rolled back") from e
            raise
        if got is not None:
            rows = fps.names.rows(pure.names) if type(fps) is FingerprintTable and not aliases else None
            more = fps.names.rows(list(done)) if rows is not None and done else None
            if rows is not None and (more is not None or not done):
                new = fps.replaced(rows, after)
                if done:
                    new = new.replaced(more, np.fromiter(done.values(), np.uint64, len(done)))
                return StagedPatch(new, undo)
            new_fps = dict(fps)
            new_fps.update(zip(pure.names, after.tolist()))
            new_fps.update(done)
            for alias, primary in aliases.items():
                new_fps[alias] = new_fps[primary]
            return StagedPatch(new_fps, undo)

    new_fps = dict(fps)

    # tied weights: the primary's patch writes the shared words once
    work = [(name, chunks) for name, chunks in prepared.patches.items() if name not in aliases]
    try:
        batched = (_patch_batched(tensors, work, fps, records, undo, executor, check)
                   if verify == "incremental" else None)
        groups = [] if batched is not None else _balanced(work, PATCH_TASKS) if executor is not None else [work]
        if batched is not None:
            new_fps.update(batched)
        elif len(groups) < 2:
            for k, (name, chunks) in enumerate(work):
                if check is not None and not k % CHECK_EVERY:
                    check()
                new_fps[name] = patch_one(name, chunks)
        else:
            # A few tasks of about equal change counts (a future per tensor costs more in GIL
            # hand-offs than most tensors' patches); each returns its first failure, if any.
            futures = [executor.submit(_patch_group, patch_one, group) for group in groups]
            try:
                wait(futures)
            finally:
                # Whatever happens here (even an interrupt), every worker must be done writing
                # before anything is rolled back.
                wait(futures)
            first = None
            for f in futures:  # groups are contiguous runs of the tensors, in order
                done, failure = f.result()
                new_fps.update(done)
                if failure is not None and first is None:
                    first = failure
            if first is not None:
                raise first  # the first failure in tensor order
        for alias, primary in aliases.items():
            new_fps[alias] = new_fps[primary]
    except BaseException as e:
        undo.rollback()
        if isinstance(e, DeltaSyncError):
            raise
        if isinstance(e, Exception):
            raise ApplyError(f"patching v{manifest.version} failed ({type(e).__name__}: {e}); rolled back") from e
        raise
    return StagedPatch(new_fps, undo)


def _patch_tensor(live: torch.Tensor, chunks: list[ChunkPatch], fp: int, undo: _Undo) -> int:
    info = _info(live.dtype)
    sdt = signed_word_dtype(info.word_size)
    work = live if live.is_contiguous() else live.contiguous()
    words = word_view(work)
    device = words.device
    if device.type == "cpu" and kernels.cpu_kernels() is not None:
        return _patch_tensor_compiled(live, work, words, chunks, fp, undo, info.word_size)
    g = kernels.gpu_kernels(words)
    if g is not None and len(chunks) > 1:
        got = _patch_tensor_at_once(live, work, words, chunks, fp, undo, g, info.word_size)
        if got is not None:
            return got
    for c in chunks:
        if c.dense is not None:
            where = slice(c.start, c.stop)
            old = words[where].clone()
            undo.entries.append((words, where, old, None if work is live else live, work))
            new = torch.from_numpy(np.require(c.dense, requirements="W").view(np.dtype(f"i{info.word_size}"))).to(device)
            words[where] = new
            fp = update_fingerprint(fp, words_range_delta(old, words[where], c.start, info.word_size))
            continue
        if c.pending is not None:  # base-conditioned chunk: decoded against the words it patches
            c = c.resolve(words[c.start : c.stop].cpu().numpy().view(numpy_word_dtype(info.word_size)))
        ch = c.changes
        idx = torch.from_numpy(ch.positions).to(device)
        vals = torch.from_numpy(ch.values.view(np.dtype(f"i{info.word_size}"))).to(device)
        raw = torch.from_numpy(ch.raw).to(device)
        g = kernels.gpu_kernels(words)
        if g is not None and ch.positions.size and 0 <= ch.positions[0] and ch.positions[-1] < words.numel():
            old = g.patch_words(words, idx, raw, vals)  # Triton: gather + write in one pass (positions sorted)
            undo.entries.append((words, idx, old, None if work is live else live, work))
        else:
            old = words.index_select(0, idx)
            undo.entries.append((words, idx, old, None if work is live else live, work))
            new = torch.where(raw, vals, old + vals).to(sdt)
            words.index_copy_(0, idx, new)
        written = words.index_select(0, idx)  # read back: verify what landed, not what we meant
        if len(ch) * DENSE_FP > c.stop - c.start:
            # Many changes: two streaming passes over the chunk beat per-change keys. The old
            # range is rebuilt from the written one and the undo record.
            before = words[c.start : c.stop].clone()
            before.index_copy_(0, idx - c.start, old)
            fp = update_fingerprint(fp, words_range_delta(before, words[c.start : c.stop], c.start, info.word_size))
        else:
            fp = update_fingerprint(fp, fingerprint_delta(idx, old, written, info.word_size))
    if work is not live:
        live.copy_(work)
    return fp


def _patch_tensor_at_once(live: torch.Tensor, work: torch.Tensor, words: torch.Tensor, chunks: list[ChunkPatch],
                          fp: int, undo: _Undo, g, word_size: int) -> int | None:
    """:func:`_patch_tensor` on a device with the Triton kernels: every chunk of the tensor in one upload, one
    patch launch and one fingerprint change (per chunk that was ~10 launches and synchronisations). None (nothing
    done) unless every chunk carries sparse changes inside its own span and the spans are in order and disjoint:
    then no word is written twice, and one undo record restores them all."""
    n = len(chunks)
    if any(c.changes is None or c.dense is not None for c in chunks):
        return None
    starts = np.fromiter((c.start for c in chunks), np.int64, n)
    stops = np.fromiter((c.stop for c in chunks), np.int64, n)
    counts = np.fromiter((c.changes.positions.size for c in chunks), np.int64, n)
    if starts[0] < 0 or stops[-1] > words.numel() or (starts[1:] < stops[:-1]).any():
        return None
    pos = np.concatenate([c.changes.positions for c in chunks]).astype(np.int64, copy=False)
    if pos.size == 0:
        return fp
    has = counts > 0
    first = (np.cumsum(counts) - counts)[has]
    if (np.minimum.reduceat(pos, first) < starts[has]).any() or (np.maximum.reduceat(pos, first) >= stops[has]).any():
        return None
    device = words.device
    idx = torch.from_numpy(pos).to(device)
    raw = torch.from_numpy(np.concatenate([c.changes.raw for c in chunks])).to(device)
    vals = torch.from_numpy(np.concatenate([c.changes.values for c in chunks]).view(np.dtype(f"i{word_size}"))).to(device)
    old = g.patch_words(words, idx, raw, vals)
    undo.entries.append((words, idx, old, None if work is live else live, work))
    fp = update_fingerprint(fp, fingerprint_delta(idx, old, words.index_select(0, idx), word_size))  # what landed
    if work is not live:
        live.copy_(work)
    return fp


def _patch_tensor_compiled(live: torch.Tensor, work: torch.Tensor, words: torch.Tensor, chunks: list[ChunkPatch],
                           fp: int, undo: _Undo, word_size: int) -> int:
    """:func:`_patch_tensor` on CPU with the compiled kernels: one pass per chunk gathers the old
    words, writes the new ones and sums the fingerprint change from the words read back."""
    host = words.detach().numpy().view(numpy_word_dtype(word_size))
    restore = None if work is live else live
    for c in chunks:
        if c.dense is not None:
            where = slice(c.start, c.stop)
            undo.entries.append((None, host, where, host[where].copy(), restore, work))
            fp = update_fingerprint(fp, kernels.copy_range_delta(host[where], c.dense, c.start, word_size))
            continue
        if c.pending is not None:  # base-conditioned chunk: decoded against the words it patches
            c = c.resolve(host[c.start : c.stop])
        old, fpd = kernels.patch_chunk(host, c.changes, word_size)  # all or nothing: bounds checked first
        undo.entries.append((None, host, c.changes.positions, old, restore, work))
        fp = update_fingerprint(fp, fpd)
    if work is not live:
        live.copy_(work)
    return fp


def _patch_batched(tensors: Mapping[str, torch.Tensor], work: list[tuple[str, list[ChunkPatch]]],
                   fps: Mapping[str, int], records: Mapping[str, object], undo: _Undo,
                   executor: Executor | None, check: Callable[[], None] | None = None) -> dict[str, int] | None:
    """Every sparse chunk of ``work`` patched by a few compiled calls (``kernels.patch_jobs``: one per word
    size, or per part of it on ``executor``'s threads) instead of a kernel call and a dozen torch calls per
    tensor: {name: fingerprint after}, each checked against the manifest. None (nothing done) unless the
    compiled kernels are selected and every tensor is a contiguous CPU tensor whose chunks all carry changes
    (no dense or base-conditioned chunk): :func:`_patch_tensor` then does it tensor by tensor.

    The same words, old words and fingerprints as :func:`_patch_tensor_compiled`, and the same failure: the
    first in tensor order (a position out of range, raised as IndexError, or a fingerprint that is not the
    manifest's, IntegrityError) after every tensor before it was patched; each patched chunk is in ``undo``."""
    cpu = kernels.cpu_kernels()
    if cpu is None or not work:
        return None
    addresses = cpu.array_addresses  # (positions, raw flags, values) -> their addresses, per chunk
    groups: dict[int, list] = {}  # word size -> [(tensor index, name, tensor, changes)]
    for i, (name, chunks) in enumerate(work):
        t = tensors[name]
        if not t.is_cpu or not t.is_contiguous():
            return None
        w = _info(t.dtype).word_size
        for c in chunks:
            if c.changes is None:
                return None
        groups.setdefault(w, []).append((i, name, t, chunks))
    done: list[tuple[int, np.ndarray, int]] = []  # (tensor index, fingerprint changes, job) of each written chunk
    bad: tuple[int, str] | None = None  # (tensor index, message) of the first out-of-range position
    for w, items in groups.items():
        if check is not None:  # between word sizes: each one's chunks are in the undo log by now
            check()
        wdt = numpy_word_dtype(w)
        like = np.empty(0, wdt)
        rows, owners, counts = [], [], []
        for i, name, t, chunks in items:
            if check is not None and not i % CHECK_EVERY:
                check()
            addr = t.data_ptr()
            n = t.numel() * (t.element_size() // w)
            for c in chunks:
                ch = c.changes
                vals = ch.values if ch.values.dtype == wdt else ch.values.astype(wdt)
                pos, raw = ch.positions, ch.raw
                if not (pos.flags.c_contiguous and raw.flags.c_contiguous and vals.flags.c_contiguous):
                    pos, raw, vals = np.ascontiguousarray(pos), np.ascontiguousarray(raw), np.ascontiguousarray(vals)
                rows.append((addr, n, *addresses(pos, raw, vals), pos.size, 0))
                owners.append((i, t, pos, raw, vals))
                counts.append(pos.size)
        jobs = np.array(rows, dtype=np.int64).reshape(-1, 7)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        old = np.empty(int(offsets[-1]), wdt)
        fpds = np.zeros(len(counts), np.uint64)
        parts = [(0, len(counts))]
        if executor is not None and len(counts) > 1 and offsets[-1] >= BATCH_PART_MIN:
            parts = split_counts(counts, PATCH_TASKS)

        def run(r, jobs=jobs, old=old, fpds=fpds, offsets=offsets, like=like, w=w):
            a, b = r
            return kernels.patch_jobs(jobs[a:b], like, old[offsets[a]:], fpds[a:b], w)

        if len(parts) > 1:
            futures = [executor.submit(run, r) for r in parts]
            try:
                wait(futures)
            finally:
                wait(futures)  # every worker done writing before anything is rolled back (even on an interrupt)
            results = [f.result() for f in futures]
        else:
            results = [run(parts[0])]
        for (a, b), (j, k) in zip(parts, results):
            end = b if j < 0 else a + j
            for q in range(a, end):  # first every written chunk into the undo log, then anything that may raise
                i, t, pos, raw, vals = owners[q]
                undo.entries.append((_BATCHED, t, pos, old[offsets[q]:offsets[q + 1]]))
                done.append((i, fpds, q))
            if j >= 0:
                i, t, pos, _, _ = owners[a + j]
                if bad is None or i < bad[0]:
                    bad = (i, f"change position {int(pos[k])} is outside a tensor of {int(jobs[a + j, 1])} words")
    fp_of = [fps[name] for name, _ in work]
    for i, arr, q in done:  # chunk by chunk, as _patch_tensor_compiled updates them
        fp_of[i] = update_fingerprint(fp_of[i], int(arr[q]))
    out: dict[str, int] = {}
    for i, (name, _) in enumerate(work):
        if bad is not None and i == bad[0]:
            raise IndexError(bad[1])
        fp = fp_of[i]
        if fp_hex(fp) != records.fp_after_hex(name):
            raise IntegrityError(
                f"{name}: fingerprint after patching is {fp_hex(fp)}, manifest says {records.fp_after_hex(name)}; "
                "rolled back")
        out[name] = fp
    return out


def host_addresses(tensors: Mapping[str, torch.Tensor], names: list[str]) -> tuple | None:
    """(word addresses, word counts, word sizes) of the named tensors as int64 arrays, or None unless every one
    is a contiguous CPU tensor."""
    ts = [tensors[n] for n in names]
    for t in ts:
        if not t.is_cpu or not t.is_contiguous():
            return None
    n = len(ts)
    sizes: dict[torch.dtype, tuple[int, int]] = {}
    for t in ts:
        if t.dtype not in sizes:
            sizes[t.dtype] = (_info(t.dtype).word_size, t.element_size())
    ws = np.fromiter((sizes[t.dtype][0] for t in ts), dtype=np.int64, count=n)
    per = np.fromiter((sizes[t.dtype][1] for t in ts), dtype=np.int64, count=n)
    numel = np.fromiter((t.numel() for t in ts), dtype=np.int64, count=n)
    addr = np.fromiter((t.data_ptr() for t in ts), dtype=np.int64, count=n)
    return addr, numel * per // ws, ws


def _patch_columns(tensors: Mapping[str, torch.Tensor], cols: ColumnarPatches, fps: Mapping[str, int],
                   records: Mapping[str, object], undo: _Undo, executor: Executor | None,
                   check: Callable[[], None] | None, addresses) -> tuple[np.ndarray, tuple | None] | None:
    """:func:`_patch_batched` of a delta prepared as columns (every chunk a column: ``ColumnarPatches.pure``): the
    kernel's job rows made by numpy from the columns and a table of the tensors' addresses (``addresses(names)``,
    else :func:`host_addresses`), the fingerprints summed and compared as arrays. The same words, fingerprints and
    undo; returns (the fingerprints after, uint64 in ``cols.names``' order, None) or, at a failure, (those, (tensor
    index, the exception to raise)): the first in tensor order, as :func:`_patch_batched` raises it. None (nothing
    done) unless the compiled kernels are selected and every tensor is contiguous host memory."""
    if kernels.cpu_kernels() is None:
        return None
    names = cols.names
    if not names:
        return np.zeros(0, np.uint64), None
    table = addresses(names) if addresses is not None else host_addresses(tensors, names)
    if table is None:
        return None
    addr, nwords, wsz = table
    wsizes = word_sizes_in(cols.word_sizes)
    if (wsz[cols.tensor] != cols.word_sizes).any():
        return None  # not the words the chunks were decoded as: the reference path (check_base says so first)
    base = fp_array(fps, names)
    if base is None:
        return None
    fpd_all = np.zeros(cols.tensor.size, dtype=np.uint64)
    bad: tuple[int, str] | None = None  # (tensor index, message) of the first out-of-range position
    for w in wsizes:
        if check is not None:  # between word sizes: each one's chunks are in the undo log by now
            check()
        sel = np.flatnonzero(cols.word_sizes == w) if len(wsizes) > 1 else np.arange(cols.tensor.size)
        ti = cols.tensor[sel]
        segs = cols.columns[w]
        seg = cols.seg[sel]
        at = cols.at[sel]
        counts = cols.counts[sel]
        jobs = np.zeros((sel.size, 7), dtype=np.int64)  # column 6, the first writable word: 0
        jobs[:, 0] = addr[ti]
        jobs[:, 1] = nwords[ti]
        for k, item in enumerate((8, 1, w)):  # each segment's positions, raw flags, values: their addresses
            base_addr = np.array([arrays[k].ctypes.data for arrays in segs], dtype=np.int64)
            jobs[:, 2 + k] = base_addr[seg] + at * item
        jobs[:, 5] = counts
        offsets = np.zeros(sel.size + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        wdt = numpy_word_dtype(w)
        like = np.empty(0, wdt)
        old = np.empty(int(offsets[-1]), wdt)
        fpds = np.zeros(sel.size, np.uint64)
        parts = [(0, sel.size)]
        if executor is not None and sel.size > 1 and offsets[-1] >= BATCH_PART_MIN:
            parts = split_counts(counts, PATCH_TASKS)

        def run(r, jobs=jobs, old=old, fpds=fpds, offsets=offsets, like=like, w=w):
            a, b = r
            return kernels.patch_jobs(jobs[a:b], like, old[offsets[a]:], fpds[a:b], w)

        if len(parts) > 1:
            futures = [executor.submit(run, r) for r in parts]
            try:
                wait(futures)
            finally:
                wait(futures)  # every worker done writing before anything is rolled back (even on an interrupt)
            results = [f.result() for f in futures]
        else:
            results = [run(parts[0])]
        keep = (segs, tensors)  # what the jobs address stays alive with the undo entry (a map stays open)
        for (a, b), (j, k) in zip(parts, results):
            end = b if j < 0 else a + j
            if end > a:  # every written chunk into the undo log first, then anything that may raise
                undo.entries.append((_COLUMNS, jobs[a:end], old[offsets[a]:offsets[end]],
                                     offsets[a:end + 1] - offsets[a], w, keep))
                fpd_all[sel[a:end]] = fpds[a:end]
            if j >= 0:
                i = int(ti[a + j])
                if bad is None or i < bad[0]:
                    p_bad = int(segs[int(seg[a + j])][0][int(at[a + j]) + k])
                    bad = (i, f"change position {p_bad} is outside a tensor of {int(jobs[a + j, 1])} words")
    after = base + np.add.reduceat(fpd_all, cols.first[:-1])  # uint64: wraps like update_fingerprint
    want = records.fp_after(names)
    wrong = np.flatnonzero(after != want) if want is not None else np.array(
        [i for i, n in enumerate(names) if fp_hex(int(after[i])) != records[n].fp_after], dtype=np.int64)
    first_wrong = int(wrong[0]) if wrong.size else len(names)
    if bad is not None and bad[0] <= first_wrong:
        return after, (bad[0], IndexError(bad[1]))
    if first_wrong < len(names):
        name = names[first_wrong]
        return after, (first_wrong, IntegrityError(
            f"{name}: fingerprint after patching is {fp_hex(int(after[first_wrong]))}, manifest says "
            f"{records[name].fp_after}; rolled back"))
    return after, None


class _Records(Mapping):
    """A manifest's records by name, made when first asked for; :meth:`fp_after` of a parsed format-3 manifest
    reads its table's columns instead (a step patched as columns asks for nothing else: no record made)."""

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest
        self._by_name: dict[str, TensorRecord] | None = None

    def _records(self) -> dict[str, TensorRecord]:
        if self._by_name is None:
            tensors = self._manifest.tensors
            self._by_name = dict(zip(map(_get_name, tensors), tensors))
        return self._by_name

    def __getitem__(self, name: str) -> TensorRecord:
        return self._records()[name]

    def __iter__(self):
        return iter(self._records())

    def __len__(self) -> int:
        return len(self._records())

    def _rows(self):
        """(the table's columns, name -> row) of a parsed format-3 manifest, else None."""
        cols = table_columns(self._manifest)
        if cols is None:
            return None
        row = cols.memo.get("rows")
        if row is None:
            row = cols.memo["rows"] = dict(zip(cols.names, range(len(cols.names))))
        return cols, row

    def fp_after_hex(self, name: str) -> str:
        """``self[name].fp_after``."""
        got = self._rows()
        if got is not None and name in got[1]:
            return f"{int(got[0].fps[got[1][name]]):016x}"
        return self[name].fp_after

    def fp_after(self, names: list[str]) -> np.ndarray | None:
        """The fingerprints after of ``names`` (uint64), or None where one is not 16 hex digits."""
        cols = table_columns(self._manifest)
        if cols is not None and names is cols.names:  # the table's own list (a step patched as its columns)
            return cols.fps.astype(np.uint64, copy=False)
        got = self._rows()
        if got is not None:
            cols, row = got
            try:
                return cols.fps[np.fromiter(map(row.__getitem__, names), np.int64, len(names))].astype(np.uint64)
            except KeyError:
                pass  # a name the table does not list: the records say which
        return fp_values(list(map(_get_fp_after, map(self.__getitem__, names))))


CHECK_EVERY = 64  # stage_prepared(check=): tensors between two calls of the caller's check (signals, deadlines)
BATCH_PART_MIN = 1 << 15  # _patch_batched with an executor: fewer changes than this of a word size in one call
PATCH_TASKS = 4  # stage_prepared with an executor: tensors in this many tasks of about equal change counts


def _balanced(work: list[tuple[str, list[ChunkPatch]]], parts: int) -> list[list[tuple[str, list[ChunkPatch]]]]:
    """``work`` (in order) cut into at most ``parts`` contiguous groups of about equal change counts."""
    if len(work) < 2:
        return [work] if work else []
    return [work[a:b] for a, b in split_counts([sum(c.count for c in chunks) for _, chunks in work], parts)]


def _patch_group(patch_one, group):
    """Patch a group's tensors in order: ({name: fingerprint}, None), or (what was done, the exception)
    at the first failure (the caller raises it once every task is done)."""
    done: dict[str, int] = {}
    for name, chunks in group:
        try:
            done[name] = patch_one(name, chunks)
        except Exception as e:  # noqa: BLE001
            return done, e
    return done, None


def apply_delta(target, manifest: Manifest, blobs: BlobSource, fps: Mapping[str, int] | None = None, *,
                verify: str = "incremental", executor: Executor | None = None,
                history: StateHistory | None = None) -> dict[str, int]:
    """prepare_delta + apply_prepared in one call; a history-coded delta also takes the ``history`` at its parent
    and, once applied, advances it to its version."""
    prepared = prepare_delta(manifest, blobs, executor=executor, history=history)
    out = apply_prepared(target, prepared, fps, verify=verify, executor=executor)
    if history is not None and manifest.coding == CODING_HISTORY:
        history.advance_patches(manifest.version, prepared.patches)
    return out


# -- Q: loading the compiled kernels before the first delta --------------------------------------

WARM_WORDS = 1 << 14  # words of each dtype's warm-up tensor


def warm_kernels(dtypes) -> None:
    """Run a tiny delta of each dtype in ``dtypes`` (names) through encode, :func:`prepare_delta` and
    :func:`apply_prepared`, so that the compiled kernels a real delta's decode and patch call are loaded.

    numba loads each kernel (and word width) from its on-disk cache at its first call: ~0.05 CPU-s for a
    delta's decode and patch, paid by the first delta a process applies. A long-running subscriber calls
    this while it waits (``subscribe --out`` does, on a thread), so its first delta costs what later ones
    do. Touches nothing but its own small tensors; a no-op with the reference kernels."""
    if kernels.cpu_kernels() is None:
        return
    from .codec import encode_delta

    g = torch.Generator().manual_seed(0)
    for name in sorted(set(dtypes)):
        info = dtype_info(name)
        if info.name == "bool" or info.element_size != info.word_size:
            continue  # bool: no valid random words; complex dtypes: their word width has a plain dtype too
        sdt = signed_word_dtype(info.word_size)
        lo, hi = (-(1 << 7), 1 << 7) if info.word_size == 1 else (-(1 << 14), 1 << 14)
        old = torch.randint(lo, hi, (WARM_WORDS,), generator=g, dtype=torch.int64).to(sdt)
        new = old.clone()
        new[::29] += 1  # ULP steps (the ans symbols) ...
        new[5::211] = 7  # ... and raw words
        a, b = old.view(info.torch_dtype), new.view(info.torch_dtype)
        enc = encode_delta({"w": a}, {"w": b}, model="warm", version=1, parent=0)
        apply_prepared({"w": a.clone()}, prepare_delta(enc.manifest, enc.blobs))
