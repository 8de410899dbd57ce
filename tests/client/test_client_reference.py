"""The publisher's split diff (on the trainer's thread) + encode (later) equals encode_delta, byte for byte."""

from __future__ import annotations

import pytest
import torch

from deltasync.apply import apply_delta
from deltasync.codec import EncodeOptions, encode_delta
from deltasync.client.reference import Reference, encode_diff
from deltasync.fingerprint import tensor_fingerprint
from deltasync.testing.trace import ModelShape, RLTrace


def _mixed_states():
    g = torch.Generator().manual_seed(0)
    a = {
        "w.bf16": torch.randn(257, 33, generator=g).bfloat16(),
        "w.f32": torch.randn(1000, generator=g),
        "w.f16": torch.randn(64, 3, generator=g).half(),
        "i64": torch.arange(50),
        "u8": torch.randint(0, 255, (300,), generator=g, dtype=torch.uint8),
        "flag": torch.zeros(9, dtype=torch.bool),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "fp8": torch.randn(128, generator=g).to(torch.float8_e4m3fn),
    }
    b = {n: t.clone() for n, t in a.items()}
    b["w.bf16"] += (0.01 * torch.randn(257, 33, generator=g)).bfloat16()
    b["w.f32"][::7] = -0.0
    b["w.f16"][5] = float("nan")
    b["i64"][-1] = -(2 ** 62)
    b["u8"][:] = 255 - b["u8"]  # every word changes: a dense chunk
    b["flag"][3] = True
    b["scalar"].fill_(float("inf"))
    b["fp8"][::3] = torch.tensor(1.0).to(torch.float8_e4m3fn)
    return a, b


@pytest.mark.parametrize("chunk_words", [7, 100, 4 << 20])
def test_split_diff_encodes_the_same_bytes_as_encode_delta(chunk_words):
    a, b = _mixed_states()
    opt = EncodeOptions(chunk_words=chunk_words, blob_target=4096)
    ref = Reference(a)
    diff = ref.diff_and_update(b, chunk_words=chunk_words)
    ours = encode_diff(diff, model="m", version=5, parent=4, options=opt, meta={"k": "v"})
    theirs = encode_delta(a, b, model="m", version=5, parent=4, options=opt, meta={"k": "v"})
    assert ours.manifest.to_json() == theirs.manifest.to_json()
    assert ours.blobs == theirs.blobs
    assert ours.fps == theirs.fps


def test_reference_is_patched_in_place_and_tracks_fingerprints():
    trace = RLTrace(ModelShape(vocab=256, hidden=32, layers=1, ffn=64), lr=1e-5, seed=0)
    s0 = trace.step()
    ref = Reference(s0)
    ptrs = {n: t.data_ptr() for n, t in ref.tensors.items()}
    base = {n: t.clone() for n, t in s0.items()}
    for _ in range(3):
        s = trace.step()
        diff = ref.diff_and_update(s, chunk_words=1000)
        enc = encode_diff(diff, model="m", version=1, parent=0)
        apply_delta(base, enc.manifest, enc.blobs)  # the delta takes the old state to the new
        base = {n: t.clone() for n, t in s.items()}
        assert {n: t.data_ptr() for n, t in ref.tensors.items()} == ptrs  # no reallocation
        for n, t in ref.tensors.items():
            assert torch.equal(t.view(torch.int16), s[n].view(torch.int16))
            assert ref.fps[n] == tensor_fingerprint(s[n])
    assert 0 < diff.changed < sum(t.numel() for t in s.values())
    assert diff.host_bytes < sum(t.numel() * t.element_size() for t in s.values())


def test_layout_change_is_refused_and_reset_reallocates():
    a, b = _mixed_states()
    ref = Reference(a)
    b2 = dict(b)
    b2["new"] = torch.zeros(3)
    assert not ref.same_layout(b2)
    with pytest.raises(ValueError, match="layout changed"):
        ref.diff_and_update(b2, chunk_words=100)
    ref.reset(b2)
    assert ref.same_layout(b2) and set(ref.tensors) == set(b2)
    ref.reset(b2)  # same layout: copies into the existing memory
    assert ref.fps["new"] == tensor_fingerprint(torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_diff_happens_on_the_device_and_matches_the_cpu_encoding():
    a, b = _mixed_states()
    a = {n: t.cuda() for n, t in a.items() if n != "fp8"}
    b = {n: t.cuda() for n, t in b.items() if n != "fp8"}
    ref = Reference(a)
    assert all(t.is_cuda for t in ref.tensors.values())
    diff = ref.diff_and_update(b, chunk_words=100)
    ours = encode_diff(diff, model="m", version=1, parent=0)
    cpu = encode_delta({n: t.cpu() for n, t in a.items()}, {n: t.cpu() for n, t in b.items()}, model="m", version=1,
                       parent=0, options=EncodeOptions(chunk_words=100))
    assert ours.manifest.to_json() == cpu.manifest.to_json() and ours.blobs == cpu.blobs
    live = {n: t.clone() for n, t in a.items()}
    apply_delta(live, ours.manifest, ours.blobs)  # patched on the GPU, verified there
    assert all(torch.equal(live[n].cpu().view(-1).view(torch.uint8), b[n].cpu().view(-1).view(torch.uint8)) for n in b)
