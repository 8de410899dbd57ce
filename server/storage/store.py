"""The server's store: the version index, the retention/budget policy and a byte layer, composed.

``IndexedStore`` implements the ``BlobStore`` protocol (blobstore.py) over any
``BlobFiles``: ``DiskStore`` over files (diskfiles.py, the production store, with
``sendfile``), ``MemoryStore`` over dicts (memfiles.py, for tests). What is stored
is answered from memory (versions.py for manifests, retention.py ``BlobLedger`` for
blobs); only bytes go to the byte layer. Whatever the byte layer lists at start is
trusted to be what it claims, except that every blob is rehashed before it is first
served or squashed (``needs_verify``). Used from the event loop only.

Size budget: complete blobs are kept in least-recently-used order. Making room
evicts the oldest blobs that are neither pinned (referenced by the newest
``retention`` versions of a model or by its newest keyframe) nor leased (in use by
a squash build). When everything left is pinned the store goes over budget
rather than refuse data it must serve; ``over_budget`` says so. Every byte kept counts:
blobs, manifests and squashed manifests (``stored_bytes``); a blob that lands, a lease
that ends and a window that moves each make room again, so the store is back within
budget as soon as something can be evicted.

History: a store made with ``prune_history`` (a relay) keeps the manifests of each
model from its floor (retention.py ``manifest_floor``: the oldest version of the
retention window, the newest keyframe whenever that is older; a keyframe of the
model's side stream ``M.kf`` counts as one of ``M``) up to the head, and
deletes older ones with the squashed manifests that start below the floor; asking for
such a version answers 404 (catch up from a keyframe), pulled through from a parent
that still has it (the newest ``STALE_MAX`` such pulls are kept, the oldest deleted).
An origin keeps every manifest (docs/PROTOCOL.md §6.4).

A full disk (ENOSPC below the budget: the budget is larger than the disk): a write
that fails with ``StorageError`` first evicts what retention allows (the oldest
blobs neither pinned nor leased, ``free_space``) and is tried once more; if there
is still no room the error stands and ``storage_error`` says why until a write
succeeds again. Nothing it could not hold is announced; routes.py answers a
relay's children 507 for a version its parent has and it cannot hold, and
``/healthz`` says degraded.

Orphans: a store made with ``orphan_grace`` (an origin) deletes blobs no manifest
references once they are older than the grace: blobs of a publish that never
committed (a publisher or origin killed between the blob uploads and the manifest,
or between a version's commit and its side keyframe's), and squash outputs. It looks
at start and at every manifest commit; the grace outlasts any publish that is still
going to commit them (``ORPHAN_GRACE``, env ``DELTASYNC_ORPHAN_GRACE_S``).
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

from deltasync.blob import check_blob_id
from deltasync.errors import NotFoundError, StorageError
from deltasync.manifest import BlobRef, Manifest, is_side_stream, keyframe_stream, parse_manifest

from .blobstore import BlobFiles, StoredBlob, GrowingBlob, Inventory
from .diskfiles import DiskFiles, DiskPartial
from .memfiles import MemoryFiles
from .retention import BlobLedger, manifest_floor
from .versions import ModelIndex, VersionInfo, version_info

log = logging.getLogger("deltasync.server.store")

#: manifests below a pruning store's floor it keeps after pulling them through again (module docstring)
STALE_MAX = 8

#: bytes freed beyond what a failed write needed when the disk is full (filesystem blocks, temp files)
FULL_DISK_SLACK = 1 << 20

#: seconds an unreferenced blob waits on an origin before it is deleted (module docstring)
ORPHAN_GRACE = float(os.environ.get("DELTASYNC_ORPHAN_GRACE_S", 3600))

PartialBlob = GrowingBlob  # the name older modules import
__all__ = ["DiskStore", "IndexedStore", "MemoryStore", "PartialBlob", "VersionInfo"]


class IndexedStore:
    """``BlobStore`` over a ``BlobFiles`` byte layer (see the module docstring)."""

    def __init__(self, files: BlobFiles, *, budget: int | None = None, retention: int = 16,
                 on_evict: Callable[[int, int], None] | None = None, verify_ttl: float = 600.0,
                 prune_history: bool = False, orphan_grace: float | None = None) -> None:
        self.files = files
        #: why the last write could not be held (the disk is full even after evicting), until one succeeds
        self.storage_error: str | None = None
        if hasattr(files, "on_full"):
            files.on_full = self.free_space  # a blob write that meets ENOSPC evicts and retries once
        # Origins: every blob id a manifest references, and unreferenced blobs with when they were written.
        self.orphan_grace = orphan_grace
        self._refs: set[str] = set()
        self._orphans: dict[str, float] = {}
        self.retention = retention
        self.prune_history = prune_history
        # Squashed manifests kept: (model, from, to) -> size (counted in the ledger's ``meta``).
        self._squashes: dict[tuple[str, int, int], int] = {}
        # Pruning stores: each model's floor at the last prune, and the versions below it pulled through
        # again since (a subscriber walking far back), oldest first, at most STALE_MAX kept.
        self._floors: dict[str, int] = {}
        self._stale: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._ledger = BlobLedger(budget=budget)
        self._on_evict = on_evict
        # Blob refs of the versions that may pin blobs (the retention window and anything above head).
        self._blob_lists: dict[tuple[str, int], tuple[BlobRef, ...]] = {}
        # When each blob's bytes were last seen to hash to its id (monotonic seconds). Blobs found
        # at start have no entry: they are rehashed before they are first served.
        self._verified: dict[str, float] = {}
        self.verify_ttl = verify_ttl
        self.models: dict[str, ModelIndex] = {}
        self.over_budget = False

    @property
    def budget(self) -> int | None:
        return self._ledger.budget

    # -- start -------------------------------------------------------------------------
    async def load(self, *, trust_head: bool = True) -> None:
        self._index(await self.files.scan(), trust_head=trust_head)

    def _index(self, inv: Inventory, *, trust_head: bool) -> None:
        for bid, size in inv.blobs:
            self._ledger.add(bid, size)
        for sm in inv.manifests:
            try:
                m = parse_manifest(sm.data, records=False)
            except Exception as e:  # a damaged file must not stop the server; it is reported and skipped
                log.error("skipping unreadable manifest %s: %s", sm.where, e)
                continue
            if m.model != sm.model or m.version != sm.version:
                log.error("skipping misplaced manifest %s", sm.where)
                continue
            self._add_version(m, sm.data)
        for model, start, end, size in inv.squashes:
            self._squashes[(model, start, end)] = size
            self._ledger.meta += size
        for idx in self.models.values():
            idx.set_head(idx.order[-1] if trust_head else self._newest_complete(idx))
        if self.orphan_grace is not None:
            now = time.time()
            for bid, _ in inv.blobs:
                if bid not in self._refs:
                    self._orphans[bid] = inv.blob_times.get(bid, now)
            self._sweep_orphans()
        self._repin()
        log.info("store: %d blobs (%d bytes), %d models", len(self._ledger), self._ledger.used, len(self.models))

    def _add_version(self, m: Manifest, data: bytes) -> VersionInfo:
        idx = self.models.get(m.model)
        if idx is None:
            idx = self.models[m.model] = ModelIndex(m.model)
        info = version_info(m, data)
        if self.orphan_grace is not None:
            for b in m.blobs:
                self._refs.add(b.id)
                self._orphans.pop(b.id, None)
        old = idx.infos.get(m.version)
        self._ledger.meta += info.manifest_size - (old.manifest_size if old is not None else 0)
        idx.add(info)
        self._blob_lists[(m.model, m.version)] = m.blobs
        return info

    def _newest_complete(self, idx: ModelIndex) -> int | None:
        for v in reversed(idx.order):
            if all(self.has_blob(b.id) for b in self.blob_refs(idx.model, v)):
                return v
        return None

    # -- what is stored ----------------------------------------------------------------
    def index(self, model: str) -> ModelIndex | None:
        return self.models.get(model)

    def head(self, model: str) -> int | None:
        idx = self.models.get(model)
        return None if idx is None else idx.head

    def info(self, model: str, version: int) -> VersionInfo | None:
        idx = self.models.get(model)
        return None if idx is None else idx.infos.get(version)

    def blob_refs(self, model: str, version: int) -> tuple[BlobRef, ...]:
        refs = self._blob_lists.get((model, version))
        if refs is None:
            raise NotFoundError(f"the blob list of {model} v{version} is not held in memory")
        return refs

    def has_blob(self, blob_id: str) -> bool:
        return blob_id in self._ledger

    def blob_size(self, blob_id: str) -> int | None:
        return self._ledger.size(blob_id)

    def touch(self, blob_id: str) -> None:
        self._ledger.touch(blob_id)

    def announce(self, model: str, version: int) -> bool:
        """Advance the head to a stored version; False if it would not move forward."""
        if not self.models[model].announce(version):
            return False
        self._repin()
        return True

    # -- retention and budget ----------------------------------------------------------
    @property
    def blob_bytes(self) -> int:
        return self._ledger.used

    @property
    def blob_count(self) -> int:
        return len(self._ledger)

    @property
    def pinned_bytes(self) -> int:
        return self._ledger.pinned_bytes

    @property
    def stored_bytes(self) -> int:
        return self._ledger.used + self._ledger.meta

    @property
    def manifest_bytes(self) -> int:
        """Bytes of manifests and squashed manifests kept (part of ``stored_bytes``)."""
        return self._ledger.meta

    def is_pinned(self, blob_id: str) -> bool:
        return blob_id in self._ledger.pinned

    def lease(self, ids: Iterable[str]) -> None:
        self._ledger.lease(ids)

    def unlease(self, ids: Iterable[str]) -> None:
        self._ledger.unlease(ids)
        self.make_room(0)  # what the lease protected may go now

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` about to be written and count them as used until ``release``."""
        self.make_room(nbytes)
        self._ledger.reserve(nbytes)

    def release(self, nbytes: int) -> None:
        self._ledger.release(nbytes)

    def make_room(self, nbytes: int, *, keep: str | None = None) -> None:
        plan = self._ledger.plan(nbytes, keep=keep)
        for bid in plan.victims:
            self._drop_blob(bid)
        if plan.over_budget and not self.over_budget:
            log.warning("cache over budget: %d bytes wanted (%d of them manifests), everything left is pinned or "
                        "in use", self._ledger.total + nbytes, self._ledger.meta)
        self.over_budget = plan.over_budget
        if plan.victims:
            log.info("evicted %d blobs (%d bytes) to stay within %d bytes", len(plan.victims), plan.freed,
                     self.budget)
            if self._on_evict:
                self._on_evict(len(plan.victims), plan.freed)

    def free_space(self, nbytes: int) -> int:
        """The disk is full: evict the oldest blobs retention allows (neither pinned nor leased) to free
        ``nbytes`` and some slack, whatever the budget; returns the bytes freed (0: nothing may go)."""
        plan = self._ledger.plan_free(nbytes + FULL_DISK_SLACK)
        for bid in plan.victims:
            self._drop_blob(bid)
        if plan.victims:
            log.warning("disk full: evicted %d blobs (%d bytes) to make room for %d bytes", len(plan.victims),
                        plan.freed, nbytes)
            if self._on_evict:
                self._on_evict(len(plan.victims), plan.freed)
        else:
            log.warning("disk full: %d bytes wanted and every stored blob is pinned or in use", nbytes)
        return plan.freed

    def storage_failed(self, e: StorageError) -> None:
        self.storage_error = str(e)

    async def _write_or_evict(self, write, nbytes: int) -> None:
        """``write()``; on StorageError evict what retention allows and try once more (module docstring)."""
        try:
            await write()
        except StorageError as e:
            if not self.free_space(nbytes):
                self.storage_failed(e)
                raise
            try:
                await write()
            except StorageError as e2:
                self.storage_failed(e2)
                raise
        self.storage_error = None

    def _repin(self) -> None:
        pinned: set[str] = set()
        keep: set[tuple[str, int]] = set()
        for idx in list(self.models.values()):
            side = self._side_keyframe(idx)
            retention = self._retention(idx)
            if self.prune_history:
                self._prune(idx, side, retention)
            for v in idx.window(retention, side_keyframe=side):
                keep.add((idx.model, v))
                refs = self._blob_lists.get((idx.model, v))
                if refs is None:
                    log.error("no blob list in memory for %s v%d: its blobs are not pinned", idx.model, v)
                    continue
                pinned.update(b.id for b in refs)
        for key in [k for k in self._blob_lists if k not in keep and not self._above_head(k)]:
            del self._blob_lists[key]
        for key, refs in self._blob_lists.items():
            if self._above_head(key):  # stored, being fetched, about to be announced: not evicted meanwhile
                pinned.update(b.id for b in refs)
        self._ledger.set_pins(pinned)
        self.make_room(0)

    def _sweep_orphans(self) -> None:
        """Delete unreferenced blobs older than the grace (not while a squash build leases them)."""
        if not self._orphans:
            return
        cutoff = time.time() - self.orphan_grace
        old = [b for b, t in self._orphans.items() if t <= cutoff and not self._ledger.leased(b)]
        for bid in old:
            del self._orphans[bid]
            if bid in self._ledger and bid not in self._refs:
                self._drop_blob(bid)
        if old:
            log.info("deleted %d orphan blobs (referenced by no manifest for %.0f s)", len(old), self.orphan_grace)

    def _forget(self, idx: ModelIndex, version: int) -> None:
        info = idx.remove(version)
        self._ledger.meta -= info.manifest_size if info is not None else 0
        self._blob_lists.pop((idx.model, version), None)
        self._stale.pop((idx.model, version), None)
        self.files.discard_manifest(idx.model, version)

    def _side_keyframe(self, idx: ModelIndex) -> int | None:
        """The newest announced version of ``idx``'s side keyframe stream ``M.kf`` at or below its head: a
        keyframe of ``M`` a subscriber starts from (client/streams.py)."""
        side = self.models.get(keyframe_stream(idx.model))
        if side is None or side.head is None or idx.head is None:
            return None
        at = bisect.bisect_right(side.order, min(side.head, idx.head))
        return side.order[at - 1] if at else None

    def _retention(self, idx: ModelIndex) -> int:
        """How many of a stream's newest versions are kept: ``retention``, but 1 for a side keyframe stream
        ``M.kf`` (every version a keyframe: a subscriber only ever starts from the newest one)."""
        return 1 if is_side_stream(idx.model) else self.retention

    def _prune(self, idx: ModelIndex, side_keyframe: int | None, retention: int) -> None:
        """Delete the manifests (and squashed manifests) of ``idx`` below its floor (module docstring)."""
        floor = manifest_floor(idx.order, head=idx.head, newest_keyframe=idx.keyframe(side_keyframe),
                               retention=retention)
        if floor is None:
            return
        self._floors[idx.model] = floor
        gone = idx.order[: bisect.bisect_left(idx.order, floor)]
        for v in gone:
            self._forget(idx, v)
        for key in [k for k in self._squashes if k[0] == idx.model and k[1] < floor]:
            self._ledger.meta -= self._squashes.pop(key)
            self.files.discard_squash(*key)
        if gone:
            log.debug("%s: pruned %d manifests below v%d", idx.model, len(gone), floor)

    def _above_head(self, key: tuple[str, int]) -> bool:
        head = self.head(key[0])
        return head is None or key[1] > head  # stored, not announced yet: it may join the window

    def drop_blob(self, blob_id: str) -> None:
        """Forget a stored blob that must not be served (it is fetched again when wanted)."""
        if blob_id in self._ledger:
            self._drop_blob(blob_id)

    def _drop_blob(self, blob_id: str) -> None:
        self._verified.pop(blob_id, None)
        self._ledger.drop(blob_id)
        self.files.discard(blob_id)

    # -- blobs -------------------------------------------------------------------------
    async def open_blob(self, blob_id: str) -> StoredBlob | None:
        if blob_id not in self._ledger:
            return None
        reader = await self.files.open_blob(blob_id)
        if reader is not None:
            self._ledger.touch(blob_id)
        return reader

    async def get_blob(self, blob_id: str) -> bytes:
        return await self.files.read_blob(blob_id)

    async def open_partial(self, blob_id: str) -> GrowingBlob:
        return await self.files.open_partial(check_blob_id(blob_id), on_commit=self._adopt)

    async def _adopt(self, part: GrowingBlob) -> None:
        size = part.written
        await self.files.adopt(part)
        self._verified[part.id] = time.monotonic()
        self._ledger.add(part.id, size)
        if self.orphan_grace is not None and part.id not in self._refs:
            self._orphans.setdefault(part.id, time.time())  # until a manifest names it
        self.make_room(0, keep=part.id)  # a blob written without a reservation (an upload) counts at once

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

    def needs_verify(self, blob_id: str) -> bool:
        t = self._verified.get(blob_id)
        return t is None or time.monotonic() - t > self.verify_ttl

    async def verify_cached(self, blob_id: str) -> bool:
        """Rehash a stored blob. A blob whose bytes no longer hash to its id (disk corruption, a
        tampered cache) is dropped so that it is refetched, never served."""
        found = await self.files.digest(blob_id)
        if found == blob_id:
            self._verified[blob_id] = time.monotonic()
            return True
        if found is not None and blob_id in self._ledger:
            log.error("stored blob %s hashes to %s: corrupt, dropped (it will be refetched)", blob_id, found)
            self._drop_blob(blob_id)
        return False

    # -- manifests and squashed deltas -------------------------------------------------
    async def get_manifest(self, model: str, version: int) -> bytes:
        if self.info(model, version) is None:
            raise NotFoundError(f"{model} v{version} is not stored here")
        return await self.files.read_manifest(model, version)

    async def put_manifest(self, m: Manifest, *, announce: bool) -> VersionInfo:
        """Store a manifest (durably, but for a relay's); with ``announce``, make it the head."""
        data = m.to_json()
        await self._write_or_evict(lambda: self.files.write_manifest(m.model, m.version, data), len(data))
        info = self._add_version(m, data)
        if self.orphan_grace is not None:
            self._sweep_orphans()
        if announce:
            self.announce(m.model, m.version)
        elif self._above_head((m.model, m.version)):
            self._repin()  # its blobs are pinned while they arrive
        else:
            if self.prune_history and m.version < self._floors.get(m.model, -1):
                self._stale[(m.model, m.version)] = None  # pulled through below the floor: kept a while
                while len(self._stale) > STALE_MAX:
                    (model, v), _ = self._stale.popitem(last=False)
                    self._forget(self.models[model], v)
            self.make_room(0)
        return info

    async def get_squash(self, model: str, start: int, end: int) -> bytes | None:
        return await self.files.read_squash(model, start, end)

    async def put_squash(self, model: str, start: int, end: int, data: bytes) -> None:
        await self._write_or_evict(lambda: self.files.write_squash(model, start, end, data), len(data))
        key = (model, start, end)
        self._ledger.meta += len(data) - self._squashes.get(key, 0)
        self._squashes[key] = len(data)  # counted; room is made at the next blob or announce


