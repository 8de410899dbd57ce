"""A safetensors file as a subscriber's target, patched in place and crash-safe (``subscribe --out F``).

:class:`FileTarget` is an :class:`~deltasync.client.appliers.Applier` whose tensors are a shared
writable memory map of ``F``'s data (``MappedTensorFile(writable=True)``): a delta is applied by
the core's ``stage_prepared`` straight into the file's pages, so a version costs what its changed
words cost, not a rewrite of the file. The scheme (docs/CLIENT.md, "The --out file"):

* **Layout.** ``F`` is a plain safetensors file laid out by :func:`deltasync.tensorfile.build_header`:
  its ``__metadata__`` comes first and begins with ``deltasync.version``, ``deltasync.state_fp``
  and a space pad sized so that everything after it stays put whatever the version's digits;
  the header is padded to a multiple of 4096 bytes with room to spare, and tensors are ordered
  by element size so every tensor is aligned in the map. Rewriting the version therefore
  changes bytes of the file's first 512-byte sector only, in place.
* **A delta**: (1) the undo journal ``F.journal`` is written and fsynced: the old bytes of every
  region about to change (word positions + old words, whole ranges for dense chunks) and the
  old header, closed by an xxh3-128 digest of all of it; (2) the words are patched in the map
  and verified (the core's incremental fingerprints, then the signed state fingerprint); (3) the
  map is ``msync``-ed; (4) the header is rewritten in place with the new version and ``msync``-ed;
  (5) the journal is removed and the directory fsynced: that removal is the commit point.
* **Recovery** (:func:`recover`, run before anything else opens ``F``): a journal whose digest
  checks is rolled back (old bytes written back, header included, fsync, journal removed): ``F``
  is exactly the old version again. A journal that does not check was cut while being written,
  before ``F`` was touched: it is removed. So a kill at any instant leaves ``F`` one published
  version, never a mix, even if the header write itself were torn (it is journaled too).
* **A keyframe** (the first version, a resync, a layout change) is written into a new file beside
  ``F`` (preallocated, filled through its map tensor by tensor, fingerprints checked, fsynced)
  and renamed over ``F``: again old or new, never a mix; ``F`` is never held twice in memory.

``before_write(version)`` (optional) runs when a verified, decoded version is about to be written
(nothing of it is in the file yet); ``before_commit(version)`` once it is written into the map
(deltas) or the new file (keyframes) and before it becomes final. Programs that embed
``subscribe`` (and the crash tests) use them.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from itertools import repeat
from operator import eq
from pathlib import Path

import numpy as np
import torch
import xxhash

from deltasync import kernels
from deltasync.apply import (CHECK_EVERY, ColumnarPatches, LayoutColumns, PreparedDelta, check_base, layout_lines,
                             stage_prepared, warm_kernels)
from deltasync.atomic import fsync_dir
from deltasync.dtypes import dtype_info, word_sizes_in
from deltasync.errors import BaseMismatchError, FormatError, IntegrityError, StorageError
from deltasync.fingerprint import (
    FingerprintTable,
    NameIndex,
    copy_fingerprint,
    fingerprint_from_lane_sums,
    fp_hex,
    host_lanes_sum,
    lanes_sum,
    StateLines,
    run_lane_sums,
    state_fingerprint,
    tensor_fingerprint,
)
from deltasync.gcpause import gc_paused
from deltasync.kernels.fpkeys import C0
from deltasync.keyframe import copy_state
from deltasync.manifest import record_columns
from deltasync.tensorfile import (MAX_HEADER_BYTES, PATCHING, MappedTensorFile, build_header, entry_names, entry_starts,
                                  header_columns, parse_header)

from .appliers import TensorApplier

log = logging.getLogger("deltasync.client.filetarget")

__all__ = ["META_MODEL", "META_STATE_FP", "META_VERSION", "FileTarget", "KeyframeWriter", "ShardSink", "journal_path",
           "recover"]

META_VERSION = "deltasync.version"
META_STATE_FP = "deltasync.state_fp"
META_PAD = "deltasync.pad"
META_MODEL = "deltasync.model"
ALIGN = 4096  # data start: a page, so every tensor of the map is aligned
RESERVE = 256  # spare header bytes beyond the pad (other metadata may grow by this much)
PAD_WIDTH = 96  # len(version) + len(state_fp) + len(pad) == PAD_WIDTH
MAGIC = b"deltasync-jrnl02"  # rel32 records, regions at recorded offsets (readers take jrnl01 too)
MAGIC_COLUMNS = b"deltasync-jrnl03"  # jrnl02 plus "sparse" groups: a delta's sparse chunks as columns
MAGICS = (MAGIC_COLUMNS, MAGIC, b"deltasync-jrnl01")  # jrnl01: int64 positions, regions back to back
_U64 = struct.Struct("<Q")

Layout = dict[str, tuple[str, tuple[int, ...]]]


def journal_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".journal")


def _meta(model: str, version: int, state_fp: str) -> dict[str, str]:
    pad = PAD_WIDTH - len(str(version)) - len(state_fp)
    if pad < 0:
        raise FormatError(f"version {version} / state fingerprint {state_fp!r} too long for the file header")
    # order matters: the bytes that change per version come first (see the module docstring)
    return {META_VERSION: str(version), META_STATE_FP: state_fp, META_PAD: " " * pad, META_MODEL: model}


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the journal -----------------------------------------------------------------------------------

def _write_journal(path: Path, info: dict, regions: list[dict], payload: list[bytes | memoryview]) -> None:
    head = json.dumps({**info, "regions": regions}, separators=(",", ":")).encode()
    h = xxhash.xxh3_128()
    magic = MAGIC_COLUMNS if "sparse" in info else MAGIC
    try:
        with open(path, "wb") as f:
            for part in (magic, _U64.pack(len(head)), head, *payload):
                f.write(part)
                h.update(part)
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path.parent)
    except OSError as e:
        try:
            path.unlink()
        except OSError:
            pass
        raise StorageError(f"cannot write the undo journal {path} ({e.strerror or e}); the file is untouched") from e


def _read_journal(path: Path) -> tuple[dict, memoryview] | None:
    """(header, payload) of a complete journal; None when it was cut while being written."""
    data = path.read_bytes()
    if len(data) < len(MAGIC) + 8 + 16 or not data.startswith(MAGICS):
        return None
    if xxhash.xxh3_128_digest(data[:-16]) != data[-16:]:
        return None
    (n,) = _U64.unpack_from(data, len(MAGIC))
    at = len(MAGIC) + 8
    try:
        info = json.loads(data[at : at + n])
    except ValueError:
        return None
    return info, memoryview(data)[at + n : -16]


def recover(path: str | os.PathLike) -> dict | None:
    """Roll ``path`` back to the version it held before an unfinished apply, if a journal says so.

    Returns the journal's header (``{"from": v, "to": v, ...}``) when a rollback happened, else None
    (no journal, or one cut before the file was touched: removed). Run it before opening the file."""
    path = Path(path)
    jpath = journal_path(path)
    if not jpath.exists():
        return None
    got = _read_journal(jpath)
    if got is None:
        log.warning("%s: incomplete undo journal (cut while being written, before %s changed); removed", jpath, path)
        jpath.unlink()
        fsync_dir(jpath.parent)
        return None
    info, payload = got
    size = os.stat(path).st_size
    if size != info["size"]:
        raise StorageError(f"{path}: {size} bytes, its undo journal {jpath} was written for {info['size']}; "
                           f"the file was replaced behind the journal's back: remove both and resync")
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE)
        try:
            for group in reversed(info.get("sparse", [])):  # jrnl03: the sparse chunks, as columns
                _restore_columns(mm, size, payload, group, jpath)
            for r, at in reversed(_layout_payload(info["regions"])):
                if r["kind"] == "bytes":
                    mm[r["offset"] : r["offset"] + r["length"]] = payload[at : at + r["length"]]
                    continue
                w, n = r["word"], r["count"]
                if r["kind"] == "rel32":  # uint32 offsets from the chunk's first word, then the old words
                    pos = np.frombuffer(payload, dtype="<u4", count=n, offset=at).astype(np.int64) + r["base"]
                    old = np.frombuffer(payload, dtype=f"<u{w}", count=n, offset=at + _pad8(4 * n))
                else:  # "words": int64 positions (journals of earlier versions)
                    pos = np.frombuffer(payload, dtype="<i8", count=n, offset=at)
                    old = np.frombuffer(payload, dtype=f"<u{w}", count=n, offset=at + 8 * n)
                words = np.frombuffer(mm, dtype=f"<u{w}", count=r["words"], offset=r["offset"])
                words[pos] = old
                del words
            mm.flush()
        finally:
            mm.close()
        os.fsync(fd)
    finally:
        os.close(fd)
    jpath.unlink()
    fsync_dir(jpath.parent)
    log.warning("%s: rolled back the unfinished v%s to v%s (undo journal)", path, info.get("to"), info.get("from"))
    return info


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _columns_bytes(chunks: int, changes: int, word: int) -> int:
    """A jrnl03 sparse group's bytes: int64 rows (tensor's first byte, its words, chunk start, change count), the
    changes' uint32 offsets from their chunk's start, their old words; each part padded to 8 bytes."""
    return 32 * chunks + _pad8(4 * changes) + _pad8(word * changes)


def _restore_columns(mm, size: int, payload: memoryview, group: dict, jpath: Path) -> None:
    """One jrnl03 sparse group's old words written back into the map ``mm`` (its rows checked against the file
    first: a journal that does not fit the file is refused, nothing of the group written)."""
    w, n_chunks, n, at = group["word"], group["chunks"], group["changes"], group["at"]
    rows = np.frombuffer(payload, dtype="<i8", count=4 * n_chunks, offset=at).reshape(n_chunks, 4)
    rel = np.frombuffer(payload, dtype="<u4", count=n, offset=at + 32 * n_chunks)
    old = np.frombuffer(payload, dtype=f"<u{w}", count=n, offset=at + 32 * n_chunks + _pad8(4 * n))
    first, words, start, counts = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
    if (w not in (1, 2, 4, 8) or int(counts.sum()) != n or (counts < 0).any() or (first < 0).any()
            or (first % w).any() or (words < 0).any() or (first + words * w > size).any() or (start < 0).any()):
        raise StorageError(f"{jpath}: a sparse group of the undo journal does not fit the file; remove both and resync")
    idx = rel.astype(np.int64) + np.repeat(start, counts)
    if n and (idx >= np.repeat(words, counts)).any():
        raise StorageError(f"{jpath}: a journaled position leaves its tensor; remove both and resync")
    idx += np.repeat(first // w, counts)
    view = np.frombuffer(mm, dtype=f"<u{w}", count=size // w)
    try:
        kernels.scatter_words(view, idx, old)
    finally:
        del view


def _region_bytes(r: dict) -> int:
    """A region's bytes in the payload (``rel32`` parts padded to 8 bytes, so every array is aligned)."""
    if r["kind"] == "bytes":
        return r["length"]
    if r["kind"] == "rel32":
        return _pad8(4 * r["count"]) + _pad8(r["word"] * r["count"])
    return r["count"] * (8 + r["word"])


