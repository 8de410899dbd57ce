"""The disk store: content-addressed blobs, committed manifests, squashed catch-up deltas.

Layout under the store directory::

    blobs/ab/ab01...ef        one file per verified blob, named by its id (sharded by prefix)
    tmp/                      partial writes; emptied at every start
    models/<model>/<version:020d>.json   manifests, canonical JSON
    squash/<model>/<from>-<to>.json      squashed catch-up manifests (their blobs live in blobs/)

Every file is written under tmp/, fsynced, renamed into place and its directory
fsynced, so a crash leaves either the old state or the new one, never half a file.
The one exception is a relay's manifests (``durable_manifests=False``): they are
renamed into place without fsync so announcing a version never waits on the disk;
after a power loss a torn one fails to parse at start, is skipped, and is fetched
from the parent again.
A blob is renamed into blobs/ only after its bytes hashed to its id; whatever is in
blobs/ at start is trusted. The store is used from the event loop only; the slow
parts (fsync) run in a worker thread.

Size budget: complete blobs are kept in least-recently-used order. Making room
evicts the oldest blobs that are neither pinned (referenced by the newest
``retention`` versions of a model or by its newest keyframe) nor leased (in use by
a squash build). When everything left is pinned the store goes over budget
rather than refuse data it must serve; ``over_budget`` says so.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import secrets
import time
import shutil
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from deltasync.blob import BLOB_ID_RE, check_blob_id
from deltasync.deltafile import fsync_dir, write_atomic
from deltasync.errors import IntegrityError, NotFoundError
from deltasync.manifest import MODEL_RE, BlobRef, Manifest, parse_manifest

log = logging.getLogger("deltasync.server.store")


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionInfo:
    """What the index keeps in memory about a stored version (the manifest itself stays on disk)."""

    model: str
    version: int
    parent: int | None
    kind: str
    state_fp: str
    state_fp_before: str | None
    blob_bytes: int
    blob_count: int
    manifest_size: int
    etag: str

    def event(self) -> dict:
        return {"model": self.model, "version": self.version, "parent": self.parent, "kind": self.kind,
                "bytes": self.blob_bytes, "blobs": self.blob_count, "state_fp": self.state_fp}


class ModelIndex:
    """The stored versions of one model, in order, and the head (newest announced version)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.infos: dict[int, VersionInfo] = {}
        self.order: list[int] = []
        self.head: int | None = None
        self.newest_keyframe: int | None = None

    def add(self, info: VersionInfo) -> None:
        if info.version not in self.infos:
            bisect.insort(self.order, info.version)
        self.infos[info.version] = info

    def after(self, version: int, *, limit: int) -> list[VersionInfo]:
        """Announced versions newer than ``version``, oldest first (at most ``limit``, the newest ones)."""
        if self.head is None:
            return []
        lo = bisect.bisect_right(self.order, version)
        hi = bisect.bisect_right(self.order, self.head)
        return [self.infos[v] for v in self.order[max(lo, hi - limit):hi]]

    def window(self, retention: int) -> list[int]:
        """The versions whose blobs are pinned: the newest ``retention`` up to head, and the newest keyframe."""
        if self.head is None:
            return []
        hi = bisect.bisect_right(self.order, self.head)
        out = self.order[max(0, hi - retention):hi]
        if self.newest_keyframe is not None and self.newest_keyframe not in out:
            out = [self.newest_keyframe, *out]
        return out


def _write_file_atomically(tmp_dir: Path, final: Path, data: bytes, fsync: bool) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(final, data, tmp_dir=tmp_dir, fsync=fsync)


