"""The tensor table of a format-3 manifest: its tensor records as binary columns, zstd-compressed
(docs/FORMAT.md §5.3).

A format-2 manifest spelled every tensor as a JSON object on every step (name, dtype, shape, two
fingerprints, chunk references with 32-hex blob ids, per-tensor span entries in ``meta``): 21.7 MB a
step for a 70k-tensor MoE checkpoint whose step's blobs were 1.8 MB. Here the records are columns
(fixed-width little-endian integers, the names one newline-separated text), which zstd squeezes to
what is actually new: a delta lists only the tensors it changes, each with its fingerprint after, its
change count and its chunks (blob *position* in the manifest's blob list, index in the blob, word span);
the names, dtypes and shapes repeat step after step and compress to a few bytes a tensor.

The record types (``TensorRecord``, ``ChunkRef``) live here and are re-exported by ``deltasync.manifest``.
``pack_table(records, kind, blob_ids)`` -> bytes and ``unpack_table(data, kind, blob_ids)`` -> records
are pure; ``unpack_table`` checks every structural rule and limit on the columns, with numpy, before it
builds a record, and raises FormatError for anything malformed (the manifest parser adds the rest).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from operator import lt

import numpy as np
import zstandard

from .blob import newline_joined
from .dtypes import dtype_info, word_count
from .errors import FormatError
from .frozen import maker
from .gcpause import gc_paused
from .zctx import compressor, decompressor

__all__ = ["ChunkRef", "TABLE_VERSION", "TableColumns", "TensorRecord", "fp_texts", "fp_values", "new_chunk", "new_record",
           "pack_columns", "pack_table", "unpack_table"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkRef:
    """Where one piece of a tensor's encoding lives: a blob and, inside it, a chunk
    index (delta) or a tensor key (keyframe shard)."""

    blob: str
    index: int | None = None
    key: str | None = None
    # a delta chunk's word span [start, stop) in its tensor (format 3 records it; format 2 in meta). Not
    # compared: a format-2 manifest read back has the spans in meta only
    start: int | None = field(default=None, compare=False)
    stop: int | None = field(default=None, compare=False)

    def to_obj(self) -> dict:
        return {"blob": self.blob, "index": self.index} if self.key is None else {"blob": self.blob, "key": self.key}


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    fp_before: str | None  # 16 hex digits; None in keyframes
    fp_after: str
    changed: int  # words the delta writes (keyframes: all words); a squash may count a word put back to its base value
    chunks: tuple[ChunkRef, ...] = ()

    @property
    def words(self) -> int:
        return word_count(self.shape, dtype_info(self.dtype))

    def to_obj(self) -> dict:
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
            "fp_before": self.fp_before, "fp_after": self.fp_after, "changed": self.changed,
            "chunks": [c.to_obj() for c in self.chunks],
        }


#: a TensorRecord / ChunkRef of checked values, its fields by position, without the keyword ``__init__``
#: (:mod:`deltasync.frozen`; unpacking a 70k-tensor table makes 70k of each)
new_record: Callable[..., TensorRecord] = maker(TensorRecord, positional=True)
new_chunk: Callable[..., ChunkRef] = maker(ChunkRef, positional=True)


TABLE_VERSION = 1
_MAGIC = b"DST\x01"
_HEAD = struct.Struct("<4sBBBxIII")  # magic, kind, flags, reserved, n records, n chunks, n dims
_KINDS = {"keyframe": 0, "delta": 1}
_F_SPANS = 1  # delta chunks carry their word spans
_F_KEYS = 2  # keyframe chunk keys are listed (else each key is its tensor's name)
MAX_TABLE_BYTES = 1 << 30  # decompressed
# zstd level of the table: 2 is both smaller and faster than 3 on seed-scale tables (a 70k-tensor step's: 673 against
# 705 KB, 3.6 against 4.7 ms; 140k: 726 against 761 KB, under 1 MB as base64 in the manifest); any level reads alike
TABLE_LEVEL = 2

# the table's frame: this thread's compressor (deltasync.zctx: python-zstandard's contexts are not safe to share
# between threads; two publishers in one process committing side by side, e.g. a bf16 stream and its
# serving-format streams, got corrupt tables from a shared one)


def _text(items: list[str], what: str) -> bytes:
    data = newline_joined(items)
    if data is None:
        raise FormatError(f"a format-3 manifest cannot carry {what} holding a newline")
    return data


def pack_table(records, kind: str, blob_ids: list[str]) -> bytes:
    """The compressed table of ``records`` (TensorRecords, sorted by name) of a manifest whose blob list
    is ``blob_ids`` (chunk references are stored as positions in it). Column by column (comprehensions and
    numpy: a 70k-tensor manifest is packed at every publish)."""
    n = len(records)
    where = {b: i for i, b in enumerate(blob_ids)}
    names = [r.name for r in records]
    dtype_names: dict[str, int] = {}
    for d in [r.dtype for r in records]:  # codes in order of first appearance
        if d not in dtype_names:
            dtype_names[d] = len(dtype_names)
    codes = np.fromiter((dtype_names[r.dtype] for r in records), dtype=np.uint8, count=n)
    shapes = [r.shape for r in records]
    ndims = np.fromiter(map(len, shapes), dtype=np.uint8, count=n)
    dims = [d for sh in shapes for d in sh]
    fps = fp_values(r.fp_after for r in records)
    if fps is None:
        raise ValueError("a record's fp_after is not 16 hex digits")
    changed = np.fromiter((r.changed for r in records), dtype=np.uint64, count=n)
    chunk_lists = [r.chunks for r in records]
    counts = np.fromiter(map(len, chunk_lists), dtype=np.uint32, count=n)
    chunks = [c for cs in chunk_lists for c in cs]
    cblob = [where[c.blob] for c in chunks]
    has_spans = kind == "delta"
    keys_named = True
    cindex: list[int] = []
    spans: list[int] = []
    keys: list[str] = []
    if kind == "delta":
        cindex = [c.index for c in chunks]
        if any(c.start is None for c in chunks):
            has_spans = False
        else:
            spans = [x for c in chunks for x in (c.start, c.stop)]
    else:
        keys = [c.key for c in chunks]
        keys_named = all(c.key == r.name for r in records for c in r.chunks)
    flags = (_F_SPANS if has_spans and cindex else 0) | (0 if keys_named else _F_KEYS)
    sp = np.asarray(spans, dtype=np.int64).reshape(-1, 2) if flags & _F_SPANS else None
    return pack_columns(kind, names, list(dtype_names), codes, ndims, dims, fps, changed, counts, cblob,
                        cindex=cindex if kind == "delta" else None,
                        starts=None if sp is None else sp[:, 0], stops=None if sp is None else sp[:, 1],
                        keys=keys if flags & _F_KEYS else None)


def pack_columns(kind: str, names: list[str], dtype_names: list[str], codes, ndims, dims, fps, changed, counts,
                 cblob, *, cindex=None, starts=None, stops=None, keys: list[str] | None = None,
                 names_text: bytes | None = None) -> bytes:
    """:func:`pack_table` of records given as columns: per record (sorted by name) its name, dtype code (an index
    in ``dtype_names``, codes numbered in order of first appearance), dimension count, fingerprint after
    (uint64), change count and chunk count; ``dims`` every record's shape, one after another; per chunk (record
    after record) its blob's position in the manifest's blob list, and for a delta its index in that blob and,
    where known (``starts``/``stops``, both or neither), its word span; ``keys``: a keyframe's chunk keys where
    any is not its tensor's name. What a writer holding columns (the codec's flat encoder) packs without making
    a record. ``names_text``: ``names`` already joined (:func:`~deltasync.blob.newline_joined`), not joined again."""
    n, nchunks = len(names), len(cblob)
    delta = kind == "delta"
    spans = delta and starts is not None and nchunks > 0
    flags = (_F_SPANS if spans else 0) | (_F_KEYS if keys is not None else 0)
    dims = np.ascontiguousarray(dims, dtype="<u8")
    names_text = _text(names, "a tensor name") if names_text is None else names_text
    # the columns joined from their own buffers (little-endian, contiguous): no bytes copy of each first
    parts = [
        _HEAD.pack(_MAGIC, _KINDS[kind], flags, TABLE_VERSION, n, nchunks, dims.size),
        struct.pack("<I", len(names_text)), names_text,
        _lp(_text(dtype_names, "a dtype")),
        np.ascontiguousarray(codes, dtype=np.uint8), np.ascontiguousarray(ndims, dtype=np.uint8), dims,
        np.ascontiguousarray(fps, dtype="<u8"),
        np.ascontiguousarray(changed, dtype="<u8"),
        np.ascontiguousarray(counts, dtype="<u4"),
        np.diff(np.asarray(cblob, dtype=np.int64), prepend=0).astype("<i4"),
    ]
    if delta:
        ci = np.asarray(cindex if cindex is not None else (), dtype=np.int64)
        parts.append(np.diff(ci, prepend=0).astype("<i8"))
        if spans:
            a = np.asarray(starts, dtype=np.int64)
            parts.append(np.diff(a, prepend=0).astype("<i8"))
            parts.append((np.asarray(stops, dtype=np.int64) - a).astype("<u8"))
    elif keys is not None:
        parts.append(_lp(_text(keys, "a shard key")))
    # one-shot over the joined parts (a stream of them, fed part by part, came out 2.6% larger at 140k tensors)
    return compressor(TABLE_LEVEL).compress(b"".join(parts))


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


class _Reader:
    __slots__ = ("data", "at")

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)  # (its pieces are views: a 70k-tensor table's ~8 MB not copied again)
        self.at = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.at + n > len(self.data):
            raise FormatError(f"manifest table: truncated in {what}")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def array(self, dtype: str, count: int, what: str) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        return np.frombuffer(self.take(size * count, what), dtype=dtype)

    def text(self, what: str) -> list[str]:
        return self.text_raw(what)[0]

    def text_raw(self, what: str, raw: memoryview | None = None) -> tuple[list[str], memoryview, bool]:
        """The strings of a length-prefixed text (or of ``raw``, its bytes taken already), its bytes, and whether it
        is ASCII."""
        if raw is None:
            (n,) = struct.unpack("<I", self.take(4, what))
            raw = self.take(n, what)
        n = len(raw)
        try:
            text = str(raw, "utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"manifest table: {what} is not UTF-8") from None
        return (text.split("\n") if n else []), raw, text.isascii()


#: (names' bytes, their list): the names sections of the last few tables checked here. Step after step a stream's
#: tables list the same names (every tensor an AdamW step touches: ~3.3 MB of text at 70,000 tensors), and their
#: checks (UTF-8, one string each, sorted, none twice, 1-1024 characters) are a pure function of those bytes:
#: ~0.01 s a table, in the origin, the relays and every subscriber, each step. The list is shared (never mutated).
_NAMES: list[tuple[bytes, list[str]]] = []


def _checked_names(r: _Reader, n: int) -> list[str]:
    """The table's ``n`` names (its next length-prefixed text), every rule on them checked (FormatError)."""
    (size,) = struct.unpack("<I", r.take(4, "the names"))
    raw = r.take(size, "the names")
    for kept, names in _NAMES:
        if len(kept) == size and len(names) == n and kept.startswith(raw):  # (one memcmp: == on a view goes item by item)
            return names
    names, raw, ascii_names = r.text_raw("the names", raw)
    if len(names) != n:
        raise FormatError(f"manifest table: {len(names)} names for {n} tensors")
    if not all(map(lt, names, islice(names, 1, None))):  # strictly ascending: sorted, none twice (one C pass)
        if len(set(names)) != n:
            raise FormatError("manifest: a tensor is listed twice")
        raise FormatError("manifest: tensors must be sorted by name")
    if ascii_names:  # (one byte a character: the lengths from where the lines end)
        ends = np.flatnonzero(np.frombuffer(raw, np.uint8) == 10)
        lengths = np.diff(ends, prepend=-1, append=len(raw)) - 1 if n else np.zeros(0, np.int64)
    else:
        lengths = np.fromiter(map(len, names), np.int64, n)
    if n and (int(lengths.min()) < 1 or int(lengths.max()) > 1024):
        raise FormatError("manifest: tensor names must be non-empty strings of at most 1024 characters")
    if n >= _NAMES_MIN:
        _NAMES.insert(0, (bytes(raw), names))
        del _NAMES[_NAMES_KEEP:]
    return names


