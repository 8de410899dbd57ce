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
from deltasync.rankmap import RankMap, restore
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
    restore(undo)
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


def _runs_layout() -> RankLayout:
    """Direct tensors of every kind: an fp32 identity, an fp32 TP row shard (its run starts at stream word 12), two
    bf16 experts stacked into one parameter's rows, and a bf16 column split that still needs the translation."""
    return RankLayout(
        stream={"d": ("float32", (6, 4)), "e": ("float32", (5,)), "f0": ("bfloat16", (2, 4)),
                "f1": ("bfloat16", (2, 4)), "h": ("bfloat16", (4, 6))},
        params={"pd": ("float32", (3, 4)), "pe": ("float32", (5,)), "pf": ("bfloat16", (4, 4)),
                "ph": ("bfloat16", (4, 3))},
        regions=(Region(source="d", param="pd", src=((3, 3), (0, 4)), dst=((0, 3), (0, 4))),
                 Region(source="e", param="pe", src=((0, 5),), dst=((0, 5),)),
                 Region(source="f0", param="pf", src=((0, 2), (0, 4)), dst=((0, 2), (0, 4))),
                 Region(source="f1", param="pf", src=((0, 2), (0, 4)), dst=((2, 2), (0, 4))),
                 Region(source="h", param="ph", src=((0, 4), (3, 3)), dst=((0, 4), (0, 3)))))


def _placed(lay: RankLayout, stream: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters' words holding ``stream``'s words, region by region (``translate``)."""
    out = {p: np.zeros(int(np.prod(shape)), dtype=np.uint16 if dt == "bfloat16" else np.uint32)
           for p, (dt, shape) in lay.params.items()}
    for name, words in stream.items():
        for r in lay.by_source().get(name, ()):
            keep, local = translate(r, lay.stream[name][1], lay.params[r.param][1], np.arange(words.size))
            out[r.param][local] = words[keep]
    return out


RUN_CASES = ["runs", "dense-tp4", "moe128-tp2", "moe128-ep2"]


@pytest.mark.parametrize("selection", ["numba joined", "numba in place", "numba mixed", "reference"])
@pytest.mark.parametrize("case", RUN_CASES)
def test_direct_runs_patch_like_the_region_by_region_path(case, selection, monkeypatch):
    """Chunks inside their tensor's one run are patched without translation (the compiled jobs on host parameters
    whose run starts at word 0, torch elsewhere); chunks across a shard's edge still go through the translation.
    Words, each tensor's fingerprint change (its counted regions only) and the undo log all equal the region-by-region
    path's, with raw and modular changes mixed and several chunks per tensor. The compiled call either joins the
    chunks' arrays (small chunks) or addresses each where it is (large ones), in parts of a bounded size."""
    import deltasync.rankmap

    monkeypatch.setattr(deltasync.rankmap, "JOIN_CHANGES", 1 << 40 if selection == "numba joined" else 0)
    if selection == "numba in place":
        monkeypatch.setattr(deltasync.rankmap, "PART_BYTES", 64)  # many compiled calls, an undo record each
    _direct_runs(case, selection.split()[0], "cpu", mixed=selection == "numba mixed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", RUN_CASES)
def test_direct_runs_on_cuda_parameters(case):
    """The same on CUDA parameters: each device's changes uploaded once, positions checked against their runs and
    the fingerprint changes summed on the device (``make gpu-check``)."""
    _direct_runs(case, "numba", "cuda")