class PartialBlob:
    """A blob being written to a temp file, hashed as it grows.

    Readers may ``os.sendfile`` from ``fd`` at explicit offsets while it grows (the
    writer's file position is not disturbed). ``commit`` checks the hash and moves the
    file into the store; ``close`` releases the descriptor once nobody reads it.
    """

    def __init__(self, store: DiskStore, blob_id: str) -> None:
        self.id = blob_id
        self._store = store
        self.path = store.tmp_dir / f"{blob_id}.{secrets.token_hex(6)}.part"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._hasher = xxhash.xxh3_128()
        self.written = 0
        self.committed = False
        self._closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        n = len(view)
        while view:
            k = os.write(self.fd, view)
            view = view[k:]
        self._hasher.update(data)
        self.written += n

    def reset(self) -> None:
        """Throw away everything written (after a hash failure) and start over."""
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self._hasher.reset()
        self.written = 0

    def digest(self) -> str:
        return self._hasher.hexdigest()

    def verify(self) -> None:
        found = self.digest()
        if found != self.id:
            raise IntegrityError(f"blob bytes hash to {found}, expected {self.id}; the blob was discarded")

    async def commit(self) -> None:
        """Verify, fsync and rename into the store. Raises IntegrityError on a hash mismatch."""
        self.verify()
        await self._store.adopt(self)
        self.committed = True

    def close(self) -> None:
        """Close the descriptor; an uncommitted file is deleted."""
        if self._closed:
            return
        self._closed = True
        os.close(self.fd)
        if not self.committed:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class DiskStore:
    def __init__(self, root: Path, *, budget: int | None = None, retention: int = 16, fsync: bool = True,
                 durable_manifests: bool = True, on_evict=None) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.model_dir = self.root / "models"
        self.squash_dir = self.root / "squash"
        self.budget = budget
        self.retention = retention
        self.fsync = fsync
        self.durable_manifests = durable_manifests and fsync
        self._on_evict = on_evict
        self._blobs: OrderedDict[str, int] = OrderedDict()  # id -> size, least recently used first
        self._blob_bytes = 0
        self._reserved = 0
        self._pinned: set[str] = set()
        self._leases: dict[str, int] = {}
        self._blob_lists: dict[tuple[str, int], tuple[BlobRef, ...]] = {}
        # When each blob's bytes on disk were last seen to hash to its id (monotonic seconds).
        # Blobs found on disk at start have no entry: they are rehashed before they are first served.
        self._verified: dict[str, float] = {}
        self.verify_ttl = 600.0
        self.models: dict[str, ModelIndex] = {}
        self.over_budget = False

    # -- start ---------------------------------------------------------------------
    def open(self, *, trust_head: bool = True) -> None:
        """Create the layout, drop partial writes, index blobs and manifests (blocking; call once)."""
        for d in (self.blob_dir, self.tmp_dir, self.model_dir, self.squash_dir):
            d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir()
        found: list[tuple[float, str, int]] = []
        for shard in self.blob_dir.iterdir():
            if not shard.is_dir():
                continue
            for f in shard.iterdir():
                if BLOB_ID_RE.match(f.name) and f.name[:2] == shard.name:
                    st = f.stat()
                    found.append((st.st_mtime, f.name, st.st_size))
                else:
                    log.warning("ignoring unexpected file %s in the blob store", f)
        for _, bid, size in sorted(found):
            self._blobs[bid] = size
            self._blob_bytes += size
        for mdir in self.model_dir.iterdir():
            if not (mdir.is_dir() and MODEL_RE.match(mdir.name)):
                continue
            idx = ModelIndex(mdir.name)
            for f in mdir.glob("*.json"):
                try:
                    data = f.read_bytes()
                    m = parse_manifest(data)
                except Exception as e:  # a damaged file must not stop the server; it is reported and skipped
                    log.error("skipping unreadable manifest %s: %s", f, e)
                    continue
                if m.model != idx.model or f.name != _manifest_name(m.version):
                    log.error("skipping misplaced manifest %s", f)
                    continue
                idx.add(_info(m, data))
            if idx.order:
                self.models[idx.model] = idx
                idx.head = idx.order[-1] if trust_head else self._newest_complete(idx)
                idx.newest_keyframe = self._newest_keyframe(idx, idx.head)
        self._repin()
        log.info("store %s: %d blobs (%d bytes), %d models", self.root, len(self._blobs), self._blob_bytes,
                 len(self.models))

    def _newest_complete(self, idx: ModelIndex) -> int | None:
        for v in reversed(idx.order):
            if all(self.has_blob(b.id) for b in self.blob_refs(idx.model, v)):
                return v
        return None

    @staticmethod
    def _newest_keyframe(idx: ModelIndex, head: int | None) -> int | None:
        if head is None:
            return None
        for v in reversed(idx.order[: bisect.bisect_right(idx.order, head)]):
            if idx.infos[v].kind == "keyframe":
                return v
        return None

    # -- blobs ---------------------------------------------------------------------
    def blob_path(self, blob_id: str) -> Path:
        check_blob_id(blob_id)
        return self.blob_dir / blob_id[:2] / blob_id

    def has_blob(self, blob_id: str) -> bool:
        return blob_id in self._blobs

    def blob_size(self, blob_id: str) -> int | None:
        return self._blobs.get(blob_id)

    def touch(self, blob_id: str) -> None:
        if blob_id in self._blobs:
            self._blobs.move_to_end(blob_id)

    def read_blob(self, blob_id: str) -> bytes:
        """Whole blob bytes (blocking; for squash builds in a worker thread)."""
        try:
            return self.blob_path(blob_id).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"blob {blob_id} is not in the store") from None

    def new_partial(self, blob_id: str) -> PartialBlob:
        return PartialBlob(self, check_blob_id(blob_id))

    async def open_partial(self, blob_id: str) -> PartialBlob:
        """``new_partial`` in a worker thread: creating a file can wait on the filesystem journal."""
        check_blob_id(blob_id)
        return await asyncio.to_thread(PartialBlob, self, blob_id)

    @property
    def blob_bytes(self) -> int:
        return self._blob_bytes

    @property
    def blob_count(self) -> int:
        return len(self._blobs)

    @property
    def pinned_bytes(self) -> int:
        return sum(self._blobs.get(b, 0) for b in self._pinned)

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` about to be written and count them as used until ``release``."""
        self.make_room(nbytes)
        self._reserved += nbytes

    def release(self, nbytes: int) -> None:
        self._reserved = max(0, self._reserved - nbytes)

    def make_room(self, nbytes: int) -> None:
        if self.budget is None:
            return
        need = self._blob_bytes + self._reserved + nbytes - self.budget
        if need <= 0:
            self.over_budget = False
            return
        victims: list[str] = []
        freed = 0
        for bid, size in self._blobs.items():
            if freed >= need:
                break
            if bid in self._pinned or bid in self._leases:
                continue
            victims.append(bid)
            freed += size
        for bid in victims:
            self._drop_blob(bid)
        over = freed < need
        if over and not self.over_budget:
            log.warning("cache over budget: %d bytes wanted, everything left is pinned or in use",
                        self._blob_bytes + self._reserved + nbytes)
        self.over_budget = over
        if victims:
            log.info("evicted %d blobs (%d bytes) to stay within %d bytes", len(victims), freed, self.budget)
            if self._on_evict:
                self._on_evict(len(victims), freed)

    def needs_verify(self, blob_id: str) -> bool:
        t = self._verified.get(blob_id)
        return t is None or time.monotonic() - t > self.verify_ttl

    async def verify_cached(self, blob_id: str) -> bool:
        """Rehash a stored blob (off the event loop). A blob whose bytes no longer hash to its id
        (disk corruption, a tampered cache) is dropped so that it is refetched, never served."""
        path = self.blob_path(blob_id)

        def digest() -> str | None:
            h = xxhash.xxh3_128()
            try:
                with open(path, "rb", buffering=0) as f:
                    while chunk := f.read(8 << 20):
                        h.update(chunk)
            except FileNotFoundError:
                return None
            return h.hexdigest()

        found = await asyncio.to_thread(digest)
        if found == blob_id:
            self._verified[blob_id] = time.monotonic()
            return True
        if found is not None and blob_id in self._blobs:
            log.error("blob %s on disk hashes to %s: corrupt, dropped (it will be refetched)", blob_id, found)
            self._drop_blob(blob_id)
        return False

    def _drop_blob(self, blob_id: str) -> None:
        self._verified.pop(blob_id, None)
        size = self._blobs.pop(blob_id)
        self._blob_bytes -= size
        try:
            os.unlink(self.blob_path(blob_id))  # open readers keep their descriptor
        except FileNotFoundError:
            pass

    async def adopt(self, part: PartialBlob) -> None:
        """Move a verified partial blob into place (fsync, rename, fsync dir) and index it."""
        final = self.blob_path(part.id)
        size = part.written

        def work() -> None:
            if self.fsync:
                os.fsync(part.fd)
            final.parent.mkdir(exist_ok=True)
            os.replace(part.path, final)
            if self.fsync:
                fsync_dir(final.parent)

        await asyncio.to_thread(work)
        self._verified[part.id] = time.monotonic()
        if part.id not in self._blobs:
            self._blobs[part.id] = size
            self._blob_bytes += size
        self._blobs.move_to_end(part.id)

    def lease(self, ids: Iterable[str]) -> None:
        for b in ids:
            self._leases[b] = self._leases.get(b, 0) + 1

    def unlease(self, ids: Iterable[str]) -> None:
        for b in ids:
            n = self._leases.get(b, 0) - 1
            if n > 0:
                self._leases[b] = n
            else:
                self._leases.pop(b, None)

    def is_pinned(self, blob_id: str) -> bool:
        return blob_id in self._pinned

    # -- manifests -----------------------------------------------------------------
    def index(self, model: str) -> ModelIndex | None:
        return self.models.get(model)

    def head(self, model: str) -> int | None:
        idx = self.models.get(model)
        return None if idx is None else idx.head

    def info(self, model: str, version: int) -> VersionInfo | None:
        idx = self.models.get(model)
        return None if idx is None else idx.infos.get(version)

    def manifest_path(self, model: str, version: int) -> Path:
        return self.model_dir / model / _manifest_name(version)

    def read_manifest(self, model: str, version: int) -> bytes:
        if self.info(model, version) is None:
            raise NotFoundError(f"{model} v{version} is not stored here")
        return self.manifest_path(model, version).read_bytes()

    def blob_refs(self, model: str, version: int) -> tuple[BlobRef, ...]:
        key = (model, version)
        refs = self._blob_lists.get(key)
        if refs is None:
            refs = parse_manifest(self.read_manifest(model, version)).blobs
            self._blob_lists[key] = refs
        return refs

    async def put_manifest(self, m: Manifest, *, announce: bool) -> VersionInfo:
        """Store a manifest durably; with ``announce``, make it the head (versions only move forward)."""
        data = m.to_json()
        path = self.manifest_path(m.model, m.version)
        # A relay's copy is not fsynced: a torn file fails to parse at start and is fetched again.
        await asyncio.to_thread(_write_file_atomically, self.tmp_dir, path, data, self.durable_manifests)
        idx = self.models.get(m.model)
        if idx is None:
            idx = self.models[m.model] = ModelIndex(m.model)
        info = _info(m, data)
        idx.add(info)
        self._blob_lists[(m.model, m.version)] = m.blobs
        if announce:
            self.announce(m.model, m.version)
        return info

    def announce(self, model: str, version: int) -> bool:
        """Advance the head to a stored version; False if it would not move forward."""
        idx = self.models[model]
        if idx.head is not None and version <= idx.head:
            return False
        idx.head = version
        if idx.infos[version].kind == "keyframe":
            idx.newest_keyframe = version
        self._repin()
        return True

    def _repin(self) -> None:
        pinned: set[str] = set()
        keep: set[tuple[str, int]] = set()
        for idx in self.models.values():
            for v in idx.window(self.retention):
                keep.add((idx.model, v))
                try:
                    pinned.update(b.id for b in self.blob_refs(idx.model, v))
                except (OSError, NotFoundError, ValueError) as e:
                    log.error("cannot read %s v%d to pin its blobs: %s", idx.model, v, e)
        for key in [k for k in self._blob_lists if k not in keep]:
            del self._blob_lists[key]
        self._pinned = pinned

    # -- squashed catch-up deltas --------------------------------------------------
    def squash_path(self, model: str, start: int, end: int) -> Path:
        return self.squash_dir / model / f"{start}-{end}.json"

    def read_squash(self, model: str, start: int, end: int) -> bytes | None:
        try:
            return self.squash_path(model, start, end).read_bytes()
        except FileNotFoundError:
            return None

    async def put_squash(self, model: str, start: int, end: int, data: bytes) -> None:
        await asyncio.to_thread(_write_file_atomically, self.tmp_dir, self.squash_path(model, start, end), data,
                                self.fsync)

    async def put_blob_bytes(self, blob_id: str, data: bytes) -> None:
        """Store a whole blob held in memory (squash output)."""
        if self.has_blob(blob_id):
            self.touch(blob_id)
            return
        self.make_room(len(data))
        part = await self.open_partial(blob_id)
        try:
            part.write(data)
            await part.commit()
        finally:
            part.close()


def _manifest_name(version: int) -> str:
    return f"{version:020d}.json"


def _info(m: Manifest, data: bytes) -> VersionInfo:
    return VersionInfo(model=m.model, version=m.version, parent=m.parent, kind=m.kind, state_fp=m.state_fp,
                       state_fp_before=m.state_fp_before, blob_bytes=m.total_bytes, blob_count=len(m.blobs),
                       manifest_size=len(data), etag=f'"{xxhash.xxh3_64_hexdigest(data)}"')
