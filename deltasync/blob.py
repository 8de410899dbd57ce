"""The delta blob container: a header of chunk records and one zstd frame per stream.

Layout (docs/FORMAT.md, "blob")::

    magic   8 bytes  b"DSYNCBLB"
    version u32 LE   4 (readers accept 1 to 4; 2 adds the ``ans`` chunk mode and its streams, 3 the
                     base-conditioned ``ansx`` mode: :mod:`deltasync.conditioned`, 4 is 2 with its chunk
                     records as binary columns)
    hlen    u32 LE   length of the header
    header  hlen bytes of UTF-8 JSON: {"streams": {name: [offset, clen, rlen]}, "chunks": [...]}
            (versions 2 and 3: one zstd frame, with its content size, of that JSON; version 4: one zstd frame
            of the streams' JSON and the chunk columns, :func:`pack_chunk_columns`)
    frames  zstd frames; stream offsets count from the first byte after the header

A blob's id is the xxh3-128 of all its bytes, as 32 lowercase hex digits.
Streams are concatenated across the blob's chunks in chunk order, so each stream
kind is compressed once per blob (most tensors are tiny; one frame per tensor
would cost 7-11% more). Word streams (``raw*``, ``dense*``) are byte-plane
shuffled over the whole stream before compression.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from . import fastjson
from .errors import FormatError, IntegrityError
from .zctx import compressor as thread_compressor, decompressor

MAGIC = b"DSYNCBLB"
VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
_PREFIX = struct.Struct("<8sII")
MAX_HEADER = 64 << 20
MAX_STREAM = 1 << 30  # no stream of a blob we write comes near; bounds what a forged header can make us allocate
BLOB_ID_RE = re.compile(r"^[0-9a-f]{32}$")
WORD_STREAMS = {f"{kind}{w}": w for kind in ("raw", "dense") for w in (1, 2, 4, 8)}
V1_BYTE_STREAMS = {"gap", "gapx", "bitmap", "sym", "tok", "ext"}
V2_BYTE_STREAMS = V1_BYTE_STREAMS | {"ans", "ansm"}  # v2: rANS messages (16-bit words, LE) and their tables
# v3: base-conditioned messages and their tables; history-conditioned ones (deltasync.history) and theirs
BYTE_STREAMS = V2_BYTE_STREAMS | {"ansx", "ansxm", "ansh", "anshm"}
STREAMS = BYTE_STREAMS | set(WORD_STREAMS)
_STREAMS_OF = {1: V1_BYTE_STREAMS | set(WORD_STREAMS), 2: V2_BYTE_STREAMS | set(WORD_STREAMS), 3: STREAMS,
               4: {"ans", "ansm"} | set(WORD_STREAMS)}
#: the versions whose chunks are ``ans`` or ``dense`` only, base-free (4: 2's under binary records)
ANS_VERSIONS = (2, 4)
#: version 4's chunk modes, by their code in the ``mode`` column
COLUMN_MODES = ("ans", "dense")
_MODE_CODE = {m: i for i, m in enumerate(COLUMN_MODES)}
#: version 4's integer columns, in the order they are stored
COLUMN_INTS = ("start", "stop", "count", "na", "nr")
_U32 = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class ChunkColumns:
    """A version-4 blob's chunk records as columns, as read (no value checked beyond its type and width: the
    decoder checks them as it does version 2's records): per chunk its tensor name, dtype (an index into
    ``dtype_names``), mode (an index into :data:`COLUMN_MODES`) and ``ints`` (uint64, shape ``(5, n)``: the
    rows of :data:`COLUMN_INTS`)."""

    names: list[str]
    dtype_names: list[str]
    dtype: np.ndarray  # uint8
    mode: np.ndarray  # uint8
    ints: np.ndarray  # uint64 (5, n)

    def __len__(self) -> int:
        return len(self.names)

    def records(self) -> list[dict]:
        """The records as version 2's dicts (keys ``tensor``, ``dtype``, ``mode``, ``start``, ``stop``, ``count``,
        ``na``, ``nr``)."""
        dn = self.dtype_names
        return [{"tensor": t, "dtype": dn[d], "mode": COLUMN_MODES[m], "start": a, "stop": b, "count": c, "na": x,
                 "nr": y}
                for t, d, m, a, b, c, x, y in zip(self.names, self.dtype.tolist(), self.mode.tolist(),
                                                  *self.ints.tolist())]


def newline_joined(items: list[str]) -> bytes | None:
    """``items`` joined by newlines (UTF-8); None where an item holds one (it could not be told apart)."""
    data = "\n".join(items).encode()
    return data if data.count(b"\n") == max(len(items) - 1, 0) else None


def pack_chunk_columns(names: list[str] | bytes | memoryview, dtype_names: list[str], dtype, mode, ints) -> bytes | None:
    """A version-4 blob's chunk block: per chunk its tensor name, dtype (index into ``dtype_names``), mode (index
    into :data:`COLUMN_MODES`) and the five integers of :data:`COLUMN_INTS` (``ints``: shape ``(5, n)``); None
    where a name holds a newline (the caller writes that blob in version 2). ``names`` may be given already
    joined (:func:`newline_joined`'s bytes, or a view of them: not joined again). docs/FORMAT.md §4.6::

        u32 n, u32 k, u32 dlen, dlen bytes: the k dtype names joined by newlines,
        u32 tlen, tlen bytes: the n tensor names joined by newlines,
        u8[n] dtype, u8[n] mode, the 5n integers as little-endian u64 (column after column), byte-plane shuffled
    """
    text = names if isinstance(names, (bytes, memoryview)) else newline_joined(names)
    dtext = newline_joined(dtype_names)
    if text is None or dtext is None:
        return None
    n = np.shape(ints)[-1]  # (5, n): one column a chunk
    cols = np.ascontiguousarray(ints, dtype="<u8").reshape(5, n)
    return b"".join([_U32.pack(n), _U32.pack(len(dtype_names)), _U32.pack(len(dtext)), dtext,
                     _U32.pack(len(text)), text, np.asarray(dtype, np.uint8).tobytes(), np.asarray(mode, np.uint8).tobytes(),
                     shuffle_planes(cols.reshape(-1)).tobytes()])


def chunk_columns_of(records: list[dict]) -> bytes | None:
    """:func:`pack_chunk_columns` of version 2's records (``ans`` and ``dense`` chunks: what
    :class:`BlobWriter` collects); None where one cannot be written in version 4 (a newline in a name)."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in records))
    code = {d: i for i, d in enumerate(dtypes)}
    ints = np.array([[r[k] for r in records] for k in COLUMN_INTS], dtype=np.uint64).reshape(5, len(records))
    return pack_chunk_columns([r["tensor"] for r in records], dtypes, [code[r["dtype"]] for r in records],
                              [_MODE_CODE[r["mode"]] for r in records], ints)


