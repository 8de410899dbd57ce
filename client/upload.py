"""Uploading a version to the origin: blobs in parallel, the manifest last.

The origin refuses a manifest whose blobs it lacks, so a version becomes visible
only once all its bytes are there. Importing this module does not import aiohttp (``PiecesPayload``, an
aiohttp payload in ``client/pieces.py``, is loaded when first asked for): the ``publish`` command's delta
goes through ``client/plainhttp.py``. PUTs are idempotent: a retried upload of a blob
the origin already holds is harmless.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

from deltasync.manifest import Manifest
from deltasync.signing import Signer

if TYPE_CHECKING:  # any client with put_blob/put_manifest: http.HttpClient (aiohttp) or plainhttp.PlainOrigin
    from .http import HttpClient


def __getattr__(name: str):
    if name == "PiecesPayload":  # an aiohttp payload: aiohttp is imported when it is first asked for
        from .pieces import PiecesPayload

        return PiecesPayload
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def upload_blobs(client: HttpClient, blobs: Mapping[str, bytes], *, concurrency: int = 4,
                       model: str | None = None) -> int:
    """PUT every blob, at most ``concurrency`` at a time; returns the bytes sent. ``model``: the model they are for
    (the origin hints large uploads to relays only when it is named and the token may publish it)."""
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(bid: str, data: bytes) -> int:
        async with sem:
            await client.put_blob(bid, data, model=model)
        return len(data)

    sizes = await asyncio.gather(*(one(b, d) for b, d in blobs.items()))
    return sum(sizes)


async def commit_manifest(client: HttpClient, manifest: Manifest, *, key: Signer | bytes | None = None) -> Manifest:
    """Sign (when a key is given) and PUT a manifest; returns what was sent. A public-key signer needs the
    blobs' digests in the manifest already (``Manifest.with_digests``; ``upload_version`` adds them)."""
    if key is not None or manifest.signature is None:
        manifest = manifest.compact()  # format 3: what is committed and sent (docs/FORMAT.md §5.3)
    # (a manifest the caller signed is sent as signed: compacting it would drop the signature)
    if key is not None:
        manifest = manifest.sign(key)
    await client.put_manifest(manifest.model, manifest.version, manifest.to_json())
    return manifest


async def upload_version(client: HttpClient, manifest: Manifest, blobs: Mapping[str, bytes], *,
                         key: Signer | bytes | None = None, concurrency: int = 4) -> Manifest:
    """Blobs first (in parallel), then the manifest (signed with ``key``: with a digest of every blob)."""
    if key is not None:
        manifest = manifest.with_digests(blobs)
    await upload_blobs(client, {b.id: blobs[b.id] for b in manifest.blobs}, concurrency=concurrency,
                       model=manifest.model)
    return await commit_manifest(client, manifest, key=key)
