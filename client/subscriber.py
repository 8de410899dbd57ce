"""The subscriber: keeps live tensors (a dict or an ``nn.Module``, CPU or GPU) at the stream's head.

::

    sub = ThreadedSubscriber(["http://relay-a:8701", "http://relay-b:8701"], "policy", model, key=key)
    sub.start()
    while serving:
        run_batch(model)
        sub.apply_pending()        # between batches: patch in place, verified; returns the version

or, in asyncio code, ``Subscriber`` with ``await sub.start()`` / ``sub.apply_pending()`` /
``await sub.close()``. ``auto=True`` applies each version as soon as it is ready, for
engines without a pause point (wrap forward passes in ``with sub.hold():`` to keep
them from overlapping a patch).

Background (an asyncio task): long-poll the head, plan the cheapest catch-up
(:func:`deltasync.planner.plan_catchup` over the chain of deltas, the relays'
squashed delta, and keyframes: inline ones and the side stream's,
:mod:`deltasync.client.streams`), download blobs in parallel (each hash-checked;
failover across the listed servers), and decode them on a worker thread
(``prepare_delta`` / ``load_keyframe``). Nothing touches the live tensors until
``apply_pending``.

Apply: ``apply_prepared`` checks the tracked fingerprints against the delta's base,
patches in place, verifies every touched tensor's fingerprint incrementally (or fully,
``verify="full"``), and rolls back on any mismatch. On top of it, the subscriber
checks every state fingerprint against the *signed* manifest (a relay's squashed
delta is unsigned: its tensor records must hash to the signed target's state
fingerprint before it is used), scrubs all tensors every ``scrub_every`` applies,
and on a failed apply: the live tensors are back at the old version, the version's
blobs are fetched again (from the next server), and after ``max_refetch`` failures
the subscriber resyncs from a keyframe. The engine is told through ``on_event``
and :attr:`status`; it never runs a half-applied version.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deltasync.apply import PreparedDelta, apply_prepared, live_tensors, prepare_delta
from deltasync.errors import BaseMismatchError, DeltaSyncError, IntegrityError, NotFoundError, SignatureError
from deltasync.fingerprint import state_fingerprint, state_fingerprint_of, tensor_fingerprint
from deltasync.keyframe import copy_state, load_keyframe
from deltasync.manifest import Manifest, parse_manifest
from deltasync.planner import plan_catchup

from .errors import SyncTimeout
from .http import HttpClient, Timeouts
from .loop import LoopThread
from .streams import keyframe_stream

log = logging.getLogger("deltasync.client.subscriber")

MAX_CHAIN = 256  # manifests walked back from the head when planning a catch-up


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncEvent:
    """Told to ``on_event``: ``kind`` is one of applied, rollback, refetch, resync, scrub, error."""

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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Step:
    kind: str  # "delta" | "keyframe"
    version: int  # version after applying
    base: int | None  # version it applies to (None: keyframe)
    state_fp: str  # signed state fingerprint of ``version``
    prepared: PreparedDelta | None = None
    state: dict[str, torch.Tensor] | None = None  # keyframe tensors (host)
    fps: dict[str, int] | None = None  # keyframe fingerprints
    manifest: Manifest | None = None
    nbytes: int = 0
    generation: int = 0
    squashed: bool = False


class _Reset(Exception):
    """The pipeline was reset while a step was being prepared; drop it."""


class Subscriber:
    """Asyncio subscriber. ``apply_pending`` is synchronous and thread-safe (see the module docstring)."""

    def __init__(self, urls: str | Sequence[str], model: str, target, *, key: bytes | None = None, auto: bool = False,
                 verify: str = "incremental", scrub_every: int = 0, version: int | None = None,
                 timeouts: Timeouts | None = None, max_ready: int = 8, download_concurrency: int = 4,
                 use_squash: bool = True, squash_min_chain: int = 3, squash_timeout: float = 15.0, max_refetch: int = 1,
                 on_event: Callable[[SyncEvent], None] | None = None,
                 on_applied: Callable[[int], None] | None = None) -> None:
        if verify not in ("incremental", "full"):
            raise ValueError("verify must be 'incremental' or 'full'")
        self.model = model
        self.side_model = keyframe_stream(model)
        self.target = target
        self.key = key
        self.auto = auto
        self.verify = verify
        self.scrub_every = scrub_every
        self.timeouts = timeouts or Timeouts()
        self.max_ready = max(1, max_ready)
        self.download_concurrency = download_concurrency
        self.use_squash = use_squash
        self.squash_min_chain = squash_min_chain
        self.squash_timeout = squash_timeout
        self.max_refetch = max_refetch
        self.on_event = on_event
        self.on_applied = on_applied
        self.client = HttpClient(urls, timeouts=self.timeouts)
        self._lock = threading.RLock()  # guards the live tensors, _ready, version/fps
        self._ready: collections.deque[_Step] = collections.deque()
        self._version: int | None = version
        self._fps: dict[str, int] | None = None
        self._trust_initial = version is not None
        self._head: int | None = None
        self._gen = 0
        self._need_keyframe = version is None
        self._failures: dict[int, int] = {}
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Condition | None = None
        self._closing = False
        self._manifests: dict[tuple[str, int], Manifest] = {}
        self._counts = collections.Counter()
        self._verify_state = "pending"
        self._last_error: str | None = None
        self._last_apply_s = 0.0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deltasync-decode")

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start following the head in the background (returns at once)."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        if self._trust_initial:
            await self._adopt_initial()
        self._task = asyncio.create_task(self._run(), name=f"deltasync-subscriber-{self.model}")

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self.client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- the engine's side ----------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        return self._version

    @property
    def fps(self) -> dict[str, int] | None:
        return dict(self._fps) if self._fps is not None else None

    @property
    def status(self) -> SyncStatus:
        c = self._counts
        return SyncStatus(
            model=self.model, version=self._version, head=self._head, ready=len(self._ready),
            bytes_received=self.client.stats.bytes_in, applies=c["applies"], rollbacks=c["rollbacks"],
            refetches=c["refetches"], resyncs=c["resyncs"], scrubs=c["scrubs"], verify=self._verify_state,
            last_error=self._last_error, last_apply_s=self._last_apply_s, server=self.client.last_url)

    @contextlib.contextmanager
    def hold(self):
        """Keep patches out while the block runs (for auto mode: wrap each forward pass)."""
        with self._lock:
            yield

    def apply_pending(self) -> int | None:
        """Apply every ready version in order, in place, verified; returns the live version.

        A failed apply leaves the previous version in place (rolled back), tells
        ``on_event`` and schedules a refetch or a resync; it does not raise. Raises only
        when the live tensors could not be restored (IntegrityError after a keyframe copy)."""
        applied_any = False
        with self._lock:
            while self._ready:
                step = self._ready.popleft()
                if step.generation != self._gen:
                    continue
                if not self._apply_step(step):
                    break  # rolled back; the pipeline was reset (refetch or resync)
                applied_any = True
            version = self._version
        if applied_any:
            self._notify()
            if self.on_applied is not None and version is not None:
                self.on_applied(version)
        return version

    async def wait_version(self, version: int, timeout: float) -> int:
        """Wait until ``version`` (or newer) is live, applying ready versions as they come
        (unless another thread applies them). Raises SyncTimeout."""
        deadline = time.monotonic() + timeout
        assert self._changed is not None, "start() first"
        while True:
            if not self.auto:
                self.apply_pending()
            if self._version is not None and self._version >= version:
                return self._version
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeout(f"{self.model}: still at v{self._version} after {timeout:.1f}s waiting for v{version}"
                                  + (f" (last error: {self._last_error})" if self._last_error else ""))
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))

    async def sync(self, timeout: float) -> int:
        """Catch up to the head as it is now; returns the live version."""
        head = await self.client.get_head(self.model)
        if head is None:
            raise NotFoundError(f"{self.model}: the servers have no version yet")
        self._note_head(head)
        return await self.wait_version(head.version, timeout)

    # -- applying ---------------------------------------------------------------------------------
    def _emit(self, kind: str, version: int | None, detail: str = "", error: BaseException | None = None) -> None:
        if kind in ("rollback", "refetch", "resync", "error"):
            (log.warning if kind != "error" else log.error)("%s %s v%s: %s", self.model, kind, version, detail)
        if error is not None:
            self._last_error = f"{type(error).__name__}: {error}"
        if self.on_event is not None:
            try:
                self.on_event(SyncEvent(kind=kind, version=version, detail=detail, error=error))
            except Exception:  # a broken callback must not break the apply path's bookkeeping
                log.exception("on_event callback failed")

    def _apply_step(self, step: _Step) -> bool:
        t0 = time.perf_counter()
        tensors = live_tensors(self.target)
        try:
            if step.kind == "keyframe":
                new_fps = self._copy_keyframe(tensors, step)
            else:
                if self._version != step.base or self._fps is None:
                    raise BaseMismatchError(f"v{step.version} applies to v{step.base}, the live state is v{self._version}")
                new_fps = apply_prepared(tensors, step.prepared, self._fps, verify=self.verify)
            got = state_fingerprint_of(tensors, new_fps)
            if got != step.state_fp:
                raise IntegrityError(f"state fingerprint after v{step.version} is {got}, the signed manifest says {step.state_fp}")
        except IntegrityError as e:
            # apply_prepared restored every word it wrote; a keyframe copy that fails cannot be undone
            if step.kind == "keyframe" and isinstance(e, BaseMismatchError):
                self._emit("error", step.version, "the target does not match the stream's tensors", e)
                raise  # nothing was copied; the target is not this model (or needs an engine adapter)
            if step.kind == "keyframe":
                self._verify_state = "mismatch"
                self._fps = None
                self._version = None
                self._emit("error", step.version, "live tensors do not match the keyframe just copied", e)
                self._schedule_reset(keyframe=True)
                raise
            self._counts["rollbacks"] += 1
            self._verify_state = "rolled-back"
            self._emit("rollback", step.version, f"rolled back to v{self._version}: {e}", e)
            if isinstance(e, BaseMismatchError):
                self._schedule_reset(keyframe=True)
            else:
                self._failed(step)
            return False
        except DeltaSyncError as e:  # ApplyError and the like: rolled back by apply_prepared
            self._counts["rollbacks"] += 1
            self._verify_state = "rolled-back"
            self._emit("rollback", step.version, f"rolled back to v{self._version}: {e}", e)
            self._failed(step)
            return False
        self._fps = new_fps
        self._version = step.version
        self._counts["applies"] += 1
        self._verify_state = "ok"
        self._last_error = None
        self._last_apply_s = time.perf_counter() - t0
        self._failures.pop(step.version, None)
        self._emit("applied", step.version, f"{step.kind}{' (squashed)' if step.squashed else ''} {step.nbytes} bytes")
        if self.scrub_every and self._counts["applies"] % self.scrub_every == 0:
            self._scrub(tensors)
        return True

    def _copy_keyframe(self, tensors: dict[str, torch.Tensor], step: _Step) -> dict[str, int]:
        assert step.state is not None and step.fps is not None
        return copy_state(tensors, step.state, step.fps, version=step.version)

    def _scrub(self, tensors: dict[str, torch.Tensor]) -> None:
        self._counts["scrubs"] += 1
        assert self._fps is not None
        bad = [n for n, t in tensors.items() if tensor_fingerprint(t) != self._fps.get(n)]
        if bad:
            self._verify_state = "mismatch"
            self._emit("scrub", self._version, f"{len(bad)} tensors differ from v{self._version} (e.g. {bad[:3]}); resyncing",
                       IntegrityError(f"live tensors {bad[:3]} do not match their tracked fingerprints"))
            self._schedule_reset(keyframe=True)
        else:
            self._emit("scrub", self._version, f"all {len(tensors)} tensors match")

    def _failed(self, step: _Step) -> None:
        n = self._failures.get(step.version, 0) + 1
        self._failures[step.version] = n
        if n > self.max_refetch:
            self._schedule_reset(keyframe=True)
        else:
            self._counts["refetches"] += 1
            self._emit("refetch", step.version, f"fetching v{step.version} again (attempt {n + 1})")
            self._schedule_reset(keyframe=False)

    def _schedule_reset(self, *, keyframe: bool) -> None:
        """Drop every prepared step; the background downloads again from the live version (a refetch:
        blobs are not cached, so they come from the servers anew), or from a keyframe."""
        with self._lock:
            self._gen += 1
            self._ready.clear()
            if keyframe:
                self._need_keyframe = True
                self._counts["resyncs"] += 1
                self._emit("resync", self._version, "resyncing from a keyframe")
        self._notify()

    def _notify(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def wake() -> None:
            if self._wake is not None:
                self._wake.set()
            if self._changed is not None:
                asyncio.ensure_future(self._notify_changed())

        try:
            if _running_loop() is loop:
                wake()
            else:
                loop.call_soon_threadsafe(wake)
        except RuntimeError:
            pass

    async def _notify_changed(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    # -- background --------------------------------------------------------------------------------
    async def _adopt_initial(self) -> None:
        """The target claims to hold ``version``: scrub it and check against the signed manifest."""
        v = self._version
        tensors = live_tensors(self.target)
        loop = asyncio.get_running_loop()
        fps = await loop.run_in_executor(self._pool, lambda: {n: tensor_fingerprint(t) for n, t in tensors.items()})
        try:
            m = await self._manifest(self.model, v)
            ok = state_fingerprint_of(tensors, fps) == m.state_fp
        except NotFoundError:
            ok = False
        if ok:
            self._fps = fps
            self._verify_state = "ok"
            self._need_keyframe = False
        else:
            log.warning("%s: the target does not hold v%s (or the servers no longer have it); resyncing", self.model, v)
            self._version = None
            self._need_keyframe = True

    async def _run(self) -> None:
        backoff = 0.2
        while not self._closing:
            try:
                await self._step_once()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except _Reset:
                continue
            except Exception as e:  # keep following; the error is reported, never swallowed silently
                self._emit("error", self._pipeline_version(), f"{type(e).__name__}: {e}", e)
                await self._sleep_or_wake(backoff)
                backoff = min(backoff * 2, 5.0)

    def _pipeline_version(self) -> int | None:
        with self._lock:
            live = [s for s in self._ready if s.generation == self._gen]
            return live[-1].version if live else self._version

    async def _sleep_or_wake(self, seconds: float) -> None:
        assert self._wake is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    async def _step_once(self) -> None:
        assert self._wake is not None
        with self._lock:
            full = len(self._ready) >= self.max_ready
            gen = self._gen
            need_kf = self._need_keyframe
        if full:
            await self._sleep_or_wake(1.0)
            return
        pv = self._pipeline_version()
        if need_kf or pv is None:
            await self._resync(gen)
            return
        self._wake.clear()
        poll = asyncio.ensure_future(self.client.get_head(self.model, after=pv))
        woke = asyncio.ensure_future(self._wake.wait())
        try:
            done, _ = await asyncio.wait({poll, woke}, timeout=self.timeouts.poll + self.timeouts.read + self.timeouts.connect,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            woke.cancel()
            if not poll.done():
                poll.cancel()
        if poll not in done or poll.cancelled():
            return
        head = poll.result()
        if head is None:
            await self._sleep_or_wake(0.5)
            return
        self._note_head(head)
        if head.version <= pv:
            return
        await self._catch_up(pv, head.version, gen)

    def _note_head(self, head, *, stream: str | None = None) -> None:
        """Record a head answer; its body is that version's manifest: verify and cache it."""
        stream = stream or self.model
        if stream == self.model:
            self._head = max(self._head or -1, head.version)
        if head.body is not None and (stream, head.version) not in self._manifests:
            m = parse_manifest(head.body, key=self.key)
            if m.model != stream or m.version != head.version:
                raise IntegrityError(f"head of {stream} claims v{head.version} but holds {m.model} v{m.version}")
            self._manifests[(stream, head.version)] = m

    def _check_gen(self, gen: int) -> None:
        if gen != self._gen or self._closing:
            raise _Reset()

    async def _manifest(self, model: str, version: int, *, cache: bool = True) -> Manifest:
        key = (model, version)
        m = self._manifests.get(key) if cache else None
        if m is None:
            m = parse_manifest(await self.client.get_manifest(model, version), key=self.key)
            if m.model != model or m.version != version:
                raise IntegrityError(f"asked for {model} v{version}, the server sent {m.model} v{m.version}")
            self._manifests[key] = m
            if len(self._manifests) > 4 * MAX_CHAIN:
                for k in list(self._manifests)[: len(self._manifests) // 2]:
                    del self._manifests[k]
        return m

    async def _blobs(self, manifest: Manifest) -> dict[str, bytes]:
        sem = asyncio.Semaphore(max(1, self.download_concurrency))

        async def one(ref) -> tuple[str, bytes]:
            async with sem:
                return ref.id, await self.client.get_blob(ref.id, ref.size)

        return dict(await asyncio.gather(*(one(r) for r in manifest.blobs)))

    async def _newest_keyframe(self, at_most: int) -> tuple[str, int, int] | None:
        """(stream, version, bytes) of the newest keyframe at or below ``at_most``, side stream or inline."""
        best: tuple[str, int, int] | None = None
        side = await self.client.get_head(self.side_model)
        if side is not None:
            self._note_head(side, stream=self.side_model)
        if side is not None and side.version <= at_most:
            m = await self._manifest(self.side_model, side.version)
            best = (self.side_model, m.version, m.total_bytes)
        # inline keyframes: walk back from at_most (bounded)
        v: int | None = at_most
        for _ in range(MAX_CHAIN):
            if v is None or (best is not None and v <= best[1]):
                break
            try:
                m = await self._manifest(self.model, v)
            except NotFoundError:
                break
            if m.kind == "keyframe":
                best = (self.model, m.version, m.total_bytes)
                break
            v = m.parent
        return best

    async def _resync(self, gen: int) -> None:
        head = await self.client.get_head(self.model)
        if head is None:
            await self._sleep_or_wake(0.5)
            return
        self._note_head(head)
        kf = await self._newest_keyframe(head.version)
        self._check_gen(gen)
        if kf is None:
            raise NotFoundError(f"{self.model}: no keyframe within {MAX_CHAIN} versions of head v{head.version} "
                                f"(nor in {self.side_model}); the publisher must send one")
        step = await self._prepare_keyframe(kf[0], kf[1], gen)
        with self._lock:
            self._check_gen(gen)
            self._need_keyframe = False
            self._ready.append(step)
        self._after_ready()
        if kf[1] < head.version:
            await self._catch_up(kf[1], head.version, gen)

    async def _catch_up(self, pv: int, target: int, gen: int) -> None:
        # walk back from the target along parent links to pv (or a keyframe, or the limit)
        deltas: dict[tuple[int, int], int] = {}
        keyframes: dict[int, int] = {}
        kf_stream: dict[int, str] = {}
        chain: dict[int, Manifest] = {}
        v: int | None = target
        for _ in range(MAX_CHAIN):
            if v is None or v <= pv:
                break
            try:
                m = await self._manifest(self.model, v)
            except NotFoundError:
                break
            chain[v] = m
            if m.kind == "keyframe":
                keyframes[v] = m.total_bytes
                kf_stream[v] = self.model
                break
            deltas[(m.parent, v)] = m.total_bytes
            v = m.parent
        self._check_gen(gen)
        reaches = v == pv
        squash: Manifest | None = None
        if self.use_squash and (not reaches or len(deltas) >= self.squash_min_chain):
            squash = await self._squash(pv, target)
            if squash is not None:
                deltas[(pv, target)] = squash.total_bytes
        side = await self.client.get_head(self.side_model)
        if side is not None:
            self._note_head(side, stream=self.side_model)
        if side is not None and pv < side.version <= target and side.version not in keyframes:
            try:
                m = await self._manifest(self.side_model, side.version)
                keyframes[side.version] = m.total_bytes
                kf_stream[side.version] = self.side_model
            except NotFoundError:
                pass
        self._check_gen(gen)
        try:
            plan = plan_catchup(pv, target, deltas=deltas, keyframes=keyframes)
        except NotFoundError as e:  # the chain from pv is gone (retention) and no keyframe is newer: resync
            log.warning("%s: no path from v%d to v%d (%s); resyncing from a keyframe", self.model, pv, target, e)
            with self._lock:
                self._check_gen(gen)
                self._need_keyframe = True
            return
        single = target in chain and chain[target].kind == "delta" and chain[target].parent == pv
        for st in plan.steps:
            if st.kind == "keyframe":
                step = await self._prepare_keyframe(kf_stream[st.target], st.target, gen)
            elif squash is not None and (st.source, st.target) == (pv, target) and not single:
                step = await self._prepare_delta(squash, gen, squashed=True)
            else:
                step = await self._prepare_delta(chain[st.target], gen)
            with self._lock:
                self._check_gen(gen)
                self._ready.append(step)
            self._after_ready()

    async def _squash(self, pv: int, target: int) -> Manifest | None:
        try:
            sq = parse_manifest(await self.client.get_squashed(self.model, pv, target, timeout=self.squash_timeout),
                                key=self.key)
        except SignatureError as e:
            log.info("%s: squashed delta v%d→v%d is not signed with our key (%s); walking the chain", self.model, pv, target, e)
            return None
        except DeltaSyncError as e:
            log.info("%s: no squashed delta v%d→v%d (%s); walking the chain", self.model, pv, target, e)
            return None
        if sq.kind != "delta" or sq.parent != pv or sq.version != target or sq.model != self.model:
            log.warning("%s: server sent a squashed delta for %s v%s→v%s when asked for v%d→v%d; ignored",
                        self.model, sq.model, sq.parent, sq.version, pv, target)
            return None
        signed = await self._manifest(self.model, target)
        claimed = state_fingerprint((t.name, t.dtype, t.shape, int(t.fp_after, 16)) for t in sq.tensors)
        if claimed != signed.state_fp or sq.state_fp != signed.state_fp:
            log.warning("%s: squashed delta v%d→v%d does not lead to the signed v%d state; ignored", self.model, pv, target, target)
            return None
        return sq

    async def _prepare_delta(self, m: Manifest, gen: int, *, squashed: bool = False) -> _Step:
        signed = m if not squashed else await self._manifest(self.model, m.version)
        blobs = await self._blobs(m)
        self._check_gen(gen)
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(self._pool, prepare_delta, m, blobs)
        return _Step(kind="delta", version=m.version, base=m.parent, state_fp=signed.state_fp, prepared=prepared,
                     manifest=m, nbytes=m.total_bytes, generation=gen, squashed=squashed)

    async def _prepare_keyframe(self, stream: str, version: int, gen: int) -> _Step:
        m = await self._manifest(stream, version)
        if m.kind != "keyframe":
            raise IntegrityError(f"{stream} v{version} is a {m.kind}, expected a keyframe")
        signed = m if stream == self.model else await self._manifest(self.model, version)
        if m.state_fp != signed.state_fp:
            raise IntegrityError(f"{stream} v{version} does not hold the state of {self.model} v{version}")
        blobs = await self._blobs(m)
        self._check_gen(gen)
        loop = asyncio.get_running_loop()
        state, fps = await loop.run_in_executor(self._pool, load_keyframe, m, blobs)
        del blobs
        return _Step(kind="keyframe", version=version, base=None, state_fp=signed.state_fp, state=state, fps=fps,
                     manifest=m, nbytes=m.total_bytes, generation=gen)

    def _after_ready(self) -> None:
        if self.auto:
            self.apply_pending()
        else:
            self._notify()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class ThreadedSubscriber:
    """The subscriber for synchronous engines: the network runs on its own thread; ``apply_pending``
    runs on the caller's. Every blocking call takes a timeout."""

    def __init__(self, urls: str | Sequence[str], model: str, target, **kwargs) -> None:
        self._io = LoopThread(f"deltasync-subscriber-{model}")
        self._sub = Subscriber(urls, model, target, **kwargs)

    @property
    def subscriber(self) -> Subscriber:
        return self._sub

    def start(self, timeout: float = 60.0) -> None:
        self._io.run(self._sub.start(), timeout)

    def apply_pending(self) -> int | None:
        return self._sub.apply_pending()

    def hold(self):
        return self._sub.hold()

    def wait_version(self, version: int, timeout: float) -> int:
        return self._io.run(self._sub.wait_version(version, timeout), timeout + 5)

    def sync(self, timeout: float) -> int:
        return self._io.run(self._sub.sync(timeout), timeout + 5)

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
