"""Everything one server runs, built from its config, opened at start-up and closed at shutdown."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .parents.catalog import Catalog
from .catchup import CatchupBuilder
from .config import ServerConfig
from .events import EventHub
from .parents.fetcher import BlobFetcher
from .intake import Intake
from .metrics import Metrics
from .parents.prefetch import Prefetcher
from .storage.blobstore import BlobStore
from .storage.store import ORPHAN_GRACE, DiskStore, MemoryStore
from .parents.upstream import Upstream

log = logging.getLogger("deltasync.server")


class StreamCounter:
    """Responses currently streaming, for the ``active_streams`` gauge."""

    def __init__(self) -> None:
        self.blobs = 0
        self.events = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Services:
    config: ServerConfig
    metrics: Metrics
    store: BlobStore
    hub: EventHub
    catalog: Catalog
    catchup: CatchupBuilder
    streams: StreamCounter
    intake: Intake | None = None  # origin only
    upstream: Upstream | None = None  # relay only
    fetcher: BlobFetcher | None = None  # relay only
    prefetcher: Prefetcher | None = None  # relay only


async def open_services(config: ServerConfig) -> Services:
    metrics = Metrics(role=config.role)
    store = _open_store(config, metrics)
    await store.load(trust_head=config.is_origin)
    hub = EventHub(queue_size=config.sse_queue)
    if hasattr(store, "follow"):  # a store shared with other origins: their commits become our events
        store.follow(hub.publish)
    streams = StreamCounter()
    t = config.timeouts
    upstream = fetcher = prefetcher = intake = None
    if config.is_origin:
        intake = Intake(store=store, hub=hub, metrics=metrics, verifier=config.verifier,
                        max_blob_size=config.max_blob_size)
    else:
        upstream = Upstream(config.parents, timeouts=t, metrics=metrics, verifier=config.verifier,
                            max_manifest_size=config.max_manifest_size, read_token=config.read_token,
                            ssl=_client_ssl(config))
        await upstream.start()
        fetcher = BlobFetcher(store=store, upstream=upstream, metrics=metrics, timeouts=t)
    catalog = Catalog(store=store, upstream=upstream)
    if upstream is not None and fetcher is not None:
        prefetcher = Prefetcher(store=store, catalog=catalog, upstream=upstream, fetcher=fetcher, hub=hub,
                                metrics=metrics, timeouts=t, retention=config.retention,
                                hinted_fetch=config.hinted_fetch)
    catchup = CatchupBuilder(store=store, catalog=catalog, fetcher=fetcher, metrics=metrics,
                             signer=config.squash_signer,                             max_chain=config.max_squash_chain, fetch_timeout=t.read * 4,
                             budget=_squash_budget(config))
    svc = Services(config=config, metrics=metrics, store=store, hub=hub, catalog=catalog, catchup=catchup,
                   streams=streams, intake=intake, upstream=upstream, fetcher=fetcher, prefetcher=prefetcher)
    _register_gauges(svc)
    if prefetcher is not None:
        prefetcher.start()
    return svc


def _squash_budget(config: ServerConfig):
    """The SquashBudget the server's flags ask for, or None (the defaults; the codec is then not loaded at start)."""
    if config.squash_budget is None:
        return None
    from deltasync.squash import SquashBudget  # loads the codec (torch): only when a budget is set

    seconds, nbytes = config.squash_budget
    return SquashBudget(seconds=seconds, output_bytes=nbytes, chain_bytes=nbytes)
def _client_ssl(config: ServerConfig):
    if config.ca_file is None:
        return None
    from deltasync.tls import client_ssl_context
    return client_ssl_context(config.ca_file)


def _open_store(config: ServerConfig, metrics: Metrics) -> BlobStore:
    def on_evict(n: int, nbytes: int) -> None:
        metrics.inc("evictions", n)
        metrics.inc("evicted_bytes", nbytes)

    if config.store_kind == "s3":
        from .storage.s3store import open_s3_store  # obstore is loaded only by servers that use a bucket
        return open_s3_store(config, on_evict)
    if config.store_kind == "memory":
        return MemoryStore(budget=config.cache_size, retention=config.retention, on_evict=on_evict,
                           prune_history=not config.is_origin, orphan_grace=ORPHAN_GRACE if config.is_origin else None)
    return DiskStore(config.store_dir, budget=config.cache_size, retention=config.retention, fsync=config.fsync,
                     durable_manifests=config.is_origin, durable_blobs=config.is_origin, on_evict=on_evict,
                     prune_history=not config.is_origin,
                     orphan_grace=ORPHAN_GRACE if config.is_origin else None)


async def close_services(svc: Services) -> None:
    svc.hub.close()
    if svc.prefetcher is not None:
        await svc.prefetcher.close()
    if svc.fetcher is not None:
        await svc.fetcher.close()
    if svc.upstream is not None:
        await svc.upstream.close()
    svc.catchup.close()  # the squash worker process, if one was started
    if hasattr(svc.store, "close"):
        await svc.store.close()


def _register_gauges(svc: Services) -> None:
    m, store = svc.metrics, svc.store

    def per_model(read):
        return lambda: [({"model": name}, read(name)) for name in sorted(store.models) if store.head(name) is not None]

    m.add_gauge("head_version", "Newest committed (origin) or announced (relay) version per model.",
                per_model(lambda name: store.head(name)))
    if svc.prefetcher is not None:
        pf = svc.prefetcher
        m.add_gauge("parent_head_version", "Newest version the parent announced per model.",
                    lambda: [({"model": k}, v) for k, v in sorted(pf.parent_heads.items())])
        m.add_gauge("lag_versions", "Versions this relay is behind its parent per model.",
                    lambda: [({"model": k}, pf.lag(k)) for k in sorted(pf.parent_heads)])
        m.add_gauge("following_parent", "1 while this relay follows a parent's event stream.",
                    lambda: [({"parent": pf.following}, 1)] if pf.following else [])
    m.add_gauge("active_streams", "Blob responses and event streams in progress.",
                lambda: [({"kind": "blob"}, svc.streams.blobs), ({"kind": "events"}, svc.streams.events)])
    if svc.fetcher is not None:
        f = svc.fetcher
        m.add_gauge("inflight_blobs", "Blobs being fetched from a parent right now.", lambda: [({}, f.count)])
    m.add_gauge("store_bytes", "Bytes of complete blobs on disk.", lambda: [({}, store.blob_bytes)])
    m.add_gauge("store_blobs", "Complete blobs on disk.", lambda: [({}, store.blob_count)])
    m.add_gauge("store_pinned_bytes", "Bytes of blobs pinned by the retention window and newest keyframes.",
                lambda: [({}, store.pinned_bytes)])
    m.add_gauge("store_budget_bytes", "The cache size budget (0: unbounded).", lambda: [({}, store.budget or 0)])
    m.add_gauge("store_over_budget", "1 when everything evictable is gone and the store is still over budget.",
                lambda: [({}, int(store.over_budget))])
