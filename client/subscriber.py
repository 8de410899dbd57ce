"""The subscriber: keeps live tensors (a dict or an ``nn.Module``, CPU or GPU) at the stream's head.

::

    sub = ThreadedSubscriber(["http://relay-a:8701", "http://relay-b:8701"], "policy", model, verifier=key)
    sub.start()
    while serving:
        run_batch(model)
        sub.apply_pending()        # between batches: patch in place, verified; returns the version

or, in asyncio code, ``Subscriber`` with ``await sub.start()`` / ``sub.apply_pending()`` /
``await sub.close()``. ``auto=True`` applies each version as soon as it is ready, for
engines without a pause point (wrap forward passes in ``with sub.hold():`` to keep
them from overlapping a patch).

Three parts, each in its own module::

    HttpClient ─ SyncDriver (asyncio; runs the pure SyncMachine) ─ ReadyQueue ─ apply_pending ─ LiveState ─ Applier ─ tensors
                 client/driver.py   deltasync/syncmachine.py       client/ready.py              client/livestate.py  client/appliers.py

Background (the driver, on the event loop): long-poll the head, walk the parent
chain (concurrently), plan the cheapest catch-up (the chain of deltas, the relays'
squashed delta, keyframes inline and in the side stream,
:mod:`deltasync.client.streams`), download blobs in parallel (hash-checked; failover
across the listed servers) and decode them on a worker thread. Prepared steps go into
the ready queue. The driver never touches the live tensors and never takes the
engine's lock, so downloads go on while the engine is inside ``hold()``.

Apply (``apply_pending``, on the caller's thread; or, with ``auto=True``, on the
subscriber's own applier thread, which waits for any ``hold()`` to end): the applier
checks the tracked fingerprints against the delta's base, patches in place and
verifies every touched tensor (incrementally, or fully with ``verify="full"``); the
state fingerprint must equal the *signed* manifest's (a relay's squashed delta is
unsigned: its tensor records must hash to the signed target's state before it is
used); all tensors are scrubbed every ``scrub_every`` applies. A failed apply leaves
the old version in place (rolled back); the version's blobs are fetched again (from
the next server), and after ``max_refetch`` failures the subscriber resyncs from a
keyframe. The engine is told through ``on_event`` (called with no lock held, from the
applying thread or the event-loop thread) and :attr:`status`; it never runs a
half-applied version.

Sharded engines: pass an :class:`~deltasync.client.appliers.Applier` as ``target``;
``apply_pending(up_to=...)`` and ``ready_steps()`` let the ranks of a group agree on
how far to apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from deltasync import syncmachine as sm
from deltasync.errors import NotFoundError
from deltasync.manifest import release_columns
from deltasync.signing import Verifier

from .appliers import as_applier
from .driver import SyncDriver
from deltasync.errors import UpstreamTimeout as SyncTimeout
from .http import HttpClient, Timeouts
from .livestate import LiveState, Told
from .loop import LoopThread
from .ready import ReadyQueue
from .streams import keyframe_stream

log = logging.getLogger("deltasync.client.subscriber")

MAX_CHAIN = sm.MAX_CHAIN


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncEvent:
    """Told to ``on_event``: ``kind`` is one of applied, rollback, refetch, resync, scrub, error, stale (a source
    answered a long-poll at once with an old head: backing off, asking the other sources)."""

    kind: str
    version: int | None
    detail: str = ""
    error: BaseException | None = None
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncStatus:
    """A snapshot of a subscriber, for an engine's metrics."""

    model: str
    version: int | None  # applied to the live tensors
    head: int | None  # newest version seen on a server
    ready: int  # versions downloaded and decoded, waiting for apply_pending
    bytes_received: int
    applies: int
    rollbacks: int
    refetches: int
    resyncs: int
    scrubs: int
    verify: str  # "ok" | "pending" | "rolled-back" | "mismatch"
    last_error: str | None
    last_apply_s: float
    server: str | None  # the URL that answered last

    @property
    def lag(self) -> int | None:
        if self.head is None or self.version is None:
            return None
        return max(0, self.head - self.version)


