"""Decoding and applying on a caller's thread pool: same bytes, same all-or-nothing rollback."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deltasync.apply import apply_delta, apply_prepared, prepare_delta
from deltasync.codec import EncodeOptions, decode_blob, encode_delta
from deltasync.errors import IntegrityError
from deltasync.testing.trace import ModelShape, RLTrace

from core_support import tensor_bytes


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(max_workers=2) as ex:
        yield ex


def _pair():
    tr = RLTrace(ModelShape(vocab=512, hidden=64, layers=3, ffn=192), lr=2e-4, seed=5)
    a = tr.step()
    a["counter"] = torch.arange(1000, dtype=torch.int32)
    b = tr.step()
    b["counter"] = a["counter"] + 3
    return a, b


def test_parallel_decode_equals_sequential(pool):
    a, b = _pair()
    enc = encode_delta(a, b, model="m", version=2, parent=1, options=EncodeOptions(chunk_words=4096, blob_target=1 << 16))
    assert len(enc.blobs) > 1
    for data in enc.blobs.values():
        seq, par = decode_blob(data), decode_blob(data, executor=pool)
        assert [(p.tensor, p.start, p.stop) for p in seq] == [(p.tensor, p.start, p.stop) for p in par]
        for x, y in zip(seq, par):
            cx, cy = x.as_changes(), y.as_changes()
            assert (cx.positions == cy.positions).all() and (cx.values == cy.values).all() and (cx.raw == cy.raw).all()


def test_parallel_apply_is_bit_exact(pool):
    a, b = _pair()
    enc = encode_delta(a, b, model="m", version=2, parent=1, options=EncodeOptions(chunk_words=4096))
    live = {k: v.clone() for k, v in a.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    fps = apply_delta(live, enc.manifest, enc.blobs, executor=pool)
    assert fps == enc.fps
    assert all(tensor_bytes(live[k]) == tensor_bytes(b[k]) for k in b)
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs


def test_parallel_apply_rolls_everything_back(pool):
    a, b = _pair()
    enc = encode_delta(a, b, model="m", version=2, parent=1, options=EncodeOptions(chunk_words=4096))
    changed = [t.name for t in enc.manifest.tensors if t.changed]
    victim = changed[len(changed) // 2]
    bad = dataclasses.replace(enc.manifest, tensors=tuple(
        dataclasses.replace(t, fp_after="0" * 16) if t.name == victim else t for t in enc.manifest.tensors))
    live = {k: v.clone() for k, v in a.items()}
    with pytest.raises(IntegrityError, match=victim):
        apply_prepared(live, prepare_delta(bad, enc.blobs, executor=pool), executor=pool)
    assert all(tensor_bytes(live[k]) == tensor_bytes(a[k]) for k in a)  # every tensor, not just the victim
