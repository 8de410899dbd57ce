"""Budgeted streams end to end: a real origin and relay on loopback, the publisher and the sidecar
with a budget, unchanged subscribers that stay bit-exact to the served view."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from deltasync.budget import META_BUDGET, budget_of, residual_of, wire_bytes
from deltasync.client.cluster import LocalCluster
from deltasync.client.http import HttpClient
from deltasync.client.publisher import Publisher
from deltasync.client.sidecar import Sidecar
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.codec import diff_states, encode_diff
from deltasync.manifest import parse_manifest
from deltasync.statefile import write_state_file
from deltasync.testing.trace import ModelShape, RLTrace

KEY = bytes(range(32))
SHAPE = ModelShape(vocab=1024, hidden=64, layers=1, ffn=128)
LR = 1e-4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("budget"), key=KEY)
    try:
        c.start_origin()
        c.start_relay("relay", [c.origin])
        yield c
    finally:
        c.close()


def _same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def _copy(state):
    return {n: t.clone() for n, t in state.items()}


def _mean_lossless(seed: int, steps: int) -> int:
    tr = RLTrace(SHAPE, lr=LR, seed=seed)
    prev, sizes = tr.state(), []
    for v in range(steps):
        cur = tr.step()
        sizes.append(wire_bytes(encode_diff(diff_states(prev, cur), model="m", version=v + 1, parent=v).manifest))
        prev = cur
    return sum(sizes) // len(sizes)


def test_publisher_with_a_budget_stays_within_it_and_subscribers_hold_the_served_view(cluster):
    budget = _mean_lossless(11, 3) // 4
    tr = RLTrace(SHAPE, lr=LR, seed=11)
    target = {n: torch.zeros_like(t) for n, t in tr.state().items()}
    late = {n: torch.zeros_like(t) for n, t in tr.state().items()}
    with Publisher(cluster.origin, "b1", cluster.token, KEY, keyframe_every=3, budget=budget) as pub, \
            ThreadedSubscriber(cluster.url("relay"), "b1", target, key=KEY) as sub:
        pub.publish(0, tr.state())
        for step in range(1, 6):
            trainer = tr.step()
            res = pub.publish(step, trainer).result(60)
            assert res.kind == "delta" and res.manifest.signature
            assert wire_bytes(res.manifest) <= budget, (wire_bytes(res.manifest), budget)
            assert res.residual is not None and res.residual.owed > 0 and res.residual.sent > 0
            assert budget_of(res.manifest) == budget and residual_of(res.manifest)["owed"] == res.residual.owed
            assert sub.wait_version(step, 60) == step
            served = _copy(pub.served)
            assert _same(target, served)  # bit-exact to the served view ...
            assert not _same(served, trainer)  # ... which is not (yet) the trainer's state
        # the trainer stops: the same state, version after version, until nothing is owed
        owed_bytes = res.residual.owed_bytes
        bound = pub.budget.max_owed_steps + 3 * math.ceil(owed_bytes / (budget // 2)) + 2
        step_stop = step
        while res.residual.owed and step - step_stop < bound:
            step += 1
            res = pub.publish(step, trainer).result(60)
            assert wire_bytes(res.manifest) <= budget
        assert res.residual.owed == 0 and res.residual.owed_bytes == 0, f"still owed after {step - step_stop} versions"
        assert _same(pub.served, trainer)
        assert sub.wait_version(step, 60) == step
        assert _same(target, trainer)  # the fleet holds the trainer's weights, bit for bit
    # a late joiner starts from a side keyframe of the served view (same signed state fingerprint)
    with ThreadedSubscriber(cluster.url("relay"), "b1", late, key=KEY) as sub2:
        assert sub2.wait_version(step, 60) == step
    assert _same(late, trainer)


def test_budget_none_and_an_unbound_budget_ship_the_lossless_bytes(cluster):
    tr = RLTrace(SHAPE, lr=LR, seed=12)
    states = [tr.state()] + [tr.step() for _ in range(3)]
    got = {}
    for model, budget in (("lossless", None), ("none", None), ("huge", 1 << 40)):
        with Publisher(cluster.origin, model, cluster.token, KEY, keyframe_every=0, budget=budget) as pub:
            for v, st in enumerate(states):
                pub.publish(v, st)
            pub.flush(60)
            got[model] = [r.manifest for r in pub.results]
    for a, b, c in zip(got["lossless"], got["none"], got["huge"]):
        # budget None: the very bytes of today's stream (the model name aside)
        assert a.canonical_bytes().replace(b'"model":"lossless"', b'"model":"none"') == b.canonical_bytes()
        # an unbound budget: the same blobs, tensors and fingerprints; only the meta marks the stream
        assert (a.blobs, a.tensors, a.state_fp) == (c.blobs, c.tensors, c.state_fp)
        assert META_BUDGET not in a.meta and c.meta[META_BUDGET] == str(1 << 40)
        if c.kind == "delta":
            assert residual_of(c)["owed"] == 0


def test_sidecar_with_a_budget_publishes_a_trace_within_it_and_converges(cluster, tmp_path):
    budget = _mean_lossless(13, 3) // 2
    tr = RLTrace(SHAPE, lr=LR, seed=13)
    target = {n: torch.zeros_like(t) for n, t in tr.state().items()}

    async def main(sub):
        car = Sidecar(tmp_path, cluster.origin, "b3", cluster.token, KEY, keyframe_every=0, budget=budget)
        h = HttpClient(cluster.origin)
        try:
            write_state_file(tmp_path / "step-0.safetensors", tr.state())
            trainer = None
            for step in range(1, 20):
                trainer = tr.step() if step <= 4 else trainer  # the trainer stops after step 4
                write_state_file(tmp_path / f"step-{step}.safetensors", trainer)
                events = await car.scan()
                assert [e.kind for e in events] == (["published", "published"] if step == 1 else ["published"])
                m = parse_manifest(await h.get_manifest("b3", step), key=KEY)
                assert m.kind == "delta" and wire_bytes(m) <= budget, (wire_bytes(m), budget)
                assert await asyncio.to_thread(sub.wait_version, step, 60) == step
                assert _same(target, car.served)
                if step > 4 and residual_of(m)["owed"] == 0:
                    break
            assert residual_of(m)["owed"] == 0, f"still owed at step {step}"
            return trainer, car.served_path
        finally:
            await h.close()
            await car.close()

    with ThreadedSubscriber(cluster.url("relay"), "b3", target, key=KEY) as sub:
        trainer, served_path = asyncio.run(main(sub))
    assert _same(target, trainer)
    assert served_path.exists() and served_path.with_name(served_path.name + ".owed").exists()
