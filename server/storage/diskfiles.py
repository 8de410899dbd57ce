"""The disk store's file layer: blobs, manifests and squashed deltas as files under one directory.

Layout under the store directory::

    lock                      held (fcntl.flock) by the one server using the directory; holds its pid
    blobs/ab/ab01...ef        one file per verified blob, named by its id (sharded by prefix)
    tmp/                      partial writes; emptied at every start
    models/<model>/<version:020d>.json   manifests, canonical JSON
    squash/<model>/<from>-<to>.json      squashed catch-up manifests (their blobs live in blobs/)

Every file is written under tmp/, fsynced, renamed into place and its directory
fsynced, so a crash leaves either the old state or the new one, never half a file.
The exceptions are a relay's manifests and blobs (``durable_manifests=False``,
``durable_blobs=False``): a relay's store is a cache of its parents, so they are
renamed into place without fsync (announcing a version never waits on the disk, and
a cold relay spends no CPU on writeback it does not need); after a power loss a torn
manifest fails to parse at start, is skipped, and is fetched from the parent again,
and a torn blob (short, or zeros where its pages never reached the disk) fails the
rehash every blob found at start gets before it is first served (store.py), is
dropped and fetched again. A blob is renamed into blobs/ only after its bytes hashed
to its id. The slow parts (fsync, creating files, rehashing) run in a worker thread;
small manifest reads stay on the loop (they come from the page cache).

Readers and growing blobs are ``FileBacked``: routes send them with ``os.sendfile``.

One server per directory: ``scan`` takes an exclusive lock on ``lock`` before it
empties ``tmp/`` (a second server on the same directory stops with StorageError
naming the holder's pid, instead of wiping the first one's temp files). A full disk
is the store's own error: a failed write raises StorageError (507), never an
OSError a relay would blame on its parent; ``DiskPartial.preallocate`` reserves a
blob's whole size before any byte is served, so a disk that cannot hold it is
known before a reader gets a status line.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import secrets
import shutil
from pathlib import Path

import xxhash

from deltasync.blob import BLOB_ID_RE
from deltasync.atomic import fsync_dir, write_atomic
from deltasync.errors import NotFoundError, StorageError
from deltasync.manifest import MODEL_RE

from .blobstore import HashedBlob, Inventory, StoredManifest

log = logging.getLogger("deltasync.server.store")


class DiskReader:
    """A stored blob opened for reading; the descriptor keeps its bytes even if the file is evicted."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self.size = size

    def fileno(self) -> int:
        return self._fd

    async def read(self, offset: int, n: int) -> bytes:
        return os.pread(self._fd, n, offset)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class DiskPartial(HashedBlob):
    """A blob being written to a temp file, hashed as it grows.

    Readers may ``os.sendfile`` from ``fileno()`` at explicit offsets while it grows (the
    writer's file position is not disturbed). ``commit`` checks the hash and hands the
    file to the store; ``close`` releases the descriptor once nobody reads it.
    """

    def __init__(self, tmp_dir: Path, blob_id: str, on_commit, on_full=None) -> None:
        self.id = blob_id
        #: ``on_full(nbytes) -> bytes freed``: the store evicts for a write that met ENOSPC (tried once more)
        self._on_full = on_full
        self.path = tmp_dir / f"{blob_id}.{secrets.token_hex(6)}.part"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._on_commit = on_commit
        self._hasher = xxhash.xxh3_128()
        self.written = 0
        self.committed = False
        self._closed = False

    def fileno(self) -> int:
        return self.fd

    def preallocate(self, size: int) -> None:
        """Reserve ``size`` bytes on disk now (StorageError if the disk cannot hold them)."""
        try:
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as e:
                if not self._room_made(e, size):
                    raise
                os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                return  # a filesystem without fallocate: writes will tell
            raise StorageError(f"cannot hold blob {self.id} ({size} bytes) in {self.path.parent}: "
                               f"{e.strerror or e}") from e

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        n = len(view)
        while view:
            try:
                try:
                    k = os.write(self.fd, view)
                except OSError as e:
                    if not self._room_made(e, len(view)):
                        raise
                    k = os.write(self.fd, view)
            except OSError as e:
                raise StorageError(f"cannot write blob {self.id} in {self.path.parent}: {e.strerror or e}") from e
            view = view[k:]
        self._hasher.update(data)
        self.written += n

    def _room_made(self, e: OSError, nbytes: int) -> bool:
        """The disk is full: ask the store to evict (once per blob); True if it freed something."""
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or self._on_full is None:
            return False
        on_full, self._on_full = self._on_full, None
        return on_full(nbytes) > 0

    def reset(self) -> None:
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self._hasher.reset()
        self.written = 0

    async def read(self, offset: int, n: int) -> bytes:
        return os.pread(self.fd, min(n, max(0, self.written - offset)), offset)

    async def commit(self) -> None:
        """Verify, then let the store move it into place. Raises IntegrityError on a hash mismatch."""
        self.verify()
        await self._on_commit(self)
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


