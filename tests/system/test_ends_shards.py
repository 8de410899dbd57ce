"""Keyframe shards built and landed in one pass (issue 10): ``shard_bytes(fps=, into=)`` gives the same bytes
as a plain build and the fingerprints of a scrub; ``KeyframeWriter.add_shard`` copies a shard's bytes into the
map fingerprinting them as they land, and the first scan after it reads nothing again."""

from __future__ import annotations

import pytest
import torch

from deltasync import kernels
from deltasync.fingerprint import tensor_fingerprint
from deltasync.tensorfile import load_shard, shard_bytes


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "a.weight": torch.randn(300, 77, generator=g).bfloat16(),
        "b.bias": torch.randn(1001, generator=g),
        "c.ids": torch.randint(-100, 100, (333,), generator=g, dtype=torch.int8),
        "d.empty": torch.empty(0, 4, dtype=torch.float16),
        "e.f64": torch.randn(17, generator=g, dtype=torch.float64),
    }


@pytest.mark.parametrize("sel", ("reference", "auto"))
def test_shard_bytes_with_fingerprints_and_a_reused_buffer(sel):
    kernels.select(sel)
    try:
        state = _state()
        plain = bytes(shard_bytes(state))
        fps: dict[str, int] = {}
        buf = bytearray(len(plain) + 1000)
        got = shard_bytes(state, fps=fps, into=buf)
        assert isinstance(got, memoryview) and got.obj is buf and bytes(got) == plain
        assert fps == {n: tensor_fingerprint(t) for n, t in state.items()}
        small = shard_bytes(state, fps={}, into=bytearray(10))  # too small: a fresh buffer, same bytes
        assert isinstance(small, bytearray) and bytes(small) == plain
        back = load_shard(plain)
        assert all(torch.equal(back[n].view(torch.uint8) if back[n].numel() else back[n], state[n].view(torch.uint8)
                               if state[n].numel() else state[n]) for n in state)
    finally:
        kernels.select("auto")


def test_keyframe_writer_lands_shards_and_the_next_scan_reuses_their_fingerprints(tmp_path, monkeypatch):
    from deltasync.client import filetarget
    from deltasync.client.filetarget import FileTarget, KeyframeWriter
    from deltasync.keyframe import encode_keyframe

    state = _state()
    enc = encode_keyframe(state, model="m", version=3, shard_bytes=4096)
    assert len(enc.manifest.blobs) > 1
    layout = {t.name: (t.dtype, tuple(t.shape)) for t in enc.manifest.tensors}
    target = FileTarget(tmp_path / "f.safetensors", "m", layout=layout, open_existing=False)
    w = KeyframeWriter(target, enc.manifest)
    for ref in reversed(enc.manifest.blobs):  # any order
        w.add_shard(enc.blobs[ref.id])
    w.commit()
    assert target.version == 3
    for n, t in state.items():
        assert torch.equal(target.tensors()[n].view(torch.uint8) if t.numel() else target.tensors()[n],
                           t.view(torch.uint8) if t.numel() else t)
    calls = []
    real = filetarget.scan_file  # one pass over the file's data (every tensor's fingerprint)
    monkeypatch.setattr(filetarget, "scan_file", lambda f: calls.append(1) or real(f))
    first = target.scan()  # the adopt scan right after the keyframe: the fingerprints read back as it landed
    assert calls == [] and first == {n: filetarget.tensor_fingerprint(t) for n, t in state.items()}
    second = target.scan()  # any later scan (a scrub) reads the file
    assert calls == [1] and second == first
    target.close()


def test_keyframe_writer_refuses_a_shard_whose_bytes_do_not_match(tmp_path):
    from deltasync.client.filetarget import FileTarget, KeyframeWriter
    from deltasync.errors import IntegrityError
    from deltasync.keyframe import encode_keyframe

    state = _state()
    enc = encode_keyframe(state, model="m", version=0)
    layout = {t.name: (t.dtype, tuple(t.shape)) for t in enc.manifest.tensors}
    target = FileTarget(tmp_path / "f.safetensors", "m", layout=layout, open_existing=False)
    w = KeyframeWriter(target, enc.manifest)
    (ref,) = enc.manifest.blobs
    data = bytearray(enc.blobs[ref.id])
    data[-3] ^= 0x40  # a flipped bit in the last tensor's bytes
    with pytest.raises(IntegrityError, match="fingerprint"):
        w.add_shard(bytes(data))
    w.abort()
    assert not (tmp_path / "f.safetensors").exists()
