"""A safetensors header's checked columns kept on disk, by the BLAKE3 of its text and the file's size.

A trainer writes every step's checkpoint with the same header, byte for byte; a 70,000-tensor one is ~8 MB of
JSON that takes ~0.1 s to parse and check, in each process that opens one (``publish --base``: every step). The
first process that parses a header of ``MIN_ENTRIES`` entries or more keeps its columns here (names, dtypes,
shapes, byte ranges, metadata: what :class:`~deltasync.tensorfile.HeaderColumns` holds); the next one that meets
the same text in a file of the same size reads them back (~0.015 s, the hash included) instead of parsing.

The directory: ``DELTASYNC_HEADER_CACHE`` (``off`` turns the cache off), else ``$XDG_CACHE_HOME/deltasync/
headers``, else ``~/.cache/deltasync/headers``. An entry is written to a temporary name and renamed into place
(two writers write the same bytes); the newest ``KEEP`` entries are kept. An entry is checked on reading (its
own checksum, its shape, every byte range tiling the data as the parser requires); anything wrong with it, or
with the directory, and the header is parsed as if there were none. Nothing here is trusted beyond what the
parser would have found in the same text: the key is a cryptographic hash of that text.

Beside an entry, ``KEY.lines`` keeps the layout's :class:`~deltasync.fingerprint.StateLines` (the text the state
fingerprint hashes, made in ~0.03 s at 70,000 tensors in every ``publish --base``): :func:`store_lines` by the
first process that makes them for a header kept here, :func:`load_lines` by the next; the caller checks them
against its layout (``StateLines.describes``) before use. Pruning an entry removes its lines.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from itertools import chain
from math import prod
from pathlib import Path

import blake3
import numpy as np
import xxhash

__all__ = ["MIN_ENTRIES", "cache_dir", "key_of", "load", "load_lines", "store", "store_lines"]

MIN_ENTRIES = 4096  # smaller headers parse in a few ms: not kept
KEEP = 8  # entries kept (a training run has one layout; its serving formats a few more)
_MAGIC = b"DSHC\x02"  # 2: shapes kept once per distinct shape (a layer's experts share a few), a code per tensor
_HEAD = struct.Struct("<5sxxxQQQQQQQQ")  # magic, entries, data start, size, the byte lengths of the names, dtype
# names and metadata, the distinct shapes and their dimensions
_SEP = "\x00"  # between names (a name holding one is not kept)
_LINES_MAGIC = b"DSHL\x01"  # an entry's state lines (fingerprint.StateLines), in a file of their own: KEY.lines
_LINES_HEAD = struct.Struct("<5sxxxQQ")  # magic, lines, template bytes


def cache_dir() -> Path | None:
    """Where entries are kept (None: the cache is off)."""
    env = os.environ.get("DELTASYNC_HEADER_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "no", "false") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "deltasync" / "headers"


def _key(text: bytes | memoryview, size: int) -> str:
    return f"{blake3.blake3(text).hexdigest()}-{size}"  # (a cryptographic hash at ~4x SHA-256's pace here)


def key_of(text: bytes | memoryview, size: int) -> str | None:
    """The key :func:`load` gives ``text`` in a file of ``size`` bytes (None: never kept, or the cache off)."""
    if len(text) < 32 * MIN_ENTRIES or cache_dir() is None:
        return None
    return _key(text, size)


def load(text: bytes | memoryview, size: int, data_start: int) -> tuple[str | None, tuple | None]:
    """``(key, columns)``: the entry's key (None: never kept, for a text too short or the cache off) and
    ``(names, dtypes, shapes, starts, stops, metadata)`` kept for this header text in a file of ``size`` bytes
    whose data starts at ``data_start``, or None (none kept, unreadable, or failing any check)."""
    where = cache_dir()
    key = key_of(text, size)  # None: too short to hold MIN_ENTRIES entries (never kept), or the cache off
    if key is None:
        return None, None
    try:
        return key, _unpack(_mapped(where / key), size, data_start)
    except (OSError, ValueError, UnicodeDecodeError, struct.error):
        return key, None


def _mapped(path: Path) -> mmap.mmap:
    """A kept file mapped read-only: its pages are the page cache's, not fresh memory (a 70k-tensor entry is ~4 MB,
    its lines ~7 MB, read in every ``publish --base``). Entries are replaced by a rename, never rewritten in place.
    ValueError for an empty file."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def store(key: str | None, size: int, data_start: int, names: list[str], dtypes: list[str], shapes: list[tuple],
          starts: np.ndarray, stops: np.ndarray, metadata: dict[str, str]) -> bool:
    """Keep a checked header's columns under ``key`` (:func:`load`'s; None: nothing kept). Nothing happens for a
    small header, a name holding ``\x00``, or any error writing: the cache is only a shortcut. True if kept."""
    where = cache_dir()
    if key is None or len(names) < MIN_ENTRIES or where is None:
        return False
    joined = _SEP.join(names)
    if joined.count(_SEP) != len(names) - 1:
        return False
    kinds = list(dict.fromkeys(dtypes))
    code = {d: i for i, d in enumerate(kinds)}
    shape_code = {s: i for i, s in enumerate(dict.fromkeys(map(tuple, shapes)))}
    ranks = np.fromiter(map(len, shape_code), np.uint8, len(shape_code))
    dims = np.fromiter(chain.from_iterable(shape_code), np.int64)
    parts = [joined.encode(), json.dumps(kinds).encode(), json.dumps(metadata).encode(),
             np.fromiter(map(code.__getitem__, dtypes), np.uint8, len(dtypes)).tobytes(),
             np.fromiter(map(shape_code.__getitem__, map(tuple, shapes)), "<u4", len(shapes)).tobytes(),
             ranks.tobytes(), dims.tobytes(), (np.asarray(starts, np.int64) - data_start).tobytes()]
    body = b"".join(parts)
    head = _HEAD.pack(_MAGIC, len(names), data_start, size, len(parts[0]), len(parts[1]), len(parts[2]),
                      len(shape_code), dims.size)
    data = head + body + xxhash.xxh3_64_digest(head + body)
    try:
        where.mkdir(parents=True, exist_ok=True)
        path = where / key
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        _prune(where)
    except OSError:
        return False
    return True


