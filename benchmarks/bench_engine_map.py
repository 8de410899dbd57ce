"""An engine rank's map at a seed model's expert count: build once, then the per-step patch (issue 22).

For vLLM's layout of a Qwen3-MoE-style model whose stream names the experts per expert
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``; hidden 64, expert intermediate 32 or
64: narrow, so the tensor count, not the bytes, is what is measured), at TP=2 rank 0 and at EP=2
rank 0, this prints:

* the map build: ``deltasync.layout.vllm_layout`` (the regions), then ``RankMap.compile`` (its offset
  tables), once at start;
* the per-step patch of a step that changes 1% of every tensor's words (every expert touched):
  ``RankMap.patch`` (translate every change, one gather/scatter per parameter, fingerprint changes
  summed per tensor); best of 3.

Layouts: 128 experts x 2 layers (the real-vLLM test's model, tests/engines/test_vllm_engine.py), 128 x 48, and a
Kimi-K2-class 384 x 60 (69k stream tensors). Run alone: ``python benchmarks/bench_engine_map.py [--quick]``
(``--quick``: the first two layouts only).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from deltasync.codec import ChunkPatch
from deltasync.dtypes import word_view
from deltasync.layout import MoEFacts, ModelFacts, Parallel, vllm_layout
from deltasync.rankmap import RankMap
from deltasync.values import Changes


def facts(layers: int, experts: int, inter: int) -> ModelFacts:
    return ModelFacts(layers=layers, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=64, vocab=1024,
                      qk_norm=True, moe=MoEFacts(style="qwen3_moe", experts=experts, intermediate=inter))


def step_patches(layout, share: float, seed: int = 0) -> tuple[dict, int]:
    rng = np.random.default_rng(seed)
    out, total = {}, 0
    for name, (_, shape) in layout.stream.items():
        size = int(np.prod(shape))
        k = max(1, int(size * share))
        pos = np.sort(rng.choice(size, size=k, replace=False)).astype(np.int64)
        out[name] = [ChunkPatch(tensor=name, dtype="bfloat16", start=0, stop=size,
                                changes=Changes(positions=pos, raw=np.zeros(k, bool),
                                                values=rng.integers(1, 3, k).astype(np.uint16)))]
        total += k
    return out, total


def measure(layers: int, experts: int, inter: int, par: Parallel) -> dict:
    f = facts(layers, experts, inter)
    t0 = time.perf_counter()
    lay = vllm_layout(f, par)
    t_layout = time.perf_counter() - t0
    t0 = time.perf_counter()
    rm = RankMap.compile(lay)
    t_compile = time.perf_counter() - t0
    words = {n: word_view(torch.zeros(shape, dtype=torch.bfloat16)) for n, (_, shape) in lay.params.items()}
    patches, changes = step_patches(lay, 0.01)
    best = float("inf")
    for _ in range(3):
        undo, touched = [], set()
        t0 = time.perf_counter()
        rm.patch(patches, words, undo, touched)
        best = min(best, time.perf_counter() - t0)
    return {"layers": layers, "experts": experts, "tensors": len(lay.stream), "rank tensors": len(rm.names),
            "params": len(lay.params), "layout_s": t_layout, "compile_s": t_compile, "patch_s": best,
            "changes": changes}


def table(quick: bool = False) -> list[str]:
    """The Markdown table's lines (``quick``: the first two layouts only)."""
    torch.set_num_threads(1)
    sizes = [(2, 128, 64), (48, 128, 64), (60, 384, 32)]
    if quick:
        sizes = sizes[:2]
    lines = ["| layout | parallel | stream tensors (on the rank) | map build: layout + offset tables | "
             "patch of a 1% step (changes) | per stream tensor |", "|---|---|---|---|---|---|"]
    for layers, experts, inter in sizes:
        for label, par in (("TP=2 rank 0", Parallel(tp_rank=0, tp_size=2)),
                           ("EP=2 rank 0", Parallel(tp_rank=0, tp_size=2, ep_rank=0, ep_size=2))):
            r = measure(layers, experts, inter, par)
            lines.append(f"| {experts} experts x {layers} layers | {label} | {r['tensors']} ({r['rank tensors']}) | "
                         f"{r['layout_s'] * 1e3:.0f} + {r['compile_s'] * 1e3:.0f} ms | {r['patch_s'] * 1e3:.1f} ms "
                         f"({r['changes']}) | {r['patch_s'] / r['tensors'] * 1e6:.2f} us |")
    return lines


def run(quick: bool = False) -> str:
    """``make bench``'s section (benchmarks/run.py)."""
    return "\n".join(["## An engine rank's map at a seed model's expert count (issue 22, bench_engine_map)", "",
                      "vLLM's layout of a Qwen3-MoE-style model streamed per expert (hidden 64, narrow experts): the "
                      "map built once at start (`vllm_layout` regions + `RankMap.compile` offset tables), then the "
                      "per-step `RankMap.patch` of a step changing 1% of every tensor's words (every expert), best "
                      "of 3, one thread.", "", *table(quick)]) + "\n"


def main(argv: list[str]) -> None:
    print("\n".join(table("--quick" in argv)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
