"""``stage_prepared(check=)``: a caller's check (a signal, a deadline) is called between pieces of an apply and
what it raises rolls every written word back (issue 27: an apply obeys SIGTERM and --timeout)."""

from __future__ import annotations

import pytest
import torch

import deltasync.apply as apply_mod
from deltasync.apply import prepare_delta, stage_prepared
from deltasync.codec import encode_delta
from deltasync.errors import ApplyError, ApplyInterrupted
from deltasync.fingerprint import tensor_fingerprint


def _states(n: int):
    g = torch.Generator().manual_seed(3)
    a = {f"t{i:05d}": torch.randn(16, generator=g).to(torch.bfloat16) for i in range(n)}
    a["big"] = torch.randn(4096, generator=g)  # a second word size: the batched patch's groups
    b = {k: (v.float() * 1.01 + 0.01).to(v.dtype) for k, v in a.items()}
    return a, b


@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.parametrize("stop_at", [1, 2, 5, 40, "last"])
def test_an_interrupted_apply_is_rolled_back(kernels, stop_at):
    """With the compiled kernels the delta is prepared as columns (apply.ColumnarPatches) and patched by a few
    compiled calls: the check comes before the patch and between its word sizes (no Python loop per tensor is
    left to interrupt); chunk by chunk (the reference kernels), every CHECK_EVERY tensors."""
    from deltasync import kernels as k

    before = k.active()
    k.select(kernels)
    try:
        a, b = _states(2000)
        enc = encode_delta(a, b, model="m", version=1, parent=0)
        # without an interruption the apply lands, and checks came between its pieces
        live = {n: t.clone() for n, t in a.items()}
        fps = {n: tensor_fingerprint(t) for n, t in live.items()}
        counted = []
        prepared = prepare_delta(enc.manifest, enc.blobs)
        columns = type(prepared.patches) is apply_mod.ColumnarPatches
        assert columns == (kernels == "numba")
        stage_prepared(live, prepared, fps).rollback()  # (the tied-weights search is remembered for these tensors)
        stage_prepared(live, prepared, fps, check=lambda: counted.append(1)).rollback()
        assert len(counted) >= (3 if columns else 2000 // apply_mod.CHECK_EVERY)  # columns: before, 2 word sizes
        stop_at = len(counted) if stop_at == "last" else stop_at
        if stop_at > len(counted):
            pytest.skip(f"this apply calls its check {len(counted)} times")
        calls = 0

        def check() -> None:
            nonlocal calls
            calls += 1
            if calls == stop_at:
                raise ApplyInterrupted("SIGTERM received")

        with pytest.raises(ApplyInterrupted) as e:
            stage_prepared(live, prepare_delta(enc.manifest, enc.blobs), fps, check=check)
        assert isinstance(e.value, ApplyError)  # rolled back, as any failed apply
        assert all(torch.equal(live[n].view(torch.int16 if live[n].dtype == torch.bfloat16 else torch.int32),
                               a[n].view(torch.int16 if a[n].dtype == torch.bfloat16 else torch.int32)) for n in a)
        stage_prepared(live, prepare_delta(enc.manifest, enc.blobs), fps).commit()
        assert all(torch.equal(live[n], b[n]) for n in b)
    finally:
        k.select(before)