def _layout_payload(regions: list[dict]) -> list[tuple[dict, int]]:
    """Each region with the offset of its bytes in the payload: its ``at`` where recorded, else (journals
    of earlier versions) right after the region before."""
    out = []
    at = 0
    for r in regions:
        at = r.get("at", at)
        out.append((r, at))
        at += _region_bytes(r)
    return out


# -- the target ------------------------------------------------------------------------------------

class _JournaledPatch:
    """A delta written into the file's map, its undo journal on disk (see the module docstring)."""

    __slots__ = ("fps", "_target", "_inner", "_version", "_state_fp")

    def __init__(self, target: FileTarget, inner, version: int, state_fp: str) -> None:
        self.fps = inner.fps
        self._target = target
        self._inner = inner
        self._version = version
        self._state_fp = state_fp

    def commit(self) -> None:
        t = self._target
        if t.before_commit is not None:
            t.before_commit(self._version)
        try:
            t.file.flush()
            t._write_meta(self._version, self._state_fp)
        except (OSError, ValueError, FormatError) as e:
            self._inner.rollback()
            t.file.flush()
            recover(t.path)  # the header too, if it was written
            raise StorageError(f"{t.path}: committing v{self._version} failed ({e}); rolled back") from e
        t.version = self._version  # what the header says now (a later rollback restores it, its journal names it)
        self._inner.commit()
        t.end_journal()

    def rollback(self) -> None:
        self._inner.rollback()
        self._target.file.flush()
        self._target._restore_meta()
        self._target.end_journal()


class _NewFile:
    """A keyframe written into a new file beside the target's; ``commit()`` renames it into place."""

    __slots__ = ("fps", "_target", "_tmp", "_file", "_version")

    def __init__(self, target: FileTarget, tmp: Path, file: MappedTensorFile, fps: dict[str, int], version: int) -> None:
        self.fps = fps
        self._target, self._tmp, self._file, self._version = target, tmp, file, version

    def commit(self) -> None:
        t = self._target
        if t.before_commit is not None:
            t.before_commit(self._version)
        try:
            self._file.flush()
            _fsync_path(self._tmp)
            os.replace(self._tmp, t.path)
            fsync_dir(t.path.parent)
        except OSError as e:
            self.rollback()
            raise StorageError(f"{t.path}: writing keyframe v{self._version} failed ({e.strerror or e}); "
                               "the previous file is untouched") from e
        t.swap(self._file)

    def rollback(self) -> None:
        self._file.close()
        try:
            self._tmp.unlink()
        except FileNotFoundError:
            pass


