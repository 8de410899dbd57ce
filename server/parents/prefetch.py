"""Prefetch: a relay follows its parent's event stream and pulls every new version at once.

On each announced version the relay takes the manifest from the event (or fetches
it when the event does not carry it), checks its signature when it holds a key, and
starts fetching every blob it lacks, at most ``concurrency`` at a time per model stream
(so a large keyframe of one stream never holds up a small delta of another). It
announces the version to its own children (head, SSE, long-polls) once every blob
is on disk or its fetch is under way: a child's request then joins that fetch
(coalescing) and receives bytes as they arrive (cut-through), so a version flows
down the tree at about one round trip per tier plus one transfer, without waiting
for any subscriber.

The stream is followed from the most preferred healthy parent; when it breaks or
stays silent past three heartbeats, the next parent is followed. While following a
fallback, the relay goes back to a more preferred parent as soon as that one's
cool-down is over and it answers. On every
(re)connect the parent first sends each model's head, so versions committed while
disconnected are caught up: the relay walks back from the parent's head through
the parent links to what it already has (at most ``retention`` versions).

A ``blob`` hint on the stream (the parent started receiving a large blob: an upload at the origin,
or a hinted fetch at a relay) starts a fetch of that blob at once, at most ``HINTED_MAX`` at a time
and only when the blob fits the cache beside what is pinned: the fetch follows the parent's copy
as it arrives (cut-through), and this relay hints its own children in turn. When the version
naming the blob comes, its blob is stored or on its way already. The hint is a parent's word
only: the blob must still hash to its id, its size is the first answer's (provisional until a
manifest gives it), and, on a relay holding a key, its digest is compared with the signed
manifest's once one names it (``BlobFetcher.check_stored``).
"""

from __future__ import annotations

import asyncio
import logging
import time


from deltasync.errors import DeltaSyncError, FormatError, NotFoundError, UpstreamError, UpstreamTimeout
from deltasync.blob import BLOB_ID_RE
from deltasync.manifest import MODEL_RE, Manifest, parse_manifest
from deltasync.retry import RETRY_BACKOFF, describe, retry
from deltasync.sse import SSEDecoder

from .catalog import Catalog
from ..config import Timeouts
from ..events import EventHub
from .fetcher import BlobFetcher
from ..metrics import Metrics
from ..storage.store import DiskStore
from .upstream import NETWORK_ERRORS, Upstream

log = logging.getLogger("deltasync.server.prefetch")
timeline = logging.getLogger("deltasync.timeline")  # time.monotonic() stamps: benchmarks/step_timeline.py

#: hinted fetches running at once (more hints meanwhile are ignored: the version's own fetch gets those blobs)
HINTED_MAX = 8
#: the most of the cache's budget the hinted fetches running may hold together (hints are unsigned)
HINT_SHARE = 0.25


