"""The live state: which version the target holds, its fingerprints, and the one way to change them.

:class:`LiveState` applies a :class:`~deltasync.client.ready.ReadyStep` through an
:class:`~deltasync.client.appliers.Applier`: the applier stages the change (patched in
place, verified tensor by tensor); then the state fingerprint of the target's layout
with the staged fingerprints must equal the *signed* manifest's ``state_fp`` (a relay's
squashed delta is unsigned: this is what makes it safe), else the change is rolled back.
It also scrubs (every ``scrub_every`` applies: all fingerprints recomputed and compared)
and checks a trusted initial version.

It takes no lock: the subscriber serialises calls (its ``hold()`` / ``apply_pending``
lock). It never calls user code either: ``apply`` returns the events to tell, and the
subscriber tells them once its lock is released.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from deltasync.apply import fp_array
from deltasync.errors import ApplyInterrupted, BaseMismatchError, DeltaSyncError, IntegrityError
from deltasync.fingerprint import FingerprintTable, state_fingerprint
from deltasync.manifest import Manifest, record_names

from .appliers import Applier, TensorApplier
from .ready import ReadyStep

__all__ = ["LiveState", "Outcome", "Told"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Told:
    """An event for ``on_event`` (the subscriber turns it into a SyncEvent)."""

    kind: str  # applied | rollback | scrub | error
    version: int | None
    detail: str = ""
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What one ``apply`` did. ``failure``: None, or the machine's reason (integrity, base_mismatch,
    keyframe, scrub); ``raise_error``: the live tensors could not be kept consistent: raise it."""

    applied: bool
    failure: str | None = None
    told: list[Told] = field(default_factory=list)
    raise_error: BaseException | None = None


