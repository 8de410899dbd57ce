"""The pure sync machine: every transition, table-driven, no socket, no thread, no clock.

A tiny in-memory "world" answers the machine's actions (heads, manifests, squashed deltas)
and a scripted engine applies or fails what is delivered, the way the driver and
``apply_pending`` would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from deltasync import syncmachine as sm
from deltasync.errors import DeltaSyncError, IntegrityError, NotFoundError
from deltasync.fingerprint import fp_hex, state_fingerprint
from deltasync.manifest import BlobRef, Manifest, TensorRecord

M, KF = "m", "m.kf"


def sfp(v: int) -> str:
    """The state fingerprint of version v: one tensor whose fingerprint is v + 1."""
    return state_fingerprint([("w", "bfloat16", (4,), v + 1)])


def rec(v: int) -> TensorRecord:
    return TensorRecord(name="w", dtype="bfloat16", shape=(4,), fp_before=None, fp_after=fp_hex(v + 1), changed=1)


def delta(v: int, parent: int | None = None, size: int = 10, model: str = M) -> Manifest:
    return Manifest(model=model, version=v, parent=v - 1 if parent is None else parent, kind="delta", tensors=(rec(v),),
                    blobs=(BlobRef(id=f"d{v}", size=size),), state_fp=sfp(v))


def keyframe(v: int, size: int = 1000, model: str = M) -> Manifest:
    return Manifest(model=model, version=v, parent=None, kind="keyframe", tensors=(rec(v),),
                    blobs=(BlobRef(id=f"k{model}{v}", size=size),), state_fp=sfp(v))


@dataclass
class World:
    """What the servers hold, and what the engine does with each delivered step."""

    streams: dict[str, dict[int, Manifest]]
    squash: dict[tuple[int, int], Manifest] = field(default_factory=dict)
    initial_ok: bool = True
    fail: dict[int, list[str]] = field(default_factory=dict)  # version -> reasons for its next applies
    source_errors: int = 0  # the first N fetches fail
    applying: bool = True  # False: the engine holds everything (back-pressure)
    log: list[tuple] = field(default_factory=list)
    walks: list[tuple[int, int | None]] = field(default_factory=list)

    def head(self, stream: str) -> int | None:
        vs = self.streams.get(stream, {})
        return max(vs) if vs else None

    def answer(self, a):
        if self.source_errors and not isinstance(a, (sm.Wait, sm.CheckInitial)):
            self.source_errors -= 1
            return sm.SourceFailed(ticket=a.ticket, error=DeltaSyncError("every server refused"))
        if isinstance(a, sm.CheckInitial):
            return sm.InitialChecked(ticket=a.ticket, ok=self.initial_ok)
        if isinstance(a, sm.PollHead):
            h = self.head(a.stream)
            if a.after is not None and h is not None and h <= a.after:
                return None  # caught up: a long-poll would wait here
            return sm.HeadSeen(ticket=a.ticket, stream=a.stream, version=h,
                               manifest=None if h is None else self.streams[a.stream][h])
        if isinstance(a, sm.WalkChain):
            self.walks.append((a.top, a.floor))
            got = {v: m for v, m in self.streams[a.stream].items() if v <= a.top and (a.floor is None or v > a.floor)}
            return sm.ManifestsVerified(ticket=a.ticket, stream=a.stream, manifests=got)
        if isinstance(a, sm.FetchManifests):
            have = self.streams.get(a.stream, {})
            return sm.ManifestsVerified(ticket=a.ticket, stream=a.stream,
                                        manifests={v: have[v] for v in a.versions if v in have},
                                        missing=frozenset(v for v in a.versions if v not in have))
        if isinstance(a, sm.FetchSquashed):
            self.log.append(("squash?", a.start, a.end))
            return sm.SquashFetched(ticket=a.ticket, manifest=self.squash.get((a.start, a.end)))
        if isinstance(a, sm.FetchBlobs):
            return sm.BlobsReady(ticket=a.ticket, version=a.manifest.version, blobs=[b.id for b in a.manifest.blobs])
        if isinstance(a, sm.Prepare):
            assert a.state_fp == sfp(a.version), "a step must carry the SIGNED state fingerprint"
            step = (a.kind, a.base, a.version) + (("squashed",) if a.squashed else ())
            return sm.StepPrepared(ticket=a.ticket, version=a.version, payload=step)
        if isinstance(a, sm.Wait):
            self.log.append(("wait", a.seconds))
            return sm.Woke(ticket=a.ticket)
        raise AssertionError(a)


def drive(world: World, *, trusted: int | None = None, limit: int = 200, **config) -> sm.SyncMachine:
    """Run the machine against ``world`` until it long-polls at the head (or ``limit`` actions)."""
    m = sm.SyncMachine(sm.SyncConfig(model=M, **config))
    queue: list[sm.Deliver] = []
    gen = [0]
    live = [trusted]

    def handle(actions):
        for a in actions:
            if isinstance(a, sm.Deliver):
                if a.generation == gen[0]:  # ReadyQueue.push refuses older generations
                    queue.append(a)
                    world.log.append(("deliver", *a.payload))
            elif isinstance(a, sm.Notify):
                world.log.append((a.kind, a.version))

    handle(m.send(sm.Started(trusted=trusted)))
    for _ in range(limit):
        while queue and world.applying:
            d = queue.pop(0)
            reasons = world.fail.get(d.version)
            if reasons:
                reason = reasons.pop(0)
                gen[0] += 1
                queue.clear()
                if reason == "keyframe":
                    live[0] = None
                world.log.append(("failed", d.version, reason))
                handle(m.send(sm.ApplyFailed(version=d.version, generation=gen[0], reason=reason, live=live[0])))
            else:
                live[0] = d.version
                world.log.append(("applied", d.version))
                handle(m.send(sm.Applied(version=d.version, generation=d.generation)))
        a = m.pending
        assert a is not None and isinstance(a, sm.BLOCKING), a
        ev = world.answer(a)
        if ev is None:
            break
        handle(m.send(ev))
    m.test_live = live[0]
    return m


def chain(a: int, b: int, **kw) -> dict[int, Manifest]:
    return {v: delta(v, **kw) for v in range(a, b + 1)}


def delivered(world: World) -> list[tuple]:
    return [e[1:] for e in world.log if e[0] == "deliver"]


def kinds(world: World) -> list[str]:
    return [e[0] for e in world.log if e[0] in ("refetch", "resync", "error", "failed")]


def bad_squash(start: int, end: int) -> Manifest:
    """A squashed delta whose tensor records do not lead to the signed state of ``end``."""
    return Manifest(model=M, version=end, parent=start, kind="delta", tensors=(rec(end + 100),),
                    blobs=(BlobRef(id="sq", size=1),), state_fp=sfp(end))


def squash(start: int, end: int, size: int = 5) -> Manifest:
    return Manifest(model=M, version=end, parent=start, kind="delta", tensors=(rec(end),),
                    blobs=(BlobRef(id="sq", size=size),), state_fp=sfp(end))


SCENARIOS = [
    # (id, world streams, squash offers, trusted, config, expected deliveries)
    ("fresh-inline-keyframe-then-chain", {M: {0: keyframe(0), **chain(1, 3)}}, {}, None, {},
     [("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2), ("delta", 2, 3)]),
    ("fresh-side-keyframe-is-newer", {M: {0: keyframe(0), **chain(1, 10)}, KF: {8: keyframe(8, model=KF)}}, {}, None, {},
     [("keyframe", None, 8), ("delta", 8, 9), ("delta", 9, 10)]),
    ("side-keyframe-above-head-is-ignored", {M: {0: keyframe(0), **chain(1, 2)}, KF: {9: keyframe(9, model=KF)}}, {},
     None, {}, [("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2)]),
    ("trusted-one-behind", {M: {0: keyframe(0), **chain(1, 4)}}, {}, 3, {}, [("delta", 3, 4)]),
    ("squashed-delta-used", {M: {0: keyframe(0), **chain(1, 8)}}, {(2, 8): squash(2, 8)}, 2, {},
     [("delta", 2, 8, "squashed")]),
    ("squashed-dearer-than-chain", {M: {0: keyframe(0), **chain(1, 5)}}, {(2, 5): squash(2, 5, size=1000)}, 2, {},
     [("delta", 2, 3), ("delta", 3, 4), ("delta", 4, 5)]),
    ("squashed-not-leading-to-signed-state", {M: {0: keyframe(0), **chain(1, 8)}}, {(2, 8): bad_squash(2, 8)}, 2, {},
     [("delta", v - 1, v) for v in range(3, 9)]),
    ("squashed-for-another-range", {M: {0: keyframe(0), **chain(1, 8)}}, {(2, 8): squash(3, 8)}, 2, {},
     [("delta", v - 1, v) for v in range(3, 9)]),
    ("squash-disabled", {M: {0: keyframe(0), **chain(1, 8)}}, {(2, 8): squash(2, 8)}, 2, {"use_squash": False},
     [("delta", v - 1, v) for v in range(3, 9)]),
    ("short-chain-skips-squash", {M: {0: keyframe(0), **chain(1, 4)}}, {(2, 4): squash(2, 4, size=1)}, 2, {},
     [("delta", 2, 3), ("delta", 3, 4)]),
    ("missing-chain-side-keyframe-in-range", {M: chain(5, 8), KF: {6: keyframe(6, model=KF)}}, {}, 2, {},
     [("keyframe", None, 6), ("delta", 6, 7), ("delta", 7, 8)]),
    ("missing-chain-squash-bridges-it", {M: chain(5, 8)}, {(2, 8): squash(2, 8)}, 2, {}, [("delta", 2, 8, "squashed")]),
    ("missing-chain-inline-keyframe", {M: {5: keyframe(5), **chain(6, 8)}}, {}, 2, {},
     [("keyframe", None, 5), ("delta", 5, 6), ("delta", 6, 7), ("delta", 7, 8)]),
    ("missing-chain-side-keyframe-at-the-gap", {M: chain(4, 8), KF: {4: keyframe(4, model=KF)}}, {}, 2,
     {}, [("keyframe", None, 4)] + [("delta", v - 1, v) for v in range(5, 9)]),
    ("already-at-head", {M: {0: keyframe(0), **chain(1, 3)}}, {}, 3, {}, []),
]


@pytest.mark.parametrize("case", SCENARIOS, ids=[c[0] for c in SCENARIOS])
def test_catch_up_paths(case):
    _, streams, offers, trusted, config, expected = case
    world = World(streams=streams, squash=offers)
    m = drive(world, trusted=trusted, **config)
    assert delivered(world) == expected, world.log
    assert m.test_live == world.head(M)
    assert kinds(world) == []


FAILURES = [
    # (id, fail script, config, expected failure/notify kinds, expected deliveries)
    ("rollback-refetch-then-resync", {2: ["integrity", "integrity"]}, {},
     ["failed", "refetch", "failed", "resync"],
     [("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2), ("delta", 1, 2), ("keyframe", None, 0), ("delta", 0, 1),
      ("delta", 1, 2), ("delta", 2, 3)]),
    ("refetch-succeeds", {2: ["integrity"]}, {}, ["failed", "refetch"],
     [("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2), ("delta", 1, 2), ("delta", 2, 3)]),
    ("max-refetch-0-resyncs-at-once", {2: ["integrity"]}, {"max_refetch": 0}, ["failed", "resync"],
     [("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2), ("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2),
      ("delta", 2, 3)]),
    ("base-mismatch-resyncs-at-once", {2: ["base_mismatch"]}, {}, ["failed", "resync"],
     [("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2), ("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2),
      ("delta", 2, 3)]),
    ("scrub-mismatch-resyncs", {1: ["scrub"]}, {}, ["failed", "resync"],
     [("keyframe", None, 0), ("delta", 0, 1), ("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2), ("delta", 2, 3)]),
    ("failed-keyframe-copy-resyncs", {0: ["keyframe"]}, {}, ["failed", "resync"],
     [("keyframe", None, 0), ("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2), ("delta", 2, 3)]),
]


@pytest.mark.parametrize("case", FAILURES, ids=[c[0] for c in FAILURES])
def test_apply_failures(case):
    _, fail, config, expected_kinds, expected = case
    world = World(streams={M: {0: keyframe(0), **chain(1, 3)}}, fail={v: list(r) for v, r in fail.items()})
    m = drive(world, use_squash=False, **config)
    assert kinds(world) == expected_kinds, world.log
    assert delivered(world) == expected, world.log
    assert m.test_live == 3
    assert m.refetches == expected_kinds.count("refetch") and m.resyncs == expected_kinds.count("resync")


def test_failures_are_counted_per_version_and_forgotten_after_a_success():
    world = World(streams={M: {0: keyframe(0), **chain(1, 3)}}, fail={1: ["integrity"], 2: ["integrity"]})
    m = drive(world, use_squash=False)
    assert kinds(world) == ["failed", "refetch", "failed", "refetch"]  # one failure each: never a resync
    assert m.failures == {} and m.test_live == 3


@pytest.mark.parametrize("trusted_ok, expected", [
    (True, [("delta", 3, 4)]),
    (False, [("keyframe", None, 0)] + [("delta", v - 1, v) for v in range(1, 5)]),
], ids=["trusted-version-checks-out", "trusted-version-does-not-match"])
def test_trusted_initial_version(trusted_ok, expected):
    world = World(streams={M: {0: keyframe(0), **chain(1, 4)}}, initial_ok=trusted_ok)
    m = sm.SyncMachine(sm.SyncConfig(model=M, use_squash=False))
    first = m.send(sm.Started(trusted=3))
    assert [type(a) for a in first] == [sm.CheckInitial] and first[0].version == 3
    world = World(streams=world.streams, initial_ok=trusted_ok)
    drive(world, trusted=3, use_squash=False)
    assert delivered(world) == expected


def test_no_keyframe_anywhere_reports_and_backs_off_doubling():
    world = World(streams={M: chain(1, 3)})
    drive(world, limit=30)
    errors = [e for e in world.log if e[0] == "error"]
    waits = [e[1] for e in world.log if e[0] == "wait"]
    assert errors and delivered(world) == []
    assert waits[:6] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0]


def test_source_failures_back_off_then_recover_and_reset_the_backoff():
    world = World(streams={M: {0: keyframe(0), **chain(1, 2)}}, source_errors=2)
    m = drive(world)
    assert [e[0] for e in world.log[:4]] == ["error", "wait", "error", "wait"]
    assert [e[1] for e in world.log if e[0] == "wait"] == [0.2, 0.4]
    assert m.test_live == 2 and m._backoff == 0.2


def test_stream_with_no_version_waits_and_asks_again():
    m = sm.SyncMachine(sm.SyncConfig(model=M))
    (poll,) = m.send(sm.Started())
    assert isinstance(poll, sm.PollHead) and poll.after is None
    (wait,) = m.send(sm.HeadSeen(ticket=poll.ticket, stream=M, version=None))
    assert isinstance(wait, sm.Wait) and wait.seconds == 0.5
    (again,) = m.send(sm.Woke(ticket=wait.ticket))
    assert isinstance(again, sm.PollHead) and again.ticket != poll.ticket


def test_a_long_poll_with_nothing_new_polls_again_without_walking():
    m = sm.SyncMachine(sm.SyncConfig(model=M))
    (check,) = m.send(sm.Started(trusted=3))
    (poll,) = m.send(sm.InitialChecked(ticket=check.ticket, ok=True))
    assert isinstance(poll, sm.PollHead) and poll.after == 3
    (again,) = m.send(sm.HeadSeen(ticket=poll.ticket, stream=M, version=3))
    assert isinstance(again, sm.PollHead) and again.after == 3


def test_a_result_for_a_superseded_action_is_ignored():
    m = sm.SyncMachine(sm.SyncConfig(model=M))
    (check,) = m.send(sm.Started(trusted=3))
    (poll,) = m.send(sm.InitialChecked(ticket=check.ticket, ok=True))
    # an apply failure arrives while the poll is out: a new round supersedes it
    out = m.send(sm.ApplyFailed(version=4, generation=1, reason="base_mismatch", live=3))
    assert [type(a) for a in out] == [sm.Notify, sm.PollHead] and out[0].kind == "resync"
    assert out[1].ticket != poll.ticket and out[1].after is None  # a resync round starts at the head
    assert m.send(sm.HeadSeen(ticket=poll.ticket, stream=M, version=9, manifest=delta(9))) == []
    assert m.generation == 1 and m.need_keyframe


def test_steps_carry_the_generation_of_the_queue_after_a_failure():
    world = World(streams={M: {0: keyframe(0), **chain(1, 3)}}, fail={2: ["integrity"]})
    drive(world, use_squash=False)
    m = sm.SyncMachine(sm.SyncConfig(model=M))
    assert m.generation == 0
    out = m.send(sm.ApplyFailed(version=2, generation=7, reason="integrity", live=1))
    assert m.generation == 7 and m.live == 1 and m.pipeline_version == 1
    assert [a.kind for a in out if isinstance(a, sm.Notify)] == ["refetch"]


def test_max_ready_back_pressure():
    world = World(streams={M: {0: keyframe(0), **chain(1, 6)}}, applying=False)
    m = drive(world, limit=40, use_squash=False, max_ready=3)
    assert delivered(world) == [("keyframe", None, 0), ("delta", 0, 1), ("delta", 1, 2)]
    assert m.outstanding == 3 and isinstance(m.pending, sm.Wait)
    # the engine applies one: the machine stops waiting and resumes from the pipeline's version
    out = m.send(sm.Applied(version=0, generation=0))
    assert [type(a) for a in out] == [sm.PollHead] and out[0].after == 2


def test_a_keyframe_stream_that_does_not_hold_the_signed_state_is_refused():
    wrong = Manifest(model=KF, version=8, parent=None, kind="keyframe", tensors=(rec(99),),
                     blobs=(BlobRef(id="k", size=1),), state_fp=sfp(99))
    world = World(streams={M: {0: keyframe(0), **chain(1, 10)}, KF: {8: wrong}})
    drive(world, limit=12)
    errors = [e for e in world.log if e[0] == "error"]
    assert errors and ("keyframe", None, 8) not in delivered(world)


def test_applied_from_an_old_generation_is_ignored():
    m = sm.SyncMachine(sm.SyncConfig(model=M))
    m.send(sm.Started())
    m.send(sm.ApplyFailed(version=None, generation=2, reason="scrub", live=None))
    before = (m.live, m.outstanding)
    assert m.send(sm.Applied(version=5, generation=1)) == []
    assert (m.live, m.outstanding) == before


def test_started_twice_is_a_bug():
    m = sm.SyncMachine(sm.SyncConfig(model=M))
    m.send(sm.Started())
    with pytest.raises(RuntimeError):
        m.send(sm.Started())


def test_errors_name_what_is_missing():
    world = World(streams={M: chain(1, 3)})
    drive(world, limit=3)
    err = next(e for e in world.log if e[0] == "error")
    assert err is not None
    m = sm.SyncMachine(sm.SyncConfig(model=M))
    (poll,) = m.send(sm.Started())
    (side,) = m.send(sm.HeadSeen(ticket=poll.ticket, stream=M, version=3, manifest=delta(3)))
    (walk,) = m.send(sm.HeadSeen(ticket=side.ticket, stream=KF, version=None))
    out = m.send(sm.ManifestsVerified(ticket=walk.ticket, stream=M, manifests=chain(1, 3)))
    note = next(a for a in out if isinstance(a, sm.Notify))
    assert isinstance(note.error, NotFoundError) and "no keyframe" in note.detail and "m.kf" in note.detail
    assert not isinstance(note.error, IntegrityError)


def test_no_path_from_the_live_version_turns_into_a_resync():
    world = World(streams={M: chain(5, 8)})  # v3, v4 are gone and no keyframe is left
    m = drive(world, trusted=2, limit=12)
    assert m.need_keyframe
    err = next(e for e in world.log if e[0] == "error")
    assert err == ("error", 2)
    assert delivered(world) == []
