"""The in-process publisher: call ``publish(step, state_dict)`` after each optimizer step.

::

    pub = Publisher("http://origin:8700", "policy", token, key, keyframe_every=20)
    for step in range(steps):
        train_step(model)
        pub.publish(step, model.state_dict())   # returns once the diff is taken
    pub.close()                                  # waits for the uploads; raises if one failed

What ``publish`` does on the caller's thread, and nothing more:

1. diff the state against the publisher's reference copy of the last published state,
   chunk by chunk on the tensors' own device (GPU tensors are compared on the GPU and
   only the sparse positions/words are copied to the host), and patch the changed
   words into the reference in place (:mod:`deltasync.client.reference`): the
   reference is allocated once, not per step;
2. queue the sparse diff for the background.

Background workers then encode (threads), upload the blobs in parallel and commit the
manifest last, versions strictly in order. The first version is a keyframe; after that
every version is a delta, and every ``keyframe_every`` versions (or on demand,
``publish(..., keyframe=True)``) a keyframe of the same state also goes to the side
stream ``M.kf`` (:mod:`deltasync.client.streams`). A failure in the background is
raised by the next ``publish``/``flush``/``close`` (as :class:`PublishError`, once);
the versions queued after it are dropped and the next ``publish`` sends a keyframe.

``publish`` blocks only for the diff, plus: waiting while ``max_pending`` versions are
still in flight (back-pressure), and, after a keyframe, until the workers have
serialized it from the reference. ``PendingVersion.blocking_s`` reports it.

Sharded trainers (each rank holds part of the state)
----------------------------------------------------
Every rank runs a ``Publisher(..., commit=False)`` over its own tensors (names unique
across ranks) and the same ``keyframe_every``; one rank commits::

    pending = pub.publish(step, my_tensors)        # every rank: diff, then background encode + upload
    part = pending.part()                          # every rank: waits for this rank's blobs to be uploaded
    parts = gather(part.to_bytes())                # any channel: torch.distributed.gather_object, a queue...
    if rank == 0:
        pub.commit([Part.from_bytes(p) for p in parts])   # merge the ranks' records, sign, one PUT

``commit`` must be called in version order. ``part()`` may be collected later (e.g. at
the next step) to keep the upload off the training loop's critical path. Ranks must
agree on on-demand keyframes (pass the same ``keyframe=`` on every rank).

Budgeted streams
----------------
``Publisher(..., budget=BYTES)`` (or a :class:`deltasync.budget.BudgetPolicy`) caps each
delta's wire bytes. The reference copy is then the *served view* (what subscribers hold):
``publish`` diffs the trainer's state against it without patching it, and an encode
worker asks :class:`deltasync.budget.Budgeter` what part of that residual fits the
budget, patches that part into the served view and encodes it; the rest is owed and
ranked first next step (docs/CLIENT.md, "Budgeted streams"). The next ``publish``
waits until the served view is patched. ``PublishResult.residual`` reports what each
version still owes. Keyframes ship the trainer's state whole and clear what is owed.

Thread-safety: one thread calls ``publish``/``flush``/``close``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass

import torch

from deltasync.apply import live_tensors
from deltasync.budget import Budgeter, BudgetPolicy, ResidualReport
from deltasync.codec import EncodeOptions, Encoded, RankTable, diff_ranks
from deltasync.conditioned import CODING_BASE_FREE, CODING_HISTORY
from deltasync.dtypes import dtype_info
from deltasync.history import HISTORY_META, StateHistory, default_coding
from deltasync.errors import ChainError, DeltaSyncError, PublishError
from deltasync.fingerprint import state_fingerprint
from deltasync.keyframe import DEFAULT_SHARD_BYTES, encode_keyframe
from deltasync.manifest import BlobRef, Manifest, parse_manifest
from deltasync.signing import Signer

from .http import HttpClient, Timeouts
from .loop import LoopThread
from .reference import Reference, StateDiff, encode_diff
from .streams import keyframe_stream
from .upload import commit_manifest, upload_blobs

log = logging.getLogger("deltasync.client.publisher")


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishResult:
    """What became of one published version."""

    version: int
    kind: str  # of the main-stream version: "keyframe" | "delta"
    side_keyframe: bool  # a keyframe of this version also went to the side stream
    blob_bytes: int  # bytes of the main-stream version's blobs
    side_bytes: int  # bytes of the side keyframe's blobs (0 if none)
    raw_bytes: int  # size of the full state
    changed: int  # words that changed (deltas) or all words (keyframes)
    blocking_s: float  # time publish() held the caller
    encode_s: float
    upload_s: float
    committed_at: float | None  # time.time() at commit (None in part mode)
    manifest: Manifest  # as committed (signed), or this rank's part
    side_manifest: Manifest | None = None  # the side keyframe's manifest, if any
    residual: ResidualReport | None = None  # budgeted deltas: what this version sent and still owes
    #: the side keyframe failed after the version itself was committed (the version is live; its side
    #: keyframe is not, and ``side_keyframe`` is False): why
    side_error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Part:
    """One rank's share of a version: unsigned partial manifests over its own tensors."""

    main: Manifest
    side: Manifest | None = None

    def to_bytes(self) -> bytes:
        return json.dumps({"main": self.main.to_obj(), "side": self.side.to_obj() if self.side else None},
                          separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Part:
        try:
            obj = json.loads(data)
            main, side = obj["main"], obj["side"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise PublishError(f"not a publisher part: {type(e).__name__}: {str(e)[:200]}") from None
        return Part(main=parse_manifest(main), side=parse_manifest(side) if side is not None else None)


def merge_parts(parts: Sequence[Manifest]) -> Manifest:
    """One manifest from the ranks' partial manifests of a version (unsigned)."""
    if not parts:
        raise PublishError("nothing to merge: no parts")
    first = parts[0]
    for p in parts:
        if (p.model, p.version, p.parent, p.kind) != (first.model, first.version, first.parent, first.kind):
            raise PublishError(
                f"parts disagree: {p.model} v{p.version} ({p.kind}, parent {p.parent}) vs {first.model} "
                f"v{first.version} ({first.kind}, parent {first.parent}); every rank must publish the same steps "
                "with the same keyframe schedule")
    tensors: dict[str, object] = {}
    blobs: dict[str, BlobRef] = {}
    for p in parts:
        for t in p.tensors:
            if t.name in tensors:
                raise PublishError(f"tensor {t.name!r} published by two ranks; each rank publishes its own tensors")
            tensors[t.name] = t
        for b in p.blobs:
            blobs.setdefault(b.id, b)
    recs = tuple(tensors[n] for n in sorted(tensors))
    meta: dict[str, str] = {}
    for p in reversed(parts):
        meta.update(p.meta)
    return Manifest(
        model=first.model, version=first.version, parent=first.parent, kind=first.kind, tensors=recs,
        blobs=tuple(blobs.values()),
        state_fp=state_fingerprint((t.name, t.dtype, t.shape, int(t.fp_after, 16)) for t in recs),
        state_fp_before=(state_fingerprint((t.name, t.dtype, t.shape, int(t.fp_before, 16)) for t in recs)
                         if first.kind == "delta" else None),
        meta=meta,
    )


class _Dropped(PublishError):
    """A version not sent because one before it failed (that failure is the one raised)."""


class PendingVersion:
    """A version handed to the background; ``result()`` waits for its commit (or upload, in part mode)."""

    def __init__(self, version: int, kind: str, side: bool, blocking_s: float, future: concurrent.futures.Future) -> None:
        self.version = version
        self.kind = kind
        self.side_keyframe = side
        self.blocking_s = blocking_s
        self._future = future
        self.serving: dict[str, PendingVersion] = {}  # the serving-format streams' versions of this step

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> PublishResult:
        return self._future.result(timeout)

    def part(self, timeout: float | None = None) -> Part:
        """Part mode: this rank's share of the version, once its blobs are uploaded."""
        r = self.result(timeout)
        return Part(main=r.manifest, side=r.side_manifest)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    version: int
    parent: int | None
    kind: str  # "keyframe" | "delta"
    side: bool
    diff: StateDiff | None
    fps: dict[str, int]
    generation: int
    blocking_s: float
    raw_bytes: int
    meta: dict[str, str]
    budgeted: bool = False  # a budgeted delta: the worker plans it and patches the served view
    ranks: RankTable | None = None  # base-conditioned coding: what it needs of the base, taken at diff time
    history_meta: str | None = None  # history coding: the history the ranks were taken with (meta[HISTORY_META])


class Publisher:
    """Publishes a trainer's state every step (see the module docstring).

    ``origin_url``: the origin server; ``token``: its bearer token for writes; ``key``:
    the manifest :class:`~deltasync.signing.Signer` (an ``Ed25519Signer``: only the
    publisher holds the private key; raw ``bytes``: a shared HMAC secret) or None.
    ``keyframe_every``: a side keyframe every K versions (0: only on demand).
    ``commit=False``: part mode for sharded trainers (see the module docstring).
    ``base``: ``(version, tensors, fps)`` of the state the origin's head holds, to
    continue a stream with a delta instead of starting with a keyframe (the tensors are
    adopted as the reference, not copied). ``budget``: bytes per delta (or a
    :class:`~deltasync.budget.BudgetPolicy`); None is the lossless stream. ``options``: how deltas are
    coded; None: the history coding when ``key`` is an Ed25519 signer on a lossless stream (docs/FORMAT.md §4.5:
    relays cannot squash such a stream anyway), else base-free.
    """

    def __init__(self, origin_url: str, model: str, token: str | None, key: Signer | bytes | None = None, *,
                 keyframe_every: int = 20, options: EncodeOptions | None = None, workers: int = 2,
                 upload_concurrency: int = 4, max_pending: int = 4, timeouts: Timeouts | None = None,
                 commit: bool = True, check_origin: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 base: tuple[int, Mapping[str, torch.Tensor], Mapping[str, int] | None] | None = None,
                 budget: int | BudgetPolicy | None = None, ssl=None, serve: Sequence[object] = ()) -> None:
        if keyframe_every < 0:
            raise ValueError("keyframe_every must be >= 0")
        self.model = model
        self.side_model = keyframe_stream(model)
        self.key = key
        self.keyframe_every = keyframe_every
        # not told a coding: the history coding for a lossless stream signed with Ed25519 (relays cannot squash it
        # anyway), else base-free (deltasync.history.default_coding); part mode: base-free (every rank the same)
        self.options = options or EncodeOptions(coding=default_coding(key, budget=budget, keeps_history=commit))
        self._auto_coding = options is None  # revisited at the first state: a state of many tensors stays base-free
        if self.options.coding != "base-free" and budget is not None:
            raise ValueError(f"the {self.options.coding} coding and a budget exclude each other (a budgeted delta's "
                             "base is the served view; use coding base-free)")
        self.upload_concurrency = upload_concurrency
        self.committer = commit
        self.shard_bytes = shard_bytes
        self.timeouts = timeouts or Timeouts()
        self.budget = BudgetPolicy(bytes=budget) if isinstance(budget, int) else budget
        self._budgeter = Budgeter(self.budget) if self.budget is not None else None
        self._io = LoopThread("deltasync-publisher-io")
        # the publish token also reads (head checks); ``ssl``: an SSLContext for an https origin (--ca-file)
        self._client = HttpClient([origin_url], token=token, timeouts=self.timeouts, ssl=ssl, read_token=token)
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="deltasync-encode")
        self._slots = threading.BoundedSemaphore(max(1, max_pending))
        self._ref_free = threading.Event()
        self._ref_free.set()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._generation = 0
        self._force_keyframe = False
        self._prev: concurrent.futures.Future | None = None
        self._ref: Reference | None = None
        self._version: int | None = None
        self._last_keyframe: int | None = None
        # the history coding: the positions the deltas since the last keyframe changed (docs/FORMAT.md §4.5),
        # kept on the publishing thread, in version order
        self._history: StateHistory | None = None
        self._origin_checked = not check_origin
        self._closed = False
        self.results: list[PublishResult] = []  # committed versions, in order (kept small: last 1000)
        self.serving = None  # serving-format streams beside this one (client/serving.py), ``serve=["fp8-block"]``
        if serve:
            if not commit:
                raise ValueError("serving formats need the whole state on one publisher (not part mode)")
            from .serving import ServingStreams
            self.serving = ServingStreams(model, serve, lambda name: Publisher(
                origin_url, name, token, key, keyframe_every=keyframe_every, options=options, workers=workers,
                upload_concurrency=upload_concurrency, max_pending=max_pending, timeouts=timeouts,
                check_origin=check_origin, shard_bytes=shard_bytes, budget=budget, ssl=ssl))
        if base is not None:
            version, tensors, fps = base
            self._ref = Reference.adopt(tensors, fps)
            self._version = self._last_keyframe = version
            self._origin_checked = True
            self._start_history(version, tensors)

    # -- public API ----------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The last version handed to publish() (committed or still in flight)."""
        return self._version

    @property
    def served(self) -> Mapping[str, torch.Tensor] | None:
        """The state subscribers hold after the last version handed to ``publish`` (read only;
        after ``flush``). Lossless: the last published state; budgeted: the served view."""
        if self._ref is None:
            return None
        self._ref_free.wait(self.timeouts.request)
        return self._ref.tensors

    @property
    def budgeter(self) -> Budgeter | None:
        """The budgeted stream's owed ledger (None for a lossless stream)."""
        return self._budgeter

    def publish(self, step: int, state, *, keyframe: bool = False, meta: Mapping[str, str] | None = None) -> PendingVersion:
        """Publish ``state`` (dict of tensors or nn.Module) as version ``step``; returns after the diff."""
        t0 = time.perf_counter()
        self._check_open()
        self._raise_error()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, found {step!r}")
        if self._version is not None and step <= self._version:
            raise ChainError(f"step {step} must be greater than the last published version {self._version}")
        tensors = live_tensors(state)
        if not tensors:
            raise ValueError("state has no tensors")
        if not self._origin_checked:
            self._check_origin(step)
        while not self._slots.acquire(timeout=0.5):  # back-pressure: too many versions in flight
            self._raise_error()
        try:
            if not self._ref_free.wait(self.timeouts.request):
                raise PublishError("the encode workers held the reference copy too long (keyframe serialization stuck?)")
            with self._lock:
                force, self._force_keyframe = self._force_keyframe, False
                generation = self._generation
            raw_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            ranks = history_meta = None
            if self._ref is None or force or not self._ref.same_layout(tensors):
                if self._ref is None:
                    self._ref = Reference(tensors)
                else:
                    self._ref.reset(tensors)
                kind, side, diff, parent = "keyframe", False, None, None
                self._start_history(step, tensors)
                if self._budgeter is not None:
                    self._budgeter.reset()
                    words = sum(t.numel() for t in tensors.values())
                    meta = {**(meta or {}), **self._budgeter.keyframe_meta(words)}
            elif self._budgeter is not None:
                diff = self._ref.diff(tensors, chunk_words=self.options.chunk_words)
                kind, parent = "delta", self._version
                self._ref_free.clear()  # the worker patches what it ships into the served view
            else:
                diff = self._ref.diff_and_update(tensors, chunk_words=self.options.chunk_words)
                kind, parent = "delta", self._version
                if self.options.coding == CODING_HISTORY:  # with the history at the parent, which then takes it in
                    ranks, history_meta = self._history.ranks(diff), self._history.meta
                elif self.options.coding != CODING_BASE_FREE:  # from the reference now, before it moves on
                    ranks = diff_ranks(diff, self._ref.tensors)
            if kind == "delta":
                side = keyframe or (self.keyframe_every > 0 and (
                    self._last_keyframe is None or step - self._last_keyframe >= self.keyframe_every))
                if self._history is not None:
                    if side:  # a late joiner starts at this keyframe: the deltas after it are coded since it
                        self._start_history(step, tensors)
                    else:
                        self._history.advance_diff(step, diff)
            if kind == "keyframe" or side:
                self._ref_free.clear()  # the workers read the reference to serialize the keyframe
                self._last_keyframe = step
            self._version = step
            blocking = time.perf_counter() - t0
            budgeted = kind == "delta" and self._budgeter is not None
            job = _Job(version=step, parent=parent, kind=kind, side=side, diff=diff, fps=dict(self._ref.fps),
                       generation=generation, blocking_s=blocking, raw_bytes=raw_bytes, meta=dict(meta or {}),
                       budgeted=budgeted, ranks=ranks, history_meta=history_meta)
            fut = self._io.submit(self._process(job, self._prev))
        except BaseException:
            self._slots.release()
            self._ref_free.set()
            if self._history is not None:
                with self._lock:  # the history may have taken in a step that is not out: start again from a keyframe
                    self._force_keyframe = True
            raise
        fut.add_done_callback(lambda _f: self._slots.release())
        self._prev = fut
        pending = PendingVersion(step, kind, side, blocking, fut)
        if self.serving is not None:  # stream name -> its PendingVersion of this step
            pending.serving = self.serving.publish(step, tensors, keyframe=keyframe, meta=meta)
        return pending

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is committed; raise the first background error."""
        if self.serving is not None:
            self.serving.flush(timeout)
        if self._prev is not None:
            try:
                self._prev.result(timeout)
            except concurrent.futures.TimeoutError:
                raise
            except BaseException:
                pass  # recorded; raised below
        self._raise_error()

    def commit(self, parts: Sequence[Part], timeout: float | None = None) -> Manifest:
        """Part mode, on the committing rank: merge the ranks' parts of one version, sign, commit."""
        self._check_open()
        main = merge_parts([p.main for p in parts])
        sides = [p.side for p in parts if p.side is not None]
        if sides and len(sides) != len(parts):
            raise PublishError(f"v{main.version}: only {len(sides)} of {len(parts)} ranks sent a side keyframe")
        side = merge_parts(sides) if sides else None

        async def go() -> Manifest:
            signed = await commit_manifest(self._client, main, key=self.key)
            if side is not None:
                await commit_manifest(self._client, side, key=self.key)
            return signed

        return self._io.run(go(), timeout)

    def close(self, timeout: float | None = None) -> None:
        """flush(), then stop the background workers. Raises the first background error, if any."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            if self.serving is not None:
                self.serving.close(timeout)
            try:
                self._io.run(self._client.close(), 10)
            except Exception:  # closing a session must not mask the flush error
                log.debug("closing the HTTP session failed", exc_info=True)
            self._io.close()
            self._pool.shutdown(wait=True)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the caller's exception with ours
            try:
                self.close()
            except DeltaSyncError as e:
                log.error("publisher close after %s: %s", exc_type.__name__, e)

    # -- internals ---------------------------------------------------------------------------
    def _start_history(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        if self._auto_coding and self.options.coding == CODING_HISTORY and \
                default_coding(self.key, budget=self.budget, tensors=len(tensors)) != CODING_HISTORY:
            self.options = dataclasses.replace(self.options, coding=CODING_BASE_FREE)
        if self.options.coding == CODING_HISTORY:
            self._history = StateHistory({n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in tensors.items()},
                                         since=version)

    def _check_open(self) -> None:
        if self._closed:
            raise PublishError("publisher is closed")

    def _raise_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
            if err is not None:
                self._generation += 1  # failures of versions queued before now are not raised again
        if err is not None:
            raise err

    def _record_error(self, job: _Job, e: BaseException) -> PublishError:
        err = e if isinstance(e, PublishError) else PublishError(f"{self.model} v{job.version}: {type(e).__name__}: {e}")
        if err is not e:
            err.__cause__ = e
        with self._lock:
            self._force_keyframe = True
            if job.generation == self._generation and self._error is None:
                self._error = err
        log.error("publishing %s v%d failed: %s", self.model, job.version, e)
        return err

    def _check_origin(self, step: int) -> None:
        try:
            head = self._io.run(self._client.get_head(self.model), self.timeouts.request)
        except DeltaSyncError as e:
            raise PublishError(f"cannot reach the origin to check {self.model}'s head: {e}") from e
        if head is not None and head.version >= step:
            raise ChainError(f"the origin already has {self.model} v{head.version}; publish steps after it "
                             "(or use another model name)")
        self._origin_checked = True

    def _encode(self, job: _Job) -> tuple[Encoded, Encoded | None, float, ResidualReport | None]:
        t0 = time.perf_counter()
        try:
            assert self._ref is not None
            main, side, report = encode_job(job, self._ref, self._budgeter, model=self.model, side_model=self.side_model,
                                            options=self.options, shard_bytes=self.shard_bytes,
                                            on_side_done=self._ref_free.set)
        finally:
            if job.kind == "keyframe" or job.side or job.budgeted:
                self._ref_free.set()
        # signed manifests carry a digest of every blob (docs/FORMAT.md §5.2); parts: the committing rank signs
        if self.key is not None or not self.committer:
            main = dataclasses.replace(main, manifest=main.manifest.with_digests(main.blobs))
            if side is not None:
                side = dataclasses.replace(side, manifest=side.manifest.with_digests(side.blobs))
        return main, side, time.perf_counter() - t0, report

    async def _process(self, job: _Job, prev: concurrent.futures.Future | None) -> PublishResult:
        try:
            loop = asyncio.get_running_loop()
            main, side, encode_s, report = await loop.run_in_executor(self._pool, self._encode, job)
            # a delta needs its parent committed; a keyframe starts a new chain and only keeps the order
            if job.kind == "delta" and prev is not None and prev.done() and prev.exception() is not None:
                raise _Dropped(f"{self.model} v{job.version} dropped: the version before it failed")
            t0 = time.perf_counter()
            blobs = dict(main.blobs)
            if side is not None:
                blobs.update(side.blobs)
            await upload_blobs(self._client, blobs, concurrency=self.upload_concurrency, model=self.model)
            if prev is not None:
                try:
                    await asyncio.wrap_future(prev)
                except BaseException:
                    if job.kind == "delta":
                        raise _Dropped(f"{self.model} v{job.version} dropped: the version before it failed") from None
            committed_at = None
            manifest = main.manifest
            side_error = None
            if self.committer:
                manifest = await commit_manifest(self._client, main.manifest, key=self.key)
                committed_at = time.time()
                if side is not None:
                    try:
                        await commit_manifest(self._client, side.manifest, key=self.key)
                    except (DeltaSyncError, OSError, asyncio.TimeoutError) as e:
                        # The version is live; only the side keyframe (a shortcut for late joiners) is not.
                        # Its uploaded blobs are orphans the origin deletes after its grace (server/storage/store.py).
                        side_error = f"{type(e).__name__}: {e}"
                        log.warning("%s v%d is live, but its side keyframe %s v%d was not committed: %s",
                                    self.model, job.version, self.side_model, job.version, side_error)
                        side = None
            res = PublishResult(
                version=job.version, kind=job.kind, side_keyframe=side is not None,
                blob_bytes=main.manifest.total_bytes, side_bytes=side.manifest.total_bytes if side else 0,
                raw_bytes=job.raw_bytes, changed=main.manifest.changed_words, blocking_s=job.blocking_s,
                encode_s=encode_s, upload_s=time.perf_counter() - t0, committed_at=committed_at, manifest=manifest,
                side_manifest=side.manifest if side else None, residual=report, side_error=side_error)
            self.results.append(res)
            del self.results[:-1000]
            return res
        except _Dropped:
            raise
        except BaseException as e:
            raise self._record_error(job, e) from None


def encode_job(job: _Job, ref: Reference, budgeter: Budgeter | None, *, model: str, side_model: str,
               options: EncodeOptions, shard_bytes: int,
               on_side_done: Callable[[], None]) -> tuple[Encoded, Encoded | None, ResidualReport | None]:
    """Encode one queued version from the reference (on an encode worker): a keyframe, a delta, or — on a
    budgeted stream — the part of the residual the budget ships (the reference, the served view, moves by
    exactly that). ``on_side_done`` is called once a side keyframe no longer needs the reference."""
    report = None
    side = None
    if job.budgeted:
        assert budgeter is not None and job.diff is not None and job.parent is not None
        plan = budgeter.plan(job.diff, model=model, version=job.version, parent=job.parent, options=options,
                             meta=job.meta)
        ref.patch(plan.sent)  # the served view moves by exactly what the delta ships
        budgeter.commit(plan)
        main, report = plan.encoded, plan.report
        if job.side:  # a keyframe of the served view, not of the trainer's state
            side = encode_keyframe(ref.tensors, model=side_model, version=job.version, fps=ref.fps,
                                   shard_bytes=shard_bytes, meta=job.meta)
    elif job.kind == "keyframe":
        main = encode_keyframe(ref.tensors, model=model, version=job.version, fps=job.fps,
                               shard_bytes=shard_bytes, meta=job.meta)
    else:
        if job.side:
            side = encode_keyframe(ref.tensors, model=side_model, version=job.version, fps=job.fps,
                                   shard_bytes=shard_bytes, meta=job.meta)
            on_side_done()
        meta = job.meta if job.history_meta is None else {**job.meta, HISTORY_META: job.history_meta}
        main = encode_diff(job.diff, model=model, version=job.version, parent=job.parent, options=options,
                           meta=meta, ranks=job.ranks)
    return main, side, report
