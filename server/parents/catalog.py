"""Where a server finds manifests: its store, and on a relay its parents (pull-through).

A relay asked for a version it does not hold fetches the manifest from a parent
(signature checked when it holds a key), stores it without announcing it, and
serves it; concurrent requests for the same version share one fetch.
"""

from __future__ import annotations

import asyncio

from deltasync.errors import NotFoundError
from deltasync.manifest import Manifest, parse_manifest

from ..storage.blobstore import BlobStore
from .upstream import Upstream


class Catalog:
    def __init__(self, *, store: BlobStore, upstream: Upstream | None) -> None:
        self.store = store
        self.upstream = upstream
        self._pending: dict[tuple[str, int], asyncio.Future[None]] = {}

    async def manifest_bytes(self, model: str, version: int) -> bytes:
        if self.store.info(model, version) is None:
            await self._pull(model, version)
        return await self.store.get_manifest(model, version)

    async def manifest(self, model: str, version: int) -> Manifest:
        return parse_manifest(await self.manifest_bytes(model, version))

    async def _pull(self, model: str, version: int) -> None:
        if self.upstream is None:
            raise NotFoundError(f"{model} v{version} is not committed here")
        key = (model, version)
        fut = self._pending.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._pending[key] = fut
            try:
                m = await self.upstream.get_manifest(model, version)
                if self.store.info(model, version) is None:
                    await self.store.put_manifest(m, announce=False)
                fut.set_result(None)
            except BaseException as e:
                fut.set_exception(e)
                fut.exception()  # mark retrieved: nobody else may be waiting
                raise
            finally:
                del self._pending[key]
        else:
            await asyncio.shield(fut)

    async def put(self, m: Manifest) -> None:
        """Store a manifest learned elsewhere (prefetch) without announcing it."""
        if self.store.info(m.model, m.version) is None:
            await self.store.put_manifest(m, announce=False)