_NAMES_MIN = 1024  # fewer names check in well under a millisecond: not kept
_NAMES_KEEP = 4  # a stream's step tables, its keyframe's, a serving stream's


def unpack_table(blob: bytes, kind: str, blob_ids: list[str], *, limits, build: bool | str = True):
    """Records of a compressed table (see :func:`pack_table`); ``limits``: the manifest module's limits
    object (``max_tensors``, ``max_dims``, ...). FormatError on anything malformed. ``build=False``: every
    check (a delta's chunks each referenced once included), no records made (None); ``build="columns"``: the
    same checks, the columns as a :class:`TableColumns` (its records made when asked for)."""
    try:
        data = decompressor().decompress(blob, max_output_size=MAX_TABLE_BYTES)
    except zstandard.ZstdError as e:
        raise FormatError(f"manifest table: not a zstd frame ({str(e)[:120]})") from None
    r = _Reader(data)
    magic, kcode, flags, tver, n, nchunks, ndims_total = _HEAD.unpack(r.take(_HEAD.size, "its head"))
    if magic != _MAGIC or tver != TABLE_VERSION:
        raise FormatError(f"manifest table: bad magic or version ({magic!r}, {tver})")
    if kcode != _KINDS[kind]:
        raise FormatError(f"manifest table: written for another kind than {kind!r}")
    if flags & ~(_F_SPANS | _F_KEYS) or (kind == "delta" and flags & _F_KEYS) or (kind == "keyframe" and flags & _F_SPANS):
        raise FormatError(f"manifest table: unknown flags {flags:#x}")
    if n > limits.MAX_TENSORS:
        raise FormatError(f"manifest: a manifest lists at most {limits.MAX_TENSORS} tensors, found {n}")
    if nchunks > limits.MAX_CHUNKS:
        raise FormatError(f"manifest: a manifest holds at most {limits.MAX_CHUNKS} chunk references, found {nchunks}")
    if ndims_total > n * limits.MAX_DIMS:
        raise FormatError("manifest table: more dimensions than its tensors may have")
    names = _checked_names(r, n)
    dtypes = r.text("the dtypes")
    infos = [dtype_info(d) for d in dtypes]  # UnsupportedError/FormatError for an unknown dtype name
    codes = r.array("u1", n, "the dtype codes")
    if n and int(codes.max()) >= len(infos):
        raise FormatError("manifest table: a dtype code past its dtype list")
    ndims = r.array("u1", n, "the ranks")
    if n and int(ndims.max()) > limits.MAX_DIMS:
        raise FormatError(f"manifest: a shape has more than {limits.MAX_DIMS} dimensions")
    if int(ndims.sum(dtype=np.int64)) != ndims_total:
        raise FormatError("manifest table: its ranks do not add up to its dimensions")
    dims = r.array("<u8", ndims_total, "the dimensions")
    if ndims_total and int(dims.max()) > limits.MAX_DIM:
        raise FormatError(f"manifest: a dimension is over the {limits.MAX_DIM} limit")
    fps = r.array("<u8", n, "the fingerprints")
    changed = r.array("<u8", n, "the change counts")
    counts = r.array("<u4", n, "the chunk counts")
    if int(counts.sum(dtype=np.int64)) != nchunks:
        raise FormatError("manifest table: its chunk counts do not add up to its chunks")
    cblob = np.cumsum(r.array("<i4", nchunks, "the chunk blobs"), dtype=np.int64)
    if nchunks and (int(cblob.min()) < 0 or int(cblob.max()) >= len(blob_ids)):
        raise FormatError("manifest: a chunk refers to a blob not in the blob list")

    # shapes -> elements and words, vectorized (a product of up to 16 dims per tensor, each <= 2^34:
    # checked against the per-tensor limit in floats first, so no integer product can overflow)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(ndims, out=starts[1:])
    has = np.flatnonzero(ndims)  # tensors of one dimension or more (a scalar's product is 1); per tensor by reduceat
    first = starts[has]
    logs = np.zeros(n)
    zero = np.zeros(n, dtype=bool)
    if ndims_total:
        with np.errstate(divide="ignore"):
            logs[has] = np.add.reduceat(np.log2(np.maximum(dims.astype(np.float64), 0.5)), first)
        zero[has] = np.logical_or.reduceat(dims == 0, first)
    if np.any((logs > np.log2(limits.MAX_TENSOR_ELEMENTS) + 1e-9) & ~zero):
        raise FormatError(f"manifest: a shape has over the {limits.MAX_TENSOR_ELEMENTS}-element limit per tensor")
    elements = np.ones(n, dtype=np.int64)
    if ndims_total:
        elements[has] = np.multiply.reduceat(dims.astype(np.int64), first)
    elements[zero] = 0
    if np.any(elements > limits.MAX_TENSOR_ELEMENTS):
        raise FormatError(f"manifest: a shape has over the {limits.MAX_TENSOR_ELEMENTS}-element limit per tensor")
    esize = np.array([i.element_size for i in infos], dtype=np.int64)[codes] if n else np.zeros(0, np.int64)
    wpe = np.array([i.words_per_element for i in infos], dtype=np.int64)[codes] if n else np.zeros(0, np.int64)
    if int(elements.sum()) > limits.MAX_STATE_ELEMENTS:
        raise FormatError(f"manifest: the tensors total over {limits.MAX_STATE_ELEMENTS} elements (the limit per state)")
    if int((elements * esize).sum()) > limits.MAX_STATE_BYTES:
        raise FormatError(f"manifest: the tensors total over {limits.MAX_STATE_BYTES} bytes (the limit per state)")
    words = elements * wpe
    if np.any(changed.astype(np.int64) > words) or np.any(changed > np.uint64(words.max() if n else 0)):
        raise FormatError("manifest: a tensor's change count is over its words")

    cstart = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=cstart[1:])
    if kind == "delta":
        cindex = np.cumsum(r.array("<i8", nchunks, "the chunk indices"), dtype=np.int64)
        if nchunks and (int(cindex.min()) < 0 or int(cindex.max()) > limits.MAX_CHUNK_INDEX):
            raise FormatError("manifest: a chunk index is out of range")
        if flags & _F_SPANS:
            sstart = np.cumsum(r.array("<i8", nchunks, "the span starts"), dtype=np.int64)
            slen = r.array("<u8", nchunks, "the span lengths").astype(np.int64)
            sstop = sstart + slen
            owner = np.repeat(np.arange(n), counts.astype(np.int64))
            if nchunks and (int(sstart.min()) < 0 or np.any(slen <= 0) or np.any(sstop > words[owner])):
                raise FormatError("manifest: a chunk span is empty or leaves its tensor")
            later = np.ones(nchunks, dtype=bool)
            later[cstart[:-1][counts > 0]] = False  # a tensor's first chunk has nothing before it
            if nchunks > 1 and np.any(later[1:] & (sstart[1:] < sstop[:-1])):
                raise FormatError("manifest: a tensor's chunk spans overlap or are out of order")
        if np.any((changed == 0) & (counts > 0)):
            raise FormatError("manifest: an unchanged tensor has chunks")
        keys = None
    else:
        if np.any(counts != 1):
            raise FormatError("manifest: a keyframe tensor lives in exactly one shard")
        keys = r.text("the shard keys") if flags & _F_KEYS else names
        if len(keys) != nchunks:
            raise FormatError(f"manifest table: {len(keys)} shard keys for {nchunks} chunks")
    if r.at != len(data):
        raise FormatError(f"manifest table: {len(data) - r.at} bytes past its end")

    if kind == "delta" and nchunks:
        refs = cblob * (limits.MAX_CHUNK_INDEX + 1) + cindex  # < 2**20 * 2**32: no overflow
        # a writer's chunks go in blob order, each blob's in index order: strictly ascending, none twice (one pass);
        # any other order is sorted to tell
        if not (nchunks == 1 or bool((refs[1:] > refs[:-1]).all())) and np.unique(refs).size != nchunks:
            raise FormatError("manifest: a chunk is referenced twice")
    if not build:
        return None
    cols = TableColumns(kind=kind, names=names, dtype_names=[i.name for i in infos], codes=codes, dims=dims,
                        starts=starts, fps=fps, changed=changed, counts=counts, cblob=cblob, cstart=cstart,
                        blob_ids=list(blob_ids), words=words, flags=flags, cindex=cindex if kind == "delta" else None,
                        sstart=sstart if flags & _F_SPANS else None, sstop=sstop if flags & _F_SPANS else None,
                        keys=keys)
    return cols if build == "columns" else cols.records()


