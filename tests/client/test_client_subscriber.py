"""The subscriber against real servers: verification, rollback/refetch/resync, keys, failover, both APIs."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch
from torch import nn

from deltasync.client.appliers import TensorApplier
from deltasync.cli.cluster import LocalCluster
from deltasync.client.errors import SyncTimeout
from deltasync.client.http import Timeouts
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import Subscriber, SyncEvent, ThreadedSubscriber
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

KEY = bytes(range(1, 33))
SHAPE = ModelShape(vocab=256, hidden=32, layers=2, ffn=64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("sub"), key=KEY)
    try:
        c.start_tree({"relay": ["origin"]})
        yield c
    finally:
        c.close()


def _zeros(like):
    return {n: torch.zeros_like(t) for n, t in like.items()}


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


def test_full_verification_failure_rolls_back_refetches_then_resyncs(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=10)
    events: list[SyncEvent] = []
    with Publisher(cluster.origin, "rb", cluster.token, KEY, keyframe_every=0) as pub:
        s0, s1 = trace.step(), trace.step()
        pub.publish(0, s0)
        pub.publish(1, s1)
        pub.flush(60)
        target = _zeros(s1)
        sub = ThreadedSubscriber(cluster.url("relay"), "rb", target, verifier=KEY, verify="full", on_event=events.append)
        try:
            sub.start()
            assert sub.wait_version(1, 60) == 1
            name = "model.layers.0.mlp.up_proj.weight"
            with torch.no_grad():
                target[name].view(torch.int16)[5] ^= 0x0100  # the engine scribbles on a weight
            s2 = trace.step()
            pub.publish(2, s2)
            pub.flush(60)
            assert sub.wait_version(2, 60) == 2
            assert _same(target, s2)
        finally:
            sub.close()
    kinds = [e.kind for e in events if e.version is not None and e.kind != "applied" or e.kind == "applied"]
    i = kinds.index("rollback")
    assert kinds[i:i + 5] == ["rollback", "refetch", "rollback", "resync", "applied"], kinds
    st = sub.status
    assert st.rollbacks == 2 and st.refetches == 1 and st.resyncs == 1 and st.verify == "ok"


def test_scrub_finds_a_scribbled_weight_and_resyncs(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=11)
    events: list[SyncEvent] = []
    with Publisher(cluster.origin, "scrub", cluster.token, KEY, keyframe_every=0) as pub:
        s0 = trace.step()
        pub.publish(0, s0)
        pub.flush(60)
        target = _zeros(s0)
        with ThreadedSubscriber(cluster.url("relay"), "scrub", target, verifier=KEY, scrub_every=1,
                                on_event=events.append) as sub:
            assert sub.wait_version(0, 60) == 0
            with torch.no_grad():
                target["model.norm.weight"].view(torch.int16)[0] ^= 1  # not touched by any delta: only a scrub sees it
            s1 = trace.step()
            pub.publish(1, s1)
            pub.flush(60)
            deadline = time.monotonic() + 60
            while not (sub.version == 1 and _same(target, s1)):
                assert time.monotonic() < deadline, (sub.status, [e.kind for e in events])
                sub.apply_pending()
                time.sleep(0.05)
    assert any(e.kind == "scrub" and "differ" in e.detail for e in events)
    assert any(e.kind == "resync" for e in events)


def test_a_wrong_key_is_refused_and_nothing_is_applied(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=12)
    with Publisher(cluster.origin, "keyed", cluster.token, KEY) as pub:
        s0 = trace.step()
        pub.publish(0, s0)
    target = _zeros(s0)
    with ThreadedSubscriber(cluster.url("relay"), "keyed", target, verifier=bytes(32)) as sub:
        with pytest.raises(SyncTimeout, match="SignatureError"):
            sub.wait_version(0, 3)
        assert sub.version is None
    assert all(int(t.abs().sum()) == 0 for t in target.values())


def test_failover_past_a_dead_server_with_bounded_waits(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=13)
    with Publisher(cluster.origin, "fo", cluster.token, KEY) as pub:
        s0 = trace.step()
        pub.publish(0, s0)
    target = _zeros(s0)
    t0 = time.monotonic()
    with ThreadedSubscriber([_dead_url(), cluster.url("relay")], "fo", target, verifier=KEY,
                            timeouts=Timeouts(connect=1.0, read=5.0, poll=2.0)) as sub:
        assert sub.wait_version(0, 30) == 0
        assert sub.status.server == cluster.url("relay")
        assert sub.subscriber.client.stats.failovers >= 1
    assert _same(target, s0)
    assert time.monotonic() - t0 < 30


def test_nn_module_target_in_auto_mode_with_the_asyncio_api(cluster):
    torch.manual_seed(0)
    trainer = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.bfloat16)
    engine = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.bfloat16)
    applied: list[int] = []

    async def main():
        sub = Subscriber([cluster.url("relay"), cluster.origin], "mod", engine, verifier=KEY, auto=True,
                         on_applied=applied.append)
        await sub.start()
        try:
            pub = Publisher(cluster.origin, "mod", cluster.token, KEY)
            try:
                opt = torch.optim.SGD(trainer.parameters(), lr=0.5)
                for step in range(5):
                    loss = trainer(torch.randn(8, 16, dtype=torch.bfloat16)).float().pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    pub.publish(step, trainer)
                await asyncio.to_thread(pub.flush, 60)
            finally:
                await asyncio.to_thread(pub.close, 60)
            assert await sub.wait_version(4, 60) == 4
            with sub.hold():  # an engine's forward pass: no patch can land in the middle
                assert torch.equal(engine(torch.ones(2, 16, dtype=torch.bfloat16)),
                                   trainer(torch.ones(2, 16, dtype=torch.bfloat16)))
        finally:
            await sub.close()

    asyncio.run(main())
    assert applied and applied[-1] == 4
    for (n, a), (_, b) in zip(engine.state_dict().items(), trainer.state_dict().items()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), n


def _engine_holding(sub, seconds: float, seen: dict) -> threading.Thread:
    """An engine thread inside ``hold()`` for ``seconds``, noting what the subscriber did meanwhile."""
    held = threading.Event()

    def run():
        with sub.hold():
            held.set()
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                st = sub.status
                if st.ready >= 1 and "ready_after_s" not in seen:
                    seen["ready_after_s"] = time.monotonic() - t0
                seen["version_during_hold"] = st.version
                time.sleep(0.02)
            seen["ready_at_end"] = sub.status.ready
        seen["released_at"] = time.monotonic()

    th = threading.Thread(target=run, name="engine")
    th.start()
    assert held.wait(5)
    return th


def test_a_version_published_during_hold_is_downloaded_meanwhile_and_applied_at_once(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=14)
    with Publisher(cluster.origin, "hold", cluster.token, KEY, keyframe_every=0) as pub:
        s0 = trace.step()
        pub.publish(0, s0)
        pub.flush(60)
        target = _zeros(s0)
        with ThreadedSubscriber(cluster.url("relay"), "hold", target, verifier=KEY) as sub:
            assert sub.wait_version(0, 60) == 0
            seen: dict = {}
            engine = _engine_holding(sub, 4.0, seen)
            s1 = trace.step()
            pub.publish(1, s1)
            pub.flush(60)
            assert engine.is_alive(), "publishing took longer than the hold; the test shows nothing"
            engine.join(30)
            # downloaded and decoded while the engine held the lock
            assert seen["ready_at_end"] >= 1 and "ready_after_s" in seen, seen
            assert seen["version_during_hold"] == 0
            t0 = time.perf_counter()
            assert sub.apply_pending() == 1
            took = time.perf_counter() - t0
            assert took < 0.5, took
            assert _same(target, s1)
            print(f"\nhold test: v1 ready {seen['ready_after_s']:.2f}s into a 4 s hold; apply_pending took {took * 1e3:.1f} ms")


def test_auto_mode_never_patches_inside_hold_and_applies_when_it_ends(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=15)
    with Publisher(cluster.origin, "holda", cluster.token, KEY, keyframe_every=0) as pub:
        s0 = trace.step()
        pub.publish(0, s0)
        pub.flush(60)
        target = _zeros(s0)
        with ThreadedSubscriber(cluster.url("relay"), "holda", target, verifier=KEY, auto=True) as sub:
            assert sub.wait_version(0, 60) == 0
            seen: dict = {}
            engine = _engine_holding(sub, 3.0, seen)
            s1 = trace.step()
            pub.publish(1, s1)
            pub.flush(60)
            engine.join(30)
            assert seen["ready_at_end"] >= 1 and seen["version_during_hold"] == 0, seen
            assert sub.wait_version(1, 10) == 1
            assert time.monotonic() - seen["released_at"] < 2.0
            assert _same(target, s1)


def test_on_event_runs_with_no_lock_held(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=16)
    results: list[str] = []

    def on_event(ev: SyncEvent) -> None:
        # another thread asks for status and applies: it must not wait for a lock this callback holds
        def other():
            _ = sub.status
            sub.apply_pending()
            results.append(ev.kind)

        th = threading.Thread(target=other)
        th.start()
        th.join(5)
        if th.is_alive():
            results.append(f"deadlock in {ev.kind} on {threading.current_thread().name}")

    with Publisher(cluster.origin, "cb", cluster.token, KEY, keyframe_every=0) as pub:
        s0, s1 = trace.step(), trace.step()
        pub.publish(0, s0)
        pub.publish(1, s1)
        pub.flush(60)
        target = _zeros(s1)
        sub = ThreadedSubscriber(cluster.url("relay"), "cb", target, verifier=KEY, scrub_every=1, on_event=on_event)
        with sub:
            assert sub.wait_version(1, 60) == 1
    assert results and not [r for r in results if r.startswith("deadlock")], results
    assert "applied" in results and "scrub" in results


class _RecordingApplier:
    """An Applier that is not a dict or a module (as an engine's sharded applier is): it wraps a
    TensorApplier, names the blobs it needs explicitly and records what it is asked to do."""

    def __init__(self, target) -> None:
        self.inner = TensorApplier(target)
        self.calls: list[str] = []

    def layout(self):
        return self.inner.layout()

    def scan(self):
        self.calls.append("scan")
        return self.inner.scan()

    def needed_blobs(self, manifest):
        self.calls.append(f"needed v{manifest.version}")
        return {b.id for b in manifest.blobs}

    def stage_delta(self, prepared, fps, *, verify):
        self.calls.append(f"delta v{prepared.manifest.version}")
        return self.inner.stage_delta(prepared, fps, verify=verify)

    def stage_keyframe(self, state, fps):
        self.calls.append("keyframe")
        return self.inner.stage_keyframe(state, fps)


def test_an_applier_object_plugs_in_and_group_glue_can_apply_up_to_a_version(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=17)
    with Publisher(cluster.origin, "grp", cluster.token, KEY, keyframe_every=0) as pub:
        states = [trace.step() for _ in range(4)]
        for v, s in enumerate(states):
            pub.publish(v, s)
        pub.flush(60)
        target = _zeros(states[0])
        applier = _RecordingApplier(target)
        with ThreadedSubscriber(cluster.url("relay"), "grp", applier, verifier=KEY, use_squash=False) as sub:
            deadline = time.monotonic() + 60
            while len(sub.ready_steps()) < 4:
                assert time.monotonic() < deadline, sub.status
                time.sleep(0.05)
            assert sub.ready_steps() == [(None, 0), (0, 1), (1, 2), (2, 3)]
            assert sub.apply_pending(up_to=1) == 1
            assert _same(target, states[1]) and sub.ready_steps() == [(1, 2), (2, 3)]
            assert sub.apply_pending() == 3
    assert _same(target, states[3])
    staged = [c for c in applier.calls if c == "keyframe" or c.startswith("delta")]
    assert staged == ["keyframe", "delta v1", "delta v2", "delta v3"] and "needed v3" in applier.calls


def test_a_trusted_initial_version_is_scanned_and_used(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=18)
    with Publisher(cluster.origin, "trust", cluster.token, KEY, keyframe_every=0) as pub:
        s0, s1 = trace.step(), trace.step()
        pub.publish(0, s0)
        pub.flush(60)
        target = {n: t.clone() for n, t in s0.items()}
        applier = _RecordingApplier(target)
        with ThreadedSubscriber(cluster.url("relay"), "trust", applier, verifier=KEY, version=0) as sub:
            assert sub.version == 0 and sub.status.verify == "ok" and applier.calls == ["scan"]
            pub.publish(1, s1)
            pub.flush(60)
            assert sub.wait_version(1, 60) == 1
    assert "keyframe" not in applier.calls and _same(target, s1)
