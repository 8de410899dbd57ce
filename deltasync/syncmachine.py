"""The subscriber's sync logic as a pure state machine (h11-style: events in, actions out).

No I/O, no asyncio, no threads, no clock: a driver (``deltasync.client.driver``) does
what the actions say and sends back what happened. ::

    m = SyncMachine(SyncConfig(model="policy"))
    actions = m.send(Started(trusted=None))
    # ... do the blocking action, then: actions = m.send(<its result event>)

Invariant: at most one *blocking* action (:data:`BLOCKING`: a fetch, a prepare, a
wait) is outstanding. Each carries a ``ticket``; its result event must carry the same
ticket, and a result with an old ticket is ignored. When ``send`` returns a new
blocking action while one is outstanding (an apply failure arrived, say), the old
one is stale: the driver cancels it. The other actions (``Deliver``, ``Notify``) are
done at once.

Rounds: poll the head after the pipeline's version; walk the parent chain back to
it; ask for a relay's squashed delta when the chain is long or broken (used only if
its tensor records hash to the *signed* target's state fingerprint); look at the
side keyframe stream (``M.kf``); plan the cheapest path (:func:`plan_catchup`); for
each step fetch its blobs, prepare it (decode), deliver it to the engine's queue.
With no live version (or after a resync) the round starts from the newest keyframe.

Apply results come from the engine's side (``Applied``, ``ApplyFailed``). A failed
delta is refetched (a new generation: its steps are dropped, the round starts again
from the live version) up to ``max_refetch`` times, then the machine resyncs from a
keyframe; a base mismatch, a failed keyframe copy or a failed scrub resyncs at once.
Back-pressure: no new round starts while ``max_ready`` steps wait to be applied.
Generations are owned by the hand-off queue (the engine side drops the queue and bumps
the generation the moment an apply fails); the machine adopts the generation an
``ApplyFailed`` carries and tags every step it delivers with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import BaseMismatchError, DeltaSyncError, IntegrityError, NotFoundError
from .fingerprint import state_fingerprint
from .manifest import Manifest, keyframe_stream
from .planner import Plan, plan_catchup

MAX_CHAIN = 256  # manifests walked back from the head when planning a catch-up


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncConfig:
    model: str
    side_model: str | None = None  # the side keyframe stream (``M.kf``); None: manifest.keyframe_stream(model)
    use_squash: bool = True
    squash_min_chain: int = 3
    max_refetch: int = 1
    max_ready: int = 8
    max_chain: int = MAX_CHAIN
    backoff_min: float = 0.2
    backoff_max: float = 5.0
    idle_wait: float = 0.5  # when the servers have no version yet
    full_wait: float = 1.0  # re-check this often while max_ready steps wait

    @property
    def side(self) -> str:
        return self.side_model or keyframe_stream(self.model)


# -- events (what happened) --------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    trusted: int | None = None  # the target claims to hold this version already


@dataclass(frozen=True, slots=True, kw_only=True)
class InitialChecked:
    ticket: int
    ok: bool  # the target's scanned state matches the signed manifest of the trusted version


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadSeen:
    """A head answer: ``version`` None when the stream has no version; ``manifest`` the head's
    verified manifest (None after a long-poll that timed out)."""

    ticket: int
    stream: str
    version: int | None
    manifest: Manifest | None = None
    #: a long-poll for a version newer than ``after`` was answered at once with one that is not newer: a
    #: source replaying an old head (or one whose long-polls are broken); the machine backs off and has the
    #: other sources asked (``PollHead.probe``) rather than asking again at once
    early: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadNoted:
    """A head learned outside the machine's own requests (``sync()`` asked); no ticket."""

    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestsVerified:
    ticket: int
    stream: str
    manifests: dict[int, Manifest]
    missing: frozenset[int] = frozenset()  # asked for, not on any server


@dataclass(frozen=True, slots=True, kw_only=True)
class SquashFetched:
    ticket: int
    manifest: Manifest | None  # None: the servers offered none (or an unusable one)
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BlobsReady:
    ticket: int
    version: int
    blobs: Any  # what the driver fetched, passed back in Prepare


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPrepared:
    ticket: int
    version: int
    payload: Any  # the decoded step, handed to the engine in Deliver


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceFailed:
    """The outstanding action failed (every server tried, or a verification failed)."""

    ticket: int
    error: BaseException