class DiskStore(IndexedStore):
    """The production store: files under ``root`` (diskfiles.py), sent with ``sendfile``.

    Besides the ``BlobStore`` calls it offers blocking ones for start-up and tools:
    ``open`` (index the directory), ``new_partial``, ``read_blob``, ``read_manifest``.
    """

    files: DiskFiles

    def __init__(self, root: Path, *, budget: int | None = None, retention: int = 16, fsync: bool = True,
                 durable_manifests: bool = True, durable_blobs: bool = True,
                 on_evict: Callable[[int, int], None] | None = None,
                 prune_history: bool = False, orphan_grace: float | None = None) -> None:
        super().__init__(DiskFiles(root, fsync=fsync, durable_manifests=durable_manifests,
                                   durable_blobs=durable_blobs), budget=budget,
                         retention=retention, on_evict=on_evict, prune_history=prune_history,
                         orphan_grace=orphan_grace)
        self.root = Path(root)

    def open(self, *, trust_head: bool = True) -> None:
        """Create the layout, drop partial writes, index blobs and manifests (blocking; call once)."""
        self._index(self.files.scan_sync(), trust_head=trust_head)
        log.info("store %s opened", self.root)

    def new_partial(self, blob_id: str) -> DiskPartial:
        return self.files.new_partial(check_blob_id(blob_id), on_commit=self._adopt)

    def read_blob(self, blob_id: str) -> bytes:
        """Whole blob bytes (blocking)."""
        return self.files.read_blob_sync(blob_id)

    def read_manifest(self, model: str, version: int) -> bytes:
        """A stored manifest's bytes (blocking)."""
        if self.info(model, version) is None:
            raise NotFoundError(f"{model} v{version} is not stored here")
        return self.files.read_manifest_sync(model, version)


class MemoryStore(IndexedStore):
    """A store that keeps everything in memory (memfiles.py): for tests; nothing survives a restart."""

    files: MemoryFiles

    def __init__(self, *, budget: int | None = None, retention: int = 16,
                 on_evict: Callable[[int, int], None] | None = None, prune_history: bool = False,
                 orphan_grace: float | None = None) -> None:
        super().__init__(MemoryFiles(), budget=budget, retention=retention, on_evict=on_evict,
                         prune_history=prune_history, orphan_grace=orphan_grace)
