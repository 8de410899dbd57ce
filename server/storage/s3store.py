"""The bucket store: an origin whose versions live in an S3-compatible bucket (``--store s3://B/P``).

``S3Files`` is the ``BlobFiles`` byte layer (blobstore.py) over a bucket
(s3objects.py) in the layout of docs/FORMAT.md "Bucket layout"; ``S3Store`` is the
``IndexedStore`` over it, plus what makes origins stateless and replaceable:

* **Blobs first, streaming.** An upload is spooled to a local scratch file (readers
  follow it, and it becomes the local read cache) *and* streamed to
  ``blobs/ab/<id>`` as it arrives, as a multipart upload for large blobs. The upload
  is completed only after the last byte hashed to the id; a bad hash, a cut-short
  body or a dying origin abort it, and an aborted upload leaves nothing visible.
* **The manifest last, conditionally.** A version exists exactly when
  ``models/<model>/<version>.json`` exists. It is written with ``If-None-Match: *``
  after every blob it names is in the bucket, so of two origins committing one
  version exactly one wins; the other's publisher gets ``ChainError`` (409,
  "committed by another origin"). Where the server ignores conditional writes
  (probed at start), origins take turns through a writer lease (bucketlease.py).
  Then ``heads.json`` is moved forward (``If-Match`` read-modify-write where
  supported), which followers poll.
* **Stateless.** At start an origin lists the bucket (blobs, manifests) and serves
  every stored version at once, reading blobs from the bucket as they are asked for
  (sequential ranged GETs, whole-object reads where ranges are ignored) with a local
  read cache of ``cache_size`` bytes; nothing is copied to local disk first. Before
  every commit, and every ``poll_interval`` seconds, it loads versions other origins
  committed (and announces them to its event streams), and it looks up in the bucket
  blobs another origin received.
* **Crash consistency.** An origin killed mid-publish leaves complete blobs, possibly
  no manifest naming them, never a manifest naming a missing blob. Orphaned blobs
  (named by no manifest, older than ``gc_grace``) are deleted by ``sweep_orphans``
  every ``gc_interval`` (docs/FORMAT.md, "Garbage collection").
* Blobs in the bucket are not rehashed before they are served (that would double
  every GET): relays and subscribers hash every blob they receive, and the local
  cache holds only bytes that hashed to their id when they were written.
* Squashed catch-up deltas are a local cache of each origin (squash/ in the scratch
  directory): cheap to rebuild, not worth a bucket round trip.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

import xxhash

from deltasync.errors import (
    ChainError, DeltaSyncError, IntegrityError, NotFoundError, StorageError, UnsupportedError,
)
from deltasync.manifest import Manifest, parse_manifest

from .blobstore import Inventory, StoredManifest
from .bucketlayout import (
    BLOBS,
    HEADS,
    MARKER,
    MARKER_BODY,
    MODELS,
    HeadEntry,
    blob_key,
    decode_heads,
    encode_heads,
    manifest_key,
    merge_heads,
    model_prefix,
    parse_blob_key,
    parse_manifest_key,
)
from .bucketlease import WriterLease
from .bucketwatch import HeadsWatcher
from .diskfiles import DiskFiles, DiskPartial, DiskReader
from deltasync.errors import UnavailableError
from .s3objects import Bucket, ObjectInfo
from .store import IndexedStore
from .versions import ModelIndex, VersionInfo, version_info

log = logging.getLogger("deltasync.server.s3store")

PIECE = 1 << 20
SCAN_CONCURRENCY = 16


class CommitConflictError(ChainError):
    """Another origin committed this version to the bucket first (409)."""


# -- growing blobs ---------------------------------------------------------------------------

class _Aborted(Exception):
    pass


class S3Partial:
    """An upload in progress: spooled to a local file (readable, ``FileBacked``) and streamed to
    the bucket at the same time; the bucket upload completes only if the bytes hash to the id."""

    def __init__(self, files: S3Files, spool: DiskPartial, on_commit) -> None:
        self.id = spool.id
        self.spool = spool
        self.committed = False
        self._files = files
        self._on_commit = on_commit
        self._grew = asyncio.Event()
        self._finished = False
        self._aborted = False
        self._upload = self._start_upload()

    @property
    def written(self) -> int:
        return self.spool.written

    def fileno(self) -> int:
        return self.spool.fd

    def _start_upload(self) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(
            self._files.bucket.put_stream(blob_key(self.id), self._pieces()), name=f"s3-put-{self.id}")
        task.add_done_callback(_consume)
        return task

    async def _pieces(self) -> AsyncIterator[bytes]:
        pos = 0
        while True:
            if self._aborted:
                raise _Aborted(f"upload of blob {self.id} abandoned")
            left = self.spool.written - pos
            if left > 0:
                data = os.pread(self.spool.fd, min(left, PIECE), pos)
                pos += len(data)
                yield data
                continue
            if self._finished:
                if self.spool.digest() != self.id:  # never complete an upload whose bytes are wrong
                    raise IntegrityError(f"blob bytes hash to {self.spool.digest()}, expected {self.id}")
                return
            self._grew.clear()
            await self._grew.wait()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.spool.write(data)
        self._grew.set()

    def reset(self) -> None:
        self._abandon()
        self.spool.reset()
        self._aborted = False
        self._finished = False
        self._upload = self._start_upload()

    def digest(self) -> str:
        return self.spool.digest()

    def verify(self) -> None:
        self.spool.verify()

    async def read(self, offset: int, n: int) -> bytes:
        return await self.spool.read(offset, n)

    async def commit(self) -> None:
        """Verify, finish the bucket upload (StorageError if the bucket refuses it), then index it."""
        self.verify()
        self._finished = True
        self._grew.set()
        await self._upload
        await self._on_commit(self)
        self.committed = True

    def _abandon(self) -> None:
        if not self._upload.done():
            self._aborted = True
            self._grew.set()

    def close(self) -> None:
        if not self.committed:
            self._abandon()
        self.spool.close()


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # an abandoned upload's error is expected; commit() re-raises real ones


# -- reading blobs from the bucket --------------------------------------------------------------

class S3Reader:
    """Sequential reads of one bucket object through one streaming GET (reopened at a new
    offset only if a read is not where the previous one ended)."""

    def __init__(self, bucket: Bucket, key: str, size: int, pieces: AsyncIterator[bytes]) -> None:
        self.size = size
        self._bucket = bucket
        self._key = key
        self._pieces: AsyncIterator[bytes] | None = pieces
        self._pos = 0
        self._buf = b""

    async def read(self, offset: int, n: int) -> bytes:
        if offset >= self.size or n <= 0:
            return b""
        if offset != self._pos or self._pieces is None:
            await self._reopen(offset)
        out = bytearray(self._buf[:n])
        self._buf = self._buf[n:]
        while len(out) < n:
            try:
                piece = await self._pieces.__anext__()
            except StopAsyncIteration:
                break
            need = n - len(out)
            out += piece[:need]
            self._buf = piece[need:]
        self._pos = offset + len(out)
        return bytes(out)

    async def _reopen(self, offset: int) -> None:
        self._close_stream()
        opened = await self._bucket.open_stream(self._key, offset)
        if opened is None:
            raise NotFoundError(f"{self._key} vanished from the bucket {self._bucket.where}")
        self._pieces, self._buf, self._pos = opened[1], b"", offset

    def _close_stream(self) -> None:
        if self._pieces is not None:
            pieces, self._pieces = self._pieces, None
            asyncio.get_running_loop().create_task(pieces.aclose())

    def close(self) -> None:
        try:
            self._close_stream()
        except RuntimeError:  # no running loop: nothing to close politely
            self._pieces = None


# -- the byte layer -----------------------------------------------------------------------------

class S3Files:
    """``BlobFiles`` over a bucket, with a local scratch directory for uploads in flight, the read
    cache (``cache_size`` bytes of blobs, least recently used out first) and squashed deltas."""

    def __init__(self, bucket: Bucket, scratch: Path, *, cache_size: int = 1 << 30,
                 conditional: bool | None = None, lease_ttl: float = 30.0) -> None:
        self.bucket = bucket
        self.local = DiskFiles(scratch, fsync=False, durable_manifests=False)
        self.cache_size = cache_size
        self.conditional = conditional  # None: probe at start
        self.lease_ttl = lease_ttl
        self.lease: WriterLease | None = None
        self._take_over: asyncio.Task | None = None  # standby: waiting for the writer lease
        self._cached: OrderedDict[str, int] = OrderedDict()
        self._cached_bytes = 0
        self._manifests: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    # -- start ------------------------------------------------------------------------------
    async def scan(self) -> Inventory:
        """Check the marker, probe conditional writes (taking the lease without them), empty the
        local scratch directory, and list blobs and manifests."""
        await self._check_marker()
        if self.conditional is None:
            self.conditional = await self.bucket.probe_conditional_create()
        if self.conditional:
            log.info("bucket %s honours conditional writes: any number of origins may share it", self.bucket.where)
        else:
            log.warning("bucket %s does not honour conditional writes (If-None-Match): one origin at a time, "
                        "through the writer lease", self.bucket.where)
            self.lease = WriterLease(self.bucket, ttl=self.lease_ttl, settle=min(0.5, self.lease_ttl / 6))
            held = await self.lease.try_acquire()
            if held is not None:  # start on standby: serve reads now, take over writes when the lease ends
                log.warning("standby: %s", self.lease.held_message(held))
                self._take_over = asyncio.get_running_loop().create_task(self._wait_for_lease(), name="lease-standby")
        await asyncio.to_thread(self._reset_scratch)
        blobs = await self.list_blobs()
        listed = [(mv, o) for o in await self.bucket.list(MODELS) if (mv := parse_manifest_key(o.key)) is not None]
        manifests = await self._get_manifests([mv for mv, _ in listed])
        log.info("bucket %s: %d blobs, %d manifests", self.bucket.where, len(blobs), len(manifests))
        return Inventory(blobs=tuple((bid, o.size) for bid, o in sorted(blobs.items(), key=lambda kv: kv[1].modified)),
                         manifests=tuple(manifests))

    async def _wait_for_lease(self) -> None:
        assert self.lease is not None
        await self.lease.acquire()
        log.warning("standby over: this origin took the writer lease of %s and accepts writes", self.bucket.where)

    def writer_status(self) -> dict | None:
        """For /healthz: None on a bucket with conditional writes (every origin writes); else the lease's
        state, ``standby`` (another origin holds it; reads only) or ``holding``."""
        if self.lease is None:
            return None
        if not self.lease.standby:
            return {"lease": "holding", "holder": self.lease.holder}
        cur = self.lease.held_by
        return {"lease": "standby", "holder": None if cur is None else cur.holder,
                "expires_in": None if cur is None else round(max(0.0, cur.expires - self.lease.clock()), 1)}

    async def _check_marker(self) -> None:
        data = await self.bucket.get(MARKER)
        if data is None:
            await self.bucket.put(MARKER, MARKER_BODY, create=True)
        elif data.strip() != MARKER_BODY.strip():
            raise UnsupportedError(f"{self.bucket.where} holds {MARKER} {data[:200]!r}, not a version 1 deltasync "
                                   "bucket; use another prefix or a deltasync that reads it")

    def _reset_scratch(self) -> None:
        shutil.rmtree(self.local.root, ignore_errors=True)
        self.local.scan_sync()  # creates the layout

    async def list_blobs(self) -> dict[str, ObjectInfo]:
        out: dict[str, ObjectInfo] = {}
        for o in await self.bucket.list(BLOBS):
            bid = parse_blob_key(o.key)
            if bid is not None:
                out[bid] = o
        return out

    async def _get_manifests(self, keys: Iterable[tuple[str, int]]) -> list[StoredManifest]:
        sem = asyncio.Semaphore(SCAN_CONCURRENCY)

        async def one(model: str, version: int) -> StoredManifest | None:
            async with sem:
                data = await self.bucket.get(manifest_key(model, version))
            if data is None:
                return None
            self._remember(model, version, data)
            return StoredManifest(model=model, version=version, data=data,
                                  where=f"{self.bucket.where}/{manifest_key(model, version)}")
        found = await asyncio.gather(*(one(m, v) for m, v in keys))
        return [f for f in found if f is not None]

    # -- blobs --------------------------------------------------------------------------------
    async def open_partial(self, blob_id: str, *, on_commit) -> S3Partial:
        if self.lease is not None:
            self.lease.refuse_writes()  # on standby: 503 naming the holder
        spool = await self.local.open_partial(blob_id, on_commit=None)
        return S3Partial(self, spool, on_commit)

    async def adopt(self, part: S3Partial) -> None:
        """The bucket upload is complete (``commit``); keep the spool file as the cached copy."""
        await self.local.adopt(part.spool)
        part.spool.committed = True  # the file now lives in the cache: closing the spool keeps it
        self._cache_add(part.id, part.written)

    def _cache_add(self, blob_id: str, size: int) -> None:
        if blob_id in self._cached:
            self._cached.move_to_end(blob_id)
            return
        self._cached[blob_id] = size
        self._cached_bytes += size
        while self._cached_bytes > self.cache_size and len(self._cached) > 1:
            old, n = self._cached.popitem(last=False)
            self._cached_bytes -= n
            self.local.discard(old)  # open readers keep their descriptor

    async def open_blob(self, blob_id: str) -> DiskReader | S3Reader | None:
        if blob_id in self._cached:
            reader = await self.local.open_blob(blob_id)
            if reader is not None:
                self._cached.move_to_end(blob_id)
                return reader
            self._cached_bytes -= self._cached.pop(blob_id)
        opened = await self.bucket.open_stream(blob_key(blob_id), 0)
        if opened is None:
            return None
        return S3Reader(self.bucket, blob_key(blob_id), opened[0], opened[1])

    async def read_blob(self, blob_id: str) -> bytes:
        if blob_id in self._cached:
            try:
                return await self.local.read_blob(blob_id)
            except NotFoundError:
                pass
        data = await self.bucket.get(blob_key(blob_id))
        if data is None:
            raise NotFoundError(f"blob {blob_id} is not in the bucket {self.bucket.where}")
        return data

    async def digest(self, blob_id: str) -> str | None:
        opened = await self.bucket.open_stream(blob_key(blob_id), 0)
        if opened is None:
            return None
        h = xxhash.xxh3_128()
        async for piece in opened[1]:
            h.update(piece)
        return h.hexdigest()

    async def blob_size(self, blob_id: str) -> int | None:
        return await self.bucket.head(blob_key(blob_id))

    def discard(self, blob_id: str) -> None:
        """Delete a blob from the bucket (in the background) and from the local cache."""
        if blob_id in self._cached:
            self._cached_bytes -= self._cached.pop(blob_id)
            self.local.discard(blob_id)
        self._spawn(self._delete(blob_key(blob_id)))

    async def _delete(self, key: str) -> None:
        try:
            await self.bucket.delete(key)
        except DeltaSyncError as e:
            log.warning("could not delete %s: %s (the orphan sweep will retry)", key, e)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- manifests ------------------------------------------------------------------------------
    def _remember(self, model: str, version: int, data: bytes) -> None:
        self._manifests[(model, version)] = data
        self._manifests.move_to_end((model, version))
        while len(self._manifests) > 4096:
            self._manifests.popitem(last=False)

    async def read_manifest(self, model: str, version: int) -> bytes:
        data = self._manifests.get((model, version))
        if data is None:
            data = await self.bucket.get(manifest_key(model, version))
            if data is None:
                raise NotFoundError(f"{model} v{version} is not in the bucket {self.bucket.where}")
            self._remember(model, version, data)
        return data

    async def write_manifest(self, model: str, version: int, data: bytes) -> None:
        """Commit: create the manifest object only if none exists; CommitConflictError if another
        origin committed this version first. Then move ``heads.json`` forward."""
        if self.lease is not None:
            self.lease.refuse_writes()
            await self.lease.check()
        key = manifest_key(model, version)
        if not await self.bucket.put(key, data, create=True):
            existing = await self.bucket.get(key)
            if existing != data:
                raise CommitConflictError(
                    f"{model} v{version} was committed to {self.bucket.where} by another origin first; this "
                    "publish lost the race and nothing of it was committed: publish the next version from "
                    f"the new head (GET /v1/models/{model}/head)")
        self._remember(model, version, data)
        m = parse_manifest(data, records=False)
        await self.update_heads(model, HeadEntry(version=version, kind=m.kind, state_fp=m.state_fp))

    async def update_heads(self, model: str, entry: HeadEntry) -> None:
        """Move ``model`` forward in ``heads.json`` (never backwards). A failure is logged, not
        raised: the version is committed, and followers also find it by listing."""
        try:
            for _ in range(8):
                data, etag, _ = await self.bucket.get_with_etag(HEADS)
                try:
                    current = decode_heads(data) if data is not None else {}
                except DeltaSyncError as e:
                    log.error("replacing a damaged %s: %s", HEADS, e)
                    current = {}
                new = merge_heads(current, model, entry)
                if new is None:
                    return
                body = encode_heads(new)
                if not self.conditional:
                    await self.bucket.put(HEADS, body)
                    return
                if await self.bucket.put_if_match(HEADS, body, etag if data is not None else None):
                    return
            log.error("%s: gave up moving %s to v%d after 8 races; followers find it by listing", HEADS, model,
                      entry.version)
        except DeltaSyncError as e:
            log.error("%s: could not move %s to v%d (%s); followers find it by listing", HEADS, model,
                      entry.version, e)

    async def read_squash(self, model: str, start: int, end: int) -> bytes | None:
        return await self.local.read_squash(model, start, end)

    async def write_squash(self, model: str, start: int, end: int, data: bytes) -> None:
        await self.local.write_squash(model, start, end, data)

    async def close(self) -> None:
        for t in list(self._tasks):
            await asyncio.gather(t, return_exceptions=True)
        if self._take_over is not None:
            self._take_over.cancel()
            await asyncio.gather(self._take_over, return_exceptions=True)
        if self.lease is not None:
            await self.lease.release()


# -- garbage collection (pure rule) ------------------------------------------------------------

def orphans(listing: dict[str, ObjectInfo], referenced: set[str], *, now: datetime, grace: float) -> list[str]:
    """Blob ids to delete: in the bucket, named by no manifest, and written more than ``grace``
    seconds ago (so blobs of a publish in progress, whose manifest comes last, are kept)."""
    out = []
    for bid, o in sorted(listing.items()):
        if bid not in referenced and (now - o.modified).total_seconds() > grace:
            out.append(bid)
    return out


# -- the store --------------------------------------------------------------------------------

class S3Store(IndexedStore):
    """``IndexedStore`` over ``S3Files``, kept in step with other origins on the same bucket."""

    files: S3Files

    def __init__(self, files: S3Files, *, budget: int | None = None, retention: int = 16,
                 on_evict: Callable[[int, int], None] | None = None, poll_interval: float = 2.0,
                 gc_interval: float = 600.0, gc_grace: float = 3600.0) -> None:
        super().__init__(files, budget=budget, retention=retention, on_evict=on_evict)
        self.poll_interval = poll_interval
        self.gc_interval = gc_interval
        self.gc_grace = gc_grace
        self.watcher = HeadsWatcher(files.bucket)
        self._on_version: Callable[[VersionInfo, bytes], None] | None = None
        self._tasks: list[asyncio.Task] = []
        self._catching_up: dict[str, asyncio.Lock] = {}

    def follow(self, on_version: Callable[[VersionInfo, bytes], None]) -> None:
        """Call ``on_version(info, manifest)`` for every version another origin commits (events)."""
        self._on_version = on_version

    async def load(self, *, trust_head: bool = True) -> None:
        await super().load(trust_head=trust_head)
        for idx in self.models.values():
            if idx.head is not None:
                self.watcher.heads[idx.model] = idx.head
        loop = asyncio.get_running_loop()
        if self.poll_interval > 0:
            self._tasks.append(loop.create_task(self._poll_forever(), name="s3store-poll"))
        if self.gc_interval > 0:
            self._tasks.append(loop.create_task(self._sweep_forever(), name="s3store-gc"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.files.close()

    def needs_verify(self, blob_id: str) -> bool:
        return False  # see the module docstring

    def writer_status(self) -> dict | None:
        """The writer lease's state for /healthz (``S3Files.writer_status``)."""
        return self.files.writer_status()

    # -- other origins' commits ------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                moved = await self.watcher.poll()
                for model, version in moved.items():
                    head = self.head(model)
                    if head is None or head < version:
                        await self.catch_up(model)
            except DeltaSyncError as e:
                log.warning("polling %s failed: %s", self.files.bucket.where, e)

    async def catch_up(self, model: str) -> list[VersionInfo]:
        """Load and announce the versions of ``model`` committed to the bucket after our head."""
        lock = self._catching_up.setdefault(model, asyncio.Lock())
        async with lock:
            head = self.head(model)
            keys = [(model, v) for v in await self._listed_versions(model, -1 if head is None else head)]
            if not keys:
                return []
            added: list[VersionInfo] = []
            for sm in sorted(await self.files._get_manifests(keys), key=lambda s: s.version):
                try:
                    m = parse_manifest(sm.data, records=False)
                except DeltaSyncError as e:
                    log.error("skipping unreadable manifest %s: %s", sm.where, e)
                    continue
                idx = self.models.get(model)
                if idx is None:
                    idx = self.models[model] = ModelIndex(model)
                info = version_info(m, sm.data)
                idx.add(info)
                self._blob_lists[(model, m.version)] = m.blobs
                for b in m.blobs:
                    if not self.has_blob(b.id):
                        self._ledger.add(b.id, b.size)  # written before its manifest, by the committing origin
                if self.announce(model, m.version):
                    added.append(info)
                    if self._on_version is not None:
                        self._on_version(info, sm.data)
            if added:
                log.info("%s: loaded v%d..v%d committed by another origin", model, added[0].version,
                         added[-1].version)
            return added

    async def _listed_versions(self, model: str, after: int) -> list[int]:
        start = manifest_key(model, after) if after >= 0 else None
        out = []
        for o in await self.files.bucket.list(model_prefix(model), after=start):
            mv = parse_manifest_key(o.key)
            if mv is not None and mv[0] == model and mv[1] > after:
                out.append(mv[1])
        return sorted(out)

    async def refresh_for_commit(self, m: Manifest) -> None:
        """Before committing ``m``: load newer versions from the bucket, and find its blobs that
        another origin received. A bucket that cannot be read fails the commit like a failed write
        (StorageError, 507): nothing was committed."""
        try:
            await self.catch_up(m.model)
            unknown = [b for b in m.blobs if not self.has_blob(b.id)]
            if not unknown:
                return
            sem = asyncio.Semaphore(SCAN_CONCURRENCY)

            async def look(bid: str) -> tuple[str, int | None]:
                async with sem:
                    return bid, await self.files.blob_size(bid)
            for bid, size in await asyncio.gather(*(look(b.id) for b in unknown)):
                if size is not None and not self.has_blob(bid):
                    self._ledger.add(bid, size)
        except UnavailableError as e:
            raise StorageError(f"cannot commit {m.model} v{m.version}: {e}; nothing was committed") from e

    # -- garbage collection --------------------------------------------------------------------
    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.gc_interval)
            try:
                await self.sweep_orphans()
            except DeltaSyncError as e:
                log.warning("orphan sweep of %s failed: %s", self.files.bucket.where, e)

    async def sweep_orphans(self, *, now: datetime | None = None) -> list[str]:
        """Delete blobs no manifest names that are older than ``gc_grace`` (see ``orphans``)."""
        if self.files.lease is not None and self.files.lease.expires <= time.time():
            return []
        listing = await self.files.list_blobs()
        keys = [mv for o in await self.files.bucket.list(MODELS) if (mv := parse_manifest_key(o.key)) is not None]
        referenced: set[str] = set()
        for sm in await self.files._get_manifests(keys):
            try:
                referenced.update(b.id for b in parse_manifest(sm.data, records=False).blobs)
            except DeltaSyncError:
                return []  # an unreadable manifest might name anything: delete nothing this round
        victims = orphans(listing, referenced, now=now or datetime.now(timezone.utc), grace=self.gc_grace)
        for bid in victims:
            await self.files.bucket.delete(blob_key(bid))
            if self.has_blob(bid):
                self._ledger.drop(bid)
        if victims:
            log.info("orphan sweep: deleted %d blobs of publishes that never committed", len(victims))
        return victims


def open_s3_store(config, on_evict: Callable[[int, int], None] | None = None) -> S3Store:
    """The origin's bucket store from its ``ServerConfig`` (``store_kind == "s3"``)."""
    from .bucketlayout import parse_bucket_url

    b = config.bucket
    t = config.timeouts
    bucket = Bucket(parse_bucket_url(b.url, endpoint=config.s3_endpoint), connect_timeout=t.connect,
                    read_timeout=t.read)
    files = S3Files(bucket, Path(config.store_dir), cache_size=b.cache_size, conditional=b.conditional,
                    lease_ttl=b.lease_ttl)
    return S3Store(files, budget=config.cache_size, retention=config.retention, on_evict=on_evict,
                   poll_interval=b.poll, gc_interval=b.gc_interval, gc_grace=b.gc_grace)
