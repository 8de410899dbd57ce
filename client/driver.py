"""The I/O driver: runs the pure :class:`~deltasync.syncmachine.SyncMachine` on an asyncio loop.

It does what the machine's actions say with the :class:`~deltasync.client.http.HttpClient`
(which owns failover across the listed servers) and a decode thread, and sends the
results back as events. It never touches the live tensors and never takes the engine's
lock: a prepared step goes into the :class:`~deltasync.client.ready.ReadyQueue`; apply
results come back through :meth:`SyncDriver.post` (thread-safe).

Every head and manifest body is parsed and verified inside the client's failover
loop (``HttpClient.get_head(parse=)``, ``fetch_manifest``): a source serving a body
that is not JSON, does not parse or has a bad signature is that source's fault, and
the next source is tried. The driver also sets the client's ``check_manifest`` (when
unset) so other head reads through the same client (``Subscriber.head_version``,
``subscribe --once``) fail over the same way. Its timeouts (``Timeouts``: connect, TTFB,
read, hedge, cool-down) are the ``Subscriber``'s ``timeouts=``; the cool-downs are
shared with every other client of the process that lists the same URLs.

A source that lags is not an error: when the source answering the long-polls has had
nothing newer for ``behind_after`` seconds (default two long-polls), the driver asks the
other listed sources' heads once, and if one is ahead it marks the quiet source failed (its
usual cool-down), so the next reads go to the one ahead.

One blocking action runs at a time, as a task; when the machine supersedes it (an apply
failed, say), the task is cancelled and its result, if any, ignored by ticket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from urllib.parse import quote

import aiohttp

from deltasync import syncmachine as sm
from deltasync.apply import prepare_delta
from deltasync.conditioned import CODING_HISTORY
from deltasync.errors import DeltaSyncError, IntegrityError, NotFoundError, SignatureError
from deltasync.history import REBUILD_MAX, HistoryKeeper, StateHistory, history_meta
from deltasync.keyframe import load_keyframe
from deltasync.manifest import Manifest, parse_manifest
from deltasync.planner import walk_parents
from deltasync.signing import Verifier

from .historychain import take_in_chain
from .http import MAX_MANIFEST, HttpClient
from .livestate import LiveState
from .ready import ReadyQueue, ReadyStep

__all__ = ["SyncDriver"]

log = logging.getLogger("deltasync.client.driver")
#: One line per step on the critical path, stamped with ``time.monotonic()`` (CLOCK_MONOTONIC, the same clock in
#: every process of the machine): benchmarks/step_timeline.py lines them up. Silent unless this logger is enabled
#: (``DELTASYNC_TIMELINE=1`` for ``deltasync subscribe``).
timeline = logging.getLogger("deltasync.timeline")

#: How long a squashed catch-up delta is waited for: this plus this per version it spans, at most
#: ``squash_timeout``. A chain of small deltas is fetched in well under that.
SQUASH_WAIT_BASE = 0.5
SQUASH_WAIT_PER_VERSION = 0.1
#: After a squash was not ready in time, this many seconds of chain walking before asking again.
SQUASH_PAUSE = 10.0
#: A long-poll answered "nothing newer" sooner than this (seconds; at most half the poll) was not held: early.
EARLY_ANSWER = 1.0


class SyncDriver:
    """Runs one machine for one model stream. Create, ``await start()``, ``await close()``; all on one loop."""

    def __init__(self, machine: sm.SyncMachine, client: HttpClient, live: LiveState, queue: ReadyQueue, *,
                 verifier: Verifier | bytes | None, notify: Callable[[str, int | None, str, BaseException | None], None],
                 download_concurrency: int = 4, squash_timeout: float = 15.0, behind_after: float | None = None) -> None:
        self.machine, self.client, self.live, self.queue = machine, client, live, queue
        # a source that answers "nothing newer" this long (default: two long-polls) while another
        # listed source has a newer head is put down like a failed one (a lagging relay is not an error)
        self.behind_after = 2 * client.timeouts.poll if behind_after is None else behind_after
        self._quiet_since: float | None = None  # when the source last had something newer
        self.verifier = verifier  # what manifests must verify with; None: not verified (digests not checked)
        self.notify = notify  # tells on_event (refetch, resync, error); runs on the loop thread, no lock held
        self.download_concurrency = max(1, download_concurrency)
        self.squash_timeout = squash_timeout
        if client.check_manifest is None:  # every head/manifest read through this client verifies
            client.check_manifest = self._check_body
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deltasync-decode")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.changed: asyncio.Event | None = None  # set on every delivery and apply result
        self._events: asyncio.Queue | None = None
        self._main: asyncio.Task | None = None
        self._work: asyncio.Task | None = None
        self._squash_not_before = 0.0  # loop time before which no squash is asked for (one was not ready)
        # the history-coded stream's history at each version prepared (docs/FORMAT.md §4.5); the decode thread only
        self.histories = HistoryKeeper(lambda: self.live.applier.layout())

    # -- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self, trusted: int | None) -> None:
        self.loop = asyncio.get_running_loop()
        self.changed = asyncio.Event()
        self._events = asyncio.Queue()
        actions = self.machine.send(sm.Started(trusted=trusted))
        pending = self.machine.pending
        if isinstance(pending, sm.CheckInitial):  # before start() returns, as the subscriber always did
            actions = self.machine.send(await self._check_initial(pending))
        self._main = asyncio.create_task(self._run(actions), name=f"deltasync-driver-{self.machine.config.model}")

    async def close(self) -> None:
        for task in (self._main, self._work):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._main = self._work = None
        self.pool.shutdown(wait=False, cancel_futures=True)

    def post(self, event: object) -> None:
        """Send an event from any thread (the engine's side: Applied, ApplyFailed)."""
        loop = self.loop
        if loop is None or loop.is_closed() or self._events is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is shutting down
            loop.call_soon_threadsafe(self._events.put_nowait, event)

    # -- the loop ----------------------------------------------------------------------------------------------
    async def _run(self, actions: list[object]) -> None:
        assert self._events is not None
        self._dispatch(actions)
        while True:
            event = await self._events.get()
            if isinstance(event, (sm.Applied, sm.ApplyFailed)):
                self.changed.set()
            try:
                actions = self.machine.send(event)
            except Exception as e:  # a bug in the machine: be loud, the subscriber stops following
                log.exception("%s: the sync machine failed on %s", self.machine.config.model, type(event).__name__)
                self.notify("error", self.machine.pipeline_version, f"sync machine failed: {type(e).__name__}: {e}", e)
                raise
            self._dispatch(actions)

    def _dispatch(self, actions: list[object]) -> None:
        for a in actions:
            if isinstance(a, sm.Deliver):
                self.queue.push(a.payload)
                self.changed.set()
            elif isinstance(a, sm.Notify):
                self.notify(a.kind, a.version, a.detail, a.error)
            else:
                if self._work is not None and not self._work.done():
                    self._work.cancel()  # superseded: its result would be ignored anyway
                self._work = asyncio.create_task(self._perform(a))

    async def _perform(self, a: object) -> None:
        try:
            event = await self._do(a)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every failure goes to the machine, which reports it and backs off
            event = sm.SourceFailed(ticket=a.ticket, error=e)
        self._events.put_nowait(event)

    async def _do(self, a: object) -> object:
        if isinstance(a, sm.PollHead):
            return await self._head(a)
        if isinstance(a, sm.WalkChain):
            return await self._walk(a)
        if isinstance(a, sm.FetchManifests):
            got = await asyncio.gather(*(self._manifest_or_none(a.stream, v) for v in a.versions))
            return sm.ManifestsVerified(ticket=a.ticket, stream=a.stream,
                                        manifests={v: m for v, m in zip(a.versions, got) if m is not None},
                                        missing=frozenset(v for v, m in zip(a.versions, got) if m is None))
        if isinstance(a, sm.FetchSquashed):
            return await self._squashed(a)
        if isinstance(a, sm.FetchBlobs):
            return await self._blobs(a)
        if isinstance(a, sm.Prepare):
            return await self._prepare(a)
        if isinstance(a, sm.Wait):
            await asyncio.sleep(a.seconds)
            return sm.Woke(ticket=a.ticket)
        if isinstance(a, sm.CheckInitial):
            return await self._check_initial(a)
        raise TypeError(f"the driver cannot do {a!r}")

    # -- actions -----------------------------------------------------------------------------------------------
    def _check_body(self, body: bytes) -> Manifest:
        return parse_manifest(body, verifier=self.verifier)

    def parse(self, body: bytes, stream: str, version: int) -> Manifest:
        m = parse_manifest(body, verifier=self.verifier)
        if m.model != stream or m.version != version:
            raise IntegrityError(f"asked for {stream} v{version}, the server sent {m.model} v{m.version}")
        return m

    async def _head(self, a: sm.PollHead) -> sm.HeadSeen:
        t = self.client.timeouts
        def parse(body: bytes, version: int) -> Manifest:
            return self.parse(body, a.stream, version)

        early = False
        if a.after is None:
            head = await self.client.get_head(a.stream, parse=parse)
        else:
            if a.probe:  # the last answer was an old head at once: is another listed source ahead?
                await self._check_not_behind(a.stream, a.after, force=True)
            asked = time.monotonic()
            try:
                head = await asyncio.wait_for(self.client.get_head(a.stream, after=a.after, parse=parse),
                                              t.poll + max(t.read, t.ttfb) + t.connect)
            except asyncio.TimeoutError:  # nothing newer within the long-poll: ask again
                await self._check_not_behind(a.stream, a.after)
                return sm.HeadSeen(ticket=a.ticket, stream=a.stream, version=a.after)
            if head is not None and head.version <= a.after:
                # a long-poll is held until something newer commits: "nothing newer" at once is a source
                # replaying an old head (or with broken long-polls); the machine backs off and probes
                early = time.monotonic() - asked < min(EARLY_ANSWER, t.poll / 2)
                await self._check_not_behind(a.stream, a.after)
            elif head is not None:
                self._quiet_since = None
                timeline.debug("mono=%.6f woke %s v%d cpu=%.3f", time.monotonic(), a.stream, head.version, time.process_time())
        if head is None:
            return sm.HeadSeen(ticket=a.ticket, stream=a.stream, version=None)
        m = None
        if head.body is not None:  # verified in the failover loop; parse again only if that was skipped
            m = head.checked if isinstance(head.checked, Manifest) else self.parse(head.body, a.stream, head.version)
        return sm.HeadSeen(ticket=a.ticket, stream=a.stream, version=head.version, manifest=m, early=early)

    async def _check_not_behind(self, stream: str, have: int, *, force: bool = False) -> None:
        """The source had nothing newer than ``have``: once that has lasted ``behind_after`` seconds (at once
        with ``force``: it answered a long-poll at once with an old head), ask the other listed sources' heads
        (a plain GET each, bounded by the client's timeouts); if one is ahead, the quiet source is marked failed
        so the next reads go to the others."""
        now = time.monotonic()
        if self._quiet_since is None:
            self._quiet_since = now
        quiet, current = self.client.last_url, now - self._quiet_since
        if len(self.client.urls) < 2 or quiet is None or (current < self.behind_after and not force):
            return
        self._quiet_since = now  # one probe per ``behind_after``
        t = self.client.timeouts
        for url in self.client.urls:
            if url == quiet or self.client.failover.cooling(url, now):
                continue
            try:
                async with asyncio.timeout(t.ttfb + t.read):
                    path = f"{url}/v1/models/{quote(stream)}/head"
                    r = await self.client._open("GET", path)
                    async with r:
                        if r.status != 200:
                            continue
                        body = await self.client._body(r, path, limit=MAX_MANIFEST)
                # what the other source can prove, not what its header claims (a mirror claiming a head far
                # ahead would otherwise put an honest source down: TUF's fast-forward)
                m = self._check_body(body)
                if m.model != stream:
                    continue
                shown = str(m.version)
            except (DeltaSyncError, OSError, asyncio.TimeoutError, aiohttp.ClientError):
                continue
            if int(shown) > have:
                why = f"behind: v{have} for {current:.0f} s while {url} has v{shown}"
                log.warning("%s is %s; reading from the next source", quiet, why)
                self.client.failover.failed(quiet, time.monotonic(), why)
                return

    async def _manifest_or_none(self, stream: str, version: int) -> Manifest | None:
        try:
            return await self.client.fetch_manifest(stream, version, lambda body: self.parse(body, stream, version))
        except NotFoundError:
            return None

    async def _walk(self, a: sm.WalkChain) -> sm.ManifestsVerified:
        fetched: dict[int, Manifest] = {}

        async def fetch(v: int) -> Manifest | None:
            m = await self._manifest_or_none(a.stream, v)
            if m is not None:
                fetched[v] = m
            return m

        walk = await walk_parents(fetch, a.top, floor=a.floor, limit=a.limit, known=a.known)
        return sm.ManifestsVerified(ticket=a.ticket, stream=a.stream, manifests={**fetched, **{m.version: m for m in walk.chain}})

    async def _squashed(self, a: sm.FetchSquashed) -> sm.SquashFetched:
        model = self.machine.config.model
        # A server builds a squash on demand, and its first build loads the codec (seconds). Waiting is
        # only worth what the chain it saves would cost: a short gap walks the chain soon instead (the
        # build goes on, for next time). The wait is cancelled, not timed out per server, so no server
        # is put in a failover cool-down for being slow to squash.
        budget = min(self.squash_timeout, SQUASH_WAIT_BASE + SQUASH_WAIT_PER_VERSION * (a.end - a.start))
        now = asyncio.get_running_loop().time()
        if now < self._squash_not_before:  # the last one was not ready: follow the chain for a while
            return sm.SquashFetched(ticket=a.ticket, manifest=None, detail="the last squash was not ready in time")
        try:
            body = await asyncio.wait_for(self.client.get_squashed(model, a.start, a.end, timeout=self.squash_timeout),
                                          budget)
            m = parse_manifest(body, verifier=self.verifier)
        except asyncio.TimeoutError:
            log.info("%s: squashed delta v%d→v%d not ready within %.1f s; walking the chain", model, a.start, a.end,
                     budget)
            self._squash_not_before = asyncio.get_running_loop().time() + SQUASH_PAUSE
            return sm.SquashFetched(ticket=a.ticket, manifest=None, detail=f"not ready within {budget:.1f} s")
        except SignatureError as e:
            log.info("%s: squashed delta v%d→v%d is not signed with our key (%s); walking the chain", model, a.start, a.end, e)
            return sm.SquashFetched(ticket=a.ticket, manifest=None, detail=str(e))
        except DeltaSyncError as e:
            log.info("%s: no squashed delta v%d→v%d (%s); walking the chain", model, a.start, a.end, e)
            return sm.SquashFetched(ticket=a.ticket, manifest=None, detail=str(e))
        return sm.SquashFetched(ticket=a.ticket, manifest=m)

    async def _fetch_blobs(self, m: Manifest, only) -> dict[str, bytes]:
        refs = [r for r in m.blobs if only is None or r.id in only]
        sem = asyncio.Semaphore(self.download_concurrency)

        async def one(ref) -> tuple[str, bytes]:
            async with sem:
                # a verified manifest's digests are checked inside the failover loop (a crafted blob: next source)
                digest = ref.digest if self.verifier is not None else None
                return ref.id, await self.client.get_blob(ref.id, ref.size, digest=digest)

        return dict(await asyncio.gather(*(one(r) for r in refs)))

    async def _blobs(self, a: sm.FetchBlobs) -> sm.BlobsReady:
        m = a.manifest
        only = self.live.applier.needed_blobs(m) if m.kind == "delta" else None
        timeline.debug("mono=%.6f blobs-start %s v%d cpu=%.3f", time.monotonic(), m.model, m.version, time.process_time())
        blobs = await self._fetch_blobs(m, only)
        timeline.debug("mono=%.6f blobs-end %s v%d %d cpu=%.3f", time.monotonic(), m.model, m.version,
                       sum(len(b) for b in blobs.values()), time.process_time())
        return sm.BlobsReady(ticket=a.ticket, version=m.version, blobs=(blobs, only))

    async def _prepare(self, a: sm.Prepare) -> sm.StepPrepared:
        blobs, only = a.blobs
        loop = asyncio.get_running_loop()
        common = dict(version=a.version, base=a.base, state_fp=a.state_fp, manifest=a.manifest, generation=a.generation,
                      nbytes=a.manifest.total_bytes, squashed=a.squashed)
        timeline.debug("mono=%.6f prepare-start v%d cpu=%.3f", time.monotonic(), a.version, time.process_time())
        if a.kind == "keyframe":
            state, fps = await loop.run_in_executor(self.pool, load_keyframe, a.manifest, blobs)
            self.histories.keyframe(a.version)
            step = ReadyStep(kind="keyframe", state=state, fps=fps, **common)
        else:
            if a.manifest.coding == CODING_HISTORY and not self.histories.has(a.manifest):
                await self._rebuild_history(a.manifest)
            prepared = await loop.run_in_executor(self.pool, self._prepare_delta, a.manifest, blobs, only)
            step = ReadyStep(kind="delta", prepared=prepared, **common)
        timeline.debug("mono=%.6f prepare-end v%d cpu=%.3f", time.monotonic(), a.version, time.process_time())
        return sm.StepPrepared(ticket=a.ticket, version=a.version, payload=step)

    async def _rebuild_history(self, m: Manifest) -> None:
        """The history a history-coded delta needs, when this end did not keep it (it restarted at a version
        after the stream's last keyframe): the deltas since that keyframe fetched, verified and taken in, in
        order (O(their changes); at most ``REBUILD_MAX`` of them, else a keyframe is the cheaper way back)."""
        since, depth = history_meta(m)
        if not 0 < m.parent - since <= REBUILD_MAX:
            return  # nothing to take in, or too much: at() says what this end holds, and a keyframe follows

        async def fetch(v: int):
            d = await self._manifest_or_none(m.model, v)
            if d is None or d.kind != "delta":
                return d and (d, {}, None)
            only = self.live.applier.needed_blobs(d)
            return d, await self._fetch_blobs(d, only), (set(only) if only is not None else None)

        history = StateHistory(self.live.applier.layout(), since=since, depth=depth)
        why = await take_in_chain(history, m.parent, fetch, pool=self.pool, wanted=self._wanted)
        if why is not None:
            log.info("%s: cannot rebuild the history of v%d (%s); a keyframe will do", m.model, m.version, why)
            return
        log.info("%s: took in v%d..v%d for the history of v%d (%d positions)", m.model, since + 1, m.parent,
                 m.version, len(history))
        self.histories.install(history)

    def _prepare_delta(self, m: Manifest, blobs, only):
        """prepare_delta on the decode thread; a history-coded delta with the history at its parent (steps are
        prepared in chain order), which then takes it in."""
        self.histories.forget(self.machine.live)
        history = self.histories.at(m) if m.coding == CODING_HISTORY else None
        prepared = prepare_delta(m, blobs, only=set(only) if only is not None else None, history=history,
                                 wanted=self._wanted)
        self.histories.took(m, prepared.patches, history)
        return prepared

    @property
    def _wanted(self):
        """The applier's chunk filter (an engine rank: the chunk spans over its rows), or None: every chunk."""
        return getattr(self.live.applier, "wants_chunk", None)

    async def _check_initial(self, a: sm.CheckInitial) -> sm.InitialChecked:
        model = self.machine.config.model
        signed = await self._manifest_or_none(model, a.version)
        ok = await asyncio.get_running_loop().run_in_executor(self.pool, self.live.adopt, a.version, signed)
        if not ok:
            log.warning("%s: the target does not hold v%s (or the servers no longer have it); resyncing", model, a.version)
        return sm.InitialChecked(ticket=a.ticket, ok=ok)
