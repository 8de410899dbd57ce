"""Squashed catch-up deltas: one delta A→B built from the chain A→…→B, for late joiners.

The chain is found by walking parent links back from B to A (manifests pulled
through from parents on a relay), every blob of it is made complete on disk
(fetched on a relay) and leased so eviction cannot take it mid-build, and
``deltasync.squash.squash_chain`` runs in a worker process (started at the first squash:
the server itself never loads numpy or torch; one build at a time;
concurrent requests for the same A→B share one build), bounded by a
:class:`~deltasync.squash.SquashBudget` (words, bytes, seconds): a chain over it is a
413 and a chain whose blobs disagree with their manifests a 422, answered at once, so one
crafted chain cannot hold the build slot (or shutdown) forever. The resulting blobs go
into the blob store like any other and the manifest is cached under squash/.
The server signs the squashed manifest only if it holds the key; a relay without
the key serves it unsigned (see docs/PROTOCOL.md).

The worker dies with its server in every case: on Linux it asks the kernel for
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and everywhere a thread
of its own exits it once its parent pid changes (``_die_with_parent``); a clean
shutdown (``close``) terminates it and joins it within ``WORKER_JOIN_S``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

from deltasync.errors import BaseMismatchError, ChainError, FormatError, NotFoundError, UnavailableError, UnsupportedError
from deltasync.planner import walk_parents
from deltasync.manifest import Manifest, parse_manifest

from .parents.catalog import Catalog
from .parents.fetcher import BlobFetcher
from .metrics import Metrics
from .storage.blobstore import BlobStore

log = logging.getLogger("deltasync.server.catchup")

#: seconds ``close`` waits for the squash worker to exit after SIGTERM before it is killed (within SIGTERM's bound)
WORKER_JOIN_S = 1.5
#: seconds between the worker's checks that its parent is still alive (the portable fallback)
PARENT_POLL_S = 0.5


def _die_with_parent(parent_pid: int) -> None:
    """The squash worker's initializer: exit when the server that started it is gone (module docstring)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watch below still ends it
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class CatchupBuilder:
    def __init__(self, *, store: BlobStore, catalog: Catalog, fetcher: BlobFetcher | None, metrics: Metrics,
                 signer: bytes | None, max_chain: int, fetch_timeout: float, budget=None) -> None:
        self.store = store
        self.catalog = catalog
        self.fetcher = fetcher
        self.metrics = metrics
        self.signer = signer  # the HMAC secret that signs the squashes (ServerConfig.squash_signer); None: unsigned
        self.max_chain = max_chain
        self.fetch_timeout = fetch_timeout
        self.budget = budget  # a deltasync.squash.SquashBudget; None: its defaults
        self._builds: dict[tuple[str, int, int], asyncio.Future[bytes]] = {}
        self._cpu = asyncio.Semaphore(1)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def _worker(self) -> concurrent.futures.ProcessPoolExecutor:
        """The squash worker process. The codec (numpy, torch) is loaded there, never in the server:
        loading torch holds the GIL for seconds (its shared libraries), which in the server's process
        froze every transfer, event stream and prefetch meanwhile."""
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                                initializer=_die_with_parent,
                                                                initargs=(os.getpid(),))
        return self._pool

    def close(self) -> None:
        """Stop the worker: terminated (a build in progress is abandoned) and joined, killed after
        ``WORKER_JOIN_S``."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + WORKER_JOIN_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("squash worker %d did not exit on SIGTERM; killed", p.pid)
                p.kill()
                p.join(1.0)

    async def delta(self, model: str, start: int, end: int) -> bytes:
        """The manifest (JSON bytes) of one delta taking ``model`` from ``start`` to ``end``."""
        if start >= end:
            raise FormatError(f"from={start} must be older than to={end}")
        cached = await self.store.get_squash(model, start, end)
        try:
            cached_m = parse_manifest(cached, records=False) if cached is not None else None
        except FormatError:  # a cached squash that no longer parses: build it again
            cached_m = None
        if cached_m is not None and all(self.store.has_blob(b.id) for b in cached_m.blobs):
            self.metrics.inc("squash_hits")
            return cached
        key = (model, start, end)
        fut = self._builds.get(key)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._builds[key] = fut
        try:
            data = await self._build(model, start, end)
            fut.set_result(data)
            return data
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()
            raise
        finally:
            del self._builds[key]

    async def chain(self, model: str, start: int, end: int) -> list[Manifest]:
        """The deltas leading from ``start`` to ``end``, oldest first; ChainError if there is no such chain.
        Manifests are fetched a window at a time (deltasync.planner.walk_parents), not one per version."""
        async def fetch(v: int) -> Manifest | None:
            try:
                return await self.catalog.manifest(model, v)
            except NotFoundError:  # versions need not be consecutive: a window may ask for ones never made
                return None

        walk = await walk_parents(fetch, end, floor=start, limit=self.max_chain, stop_at_keyframe=True)
        if walk.reason == "missing":
            raise NotFoundError(f"{model}: v{walk.cursor} on the chain v{start}→v{end} is not on this server or its parents")
        if walk.reason == "limit":
            raise ChainError(f"{model}: the chain v{start}→v{end} is longer than {self.max_chain} deltas; "
                             "start from a keyframe instead")
        if walk.reason == "keyframe":
            raise ChainError(f"{model}: v{start} is not an ancestor of v{end} (v{walk.chain[-1].version} is a keyframe); "
                             "start from that keyframe")
        if not walk.reaches_floor:
            last = walk.chain[-1] if walk.chain else None
            raise ChainError(f"{model}: v{start} is not an ancestor of v{end}"
                             + (f" (v{last.version} follows v{last.parent})" if last is not None else ""))
        out = list(walk.chain)
        out.reverse()
        for prev, m in zip(out, out[1:]):
            if m.state_fp_before != prev.state_fp:
                raise BaseMismatchError(f"{model}: v{m.version} does not start from the state of v{prev.version}")
        return out

    async def _build(self, model: str, start: int, end: int) -> bytes:
        chain = await self.chain(model, start, end)
        if len(chain) == 1:
            return await self.catalog.manifest_bytes(model, end)
        coded = next((m for m in chain if m.coding != "base-free"), None)
        if coded is not None:  # docs/FORMAT.md §4.4-4.5: decoding needs the model or the history, which a server
            why = "the stream's history" if coded.coding == "history" else "the model"
            raise UnsupportedError(f"{model} v{coded.version} uses the {coded.coding} coding, which cannot be squashed "
                                   f"without {why}; fetch the chain version by version")
        ids = sorted({b.id for m in chain for b in m.blobs})
        self.store.lease(ids)
        try:
            for bid in ids:
                # the bytes a squash reads are checked as those a child is served are (store.py: rehashed when
                # not verified lately, after a restart say): a damaged copy is dropped and fetched again
                if (self.store.has_blob(bid) and self.store.needs_verify(bid)
                        and not await self.store.verify_cached(bid)):
                    self.metrics.inc("corrupt_dropped")
                if not self.store.has_blob(bid):
                    if self.fetcher is None:
                        raise ChainError(f"blob {bid} of the chain is missing from the store (or failed its hash "
                                         "check there)")
                    await self.fetcher.ensure(bid, timeout=self.fetch_timeout)
            async with self._cpu:
                blobs = {bid: await self.store.get_blob(bid) for bid in ids}
                t0 = time.monotonic()
                budget = self.budget
                limits = None if budget is None else (budget.chain_bytes, budget.words, budget.output_bytes,
                                                      budget.seconds)
                manifest_json, out_blobs = await asyncio.get_running_loop().run_in_executor(
                    self._worker(), squash_in_worker, [m.to_json() for m in chain], blobs, limits)
                del blobs
                took = time.monotonic() - t0
        finally:
            self.store.unlease(ids)
        for bid, data in out_blobs.items():
            await self.store.put_blob_bytes(bid, data)
        m = parse_manifest(manifest_json, records=False)
        if self.signer is not None:
            m = m.sign(self.signer)
        data = m.to_json()
        await self.store.put_squash(model, start, end, data)
        self.metrics.inc("squash_builds")
        log.info("squashed %s v%d→v%d (%d deltas, %d bytes → %d bytes) in %.2f s", model, start, end, len(chain),
                 sum(x.total_bytes for x in chain), m.total_bytes, took)
        return data


def squash_in_worker(manifests: list[bytes], blobs: dict[str, bytes], limits: tuple | None) -> tuple[bytes, dict[str, bytes]]:
    """Runs in the squash worker process: manifests as canonical JSON (already verified by the server),
    the chain's blobs by id; returns the squashed manifest's JSON (unsigned) and its blobs."""
    try:
        from deltasync.squash import SquashBudget, squash_chain
    except ImportError:
        raise UnavailableError("this build has no deltasync.squash; fetch the chain instead") from None
    budget = SquashBudget() if limits is None else SquashBudget(chain_bytes=limits[0], words=limits[1],
                                                                output_bytes=limits[2], seconds=limits[3])
    chain = [parse_manifest(m) for m in manifests]
    encoded = squash_chain(chain, blobs.__getitem__, budget=budget)
    return encoded.manifest.to_json(), encoded.blobs
