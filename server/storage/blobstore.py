"""The seams between a server and where it keeps bytes: ``BlobStore`` and the ``BlobFiles`` under it.

Two levels, both ``typing.Protocol``s::

    routes, intake, catalog, catch-up,       BlobStore: the whole store as the server sees it
    fetcher, prefetch                         (store.py: IndexedStore, DiskStore, MemoryStore)
            │                                   ├── version index (versions.py: heads, infos; memory)
            ▼                                   ├── retention + LRU budget (retention.py: pure policy)
         BlobStore ────────────────────────────►└── BlobFiles: the bytes (diskfiles.py, memfiles.py)

``BlobStore`` is what routes and relays call. Its answers about *what is stored*
(``has_blob``, ``blob_size``, ``head``, ``info``, ``announce``, pins, leases, budget)
come from memory and are synchronous; everything that moves *bytes* (blobs,
manifests, squashed deltas, growing blobs) is a coroutine. ``BlobFiles`` is the
byte layer alone: every call that reads or writes is ``async``, so a store whose
calls are network requests (the S3 store a later issue adds as the origin's durable
store) implements ``BlobFiles`` and gets the index, pinning and budget for free:
``scan`` lists what exists once at start (LIST), ``read_*`` are GETs (``StoredBlob.read``
a ranged GET), ``adopt``/``write_*`` PUTs, and ``discard`` (called from the
synchronous eviction path) schedules a DELETE and returns. Nothing above this
layer opens a file: routes get a ``StoredBlob`` and send it.

``sendfile`` stays a disk optimisation behind the seam: a reader (or a growing
blob) that also has ``fileno()`` (the ``FileBacked`` capability) is sent with
``os.sendfile`` from that descriptor; any other reader is streamed with ``read``
(see sendfile.py ``send_blob_range``).

A growing blob (``GrowingBlob``) is a blob being written (an upload, or a relay's
fetch from its parent), hashed as it grows; readers may read what is written
while it grows (cut-through). ``commit`` checks the hash and makes it a stored blob.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from deltasync.errors import IntegrityError
from deltasync.manifest import BlobRef, Manifest

from .versions import ModelIndex, VersionInfo


class StoredBlob(Protocol):
    """An open, stable view of one stored blob: evicting the blob meanwhile does not change what it reads."""

    size: int

    async def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes from ``offset`` (fewer only at the end)."""

    def close(self) -> None:
        """Release the view (idempotent)."""


@runtime_checkable
class FileBacked(Protocol):
    """The optional capability of a reader or growing blob whose bytes are in a local file."""

    def fileno(self) -> int:
        """A descriptor readable with ``os.sendfile``/``os.pread`` at explicit offsets."""


class HashedBlob:
    """The hash check every growing blob shares: feed ``_hasher`` as bytes arrive, then ``verify``."""

    id: str
    _hasher: Any

    def digest(self) -> str:
        return self._hasher.hexdigest()

    def verify(self) -> None:
        found = self.digest()
        if found != self.id:
            raise IntegrityError(f"blob bytes hash to {found}, expected {self.id}; the blob was discarded")


