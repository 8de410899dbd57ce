"""GPU parity: fingerprints, encode and apply on a CUDA device agree bit for bit with the CPU.

Skipped where no CUDA device exists (CI and the development machines); run them on a GPU
machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

from deltasync.apply import apply_delta
from deltasync.codec import EncodeOptions, encode_delta
from deltasync.fingerprint import fingerprint_state, tensor_fingerprint
from deltasync.testing.trace import ModelShape, RLTrace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _states():
    tr = RLTrace(ModelShape(vocab=1024, hidden=128, layers=2, ffn=384), lr=3e-5, seed=11)
    return tr.step(), tr.step()


def test_fingerprint_same_on_cpu_and_gpu():
    a, _ = _states()
    for name, t in a.items():
        assert tensor_fingerprint(t) == tensor_fingerprint(t.cuda()), name
    x = torch.randint(-2**62, 2**62, (300_007,), dtype=torch.int64)
    assert tensor_fingerprint(x) == tensor_fingerprint(x.cuda())


def test_encode_on_gpu_equals_cpu_and_applies_on_gpu():
    a, b = _states()
    opts = EncodeOptions(chunk_words=1 << 16)
    cpu = encode_delta(a, b, model="m", version=2, parent=1, options=opts)
    gpu = encode_delta({k: v.cuda() for k, v in a.items()}, {k: v.cuda() for k, v in b.items()},
                       model="m", version=2, parent=1, options=opts)
    assert cpu.manifest.to_json() == gpu.manifest.to_json()
    assert cpu.blobs == gpu.blobs
    live = {k: v.cuda() for k, v in a.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    fps = apply_delta(live, gpu.manifest, gpu.blobs, fingerprint_state(live))
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs
    for k in b:
        assert torch.equal(live[k].cpu().view(torch.int16), b[k].view(torch.int16)), k
        assert fps[k] == tensor_fingerprint(b[k])
