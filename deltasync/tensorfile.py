"""Safetensors, the one place that reads and writes them: shards in memory, state files on disk.

Layout (the safetensors spec)::

    N        u64 LE   length of the JSON header
    header   N bytes  {"__metadata__": {str: str}, NAME: {"dtype": TAG, "shape": [..], "data_offsets": [b, e]}, ...}
    data     the rest; tensor NAME is data[b:e], little-endian, row-major

Readers here enforce the spec's MUST rules and raise :class:`FormatError` (naming the
file, if any) for anything else: a header that runs past the end or is not a JSON
object, a duplicate key, an unknown dtype tag, a shape that is not a list of
non-negative integers, offsets that do not fit the shape, holes or overlaps in the
data, bytes after the last tensor. Empty and 0-d tensors are legal.

Dtypes safetensors cannot name (complex32, complex128, float8_e8m0fnu,
float4_e2m1fn_x2) are stored as a ``U8`` tensor of shape ``[*shape, element_size]``
with the real dtype in the metadata under ``deltasync.dtype.<name>``; readers here
restore them, other tools see bytes.

* :func:`save_shard` / :func:`load_shard`: bytes in memory (keyframe shards).
* :class:`MappedTensorFile`: a file through ``mmap`` (copy-on-write), its tensors views
  of the mapped pages: nothing is read until used, nothing is copied. ``.host`` gives them as
  :class:`~deltasync.dtypes.HostTensor` numpy words without importing torch (``.tensors``, the
  torch views, are made on first use).
* :func:`read_state_file` / :func:`write_state_file`: whole states on disk (atomic writes).
* :func:`build_header` / :func:`shard_bytes`: a header laid out here (metadata first, in the caller's
  order; data start aligned; a fixed length on request, padded with spaces as the spec allows), and
  shard bytes built with one copy of the data (publishing from mapped files).
* ``MappedTensorFile(path, writable=True)``: a shared writable map (``MAP_SHARED``): tensors are the
  file's pages, so patching them patches the file (``flush()`` is ``msync``; ``write_header()``
  rewrites the header in place).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import chain, repeat
from operator import eq, itemgetter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

try:
    import orjson as _orjson
except ImportError:  # the stdlib path decides alone
    _orjson = None

from . import headercache, kernels
from .atomic import write_atomic
from .dtypes import HostTensor, dtype_info, numpy_word_dtype, word_count
from .errors import FormatError, IntegrityError
from .frozen import maker
from .gcpause import gc_paused
from .lazytuple import LazyDict, LazyTuple

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

__all__ = [
    "DTYPE_META_PREFIX", "MAX_HEADER_BYTES", "MappedTensorFile", "ST_DTYPES", "TensorEntry", "TensorHeader",
    "build_header", "load_shard", "parse_header", "read_state_file", "save_shard", "shard_bytes", "tensors_of",
    "write_state_file",
]

DTYPE_META_PREFIX = "deltasync.dtype."  # metadata key prefix naming an exotic dtype
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit

# safetensors dtype tag -> deltasync dtype name (the dtypes stored natively)
ST_DTYPES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
_NATIVE = frozenset(ST_DTYPES.values())
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_LEN = struct.Struct("<Q")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """One tensor of a header: ``dtype``/``shape`` as restored, bytes ``[start, stop)`` of the whole buffer."""

    name: str
    dtype: str  # deltasync dtype name
    shape: tuple[int, ...]
    start: int
    stop: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorHeader:
    entries: tuple[TensorEntry, ...]  # in header order
    metadata: dict[str, str]
    data_start: int  # 8 + header length
    size: int  # the whole buffer's length


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderColumns:
    """A checked header's entries as columns, in header order: what a reader that works on arrays takes (the
    mapped compare of two files of one header) without an entry made."""

    names: list[str]
    dtypes: list[str]  # deltasync dtype names
    shapes: list[tuple[int, ...]]
    starts: np.ndarray  # int64, bytes of the whole buffer
    stops: np.ndarray
    key: str | None = None  # the header cache's key of the text it was read from (None: not kept there)


class LazyEntries(LazyTuple):
    """A header's :class:`TensorEntry` tuple made from its :class:`HeaderColumns` (``columns``) when first used
    (~0.03 s at 70,000 tensors, which a publish of two files of one header never needs)."""

    columns: HeaderColumns

    def _build(self) -> tuple[TensorEntry, ...]:
        c = self.columns
        with gc_paused():
            return tuple(map(_entry_at, c.names, c.dtypes, c.shapes, c.starts.tolist(), c.stops.tolist()))

    def __len__(self) -> int:
        return len(self.columns.names)


def header_columns(header: TensorHeader) -> HeaderColumns | None:
    """The columns a header was parsed or built as (None: its entries only)."""
    return getattr(header.entries, "columns", None)


def entry_names(header: TensorHeader) -> list[str]:
    """Its tensors' names, in header order (from its columns where it has them: no entry made)."""
    cols = header_columns(header)
    return cols.names if cols is not None else [e.name for e in header.entries]


def entry_starts(header: TensorHeader) -> dict[str, int]:
    """Each tensor's first byte in the buffer, by name (from its columns where it has them: no entry made)."""
    cols = header_columns(header)
    if cols is not None:
        return dict(zip(cols.names, cols.starts.tolist()))
    return {e.name: e.start for e in header.entries}


_TAGS = {tag: (name, dtype_info(name).element_size) for tag, name in ST_DTYPES.items()}  # tag -> (name, bytes)
_entry, _host_tensor = maker(TensorEntry), maker(HostTensor)  # built without __init__: 70k a file
_entry_at = maker(TensorEntry, positional=True)


def _first_duplicate(pairs: list[tuple[str, object]]) -> str:
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            return k
        seen.add(k)
    return ""


