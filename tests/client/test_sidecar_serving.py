"""The sidecar with serving formats: every checkpoint a trainer writes is published as M and, quantized, as
M.int4 / M.fp8 (real origin on loopback, real safetensors files, a real AdamW trace); subscribers of the serving
streams hold each checkpoint's quantized state bit for bit; after a restart the serving streams go on with a
keyframe."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltasync import quant
from deltasync.cli.cluster import LocalCluster
from deltasync.client.serving import serving_model
from deltasync.client.sidecar import Sidecar
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.tensorfile import write_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

KEY = bytes(range(32))
SHAPE = ModelShape(vocab=96, hidden=128, layers=1, ffn=256)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("sidecar-serving"), key=KEY)
    try:
        c.start_origin()
        yield c
    finally:
        c.close()


async def _scan_and_close(car: Sidecar):
    try:
        return await car.scan()
    finally:
        await car.close()


def _follow(cluster, model: str, want: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    target = {n: torch.zeros_like(t) for n, t in want.items()}
    with ThreadedSubscriber(cluster.origin, model, target, verifier=KEY) as sub:
        assert sub.wait_version(version, 60) == version
    return target


def test_sidecar_publishes_each_checkpoint_in_serving_formats(cluster, tmp_path):
    tr = RLTrace(SHAPE, lr=2e-5, seed=31)
    states = {1: tr.step(), 2: tr.step()}
    for step, st in states.items():
        write_state_file(tmp_path / f"step-{step}.safetensors", st)
    car = Sidecar(tmp_path, cluster.origin, "car", cluster.token, KEY, keyframe_every=0, serve=["int4", "fp8-block"])
    events = asyncio.run(_scan_and_close(car))
    assert [(e.kind, e.step) for e in events] == [("published", 1), ("served", 1), ("published", 2), ("served", 2)]
    assert "car.int4 delta" in events[3].detail and "car.fp8 delta" in events[3].detail
    for fmt in ("int4", "fp8-block"):
        want = quant.serving_state(states[2], quant.ServingFormat(name=fmt))
        assert _same(_follow(cluster, serving_model("car", fmt), want, 2), want)
    # a restart: the main stream resumes with a delta, the serving streams with a keyframe at the next checkpoint
    states[3] = tr.step()
    write_state_file(tmp_path / "step-3.safetensors", states[3])
    car2 = Sidecar(tmp_path, cluster.origin, "car", cluster.token, KEY, keyframe_every=0, serve=["int4"])
    events = asyncio.run(_scan_and_close(car2))
    assert [(e.kind, e.step) for e in events] == [("published", 3), ("served", 3)]
    assert "delta v3" in events[0].detail and "car.int4 keyframe" in events[1].detail
    want = quant.serving_state(states[3], quant.ServingFormat(name="int4"))
    assert _same(_follow(cluster, "car.int4", want, 3), want)


def test_sidecar_command_with_serve_format(tmp_path_factory, tmp_path):
    import subprocess
    import sys

    c = LocalCluster(tmp_path_factory.mktemp("sidecar-serving-cli"))
    try:
        c.start_origin()
        st = RLTrace(SHAPE, lr=2e-5, seed=32).step()
        write_state_file(tmp_path / "step-5.safetensors", st)
        token = tmp_path / "token"
        token.write_text(c.token)
        r = subprocess.run([sys.executable, "-m", "deltasync.client.cli", "sidecar", "--watch", str(tmp_path),
                            "--origin", c.origin, "--model", "cli", "--token-file", str(token), "--once",
                            "--serve-format", "fp8-block"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "served step-5.safetensors: cli.fp8 keyframe" in r.stdout, r.stdout
        want = quant.serving_state(st, quant.ServingFormat(name="fp8-block"))
        target = {n: torch.zeros_like(t) for n, t in want.items()}
        with ThreadedSubscriber(c.origin, "cli.fp8", target) as sub:
            assert sub.wait_version(5, 60) == 5
        assert _same(target, want)
    finally:
        c.close()
