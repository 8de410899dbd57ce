"""A ``subscribe --out`` file's torch views are made as they are asked for (issue 22): a step patched by address
asks for few; opening a 70k-tensor file made them all (~0.5 s), and its scan read every tensor through them."""

from __future__ import annotations

import pytest
import torch

from deltasync.apply import prepare_delta
from deltasync.codec import EncodeOptions, encode_delta
from deltasync.fingerprint import tensor_fingerprint
from deltasync.client.filetarget import FileTarget
from deltasync.tensorfile import TensorViews

pytest.importorskip("numba")


def _state(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i:04d}.w": torch.randn(8 + i % 9, generator=g).bfloat16() for i in range(n)}


def test_a_step_on_a_reopened_file_makes_few_views_and_lands_bit_for_bit(tmp_path):
    old = _state(1500, 1)
    new = {n: t.clone() for n, t in old.items()}
    for i, t in enumerate(new.values()):
        if i % 3 == 0:
            t.view(torch.int16)[i % t.numel()] += 1
    new["layers.0007.w"].view(torch.int16)[:] ^= 0x55  # every word: a dense chunk, patched by view
    path = tmp_path / "f.safetensors"
    first = FileTarget(path, "m", layout={n: ("bfloat16", tuple(t.shape)) for n, t in old.items()},
                       open_existing=False)
    first.stage_keyframe(old, {n: tensor_fingerprint(t) for n, t in old.items()}, version=1).commit()
    first.close()
    f = FileTarget(path, "m")  # reopened: layout from the header, fingerprints from one scan of its data
    fps = f.scan()
    assert fps == {n: tensor_fingerprint(t) for n, t in old.items()}
    assert f.file._tensors is None  # no view made yet
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=EncodeOptions())
    staged = f.stage_delta(prepare_delta(enc.manifest, enc.blobs), fps, verify="incremental")
    staged.commit()
    views = f.file.views
    assert isinstance(views, TensorViews) and len(views._made) <= 1, len(views._made)
    assert staged.fps == {n: tensor_fingerprint(t) for n, t in new.items()}
    got = f.file.tensors
    for n, t in new.items():
        assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), n
    f.close()