def _fast_json(text: bytes) -> tuple[dict, dict] | None:
    """The header's entries and metadata through orjson (~4x faster than ``json`` with a pairs hook on a
    70k-tensor header), or None where the stdlib path must decide: orjson is missing or refuses the text,
    or re-encoding what it parsed does not give back the same bytes (trailing spaces aside). That round
    trip is the duplicate-key check (orjson keeps a duplicate's last value, so its re-encoding is
    shorter); it holds for compact writers (safetensors' own, :func:`build_header` for ASCII names)."""
    if _orjson is None:
        return None
    try:
        obj = _orjson.loads(text)
    except _orjson.JSONDecodeError:
        return None
    if type(obj) is not dict:
        return None
    meta = obj.get("__metadata__", {})
    if type(meta) is not dict:
        return None
    try:
        same = _orjson.dumps(obj) == text.rstrip(b" ")
    except TypeError:
        return None
    if not same:
        return None
    obj.pop("__metadata__", None)
    return obj, meta


def _checked_json(text: bytes, where: str) -> tuple[dict, dict]:
    """The header's entries and metadata through the stdlib ``json``, every object checked for duplicate
    keys; FormatError for anything that is not a JSON object of that shape."""
    try:
        # objects as lists of pairs (built in C, no Python call per object as a hook has): duplicates are
        # found by comparing each dict's length with its pairs'
        pairs = json.loads(text, object_pairs_hook=list)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise FormatError(f"{where}header is not JSON (corrupt, or not safetensors)") from None
    if type(pairs) is not list or (pairs and type(pairs[0]) is not tuple) or text.lstrip()[:1] != b"{":
        raise FormatError(f"{where}header is not a JSON object")
    header = dict(pairs)
    if len(header) != len(pairs):
        raise FormatError(f"{where}header: key {_first_duplicate(pairs)!r} appears twice")
    meta = header.pop("__metadata__", None)
    meta = [] if meta is None else meta
    if type(meta) is not list or (meta and type(meta[0]) is not tuple):
        raise FormatError(f"{where}__metadata__ is not an object of strings")
    meta_pairs, meta = meta, dict(meta)
    if len(meta) != len(meta_pairs):
        raise FormatError(f"{where}header: key {_first_duplicate(meta_pairs)!r} appears twice")
    for name, e in header.items():  # an entry object with a duplicate key stays a list: malformed
        if type(e) is list and (not e or type(e[0]) is tuple) and len(d := dict(e)) == len(e):
            header[name] = d
    return header, meta


def parse_header(buf, *, where: str = "", size: int | None = None) -> TensorHeader:
    """Parse and check the header of a safetensors buffer (bytes, memoryview or mmap), the data
    layout included: every MUST rule of the spec holds, or FormatError (prefixed by ``where``).
    ``size``: the whole file's length when ``buf`` holds only its first bytes (the header)."""
    size = len(buf) if size is None else size
    if size < 8:
        raise FormatError(f"{where}{size} bytes, too short for a safetensors header (truncated?)")
    (n,) = _LEN.unpack_from(buf, 0)
    if n > MAX_HEADER_BYTES or 8 + n > size or 8 + n > len(buf):
        raise FormatError(f"{where}header of {n} bytes runs past the end of the {size}-byte data (truncated?)")
    view = memoryview(buf)[8 : 8 + n]  # (the text is copied only to be parsed: a 70k-tensor header is ~8 MB)
    try:
        global _LAST_HEADER
        last = _LAST_HEADER
        if last is not None and last[1] == size and _same_text(last[0], view, size):  # again (a step's two files)
            h = last[2]
            return TensorHeader(entries=h.entries, metadata=dict(h.metadata), data_start=h.data_start, size=size)
        with gc_paused():  # 70k entries: the collector's passes over them cost more than making them
            return _parse_text(view, where, n, size)
    finally:
        view.release()  # (a map may close once this returns)


def _same_text(kept: bytes | str, view: memoryview, size: int) -> bool:
    """Whether a header text is the one :data:`_LAST_HEADER` was read from: its text, or its header cache key."""
    return kept == view if isinstance(kept, bytes) else kept == headercache.key_of(view, size)


