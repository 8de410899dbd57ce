"""Budgeted streams end to end: a real origin and relay on loopback, the publisher and the sidecar
with a budget, unchanged subscribers that stay bit-exact to the served view."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass

import pytest
import torch

from deltasync.budget import META_BUDGET, budget_of, residual_of, wire_bytes
from deltasync.cli.cluster import LocalCluster
from deltasync.client.http import HttpClient
from deltasync.client.publisher import Publisher
from deltasync.client.sidecar import Sidecar
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.codec import diff_states, encode_diff
from deltasync.manifest import parse_manifest
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

KEY = bytes(range(32))
SHAPE = ModelShape(vocab=1024, hidden=64, layers=1, ffn=128)
LR = 1e-4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("budget"), key=KEY)
    try:
        c.start_origin()
        c.start_tree({"relay": ["origin"]})
        yield c
    finally:
        c.close()


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
            ThreadedSubscriber(cluster.url("relay"), "b1", target, verifier=KEY) as sub:
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
    with ThreadedSubscriber(cluster.url("relay"), "b1", late, verifier=KEY) as sub2:
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
                m = parse_manifest(await h.get_manifest("b3", step), verifier=KEY)
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

    with ThreadedSubscriber(cluster.url("relay"), "b3", target, verifier=KEY) as sub:
        trainer, served_path = asyncio.run(main(sub))
    assert _same(target, trainer)
    assert served_path.exists() and served_path.with_name(served_path.name + ".owed").exists()


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys):
    """The ``deltasync`` command in this process (what the subprocess tests of test_client_cli.py run)."""
    from deltasync.cli.main import main

    def run(*args: str) -> Ran:
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = e.code
        out = capsys.readouterr()
        return Ran(returncode=rc, stdout=out.out, stderr=out.err)
    return run


def test_publish_command_with_a_budget_keeps_the_served_view_in_its_state_dir(cluster, tmp_path, cli):
    budget = _mean_lossless(14, 2) // 3
    tr = RLTrace(SHAPE, lr=LR, seed=14)
    states = [tr.state(), tr.step(), tr.step()]
    pub = ["publish", "--origin", cluster.origin, "--model", "b4", "--token-file", str(cluster.token_file),
           "--key-file", str(cluster.key_file), "--budget", str(budget), "--max-owed-steps", "4"]
    r = cli(*pub[:-4], str(tmp_path / "missing.safetensors"), "--budget", "100")
    assert r.returncode == 2 and "--state-dir" in r.stderr
    for i, st in enumerate(states):
        write_state_file(tmp_path / f"s{i}.safetensors", st)
        r = cli(*pub, "--state-dir", str(tmp_path / "served"), str(tmp_path / f"s{i}.safetensors"))
        assert r.returncode == 0, r.stderr
        assert f"published b4 v{i}: {'keyframe' if i == 0 else 'delta'}" in r.stdout
        if i:
            assert f"budget {budget:,} bytes" in r.stdout and "still owed" in r.stdout, r.stdout
    served = read_state_file(tmp_path / "served" / "served.safetensors")
    assert not _same(served, states[-1])
    out = tmp_path / "sub.safetensors"
    r = cli("subscribe", "--from", cluster.url("relay"), "--model", "b4", "--key-file", str(cluster.key_file),
             "--out", str(out), "--once", "--timeout", "60")
    assert r.returncode == 0, r.stderr
    assert _same(read_state_file(out), served)  # subscribers hold the served view kept in --state-dir
    for v in (1, 2):
        async def get():
            async with HttpClient(cluster.origin) as h:
                return parse_manifest(await h.get_manifest("b4", v), verifier=KEY)
        m = asyncio.run(get())
        assert wire_bytes(m) <= budget and residual_of(m)["max_owed_steps"] == 4
    assert (tmp_path / "served" / "served.safetensors.owed").exists()


def test_inspect_shows_the_budget_what_is_owed_and_the_residual(tmp_path, cli):
    from deltasync.budget import BudgetPolicy, Budgeter
    from deltasync.deltafile import write_delta_file
    tr = RLTrace(SHAPE, lr=LR, seed=15)
    a, b = tr.state(), tr.step()
    diff = diff_states(a, b)
    budget = wire_bytes(encode_diff(diff, model="m", version=1, parent=0).manifest) // 4
    plan = Budgeter(BudgetPolicy(bytes=budget)).plan(diff, model="m", version=1, parent=0)
    write_delta_file(tmp_path / "d.delta", plan.encoded.manifest, plan.encoded.blobs)
    r = cli("inspect", str(tmp_path / "d.delta"))
    assert r.returncode == 0, r.stderr
    rep = plan.report
    assert f"budget {budget:,} bytes/delta" in r.stdout
    assert f"{rep.owed:,} words" in r.stdout and f"{rep.owed_bytes:,} bytes" in r.stdout
    assert f"max {rep.max_ulps} ULPs" in r.stdout and "max age 1/8" in r.stdout
    r = cli("inspect", "--json", str(tmp_path / "d.delta"))
    info = json.loads(r.stdout)
    assert info["budget"] == budget and info["residual"]["owed"] == rep.owed
    write_delta_file(tmp_path / "l.delta", *_lossless(diff))
    r = cli("inspect", str(tmp_path / "l.delta"))
    assert r.returncode == 0 and "budget" not in r.stdout


def _lossless(diff):
    enc = encode_diff(diff, model="m", version=1, parent=0)
    return enc.manifest, enc.blobs


def test_served_view_file_round_trips_with_its_ledger_and_refuses_another_head(tmp_path):
    from deltasync.budget import BudgetPolicy, Budgeter
    from deltasync.client.served import load_served, save_served
    from deltasync.fingerprint import fingerprint_state, state_fingerprint_of
    tr = RLTrace(SHAPE, lr=LR, seed=16)
    a, b = tr.state(), tr.step()
    bud = Budgeter(BudgetPolicy(bytes=_mean_lossless(16, 1) // 4))
    plan = bud.plan(diff_states(a, b), model="m", version=1, parent=0)
    bud.commit(plan)
    served = _copy(a)
    from deltasync.dtypes import word_view
    for name, chunks in plan.sent.chunks.items():
        for c in chunks:
            word_view(served[name])[torch.from_numpy(c.positions)] = torch.from_numpy(c.new.view("i2"))
    assert fingerprint_state(served) == plan.sent.fps_after
    path = tmp_path / "served.safetensors"
    save_served(path, served, "m", 1, bud)
    sfp = state_fingerprint_of(served)
    back = Budgeter(bud.policy)
    got = load_served(path, "m", 1, sfp, back)
    assert got is not None and _same(got[0], served) and got[1] == plan.sent.fps_after
    for name in served:
        p0, a0 = bud.owed_ages(name)
        p1, a1 = back.owed_ages(name)
        assert (p0 == p1).all() and (a0 == a1).all()
    assert load_served(path, "m", 2, sfp, back) is None  # the origin moved on: not this view
    assert load_served(path, "other", 1, sfp, back) is None
    assert load_served(path, "m", 1, "0" * 16, back) is None
    assert load_served(tmp_path / "missing.safetensors", "m", 1, sfp, back) is None