def _read_chunk_columns(data: bytes, at: int) -> ChunkColumns:
    """The chunk block of a version-4 header from byte ``at`` to its end (FormatError on any malformed byte)."""
    end = len(data)

    def u32() -> int:
        nonlocal at
        if at + 4 > end:
            raise FormatError("blob header: its chunk columns are truncated")
        (v,) = _U32.unpack_from(data, at)
        at += 4
        return v

    def text(n: int, what: str) -> list[str]:
        nonlocal at
        size = u32()
        if at + size > end:
            raise FormatError(f"blob header: its {what} are truncated")
        raw = data[at : at + size]
        at += size
        try:
            items = raw.decode().split("\n") if size else []
        except UnicodeDecodeError:
            raise FormatError(f"blob header: its {what} are not UTF-8") from None
        if len(items) != n:
            raise FormatError(f"blob header: {len(items)} {what} where {n} are declared")
        return items

    n, k = u32(), u32()
    dtype_names = text(k, "dtype names")
    names = text(n, "tensor names")
    if end - at != 42 * n:  # u8 dtype, u8 mode, 5 u64
        raise FormatError(f"blob header: its chunk columns hold {end - at} bytes where {n} chunks take {42 * n}")
    raw = np.frombuffer(data, np.uint8, count=42 * n, offset=at)
    dtype, mode = raw[:n], raw[n : 2 * n]
    if n and int(dtype.max()) >= k:
        raise FormatError(f"blob header: a chunk's dtype index is past the blob's {k} dtype names")
    if n and int(mode.max()) >= len(COLUMN_MODES):
        raise FormatError(f"blob header: unknown chunk mode code {int(mode.max())} (blob format version 4 has "
                          f"{', '.join(COLUMN_MODES)})")
    ints = unshuffle_planes(raw[2 * n :], 8, np.dtype("<u8")).reshape(5, n)
    return ChunkColumns(names=names, dtype_names=dtype_names, dtype=dtype, mode=mode, ints=ints)


