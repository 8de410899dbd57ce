"""States of the same bytes in many or few tensors (issue 22's tensor-count row).

``kimi_layout`` follows Kimi-K2's Hugging Face naming (per-expert gate/up/down projections, MLA attention,
norms, routers, shared experts) with narrow dims; ``fp8_layout`` adds a ``weight_scale_inv`` per 2-D weight
(DeepSeek-V3-FP8 style); ``few_layout`` holds the same element count in 8 tensors.
"""

from __future__ import annotations

import numpy as np
import torch


def kimi_layout(*, layers: int = 61, dense_layers: int = 1, experts: int = 384, hidden: int = 64,
                inter: int = 32, vocab: int = 2048) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                                       "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (hidden,)
        out[p + "post_attention_layernorm.weight"] = (hidden,)
        out[p + "self_attn.q_a_proj.weight"] = (hidden // 2, hidden)
        out[p + "self_attn.q_a_layernorm.weight"] = (hidden // 2,)
        out[p + "self_attn.q_b_proj.weight"] = (hidden, hidden // 2)
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = (hidden // 2, hidden)
        out[p + "self_attn.kv_a_layernorm.weight"] = (hidden // 4,)
        out[p + "self_attn.kv_b_proj.weight"] = (hidden, hidden // 4)
        out[p + "self_attn.o_proj.weight"] = (hidden, hidden)
        if i < dense_layers:
            for m, s in (("gate_proj", (inter * 4, hidden)), ("up_proj", (inter * 4, hidden)),
                         ("down_proj", (hidden, inter * 4))):
                out[p + f"mlp.{m}.weight"] = s
            continue
        out[p + "mlp.gate.weight"] = (experts, hidden)
        out[p + "mlp.gate.e_score_correction_bias"] = (experts,)
        for m, s in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            out[p + f"mlp.shared_experts.{m}.weight"] = s
        for e in range(experts):
            for m, s in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                out[p + f"mlp.experts.{e}.{m}.weight"] = s
    return out


def fp8_layout(base: dict[str, tuple[int, ...]], block: int = 128) -> dict[str, tuple[int, ...]]:
    """Every 2-D projection gets a ``weight_scale_inv`` of ceil(rows/128) x ceil(cols/128) (fp32)."""
    out = dict(base)
    for name, shape in base.items():
        if len(shape) == 2 and name.endswith("proj.weight"):
            out[name[:-len("weight")] + "weight_scale_inv"] = tuple(-(-d // block) for d in shape)
    return out


def few_layout(elements: int, n: int = 8) -> dict[str, tuple[int, ...]]:
    per = elements // n
    sizes = [per] * (n - 1) + [elements - per * (n - 1)]
    return {f"layer.{i}.weight": (s,) for i, s in enumerate(sizes)}


def elements_of(layout: dict[str, tuple[int, ...]]) -> int:
    return sum(int(np.prod(s)) if s else 1 for s in layout.values())


def make_state(layout: dict[str, tuple[int, ...]], *, seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """One flat random buffer cut into the layout's tensors (scales as float32 of the same words' count)."""
    g = torch.Generator().manual_seed(seed)
    total = elements_of(layout)
    flat = (torch.randn(total, generator=g) * 0.02).to(dtype)
    out, at = {}, 0
    for name, shape in layout.items():
        n = int(np.prod(shape)) if shape else 1
        out[name] = flat[at:at + n].view(shape)
        at += n
    return out


def step_state(state: dict[str, torch.Tensor], *, changed: float = 0.01, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy with ~``changed`` of every tensor's words moved by one ULP (an AdamW-like step), one flat pass."""
    names = list(state)
    flat = torch.cat([state[n].reshape(-1) for n in names])
    words = flat.view(torch.int16)
    g = torch.Generator().manual_seed(seed)
    sel = torch.rand(words.numel(), generator=g) < changed
    step = torch.where(torch.rand(words.numel(), generator=g) < 0.5, 1, -1).to(torch.int16)
    words[sel] += step[sel]
    out, at = {}, 0
    for n in names:
        k = state[n].numel()
        out[n] = flat[at:at + k].view(state[n].shape)
        at += k
    return out
