"""Realistic consecutive RL weight states, generated: the test, bench and demo workload.

A transformer-shaped set of fp32 *master* weights is updated by Adam steps with
random gradients at a chosen learning rate; each step's served state is the bf16
cast of the master weights, as an RL trainer would publish it. Small updates are
lost in bf16 rounding (an update moves the bf16 value only when it crosses a
rounding boundary, more often for small |w| whose ULP is small), which gives the
sparsity real traces show: ~99% of bf16 elements unchanged at lr ~1e-6, and
mostly ±1 ULP changes.

Deterministic for a given seed; single precision arithmetic, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    ffn: int

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in transformer_shapes(self).values())


def shape_for_params(target: int) -> ModelShape:
    """A plausible decoder shape of about ``target`` parameters."""
    best = None
    for hidden in (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096):
        vocab = 32000 if target >= 20_000_000 else 4096
        ffn = hidden * 8 // 3 // 64 * 64 or 64
        per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
        rest = target - 2 * vocab * hidden - hidden
        layers = max(1, round(rest / per_layer)) if rest > 0 else 1
        shape = ModelShape(vocab=vocab, hidden=hidden, layers=min(layers, 48), ffn=ffn)
        err = abs(shape.params - target) / target + (0.5 if layers > 48 or layers < 2 else 0)
        if best is None or err < best[0]:
            best = (err, shape)
    return best[1]


def transformer_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    h, f = shape.hidden, shape.ffn
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (h, h)
        out[p + "self_attn.k_proj.weight"] = (h, h)
        out[p + "self_attn.v_proj.weight"] = (h, h)
        out[p + "self_attn.o_proj.weight"] = (h, h)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (f, h)
        out[p + "mlp.up_proj.weight"] = (f, h)
        out[p + "mlp.down_proj.weight"] = (h, f)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (shape.vocab, h)
    return out


class RLTrace:
    """fp32 master weights + Adam state; ``step()`` returns the next bf16 state dict.

    The returned tensors are fresh each step (the caller may keep them); ``state()``
    returns the current bf16 state without stepping.
    """

    def __init__(self, shape: ModelShape, *, lr: float, seed: int = 0, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, grad_persistence: float = 0.5) -> None:
        self.shape = shape
        self.lr = lr
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.persist = grad_persistence
        self.gen = torch.Generator().manual_seed(seed)
        self.master: dict[str, torch.Tensor] = {}
        for name, shp in transformer_shapes(shape).items():
            if name.endswith("norm.weight"):
                w = 1.0 + 0.05 * torch.randn(shp, generator=self.gen)
            else:
                w = torch.randn(shp, generator=self.gen) * (1.0 / math.sqrt(shp[-1]))
            self.master[name] = w
        self.m = {n: torch.zeros_like(w) for n, w in self.master.items()}
        self.v = {n: torch.zeros_like(w) for n, w in self.master.items()}
        self.g = {n: torch.zeros_like(w) for n, w in self.master.items()}
        self.t = 0
        # Real gradients are heavy-tailed and differ in scale per row; a per-row scale models that.
        self.row_scale = {n: torch.exp(torch.randn(w.shape[0], *([1] * (w.dim() - 1)), generator=self.gen))
                          for n, w in self.master.items()}

    def state(self) -> dict[str, torch.Tensor]:
        return {n: w.to(torch.bfloat16) for n, w in self.master.items()}

    def step(self) -> dict[str, torch.Tensor]:
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        c1 = 1 - b1 ** self.t
        c2 = 1 - b2 ** self.t
        with torch.no_grad():
            for n, w in self.master.items():
                g = self.g[n]
                noise = torch.randn(w.shape, generator=self.gen)
                g.mul_(self.persist).add_(noise.mul_(self.row_scale[n]))
                self.m[n].mul_(b1).add_(g, alpha=1 - b1)
                self.v[n].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (self.v[n] / c2).sqrt_().add_(self.eps)
                w.addcdiv_(self.m[n], denom, value=-self.lr / c1)
        return self.state()


def unchanged_fraction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    same = total = 0
    for n, t in a.items():
        same += int((t.view(torch.int16) == b[n].view(torch.int16)).sum())
        total += t.numel()
    return same / max(total, 1)


def lr_for_unchanged(target: float, shape: ModelShape, *, seed: int = 0, warmup: int = 3) -> float:
    """Learning rate at which about ``target`` of bf16 elements stay unchanged per step, found by
    bisection on one layer of ``shape`` (same widths, so the same weight magnitudes)."""
    probe = ModelShape(vocab=min(shape.vocab, 2048), hidden=shape.hidden, layers=1, ffn=shape.ffn)
    lo, hi = 1e-9, 1e-2
    for _ in range(16):
        mid = math.sqrt(lo * hi)
        tr = RLTrace(probe, lr=mid, seed=seed)
        for _ in range(warmup):
            prev = tr.step()
        frac = unchanged_fraction(prev, tr.step())
        if frac > target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)