def blob_id(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def blob_version(data: bytes | bytearray | memoryview) -> int:
    """The format version in a blob's prefix (not validated beyond its length: BlobReader does that)."""
    if len(data) < _PREFIX.size:
        raise FormatError(f"blob of {len(data)} bytes is shorter than its {_PREFIX.size}-byte prefix")
    return _PREFIX.unpack_from(data)[1]


def check_blob_id(text: str) -> str:
    if not isinstance(text, str) or not BLOB_ID_RE.match(text):
        raise FormatError(f"blob id must be 32 lowercase hex digits, found {text!r}")
    return text


def verify_blob(expected_id: str, data: bytes | bytearray | memoryview) -> None:
    found = blob_id(data)
    if found != expected_id:
        raise IntegrityError(f"blob content hashes to {found}, expected {expected_id}; refetch it")


def shuffle_planes(words: np.ndarray) -> np.ndarray:
    """Byte-plane shuffle: all first bytes, then all second bytes, ..."""
    w = words.dtype.itemsize
    if w == 1:
        return words.view(np.uint8)
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, w).T).reshape(-1)


def unshuffle_planes(data: np.ndarray, word_size: int, dtype: np.dtype) -> np.ndarray:
    if data.size % word_size:
        raise FormatError(f"word stream of {data.size} bytes is not a multiple of {word_size}")
    if word_size == 1:
        return data.view(dtype)
    return np.ascontiguousarray(data.reshape(word_size, -1).T).reshape(-1).view(dtype)


def _inflate_header(frame: bytes, dctx: zstandard.ZstdDecompressor) -> bytes:
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise FormatError(f"blob header is not a zstd frame: {e}") from None
    if declared < 0 or declared > MAX_HEADER:
        raise FormatError(f"blob header frame declares {declared} bytes (at most {MAX_HEADER}, content size required)")
    try:
        text = dctx.decompress(frame, max_output_size=declared)
    except zstandard.ZstdError as e:
        raise FormatError(f"blob header does not decompress: {e}") from None
    if len(text) != declared:
        raise FormatError(f"blob header: {len(text)} bytes, its frame says {declared}")
    return text


class BlobWriter:
    """Collects chunk records and their streams, then packs one blob.

    Not thread-safe; build one per worker thread (the zstd context is reused).
    """

    def __init__(self, *, level: int = 1, compressor: zstandard.ZstdCompressor | None = None,
                 version: int = VERSION) -> None:
        if version not in READ_VERSIONS:
            raise ValueError(f"blob format version must be one of {READ_VERSIONS}, got {version}")
        self.version = version
        self._cctx = compressor  # None: this thread's context at ``level``, fetched at each use (zctx)
        self._level = level
        self.reset()

    def reset(self) -> None:
        self.chunks: list[dict] = []
        self._parts: dict[str, list[np.ndarray]] = {}
        self.raw_bytes = 0

    def add_chunk(self, record: dict, streams: dict[str, np.ndarray]) -> int:
        """Append one chunk; returns its index in this blob."""
        for name, arr in streams.items():
            if name not in _STREAMS_OF[self.version]:
                raise ValueError(f"unknown stream {name} (blob format version {self.version})")
            if arr.size:
                self._parts.setdefault(name, []).append(arr)
                self.raw_bytes += arr.nbytes
        self.chunks.append(record)
        return len(self.chunks) - 1

    def append(self, name: str, arr: np.ndarray) -> None:
        """Append to stream ``name`` out of band (a part the caller codes when the blob closes, in
        chunk order); the caller accounts for it in ``raw_bytes``."""
        if name not in STREAMS:
            raise ValueError(f"unknown stream {name}")
        if arr.size:
            self._parts.setdefault(name, []).append(arr)

    def finish(self) -> bytes:
        cctx = self._cctx or thread_compressor(self._level)
        block = chunk_columns_of(self.chunks) if self.version == 4 else None
        if block is not None:
            out = pack_blob(self._parts, block, version=4, cctx=cctx)
        else:  # (version 4 where a name holds a newline: version 2, the same chunks in JSON)
            out = pack_blob(self._parts, json.dumps(self.chunks, separators=(",", ":"), sort_keys=True),
                            version=2 if self.version == 4 else self.version, cctx=cctx)
        self.reset()
        return out


