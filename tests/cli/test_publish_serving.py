"""`deltasync publish --serve-format`: one bf16 checkpoint file published as M and, once M's version is live, as
the serving streams M.fp8 / M.int4 (issue 25). A real origin on loopback, real safetensors files of a real AdamW
trace, the real command in a subprocess; subscribers of the serving streams hold each step's quantized state bit
for bit (``deltasync.quant.serving_state``: the quantized checkpoint vLLM loads), the second step of each serving
stream is a delta (against ``--base`` quantized the same way, or the head rebuilt from the servers), a base that
is not the serving head gives a keyframe, and the options that cannot go together are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deltasync import quant
from deltasync.cli.cluster import LocalCluster
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.tensorfile import write_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state

KEY_HEX = bytes(range(32)).hex()
SHAPE = ModelShape(vocab=96, hidden=128, layers=1, ffn=256)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("publish-serving"), key=bytes(range(32)))
    try:
        c.start_origin()
        yield c
    finally:
        c.close()


def _publish(cluster, tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "token").write_text(cluster.token)
    (tmp_path / "key").write_text(KEY_HEX)
    return subprocess.run([sys.executable, "-m", "deltasync.client.cli", "publish", "--origin", cluster.origin,
                           "--token-file", str(tmp_path / "token"), "--key-file", str(tmp_path / "key"), *args],
                          capture_output=True, text=True, timeout=180)


def _held(cluster, model: str, want: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    target = {n: torch.zeros_like(t) for n, t in want.items()}
    with ThreadedSubscriber(cluster.origin, model, target, verifier=bytes(range(32))) as sub:
        assert sub.wait_version(version, 60) == version
    return target


def test_publish_serve_format_keyframe_then_deltas(cluster, tmp_path):
    tr = RLTrace(SHAPE, lr=2e-5, seed=41)
    files = {}
    for step in range(3):
        st = tr.step()
        files[step] = (tmp_path / f"s{step}.safetensors", st)
        write_state_file(files[step][0], st)
    serve = ["--serve-format", "fp8-block", "--serve-format", "int4"]
    r = _publish(cluster, tmp_path, "--model", "m", str(files[0][0]), *serve)
    assert r.returncode == 0, r.stderr
    assert "published m.fp8 v0: keyframe" in r.stdout and "published m.int4 v0: keyframe" in r.stdout, r.stdout
    # with --base: the base quantized the same way is each serving stream's head, so deltas
    r = _publish(cluster, tmp_path, "--model", "m", "--base", str(files[0][0]), str(files[1][0]), *serve)
    assert r.returncode == 0, r.stderr
    assert "published m v1: delta" in r.stdout, r.stdout
    assert "published m.fp8 v1: delta" in r.stdout and "published m.int4 v1: delta" in r.stdout, r.stdout
    # without --base: each head rebuilt from the servers
    r = _publish(cluster, tmp_path, "--model", "m", str(files[2][0]), *serve)
    assert r.returncode == 0, r.stderr
    assert "published m.fp8 v2: delta" in r.stdout and "published m.int4 v2: delta" in r.stdout, r.stdout
    for fmt in ("fp8-block", "int4"):
        want = quant.serving_state(files[2][1], quant.ServingFormat(name=fmt))
        name = "m.fp8" if fmt == "fp8-block" else "m.int4"
        assert same_state(_held(cluster, name, want, 2), want), fmt
    # the manifests say what they carry
    got = _held(cluster, "m", files[2][1], 2)
    assert same_state(got, files[2][1])


def test_publish_serve_format_base_not_the_serving_head_gives_a_keyframe(cluster, tmp_path):
    tr = RLTrace(SHAPE, lr=2e-5, seed=42)
    s0, s1, other = tr.step(), tr.step(), RLTrace(SHAPE, lr=2e-5, seed=43).step()
    for n, st in (("a", s0), ("b", s1), ("x", other)):
        write_state_file(tmp_path / f"{n}.safetensors", st)
    assert _publish(cluster, tmp_path, "--model", "k", str(tmp_path / "a.safetensors")).returncode == 0
    # k.fp8 starts at v1 (k had no serving stream at v0): a keyframe
    r = _publish(cluster, tmp_path, "--model", "k", "--base", str(tmp_path / "a.safetensors"),
                 str(tmp_path / "b.safetensors"), "--serve-format", "fp8-block")
    assert r.returncode == 0, r.stderr
    assert "published k v1: delta" in r.stdout and "published k.fp8 v1: keyframe" in r.stdout, r.stdout
    # a base that is not k's head: the bf16 publish refuses (as without --serve-format); with
    # --keyframe-on-mismatch both streams go on with keyframes
    write_state_file(tmp_path / "c.safetensors", tr.step())
    r = _publish(cluster, tmp_path, "--model", "k", "--base", str(tmp_path / "x.safetensors"),
                 str(tmp_path / "c.safetensors"), "--serve-format", "fp8-block")
    assert r.returncode != 0 and "not" in r.stderr
    r = _publish(cluster, tmp_path, "--model", "k", "--base", str(tmp_path / "x.safetensors"),
                 "--keyframe-on-mismatch", str(tmp_path / "c.safetensors"), "--serve-format", "fp8-block")
    assert r.returncode == 0, r.stderr
    assert "published k.fp8 v2: keyframe" in r.stdout, r.stdout


def test_publish_serve_format_refusals(cluster, tmp_path):
    write_state_file(tmp_path / "s.safetensors", RLTrace(SHAPE, lr=2e-5, seed=44).step())
    r = _publish(cluster, tmp_path, "--model", "r", str(tmp_path / "s.safetensors"), "--serve-format", "fp8-block",
                 "--budget", "1000", "--state-dir", str(tmp_path / "sd"))
    assert r.returncode == 2 and "--serve-format and --budget" in r.stderr
    r = _publish(cluster, tmp_path, "--model", "r", str(tmp_path / "s.safetensors"), "--serve-format", "int4",
                 "--serve-format", "int4")
    assert r.returncode == 2 and "listed twice" in r.stderr
    r = _publish(cluster, tmp_path, "--model", "r", str(tmp_path / "s.safetensors"), "--serve-format", "fp4")
    assert r.returncode == 2 and "invalid choice" in r.stderr