@dataclass(frozen=True, slots=True, kw_only=True)
class Woke:
    ticket: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Applied:
    """The engine side applied a delivered step."""

    version: int
    generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyFailed:
    """The engine side could not apply a step (or a scrub found damage); the live tensors are at
    ``live`` (None: unknown, after a failed keyframe copy). ``generation``: the queue's new one."""

    version: int | None
    generation: int
    reason: str  # "integrity" (rolled back) | "base_mismatch" | "keyframe" | "scrub"
    live: int | None


# -- actions (what to do) ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class CheckInitial:
    ticket: int
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PollHead:
    """Long-poll ``stream``'s head for a version newer than ``after`` (None: answer at once). ``probe``: the last
    source answered early with an old head (``HeadSeen.early``): first ask every other listed source's signed
    head, and read from one that is ahead."""

    ticket: int
    stream: str
    after: int | None
    probe: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WalkChain:
    """Walk ``stream``'s parent links back from ``top`` (``deltasync.planner.walk_parents``),
    seeded with ``known``; answer with every manifest fetched."""

    ticket: int
    stream: str
    top: int
    floor: int | None
    limit: int
    known: dict[int, Manifest]


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchManifests:
    ticket: int
    stream: str
    versions: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchSquashed:
    ticket: int
    start: int
    end: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchBlobs:
    """Fetch (a target's subset of) ``manifest``'s blobs, from whichever source the failover policy picks."""

    ticket: int
    manifest: Manifest


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepare:
    """Decode a step off the event loop: a delta (``prepare_delta``) or a keyframe (``load_keyframe``)."""

    ticket: int
    kind: str  # "delta" | "keyframe"
    manifest: Manifest
    blobs: Any
    version: int
    base: int | None
    state_fp: str  # the SIGNED state fingerprint of ``version``
    squashed: bool
    generation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Deliver:
    """Hand a prepared step to the engine's queue (tagged with ``generation``)."""

    version: int
    generation: int
    payload: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Notify:
    """Tell the engine (``on_event``): kind is refetch | resync | error."""

    kind: str
    version: int | None
    detail: str
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    ticket: int
    seconds: float


BLOCKING = (CheckInitial, PollHead, WalkChain, FetchManifests, FetchSquashed, FetchBlobs, Prepare, Wait)


@dataclass(slots=True, kw_only=True)
class _Round:
    """One catch-up from ``start`` (None: from a keyframe) to ``target``."""

    start: int | None
    target: int | None = None
    phase: str = ""
    chain: dict[int, Manifest] = field(default_factory=dict)
    reaches: bool = False
    squash: Manifest | None = None
    side: int | None = None  # side stream head version
    kf_floor: int | None = None  # resync: the side keyframe found (walk inline keyframes above it)
    plan: Plan | None = None
    index: int = 0  # next plan step to prepare
    blobs: Any = None