def pack_blob(parts: dict[str, list[np.ndarray]], chunks_json: str | bytes, *, version: int,
              cctx: zstandard.ZstdCompressor) -> bytes:
    """A blob's bytes: ``parts`` (stream name -> its non-empty pieces, in chunk order) compressed a frame a stream,
    under the header of those streams and of the chunk records whose compact, key-sorted JSON array is
    ``chunks_json`` (text, or its ASCII bytes; what :meth:`BlobWriter.finish` writes; ``deltasync.columnar``
    renders the records itself). Version 4: ``chunks_json`` is the records' :func:`pack_chunk_columns` block."""
    frames: list[bytes] = []
    table: dict[str, list[int]] = {}
    offset = 0
    for name in sorted(parts):
        arr = np.concatenate(parts[name]) if len(parts[name]) > 1 else parts[name][0]
        if name in WORD_STREAMS:
            arr = shuffle_planes(arr)
        raw = arr.view(np.uint8).tobytes() if arr.dtype != np.uint8 else arr.tobytes()
        frame = cctx.compress(raw)
        table[name] = [offset, len(frame), len(raw)]
        frames.append(frame)
        offset += len(frame)
    # json.dumps({"streams": table, "chunks": records}, separators=(",", ":"), sort_keys=True), the records given
    streams = json.dumps(table, separators=(",", ":"), sort_keys=True)
    if version == 4:
        sj = streams.encode()
        header = b"".join([_U32.pack(len(sj)), sj, chunks_json])
    elif isinstance(chunks_json, bytes):  # ASCII (json.dumps escapes the rest)
        header = b"".join([b'{"chunks":', chunks_json, b',"streams":', streams.encode(), b"}"])
    else:
        header = ('{"chunks":' + chunks_json + ',"streams":' + streams + "}").encode()
    if version >= 2:
        header = cctx.compress(header)  # per-chunk records repeat names and keys: ~6x smaller
    return b"".join([_PREFIX.pack(MAGIC, version, len(header)), header, *frames])