#: store directories' lock files this process holds (realpath -> descriptor), kept until it exits
_HELD_LOCKS: dict[str, int] = {}


class DiskFiles:
    """``BlobFiles`` over a directory (layout in the module docstring)."""

    def __init__(self, root: Path, *, fsync: bool = True, durable_manifests: bool = True,
                 durable_blobs: bool = True) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.model_dir = self.root / "models"
        self.squash_dir = self.root / "squash"
        self.fsync = fsync
        self.durable_manifests = durable_manifests and fsync
        self.durable_blobs = durable_blobs and fsync
        self._lock_fd: int | None = None
        #: set by the store: evicts for a blob write that met ENOSPC, returns the bytes freed
        self.on_full = None

    # -- paths ---------------------------------------------------------------------------
    def blob_path(self, blob_id: str) -> Path:
        return self.blob_dir / blob_id[:2] / blob_id

    def manifest_path(self, model: str, version: int) -> Path:
        return self.model_dir / model / manifest_name(version)

    def squash_path(self, model: str, start: int, end: int) -> Path:
        return self.squash_dir / model / f"{start}-{end}.json"

    # -- start ---------------------------------------------------------------------------
    async def scan(self) -> Inventory:
        return await asyncio.to_thread(self.scan_sync)

    def lock(self) -> None:
        """Take the directory's lock (held until the process exits); StorageError if another process holds it.
        A store reopened within the same process shares the lock it already holds."""
        if self._lock_fd is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "lock"
        real = os.path.realpath(path)
        held = _HELD_LOCKS.get(real)
        if held is not None:
            self._lock_fd = held
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StorageError(f"store directory {self.root} is in use by another server (pid {holder}, "
                                   f"lock file {path}); give each server its own directory") from None
            raise StorageError(f"cannot lock store directory {self.root}: {e.strerror or e}") from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = _HELD_LOCKS[real] = fd

    def scan_sync(self) -> Inventory:
        """Lock the directory, create the layout, drop partial writes, list blobs (oldest first) and read every
        manifest."""
        self.lock()
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
        manifests: list[StoredManifest] = []
        for mdir in self.model_dir.iterdir():
            if not (mdir.is_dir() and MODEL_RE.match(mdir.name)):
                continue
            for f in mdir.glob("*.json"):
                stem = f.name[:-len(".json")]
                if not (stem.isdigit() and f.name == manifest_name(int(stem))):
                    log.error("skipping misplaced manifest %s", f)
                    continue
                try:
                    data = f.read_bytes()
                except OSError as e:
                    log.error("skipping unreadable manifest %s: %s", f, e)
                    continue
                manifests.append(StoredManifest(model=mdir.name, version=int(stem), data=data, where=str(f)))
        squashes: list[tuple[str, int, int, int]] = []
        for sdir in self.squash_dir.iterdir():
            if not (sdir.is_dir() and MODEL_RE.match(sdir.name)):
                continue
            for f in sdir.glob("*.json"):
                a, _, b = f.name[:-len(".json")].partition("-")
                if a.isdigit() and b.isdigit() and f.name == f"{int(a)}-{int(b)}.json":
                    squashes.append((sdir.name, int(a), int(b), f.stat().st_size))
                else:
                    log.warning("ignoring unexpected file %s in the squash cache", f)
        return Inventory(blobs=tuple((bid, size) for _, bid, size in sorted(found)), manifests=tuple(manifests),
                         squashes=tuple(squashes), blob_times={bid: t for t, bid, _ in found})

    # -- blobs ---------------------------------------------------------------------------
    def new_partial(self, blob_id: str, *, on_commit) -> DiskPartial:
        return DiskPartial(self.tmp_dir, blob_id, on_commit, self.on_full)

    async def open_partial(self, blob_id: str, *, on_commit) -> DiskPartial:
        # Creating a file can wait on the filesystem journal: off the loop.
        return await asyncio.to_thread(DiskPartial, self.tmp_dir, blob_id, on_commit, self.on_full)

    async def adopt(self, part: DiskPartial) -> None:
        final = self.blob_path(part.id)

        def work() -> None:
            if self.durable_blobs:
                os.fsync(part.fd)
            final.parent.mkdir(exist_ok=True)
            os.replace(part.path, final)
            if self.durable_blobs:
                fsync_dir(final.parent)

        await asyncio.to_thread(work)

    async def open_blob(self, blob_id: str) -> DiskReader | None:
        try:
            fd = os.open(self.blob_path(blob_id), os.O_RDONLY)
        except FileNotFoundError:
            return None
        return DiskReader(fd, os.fstat(fd).st_size)

    def read_blob_sync(self, blob_id: str) -> bytes:
        try:
            return self.blob_path(blob_id).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"blob {blob_id} is not in the store") from None

    async def read_blob(self, blob_id: str) -> bytes:
        return await asyncio.to_thread(self.read_blob_sync, blob_id)

    async def digest(self, blob_id: str) -> str | None:
        path = self.blob_path(blob_id)

        def work() -> str | None:
            h = xxhash.xxh3_128()
            try:
                with open(path, "rb", buffering=0) as f:
                    while chunk := f.read(8 << 20):
                        h.update(chunk)
            except FileNotFoundError:
                return None
            return h.hexdigest()

        return await asyncio.to_thread(work)

    def discard(self, blob_id: str) -> None:
        try:
            os.unlink(self.blob_path(blob_id))  # open readers keep their descriptor
        except FileNotFoundError:
            pass

    # -- manifests and squashed deltas ---------------------------------------------------
    def read_manifest_sync(self, model: str, version: int) -> bytes:
        try:
            return self.manifest_path(model, version).read_bytes()
        except FileNotFoundError:  # pruned (or removed by hand): the version is gone here, never a 500
            raise NotFoundError(f"{model} v{version} is no longer stored here; catch up from a keyframe") from None

    def discard_manifest(self, model: str, version: int) -> None:
        try:
            os.unlink(self.manifest_path(model, version))
        except FileNotFoundError:
            pass

    def discard_squash(self, model: str, start: int, end: int) -> None:
        try:
            os.unlink(self.squash_path(model, start, end))
        except FileNotFoundError:
            pass

    async def read_manifest(self, model: str, version: int) -> bytes:
        return self.read_manifest_sync(model, version)

    async def write_manifest(self, model: str, version: int, data: bytes) -> None:
        # A relay's copy is not fsynced: a torn file fails to parse at start and is fetched again.
        await asyncio.to_thread(self._write, self.manifest_path(model, version), data, self.durable_manifests)

    async def read_squash(self, model: str, start: int, end: int) -> bytes | None:
        try:
            return self.squash_path(model, start, end).read_bytes()
        except FileNotFoundError:
            return None

    async def write_squash(self, model: str, start: int, end: int, data: bytes) -> None:
        await asyncio.to_thread(self._write, self.squash_path(model, start, end), data, self.fsync)

    def _write(self, final: Path, data: bytes, fsync: bool) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(final, data, tmp_dir=self.tmp_dir, fsync=fsync)


def manifest_name(version: int) -> str:
    return f"{version:020d}.json"