def load_lines(key: str | None, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The state lines kept beside entry ``key`` (:func:`store_lines`): ``(order, hex_at, template)`` of ``n``
    lines, or None (none kept, the cache off, unreadable or not of ``n`` lines; the caller checks them against
    its layout: ``StateLines.describes``)."""
    where = cache_dir()
    if key is None or where is None:
        return None
    try:  # mapped, read-only (StateLines.digest copies its windows of the lines)
        raw = np.frombuffer(_mapped(where / f"{key}.lines"), np.uint8)
    except (OSError, ValueError):
        return None
    if len(raw) < _LINES_HEAD.size + 8 or xxhash.xxh3_64_digest(memoryview(raw)[:-8]) != raw[-8:].tobytes():
        return None
    magic, count, length = _LINES_HEAD.unpack_from(raw)
    if magic != _LINES_MAGIC or count != n or _LINES_HEAD.size + 16 * n + length + 8 != len(raw):
        return None
    at = _LINES_HEAD.size
    order = np.frombuffer(raw, np.int64, n, at)
    hex_at = np.frombuffer(raw, np.int64, n, at + 8 * n)
    template = np.frombuffer(raw, np.uint8, length, at + 16 * n)
    if n and (int(hex_at.min()) < 0 or int(hex_at.max()) + 17 > length):
        return None
    return order, hex_at, template


def store_lines(key: str | None, order: np.ndarray, hex_at: np.ndarray, template: np.ndarray) -> None:
    """Keep a layout's state lines beside its header's entry ``key`` (None, or the cache off: nothing kept;
    an error writing: nothing kept either, the cache is only a shortcut)."""
    where = cache_dir()
    if key is None or where is None or not (where / key).exists():
        return
    order, hex_at = np.asarray(order, "<i8"), np.asarray(hex_at, "<i8")
    body = _LINES_HEAD.pack(_LINES_MAGIC, order.size, template.size) + order.tobytes() + hex_at.tobytes() + \
        np.asarray(template, np.uint8).tobytes()
    try:
        path = where / f"{key}.lines"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(body + xxhash.xxh3_64_digest(body))
        os.replace(tmp, path)
    except OSError:
        pass


def _prune(where: Path) -> None:
    """The newest ``KEEP`` entries kept, each with its lines; lines whose entry is gone removed."""
    files = [p for p in where.iterdir() if not p.name.startswith(".")]
    entries = sorted((p for p in files if not p.name.endswith(".lines")), key=lambda p: p.stat().st_mtime)
    for p in entries[:-KEEP]:
        p.unlink(missing_ok=True)
    kept = {p.name for p in entries[-KEEP:]}
    for p in files:
        if p.name.endswith(".lines") and p.name[: -len(".lines")] not in kept:
            p.unlink(missing_ok=True)


def _unpack(raw: bytes | mmap.mmap, size: int, data_start: int):
    view = memoryview(raw)  # (slices of a view: no copy of the map)
    if len(raw) < _HEAD.size + 8 or xxhash.xxh3_64_digest(view[:-8]) != view[-8:]:
        return None
    magic, n, start, fsize, ln, lk, lm, ns, nd = _HEAD.unpack_from(raw)
    if magic != _MAGIC or start != data_start or fsize != size or 8 * n + 4 * n + ns + 8 * nd > len(raw):
        return None
    at = _HEAD.size
    names = str(view[at : at + ln], "utf-8").split(_SEP)
    at += ln
    kinds = json.loads(bytes(view[at : at + lk]))
    at += lk
    metadata = json.loads(bytes(view[at : at + lm]))
    at += lm
    codes = np.frombuffer(raw, np.uint8, n, at)
    at += n
    scode = np.frombuffer(raw, "<u4", n, at).astype(np.int64)
    at += 4 * n
    ranks = np.frombuffer(raw, np.uint8, ns, at).astype(np.int64)
    at += ns
    dims = np.frombuffer(raw, np.int64, nd, at)
    at += 8 * nd
    begin = np.frombuffer(raw, np.int64, n, at)
    at += 8 * n
    if at != len(raw) - 8 or len(names) != n or int(ranks.sum()) != nd or (n and int(codes.max()) >= len(kinds)) \
            or (n and int(scode.max()) >= ns):
        return None
    if not (isinstance(metadata, dict) and all(type(k) is str and type(v) is str for k, v in metadata.items())):
        return None
    from .dtypes import dtype_info

    infos = [dtype_info(k) for k in kinds]
    esize = np.array([i.element_size for i in infos], np.int64)[codes] if n else np.zeros(0, np.int64)
    if np.any(dims < 0):
        return None
    dl, el = dims.tolist(), [0, *np.cumsum(ranks).tolist()]
    shape_of = [tuple(dl[a:z]) for a, z in zip(el, el[1:])]  # each distinct shape, once
    numel_of = [prod(s) for s in shape_of]
    if any(x >= 1 << 62 for x in numel_of):
        return None
    numel = np.array(numel_of, np.int64)[scode] if n else np.zeros(0, np.int64)
    end = begin + numel * esize
    # the byte ranges tile the data, as the parser requires of the text they were read from
    order = np.argsort(begin, kind="stable")
    b, e = begin[order], end[order]
    if n and (int(b[0]) != 0 or np.any(b[1:] != e[:-1]) or int(e[-1]) != size - data_start):
        return None
    shapes = list(map(shape_of.__getitem__, scode.tolist()))
    names_of = [i.name for i in infos]
    return (names, [names_of[c] for c in codes.tolist()], shapes, begin + data_start, end + data_start, metadata)
