"""Serving-format layout maps (deltasync.quantlayout): a bf16 rank map carried over to FP8 block scales and
INT4 packed words, checked against the shapes vLLM 0.32.0 gives a Llama's quantized parameters, and the cases
that must fail closed. A state pushed through the map lands where the engine's loader puts it."""

from __future__ import annotations

import pytest
import torch

from deltasync import quant
from deltasync.errors import UnsupportedError
from deltasync.layout import ModelFacts, Parallel, Region, RankLayout, vllm_layout
from deltasync.quantlayout import CONST_PREFIX, constant_values, serving_layout

# the tiny Llama of the engine test: hidden 256, 4 heads of 64 over 2 KV heads, intermediate 512, vocab 200
FACTS = ModelFacts(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=200)
# at TP=2 FP8 blocks need 128 rows of each of q, k, v per rank (vLLM's validate_fp8_block_shape refuses less)
FACTS_TP2 = ModelFacts(layers=1, hidden=512, heads=4, kv_heads=2, head_dim=128, intermediate=512, vocab=200)


def _layout(fmt: str, tp: int = 1, rank: int = 0, facts: ModelFacts = FACTS) -> RankLayout:
    return serving_layout(vllm_layout(facts, Parallel(tp_rank=rank, tp_size=tp)), quant.ServingFormat(name=fmt))


def test_fp8_block_params_are_the_engines():
    lay = _layout("fp8-block")
    # what vLLM 0.32.0 (CPU, TP=1) holds for this model, read from a loaded engine's named_parameters()
    want = {
        "model.layers.0.self_attn.qkv_proj.weight": ("float8_e4m3fn", (512, 256)),
        "model.layers.0.self_attn.qkv_proj.weight_scale_inv": ("float32", (4, 2)),
        "model.layers.0.self_attn.o_proj.weight_scale_inv": ("float32", (2, 2)),
        "model.layers.0.mlp.gate_up_proj.weight_scale_inv": ("float32", (8, 2)),
        "model.layers.0.mlp.down_proj.weight": ("float8_e4m3fn", (256, 512)),
        "model.layers.0.mlp.down_proj.weight_scale_inv": ("float32", (2, 4)),
        "model.embed_tokens.weight": ("bfloat16", (256, 256)),
        "lm_head.weight": ("bfloat16", (256, 256)),
        "model.norm.weight": ("bfloat16", (256,)),
    }
    for name, v in want.items():
        assert lay.params[name] == v, name
    assert lay.stream["model.layers.0.self_attn.k_proj.weight_scale_inv"] == ("float32", (1, 2))
    k = [r for r in lay.regions if r.source == "model.layers.0.self_attn.k_proj.weight_scale_inv"]
    assert [(r.src, r.dst) for r in k] == [(((0, 1), (0, 2)), ((2, 1), (0, 2)))]  # block row 2: after q's two


def test_int4_params_and_constants():
    lay = _layout("int4")
    assert lay.params["model.layers.0.self_attn.qkv_proj.weight_packed"] == ("int32", (512, 32))
    assert lay.params["model.layers.0.self_attn.qkv_proj.weight_scale"] == ("bfloat16", (512, 8))
    assert lay.params["model.layers.0.mlp.down_proj.weight_packed"] == ("int32", (256, 64))
    assert lay.stream["model.layers.0.mlp.up_proj.weight_shape"] == ("int64", (2,))
    consts = constant_values(lay)
    assert consts[CONST_PREFIX + "model.layers.0.mlp.down_proj.weight_shape"] == (256, 512)
    assert consts[CONST_PREFIX + "model.layers.1.self_attn.k_proj.weight_shape"] == (128, 256)
    assert not any(p.endswith(".weight_shape") and not p.startswith(CONST_PREFIX) for p in lay.params)


@pytest.mark.parametrize("fmt", ["fp8-block", "int4"])
def test_tp2_shards_scale_with_the_weight(fmt):
    r1 = _layout(fmt, tp=2, rank=1, facts=FACTS_TP2)
    name = "model.layers.0.self_attn.o_proj.weight" + ("_scale_inv" if fmt == "fp8-block" else "_scale")
    (reg,) = [r for r in r1.regions if r.param == name]
    # o_proj is row-parallel: rank 1 holds input columns [256, 512) of 512
    cols = (2, 2) if fmt == "fp8-block" else (8, 8)
    assert reg.src[1] == cols and reg.dst[1] == (0, cols[1])