class BlobReader:
    """Parses a blob and hands out its decompressed streams; malformed input raises FormatError."""

    def __init__(self, data: bytes | bytearray | memoryview, *, dctx: zstandard.ZstdDecompressor | None = None) -> None:
        view = memoryview(data)
        if len(view) < _PREFIX.size:
            raise FormatError(f"blob of {len(view)} bytes is shorter than its {_PREFIX.size}-byte prefix")
        magic, version, hlen = _PREFIX.unpack_from(view)
        if magic != MAGIC:
            raise FormatError(f"not a delta blob: magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version not in READ_VERSIONS:
            raise FormatError(f"blob format version {version} is not supported (this build reads "
                              f"{', '.join(map(str, READ_VERSIONS))}); upgrade deltasync")
        if hlen > MAX_HEADER or _PREFIX.size + hlen > len(view):
            raise FormatError(f"blob header of {hlen} bytes runs past the end ({len(view)} bytes)")
        text = bytes(view[_PREFIX.size : _PREFIX.size + hlen])
        if version >= 2:
            text = _inflate_header(text, dctx or decompressor())
        columns = None
        if version == 4:  # u32 slen, the streams' JSON object, the chunk columns
            if len(text) < 4 or 4 + _U32.unpack_from(text)[0] > len(text):
                raise FormatError("blob header: its streams' JSON runs past its end")
            slen = _U32.unpack_from(text)[0]
            columns = _read_chunk_columns(text, 4 + slen)
            text = text[4 : 4 + slen]
        try:
            header = fastjson.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise FormatError(f"blob header is not JSON: {type(e).__name__}: {e}") from None
        if columns is not None:
            header = {"streams": header, "chunks": []}
        if not isinstance(header, dict) or set(header) != {"streams", "chunks"}:
            raise FormatError("blob header must be an object with exactly 'streams' and 'chunks'")
        streams, chunks = header["streams"], header["chunks"]
        if not isinstance(streams, dict) or not isinstance(chunks, list):
            raise FormatError("blob header: 'streams' must be an object and 'chunks' a list")
        body = view[_PREFIX.size + hlen :]
        end = 0
        spans = []
        for name, entry in streams.items():
            if name not in _STREAMS_OF[version]:
                raise FormatError(f"blob header: unknown stream {name!r} (blob format version {version})")
            if (not isinstance(entry, list) or len(entry) != 3
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_STREAM for x in entry)):
                raise FormatError(f"blob header: stream {name!r} needs [offset, clen, rlen] of non-negative ints")
            off, clen, _ = entry
            if off + clen > len(body):
                raise FormatError(f"blob stream {name!r} runs past the end of the blob (truncated?)")
            end = max(end, off + clen)
            spans.append((off, clen))
        at = 0
        for off, clen in sorted(spans):
            if off != at:
                raise FormatError(f"blob streams must be back to back; found a hole or overlap at byte {at}")
            at = off + clen
        if at != len(body):
            raise FormatError(f"blob has {len(body) - at} trailing bytes after its last stream")
        for c in chunks:
            if not isinstance(c, dict):
                raise FormatError("blob header: every chunk must be an object")
        self.version: int = version
        #: version 4's chunk records as read; None for the other versions (their records: :attr:`chunks`)
        self.columns: ChunkColumns | None = columns
        self._chunks: list[dict] | None = None if columns is not None else chunks
        self._streams = streams
        self._body = body
        self._dctx = dctx  # None: the reading thread's context (zctx), fetched at each use
        self._cache: dict[str, np.ndarray] = {}

    @property
    def chunks(self) -> list[dict]:
        """The chunk records as dicts (version 4's made from its columns on first use)."""
        if self._chunks is None:
            self._chunks = self.columns.records()
        return self._chunks

    @chunks.setter
    def chunks(self, records: list[dict]) -> None:
        """Records replaced (a test's forgery): what is read from now on, version 4's columns dropped."""
        self._chunks, self.columns = records, None

    @property
    def stream_names(self) -> list[str]:
        return list(self._streams)

    def stream(self, name: str, dtype: np.dtype | None = None) -> np.ndarray:
        """A whole stream, decompressed (word streams also unshuffled to ``dtype``)."""
        if name in self._cache:
            return self._cache[name]
        entry = self._streams.get(name)
        if entry is None:
            arr = np.empty(0, dtype=np.uint8)
        else:
            off, clen, rlen = entry
            frame = self._body[off : off + clen]
            try:
                declared = zstandard.frame_content_size(frame)
            except zstandard.ZstdError as e:
                raise FormatError(f"blob stream {name!r} is not a zstd frame: {e}") from None
            if declared != rlen:
                # Our frames always carry their content size; requiring it to match the header means
                # a forged length can never make us allocate more than the frame really holds.
                raise FormatError(f"blob stream {name!r}: frame holds {declared} bytes, header says {rlen}")
            try:
                raw = (self._dctx or decompressor()).decompress(frame, max_output_size=rlen)
            except zstandard.ZstdError as e:
                raise FormatError(f"blob stream {name!r} does not decompress: {e}") from None
            if len(raw) != rlen:
                raise FormatError(f"blob stream {name!r}: {len(raw)} bytes, header says {rlen}")
            arr = np.frombuffer(raw, dtype=np.uint8)
        if name in WORD_STREAMS:
            w = WORD_STREAMS[name]
            arr = unshuffle_planes(arr, w, dtype or np.dtype(f"u{w}"))
        self._cache[name] = arr
        return arr
