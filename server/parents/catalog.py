"""Where a server finds manifests: its store, and on a relay its parents (pull-through).

A relay asked for a version it does not hold fetches the manifest from a parent
(signature checked when it holds a key), stores it without announcing it, and
serves it; concurrent requests for the same version share one fetch.

The catalog also remembers what this process already checked: ``checked`` holds the (model, version, etag)
of every manifest it parsed and verified since start (committed here, fetched from a parent, learned from an
event), so serving one again only rehashes its bytes (routes.served_manifest), and the last few parsed
manifests are kept, so the relay's chain walk does not parse a version it just stored. Servers parse manifests
without their tensor records (``parse_manifest(records=False)``: every field, the table and the signature checked,
~0.02 s at 70,000 tensors against ~0.3 s with the records): a server reads only a manifest's fields and blobs;
the squash worker, which composes chains, parses its manifests whole. A relay holding a key takes its parents'
manifests on their signature, the table not even checked (``Upstream.table_check``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from deltasync.errors import NotFoundError
from deltasync.manifest import Manifest, parse_manifest

from ..storage.blobstore import BlobStore
from .upstream import Upstream


class Catalog:
    RECENT = 8  # parsed manifests kept (the newest versions a relay announces and walks back through)

    def __init__(self, *, store: BlobStore, upstream: Upstream | None) -> None:
        self.store = store
        self.upstream = upstream
        self._pending: dict[tuple[str, int], asyncio.Future[None]] = {}
        #: (model, version, etag) of the manifests this process has parsed and verified since start: served
        #: from the store again, their bytes are only rehashed against the etag (routes.served_manifest)
        self.checked: set[tuple[str, int, str]] = set()
        self._recent: OrderedDict[tuple[str, int], Manifest] = OrderedDict()

    def verified(self, m: Manifest) -> None:
        """``m`` (stored) was parsed and verified by this process: kept parsed, and its stored bytes checked."""
        info = self.store.info(m.model, m.version)
        if info is None:
            return
        self.checked.add((m.model, m.version, info.etag))
        self._recent[(m.model, m.version)] = m
        self._recent.move_to_end((m.model, m.version))
        while len(self._recent) > self.RECENT:
            self._recent.popitem(last=False)

    async def manifest_bytes(self, model: str, version: int) -> bytes:
        if self.store.info(model, version) is None:
            await self._pull(model, version)
        return await self.store.get_manifest(model, version)

    async def manifest(self, model: str, version: int) -> Manifest:
        m = self._recent.get((model, version))
        if m is not None and self.store.info(model, version) is not None:
            return m
        data = await self.manifest_bytes(model, version)  # pulled from a parent (and kept parsed) if not here
        m = self._recent.get((model, version))
        return m if m is not None else parse_manifest(data, records=False)

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
                    self.verified(m)
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
            self.verified(m)