@dataclass(frozen=True, slots=True, kw_only=True)
class TableColumns:
    """A checked table's columns (``unpack_table(build="columns")``): per record its name (sorted), dtype code
    (into ``dtype_names``), dims (``dims[starts[i]:starts[i + 1]]``), fingerprint after, change count, word count
    and chunk count; per chunk (record after record, record ``i``'s from ``cstart[i]``) its blob's position in
    ``blob_ids``, a delta's chunk index and, with spans, its word span. What a reader that works on arrays (a
    subscriber's checks and patch plan) takes without a record made; :meth:`records` makes them."""

    kind: str
    names: list[str]
    dtype_names: list[str]  # canonical dtype names, by code
    codes: np.ndarray
    dims: np.ndarray
    starts: np.ndarray
    fps: np.ndarray
    changed: np.ndarray
    counts: np.ndarray
    cblob: np.ndarray
    cstart: np.ndarray
    blob_ids: list[str]
    words: np.ndarray
    flags: int
    cindex: np.ndarray | None
    sstart: np.ndarray | None
    sstop: np.ndarray | None
    keys: list[str] | None
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # dtypes() and shapes(), once made

    def dtypes(self) -> list[str]:
        """Each record's dtype name (made once)."""
        got = self.memo.get("dtypes")
        if got is None:
            got = self.memo["dtypes"] = list(map(self.dtype_names.__getitem__, self.codes.tolist()))
        return got

    def shapes(self) -> list[tuple[int, ...]]:
        """Each record's shape (made once)."""
        got = self.memo.get("shapes")
        if got is None:
            dl, sl = self.dims.tolist(), self.starts.tolist()
            got = self.memo["shapes"] = [tuple(dl[a:b]) for a, b in zip(sl, sl[1:])]
        return got

    def records(self) -> tuple:
        """The table's records (TensorRecords, each with its ChunkRefs), built without the frozen dataclasses'
        keyword ``__init__`` (a few µs a tensor otherwise)."""
        with gc_paused():  # 70k records, refs and tuples: the collector's passes over them cost more than making them
            n, nchunks = len(self.names), int(self.cblob.size)
            ids = [self.blob_ids[i] for i in self.cblob.tolist()]
            none = [None] * nchunks
            if self.kind == "delta":
                spans = self.flags & _F_SPANS
                refs = list(map(new_chunk, ids, self.cindex.tolist(), none, self.sstart.tolist() if spans else none,
                                self.sstop.tolist() if spans else none))
            else:
                refs = list(map(new_chunk, ids, none, self.keys, none, none))
            if nchunks == n and (n == 0 or int(self.counts.min()) == 1):  # one chunk a tensor (most states)
                chunk_tuples = [(c,) for c in refs]
            else:
                bounds = self.cstart.tolist()
                chunk_tuples = [tuple(refs[a:b]) for a, b in zip(bounds, bounds[1:])]
            return tuple(map(new_record, self.names, self.dtypes(), self.shapes(), [None] * n, fp_texts(self.fps),
                             self.changed.tolist(), chunk_tuples))


def fp_texts(values: np.ndarray) -> list[str]:
    """Fingerprints (uint64) as records spell them: 16 lowercase hex digits each."""
    return values.astype(">u8").tobytes().hex(" ", 8).split(" ") if values.size else []


def fp_values(texts) -> np.ndarray | None:
    """Fingerprints spelled as records spell them (16 hex digits) as uint64, in order; None if any is not exactly
    that."""
    texts = list(texts)
    try:
        raw = bytes.fromhex("".join(texts))
    except ValueError:
        return None
    if len(raw) != 8 * len(texts):
        return None
    return np.frombuffer(raw, dtype=">u8").astype(np.uint64)