class Prefetcher:
    def __init__(self, *, store: DiskStore, catalog: Catalog, upstream: Upstream, fetcher: BlobFetcher,
                 hub: EventHub, metrics: Metrics, timeouts: Timeouts, retention: int, concurrency: int = 8,
                 hinted_fetch: bool = True) -> None:
        self.hinted_fetch = hinted_fetch  # act on the parent's ``blob`` hints
        self.store = store
        self.catalog = catalog
        self.upstream = upstream
        self.fetcher = fetcher
        self.hub = hub
        self.metrics = metrics
        self.timeouts = timeouts
        self.retention = retention
        # Fetch slots per model stream: a big keyframe (say the side stream M.kf) must not hold
        # every slot while the next small delta of M waits behind it.
        self._concurrency = concurrency
        self._slots: dict[str, asyncio.Semaphore] = {}
        self.parent_heads: dict[str, int] = {}
        self._inline: dict[tuple[str, int], dict] = {}  # manifests that came with events, not yet used
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        self.following: str | None = None
        self._hinted: dict = {}  # InflightBlob of each hinted fetch still running -> its hinted size

    def start(self) -> None:
        self._spawn(self._follow_forever(), "prefetch-follow")

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def lag(self, model: str) -> int:
        parent = self.parent_heads.get(model)
        if parent is None:
            return 0
        own = self.store.head(model)
        return parent - own if own is not None else parent + 1

    # -- following the parent's events -----------------------------------------------------
    async def _follow_forever(self) -> None:
        def on_retry(n: int, e: BaseException, delay: float) -> None:
            if n & (n - 1) == 0:
                log.warning("no parent's event stream can be followed (%s); retrying in %.1f s", describe(e), delay)

        def again(e: BaseException) -> bool:
            # whatever a parent's stream did to this loop, the relay keeps following: only a
            # cancellation (shutting down) ends it
            if isinstance(e, asyncio.CancelledError):
                return False
            if not isinstance(e, UpstreamError):
                log.error("following the parents' event streams failed unexpectedly (%s); reconnecting",
                          describe(e), exc_info=e)
            return True

        while True:
            # one pass over the parents, best first; a stream that ended is followed again after a pause
            await retry(self._follow_best, backoff=RETRY_BACKOFF, attempts=None, again=again, on_retry=on_retry)
            await asyncio.sleep(RETRY_BACKOFF.base)

    async def _follow_best(self) -> None:
        try:
            await self.upstream.each_parent(self._follow, what="the event stream")
        finally:
            self.following = None

    async def _follow(self, parent: str) -> None:
        async with self.upstream.events_request(parent, read_timeout=3 * self.timeouts.heartbeat) as resp:
            if resp.status != 200:
                raise UpstreamError(f"events answered {resp.status}")
            self.following = parent
            self.upstream.mark_ok(parent)
            log.info("following events of %s", parent)
            decoder = SSEDecoder()
            preferred = self.upstream.parents.index(parent)
            loop = asyncio.get_running_loop()
            recheck = loop.time() + self.timeouts.parent_cooldown
            # A live parent sends at least a heartbeat this often; silence past it is that parent's
            # fault. The bound is our own: when aiohttp's chunked parser fails on a mangled size line
            # (aiohttp 3.14), it closes the connection and drops its sock_read timer without telling
            # the body's reader, so a read waiting then waits forever (one started after the close
            # raises RuntimeError, which ``Upstream.request`` turns into UpstreamError).
            silence = 3 * self.timeouts.heartbeat
            while True:
                if preferred and loop.time() >= recheck:
                    recheck = loop.time() + self.timeouts.parent_cooldown
                    if self.upstream.candidates()[0] != parent:
                        log.info("leaving %s for a more preferred parent", parent)
                        return
                try:
                    async with asyncio.timeout(silence):
                        chunk = await resp.content.readany()
                except TimeoutError:
                    raise UpstreamTimeout(f"the event stream of {parent} sent nothing for {silence:g} s "
                                          f"(heartbeats are due every {self.timeouts.heartbeat:g} s)") from None
                if not chunk:  # a parent's stream never ends while it runs: a cut one is that parent's fault
                    raise UpstreamError(f"the event stream of {parent} ended")
                for ev in decoder.feed(chunk):
                    if ev.event == "blob":
                        try:
                            self.hinted(ev.json())
                        except FormatError as e:
                            log.warning("ignoring a blob hint from %s: %s", parent, e)
                    elif ev.event in ("head", "version"):
                        data = ev.json()
                        model, version = data.get("model"), data.get("version")
                        if isinstance(model, str) and MODEL_RE.match(model) and isinstance(version, int):
                            self.want(model, version, data.get("manifest"), head=ev.event == "head")

    def hinted(self, data: object) -> None:
        """The parent is receiving a blob (its ``blob`` hint): start fetching it, when there is room."""
        if not self.hinted_fetch or not isinstance(data, dict):
            return
        blob_id, size = data.get("id"), data.get("size")
        if not (isinstance(blob_id, str) and BLOB_ID_RE.match(blob_id) and isinstance(size, int) and size >= 0):
            log.warning("ignoring a malformed blob hint from the parent: %r", data)
            return
        self._hinted = {b: n for b, n in self._hinted.items() if not b.finished}
        if self.store.has_blob(blob_id) or self.fetcher.inflight(blob_id) is not None:
            return
        if len(self._hinted) >= HINTED_MAX:
            self.metrics.inc("hints_refused")
            return
        budget = self.store.budget
        if budget is not None and size > budget - self.store.pinned_bytes:
            log.debug("hinted blob %s (%d bytes) does not fit beside what is pinned; not fetched", blob_id, size)
            return
        # hints are unsigned (anyone with a publish token can declare an upload of any size): together they may
        # hold at most HINT_SHARE of the cache, so a signed version's blobs always find room beside them
        hinted = sum(self._hinted.values())
        if budget is not None and hinted + size > HINT_SHARE * budget:
            self.metrics.inc("hints_refused")
            log.info("hinted blob %s (%d bytes): hints would hold over %d%% of the cache; not fetched", blob_id,
                     size, round(100 * HINT_SHARE))
            return
        try:
            blob, started = self.fetcher.get(blob_id, hinted=True)
        except DeltaSyncError as e:  # shutting down, or the negative cache
            log.debug("hinted blob %s: %s", blob_id, e)
            return
        if started:
            self.metrics.inc("hinted_fetches")
            timeline.info("mono=%.6f hinted %s", time.monotonic(), blob_id)
            self._hinted[blob] = size
            self.hub.hint(blob_id, size)  # our children may follow our copy in turn

    # -- syncing models --------------------------------------------------------------------
    def want(self, model: str, version: int, manifest: dict | None = None, *, head: bool = False) -> None:
        """The parent has ``version`` of ``model``: make sure this relay gets it.

        ``head``: the parent's head, sent first on each (re)connect; it replaces what an earlier
        event said even when lower (events are not signed: one mangled on the wire may have named
        a version the parent never had, and every real version below it would be ignored)."""
        known = self.parent_heads.get(model, -1)
        if head and version < known:
            log.warning("parent's head of %s is v%d, not v%d as an earlier event said; following v%d", model,
                        version, known, version)
            self.parent_heads[model] = version
            return
        if version <= known:
            return
        log.debug("parent has %s v%d (manifest %s)", model, version, "inline" if manifest else "not inline")
        timeline.info("mono=%.6f event %s v%d", time.monotonic(), model, version)
        self.parent_heads[model] = version
        if isinstance(manifest, dict):
            for key in [k for k in self._inline if k[0] == model]:
                del self._inline[key]  # keep only the newest per model
            self._inline[(model, version)] = manifest
        ev = self._wake.get(model)
        if ev is None:
            ev = self._wake[model] = asyncio.Event()
            self._spawn(self._model_worker(model, ev), f"prefetch-{model}")
        ev.set()

    async def _model_worker(self, model: str, wake: asyncio.Event) -> None:
        def on_retry(n: int, e: BaseException, delay: float) -> None:
            log.warning("prefetch of %s v%d failed (%s); retrying in %.1f s", model, self.parent_heads[model],
                        describe(e), delay)

        def again(e: BaseException) -> bool:
            return isinstance(e, (DeltaSyncError, *NETWORK_ERRORS))

        while True:
            await wake.wait()
            wake.clear()
            # each try aims at the parent's newest head, which may have moved on since the last
            await retry(lambda: self._sync(model, self.parent_heads[model]), backoff=RETRY_BACKOFF, attempts=None,
                        again=again, on_retry=on_retry)

    async def _sync(self, model: str, target: int) -> None:
        head = self.store.head(model)
        if head is not None and head >= target:
            return
        chain: list[Manifest] = []
        v: int | None = target
        while v is not None:
            try:
                m = await self._manifest(model, v)
            except NotFoundError:
                if not chain:
                    raise
                break  # an older version the parent no longer has: start from what we have
            chain.append(m)
            if m.kind == "keyframe" or len(chain) >= self.retention:
                break
            if head is not None and m.parent is not None and m.parent <= head:
                break
            v = m.parent
        log.debug("%s v%d: %d manifest(s) in hand", model, target, len(chain))
        for m in reversed(chain):
            if (h := self.store.head(model)) is not None and m.version <= h:
                continue
            await self._make_servable(m)
            log.debug("%s v%d: every blob stored or being fetched", model, m.version)
            if self.store.announce(model, m.version):
                info = self.store.info(model, m.version)
                self.metrics.inc("versions")
                self.hub.publish(info, m.to_json())
                timeline.info("mono=%.6f announced %s v%d", time.monotonic(), model, m.version)
                log.info("announced %s v%d (%s, %d blobs, %d bytes)", model, m.version, m.kind, len(m.blobs),
                         m.total_bytes)

    async def _manifest(self, model: str, version: int) -> Manifest:
        obj = self._inline.pop((model, version), None)
        if obj is not None and self.store.info(model, version) is None:
            try:
                m = parse_manifest(obj, verifier=self.upstream.verifier, records=self.upstream.table_check)
                if m.model == model and m.version == version:
                    await self.catalog.put(m)
                    self.metrics.inc("manifest_fetches")
                    return m
                log.error("event for %s v%d carried the manifest of %s v%d; fetching it instead", model, version,
                          m.model, m.version)
            except DeltaSyncError as e:
                log.error("manifest of %s v%d in the event stream refused: %s", model, version, e)
        return await self.catalog.manifest(model, version)

    async def _make_servable(self, m: Manifest) -> None:
        """Return once every blob of ``m`` is on disk or being fetched (fetches continue in the background)."""
        self.fetcher.expect(m.blobs)  # sizes (and, verified, digests) a parent's answer must match
        waits = []
        for b in m.blobs:
            if self.store.has_blob(b.id) and await self.fetcher.check_stored(b):
                self.store.touch(b.id)
                continue
            started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            slots = self._slots.get(m.model)
            if slots is None:
                slots = self._slots[m.model] = asyncio.Semaphore(self._concurrency)
            self._spawn(self._pull_blob(b.id, started, slots), f"prefetch-blob-{b.id}")
            waits.append(started)
        if waits:
            results = await asyncio.gather(*waits, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r

    async def _pull_blob(self, blob_id: str, started: asyncio.Future[None], slots: asyncio.Semaphore) -> None:
        try:
            async with slots:
                if self.store.has_blob(blob_id):
                    started.set_result(None)
                    return
                blob, _ = self.fetcher.get(blob_id)
                blob.attach()
                try:
                    # announced only once our disk holds room for it (the size is known after preallocating)
                    await blob.wait_size(self.timeouts.first_byte)
                    started.set_result(None)  # a child asking now joins this fetch
                    await blob.wait_done(self.timeouts.read * 4)
                finally:
                    blob.detach()
        except asyncio.CancelledError:
            if not started.done():
                started.cancel()
            raise
        except Exception as e:  # any failure must reach the version waiting on ``started``
            if not started.done():
                started.set_exception(e)
            else:
                log.warning("prefetch of blob %s failed after it started: %s", blob_id, e)
