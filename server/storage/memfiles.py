"""The in-memory byte layer: ``BlobFiles`` over dicts, for tests and throw-away servers.

Nothing survives the process. Blobs are immutable ``bytes``; a reader holds a reference
to them, so evicting a blob never changes what an open reader reads. Growing blobs
are ``bytearray``s that readers follow while they grow. Nothing here is
``FileBacked``: routes stream these readers with ``read`` instead of ``sendfile``.
"""

from __future__ import annotations

import xxhash

from deltasync.errors import NotFoundError

from .blobstore import HashedBlob, Inventory


class MemoryReader:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self.size = len(data)

    async def read(self, offset: int, n: int) -> bytes:
        return self._data[offset:offset + n]

    def close(self) -> None:
        pass


class MemoryPartial(HashedBlob):
    """A blob being written into a ``bytearray``, hashed as it grows."""

    def __init__(self, blob_id: str, on_commit) -> None:
        self.id = blob_id
        self.buf = bytearray()
        self._on_commit = on_commit
        self._hasher = xxhash.xxh3_128()
        self.committed = False

    @property
    def written(self) -> int:
        return len(self.buf)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.buf += data
        self._hasher.update(data)

    def reset(self) -> None:
        self.buf = bytearray()
        self._hasher.reset()

    async def read(self, offset: int, n: int) -> bytes:
        return bytes(self.buf[offset:offset + n])

    async def commit(self) -> None:
        self.verify()
        await self._on_commit(self)
        self.committed = True

    def close(self) -> None:
        if not self.committed:
            self.buf = bytearray()


class MemoryFiles:
    """``BlobFiles`` in dicts."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[tuple[str, int], bytes] = {}
        self.squashes: dict[tuple[str, int, int], bytes] = {}

    async def scan(self) -> Inventory:
        return Inventory()  # a fresh memory store holds nothing

    async def open_partial(self, blob_id: str, *, on_commit) -> MemoryPartial:
        return MemoryPartial(blob_id, on_commit)

    async def adopt(self, part: MemoryPartial) -> None:
        self.blobs[part.id] = bytes(part.buf)

    async def open_blob(self, blob_id: str) -> MemoryReader | None:
        data = self.blobs.get(blob_id)
        return None if data is None else MemoryReader(data)

    async def read_blob(self, blob_id: str) -> bytes:
        try:
            return self.blobs[blob_id]
        except KeyError:
            raise NotFoundError(f"blob {blob_id} is not in the store") from None

    async def digest(self, blob_id: str) -> str | None:
        data = self.blobs.get(blob_id)
        return None if data is None else xxhash.xxh3_128_hexdigest(data)

    def discard(self, blob_id: str) -> None:
        self.blobs.pop(blob_id, None)

    async def read_manifest(self, model: str, version: int) -> bytes:
        try:
            return self.manifests[(model, version)]
        except KeyError:
            raise NotFoundError(f"{model} v{version} is not stored here") from None

    async def write_manifest(self, model: str, version: int, data: bytes) -> None:
        self.manifests[(model, version)] = bytes(data)

    async def read_squash(self, model: str, start: int, end: int) -> bytes | None:
        return self.squashes.get((model, start, end))

    async def write_squash(self, model: str, start: int, end: int, data: bytes) -> None:
        self.squashes[(model, start, end)] = bytes(data)

    def discard_manifest(self, model: str, version: int) -> None:
        self.manifests.pop((model, version), None)

    def discard_squash(self, model: str, start: int, end: int) -> None:
        self.squashes.pop((model, start, end), None)