class Subscriber:
    """Asyncio subscriber. ``apply_pending`` and ``hold`` are synchronous and thread-safe; the event loop
    never waits for them (see the module docstring)."""

    def __init__(self, urls: str | Sequence[str], model: str, target, *, verifier: Verifier | bytes | None = None,
                 auto: bool = False,
                 verify: str = "incremental", scrub_every: int = 0, version: int | None = None,
                 timeouts: Timeouts | None = None, max_ready: int = 8, download_concurrency: int = 4,
                 use_squash: bool = True, squash_min_chain: int = 3, squash_timeout: float = 15.0, max_refetch: int = 1,
                 on_event: Callable[[SyncEvent], None] | None = None,
                 on_applied: Callable[[int], None] | None = None,
                 ssl: ssl_module.SSLContext | None = None, read_token: str | None = None,
                 key: Verifier | bytes | None = None) -> None:
        # ``verifier``: what manifests must verify with: the publisher's public key(s) (``Ed25519Verifier`` /
        # ``KeySet``) or a raw HMAC secret; ``ssl``: TLS context for https sources; ``read_token``: a scoped read
        # token. ``key``: the old name of ``verifier`` (deprecated)
        if key is not None:
            if verifier is not None:
                raise TypeError("Subscriber: pass verifier= (key= is its old name), not both")
            warnings.warn("Subscriber(key=...) is deprecated: pass verifier=", DeprecationWarning, stacklevel=2)
            verifier = key
        self.model = model
        self.target = target
        self.auto = auto
        self.on_event = on_event
        self.on_applied = on_applied
        self.timeouts = timeouts or Timeouts()
        self.client = HttpClient(urls, timeouts=self.timeouts, ssl=ssl, read_token=read_token)
        self.live = LiveState(as_applier(target), version=version, verify=verify, scrub_every=scrub_every)
        self.queue = ReadyQueue()
        self.machine = sm.SyncMachine(sm.SyncConfig(
            model=model, side_model=keyframe_stream(model), use_squash=use_squash, squash_min_chain=squash_min_chain,
            max_refetch=max_refetch, max_ready=max(1, max_ready)))
        self.driver = SyncDriver(self.machine, self.client, self.live, self.queue, verifier=verifier, notify=self._tell,
                                 download_concurrency=download_concurrency, squash_timeout=squash_timeout)
        self._trusted = version
        self._lock = threading.RLock()  # the engine's lock: hold() and apply_pending(); never taken by the loop
        self._last_error: str | None = None
        self._applied_manifest = None  # the last applied step's manifest: its columns let go at the next one
        self._started = False
        self._closing = threading.Event()
        self._applier: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start following the head in the background (returns at once, after checking a trusted version)."""
        if self._started:
            return
        self._started = True
        await self.driver.start(self._trusted)
        if self.auto:
            self._applier = threading.Thread(target=self._auto_apply, name=f"deltasync-apply-{self.model}", daemon=True)
            self._applier.start()

    async def close(self) -> None:
        self._closing.set()
        self.queue.touch()
        await self.driver.close()
        await self.client.close()
        if self._applier is not None:
            await asyncio.to_thread(self._applier.join, 10.0)

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- the engine's side ----------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        return self.live.version

    @property
    def fps(self) -> dict[str, int] | None:
        fps = self.live.fps
        return dict(fps) if fps is not None else None

    @property
    def status(self) -> SyncStatus:
        c, m = self.live.counts, self.machine
        return SyncStatus(
            model=self.model, version=self.live.version, head=m.head, ready=len(self.queue),
            bytes_received=self.client.stats.bytes_in, applies=c["applies"], rollbacks=c["rollbacks"],
            refetches=m.refetches, resyncs=m.resyncs, scrubs=c["scrubs"], verify=self.live.verify_state,
            last_error=self._last_error, last_apply_s=self.live.last_apply_s, server=self.client.last_url)

    @contextlib.contextmanager
    def hold(self):
        """Keep patches out while the block runs (wrap each forward pass in auto mode). Downloads go on."""
        with self._lock:
            yield

    def ready_steps(self) -> list[tuple[int | None, int]]:
        """(base, version) of the steps waiting, oldest first (base None: a keyframe)."""
        return self.queue.steps()

    def apply_pending(self, up_to: int | None = None) -> int | None:
        """Apply every ready version in order (only those <= ``up_to`` when given), in place, verified;
        returns the live version.

        A failed apply leaves the previous version in place (rolled back), tells ``on_event``
        and schedules a refetch or a resync; it does not raise. Raises only when the live
        tensors could not be kept consistent (a keyframe that does not fit, or did not land)."""
        told: list[Told] = []
        posts: list[object] = []
        applied_any, error = False, None
        with self._lock:
            while (step := self.queue.pop(up_to)) is not None:
                if step.generation != self.queue.generation:
                    continue
                out = self.live.apply(step)
                if out.applied and step.manifest is not None:
                    # the manifest before is kept for catch-up plans, not its columns (~15 MB at 70k tensors); not
                    # this one's yet: subscribers in one process share a parsed manifest, and the others apply it next
                    prev, self._applied_manifest = self._applied_manifest, step.manifest
                    if prev is not None and prev is not step.manifest:
                        release_columns(prev)
                told += out.told
                if out.applied:
                    applied_any = True
                    posts.append(sm.Applied(version=step.version, generation=step.generation))
                if out.failure is not None:
                    generation = self.queue.invalidate()
                    posts.append(sm.ApplyFailed(version=step.version, generation=generation, reason=out.failure,
                                                live=self.live.version))
                    error = out.raise_error
                    break
            version = self.live.version
        for t in told:  # no lock held: a callback may call status or apply_pending from any thread
            self._tell(t.kind, t.version, t.detail, t.error)
        if applied_any and error is None and not any(isinstance(p, sm.ApplyFailed) for p in posts):
            self._last_error = None
        for p in posts:
            self.driver.post(p)
        self.queue.touch()
        if applied_any and self.on_applied is not None and version is not None:
            self.on_applied(version)
        if error is not None:
            raise error
        return version

    async def wait_version(self, version: int, timeout: float) -> int:
        """Wait until ``version`` (or newer) is live, applying ready versions as they come (on a worker
        thread, so the loop keeps downloading; unless auto mode applies them). Raises SyncTimeout."""
        deadline = time.monotonic() + timeout
        changed = self.driver.changed
        assert changed is not None, "start() first"
        while True:
            if not self.auto and len(self.queue):
                await asyncio.to_thread(self.apply_pending)
            if self.version is not None and self.version >= version:
                return self.version
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout(version, timeout)
            changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, 0.25))

    def _timeout(self, version: int, timeout: float) -> SyncTimeout:
        return SyncTimeout(f"{self.model}: still at v{self.version} after {timeout:.1f}s waiting for v{version}"
                           + (f" (last error: {self._last_error})" if self._last_error else ""))

    async def sync(self, timeout: float) -> int:
        """Catch up to the head as it is now; returns the live version."""
        return await self.wait_version(await self.head_version(), timeout)

    async def head_version(self) -> int:
        """The newest signed head any listed source can prove (``HttpClient.highest_head``)."""
        head = await self.client.highest_head(self.model)
        if head is None:
            raise NotFoundError(f"{self.model}: the servers have no version yet")
        if head.body is not None:
            self.driver.parse(head.body, self.model, head.version)  # verified, as every head is
        self.driver.post(sm.HeadNoted(version=head.version))
        return head.version

    # -- internals -------------------------------------------------------------------------------
    def _tell(self, kind: str, version: int | None, detail: str = "", error: BaseException | None = None) -> None:
        if kind in ("rollback", "refetch", "resync", "error"):
            (log.warning if kind != "error" else log.error)("%s %s v%s: %s", self.model, kind, version, detail)
        if error is not None:
            self._last_error = f"{type(error).__name__}: {error}"
        if self.on_event is not None:
            try:
                self.on_event(SyncEvent(kind=kind, version=version, detail=detail, error=error))
            except Exception:  # a broken callback must not break the apply path's bookkeeping
                log.exception("on_event callback failed")

    def _auto_apply(self) -> None:
        """Auto mode: apply on this thread as soon as a step is ready; ``hold()`` blocks it, never the loop."""
        while not self._closing.is_set():
            if not self.queue.wait_for_steps(0.5) or self._closing.is_set():
                continue
            try:
                self.apply_pending()
            except Exception:  # told through on_event already; keep following
                log.exception("%s: auto apply failed", self.model)


class ThreadedSubscriber:
    """The subscriber for synchronous engines: the network runs on its own thread; ``apply_pending``
    (and ``wait_version``'s applies) run on the caller's. Every blocking call takes a timeout."""

    def __init__(self, urls: str | Sequence[str], model: str, target, **kwargs) -> None:
        self._io = LoopThread(f"deltasync-subscriber-{model}")
        self._sub = Subscriber(urls, model, target, **kwargs)

    @property
    def subscriber(self) -> Subscriber:
        return self._sub

    def start(self, timeout: float = 60.0) -> None:
        self._io.run(self._sub.start(), timeout)

    def apply_pending(self, up_to: int | None = None) -> int | None:
        return self._sub.apply_pending(up_to)

    def ready_steps(self) -> list[tuple[int | None, int]]:
        return self._sub.ready_steps()

    def hold(self):
        return self._sub.hold()

    def wait_version(self, version: int, timeout: float) -> int:
        """Wait on the caller's thread, applying ready versions here (unless auto mode does)."""
        sub = self._sub
        deadline = time.monotonic() + timeout
        while True:
            if not sub.auto:
                sub.apply_pending()
            if sub.version is not None and sub.version >= version:
                return sub.version
            left = deadline - time.monotonic()
            if left <= 0:
                raise sub._timeout(version, timeout)
            if sub.auto:
                sub.queue.wait(min(left, 0.25))  # the applier thread notifies after each apply
            else:
                sub.queue.wait_for_steps(min(left, 0.25))

    def sync(self, timeout: float) -> int:
        head = self._io.run(self._sub.head_version(), min(timeout, self._sub.timeouts.request) + 5)
        return self.wait_version(head, timeout)

    @property
    def version(self) -> int | None:
        return self._sub.version

    @property
    def status(self) -> SyncStatus:
        return self._sub.status

    def close(self, timeout: float = 10.0) -> None:
        try:
            if self._io.alive:
                self._io.run(self._sub.close(), timeout)
        finally:
            self._io.close()

    def __enter__(self) -> ThreadedSubscriber:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
