"""Uploading a version to the origin: blobs in parallel, the manifest last.

The origin refuses a manifest whose blobs it lacks, so a version becomes visible
only once all its bytes are there. PUTs are idempotent: a retried upload of a blob
the origin already holds is harmless.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from aiohttp import payload

from deltasync.manifest import Manifest
from deltasync.signing import Signer

from .http import HttpClient


class PiecesPayload(payload.Payload):
    """A request body that is the concatenation of ``pieces`` (e.g. a keyframe shard's header and
    memoryviews of a mapped file), sent with its Content-Length and never joined into one buffer.
    Reusable: a retried PUT sends the same pieces again. ``len()`` is its size."""

    WRITE_BYTES = 4 << 20  # handed to the transport at a time, so its send buffer never holds a whole piece
    _autoclose = True  # views of memory the caller owns: nothing to close

    def __init__(self, pieces: Sequence[bytes | bytearray | memoryview]) -> None:
        views = tuple(memoryview(p).cast("B") if memoryview(p).format != "B" else memoryview(p) for p in pieces)
        super().__init__(views, content_type="application/octet-stream")
        self._size = sum(len(v) for v in views)

    def __len__(self) -> int:
        return self._size

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._value)

    async def write(self, writer) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer, content_length: int | None) -> None:
        left = self._size if content_length is None else min(content_length, self._size)
        for view in self._value:
            for at in range(0, len(view), self.WRITE_BYTES):
                if left <= 0:
                    return
                part = view[at : at + min(self.WRITE_BYTES, left)]
                await writer.write(part)
                left -= len(part)


async def upload_blobs(client: HttpClient, blobs: Mapping[str, bytes], *, concurrency: int = 4) -> int:
    """PUT every blob, at most ``concurrency`` at a time; returns the bytes sent."""
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(bid: str, data: bytes) -> int:
        async with sem:
            await client.put_blob(bid, data)
        return len(data)

    sizes = await asyncio.gather(*(one(b, d) for b, d in blobs.items()))
    return sum(sizes)


async def commit_manifest(client: HttpClient, manifest: Manifest, *, key: Signer | bytes | None = None) -> Manifest:
    """Sign (when a key is given) and PUT a manifest; returns what was sent. A public-key signer needs the
    blobs' digests in the manifest already (``Manifest.with_digests``; ``upload_version`` adds them)."""
    if key is not None:
        manifest = manifest.sign(key)
    await client.put_manifest(manifest.model, manifest.version, manifest.to_json())
    return manifest


async def upload_version(client: HttpClient, manifest: Manifest, blobs: Mapping[str, bytes], *,
                         key: Signer | bytes | None = None, concurrency: int = 4) -> Manifest:
    """Blobs first (in parallel), then the manifest (signed with ``key``: with a digest of every blob)."""
    if key is not None:
        manifest = manifest.with_digests(blobs)
    await upload_blobs(client, {b.id: blobs[b.id] for b in manifest.blobs}, concurrency=concurrency)
    return await commit_manifest(client, manifest, key=key)
