"""Serving formats (deltasync.quant): bit for bit against the references, the ignore rules, the deriver.

The reference comparison runs the references' own code (vLLM's ``per_block_cast_to_fp8``, compressed-tensors'
qparams, ``quantize`` and ``pack_to_int32``) in the engine venv (``tests/quant_reference.py`` as a subprocess of
``.venv-vllm/bin/python``). Those two tests are marked ``engine`` (``make test-engines`` runs them, after the venv
is built); elsewhere they are skipped unless that venv is complete: its stamp exists and is newer than
pyproject.toml. A bare ``.venv-vllm/bin/python`` is not enough: .ci/run builds the venv in the background while
``make test`` runs, and a half-built venv still has the torchvision wheel that breaks compressed-tensors' import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltasync import quant
from deltasync.errors import UnsupportedError
from deltasync.testing.trace import ModelShape, RLTrace

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_STAMP = ROOT / ".venv-vllm" / ".installed"  # the Makefile touches it when the venv is complete


def _engine_venv_complete() -> bool:
    try:
        return VLLM_STAMP.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime and VLLM_PY.exists()
    except FileNotFoundError:
        return False


def _bits(t: torch.Tensor) -> torch.Tensor:
    return quant._words(t)


SHAPE = ModelShape(vocab=96, hidden=256, layers=2, ffn=640)


def _trace_tensors() -> dict[str, torch.Tensor]:
    """Real AdamW-trained bf16 weights (deltasync.testing.trace) plus edge cases: a shape that is not a whole
    number of blocks, an all-zero group, outliers, tiny values."""
    tr = RLTrace(SHAPE, lr=3e-5, seed=3)
    tr.step()
    state = tr.step()
    # every 2-D tensor of the state: division instead of vLLM's multiply by the reciprocal changes ~1 fp8 word
    # in 2,500, so the comparison needs about a million words to tell them apart
    out = {n: t for n, t in state.items() if t.dim() == 2}
    out["up_proj_cut"] = state["model.layers.0.mlp.up_proj.weight"][:200, :224].contiguous()
    odd = (torch.randn(130, 96, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16)
    odd[3, 32:64] = 0  # an all-zero int4 group: its scale is bf16's eps
    odd[7, 5] = 40.0  # an outlier that decides its block's scale
    odd[100:, :] *= 1e-6  # blocks whose amax is below the 1e-4 floor
    out["odd"] = odd
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if not _engine_venv_complete():
        pytest.skip("the engine venv (.venv-vllm: vLLM, compressed-tensors) is not built or is being rebuilt "
                    "(make venv-vllm)")
    d = tmp_path_factory.mktemp("quantref")
    tensors = _trace_tensors()
    save_file(tensors, str(d / "in.safetensors"))
    subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "quant_reference.py"), str(d / "in.safetensors"),
                    str(d / "out.safetensors")], check=True, timeout=300, cwd=ROOT)
    return tensors, load_file(str(d / "out.safetensors"))


@pytest.mark.engine
def test_fp8_block_equals_vllm_reference(reference):
    tensors, ref = reference
    for name, w in tensors.items():
        q, s = quant.fp8_block_quantize(w)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert torch.equal(_bits(q), _bits(ref[name + ".fp8"])), name
        assert torch.equal(_bits(s), _bits(ref[name + ".fp8_scale_inv"])), name
        if name + ".fp8_eager" in ref:
            assert torch.equal(_bits(q), _bits(ref[name + ".fp8_eager"])), name


@pytest.mark.engine
def test_int4_equals_compressed_tensors(reference):
    tensors, ref = reference
    for name, w in tensors.items():
        packed, scale, shape = quant.int4_pack_quantize(w)
        assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16 and shape.dtype == torch.int64
        assert torch.equal(packed, ref[name + ".int4_packed"]), name
        assert torch.equal(_bits(scale), _bits(ref[name + ".int4_scale"])), name
        assert torch.equal(shape, ref[name + ".int4_shape"]), name


def test_int4_pack_roundtrip_and_layout():
    q = torch.tensor([[-8, -1, 0, 1, 2, 3, 4, 7, 5, -3, 0, 0, 0, 0, 0, 0]], dtype=torch.int8)
    packed = quant.pack_int4(q)
    assert packed.shape == (1, 2)
    # value i of a word sits at bits 4i, stored as q + 8: the first word's low nibble is -8 + 8 = 0
    assert int(packed[0, 0]) & 0xF == 0 and (int(packed[0, 0]) >> 28) & 0xF == 15
    assert torch.equal(quant.unpack_int4(packed, 16), q)


def test_fp8_dequantize_is_close():
    w = _trace_tensors()["odd"]
    q, s = quant.fp8_block_quantize(w)
    back = quant.fp8_block_dequantize(q, s)
    assert s.shape == (2, 1)
    assert torch.allclose(back, w.float(), rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("name,shape,fp8,int4", [
    ("model.layers.0.self_attn.q_proj.weight", (256, 256), True, True),
    ("model.layers.0.mlp.gate_proj.weight", (512, 256), True, True),
    ("model.layers.0.mlp.gate.weight", (8, 256), False, False),  # a MoE router
    ("model.layers.0.mlp.shared_expert_gate.weight", (1, 256), False, False),
    ("model.layers.0.mlp.experts.3.down_proj.weight", (256, 64), True, True),
    ("model.embed_tokens.weight", (200, 256), False, False),
    ("lm_head.weight", (200, 256), False, False),
    ("model.norm.weight", (256,), False, False),
    ("model.layers.0.self_attn.q_proj.bias", (256,), False, False),
])
def test_which_tensors_are_quantized(name, shape, fp8, int4):
    assert quant.ServingFormat(name="fp8-block").quantizes(name, shape) is fp8
    assert quant.ServingFormat(name="int4").quantizes(name, shape) is int4


def test_ignore_list_from_config():
    fmt = quant.ServingFormat(name="int4", ignore=("re:.*self_attn.*", "down_proj"))
    assert not fmt.quantizes("model.layers.1.self_attn.o_proj.weight", (8, 32))
    assert not fmt.quantizes("model.layers.1.mlp.down_proj.weight", (8, 32))
    assert fmt.quantizes("model.layers.1.mlp.up_proj.weight", (8, 32))
    assert fmt.quantizes("lm_head.weight", (8, 32))  # not in this config's ignore list
    cfg = fmt.quantization_config()
    assert cfg["ignore"] == ["re:.*self_attn.*", "down_proj"] and cfg["format"] == "pack-quantized"
    with pytest.raises(UnsupportedError, match="serving format"):
        quant.ServingFormat(name="nf4")
    with pytest.raises(UnsupportedError, match="multiple of 8"):
        quant.ServingFormat(name="int4", group=12)


def test_serving_state_names():
    state = {"model.embed_tokens.weight": torch.zeros(10, 64, dtype=torch.bfloat16),
             "model.layers.0.mlp.up_proj.weight": torch.ones(128, 64, dtype=torch.bfloat16),
             "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    fp8 = quant.serving_state(state, quant.ServingFormat(name="fp8-block"))
    assert sorted(fp8) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                           "model.layers.0.mlp.up_proj.weight_scale_inv", "model.norm.weight"]
    assert fp8["model.embed_tokens.weight"] is state["model.embed_tokens.weight"]
    int4 = quant.serving_state(state, quant.ServingFormat(name="int4"))
    assert int4["model.layers.0.mlp.up_proj.weight_packed"].shape == (128, 8)
    assert int4["model.layers.0.mlp.up_proj.weight_scale"].shape == (128, 2)
    assert int4["model.layers.0.mlp.up_proj.weight_shape"].tolist() == [128, 64]


@pytest.mark.parametrize("fmt", ["fp8-block", "int4"])
def test_deriver_requantizes_only_changed_tensors(fmt):
    f = quant.ServingFormat(name=fmt)
    tr = RLTrace(SHAPE, lr=3e-5, seed=5)
    name = "model.layers.0.mlp.up_proj.weight"
    state = {"a.weight": tr.step()[name], "b.weight": torch.randn(64, 256).to(torch.bfloat16),
             "n.weight": torch.ones(128, dtype=torch.bfloat16)}
    d = quant.ServingDeriver(f)
    out = d.derive(state)
    assert d.requantized == 2
    held = {k: v for k, v in out.items()}
    state["a.weight"] = tr.step()[name]
    out2 = d.derive(state)
    assert d.requantized == 1
    want = quant.serving_state(state, f)
    assert sorted(out2) == sorted(want)
    for k in want:
        assert torch.equal(_bits(out2[k]), _bits(want[k])), k
        assert out2[k] is held[k] or k == "a.weight"  # quantized tensors are updated in place
    assert d.derive(state) is not None and d.requantized == 0