class SyncMachine:
    """Pure catch-up and recovery logic. Not thread-safe: one driver sends events from one thread."""

    def __init__(self, config: SyncConfig) -> None:
        self.config = config
        self.generation = 0
        self.live: int | None = None  # applied (as far as the machine has heard)
        self.top: int | None = None  # version of the newest step delivered in this generation
        self.head: int | None = None
        self.outstanding = 0  # delivered in this generation, not yet applied
        self.need_keyframe = True
        self.failures: dict[int, int] = {}
        self.refetches = 0
        self.resyncs = 0
        self.manifests: dict[tuple[str, int], Manifest] = {}
        self._ticket = 0
        self._pending: object | None = None  # the outstanding blocking action
        self._round: _Round | None = None
        self._backoff = config.backoff_min
        self._started = False
        self._probe = False  # the next poll asks the other sources first (an early, old answer)

    # -- public ------------------------------------------------------------------------------------------------
    @property
    def pipeline_version(self) -> int | None:
        return self.top if self.top is not None else self.live

    @property
    def pending(self) -> object | None:
        return self._pending

    def send(self, event: object) -> list[object]:
        out: list[object] = []
        if isinstance(event, (Applied, ApplyFailed, HeadNoted)):
            self._engine_side(event, out)
            return out
        if isinstance(event, Started):
            if self._started:
                raise RuntimeError("the machine was started already")
            self._started = True
            if event.trusted is not None:
                self.live = event.trusted
                self.need_keyframe = False
                return self._block(out, CheckInitial(ticket=self._next_ticket(), version=event.trusted))
            return self._new_round(out)
        ticket = getattr(event, "ticket", None)
        if ticket is None or self._pending is None or ticket != getattr(self._pending, "ticket", None):
            return out  # a stale result of a superseded action
        self._pending = None
        try:
            self._result(event, out)
        except DeltaSyncError as e:  # a verification failed: report, back off, start over
            self._fail(e, out)
        return out

    # -- helpers -----------------------------------------------------------------------------------------------
    def _next_ticket(self) -> int:
        self._ticket += 1
        return self._ticket

    def _block(self, out: list[object], action: object) -> list[object]:
        self._pending = action
        out.append(action)
        return out

    def _wait(self, out: list[object], seconds: float) -> list[object]:
        self._round = None
        return self._block(out, Wait(ticket=self._next_ticket(), seconds=seconds))

    def _fail(self, error: BaseException, out: list[object]) -> list[object]:
        out.append(Notify(kind="error", version=self.pipeline_version, detail=f"{type(error).__name__}: {error}",
                          error=error))
        seconds = self._backoff
        self._backoff = min(self._backoff * 2, self.config.backoff_max)
        return self._wait(out, seconds)

    def _remember(self, stream: str, m: Manifest) -> None:
        self.manifests[(stream, m.version)] = m
        if len(self.manifests) > 4 * self.config.max_chain:
            for k in list(self.manifests)[: len(self.manifests) // 2]:
                del self.manifests[k]

    def _known(self, stream: str) -> dict[int, Manifest]:
        return {v: m for (s, v), m in self.manifests.items() if s == stream}

    def _reset(self, out: list[object], generation: int, live: int | None, *, keyframe: bool) -> None:
        self.generation = max(self.generation, generation)
        self.live = live
        self.top = None
        self.outstanding = 0
        self._round = None
        if keyframe:
            self.need_keyframe = True
            self.resyncs += 1
            out.append(Notify(kind="resync", version=live, detail="resyncing from a keyframe"))

    # -- the engine's side -------------------------------------------------------------------------------------
    def _engine_side(self, ev: object, out: list[object]) -> None:
        if isinstance(ev, HeadNoted):
            self.head = max(self.head if self.head is not None else -1, ev.version)
            return
        was_full = self.outstanding >= self.config.max_ready
        if isinstance(ev, Applied):
            if ev.generation != self.generation:
                return
            self.live = ev.version
            self.outstanding = max(0, self.outstanding - 1)
            self.failures.pop(ev.version, None)
            if self.outstanding == 0 and self.top is not None and self.top <= ev.version:
                self.top = None
            if was_full and self.outstanding < self.config.max_ready and isinstance(self._pending, Wait):
                self._new_round(out)  # room again: stop waiting
            return
        assert isinstance(ev, ApplyFailed)
        if ev.reason == "integrity" and ev.version is not None:
            n = self.failures.get(ev.version, 0) + 1
            self.failures[ev.version] = n
            if n > self.config.max_refetch:
                self._reset(out, ev.generation, ev.live, keyframe=True)
            else:
                self.refetches += 1
                out.append(Notify(kind="refetch", version=ev.version, detail=f"fetching v{ev.version} again (attempt {n + 1})"))
                self._reset(out, ev.generation, ev.live, keyframe=False)
        else:  # base mismatch, a failed keyframe copy, a failed scrub: only a keyframe helps
            self._reset(out, ev.generation, ev.live, keyframe=True)
        self._new_round(out)  # supersedes whatever was outstanding

    # -- rounds ------------------------------------------------------------------------------------------------
    def _new_round(self, out: list[object]) -> list[object]:
        if self.outstanding >= self.config.max_ready:
            return self._wait(out, self.config.full_wait)
        pv = self.pipeline_version
        if self.need_keyframe or pv is None:
            self._round = _Round(start=None, phase="resync-head")
            return self._block(out, PollHead(ticket=self._next_ticket(), stream=self.config.model, after=None))
        self._round = _Round(start=pv, phase="poll")
        probe, self._probe = self._probe, False
        return self._block(out, PollHead(ticket=self._next_ticket(), stream=self.config.model, after=pv, probe=probe))

    def _result(self, ev: object, out: list[object]) -> None:
        r = self._round
        if isinstance(ev, Woke):
            self._new_round(out)
            return
        if isinstance(ev, SourceFailed):
            if isinstance(ev.error, BaseMismatchError) and r is not None and r.phase == "prepare":
                # a step this end cannot decode from what it holds (a history-coded delta whose history it did
                # not take in: it started or restarted later, docs/FORMAT.md §4.5): only a keyframe helps
                out.append(Notify(kind="error", version=self.pipeline_version,
                                  detail=f"{type(ev.error).__name__}: {ev.error}", error=ev.error))
                self.need_keyframe = True
                self.resyncs += 1
                out.append(Notify(kind="resync", version=self.live, detail="resyncing from a keyframe"))
                self._round = None
                self._new_round(out)
                return
            self._fail(ev.error, out)
            return
        if isinstance(ev, InitialChecked):
            if not ev.ok:
                self.live = None
                self.need_keyframe = True
            self._new_round(out)
            return
        if isinstance(ev, HeadSeen):
            if ev.manifest is not None:
                self._remember(ev.stream, ev.manifest)
            if ev.stream == self.config.model and ev.version is not None:
                self.head = max(self.head if self.head is not None else -1, ev.version)
        if isinstance(ev, ManifestsVerified):
            for m in ev.manifests.values():
                self._remember(ev.stream, m)
        assert r is not None, f"{type(ev).__name__} with no round"
        getattr(self, "_on_" + r.phase.replace("-", "_"))(r, ev, out)

    # poll -> walk -> squash -> side -> side-manifest -> plan -> (blobs -> prepare)*
    def _on_poll(self, r: _Round, ev: HeadSeen, out: list[object]) -> None:
        if ev.version is None:
            self._wait(out, self.config.idle_wait)
            return
        if ev.version <= r.start:
            if ev.early:  # an old head at once: never a busy loop; the others are asked next time
                self._probe = True
                seconds = self._backoff
                self._backoff = min(self._backoff * 2, self.config.backoff_max)
                out.append(Notify(kind="stale", version=ev.version,
                                  detail=f"a source answered a long-poll at once with v{ev.version}, not newer than "
                                         f"v{r.start}; asking the other sources, again in {seconds:g} s"))
                self._wait(out, seconds)
                return
            self._backoff = self.config.backoff_min
            self._new_round(out)
            return
        self._backoff = self.config.backoff_min
        r.target = ev.version
        self._walk(r, out)

    def _walk(self, r: _Round, out: list[object]) -> None:
        r.phase = "walk"
        self._block(out, WalkChain(ticket=self._next_ticket(), stream=self.config.model, top=r.target, floor=r.start,
                                   limit=self.config.max_chain, known=self._known(self.config.model)))

    def _on_walk(self, r: _Round, ev: ManifestsVerified, out: list[object]) -> None:
        v: int | None = r.target
        while v is not None and v > r.start and len(r.chain) < self.config.max_chain:
            m = self.manifests.get((self.config.model, v))
            if m is None:
                break
            r.chain[v] = m
            if m.kind == "keyframe":
                break
            v = m.parent
        r.reaches = v == r.start
        deltas = sum(1 for m in r.chain.values() if m.kind == "delta")
        if self.config.use_squash and (not r.reaches or deltas >= self.config.squash_min_chain):
            r.phase = "squash"
            self._block(out, FetchSquashed(ticket=self._next_ticket(), start=r.start, end=r.target))
            return
        self._side_head(r, out)

    def _on_squash(self, r: _Round, ev: SquashFetched, out: list[object]) -> None:
        r.squash = self._usable_squash(r, ev.manifest)
        self._side_head(r, out)

    def _usable_squash(self, r: _Round, sq: Manifest | None) -> Manifest | None:
        """A relay's squashed delta is unsigned: use it only if it leads exactly to the signed target state."""
        if sq is None:
            return None
        if sq.kind != "delta" or sq.parent != r.start or sq.version != r.target or sq.model != self.config.model:
            return None
        signed = self.manifests.get((self.config.model, r.target))
        if signed is None:
            return None
        if sq.state_fp != signed.state_fp:
            return None
        if sq.format < 3:  # every tensor listed: its claimed fingerprints must make the signed state
            claimed = state_fingerprint((t.name, t.dtype, t.shape, int(t.fp_after, 16)) for t in sq.tensors)
            if claimed != signed.state_fp:
                return None
        # format 3 lists only what the squash changes: the apply's check of the state it reaches against the
        # signed state fingerprint (LiveState) refuses and rolls back a squash that lies
        return sq

    def _side_head(self, r: _Round, out: list[object]) -> None:
        r.phase = "side-head"
        self._block(out, PollHead(ticket=self._next_ticket(), stream=self.config.side, after=None))

    def _on_side_head(self, r: _Round, ev: HeadSeen, out: list[object]) -> None:
        sv = ev.version
        if sv is not None and r.start < sv <= r.target and sv not in r.chain:
            r.side = sv
            if (self.config.side, sv) not in self.manifests:
                r.phase = "side-manifest"
                self._block(out, FetchManifests(ticket=self._next_ticket(), stream=self.config.side, versions=(sv,)))
                return
        self._plan(r, out)

    def _on_side_manifest(self, r: _Round, ev: ManifestsVerified, out: list[object]) -> None:
        if (self.config.side, r.side) not in self.manifests:
            r.side = None
        self._plan(r, out)

    def _plan(self, r: _Round, out: list[object]) -> None:
        deltas: dict[tuple[int, int], int] = {}
        keyframes: dict[int, int] = {}
        for v, m in r.chain.items():
            if m.kind == "keyframe":
                keyframes[v] = m.total_bytes
            else:
                deltas[(m.parent, v)] = m.total_bytes
        if r.squash is not None:
            deltas[(r.start, r.target)] = r.squash.total_bytes
        if r.side is not None:
            keyframes[r.side] = self.manifests[(self.config.side, r.side)].total_bytes
        try:
            r.plan = plan_catchup(r.start, r.target, deltas=deltas, keyframes=keyframes)
        except NotFoundError:  # the chain from here is gone (retention) and no keyframe is newer: resync
            self.need_keyframe = True
            self._new_round(out)
            return
        r.index = 0
        self._next_step(r, out)

    def _step_source(self, r: _Round, i: int) -> tuple[str, Manifest, bool]:
        """(stream, manifest, squashed) of plan step ``i``."""
        st = r.plan.steps[i]
        if st.kind == "keyframe":
            if st.target in r.chain and r.chain[st.target].kind == "keyframe":
                return self.config.model, r.chain[st.target], False
            return self.config.side, self.manifests[(self.config.side, st.target)], False
        single = st.target in r.chain and r.chain[st.target].kind == "delta" and r.chain[st.target].parent == r.start
        if r.squash is not None and (st.source, st.target) == (r.start, r.target) and not single:
            return self.config.model, r.squash, True
        return self.config.model, r.chain[st.target], False

    def _next_step(self, r: _Round, out: list[object]) -> None:
        if r.index >= len(r.plan.steps):
            self._backoff = self.config.backoff_min
            self._new_round(out)
            return
        stream, m, squashed = self._step_source(r, r.index)
        signed = self.manifests.get((self.config.model, m.version)) if (stream != self.config.model or squashed) else m
        if signed is None:
            r.phase = "signed"
            self._block(out, FetchManifests(ticket=self._next_ticket(), stream=self.config.model, versions=(m.version,)))
            return
        if m.kind == "keyframe" and m.state_fp != signed.state_fp:
            raise IntegrityError(f"{stream} v{m.version} does not hold the state of {self.config.model} v{m.version}")
        r.phase = "blobs"
        self._block(out, FetchBlobs(ticket=self._next_ticket(), manifest=m))

    def _on_signed(self, r: _Round, ev: ManifestsVerified, out: list[object]) -> None:
        stream, m, _ = self._step_source(r, r.index)
        if (self.config.model, m.version) not in self.manifests:
            raise NotFoundError(f"{self.config.model} v{m.version}: no signed manifest on any server (needed to trust {stream})")
        self._next_step(r, out)

    def _on_blobs(self, r: _Round, ev: BlobsReady, out: list[object]) -> None:
        stream, m, squashed = self._step_source(r, r.index)
        signed = self.manifests.get((self.config.model, m.version), m)
        r.phase = "prepare"
        self._block(out, Prepare(ticket=self._next_ticket(), kind=m.kind, manifest=m, blobs=ev.blobs, version=m.version,
                                 base=m.parent if m.kind == "delta" else None, state_fp=signed.state_fp,
                                 squashed=squashed, generation=self.generation))

    def _on_prepare(self, r: _Round, ev: StepPrepared, out: list[object]) -> None:
        out.append(Deliver(version=ev.version, generation=self.generation, payload=ev.payload))
        self.top = ev.version
        self.outstanding += 1
        if r.start is None:
            self.need_keyframe = False
        r.index += 1
        if r.index < len(r.plan.steps) and self.outstanding >= self.config.max_ready:
            # back-pressure mid-round: resume from the pipeline's version once there is room
            self._wait(out, self.config.full_wait)
            return
        self._next_step(r, out)

    # resync: head -> side head (-> side manifest) -> walk for an inline keyframe -> plan from the keyframe
    def _on_resync_head(self, r: _Round, ev: HeadSeen, out: list[object]) -> None:
        if ev.version is None:
            self._wait(out, self.config.idle_wait)
            return
        r.target = ev.version
        r.phase = "resync-side"
        self._block(out, PollHead(ticket=self._next_ticket(), stream=self.config.side, after=None))

    def _on_resync_side(self, r: _Round, ev: HeadSeen, out: list[object]) -> None:
        if ev.version is not None and ev.version <= r.target:
            r.side = ev.version
            if (self.config.side, ev.version) not in self.manifests:
                r.phase = "resync-side-manifest"
                self._block(out, FetchManifests(ticket=self._next_ticket(), stream=self.config.side, versions=(ev.version,)))
                return
        self._resync_walk(r, out)

    def _on_resync_side_manifest(self, r: _Round, ev: ManifestsVerified, out: list[object]) -> None:
        if (self.config.side, r.side) not in self.manifests:
            raise NotFoundError(f"{self.config.side} v{r.side}: the head names it but no server has its manifest")
        self._resync_walk(r, out)

    def _resync_walk(self, r: _Round, out: list[object]) -> None:
        if r.side is not None and r.side >= r.target:
            self._resync_plan(r, None, out)
            return
        r.phase = "resync-walk"
        self._block(out, WalkChain(ticket=self._next_ticket(), stream=self.config.model, top=r.target, floor=r.side,
                                   limit=self.config.max_chain, known=self._known(self.config.model)))

    def _on_resync_walk(self, r: _Round, ev: ManifestsVerified, out: list[object]) -> None:
        inline: int | None = None
        v: int | None = r.target
        for _ in range(self.config.max_chain):
            if v is None or (r.side is not None and v <= r.side):
                break
            m = self.manifests.get((self.config.model, v))
            if m is None:
                break
            r.chain[v] = m
            if m.kind == "keyframe":
                inline = v
                break
            v = m.parent
        self._resync_plan(r, inline, out)

    def _resync_plan(self, r: _Round, inline: int | None, out: list[object]) -> None:
        kf = inline if inline is not None else r.side
        if kf is None:
            raise NotFoundError(f"{self.config.model}: no keyframe within {self.config.max_chain} versions of head "
                                f"v{r.target} (nor in {self.config.side}); the publisher must send one")
        # the keyframe, then (next rounds) the chain from it: the same path the old subscriber took
        size = (r.chain[kf] if inline is not None else self.manifests[(self.config.side, kf)]).total_bytes
        if inline is None:
            r.chain = {}
        r.start, r.target, r.squash = None, kf, None
        r.side = None if inline is not None else kf
        r.plan = plan_catchup(None, kf, deltas={}, keyframes={kf: size})
        r.index = 0
        self._next_step(r, out)
