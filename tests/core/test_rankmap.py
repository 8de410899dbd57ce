"""RankMap: a rank's layout map as offset tables, a step translated and patched vectorized.

Checked against the region-by-region path it replaces (``deltasync.layout.translate`` per region, the
fingerprint change per tensor by ``fingerprint_delta``) on the engine layouts (dense, MoE per-expert and
stacked, TP and EP, 128 experts), and on hand-made layouts with a region that is not a 2-D box and with
words of two sizes. The end-to-end checks (ranks following deltas end identical to the engines' loaders)
are tests/engines/test_layout_engines.py and tests/engines/test_engines_gloo.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from deltasync.codec import ChunkPatch
from deltasync.dtypes import word_view
from deltasync.fingerprint import fingerprint_delta, tensor_fingerprint
from deltasync.layout import MoEFacts, ModelFacts, Parallel, RankLayout, Region, translate, vllm_layout
from deltasync.rankmap import RankMap
from deltasync.values import Changes

DENSE = ModelFacts(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=100, qkv_bias=True)
MOE128 = ModelFacts(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=64, vocab=100, qk_norm=True,
                    moe=MoEFacts(style="qwen3_moe", experts=128, intermediate=32))
STACKED = ModelFacts(layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=32, vocab=100,
                     moe=MoEFacts(style="qwen2_moe", experts=6, intermediate=16, shared_intermediate=32, stacked=True))

CASES = [(DENSE, Parallel(tp_rank=1, tp_size=2)), (DENSE, Parallel(tp_rank=3, tp_size=4)),
         (MOE128, Parallel(tp_rank=1, tp_size=2)), (MOE128, Parallel(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)),
         (MOE128, Parallel(tp_rank=0, tp_size=2, ep_rank=0, ep_size=2, expert_placement="round_robin")),
         (STACKED, Parallel(tp_rank=1, tp_size=2))]


def _positions(rng, n: int) -> np.ndarray:
    k = min(n, max(1, n // 7))
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


def _reference(lay: RankLayout, changes: dict[str, np.ndarray]) -> set[tuple]:
    out = set()
    for name, pos in changes.items():
        for r in lay.by_source().get(name, ()):  # an expert of another EP rank has none
            keep, local = translate(r, lay.stream[name][1], lay.params[r.param][1], pos)
            out.update(zip([name] * int(keep.sum()), pos[keep].tolist(), [r.param] * int(keep.sum()), local.tolist()))
    return out


def _mapped(rm: RankMap, lay: RankLayout, changes: dict[str, np.ndarray]) -> set[tuple]:
    here = {n: p for n, p in changes.items() if n in rm.ids}
    tids = np.concatenate([np.full(p.size, rm.ids[n], dtype=np.int64) for n, p in here.items()])
    pos = np.concatenate(list(here.values()))
    ci, rr, dst = rm.translate(tids, pos, lay)
    return {(rm.names[tids[i]], int(pos[i]), rm.params[rm.param[r]], int(d)) for i, r, d in zip(ci, rr, dst)}


@pytest.mark.parametrize("facts,par", CASES, ids=["dense-tp2", "dense-tp4", "moe128-tp2", "moe128-ep2",
                                                  "moe128-ep2-round-robin", "stacked-tp2"])
def test_translation_equals_the_region_by_region_path(facts, par):
    lay = vllm_layout(facts, par)
    rm = RankMap.compile(lay)
    assert all(g is None for g in rm.general)  # every engine region is a 2-D box of the (rows, last dim) views
    rng = np.random.default_rng(0)
    changes = {n: _positions(rng, int(np.prod(shape))) for n, (_, shape) in lay.stream.items()}
    want = _reference(lay, changes)
    assert want and _mapped(rm, lay, changes) == want
    # the compiled kernel (one pass, grouped by parameter) places the same changes, in parameter order
    here = {n: p for n, p in changes.items() if n in rm.ids}
    tids = np.concatenate([np.full(p.size, rm.ids[n], dtype=np.int64) for n, p in here.items()])
    pos = np.concatenate(list(here.values()))
    ci, rr, dst = rm._placements(tids, pos, lay)
    assert np.all(np.diff(rm.param[rr]) >= 0)
    got = {(rm.names[tids[i]], int(pos[i]), rm.params[rm.param[r]], int(d)) for i, r, d in zip(ci, rr, dst)}
    assert len(got) == ci.size and got == want


def _general_layout() -> RankLayout:
    """A [2, 4, 4] source whose middle rows 1..2 of both planes feed a [2, 2, 4] parameter (rows 1, 2, 5, 6 of the
    [8, 4] view: not one run), plus an fp32 tensor split by columns and a 0-d bf16 tensor."""
    return RankLayout(
        stream={"a": ("bfloat16", (2, 4, 4)), "b": ("float32", (3, 6)), "c": ("bfloat16", ())},
        params={"pa": ("bfloat16", (2, 2, 4)), "pb": ("float32", (3, 2)), "pc": ("bfloat16", ())},
        regions=(Region(source="a", param="pa", src=((0, 2), (1, 2), (0, 4)), dst=((0, 2), (0, 2), (0, 4))),
                 Region(source="b", param="pb", src=((0, 3), (2, 2)), dst=((0, 3), (0, 2))),
                 Region(source="c", param="pc", src=(), dst=())))


def test_a_region_that_is_not_a_box_goes_through_translate_and_two_word_sizes_patch_together():
    lay = _general_layout()
    rm = RankMap.compile(lay)
    assert [g is not None for g in rm.general] == [True, False, False]
    changes = {"a": np.arange(32, dtype=np.int64), "b": np.arange(18, dtype=np.int64), "c": np.zeros(1, np.int64)}
    assert _mapped(rm, lay, changes) == _reference(lay, changes)

    g = torch.Generator().manual_seed(1)
    full = {"a": torch.randn(2, 4, 4, generator=g).bfloat16(), "b": torch.randn(3, 6, generator=g),
            "c": torch.randn((), generator=g).bfloat16()}
    params = {"pa": full["a"][:, 1:3].contiguous(), "pb": full["b"][:, 2:4].contiguous(), "pc": full["c"].clone()}
    new = {n: t + 0.25 for n, t in full.items()}
    patches = {}
    for n, t in full.items():
        o, w = word_view(t.contiguous()).numpy(), word_view(new[n].contiguous()).numpy()
        pos = np.flatnonzero(o != w).astype(np.int64)
        u = np.dtype(f"u{o.dtype.itemsize}")
        raw = np.arange(pos.size) % 2 == 0  # half raw new words, half modular steps
        vals = np.where(raw, w[pos].view(u), (w[pos].view(u) - o[pos].view(u)))
        patches[n] = [ChunkPatch(tensor=n, dtype=str(t.dtype).split(".")[1], start=0, stop=o.size,
                                 changes=Changes(positions=pos, raw=raw, values=vals.astype(u)))]
    words = {n: word_view(t) for n, t in params.items()}
    before = {n: t.clone() for n, t in params.items()}
    undo, touched = [], set()
    fpd = rm.patch(patches, words, undo, touched, layout=lay)
    assert touched == set(params)
    assert torch.equal(params["pa"], new["a"][:, 1:3]) and torch.equal(params["pb"], new["b"][:, 2:4])
    assert torch.equal(params["pc"], new["c"])
    # fingerprint change of each tensor's boxes, region by region (the path RankMap replaces)
    for n, p in (("a", "pa"), ("b", "pb"), ("c", "pc")):
        r = lay.by_source()[n][0]
        pos = patches[n][0].changes.positions
        keep, local = translate(r, lay.stream[n][1], lay.params[p][1], pos)
        old_w = word_view(before[p].contiguous())[torch.from_numpy(local)]
        new_w = word_view(params[p])[torch.from_numpy(local)]
        assert fpd[n] == fingerprint_delta(torch.from_numpy(pos[keep]), old_w, new_w, 4 if n == "b" else 2), n
    for w, idx, old in reversed(undo):
        w.index_copy_(0, idx, old)
    for n, t in params.items():
        assert torch.equal(word_view(t), word_view(before[n])), n


def test_the_map_is_built_once_and_a_step_walks_no_region(monkeypatch):
    """128 experts x 2 layers, then x 64 layers, in per-expert names at TP=2 (a Qwen3-MoE-style stream): build the
    map, then patch a step changing 1% of every tensor (every expert); the region-by-region translation is never
    called (it raises here), and the times are printed (no bound: CI machines are shared; see
    benchmarks/bench_engine_map.py)."""
    import deltasync.rankmap

    def walked(*a, **k):
        raise AssertionError("a region was translated one by one")

    monkeypatch.setattr(deltasync.rankmap, "translate", walked)

    def run(layers: int):
        facts = ModelFacts(layers=layers, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=64, vocab=100,
                           qk_norm=True, moe=MoEFacts(style="qwen3_moe", experts=128, intermediate=32))
        lay = vllm_layout(facts, Parallel(tp_rank=0, tp_size=2))
        t0 = time.perf_counter()
        rm = RankMap.compile(lay)
        build = time.perf_counter() - t0
        words = {n: word_view(torch.zeros(shape, dtype=torch.bfloat16)) for n, (_, shape) in lay.params.items()}
        rng = np.random.default_rng(0)
        patches = {}
        for n, (_, shape) in lay.stream.items():
            size = int(np.prod(shape))
            pos = np.sort(rng.choice(size, size=max(1, size // 100), replace=False)).astype(np.int64)
            patches[n] = [ChunkPatch(tensor=n, dtype="bfloat16", start=0, stop=size,
                                     changes=Changes(positions=pos, raw=np.zeros(pos.size, bool),
                                                     values=np.ones(pos.size, np.uint16)))]
        best = float("inf")
        for _ in range(3):
            undo, touched = [], set()
            t0 = time.perf_counter()
            fpd = rm.patch(patches, words, undo, touched)
            best = min(best, time.perf_counter() - t0)
        assert set(fpd) == set(lay.stream) and touched == set(lay.params)
        return len(lay.stream), build, best, sum(p[0].changes.positions.size for p in patches.values())

    n2, b2, s2, c2 = run(2)
    n64, b64, s64, c64 = run(64)
    print(f"\nRankMap, 128 experts/layer, TP=2 rank 0: {n2} tensors: build {b2 * 1e3:.1f} ms, step (1% of every "
          f"tensor, {c2} changes) {s2 * 1e3:.1f} ms; {n64} tensors: build {b64 * 1e3:.0f} ms, step ({c64} changes) "
          f"{s64 * 1e3:.0f} ms ({s64 / n64 * 1e6:.2f} us per tensor)")
