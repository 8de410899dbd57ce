"""The origin's write path: blob uploads and version commits, with every check the protocol promises.

A blob is stored only if its bytes hash to its id and fit the size limit; a version
is committed only if its manifest parses (and verifies, with a key), names only
blobs already stored with the sizes it claims, increases the model's version, and
links to a committed parent whose state fingerprint it starts from (or is a
keyframe). Commits of one model are serialized; a version becomes visible (head,
events, GET) in one step after its manifest file is durably in place.

With a verifier (``--verify-key``: the publisher's public key), the manifest must also
carry a cryptographic digest of every blob, and each must match the stored bytes: the
digest is computed while the upload streams in (kept for the blobs of recent uploads)
or, for an older blob, by rereading it. A blob whose bytes do not match is refused
(422 integrity), so the origin never serves a version whose blobs are not the signed ones.

An upload of ``HINT_MIN`` bytes or more with a ``Content-Length``, sent for a model its token may publish
(``X-Deltasync-Model``, checked by the route layer: ``hint=True``), is servable while it arrives: it
is registered as an ``InflightBlob`` (inflight.py, the relay fetch's cut-through) and announced to
the streams of every model as a ``blob`` hint (events.py). A relay that follows this origin may
then fetch it at once; it receives the bytes as they are written, and the last byte only once the
whole upload hashed to its id (a failed or cut upload aborts those responses: the relay sees a
truncated transfer). A version is still committed only when its blobs are stored: the hint lets
the relays' copies of a keyframe start with its upload instead of after its commit. An upload that names
no model, or one its token may not publish, is stored the same way but never hinted (issue 27: an unsigned hint
sized by the uploader takes room in every relay's cache, so only a publisher of some model may cause one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from deltasync.errors import (
    BaseMismatchError,
    ChainError,
    FormatError,
    IntegrityError,
    MissingBlobsError,
    StorageError,
    TooLargeError,
    UnavailableError,
)
from deltasync.digest import DEFAULT_DIGEST, DigestHasher, blob_digest, parse_digest
from deltasync.manifest import Manifest, parse_manifest
from deltasync.signing import Verifier

from .events import EventHub
from .http.inflight import InflightBlob
from .metrics import Metrics
from .storage.blobstore import BlobStore
from .storage.versions import VersionInfo

log = logging.getLogger("deltasync.server.intake")
timeline = logging.getLogger("deltasync.timeline")  # time.monotonic() stamps: benchmarks/keyframe_timeline.py


class Intake:
    #: digests of this many recent uploads are kept for the commit check (older blobs are reread)
    DIGEST_MEMORY = 4096
    #: uploads at least this long (with a declared size) are hinted to relays and servable while they arrive
    HINT_MIN = 1 << 20

    def __init__(self, *, store: BlobStore, hub: EventHub, metrics: Metrics, verifier: Verifier | bytes | None,
                 max_blob_size: int) -> None:
        self.store = store
        self.hub = hub
        self.metrics = metrics
        self.verifier = verifier  # a Verifier (public keys) or a raw HMAC secret; None: manifests are not verified
        self.max_blob_size = max_blob_size
        self._locks: dict[str, asyncio.Lock] = {}
        self._digests: dict[str, str] = {}  # blob id -> DEFAULT_DIGEST of its uploaded bytes (insertion order)
        self._inflight: dict[str, InflightBlob] = {}  # uploads being received that readers may follow

    def inflight(self, blob_id: str) -> InflightBlob | None:
        """The upload of ``blob_id`` being received now, when it is servable while it arrives."""
        return self._inflight.get(blob_id)

    async def put_blob(self, blob_id: str, body: AsyncIterator[bytes], *, declared: int | None,
                       hint: bool = False) -> tuple[int, bool]:
        """Store an uploaded blob; returns (size, created). Nothing is kept unless every check passes."""
        size = self.stored_size(blob_id, declared=declared)
        if size is not None:
            return size, False
        up = await self.open_upload(blob_id, declared=declared, hint=hint)
        try:
            async for chunk in body:
                up.feed(chunk)
            return await up.finish()
        finally:
            up.close()

    def stored_size(self, blob_id: str, *, declared: int | None) -> int | None:
        """The size of ``blob_id`` if it is stored already (its upload is then answered without its body);
        TooLargeError for a declared size over the limit."""
        size = self.store.blob_size(blob_id)
        if size is not None:
            return size
        if declared is not None and declared > self.max_blob_size:
            raise TooLargeError(f"blob of {declared} bytes exceeds this origin's limit of {self.max_blob_size}")
        return None

    async def open_upload(self, blob_id: str, *, declared: int | None, hint: bool = False) -> Upload:
        """An upload of ``blob_id`` (not stored yet: see ``stored_size``) into a temp file: ``Upload.feed``
        each piece, then ``finish``; ``close`` always. ``hint``: the uploader's token may publish the model it
        names, so a large upload may be hinted to relays (otherwise it never is)."""
        try:
            part = await self.store.open_partial(blob_id)
        except OSError as e:
            raise StorageError(f"cannot store blob {blob_id}: {e.strerror or e}") from e
        timeline.info("mono=%.6f upload-start %s", time.monotonic(), blob_id)
        up = Upload(self, blob_id, part, declared)
        if declared is not None and declared >= self.HINT_MIN and not hint:
            self.metrics.inc("uploads_unhinted")  # no model named, or one the token may not publish
        elif declared is not None and declared >= self.HINT_MIN and blob_id not in self._inflight:
            blob = up.blob = InflightBlob(blob_id)
            blob.part = part
            blob.set_size(declared)
            self._inflight[blob_id] = blob
            self.hub.hint(blob_id, declared)
        return up

    async def commit(self, model: str, version: int, body: bytes) -> tuple[VersionInfo, bool]:
        """Commit a version; returns (info, created). Re-sending a committed manifest is a no-op."""
        # checked whole, its tensor records not made: nothing here reads them (0.3 s of the commit at 70k tensors)
        m = parse_manifest(body, verifier=self.verifier, records=False)
        if m.model != model or m.version != version:
            raise FormatError(f"manifest is for {m.model} v{m.version} but was sent to {model} v{version}")
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            refresh = getattr(self.store, "refresh_for_commit", None)  # a store shared with other origins
            if refresh is not None:
                await refresh(m)
            existing = self.store.info(model, version)
            if existing is not None:
                if await self.store.get_manifest(model, version) == m.to_json():
                    return existing, False
                raise ChainError(f"{model} v{version} is already committed with different content; "
                                 "publish a new version instead")
            self._check(m)
            if self.verifier is not None:
                await self._check_digests(m)
            info = await self.store.put_manifest(m, announce=True)
        self.metrics.inc("versions")
        self.hub.publish(info, m.to_json())
        log.info("committed %s v%d (%s, parent %s, %d blobs, %d bytes)", model, version, m.kind, m.parent,
                 len(m.blobs), m.total_bytes)
        return info, True

    def _check(self, m: Manifest) -> None:
        head = self.store.head(m.model)
        if head is not None and m.version <= head:
            raise ChainError(f"{m.model} v{m.version} is not newer than the head v{head}; versions must increase")
        missing = [b.id for b in m.blobs if not self.store.has_blob(b.id)]
        if missing:
            raise MissingBlobsError(f"{m.model} v{m.version} names {len(missing)} blob(s) this origin does not have; "
                                    "upload them first", missing=missing)
        for b in m.blobs:
            size = self.store.blob_size(b.id)
            if size != b.size:
                raise IntegrityError(f"blob {b.id} is {size} bytes but the manifest says {b.size}")
        if m.kind == "delta":
            parent = self.store.info(m.model, m.parent)
            if parent is None:
                raise ChainError(f"{m.model} v{m.version} is a delta from v{m.parent}, which is not committed; "
                                 "commit the parent first or publish a keyframe")
            if parent.state_fp != m.state_fp_before:
                raise BaseMismatchError(f"{m.model} v{m.version} starts from state {m.state_fp_before} but "
                                        f"v{m.parent} is state {parent.state_fp}")

    async def _check_digests(self, m: Manifest) -> None:
        """Every blob's stored bytes match the digest the (verified) manifest signs."""
        for b in m.blobs:
            if b.digest is None:
                continue  # only an HMAC-signed or unsigned manifest gets here without digests
            alg, _ = parse_digest(b.digest)
            found = self._digests.get(b.id) if alg == DEFAULT_DIGEST else None
            if found is None:
                data = await self.store.get_blob(b.id)
                found = await asyncio.to_thread(blob_digest, data, alg)
            if found != b.digest:
                self.metrics.inc("hash_failures")
                raise IntegrityError(f"blob {b.id}: stored bytes hash to {found} but {m.model} v{m.version} "
                                     f"signs {b.digest}; re-upload the blob or fix the publisher")


