"""Serving-format streams end to end: one Publisher with serve=["fp8-block", "int4"] on a real origin and
relay (loopback), a real AdamW trace, and plain subscribers of M.fp8 / M.int4 that hold, after every step,
the very tensors of that step's quantized checkpoint (deltasync.quant, itself checked against vLLM's and
compressed-tensors' code in test_quant.py); a budget caps the serving deltas too."""

from __future__ import annotations

import json

import pytest
import torch

from deltasync import quant
from deltasync.budget import wire_bytes
from deltasync.cli.cluster import LocalCluster
from deltasync.client.publisher import Publisher
from deltasync.client.serving import FORMAT_META, QUANT_META, SERVES_META, format_of, serving_model
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

KEY = bytes(range(32))
SHAPE = ModelShape(vocab=96, hidden=128, layers=1, ffn=256)
LR = 2e-5
FORMATS = ("fp8-block", "int4")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("serving"), key=KEY)
    try:
        c.start_origin()
        c.start_tree({"relay": ["origin"]})
        yield c
    finally:
        c.close()


def _empty(fmt: str, state) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in quant.serving_state(state, quant.ServingFormat(name=fmt)).items()}


def test_serving_streams_follow_the_trainer_bit_for_bit(cluster):
    tr = RLTrace(SHAPE, lr=LR, seed=21)
    first = tr.state()
    targets = {f: _empty(f, first) for f in FORMATS}
    subs = [ThreadedSubscriber(cluster.url("relay"), serving_model("s1", f), targets[f], verifier=KEY) for f in FORMATS]
    try:
        with Publisher(cluster.origin, "s1", cluster.token, KEY, keyframe_every=2, serve=FORMATS) as pub:
            for s in subs:
                s.start()
            state = first
            for step in range(5):
                pending = pub.publish(step, state)
                assert sorted(pending.serving) == ["s1.fp8", "s1.int4"]
                for fmt in FORMATS:
                    res = pending.serving[serving_model("s1", fmt)].result(60)
                    assert res.manifest.signature and res.kind == ("keyframe" if step == 0 else "delta")
                    meta = res.manifest.meta
                    assert meta[FORMAT_META] == fmt and meta[SERVES_META] == "s1"
                    assert format_of(meta) == quant.ServingFormat(name=fmt)
                    if fmt == "int4":
                        assert json.loads(meta[QUANT_META])["format"] == "pack-quantized"
                    if step:
                        dtypes = {t.dtype for t in res.manifest.tensors}
                        # deltas over the quantized words: fp8 (1-byte) or packed int32 words, and their scales
                        assert dtypes & ({"float8_e4m3fn", "float32"} if fmt == "fp8-block" else {"int32", "bfloat16"})
                for fmt, sub in zip(FORMATS, subs):
                    assert sub.wait_version(step, 60) == step
                    want = quant.serving_state(state, quant.ServingFormat(name=fmt))
                    assert _same(targets[fmt], want), (fmt, step)
                state = tr.step()
            assert pending.result(60).kind == "delta"  # the bf16 stream goes on as before
    finally:
        for s in subs:
            s.close()


def test_a_budget_caps_serving_deltas_and_subscribers_hold_the_served_view(cluster):
    tr = RLTrace(SHAPE, lr=LR, seed=22)
    first = tr.state()
    budget = 3000
    target = _empty("fp8-block", first)
    name = serving_model("s2", "fp8-block")
    with Publisher(cluster.origin, "s2", cluster.token, KEY, keyframe_every=0, budget=budget,
                   serve=["fp8-block"]) as pub, ThreadedSubscriber(cluster.url("relay"), name, target, verifier=KEY) as sub:
        child = pub.serving.publishers[name]
        pub.publish(0, first).serving[name].result(60)
        owed = 0
        for step in range(1, 5):
            res = pub.publish(step, tr.step()).serving[name].result(60)
            assert wire_bytes(res.manifest) <= budget, (wire_bytes(res.manifest), budget)
            owed = max(owed, res.residual.owed)
            assert sub.wait_version(step, 60) == step
            assert _same(target, child.served)  # bit-exact to the serving stream's served view
        assert owed > 0  # the budget bound: part of the quantized residual was left owed