class GrowingBlob(Protocol):
    """A blob being written, hashed as it grows, readable while it grows; ``commit`` stores it."""

    id: str
    written: int
    committed: bool

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def reset(self) -> None:
        """Throw away everything written (after a hash failure) and start over."""

    def digest(self) -> str: ...

    def verify(self) -> None:
        """IntegrityError unless the bytes written hash to the id."""

    async def read(self, offset: int, n: int) -> bytes: ...

    async def commit(self) -> None:
        """Verify, then make it a stored blob (durably). IntegrityError on a hash mismatch."""

    def close(self) -> None:
        """Release it; an uncommitted blob is thrown away."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredManifest:
    """A manifest found by ``BlobFiles.scan``: where it is filed and its bytes (not yet parsed)."""

    model: str
    version: int
    data: bytes
    where: str  # for log messages: a path, a key


@dataclass(frozen=True, slots=True, kw_only=True)
class Inventory:
    """What ``BlobFiles.scan`` found: complete blobs (oldest first) and manifests."""

    blobs: tuple[tuple[str, int], ...] = ()
    manifests: tuple[StoredManifest, ...] = ()
    #: squashed manifests as (model, from, to, size)
    squashes: tuple[tuple[str, int, int, int], ...] = ()
    #: when each blob was written (wall-clock seconds), where the byte layer knows it
    blob_times: dict[str, float] = field(default_factory=dict)


OnCommit = Callable[[GrowingBlob], Awaitable[None]]  # what a growing blob awaits once it verified


class BlobFiles(Protocol):
    """The byte layer of a store: content-addressed blobs, manifests per model, squashed deltas.

    Every byte-moving call is a coroutine (a remote store makes network calls). Blob ids
    reaching it are already checked; writes are atomic (all or nothing).
    """

    async def scan(self) -> Inventory:
        """Drop partial writes and list what is stored (once, at start)."""

    async def open_partial(self, blob_id: str, *, on_commit: OnCommit) -> GrowingBlob:
        """A new growing blob; its ``commit`` verifies and then awaits ``on_commit(part)``."""

    async def adopt(self, part: GrowingBlob) -> None:
        """Make a verified growing blob a stored blob, durably."""

    async def open_blob(self, blob_id: str) -> StoredBlob | None:
        """A reader of a stored blob, or None if it is not there."""

    async def read_blob(self, blob_id: str) -> bytes:
        """A stored blob's bytes; NotFoundError if it is not there."""

    async def digest(self, blob_id: str) -> str | None:
        """The xxh3-128 of a stored blob's bytes as they are now, None if it is not there."""

    def discard(self, blob_id: str) -> None:
        """Delete a stored blob (open readers keep what they read); may finish in the background."""

    async def read_manifest(self, model: str, version: int) -> bytes: ...

    async def write_manifest(self, model: str, version: int, data: bytes) -> None: ...

    async def read_squash(self, model: str, start: int, end: int) -> bytes | None: ...

    async def write_squash(self, model: str, start: int, end: int, data: bytes) -> None: ...

    # Only stores that prune their history (relays: ``IndexedStore(prune_history=True)``) call these; an
    # origin's durable byte layer (the S3 store) keeps every version and need not offer them.
    def discard_manifest(self, model: str, version: int) -> None:
        """Delete a stored manifest (a version below the kept floor)."""

    def discard_squash(self, model: str, start: int, end: int) -> None:
        """Delete a cached squashed manifest."""


class BlobStore(Protocol):
    """The store as routes and relays use it. Index and budget calls are synchronous (memory);
    byte-moving calls are coroutines. Used from the event loop only."""

    models: dict[str, ModelIndex]
    budget: int | None
    over_budget: bool

    # -- what is stored (memory) -------------------------------------------------------
    def index(self, model: str) -> ModelIndex | None: ...
    def head(self, model: str) -> int | None: ...
    def info(self, model: str, version: int) -> VersionInfo | None: ...
    def announce(self, model: str, version: int) -> bool: ...
    def blob_refs(self, model: str, version: int) -> tuple[BlobRef, ...]: ...
    def has_blob(self, blob_id: str) -> bool: ...
    def blob_size(self, blob_id: str) -> int | None: ...
    def touch(self, blob_id: str) -> None: ...

    # -- retention and budget (memory) -------------------------------------------------
    def is_pinned(self, blob_id: str) -> bool: ...
    def lease(self, ids: Iterable[str]) -> None: ...
    def unlease(self, ids: Iterable[str]) -> None: ...
    def reserve(self, nbytes: int) -> None: ...
    def release(self, nbytes: int) -> None: ...
    def make_room(self, nbytes: int) -> None: ...
    @property
    def blob_bytes(self) -> int: ...
    @property
    def blob_count(self) -> int: ...
    @property
    def pinned_bytes(self) -> int: ...
    @property
    def stored_bytes(self) -> int:
        """Every byte kept, as counted against the budget: blobs, manifests, squashed manifests."""

    # -- bytes (coroutines) ------------------------------------------------------------
    async def load(self, *, trust_head: bool = True) -> None:
        """Index what is stored (once, before serving)."""

    async def open_blob(self, blob_id: str) -> StoredBlob | None:
        """A reader of a complete blob (marked recently used), or None if it is not stored."""

    async def get_blob(self, blob_id: str) -> bytes: ...
    async def put_blob_bytes(self, blob_id: str, data: bytes) -> None: ...
    async def open_partial(self, blob_id: str) -> GrowingBlob: ...
    def needs_verify(self, blob_id: str) -> bool: ...
    def drop_blob(self, blob_id: str) -> None: ...
    async def verify_cached(self, blob_id: str) -> bool: ...
    async def get_manifest(self, model: str, version: int) -> bytes: ...
    async def put_manifest(self, m: Manifest, *, announce: bool) -> VersionInfo: ...
    async def get_squash(self, model: str, start: int, end: int) -> bytes | None: ...
    async def put_squash(self, model: str, start: int, end: int, data: bytes) -> None: ...