class Upload:
    """One blob upload in progress: every piece hashed (xxh3 id, and the BLAKE3 digest the commit check needs
    when the origin holds a key) and written as it comes (``feed``: synchronous, so a receive callback can
    call it with a view of its buffer); ``finish`` checks and stores it; ``close`` drops what is left."""

    __slots__ = ("intake", "blob_id", "part", "declared", "hasher", "blob", "stored")

    def __init__(self, intake: Intake, blob_id: str, part, declared: int | None) -> None:
        self.intake = intake
        self.blob_id = blob_id
        self.part = part
        self.declared = declared
        self.hasher = DigestHasher(DEFAULT_DIGEST) if intake.verifier is not None else None
        self.blob: InflightBlob | None = None  # readers follow it while it arrives (``Intake.HINT_MIN``)
        self.stored = False

    @property
    def written(self) -> int:
        return self.part.written

    def feed(self, chunk) -> None:
        if self.hasher is not None:
            self.hasher.update(chunk)
        if self.part.written + len(chunk) > self.intake.max_blob_size:
            raise TooLargeError(f"blob body exceeds this origin's limit of {self.intake.max_blob_size} bytes")
        try:
            self.part.write(chunk)
        except OSError as e:
            raise StorageError(f"storing blob {self.blob_id} failed after {self.part.written} bytes "
                               f"({e.strerror or e}); nothing was kept") from e
        self.intake.metrics.inc("bytes_in", len(chunk))
        if self.blob is not None:
            self.blob.progress()

    async def finish(self) -> tuple[int, bool]:
        intake, part, blob_id = self.intake, self.part, self.blob_id
        if self.declared is not None and part.written != self.declared:
            raise FormatError(f"upload ended after {part.written} of {self.declared} declared bytes (truncated)")
        try:
            part.verify()
        except IntegrityError:
            intake.metrics.inc("hash_failures")
            raise
        if self.blob is not None:
            self.blob.verified = True  # readers may send the last byte
            self.blob.progress()
        intake.store.make_room(part.written)
        try:
            await part.commit()
        except OSError as e:
            raise StorageError(f"storing blob {blob_id} failed ({e.strerror or e}); nothing was kept") from e
        if self.hasher is not None:
            intake._digests[blob_id] = self.hasher.digest()
            while len(intake._digests) > intake.DIGEST_MEMORY:
                del intake._digests[next(iter(intake._digests))]
        intake.metrics.inc("uploads")
        timeline.info("mono=%.6f upload-stored %s", time.monotonic(), blob_id)
        log.info("stored blob %s (%d bytes)", blob_id, part.written)
        self.stored = True
        return part.written, True

    def close(self) -> None:
        """Drop what is left; readers following an upload that was not stored see their response cut off."""
        blob = self.blob
        if blob is None:
            self.part.close()
            return
        if self.intake._inflight.get(self.blob_id) is blob:
            del self.intake._inflight[self.blob_id]
        if not self.stored:
            blob.verified = False  # a copy stored nowhere: nobody gets its last byte
            blob.fail(UnavailableError(f"the upload of blob {self.blob_id} did not complete"))
        blob.finish()  # the file is closed once the last reader detached