def _parse_text(view: memoryview, where: str, n: int, size: int) -> TensorHeader:
    global _LAST_HEADER
    key, kept = headercache.load(view, size, 8 + n)  # this text's columns as a process parsed them before
    if kept is not None:
        names, dtypes, shapes, starts, stops, meta = kept
        entries = LazyEntries()
        entries.columns = HeaderColumns(names=names, dtypes=dtypes, shapes=shapes, starts=starts, stops=stops, key=key)
        _LAST_HEADER = (key, size, TensorHeader(entries=entries, metadata=dict(meta), data_start=8 + n, size=size))
        return TensorHeader(entries=entries, metadata=dict(meta), data_start=8 + n, size=size)
    text = bytes(view)
    parsed = _fast_json(text)
    if parsed is not None:
        header, meta = parsed
    else:
        header, meta = _checked_json(text, where)
    if not all(type(v) is str for v in meta.values()):
        raise FormatError(f"{where}__metadata__ is not an object of strings")
    base = 8 + n
    data_len = size - base
    exotic = any(k.startswith(DTYPE_META_PREFIX) for k in meta)  # else no entry has a real dtype to look up
    entries = None if exotic else _entries_fast(header, base, data_len)
    if entries is not None:
        c = entries.columns
        if headercache.store(key, size, base, c.names, c.dtypes, c.shapes, c.starts, c.stops, meta):
            entries.columns = replace(c, key=key)
        out = TensorHeader(entries=entries, metadata=dict(meta), data_start=base, size=size)
        _LAST_HEADER = (text, size, TensorHeader(entries=entries, metadata=dict(meta), data_start=base, size=size))
        return out
    entries = []
    make, tags = _entry, _TAGS
    for name, e in header.items():
        if type(e) is not dict or e.keys() != _ENTRY_KEYS:
            raise FormatError(f"{where}entry {name!r} is malformed (expected {sorted(_ENTRY_KEYS)})")
        tag, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        kind = tags.get(tag) if type(tag) is str else None
        if kind is None:
            raise FormatError(f"{where}{name}: dtype {tag!r} is not supported; supported: {', '.join(ST_DTYPES)}")
        stored, element_size = kind
        if type(shape) is not list:
            raise FormatError(f"{where}{name}: bad shape {shape!r}")
        numel = 1
        for s in shape:
            if type(s) is not int or s < 0:  # bool is not int by type()
                raise FormatError(f"{where}{name}: bad shape {shape!r}")
            numel *= s
        if not (type(offsets) is list and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int
                and 0 <= offsets[0] <= offsets[1] and offsets[1] - offsets[0] == numel * element_size):
            raise FormatError(f"{where}{name}: data offsets {offsets!r} do not fit {shape} {tag}")
        b, end = offsets
        if end > data_len:
            raise FormatError(f"{where}{name} ends at byte {base + end} but the data has {size} (truncated?)")
        dtype, real_shape = stored, tuple(shape)
        real = meta.get(DTYPE_META_PREFIX + name) if exotic else None
        if real is not None:
            rinfo = dtype_info(real)  # an unknown name raises UnsupportedError (a FormatError)
            if stored != "uint8" or not shape or shape[-1] != rinfo.element_size:
                raise FormatError(f"{where}{name}: stored as {tag} {shape}, cannot be {real}")
            dtype, real_shape = rinfo.name, tuple(shape[:-1])
        # without the frozen dataclass's keyword __init__ (70k entries a file)
        entries.append(make(name=name, dtype=dtype, shape=real_shape, start=base + b, stop=base + end))
    at = base
    for e in sorted(entries, key=lambda e: (e.start, e.stop)):
        if e.start != at:
            raise FormatError(f"{where}tensor data has a hole or overlap at byte {e.start}")
        at = e.stop
    if at != size:
        raise FormatError(f"{where}{size - at} bytes after the last tensor (a torn write?)")
    out = TensorHeader(entries=tuple(entries), metadata=dict(meta), data_start=base, size=size)
    _LAST_HEADER = (text, size, TensorHeader(entries=out.entries, metadata=dict(meta), data_start=base, size=size))
    return out


_BIG = 1 << 60  # offsets and element counts a header's columns are checked in int64 below (any larger: the loop)


def _entries_fast(header: dict, base: int, data_len: int) -> LazyEntries | None:
    """:func:`parse_header`'s entries of a header without exotic dtypes, checked column by column (C-level maps
    over the entries, then numpy: ~5x the loop's speed at 70,000 tensors) and kept as those columns (the entries
    made when first used), or None where any rule fails or a value is out of the columns' range: the loop then
    finds the first fault and names it."""
    vals = list(header.values())
    n = len(vals)
    if not n:
        return None
    if set(map(type, vals)) != {dict} or not all(map(eq, map(dict.keys, vals), repeat(_ENTRY_KEYS))):
        return None
    tags = list(map(_GET_DTYPE, vals))
    shapes = list(map(_GET_SHAPE, vals))
    offsets = list(map(_GET_OFFSETS, vals))
    if set(map(type, tags)) != {str} or set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
        return None
    kinds = list(map(_TAGS.get, tags))
    if None in kinds or set(map(len, offsets)) != {2}:
        return None
    bounds = list(chain.from_iterable(offsets))
    dims = list(chain.from_iterable(shapes))
    if set(map(type, bounds)) != {int} or (dims and set(map(type, dims)) != {int}):  # bool is not int by type()
        return None
    try:
        off = np.array(bounds, dtype=np.int64).reshape(-1, 2)
        dim = np.array(dims, dtype=np.int64)
    except OverflowError:
        return None
    if (off < 0).any() or (off >= _BIG).any() or (dim < 0).any() or (dim >= _BIG).any():
        return None
    ndim = np.fromiter(map(len, shapes), np.int64, n)
    numel = np.ones(n, np.int64)
    has = np.flatnonzero(ndim)
    if has.size:
        at = np.zeros(n + 1, np.int64)
        np.cumsum(ndim, out=at[1:])
        # element counts in float first: a product at or past 2**60 leaves the columns' range (the loop decides)
        if (np.multiply.reduceat(dim.astype(np.float64), at[has]) >= float(_BIG) / 2).any():
            return None
        numel[has] = np.multiply.reduceat(dim, at[has])
    esize = np.array([k[1] for k in kinds], dtype=np.int64)
    begin, end = off[:, 0], off[:, 1]
    if np.any(end < begin) or np.any(end - begin != numel * esize) or int(end.max()) > data_len:
        return None
    order = np.lexsort((end, begin))
    b, e = begin[order], end[order]
    if int(b[0]) != 0 or np.any(b[1:] != e[:-1]) or int(e[-1]) != data_len:
        return None
    entries = LazyEntries()  # made when first used
    entries.columns = HeaderColumns(names=list(header), dtypes=[k[0] for k in kinds], shapes=list(map(tuple, shapes)),
                                    starts=begin + base, stops=end + base)
    return entries


_GET_DTYPE, _GET_SHAPE, _GET_OFFSETS = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets")


#: (header text, or its header cache key where it was read back from the cache; buffer size; its checked
#: TensorHeader): the last header parsed. Consecutive checkpoints of one trainer have the same header byte for byte
#: (``publish --base``, ``diff``: 0.37 s a file at 70,000 tensors); a header is a pure function of its text and the
#: buffer's size, so the second is the first's.
_LAST_HEADER: tuple[bytes | str, int, TensorHeader] | None = None