def _direct_runs(case: str, selection: str, device: str, mixed: bool = False) -> None:
    from deltasync import kernels

    kernels.select(selection)
    try:
        if case == "runs":
            lay = _runs_layout()
        else:
            facts, par = {"dense-tp4": (DENSE, Parallel(tp_rank=3, tp_size=4)),
                          "moe128-tp2": (MOE128, Parallel(tp_rank=1, tp_size=2)),
                          "moe128-ep2": (MOE128, Parallel(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2))}[case]
            lay = vllm_layout(facts, par)
        rm = RankMap.compile(lay)
        assert any(r is not None for r in rm.runs)
        rng = np.random.default_rng(7)
        u = {n: np.uint16 if dt == "bfloat16" else np.uint32 for n, (dt, _) in lay.stream.items()}
        old = {n: rng.integers(0, 1 << 15, int(np.prod(s)), dtype=np.int64).astype(u[n]) for n, (_, s) in lay.stream.items()}
        new = {n: w.copy() for n, w in old.items()}
        patches = {}
        for n, w in new.items():
            size = w.size
            pos = np.sort(rng.choice(size, size=max(1, size // 3), replace=False)).astype(np.int64)
            w[pos] += rng.integers(1, 9, pos.size).astype(w.dtype)
            raw = rng.random(pos.size) < 0.5
            vals = np.where(raw, w[pos], w[pos] - old[n][pos]).astype(w.dtype)
            span = max(1, size // 3 + 1)  # three chunks: some inside a shard's run, some across its edge
            chunks = []
            for s in range(0, size, span):
                k = (pos >= s) & (pos < s + span)
                chunks.append(ChunkPatch(tensor=n, dtype=lay.stream[n][0], start=s, stop=min(size, s + span),
                                         changes=Changes(positions=pos[k], raw=raw[k], values=vals[k])))
            patches[n] = chunks
        before, want = _placed(lay, old), _placed(lay, new)
        dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}
        params = {p: torch.from_numpy(before[p].view(np.int16 if d == "bfloat16" else np.int32).copy()).view(dt[d])
                  .to(device) for p, (d, _) in lay.params.items()}
        words = {p: word_view(t) for p, t in params.items()}
        if mixed:  # every other parameter's words strided (not contiguous): torch patches those, the jobs the rest
            for p in list(words)[::2]:
                spread = torch.zeros(2 * words[p].numel(), dtype=words[p].dtype)
                spread[::2] = words[p]
                words[p] = spread[::2]
        undo, touched = [], set()
        versions = {p: w._version for p, w in words.items()}
        fpd = rm.patch(patches, words, undo, touched, layout=lay)
        for p, w in words.items():
            assert np.array_equal(w.cpu().numpy().view(want[p].dtype), want[p]), p
            # written in place, through addresses or not: the version moved (vLLM's CPU extension repacks on it)
            assert (w._version > versions[p]) == (p in touched), p
        for n in lay.stream:
            ws = 2 if u[n] is np.uint16 else 4
            total = 0
            for r in lay.by_source().get(n, ()):
                if not r.counted:
                    continue
                pos = np.flatnonzero(old[n] != new[n]).astype(np.int64)
                keep, local = translate(r, lay.stream[n][1], lay.params[r.param][1], pos)
                sdt = torch.int16 if ws == 2 else torch.int32
                total += fingerprint_delta(torch.from_numpy(pos[keep]), torch.from_numpy(before[r.param][local]).view(sdt),
                                           torch.from_numpy(want[r.param][local]).view(sdt), ws)
            assert fpd.get(n, 0) == total & ((1 << 64) - 1), n
        restore(undo)
        for p, w in words.items():
            assert np.array_equal(w.cpu().numpy().view(before[p].dtype), before[p]), p
    finally:
        kernels.select("auto")


def test_a_direct_change_outside_its_run_is_refused_before_it_lands():
    """A chunk that says it lies in a shard's run but carries a position outside it: refused (IndexError, which the
    sharded applier votes on and rolls back), nothing written outside the run."""
    lay = _runs_layout()
    rm = RankMap.compile(lay)
    params = {p: torch.zeros(shape, dtype=torch.float32 if d == "float32" else torch.bfloat16)
              for p, (d, shape) in lay.params.items()}
    words = {p: word_view(t) for p, t in params.items()}
    for name, bad in (("d", 5), ("e", 7)):  # d: before its run (the shard's rows start at word 12); e: past its end
        ch = ChunkPatch(tensor=name, dtype="float32", start=12 if name == "d" else 0, stop=16 if name == "d" else 5,
                        changes=Changes(positions=np.asarray([bad], np.int64), raw=np.ones(1, bool),
                                        values=np.ones(1, np.uint32)))
        undo = []
        with pytest.raises(IndexError, match="outside its run"):
            rm.patch({name: [ch]}, words, undo, set(), layout=lay)
        restore(undo)
        assert all(not t.any() for t in params.values())