class LiveState:
    """Version + fingerprints of one target, changed only through its applier."""

    def __init__(self, applier: Applier, *, version: int | None = None, verify: str = "incremental",
                 scrub_every: int = 0) -> None:
        if verify not in ("incremental", "full"):
            raise ValueError("verify must be 'incremental' or 'full'")
        self.applier = applier
        self.version = version
        self.fps: dict[str, int] | None = None
        self.verify = verify
        self.scrub_every = scrub_every
        self.verify_state = "pending"  # ok | pending | rolled-back | mismatch
        self.counts: Counter[str] = Counter()
        self.last_apply_s = 0.0

    def state_fp(self, fps: dict[str, int]) -> str:
        kept = getattr(self.applier, "state_lines", None)  # an applier that keeps its layout's lines (FileTarget)
        lines = kept() if callable(kept) else None
        if lines is not None:
            names, state_lines = lines
            have = fp_array(fps, names)
            if have is not None:
                return state_lines.digest(have)
        layout = self.applier.layout()
        missing = sorted(set(layout) - set(fps))
        if missing:
            raise IntegrityError(f"the applier reported no fingerprint for {missing[:3]} after the change")
        return state_fingerprint((n, dt, shape, fps[n]) for n, (dt, shape) in layout.items())

    def adopt(self, version: int, signed: Manifest | None) -> bool:
        """The target claims to hold ``version``: scan it and compare with the signed manifest (None: the
        servers no longer have it). True: adopted; False: the version is forgotten (resync)."""
        if signed is not None and signed.kind == "delta" and signed.format >= 3 \
                and callable(getattr(self.applier, "fit_state", None)):
            # a format-3 delta lists only what it changes: the signed state fingerprint tells which tied names
            # the stream leaves out, and whether the target holds the version
            fps = self.applier.fit_state(signed.state_fp)
            if fps is not None:
                self.version, self.fps, self.verify_state = version, fps, "ok"
                return True
            self.version, self.fps = None, None
            return False
        fit = getattr(self.applier, "fit_stream", None)  # a TensorApplier learns which tied names the stream leaves out
        if signed is not None and fit is not None:
            try:
                fit(record_names(signed), version=version)
            except BaseMismatchError:
                self.version, self.fps = None, None
                return False  # the resync's keyframe raises the error, naming the fix
        fps = self.applier.scan()
        if signed is not None and self.state_fp(fps) == signed.state_fp:
            self.version, self.fps, self.verify_state = version, fps, "ok"
            return True
        self.version, self.fps = None, None
        return False

    def apply(self, step: ReadyStep) -> Outcome:
        t0 = time.perf_counter()
        told: list[Told] = []
        try:
            if step.kind == "keyframe":
                assert step.state is not None and step.fps is not None
                if isinstance(self.applier, TensorApplier):
                    staged = self.applier.stage_keyframe(step.state, step.fps, version=step.version)
                else:
                    staged = self.applier.stage_keyframe(step.state, step.fps)
            else:
                if self.version != step.base or self.fps is None:
                    raise BaseMismatchError(f"v{step.version} applies to v{step.base}, the live state is v{self.version}")
                staged = self.applier.stage_delta(step.prepared, self.fps, verify=self.verify)
            try:
                got = self.state_fp(staged.fps)
                if got != step.state_fp:
                    raise IntegrityError(f"state fingerprint after v{step.version} is {got}, "
                                         f"the signed manifest says {step.state_fp}")
            except BaseException:
                staged.rollback()
                raise
            staged.commit()
        except ApplyInterrupted:  # a signal or a deadline: rolled back, and not the delta's fault: the caller stops
            self.counts["interrupted"] += 1
            raise
        except IntegrityError as e:
            if step.kind == "keyframe" and isinstance(e, BaseMismatchError):
                # nothing was copied; the target is not this model (or needs an engine applier)
                told.append(Told(kind="error", version=step.version, detail="the target does not match the stream's tensors", error=e))
                return Outcome(applied=False, failure="keyframe", told=told, raise_error=e)
            if step.kind == "keyframe":  # a whole-state copy cannot be undone: the state is unknown now
                self.verify_state, self.fps, self.version = "mismatch", None, None
                told.append(Told(kind="error", version=step.version, detail="live tensors do not match the keyframe just copied", error=e))
                return Outcome(applied=False, failure="keyframe", told=told, raise_error=e)
            return self._rolled_back(step, e, "base_mismatch" if isinstance(e, BaseMismatchError) else "integrity")
        except DeltaSyncError as e:  # ApplyError and the like: the applier restored every word
            return self._rolled_back(step, e, "integrity")
        fps = staged.fps
        self.fps = fps if type(fps) is FingerprintTable else dict(fps)  # (a table is immutable)
        self.version = step.version
        self.counts["applies"] += 1
        self.verify_state = "ok"
        self.last_apply_s = time.perf_counter() - t0
        told.append(Told(kind="applied", version=step.version,
                         detail=f"{step.kind}{' (squashed)' if step.squashed else ''} {step.nbytes} bytes"))
        failure = None
        if self.scrub_every and self.counts["applies"] % self.scrub_every == 0:
            failure = self.scrub(told)
        return Outcome(applied=True, failure=failure, told=told)

    def _rolled_back(self, step: ReadyStep, e: DeltaSyncError, reason: str) -> Outcome:
        self.counts["rollbacks"] += 1
        self.verify_state = "rolled-back"
        return Outcome(applied=False, failure=reason,
                       told=[Told(kind="rollback", version=step.version, detail=f"rolled back to v{self.version}: {e}", error=e)])

    def scrub(self, told: list[Told]) -> str | None:
        """Recompute every fingerprint; "scrub" (a failure reason) when any differs from the tracked one."""
        self.counts["scrubs"] += 1
        assert self.fps is not None
        bad = [n for n, fp in self.applier.scan().items() if fp != self.fps.get(n)]
        if bad:
            self.verify_state = "mismatch"
            told.append(Told(kind="scrub", version=self.version,
                             detail=f"{len(bad)} tensors differ from v{self.version} (e.g. {bad[:3]}); resyncing",
                             error=IntegrityError(f"live tensors {bad[:3]} do not match their tracked fingerprints")))
            return "scrub"
        told.append(Told(kind="scrub", version=self.version, detail=f"all {len(self.fps)} tensors match"))
        return None