def test_a_state_through_the_map_is_the_loaders_placement():
    """Every rank's parameters, filled from the quantized checkpoint through the map, hold each checkpoint
    tensor's rows/columns where vLLM's weight_loader puts them (fused offsets, TP shards, scale blocks)."""
    torch.manual_seed(0)
    bf16 = vllm_layout(FACTS_TP2, Parallel())
    state = {n: torch.randn(shape).to(torch.bfloat16) * 0.02 for n, (_, shape) in bf16.stream.items()}
    for fmt in ("fp8-block", "int4"):
        sv = quant.serving_state(state, quant.ServingFormat(name=fmt))
        for rank in (0, 1):
            lay = _layout(fmt, tp=2, rank=rank, facts=FACTS_TP2)
            assert set(lay.stream) == set(sv)
            params = {n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, (dt, shape) in lay.params.items()}
            for r in lay.regions:
                src = sv[r.source]
                dst = params[r.param]
                for i in r.dst_index:
                    dst = dst[i]
                for d, ((s, n), (t, _)) in enumerate(zip(r.src, r.dst)):
                    src, dst = src.narrow(d, s, n), dst.narrow(d, t, n)
                dst.copy_(src)
            if fmt == "fp8-block":
                qkv = params["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
                k_scale = sv["model.layers.0.self_attn.k_proj.weight_scale_inv"]
                assert torch.equal(qkv[2], k_scale[rank])  # q: 2 block rows per rank, then this rank's k head
                down = params["model.layers.0.mlp.down_proj.weight_scale_inv"]
                assert torch.equal(down, sv["model.layers.0.mlp.down_proj.weight_scale_inv"][:, 2 * rank:2 * rank + 2])
            else:
                packed = params["model.layers.0.mlp.gate_up_proj.weight_packed"]
                up = sv["model.layers.0.mlp.up_proj.weight_packed"]
                assert torch.equal(packed[256:], up[256 * rank:256 * (rank + 1)])


def test_cut_blocks_fail_closed():
    # a 64-row KV head per rank (FACTS at TP=2) cuts a 128-row block, as vLLM's own check says
    with pytest.raises(UnsupportedError, match="block"):
        _layout("fp8-block", tp=2, rank=0)
    # 3 heads of 64 at TP=1 put k at row 192: not a 128-row block boundary
    facts = ModelFacts(layers=1, hidden=192, heads=3, kv_heads=1, head_dim=64, intermediate=256, vocab=64)
    with pytest.raises(UnsupportedError, match="block"):
        serving_layout(vllm_layout(facts, Parallel()), quant.ServingFormat(name="fp8-block"))
    # int4 is fine there: offsets are whole rows
    serving_layout(vllm_layout(facts, Parallel()), quant.ServingFormat(name="int4"))
    mixed = RankLayout(stream={"a.weight": ("bfloat16", (4, 64)), "lm_head.weight": ("bfloat16", (4, 64))},
                       params={"p.weight": ("bfloat16", (8, 64))},
                       regions=(Region(source="a.weight", param="p.weight", src=((0, 4), (0, 64)), dst=((0, 4), (0, 64))),
                                Region(source="lm_head.weight", param="p.weight", src=((0, 4), (0, 64)),
                                       dst=((4, 4), (0, 64)))))
    with pytest.raises(UnsupportedError, match="quantized and unquantized"):
        serving_layout(mixed, quant.ServingFormat(name="int4"))


def test_fp8_moe_experts_map_to_fused_moe_scales():
    """Routed experts per expert (``experts.{e}.gate_proj.weight``): the map carries them to vLLM's Fp8MoEMethod
    names and shapes (``w13_weight`` [E, 2I, H] fp8, ``w13_weight_scale_inv`` [E, 2I/128, H/128]); the router
    stays bf16. (Pure map; every rank's placement: tests/core/test_quant_layout_moe.py; on vLLM:
    tests/engines/test_vllm_quant_moe.py.)"""
    from deltasync.layout import MoEFacts

    facts = ModelFacts(layers=1, hidden=256, heads=2, kv_heads=2, head_dim=128, intermediate=256, vocab=64,
                       moe=MoEFacts(style="qwen3_moe", experts=4, intermediate=128))
    lay = serving_layout(vllm_layout(facts, Parallel()), quant.ServingFormat(name="fp8-block"))
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert lay.params[w13] == ("float8_e4m3fn", (4, 256, 256))
    assert lay.params[w13 + "_scale_inv"] == ("float32", (4, 2, 2))
    assert lay.params["model.layers.0.mlp.experts.routed_experts.w2_weight_scale_inv"] == ("float32", (4, 2, 1))
    assert lay.params["model.layers.0.mlp.gate.weight"] == ("bfloat16", (4, 256))
    up3 = [r for r in lay.regions if r.source == "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"]
    assert [(r.dst_index, r.src, r.dst) for r in up3] == [((3,), ((0, 1), (0, 2)), ((1, 1), (0, 2)))]