class KeyframeWriter:
    """A keyframe streamed into a new file beside the target's, one shard at a time (the first version
    of ``subscribe --out``), in any order, each tensor's fingerprint checked against the manifest as it
    lands: ``shard_sink(size)`` per blob for ``HttpClient.receive_blob`` (its bytes received straight into
    the file; memory: the shard's header), then ``add_received(sink)``; or ``add_shard(bytes)`` for a shard
    already in memory. ``commit()`` checks the state fingerprint, fsyncs and renames the file into place;
    ``abort()`` removes it."""

    def __init__(self, target: FileTarget, manifest, *, version: int | None = None) -> None:
        if manifest.kind != "keyframe":
            raise FormatError(f"v{manifest.version} is a {manifest.kind}, not a keyframe")
        self.target = target
        self.manifest = manifest
        self.version = manifest.version if version is None else version
        # the manifest's records as columns (a parsed one's table: no record made; ~0.15 s at 70,000 tensors)
        names, dtypes, shapes, self._want = record_columns(manifest)
        with gc_paused():
            self._names, self._dtypes, self._shapes = names, dtypes, shapes
            self._index = dict(zip(names, range(len(names))))
            layout = dict(zip(names, zip(dtypes, shapes)))
        self._layout = layout
        if target._layout is None:  # layout_from_keyframe: this first keyframe lays the file out
            target._layout = dict(layout)
        if layout != target._layout:
            raise BaseMismatchError(f"keyframe v{manifest.version}'s tensors are not those of {target.path}")
        if target.before_write is not None:
            target.before_write(self.version)
        self._tmp, self._file = target._new_file(layout, self.version, manifest.state_fp)
        self._got = np.zeros(len(names), np.uint64)  # each tensor's fingerprint as it landed
        self._have = np.zeros(len(names), np.bool_)  # ... once it has
        # each tensor's first byte in the file, by row (the manifest's order): a shard's tensors are placed by row
        cols = header_columns(self._file.header)
        if cols is not None:
            file_rows = np.fromiter(map(self._index.__getitem__, cols.names), np.int64, len(cols.names))
            self._file_at = np.empty(len(names), np.int64)
            self._file_at[file_rows] = cols.starts
        else:
            at = entry_starts(self._file.header)
            self._file_at = np.fromiter(map(at.__getitem__, names), np.int64, len(names))
        self._fd: int | None = None  # the new file opened for pwrite (received shards), once one arrives
        self._bounce = bytearray(BOUNCE)  # every received shard's bytes pass through it (ShardSink)
        self._scratch = np.empty(BOUNCE // 2, dtype=np.uint16)  # a receive's lanes of a tensor at an odd byte

    @property
    def fps(self) -> dict[str, int]:
        """The fingerprints of the tensors landed so far (each checked against the manifest)."""
        names = self._names
        return {names[i]: fp for i, fp in zip(np.flatnonzero(self._have).tolist(), self._got[self._have].tolist())}

    def _check(self, names: list[str], fps: np.ndarray, idx: np.ndarray | None = None) -> None:
        """Tensors ``names`` (their rows ``idx``, where known) landed with fingerprints ``fps`` (uint64):
        IntegrityError naming the first that is not the manifest's, else kept."""
        if idx is None:
            idx = np.fromiter(map(self._index.__getitem__, names), np.int64, len(names))
        bad = np.flatnonzero(self._want[idx] != fps)
        if bad.size:
            name, fp = names[int(bad[0])], int(fps[int(bad[0])])
            raise IntegrityError(f"{name}: fingerprint {fp_hex(fp)} in {self._tmp}, keyframe v"
                                 f"{self.manifest.version} says {fp_hex(int(self._want[idx[int(bad[0])]]))}")
        self._got[idx] = fps
        self._have[idx] = True

    def _writer_fd(self) -> int:
        if self._fd is None:
            self._fd = os.open(self._tmp, os.O_WRONLY)
        return self._fd

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def add_shard(self, data, *, executor=None) -> None:
        """One shard's tensors copied from ``data`` (its bytes, not copied again) straight into the new
        file's map, each fingerprinted in the same pass (``copy_fingerprint``) and checked against the
        manifest. ``executor``: copy and fingerprint pieces of a tensor on its threads."""
        header = parse_header(data, where=f"keyframe v{self.manifest.version} shard: ")
        raw = np.frombuffer(data, dtype=np.uint8)
        layout = self._layout
        for e in header.entries:
            if layout.get(e.name) != (e.dtype, tuple(e.shape)):
                raise FormatError(f"keyframe v{self.manifest.version}: shard tensor {e.name} {e.dtype} "
                                  f"{tuple(e.shape)} is not in the manifest as such")
            dst = self._file.tensors[e.name]
            fp = copy_fingerprint(dst, raw[e.start : e.stop], executor=executor)  # the bytes as written to the map
            self._check([e.name], np.array([fp], np.uint64))

    @staticmethod
    def warm() -> None:
        """Load the compiled kernels a keyframe's receive runs (the fingerprint's lane sums, both lane widths):
        numba loads each from its cache on first use, ~0.7 s here. Run it while waiting for the first version
        (``subscribe --out`` does, on a thread), so that cost is not paid when the bytes arrive."""
        lanes_sum(torch.zeros(8, dtype=torch.int16), 0)
        lanes_sum(torch.zeros(8, dtype=torch.int8), 0)
        host_lanes_sum(np.frombuffer(bytearray(16), dtype=np.uint16), 0)
        host_lanes_sum(np.frombuffer(bytearray(16), dtype=np.uint8), 0)
        buf, one = np.zeros(16, dtype=np.uint8), np.ones(2, dtype=np.int64)  # the receive's form (ShardSink)
        run_lane_sums(buf, 0, 16, one * 0, one * 16, one, one * 0, np.zeros(2, np.uint64), 0, np.empty(8, np.uint16))

    def shard_sink(self, size: int) -> ShardSink:
        """Where a shard blob of ``size`` bytes is received (``HttpClient.receive_blob``): its header into a small
        buffer, its tensors' bytes straight into their places in the new file's map, fingerprinted as they
        land; then :meth:`add_received` checks them. Memory: the shard's header."""
        return ShardSink(self, size)

    def add_received(self, sink: ShardSink) -> None:
        """A shard received whole into ``sink`` (its blob's hash checked): every tensor's fingerprint
        against the manifest (as columns: a shard of a 70k-tensor state holds ~14k tensors)."""
        names, fps = sink.fingerprint_columns()
        self._check(names, fps, sink.rows)

    def commit(self) -> None:
        missing = np.flatnonzero(~self._have)
        if missing.size:
            raise IntegrityError(f"keyframe v{self.manifest.version}: no shard held "
                                 f"{[self._names[i] for i in missing[:3].tolist()]}")
        lines = StateLines(self._names, self._dtypes, self._shapes)
        sfp = lines.digest(self._got)
        if sfp != self.manifest.state_fp:
            raise IntegrityError(f"keyframe v{self.manifest.version}: state fingerprint {sfp}, the manifest says "
                                 f"{self.manifest.state_fp}")
        self._close_fd()
        fps = dict(zip(self._names, self._got.tolist()))
        _NewFile(self.target, self._tmp, self._file, fps, self.version).commit()
        self.target._written_fps = dict(fps)  # fingerprinted as the bytes landed: the adopt scan's
        if self.target._layout is not None and np.array_equal(lines.order, np.arange(lines.order.size)):
            self.target._lines = (self.target._layout, (self._names, lines))  # the names sorted: its state_lines()

    def abort(self) -> None:
        self._close_fd()
        self._file.close()
        self._tmp.unlink(missing_ok=True)


#: the room a shard's bytes are received into before they are written into the file (stays in a core's L2)
BOUNCE = 1 << 20


class ShardSink:
    """A keyframe shard received into the new file (see :meth:`KeyframeWriter.shard_sink`); a
    ``client.blobrecv.BlobSink``. The shard's safetensors header is parsed and checked against the manifest
    as soon as it is in; each tensor's bytes are then received into one small reused buffer (hot in the
    core's cache: the blob's hashes read them there) and ``pwrite`` into the tensor's place in the file, and
    the lanes received are summed into its fingerprint from that buffer too (a lane cut between two
    receives is carried over to the buffer's start: ``_carry`` bytes). No page of the new file's map is
    touched on the way.

    Why not straight into the map: on tmpfs every first write to a page of a shared map faults and zeroes it
    (~0.47 CPU-s per 512 MiB here, against 0.24 for ``pwrite`` of the same bytes, its copy included), and
    unmapping the touched pages at close costs again (~0.1 s)."""

    def __init__(self, writer: KeyframeWriter, size: int) -> None:
        self._w = writer
        self.size = size
        self._room = BOUNCE
        # one buffer for every shard of the keyframe (they are received side by side, but each receive is
        # taken in, hashed and written before the loop runs the next): it stays in the core's L2, where one
        # per shard (8 MiB) did not; a cut lane's bytes wait in ``_carried`` between receives
        raw = writer._bounce
        self._bounce = memoryview(raw)
        # the fingerprint's lanes over the buffer, as numpy (the compiled sum takes them as they are: a torch
        # view cost a conversion per receive, about as much as the sum itself)
        self._lanes = {1: np.frombuffer(raw, dtype=np.uint8), 2: np.frombuffer(raw, dtype=np.uint16)}
        self.restart()

    def restart(self) -> None:
        self._head = bytearray(8)
        self._need: int | None = None  # 8 + the header's length, once known
        self._names: list[str] | None = None  # the shard's tensors by their first byte, once its header is in
        self.rows: np.ndarray | None = None  # ... and their rows in the manifest
        self._at = 0  # the tensor the next receive starts in
        self._carry = 0  # bytes of a cut lane at the buffer's start (received, written, not yet summed)
        self._carried = b""  # those bytes, kept here while the shared buffer serves other shards

    def buffer(self, offset: int) -> memoryview:
        if self._names is None:
            return memoryview(self._head)[offset:]
        stops, at = self._stops_l, self._at
        while stops[at] <= offset:
            at += 1
        self._at = at
        c = self._carry
        if c:
            self._bounce[:c] = self._carried
        # up to the end of the run of tensors that lie back to back in the file too (a whole shard, as both sides
        # lay tensors out by name): one receive, one pwrite for many small tensors, not one for each
        return self._bounce[c : c + min(self._room - c, self._run_end[at] - offset)]

    def received(self, offset: int, n: int) -> None:
        if self._names is None:
            end = offset + n
            if self._need is None and end >= 8:
                (hlen,) = _U64.unpack_from(self._head, 0)
                if 8 + hlen > self.size or hlen > MAX_HEADER_BYTES:
                    raise FormatError(f"keyframe v{self._w.manifest.version} shard: a header of {hlen} bytes in a "
                                      f"{self.size}-byte shard")
                self._need = 8 + hlen
                head = bytearray(self._need)
                head[:8] = self._head[:8]
                self._head = head
            if self._need is not None and end >= self._need:
                self._plan()
            return
        j = self._at
        c = self._carry
        _pwrite_all(self._w._writer_fd(), self._bounce[c : c + n], self._file_at[j] + offset - self._starts_l[j])
        base = offset - c  # the shard offset of the buffer's first byte: tensor j's first lane not yet summed
        end = offset + n
        # every whole lane the buffer holds, tensor by tensor of the run, summed into their fingerprints
        j = run_lane_sums(self._lanes[1], base, end, self._starts, self._stops, self._lbs, self._done, self._sums, j,
                          self._w._scratch)
        rest = end - (self._starts_l[j] + int(self._done[j]) * self._lbs_l[j])  # bytes of tensor j's next (cut) lane
        self._carried = bytes(self._bounce[end - rest - base : end - base]) if rest else b""
        self._carry = rest
        self._at = j

    def _plan(self) -> None:
        w = self._w
        header = parse_header(self._head, size=self.size, where=f"keyframe v{w.manifest.version} shard: ")
        with gc_paused():  # a shard of a 70k-tensor state: ~14k tensors, done as columns (no entry made)
            cols = header_columns(header)
            if cols is not None:
                names, dtypes, shapes = cols.names, cols.dtypes, cols.shapes
                begin, end = cols.starts, cols.stops
            else:
                entries = header.entries
                names, dtypes, shapes = [e.name for e in entries], [e.dtype for e in entries], [e.shape for e in entries]
                begin = np.fromiter((e.start for e in entries), np.int64, len(entries))
                end = np.fromiter((e.stop for e in entries), np.int64, len(entries))
            # each tensor's row in the manifest (-1: not in it), then its dtype and shape there
            rows = np.fromiter(map(w._index.get, names, repeat(-1)), np.int64, len(names))
            rl = rows.tolist()
            if (rows < 0).any() or not (all(map(eq, map(w._dtypes.__getitem__, rl), dtypes))
                                        and all(map(eq, map(w._shapes.__getitem__, rl), map(tuple, shapes)))):
                layout = w._layout
                i = next(i for i, n in enumerate(names) if layout.get(n) != (dtypes[i], tuple(shapes[i])))
                raise FormatError(f"keyframe v{w.manifest.version}: shard tensor {names[i]} {dtypes[i]} "
                                  f"{tuple(shapes[i])} is not in the manifest as such")
            # the fingerprint's lanes: bytes for 1-byte words, else 16-bit
            lane_bytes = {d: 1 if dtype_info(d).word_size == 1 else 2 for d in set(dtypes)}
            order = np.lexsort((end, begin))  # by first byte in the shard (a header lists them by name)
            ol = order.tolist()
            n = len(ol)
            self._starts = np.append(begin[order], self.size)  # the columns the lane sums run over; a sentinel row
            self._stops = np.append(end[order], self.size + 1)  # (never reached) ends them
            self._lbs = np.append(np.fromiter(map(lane_bytes.__getitem__, dtypes), np.int64, n)[order], 1)
            names = [*map(names.__getitem__, ol), ""]
            self.rows = rows[order]  # the manifest rows of the shard's tensors, by first byte
            file_at = [*w._file_at[self.rows].tolist(), 0]
            self._starts_l, self._stops_l, self._lbs_l = self._starts.tolist(), self._stops.tolist(), self._lbs.tolist()
            self._file_at, self._names = file_at, names
            self._done = np.zeros(n + 1, dtype=np.int64)  # lanes summed
            self._sums = np.zeros(n + 1, dtype=np.uint64)
            # where the run of tensors back to back in shard and file (from each one on) ends
            s_, e_, f_ = self._starts, self._stops, np.array(file_at, dtype=np.int64)
            joined = (s_[1:] == e_[:-1]) & (f_[1:] == f_[:-1] + (e_[:-1] - s_[:-1]))
            joined[-1] = False  # the sentinel joins nothing
            brk = np.flatnonzero(~joined)  # runs end after these tensors
            ends = e_[brk]
            self._run_end = np.append(ends[np.searchsorted(brk, np.arange(n))], e_[-1]).tolist()
        self._at = 0

    def fingerprints(self) -> dict[str, int]:
        """Every tensor's fingerprint, once the whole shard is in."""
        names, fps = self.fingerprint_columns()
        return dict(zip(names, fps.tolist()))

    def fingerprint_columns(self) -> tuple[list[str], np.ndarray]:
        """The shard's tensor names and their fingerprints (uint64), once the whole shard is in."""
        if self._names is None:
            raise IntegrityError(f"keyframe v{self._w.manifest.version}: a shard whose header never arrived")
        lanes = (self._stops[:-1] - self._starts[:-1]) // self._lbs[:-1]
        short = np.flatnonzero(self._done[:-1] != lanes)
        if short.size:
            t = int(short[0])
            raise IntegrityError(f"{self._names[t]}: {int(self._done[t])} of {int(lanes[t])} lanes received")
        return self._names[:-1], self._sums[:-1] + lanes.astype(np.uint64) * np.uint64(C0)  # mod 2**64


def scan_file(f: MappedTensorFile) -> dict[str, int]:
    """Every tensor's fingerprint, read from the mapped file: its tensors as one run of its data, summed by
    :func:`deltasync.fingerprint.run_lane_sums` in one compiled call (~0.1 s for 288 MB, at the memory's pace;
    two threads gained nothing measurable), not tensor by tensor (70k torch views and calls: ~0.55 s). Tensors
    of 2-byte lanes at odd bytes (none in a file this module writes) are fingerprinted one by one."""
    entries = sorted(f.header.entries, key=lambda e: e.start)
    if not entries:
        return {}
    lane = {d: 1 if dtype_info(d).word_size == 1 else 2 for d in {e.dtype for e in entries}}
    with gc_paused():
        starts = np.array([e.start for e in entries] + [f.size], dtype=np.int64)
        stops = np.array([e.stop for e in entries] + [f.size + 1], dtype=np.int64)
        lbs = np.array([lane[e.dtype] for e in entries] + [1], dtype=np.int64)
    if np.any((lbs[:-1] == 2) & (starts[:-1] % 2 == 1)):
        return {e.name: tensor_fingerprint(f.host[e.name]) for e in entries}
    base = int(starts[0]) & ~1  # even: a tensor's lanes are where they are aligned in the file
    data = np.frombuffer(f.buffer(), dtype=np.uint8)[base:]
    done = np.zeros(len(starts), dtype=np.int64)
    sums = np.zeros(len(starts), dtype=np.uint64)
    run_lane_sums(data, base, f.size, starts, stops, lbs, done, sums, 0, np.empty(1, np.uint16))
    lanes = (stops[:-1] - starts[:-1]) // lbs[:-1]
    if np.any(done[:-1] != lanes):
        raise IntegrityError(f"{f.path}: the scan summed {int(done[:-1].sum())} of {int(lanes.sum())} lanes")
    fps = sums[:-1] + lanes.astype(np.uint64) * np.uint64(C0)  # mod 2**64
    return dict(zip([e.name for e in entries], fps.tolist()))


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    while data:
        try:
            k = os.pwrite(fd, data, at)
        except OSError as e:  # our disk, not the source's fault
            raise StorageError(f"cannot write a received keyframe shard into the new file: {e.strerror or e}") from e
        data, at = data[k:], at + k


class FileTarget(TensorApplier):
    """The Applier over a safetensors file (see the module docstring): a ``TensorApplier`` whose
    tensors are the file's map (so ``LiveState`` hands it a keyframe's version, for the header).

    ``FileTarget(path, model, layout=...)``: ``path`` need not exist yet (its first version is a
    keyframe; ``layout`` is the stream's, from its head manifest). An existing file is opened
    writable; one not laid out for in-place writes (written by another tool) is rewritten once.
    ``open_existing=False``: ignore what is at ``path`` (it holds no usable version; the first keyframe
    replaces it). Call :func:`recover` first. ``version``: what the file's header claims (None: not ours).
    """

    _state_fp_before = ""  # the header's state fingerprint while a delta is being written (restored on rollback)

    def __init__(self, path: str | os.PathLike, model: str, *, layout: Layout | None = None,
                 before_commit: Callable[[int], None] | None = None,
                 before_write: Callable[[int], None] | None = None, open_existing: bool = True,
                 layout_from_keyframe: bool = False) -> None:
        # TensorApplier.__init__ is not called: the tensors are the map's, see tensors()
        self.path = Path(path)
        self.model = model
        self.before_commit = before_commit
        self.before_write = before_write
        self.file: MappedTensorFile | None = None
        self.version: int | None = None
        self._written_fps: dict[str, int] | None = None  # see scan()
        self._columns: tuple | None = None  # (file, its tensors as columns): see _table()
        self._lines: tuple | None = None  # (layout, its state fingerprint lines): see state_lines()
        self._layout_cols: tuple | None = None  # (layout, its LayoutColumns): see layout_columns()
        self._name_index: tuple | None = None  # (layout, its NameIndex): see name_index()
        self._scratch_buf: np.ndarray | None = None  # the journal's buffer, kept: see _scratch()
        self._layout = dict(layout) if layout is not None else None
        if open_existing and self.path.exists():
            self._open_existing()
        elif self._layout is None and not layout_from_keyframe:
            raise FormatError(f"{self.path} does not exist and no layout was given to create it")
        # layout_from_keyframe: the file is created by the first keyframe staged, in its layout (a format-3
        # delta names only the tensors it changes, so a stream's head may not say the whole layout)

    # -- opening ---------------------------------------------------------------------------------
    def _open_existing(self) -> None:
        try:
            f = MappedTensorFile(self.path, writable=True)
        except FormatError as e:
            if "cannot be patched in place" not in str(e):
                raise
            f = None
        if f is not None and self._ours(f):
            self._adopt_file(f)
            return
        if f is not None:
            f.close()
        # another layout (another tool's file, an older subscribe's): rewritten once, renamed into place
        with MappedTensorFile(self.path) as src:
            meta = src.metadata
            layout = {n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in src.tensors.items()}
            version, sfp = meta.get(META_VERSION) or "", meta.get(META_STATE_FP) or ""
            if meta.get(META_MODEL) != self.model or not version.isdigit() or len(version) + len(sfp) > PAD_WIDTH:
                if self._layout is None:  # not a version of this stream: its tensors are a layout only
                    self._layout = layout
                return
            tmp, new = self._new_file(layout, int(version), sfp)
            try:
                with torch.no_grad():
                    for n, t in src.tensors.items():
                        new.tensors[n].copy_(t)
                new.flush()
                _fsync_path(tmp)
            except BaseException:
                new.close()
                tmp.unlink(missing_ok=True)
                raise
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        log.info("%s: rewritten once in the in-place layout", self.path)
        self._adopt_file(new)

    def _ours(self, f: MappedTensorFile) -> bool:
        meta = f.metadata
        return (meta.get(META_MODEL) == self.model and (meta.get(META_VERSION) or "").isdigit()
                and META_PAD in meta and f.header.data_start % ALIGN == 0)

    def _adopt_file(self, f: MappedTensorFile) -> None:
        self.file = f
        # from the header: the file's torch views are made when first used (warm(), or the first delta)
        self._layout = {e.name: (e.dtype, e.shape) for e in f.header.entries}
        self.version = int(f.metadata[META_VERSION])

    def _new_file(self, layout: Layout, version: int, state_fp: str) -> tuple[Path, MappedTensorFile]:
        """A preallocated file beside ``path`` (a temp name ``remove_temp_files`` knows), mapped writable."""
        header, offsets = build_header(layout, _meta(self.model, version, state_fp), align=ALIGN, reserve=RESERVE)
        # the data's bytes counted per (dtype, shape): layers share a few (70k tensors: ~0.03 s less than per tensor)
        try:
            kinds = Counter(layout.values())
        except TypeError:  # a shape given as a list
            kinds = Counter((d, tuple(s)) for d, s in layout.values())
        size = len(header) + sum(dtype_info(d).element_size * _numel(s) * k for (d, s), k in kinds.items())
        fd, name = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        tmp = Path(name)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # a disk that cannot hold the version says so now, not mid-receive
            except AttributeError:  # no posix_fallocate (macOS): the writes will tell
                os.ftruncate(fd, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, size)  # a filesystem without fallocate: the writes will tell
            os.pwrite(fd, header, 0)
        except OSError as e:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise StorageError(f"cannot create {tmp} ({size:,} bytes) beside {self.path}: {e.strerror or e}") from e
        os.close(fd)
        return tmp, MappedTensorFile(tmp, writable=True)

    def swap(self, f: MappedTensorFile) -> None:
        """The file renamed into place becomes the target's map."""
        old, self.file = self.file, f
        self.version = int(f.metadata[META_VERSION])
        if self._layout is None:  # created by its first keyframe (layout_from_keyframe)
            self._layout = {e.name: (e.dtype, e.shape) for e in f.header.entries}
        self._written_fps = None
        if old is not None:
            old.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    # -- the Applier protocol ------------------------------------------------------------------------
    @property
    def target(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self.tensors()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.file is None else self.file.tensors

    def layout(self) -> Layout:
        assert self._layout is not None
        return dict(self._layout)

    def _names(self):
        # the file's layout, not its torch views (0.3-0.5 s to make at 70,000 tensors)
        return self._layout if self._layout is not None else super()._names()

    def scan(self) -> dict[str, int]:
        """Every tensor's fingerprint, read from the file; right after a keyframe this target wrote (and
        fingerprinted from the map as it landed), those fingerprints, once, without a second full read."""
        fresh, self._written_fps = getattr(self, "_written_fps", None), None
        if fresh is not None and self.file is not None and fresh.keys() == set(entry_names(self.file.header)):
            return self.fingerprints(fresh)  # (the names from the header: no torch view, 0.5 s at 70,000 tensors)
        if self.file is None:
            return {}
        return self.fingerprints(scan_file(self.file))

    def needed_blobs(self, manifest) -> set[str] | None:
        return None

    def warm(self) -> None:
        """Load the compiled kernels a delta's decode, journal and patch call, for this file's dtypes
        (:func:`deltasync.apply.warm_kernels`, and the journal's gather), and enter the file's pages into its
        map (``MappedTensorFile.prefault``: a step of a 70k-tensor state touches ~70k pages, each a fault on a
        map not yet populated, 0.05-0.25 s of its journal and patch here): run it while nothing arrives
        (``subscribe --out`` does, on a thread), so the first delta costs what later ones do."""
        if self._layout is None:
            return
        dtypes = {d for d, _ in self._layout.values()}
        warm_kernels(dtypes)
        one = np.ones(1, dtype=np.int64)
        for w in sorted({dtype_info(d).word_size for d in dtypes}):
            words = np.zeros(8, dtype=f"<u{w}")
            kernels.journal_gather(words, np.arange(2, dtype=np.int64), 0, 8, np.empty(2, "<u4"),
                                   np.empty(2, words.dtype))
            whole = words.view()
            whole.flags.writeable = False  # as _journal_columns reads the map: through its read-only buffer
            kernels.journal_columns(whole, np.arange(2, dtype=np.int64), one * 0, one * 2, one * 0, one * 8, one * 0,
                                    np.empty(2, "<u4"), np.empty(2, words.dtype))
        # what a delta's stage reads of this file's layout, made once per file (not in the first delta's time)
        if self.file is not None:
            self._table()
        self.state_lines()
        self.layout_columns()
        f = self.file
        if f is not None:
            f.prefault()  # the GIL released: the loop goes on

    def stage_delta(self, prepared: PreparedDelta, fps: Mapping[str, int], *, verify: str) -> _JournaledPatch:
        self._written_fps = None
        if self.file is None:
            raise BaseMismatchError(f"{self.path} holds no version yet; a delta cannot be its first")
        m = prepared.manifest
        fps = self.fingerprints(fps)  # (those this target handed out are already)
        tensors = self.file.views  # made as asked for: a step patched by address asks for few (a file of 70k: 0.5 s)
        check_base(m, tensors, fps, layout=self._layout, state_lines=self.state_lines(),
                   layout_columns=self.layout_columns())  # before any I/O
        if self.before_write is not None:
            self.before_write(m.version)
        if self.check is not None:  # a signal or a deadline: stop before the journal (nothing to roll back)
            self.check()
        info = {"from": self.version, "to": m.version, "size": self.file.size}
        hdr = self._header_bytes(m.version, m.state_fp)
        got = self._journal_columns(prepared.patches, hdr) if type(prepared.patches) is ColumnarPatches else None
        addresses = None
        if got is not None:
            regions, payload, info["sparse"], addresses = got
        else:
            regions, payload = self._journal_payload(prepared, hdr)
        _write_journal(journal_path(self.path), info, regions, [memoryview(payload)])
        try:
            # the header says "patching" until the new version's is written (or the old one restored): a reader
            # that finds F mid-apply, or left so by a kill, refuses it (tensorfile.check_published)
            self._state_fp_before = self.file.metadata.get(META_STATE_FP, "")
            self._write_meta(self.version, PATCHING)
            # the tensors of one mapped file, whose header parse refused overlapping entries: disjoint
            inner = stage_prepared(tensors, prepared, fps, verify=verify, check=self.check, base_checked=True,
                                   disjoint=True, addresses=addresses)
        except BaseException:
            self.file.flush()  # the core restored every word; make that durable before dropping the journal
            self._restore_meta()
            self.end_journal()
            raise
        return _JournaledPatch(self, inner, m.version, m.state_fp)

    def _write_meta(self, version: int, state_fp: str) -> None:
        """Rewrite the header in place with ``version``/``state_fp``: only its metadata (same length: the pad field
        absorbs the difference), else (a header laid out otherwise) all of it (same length: the pad absorbs it)."""
        meta = _meta(self.model, version, state_fp)
        if self.file.write_metadata({**self.file.metadata, **meta}):
            return
        header, _ = build_header(self.layout(), meta, length=self.file.header.data_start)
        self.file.write_header(header)

    def _header_bytes(self, version: int, state_fp: str) -> int:
        """How many of the header's first bytes a delta to ``version``/``state_fp`` may rewrite (what its journal
        keeps): the metadata's (:meth:`_write_meta`: only those, the tensors' entries of a 70k-tensor header, ~8 MB,
        untouched) when every header of the apply (patching, the new version's, the old one's again) fits it in
        place, else the whole header."""
        end = self.file.metadata_end()
        if end is None:
            return self.file.header.data_start
        now = self.file.metadata
        fits = all(len(json.dumps({**now, **_meta(self.model, v, fp)}, separators=(",", ":"))) == len(
            json.dumps(now, separators=(",", ":"))) for v, fp in ((self.version, PATCHING), (version, state_fp),
                                                                  (self.version, now.get(META_STATE_FP, ""))))
        return end if fits else self.file.header.data_start

    def _restore_meta(self) -> None:
        """The header of the version F holds again (after a rollback): from the journal's copy of it."""
        self._write_meta(self.version, self._state_fp_before)

    def _table(self) -> tuple[NameIndex, np.ndarray, np.ndarray, np.ndarray] | None:
        """The file's tensors as columns in the rows of :meth:`name_index`, made once per file: (those rows, first
        byte, bytes, word size); None where the file's tensors are not its layout's (the journal then goes chunk by
        chunk)."""
        got = self._columns
        if got is not None and got[0] is self.file:
            return got[1]
        table = None
        idx = self.name_index()
        cols = header_columns(self.file.header)  # a parsed header's columns: no entry made
        if cols is not None:
            names, dtypes, starts, stops = cols.names, cols.dtypes, cols.starts, cols.stops
        else:
            entries = self.file.header.entries
            names, dtypes = [e.name for e in entries], [e.dtype for e in entries]
            starts = np.fromiter((e.start for e in entries), dtype=np.int64, count=len(entries))
            stops = np.fromiter((e.stop for e in entries), dtype=np.int64, count=len(entries))
        rows = idx.rows(names) if idx is not None and len(idx) == len(names) else None
        if rows is not None:
            sizes = {d: dtype_info(d).word_size for d in set(dtypes)}
            first, nbytes, wsize = (np.empty(len(names), np.int64) for _ in range(3))
            first[rows] = starts
            nbytes[rows] = stops - starts
            wsize[rows] = np.fromiter(map(sizes.__getitem__, dtypes), dtype=np.int64, count=len(dtypes))
            table = (idx, first, nbytes, wsize)
        self._columns = (self.file, table)
        return table

    def layout_columns(self) -> LayoutColumns | None:
        """This file's layout as :class:`~deltasync.apply.LayoutColumns`, made once per layout (None while the file
        holds no version)."""
        idx = self.name_index()
        return None if idx is None else self._per_layout("_layout_cols", lambda layout: LayoutColumns(layout, idx))

    def _scratch(self, n: int) -> np.ndarray:
        """``n`` bytes of a buffer kept for the next delta's journal (a step's is written to disk before its patch
        and not read again): a 70k-tensor step's ~10 MB of fresh pages a step, each a fault, cost more than the
        gather that fills them. One delta is staged at a time (the subscriber's apply lock)."""
        buf = self._scratch_buf
        if buf is None or buf.size < n:
            buf = self._scratch_buf = np.empty(max(n, 2 * (buf.size if buf is not None else 0)), np.uint8)
        return buf[:n]

    def _per_layout(self, slot: str, make):
        """``make(layout)`` of the file's layout, kept in ``slot`` until the layout changes (None: no layout)."""
        layout = self._layout
        got = getattr(self, slot)
        if got is not None and got[0] is layout:
            return got[1]
        if layout is None:
            return None
        made = make(layout)
        setattr(self, slot, (layout, made))
        return made

    def name_index(self) -> NameIndex | None:
        """The layout's names sorted (:meth:`state_lines`' list) and each one's row, made once per layout: the rows
        of the :class:`~deltasync.fingerprint.FingerprintTable` this target keeps its fingerprints in, of its
        file's columns and of its :class:`LayoutColumns` (None while the file holds no version)."""
        lines = self.state_lines()
        return None if lines is None else self._per_layout("_name_index", lambda _: NameIndex(lines[0]))

    def fingerprints(self, fps: Mapping[str, int]) -> Mapping[str, int]:
        """``fps`` as a :class:`~deltasync.fingerprint.FingerprintTable` of this layout (as given where they are
        not exactly its tensors')."""
        idx = self.name_index()
        got = FingerprintTable.of(idx, fps) if idx is not None else None
        return fps if got is None else got

    def state_lines(self) -> tuple[list[str], StateLines] | None:
        """This file's layout's names sorted and its :class:`StateLines` in that order, made once per layout: what
        ``check_base(state_lines=)`` takes and what ``LiveState.state_fp`` hashes the fingerprints after a step
        with (None while the file holds no version)."""
        return self._per_layout("_lines", layout_lines)

    def _journal_columns(self, cols: ColumnarPatches, hdr: int):
        """The undo journal of a delta prepared as columns (jrnl03): per word size, one group of chunk rows, the
        changes' uint32 offsets in their chunks and their old words, gathered by one compiled call over the
        map's words; then the header's first ``hdr`` bytes (:meth:`_header_bytes`). Returns (regions, payload,
        sparse groups, the tensors' addresses for ``stage_prepared``), or None where the columns do not fit this
        scheme (a chunk of more than 2**32 words, a tensor not aligned to its words): the chunk-by-chunk journal
        then. Raises FormatError (nothing written)
        for a chunk or a change outside its tensor or chunk, as :meth:`_journal_payload` does."""
        if self.check is not None:
            self.check()
        everything = cols
        cols, _, rest = everything.pure()  # tensors with a dense or base-conditioned chunk: chunk by chunk
        table = self._table()
        if table is None:
            return None
        index, first, nbytes, wsize = table
        rows = index.rows(cols.names)  # (the step's check_base asked for the same list: remembered)
        if rows is None:
            return None
        if (wsize[rows][cols.tensor] != cols.word_sizes).any():
            return None
        if (first[rows] % wsize[rows]).any() or ((cols.stops - cols.starts) > kernels.REL_MAX).any():
            return None
        groups: list[dict] = []
        plan = []
        total = 0
        for w in word_sizes_in(cols.word_sizes):
            sel = np.flatnonzero(cols.word_sizes == w)
            sel = sel[np.argsort(cols.seg[sel], kind="stable")]  # a run of rows per segment (blob): a call each
            counts = cols.counts[sel]
            n = int(counts.sum())
            groups.append({"word": w, "chunks": int(sel.size), "changes": n, "at": total})
            plan.append((w, sel, counts, n, total))
            total += _columns_bytes(int(sel.size), n, w)
        regions, parts, total = self._plan_chunks([(everything.names[t], everything[everything.names[t]])
                                                   for t in rest], total)
        regions.append({"kind": "bytes", "offset": 0, "length": hdr, "at": total})
        payload = self._scratch(total + hdr)
        whole = np.frombuffer(self.file.buffer(), dtype=np.uint8)
        try:
            for w, sel, counts, n, at in plan:
                t = rows[cols.tensor[sel]]
                starts, stops = cols.starts[sel], cols.stops[sel]
                words = nbytes[t] // w
                out = np.flatnonzero(stops > words)
                if out.size:
                    k = int(out[0])
                    raise FormatError(f"{self.path}: chunk [{int(starts[k])}:{int(stops[k])}] of "
                                      f"{cols.names[int(cols.tensor[sel[k]])]} leaves its {int(words[k])} words")
                table = payload[at : at + 32 * sel.size].view("<i8").reshape(-1, 4)
                table[:, 0] = first[t]
                table[:, 1] = words
                table[:, 2] = starts
                table[:, 3] = counts
                o = at + 32 * sel.size
                rel = payload[o : o + 4 * n].view("<u4")
                old = payload[o + _pad8(4 * n) : o + _pad8(4 * n) + w * n].view(f"<u{w}")
                where, seg, base_word = cols.at[sel], cols.seg[sel], first[t] // w
                cuts = [0, *(np.flatnonzero(np.diff(seg)) + 1).tolist(), sel.size]
                ends = np.cumsum(counts)
                as_words = whole[: whole.size // w * w].view(f"<u{w}")  # the whole file as words
                try:
                    for a, b in zip(cuts[:-1], cuts[1:]):  # one compiled gather per segment (blob) of the changes
                        flat = cols.columns[w][int(seg[a])][0]
                        o0 = int(ends[a] - counts[a])
                        j, k = kernels.journal_columns(as_words, flat, where[a:b], counts[a:b], starts[a:b], stops[a:b],
                                                       base_word[a:b], rel[o0:], old[o0:])
                        if j >= 0:
                            j += a
                            raise FormatError(f"{self.path}: change position {int(flat[int(where[j]) + k])} leaves "
                                              f"its chunk [{int(starts[j])}:{int(stops[j])}] of {int(words[j])} words")
                finally:
                    del as_words
            self._fill_chunks(payload, parts)
            payload[total:] = whole[:hdr]
            base = whole.ctypes.data
        finally:
            del whole

        def addresses(names, first=first, nbytes=nbytes, wsize=wsize, base=base):
            r = index.rows(names)
            if r is None:
                return None
            return base + first[r], nbytes[r] // wsize[r], wsize[r]

        return regions, payload, groups, addresses

    def _journal_payload(self, prepared: PreparedDelta, hdr: int) -> tuple[list[dict], np.ndarray]:
        """The undo journal's regions and payload for ``prepared``, in one buffer: O(changed) in time and
        memory. A sparse chunk's record (``rel32``) is its changes' uint32 offsets from the chunk's first
        word and their old words, both written by one compiled pass (``kernels.journal_gather``, which
        also checks every position lies in its chunk); a dense chunk's, its old bytes; then the header's first
        ``hdr`` bytes (:meth:`_header_bytes`).
        Every region starts 8-byte aligned at its recorded ``at``."""
        regions, parts, total = self._plan_chunks(prepared.patches.items(), 0)
        regions.append({"kind": "bytes", "offset": 0, "length": hdr, "at": total})
        payload = np.empty(total + hdr, dtype=np.uint8)
        self._fill_chunks(payload, parts)
        payload[total:] = np.frombuffer(self.file.buffer()[:hdr], dtype=np.uint8)
        return regions, payload

    def _plan_chunks(self, items, total: int) -> tuple[list[dict], list[tuple], int]:
        """The journal regions of ``items`` ((name, chunks) pairs) from payload offset ``total`` on: (regions,
        (host words, chunk, region) to fill, the payload's end)."""
        regions: list[dict] = []
        if not items:
            return regions, [], total
        host_of = self.file.host  # numpy words viewing the map: no torch view per tensor
        starts = entry_starts(self.file.header)
        parts: list[tuple] = []  # (host words, chunk) in region order
        check = self.check  # a signal or a deadline stops it here too: nothing is written yet
        for i, (name, chunks) in enumerate(items):
            if check is not None and not i % CHECK_EVERY:
                check()
            host = host_of[name].words
            w = host.itemsize
            for k, c in enumerate(chunks):
                if c.pending is not None:  # base-conditioned coding: decode against the file's words, once
                    c = chunks[k] = c.resolve(host[c.start : c.stop])
                if c.stop > host.size or c.start < 0:
                    raise FormatError(f"{self.path}: chunk [{c.start}:{c.stop}] of {name} leaves its {host.size} words")
                if c.dense is not None:
                    r = {"kind": "bytes", "offset": starts[name] + c.start * w, "length": (c.stop - c.start) * w}
                elif c.stop - c.start <= kernels.REL_MAX:
                    r = {"kind": "rel32", "offset": starts[name], "words": host.size, "word": w,
                         "base": c.start, "count": int(c.changes.positions.size)}
                else:  # a chunk of more than 2**32 words: int64 positions
                    r = {"kind": "words", "offset": starts[name], "words": host.size, "word": w,
                         "count": int(c.changes.positions.size)}
                r["at"] = total
                regions.append(r)
                total += _pad8(_region_bytes(r))
                parts.append((host, c, r))
        return regions, parts, total

    def _fill_chunks(self, payload: np.ndarray, parts: list[tuple]) -> None:
        """Each planned chunk's record written into ``payload`` (:meth:`_plan_chunks`)."""
        for host, c, r in parts:
            at = r["at"]
            if r["kind"] == "bytes":
                payload[at : at + r["length"]] = host[c.start : c.stop].view(np.uint8)
                continue
            pos, n = c.changes.positions, r["count"]
            if r["kind"] == "rel32":
                rel = payload[at : at + 4 * n].view("<u4")
                old = payload[at + _pad8(4 * n) : at + _pad8(4 * n) + n * host.itemsize].view(host.dtype)
                bad = kernels.journal_gather(host, pos, c.start, c.stop, rel, old)
                if bad >= 0:
                    raise FormatError(f"{self.path}: change position {int(pos[bad])} leaves its chunk "
                                      f"[{c.start}:{c.stop}] of {host.size} words")
                continue
            if n and (int(pos.min()) < c.start or int(pos.max()) >= c.stop):
                raise FormatError(f"{self.path}: a change position leaves its chunk [{c.start}:{c.stop}]")
            payload[at : at + 8 * n] = np.ascontiguousarray(pos, dtype="<i8").view(np.uint8)
            kernels.gather_words(host, pos, payload[at + 8 * n : at + n * (8 + host.itemsize)].view(host.dtype))

    def stage_keyframe(self, state: Mapping[str, torch.Tensor], fps: Mapping[str, int], *,
                       version: int | None = None) -> _NewFile:
        have = {n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in state.items()}
        if self._layout is None:  # layout_from_keyframe: this first keyframe lays the file out
            self._layout = dict(have)
        if have != self._layout:
            raise BaseMismatchError(
                f"keyframe v{version} has tensors {sorted(set(have) - set(self._layout))[:5]} {self.path} lacks and "
                f"lacks {sorted(set(self._layout) - set(have))[:5]} (or other shapes); is the file the same model?")
        v = -1 if version is None else version
        if self.before_write is not None:
            self.before_write(max(v, 0))
        sfp = state_fingerprint((n, d, s, fps[n]) for n, (d, s) in have.items())
        tmp, new = self._new_file(have, max(v, 0), sfp)
        try:
            got = copy_state(new.tensors, dict(state), dict(fps), version="?" if version is None else version)
        except BaseException:
            new.close()
            tmp.unlink(missing_ok=True)
            raise
        return _NewFile(self, tmp, new, got, max(v, 0))

    def end_journal(self) -> None:
        """Remove the journal (the commit point, or the end of a rollback) and make that durable."""
        try:
            journal_path(self.path).unlink()
        except FileNotFoundError:
            return
        except OSError as e:
            raise StorageError(f"cannot remove the undo journal beside {self.path}: {e.strerror or e}") from e
        fsync_dir(self.path.parent)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

