"""The sidecar and its checkpoint folder rules: complete files only, mmap views, truncation skipped, resume."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from deltasync.client.checkpoints import CheckpointError, MappedCheckpoint, checkpoint_step, find_checkpoints
from deltasync.cli.cluster import LocalCluster
from deltasync.client.sidecar import STATE_NAME, Sidecar
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.tensorfile import write_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)


@pytest.mark.parametrize("name, step", [
    ("step-000120.safetensors", 120), ("ckpt_7.safetensors", 7), ("model-v2-step-30.safetensors", 30),
    ("final.safetensors", None), ("step-3.pt", None),
])
def test_checkpoint_step_is_the_last_number_in_the_name(name, step):
    assert checkpoint_step(name) == step


def test_only_complete_checkpoints_count(tmp_path):
    for name in ["step-1.safetensors", ".step-2.safetensors", "step-3.safetensors.tmp", "step-4.safetensors.part",
                 "step-5.tmp.safetensors", "notes.txt", "step-6.safetensors"]:
        (tmp_path / name).write_bytes(b"x")
    assert [c.step for c in find_checkpoints(tmp_path)] == [1, 6]
    (tmp_path / "step-6.safetensors.done").write_bytes(b"")
    assert [c.step for c in find_checkpoints(tmp_path, marker=".done")] == [6]
    assert find_checkpoints(tmp_path / "missing") == []


def test_mapped_checkpoint_views_the_file_and_rejects_damage(tmp_path):
    state = {"a": torch.randn(10, 3).bfloat16(), "b": torch.arange(5), "e": torch.empty(0), "s": torch.tensor(1.5),
             "f8": torch.randn(4).to(torch.float8_e4m3fn)}
    p = tmp_path / "step-1.safetensors"
    write_state_file(p, state)
    with MappedCheckpoint(p) as ck:
        assert set(ck.tensors) == set(state)
        for n, t in state.items():
            assert torch.equal(ck.tensors[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
    data = p.read_bytes()
    for bad, why in [(data[:-1], "truncated"), (data[:6], "too short"), (b"\xff" * 8 + data[8:], "runs past"),
                     (data[:8] + b"x" + data[9:], "not JSON"), (data + b"\0", "after the last tensor")]:
        q = tmp_path / "bad.safetensors"
        q.write_bytes(bad)
        with pytest.raises(CheckpointError, match=why):
            MappedCheckpoint(q)
    with pytest.raises(CheckpointError, match="cannot open"):
        MappedCheckpoint(tmp_path / "nope.safetensors")


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("sidecar"))
    try:
        c.start_origin()
        yield c
    finally:
        c.close()


def _sync(c: LocalCluster, model: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {n: torch.zeros_like(t) for n, t in like.items()}
    with ThreadedSubscriber(c.origin, model, target) as sub:
        sub.sync(60)
    return target


def test_sidecar_publishes_in_order_skips_truncated_and_resumes(origin, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=5)
    states = {}
    for step in (10, 20):
        states[step] = trace.step()
        write_state_file(tmp_path / f"step-{step}.safetensors", states[step])
    good = (tmp_path / "step-20.safetensors").read_bytes()
    (tmp_path / "step-25.safetensors").write_bytes(good[: len(good) - 100])  # a torn write under the final name
    seen = []
    car = Sidecar(tmp_path, origin.origin, "sc", origin.token, keyframe_every=2, delete_published=True,
                  on_event=seen.append)
    events = asyncio.run(_scan_and_close(car))
    kinds = [(e.kind, e.step) for e in events]
    assert kinds == [("published", 10), ("published", 20), ("deleted", 10), ("skipped", 25)]
    assert "truncated" in events[-1].detail
    assert not (tmp_path / "step-10.safetensors").exists()  # superseded base, deleted
    state = json.loads((tmp_path / STATE_NAME).read_text())
    assert state["version"] == 20 and state["base"]["path"] == "step-20.safetensors"
    # a restart resumes with a delta against step 20; the truncated file is not retried
    states[30] = trace.step()
    write_state_file(tmp_path / "step-30.safetensors", states[30])
    car2 = Sidecar(tmp_path, origin.origin, "sc", origin.token, keyframe_every=2, delete_published=True)
    events = asyncio.run(_scan_and_close(car2))
    assert [(e.kind, e.step) for e in events] == [("published", 30), ("deleted", 20)]
    assert "delta v30" in events[0].detail and "side keyframe" in events[0].detail
    assert _same(_sync(origin, "sc", states[30]), states[30])
    assert (tmp_path / "step-25.safetensors").exists()  # skipped files are left for a human to look at


async def _scan_and_close(car: Sidecar):
    try:
        return await car.scan()
    finally:
        await car.close()


def test_sidecar_cli_with_marker_files(origin, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=6)
    s1, s2 = trace.step(), trace.step()
    write_state_file(tmp_path / "ckpt-1.safetensors", s1)
    (tmp_path / "ckpt-1.safetensors.done").write_bytes(b"")
    write_state_file(tmp_path / "ckpt-2.safetensors", s2)  # no marker yet: not complete
    token = tmp_path / "token"
    token.write_text(origin.token)
    argv = [sys.executable, "-m", "deltasync.client.cli", "sidecar", "--watch", str(tmp_path), "--origin", origin.origin,
            "--model", "scm", "--token-file", str(token), "--marker", ".done", "--once"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "published ckpt-1.safetensors" in r.stdout
    assert _same(_sync(origin, "scm", s1), s1)
    (tmp_path / "ckpt-2.safetensors.done").write_bytes(b"")
    r = subprocess.run([*argv, "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    assert _same(_sync(origin, "scm", s2), s2)


def test_sidecar_streams_signed_keyframes_from_the_file_and_subscribers_verify_them(origin, tmp_path):
    """Keyframes (the first version and the side stream's) go out as pieces of the mapped checkpoint, with a
    digest of every shard under the signature: a subscriber holding the key verifies and rebuilds them."""
    key = b"k" * 32
    trace = RLTrace(SHAPE, lr=1e-4, seed=8)
    s1, s2 = trace.step(), trace.step()
    write_state_file(tmp_path / "step-1.safetensors", s1)
    write_state_file(tmp_path / "step-2.safetensors", s2)
    car = Sidecar(tmp_path, origin.origin, "scs", origin.token, signer=key, keyframe_every=1)
    events = asyncio.run(_scan_and_close(car))
    assert [(e.kind, e.step) for e in events] == [("published", 1), ("published", 2)]
    assert "keyframe v1" in events[0].detail and "delta v2" in events[1].detail
    assert "side keyframe" in events[1].detail
    for model in ("scs", "scs.kf"):  # the main stream and its side keyframe stream
        target = {n: torch.zeros_like(t) for n, t in s2.items()}
        with ThreadedSubscriber(origin.origin, model, target, verifier=key) as sub:
            sub.sync(60)
        assert _same(target, s2)


def test_a_checkpoint_rewritten_while_its_keyframe_streams_is_not_committed(origin, tmp_path, monkeypatch):
    """The streamed keyframe reads the file's pages as it uploads: if the file changes meanwhile, nothing is
    committed (the uploaded blobs are orphans the origin sweeps) and the checkpoint is skipped."""
    import deltasync.client.sidecar as sidecar_mod

    trace = RLTrace(SHAPE, lr=1e-4, seed=9)
    path = tmp_path / "step-1.safetensors"
    write_state_file(path, trace.step())
    real = sidecar_mod.publish_keyframe

    async def touched_meanwhile(*args, **kwargs):  # the real upload, then the trainer rewrites the file
        got = await real(*args, **kwargs)
        write_state_file(path, trace.step())
        return got

    monkeypatch.setattr(sidecar_mod, "publish_keyframe", touched_meanwhile)
    car = Sidecar(tmp_path, origin.origin, "scr", origin.token)
    events = asyncio.run(_scan_and_close(car))
    assert [(e.kind, e.step) for e in events] == [("skipped", 1)]
    assert "changed while it was being published" in events[0].detail

    async def head():
        car = Sidecar(tmp_path, origin.origin, "scr", origin.token)
        try:
            return await car.client.get_head("scr")
        finally:
            await car.close()

    assert asyncio.run(head()) is None  # no version of it went live