def _tensor(whole: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """The entry's tensor as a view of ``whole`` (the buffer as uint8), copied only if misaligned."""
    import torch

    info = dtype_info(e.dtype)
    if e.stop == e.start:
        return torch.empty(e.shape, dtype=info.torch_dtype)
    raw = whole[e.start : e.stop]
    if e.start % info.element_size:  # unaligned (complex128 in a shard, a foreign file): copy to view
        raw = raw.clone()
    return raw.view(info.torch_dtype).reshape(e.shape)


def tensors_of(whole: torch.Tensor, header: TensorHeader) -> dict[str, torch.Tensor]:
    """Every tensor of a parsed buffer (``whole``: the buffer as a flat uint8 tensor), as views of it."""
    return {e.name: _tensor(whole, e) for e in header.entries}


class TensorViews(Mapping):
    """Name -> a torch view of a parsed buffer (``whole``: the buffer as a flat uint8 tensor), each made when first
    asked for and kept: what :func:`tensors_of` gives, in header order, without making them all up front."""

    def __init__(self, whole: torch.Tensor, header: TensorHeader) -> None:
        self._whole = whole
        self._header = header
        self._by_name: dict[str, TensorEntry] | None = None  # made when first needed (0.02 s at 140k tensors)
        self._made: dict[str, torch.Tensor] = {}

    @property
    def _entries(self) -> dict[str, TensorEntry]:
        got = self._by_name
        if got is None:
            got = self._by_name = {e.name: e for e in self._header.entries}
        return got

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._made.get(name)
        if t is None:
            t = self._made[name] = _tensor(self._whole, self._entries[name])
        return t

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._header.entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


class HostState(LazyDict):
    """:func:`host_tensors_of`'s mapping: name -> :class:`HostTensor`, in header order, that also knows the
    header it was made from (``header``), so a state of many tensors can be described without a pass over
    them (its layout, its bytes: :func:`deltasync.codec.same_layout`, :meth:`records`).

    Its tensors are made when first asked for (all at once: ~0.5 µs each, 70k a file, where a publish of two
    files of one header compares them from the header's columns and needs none); its length is the header's
    until then. ``pristine``: still exactly what its header says (nothing set or deleted since)."""

    header: TensorHeader
    whole: np.ndarray | None = None  # the mapped buffer the tensors view (uint8), where made from one
    _edited = False

    @property
    def pristine(self) -> bool:
        return not self._edited

    def records(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype name, shape) of every tensor, in header order."""
        if self._edited:  # changed since it was made: as it is now
            return [(n, t.dtype, t.shape) for n, t in self.items()]
        return [(e.name, e.dtype, e.shape) for e in self.header.entries]

    @property
    def nbytes(self) -> int:
        if self._edited:
            return sum(t.nbytes for t in self.values())
        return self.header.size - self.header.data_start

    def __len__(self) -> int:
        return len(self.header.entries) if self._pending is not None else dict.__len__(self)

    def _edit(self) -> None:  # made first, and the state is no longer its header's
        self._full()
        self._edited = True


def same_header(a: Mapping, b: Mapping) -> bool:
    """``a`` and ``b`` are mapped files' states (``tensorfile.HostState``) of one header object (the header
    cache's: two checkpoints of one trainer), each still exactly its header's: the same layout, known without
    a pass over either."""
    ha, hb = getattr(a, "header", None), getattr(b, "header", None)
    return (ha is not None and hb is not None and ha.entries is hb.entries and getattr(a, "pristine", False)
            and getattr(b, "pristine", False))


def host_tensors_of(whole: np.ndarray, header: TensorHeader) -> HostState:
    """Every tensor of a parsed buffer (``whole``: the buffer as a flat uint8 numpy array) as
    :class:`HostTensor` words viewing it (copied only where misaligned to its words), made when first asked
    for. No torch."""
    out = HostState()
    out.header = header
    out.whole = whole
    out._pending = _host_tensors
    return out


def _host_tensors(out: HostState) -> None:
    with gc_paused():
        _fill_host(out, out.whole, out.header)


def _fill_host(out: HostState, whole: np.ndarray, header: TensorHeader) -> None:
    make, put = _host_tensor, dict.__setitem__
    kinds: dict[str, tuple] = {}  # dtype name -> (dtype name, word size, word dtype, the buffer as those words)
    for e in header.entries:
        kind = kinds.get(e.dtype)
        if kind is None:
            info = dtype_info(e.dtype)
            w, wdt = info.word_size, numpy_word_dtype(info.word_size)
            kind = kinds[e.dtype] = (info.name, w, wdt, whole[: whole.size // w * w].view(wdt))
        name, w, wdt, as_words = kind
        start, stop = e.start, e.stop
        if start % w:  # misaligned to its words: copied
            words = whole[start:stop].copy().view(wdt)
        elif stop > start:
            words = as_words[start // w : stop // w]
        else:
            words = np.empty(0, wdt)
        # HostTensor's checks hold by construction (the header's checked sizes): built without its keyword
        # __init__ and __post_init__ (~8 µs a tensor; 70k tensors a file)
        put(out, e.name, make(dtype=name, shape=e.shape, words=words))


# -- in memory ---------------------------------------------------------------------------------

def _storable(name: str, t: torch.Tensor, meta: dict[str, str]) -> torch.Tensor:
    import torch

    t = t.detach().cpu().contiguous()
    info = dtype_info(t.dtype)
    if info.name in _NATIVE:
        return t
    meta[DTYPE_META_PREFIX + name] = info.name
    return t.reshape(-1).view(torch.uint8).reshape(*t.shape, info.element_size)


def save_shard(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Tensors (any device, any supported dtype) as safetensors bytes, with ``metadata``."""
    from safetensors.torch import save as save_safetensors

    meta = dict(metadata or {})
    data = {n: _storable(n, t, meta) for n, t in tensors.items()}
    return save_safetensors(data, metadata=meta or None)


def load_shard(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors of safetensors bytes, exotic dtypes restored, in one buffer the caller owns (one copy
    of the data). Malformed input raises FormatError."""
    import torch

    header = parse_header(data)
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # parse_header saw at least 8 bytes
    return tensors_of(whole, header)


# -- on disk -----------------------------------------------------------------------------------

_MADV_POPULATE_READ = 22  # linux/mman.h (5.14+)


class MappedTensorFile:
    """A safetensors file through ``mmap``: ``tensors`` are views of its pages, ``metadata`` its header's.

    By default the map is copy-on-write (``MAP_PRIVATE``): writing to a tensor never changes the file.
    ``writable=True`` maps it shared (``MAP_SHARED``): writes to the tensors are writes to the file
    (durable after :meth:`flush`), and every tensor must be a view (a misaligned tensor, which a
    read-only map would copy, raises FormatError).
    ``close()`` (or ``with``) releases the map once nothing uses the tensors; tensors still
    referenced keep it alive. Opening checks the whole header against the file's size, so a
    truncated or garbled file raises FormatError before any tensor is read. Replace such files
    by renaming (:func:`~deltasync.atomic.write_atomic`); truncating a mapped file in place
    makes reads of the lost pages fault.
    """

    def __init__(self, path: str | os.PathLike, *, writable: bool = False) -> None:
        self.path = Path(path)
        self.writable = writable
        fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)  # OSError (FileNotFoundError, ...) as is
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise FormatError(f"{self.path}: {size} bytes, too short for a safetensors header (truncated?)")
            self._mm: mmap.mmap | None = mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self.size = size
        try:
            self.header = parse_header(self._mm, where=f"{self.path}: ")
            if writable:
                self._check_aligned()
        except BaseException:
            self.close()
            raise
        self._tensors: dict[str, torch.Tensor] | None = None
        self._views: TensorViews | None = None
        self._host: dict[str, HostTensor] | None = None
        self.metadata: dict[str, str] = self.header.metadata

    def _check_aligned(self) -> None:
        """FormatError unless every tensor starts aligned to its elements (a writable map patches them in place
        as words). From the header's columns where it has them: no entry made (~0.08 s at 70,000 tensors)."""
        cols = header_columns(self.header)
        if cols is not None:
            kinds = {d: i for i, d in enumerate(dict.fromkeys(cols.dtypes))}
            size = np.array([dtype_info(d).element_size for d in kinds], np.int64)
            code = np.fromiter(map(kinds.__getitem__, cols.dtypes), np.int64, len(cols.dtypes))
            bad = np.flatnonzero((cols.stops > cols.starts) & (cols.starts % size[code] != 0)) if code.size else ()
            if len(bad) == 0:
                return
            entries = [self.header.entries[int(bad[0])]]
        else:
            entries = self.header.entries
        for e in entries:
            if e.stop > e.start and e.start % dtype_info(e.dtype).element_size:
                raise FormatError(f"{self.path}: {e.name} starts at byte {e.start}, not aligned to its "
                                  f"{e.dtype} elements; it cannot be patched in place (rewrite the file)")

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as torch views of the map (imports torch; made on first use)."""
        if self._tensors is None:
            if self._mm is None:
                return {}
            import torch

            self._tensors = tensors_of(torch.frombuffer(self._mm, dtype=torch.uint8), self.header)
        return self._tensors

    @property
    def views(self) -> Mapping[str, torch.Tensor]:
        """:attr:`tensors` where they are made already, else a :class:`TensorViews` that makes each view when it is
        first asked for (a step of a 70k-tensor file that patches its tensors by address needs few, or none)."""
        if self._tensors is not None or self._mm is None:
            return self.tensors
        if self._views is None:
            import torch

            self._views = TensorViews(torch.frombuffer(self._mm, dtype=torch.uint8), self.header)
        return self._views

    @property
    def host(self) -> dict[str, HostTensor]:
        """The tensors as :class:`HostTensor` numpy words viewing the map (no torch)."""
        if self._host is None:
            if self._mm is None:
                return {}
            self._host = host_tensors_of(np.frombuffer(self._mm, dtype=np.uint8), self.header)
        return self._host

    def prefault(self) -> bool:
        """Enter every page of the file into this map's page tables now, reading what is not in the page cache
        (``madvise(MADV_POPULATE_READ)``, Linux 5.14+), so that a later full read of the tensors takes no page
        fault: on tmpfs that first-touch cost is about as large as the read itself (~50 ms per 512 MiB), paid
        by whichever thread touches a page first. The call is made through ctypes, which releases the GIL:
        a command runs it on a thread of its own while its main thread is busy with Python (its imports).
        Changes nothing in the file or the map's contents; True if the kernel did it, False where it cannot
        (older kernels, other systems, a closed map)."""
        if self._mm is None or self.size == 0:
            return False
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            madvise.restype = ctypes.c_int
        except (OSError, AttributeError, ImportError):
            return False
        words = np.frombuffer(self._mm, dtype=np.uint8)
        address = words.__array_interface__["data"][0]
        del words  # no export of the map outlives this line (close() stays possible)
        return madvise(address, self.size, _MADV_POPULATE_READ) == 0

    def buffer(self) -> memoryview:
        """The whole mapped file as a read-only memoryview (header included; valid until close)."""
        if self._mm is None:
            raise FormatError(f"{self.path}: closed")
        return memoryview(self._mm).toreadonly()

    def flush(self) -> None:
        """``msync`` the map: every write to the tensors (and the header) is on disk when this returns."""
        if self._mm is not None and self.writable:
            self._mm.flush()

    def write_header(self, header: bytes) -> None:
        """Writable maps: replace the header in place by ``header`` of exactly the same length (the
        8-byte length included, see :func:`build_header`'s ``length``), then ``msync``; the new header
        must describe the same data (checked: same entries)."""
        if self._mm is None or not self.writable:
            raise FormatError(f"{self.path}: not mapped writable")
        if len(header) != self.header.data_start:
            raise FormatError(f"{self.path}: new header is {len(header)} bytes, the file's is {self.header.data_start}")
        check = parse_header(header, where=f"{self.path} (new header): ", size=self.size)
        if check.entries != self.header.entries:
            raise FormatError(f"{self.path}: the new header describes other tensors than the file holds")
        self._mm[: len(header)] = header
        self._mm.flush()
        self.header = check
        self.metadata = check.metadata

    def write_metadata(self, metadata: Mapping[str, str]) -> bool:
        """Writable maps: replace the header's ``__metadata__`` in place by ``metadata`` when the header was laid
        out by :func:`build_header` (its JSON starts with the metadata) and the new metadata's JSON is exactly as
        long as the old one's (a caller pads it to a fixed width: ``subscribe --out``'s version and state
        fingerprint), then ``msync``. Only those bytes change: the tensors' entries, whatever their number, are
        neither rebuilt nor parsed again (a header of 200,000 entries took ~1.5 s to rebuild and check, twice per
        applied delta). Returns False, changing nothing, when the header is not of that shape (then rebuild it:
        :meth:`write_header`)."""
        if self._mm is None or not self.writable:
            raise FormatError(f"{self.path}: not mapped writable")
        meta = dict(metadata)
        if not all(type(k) is str and type(v) is str for k, v in meta.items()):
            raise FormatError(f"{self.path}: header metadata must map strings to strings")
        new = json.dumps(meta, separators=(",", ":")).encode()
        end = self.metadata_end()
        at = 8 + len(_META_PREFIX)
        if end is None or at + len(new) != end:
            return False
        self._mm[at:end] = new
        self._mm.flush()
        self.header = TensorHeader(entries=self.header.entries, metadata=meta, data_start=self.header.data_start,
                                   size=self.header.size)
        self.metadata = meta
        return True

    def metadata_end(self) -> int | None:
        """Writable maps: where the header's metadata ends (the first byte :meth:`write_metadata` leaves alone: it
        rewrites only bytes before it), or None when the header is not laid out with its metadata first."""
        if self._mm is None or not self.writable:
            raise FormatError(f"{self.path}: not mapped writable")
        old = json.dumps(self.metadata, separators=(",", ":")).encode()
        at = 8 + len(_META_PREFIX)
        if bytes(self._mm[8:at]) != _META_PREFIX or bytes(self._mm[at : at + len(old)]) != old:
            return None
        return at + len(old)

    def close(self) -> None:
        self._tensors = self._host = self._views = None
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a tensor still views the map; the map goes with the last one
                pass

    def __enter__(self) -> MappedTensorFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: ``deltasync.state_fp`` of a ``subscribe --out`` file while a delta is written into it (or was, when the
#: subscriber was killed then): its bytes are no published version until the apply ends or is rolled back
PATCHING = "patching"
META_STATE_FP = "deltasync.state_fp"


def check_published(metadata: Mapping[str, str], where: str) -> None:
    """Refuse a file whose header says a delta is being written into it (docs/CLIENT.md, "The --out file":
    the rule every reader of a ``subscribe --out`` file follows)."""
    if metadata.get(META_STATE_FP) == PATCHING:
        raise IntegrityError(
            f"{where}: a delta is being written into this file (deltasync.state_fp is {PATCHING!r}): its bytes are "
            "no published version. Wait for the apply to end, or, if its subscriber was killed, run `deltasync "
            "subscribe --out` on it again (it rolls the file back to the version before, from its journal)")


def read_state_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, as copy-on-write views of its mmap (nothing is read until
    used; writes stay in this process). Bad files raise FormatError, a missing one FileNotFoundError, a
    ``subscribe --out`` file caught mid-apply IntegrityError (:func:`check_published`)."""
    f = MappedTensorFile(path)
    check_published(f.metadata, str(path))
    return f.tensors  # the tensors keep the map alive


def write_state_file(path: str | os.PathLike, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write a state atomically (temp file, fsync, rename); returns the file size."""
    data = save_shard(state, metadata)
    write_atomic(path, data)
    return len(data)


# -- headers laid out here -------------------------------------------------------------------------

_META_PREFIX = b'{"__metadata__":'  # how build_header's JSON starts when it has metadata

_TAG_OF: dict[str, str] = {}  # dtype name -> its safetensors tag (the first ST_DTYPES names)
for _tag, _name in ST_DTYPES.items():
    _TAG_OF.setdefault(_name, _tag)


def _entry_of(name: str, info, shape: tuple[int, ...], meta: dict[str, str]) -> tuple[str, list[int], int]:
    """(tag, stored shape, bytes) of a tensor of dtype ``info`` as stored here; exotic dtypes become tagged ``U8``."""
    numel = 1
    for s in shape:
        numel *= s
    tag = _TAG_OF.get(info.name)
    if tag is not None:
        return tag, list(shape), numel * info.element_size
    meta[DTYPE_META_PREFIX + name] = info.name
    return "U8", [*shape, info.element_size], numel * info.element_size


def build_header(layout: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None, *,
                 align: int = 8, length: int | None = None, reserve: int = 0) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for ``layout`` (name -> (dtype name, shape)) and the data offset of each
    tensor (from the start of the file). Returns ``(header, offsets)``; ``header`` includes the 8-byte
    length, and ``len(header)`` is where the data starts.

    The JSON starts with ``__metadata__``, its keys in the caller's order (so a caller can keep the
    bytes that change between versions at the very start of the file). Tensors are laid out by
    element size, largest first, so each starts aligned to its elements when the data start is a
    multiple of ``align`` (the header is padded with spaces, which the spec allows). ``length``: pad
    to exactly this many bytes (FormatError if the header does not fit); else the smallest aligned
    length with at least ``reserve`` spare bytes (room to rewrite the header in place later)."""
    with gc_paused():  # 70k entries' dicts and lists: the collector's passes over them cost more than making them
        return _build_header(layout, metadata, align, length, reserve)


def _dumps(obj: dict) -> bytes:
    """``json.dumps(obj, separators=(",", ":")).encode()``: through orjson (~5x faster on a 70k-tensor header) when
    every key and string is printable ASCII, where both give the same bytes."""
    if _orjson is not None:
        meta = obj.get("__metadata__", {})
        texts = [*obj, *meta, *meta.values()]  # the entries' dtype tags are ours (printable ASCII)
        if all(type(x) is str for x in texts):
            joined = "".join(texts)  # one C-level pass over every name and string
            if joined.isascii() and joined.isprintable():
                return _orjson.dumps(obj)
    return json.dumps(obj, separators=(",", ":")).encode()


def _plain(text: str) -> bool:
    """Whether ``text`` is its own JSON string body (printable ASCII, no quote or backslash to escape)."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def _build_columns(layout, metadata, align, length, reserve) -> tuple[bytes, dict[str, int]] | None:
    """:func:`_build_header` of a layout whose dtypes all have a safetensors tag and whose names are plain
    (:func:`_plain`), as columns: one text per (dtype, shape) and one formatted line per tensor, no object per
    entry to encode (~2.5x faster at 70,000 tensors); the same bytes. None for any other layout."""
    names = sorted(layout)
    if not names or not _plain("".join(names)):
        return None
    vals = list(map(layout.__getitem__, names))
    try:
        kinds = {k: i for i, k in enumerate(dict.fromkeys(vals))}  # (dtype, shape): layers share a few
    except TypeError:  # shapes given as lists
        vals = [(d, s if type(s) is tuple else tuple(s)) for d, s in vals]
        kinds = {k: i for i, k in enumerate(dict.fromkeys(vals))}
    code = np.fromiter(map(kinds.__getitem__, vals), np.int64, len(vals))
    infos, shapes, prefix, nbytes = [], [], [], []
    for dtype, shape in kinds:
        info = dtype_info(dtype)
        tag = _TAG_OF.get(info.name)
        shape = shape if type(shape) is tuple else tuple(shape)
        if tag is None or not all(type(d) is int and d >= 0 for d in shape):
            return None  # an exotic dtype (stored as U8, named in the metadata), or a shape to judge: the loop
        numel = 1
        for d in shape:
            numel *= d
        infos.append(info.name)
        shapes.append(shape)
        prefix.append(f'{{"dtype":"{tag}","shape":[{",".join(map(str, shape))}],"data_offsets":[')
        nbytes.append(numel * info.element_size)
    size = np.array([dtype_info(d).element_size for d in infos], np.int64)
    try:
        sizes = np.array(nbytes, np.int64)
    except OverflowError:
        return None
    rank = np.argsort(-size[code], kind="stable")  # by element size, largest first, then by name
    order = rank.tolist()
    oc = code[rank]
    ends = np.cumsum(sizes[oc])
    starts = ends - sizes[oc]
    onames = list(map(names.__getitem__, order))
    ocodes = oc.tolist()
    lines = _entries_text(names, rank, prefix, oc, starts, ends)
    if lines is None:
        lines = ",".join(map('"{}":{}{},{}]}}'.format, onames, map(prefix.__getitem__, ocodes), starts.tolist(),
                             ends.tolist())).encode()
    meta = dict(metadata or {})
    body = (('{"__metadata__":' + json.dumps(meta, separators=(",", ":")) + ("," if names else "") if meta else "{")
            .encode() + lines + b"}")
    at = int(ends[-1])
    if length is None:
        length = -(-(8 + len(body) + reserve) // align) * align
    if 8 + len(body) > length:
        raise FormatError(f"a header of {8 + len(body)} bytes does not fit the {length} reserved for it")
    header = _LEN.pack(length - 8) + body + b" " * (length - 8 - len(body))
    first = starts + length
    if all(type(v) is str for v in meta.values()):  # what parse_header makes of it (see _build_header)
        global _LAST_HEADER
        entries = LazyEntries()  # as columns, the entries made when first used
        entries.columns = HeaderColumns(names=onames, dtypes=list(map(infos.__getitem__, ocodes)),
                                        shapes=list(map(shapes.__getitem__, ocodes)), starts=first, stops=ends + length)
        _LAST_HEADER = (header[8:], length + at, TensorHeader(entries=entries, metadata=dict(meta), data_start=length,
                                                              size=length + at))
    if len(onames) < ENTRIES_KERNEL_MIN:
        return header, dict(zip(onames, first.tolist()))
    offsets = LazyDict()  # (a first subscribe's new file never reads them: 70k-140k entries not made)
    offsets._pending = lambda d: dict.update(d, zip(onames, first.tolist()))
    return header, offsets


#: entries from which :func:`_entries_text` writes them with the compiled kernel (fewer: a few ms in Python)
ENTRIES_KERNEL_MIN = 4096


def _entries_text(names: list[str], rank: np.ndarray, prefixes: list[str], codes: np.ndarray, starts: np.ndarray,
                  ends: np.ndarray) -> bytes | None:
    """:func:`_build_columns`' entries, ``"NAME":PREFIX START,END]}`` comma-separated for the names ``names[rank[i]]``
    in turn, written by one compiled pass (``kernels.cpu.header_entries``: ~0.005 s at 70,000 tensors, where a
    formatted string each was ~0.03-0.08 s, in every first ``subscribe --out`` of a seed-scale model); None for
    fewer than :data:`ENTRIES_KERNEL_MIN` entries or without the compiled kernels (the caller formats them). The
    names and prefixes are plain (:func:`_plain`): one byte a character."""
    n = len(names)
    k = kernels.cpu_kernels() if n >= ENTRIES_KERNEL_MIN else None
    if k is None:
        return None
    raw = "".join(names).encode()
    name_at = np.zeros(n + 1, np.int64)
    np.cumsum(np.fromiter(map(len, names), np.int64, n), out=name_at[1:])
    praw = "".join(prefixes).encode()
    prefix_at = np.zeros(len(prefixes) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, prefixes), np.int64, len(prefixes)), out=prefix_at[1:])
    if len(raw) != int(name_at[-1]) or len(praw) != int(prefix_at[-1]):
        return None  # not one byte a character after all
    room = len(raw) + int(np.diff(prefix_at)[codes].sum()) + 47 * n  # quotes, colon, two 19-digit numbers, ",]}" ","
    out = np.empty(room, np.uint8)
    used = k.header_entries(out, np.frombuffer(raw, np.uint8), name_at, np.ascontiguousarray(rank, np.int64),
                            np.frombuffer(praw, np.uint8), prefix_at, np.ascontiguousarray(codes, np.int64),
                            np.ascontiguousarray(starts, np.int64), np.ascontiguousarray(ends, np.int64))
    return out[:used].tobytes()


def _build_header(layout, metadata, align, length, reserve) -> tuple[bytes, dict[str, int]]:
    if not any(k.startswith(DTYPE_META_PREFIX) for k in (metadata or {})):
        got = _build_columns(layout, metadata, align, length, reserve)
        if got is not None:
            return got
    meta = dict(metadata or {})
    infos = {d: dtype_info(d) for d in {d for d, _ in layout.values()}}  # 70k tensors, a few dtypes
    size_of = {d: -i.element_size for d, i in infos.items()}
    names = sorted(layout)
    order = sorted(names, key=lambda n: size_of[layout[n][0]])  # stable: by element size, then name
    entries: dict[str, dict] = {}
    at = 0
    native: dict[tuple, tuple] = {}  # (dtype, shape) -> (tag, stored shape, bytes): layers share shapes
    for name in order:
        dtype, shape = layout[name]
        key = (dtype, shape if type(shape) is tuple else tuple(shape))
        got = native.get(key)
        if got is None:
            got = _entry_of(name, infos[dtype], key[1], meta)
            if got[0] != "U8" or infos[dtype].name == "uint8":
                native[key] = got
        tag, stored, nbytes = got
        entries[name] = {"dtype": tag, "shape": stored, "data_offsets": [at, at + nbytes]}
        at += nbytes
    body = _dumps({"__metadata__": meta, **entries} if meta else entries)
    if length is None:
        length = -(-(8 + len(body) + reserve) // align) * align
    if 8 + len(body) > length:
        raise FormatError(f"a header of {8 + len(body)} bytes does not fit the {length} reserved for it")
    header = _LEN.pack(length - 8) + body + b" " * (length - 8 - len(body))
    # what parse_header makes of these bytes in a buffer of exactly this data (the file about to be written with
    # them: ``subscribe --out``'s new file is mapped right after; its parse was 0.6 s at 70,000 tensors)
    global _LAST_HEADER
    if not all(type(v) is str for v in meta.values()) or any(
            k.startswith(DTYPE_META_PREFIX) for k in (metadata or {})):
        return header, {name: length + e["data_offsets"][0] for name, e in entries.items()}  # parse_header judges it
    make = _entry_at
    _LAST_HEADER = (header[8:], length + at, TensorHeader(
        entries=tuple(make(name, infos[layout[name][0]].name, tuple(layout[name][1]), length + e["data_offsets"][0],
                           length + e["data_offsets"][1])
                      for name, e in entries.items()),
        metadata={k: v for k, v in meta.items()}, data_start=length, size=length + at))
    return header, {name: length + e["data_offsets"][0] for name, e in entries.items()}


def shard_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, *,
                fps: dict[str, int] | None = None, into: bytearray | None = None) -> bytearray | memoryview:
    """Safetensors bytes of ``tensors`` (CPU, e.g. views of a mapped file), built with one copy of the data
    (no intermediate buffers): what :func:`save_shard` returns, laid out by :func:`build_header`.

    ``fps``: filled with each tensor's fingerprint, computed in the same pass as the copy
    (:func:`~deltasync.fingerprint.copy_fingerprint`). ``into``: a reused buffer, grown when too small;
    the shard is then ``memoryview(into)[:size]`` (no fresh allocation and first-touch page faults per
    shard; valid until the caller reuses ``into``); a fresh bytearray when ``into`` is too small."""
    import torch

    from .fingerprint import copy_fingerprint, tensor_fingerprint

    layout = {n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in tensors.items()}
    header, offsets = build_header(layout, metadata)
    total = len(header) + sum(t.numel() * t.element_size() for t in tensors.values())
    out = into if into is not None and len(into) >= total else bytearray(total)
    out[: len(header)] = header
    whole = torch.frombuffer(out, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    with torch.no_grad():
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            src = t.detach().cpu().contiguous()
            if n and fps is not None and offsets[name] % t.element_size() == 0 and src.dtype == t.dtype:
                dst = whole[offsets[name] : offsets[name] + n].view(t.dtype).reshape(src.shape)
                fps[name] = copy_fingerprint(dst, src)
                continue
            if n:
                whole[offsets[name] : offsets[name] + n].copy_(src.reshape(-1).view(torch.uint8))
            if fps is not None:
                fps[name] = tensor_fingerprint(src)
    return out if out is not into else memoryview(out)[:total]
