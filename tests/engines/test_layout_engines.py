"""Layout maps against the engines' own loader arithmetic (reproduced in tests/engine_loaders.py: no
multi-rank vLLM and no SGLang CPU wheel here), dense and MoE, TP 1/2/4 and EP 2.

Every rank follows a chain of deltas through its own ShardedApplier (only the blobs it needs, ranks in
threads over an in-process transport for the two collectives) and must end byte-identical to the
engine's loader fed the trainer's final weights; a keyframe into zeroed parameters as well."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deltasync.apply import prepare_delta
from deltasync.client.sharded import ShardedApplier, prepare_needed
from deltasync.codec import EncodeOptions, diff_states, encode_delta, state_layout
from deltasync.history import StateHistory
from deltasync.errors import BaseMismatchError, IntegrityError, UnsupportedError
from deltasync.fingerprint import fingerprint_state
from deltasync.layout import MoEFacts, ModelFacts, Parallel, local_experts, sglang_layout, translate, vllm_layout, Region
from engine_loaders import ThreadGroup, engine_load, run_ranks, trainer_shapes, trainer_steps

import numpy as np

DENSE = ModelFacts(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=100,
                   qkv_bias=True)
QWEN3 = ModelFacts(layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=32, vocab=100,
                   qk_norm=True, tie_word_embeddings=True)
MIXTRAL = ModelFacts(layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=32, vocab=100,
                     moe=MoEFacts(style="mixtral", experts=4, intermediate=16))
QWEN2MOE = ModelFacts(layers=1, hidden=32, heads=4, kv_heads=4, head_dim=8, intermediate=32, vocab=130,
                      qkv_bias=True, moe=MoEFacts(style="qwen2_moe", experts=3, intermediate=16, shared_intermediate=32))
DEEPSEEK = ModelFacts(layers=2, hidden=32, heads=4, kv_heads=4, head_dim=8, intermediate=64, vocab=100,
                      moe=MoEFacts(style="deepseek", experts=4, intermediate=16, shared_intermediate=16,
                                   first_dense=1, score_bias=True))
STACKED = ModelFacts(layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=32, vocab=100,
                     moe=MoEFacts(style="qwen3_moe", experts=4, intermediate=16, stacked=True))

SMALL = EncodeOptions(chunk_words=256, blob_target=4096, cell_blob_min=1)
CELLS = EncodeOptions(chunk_words=256, blob_target=4096, cell_blob_min=1, pack="cells")


@pytest.fixture(autouse=True)
def small_cells(monkeypatch):
    """Row cells for these tiny tensors too (real models pass the default threshold: 512 Ki words)."""
    import deltasync.diffs

    monkeypatch.setattr(deltasync.diffs, "MIN_CELL_WORDS", 16)


def follow(facts, tp, ep=1, *, engine="vllm", steps=2, tied_in_stream=False, options=SMALL, history=False):
    tpl = "experts.routed_experts.{w}_weight" if engine == "vllm" else "experts.{w}_weight"
    build = vllm_layout if engine == "vllm" else sglang_layout
    shapes = trainer_shapes(facts, tied_in_stream=tied_in_stream)
    states = trainer_steps(shapes, steps, tied=tied_in_stream)
    if history:  # the history coding: each delta coded with the publisher's history, which then takes it in
        options = replace(options, coding="history")
        pub = StateHistory(state_layout(states[0]), since=0)
        encs = []
        for i, (a, b) in enumerate(zip(states, states[1:])):
            encs.append(encode_delta(a, b, model="m", version=i + 1, parent=i, options=options, history=pub))
            pub.advance_diff(i + 1, diff_states(a, b))
    else:
        encs = [encode_delta(a, b, model="m", version=i + 1, parent=i, options=options)
                for i, (a, b) in enumerate(zip(states, states[1:]))]
    group = ThreadGroup(tp)
    total = sum(b.size for e in encs for b in e.manifest.blobs)

    def rank(r):
        er = r if ep > 1 else 0
        par = Parallel(tp_rank=r, tp_size=tp, ep_rank=er, ep_size=ep)
        lay = build(facts, par, tied_copy=tied_in_stream)
        params = engine_load(facts, states[0], tp, r, ep, er, tpl)
        app = ShardedApplier(lay, params, comm=group.comm(r))
        fps = app.scan()
        want = fingerprint_state(states[0])
        assert fps == want
        fetched = 0
        mine = StateHistory(app.layout(), since=0) if history else None  # this rank's: its chunks' spans only
        for e in encs:
            need = app.needed_blobs(e.manifest)
            fetched += app.last_needed_bytes
            if history:
                prepared = prepare_delta(e.manifest, {b: e.blobs[b] for b in (need or e.blobs)}, only=need,
                                         history=mine, wanted=app.wants_chunk)
            else:
                prepared = prepare_needed(e.manifest, e.blobs, need)
            staged = app.stage_delta(prepared, fps)
            staged.commit()
            fps = staged.fps
            if history:
                mine.advance_patches(e.manifest.version, prepared.patches)
        assert fps == fingerprint_state(states[-1])
        final = engine_load(facts, states[-1], tp, r, ep, er, tpl)
        for n, t in final.items():
            assert torch.equal(params[n].view(torch.int16), t.view(torch.int16)), (r, n)
        # a keyframe into zeroed parameters ends the same
        zero = {n: torch.zeros_like(t) for n, t in params.items()}
        app2 = ShardedApplier(lay, zero, comm=group.comm(r))
        st = app2.stage_keyframe(states[-1], fingerprint_state(states[-1]))
        st.commit()
        for n, t in final.items():
            assert torch.equal(zero[n].view(torch.int16), t.view(torch.int16)), (r, n)
        return fetched

    out, errs = run_ranks(tp, rank)
    for e in sorted((e for e in errs if e is not None), key=lambda e: "Barrier" in type(e).__name__):
        raise e
    return out, total


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("facts", [DENSE, QWEN3], ids=["qwen2", "qwen3-tied"])
def test_dense_ranks_end_identical_to_the_engine_loader(facts, tp):
    fetched, total = follow(facts, tp, options=CELLS if tp == 4 else SMALL)
    if tp > 1:
        assert max(fetched) < total  # a rank fetches only the blobs with changes in its shard


@pytest.mark.parametrize("tp,ep,facts", [(2, 1, DENSE), (4, 1, DENSE), (2, 2, DEEPSEEK)], ids=["tp2", "tp4", "ep2-moe"])
def test_ranks_follow_a_history_coded_stream_with_only_their_blobs(tp, ep, facts):
    """The history coding (docs/FORMAT.md §4.5) on engine ranks: each rank fetches only the blobs over its rows,
    decodes only the chunks over them (``wants_chunk``: the same spans every step, so its history of them is
    whole) and ends byte-identical to the engine's loader after six steps."""
    fetched, total = follow(facts, tp, ep, steps=6, options=CELLS if tp == 4 else SMALL, history=True)
    assert max(fetched) < total


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("facts", [MIXTRAL, QWEN2MOE, DEEPSEEK, STACKED], ids=["mixtral", "qwen2moe", "deepseek", "stacked"])
def test_moe_ranks_end_identical_to_the_engine_loader(facts, tp, ep):
    follow(facts, tp, ep, options=CELLS if tp == 4 else SMALL)


def test_sglang_naming_and_a_stream_with_the_tied_copy():
    follow(QWEN3, 2, engine="sglang", tied_in_stream=True)


def test_replicated_kv_heads_are_counted_once():
    lays = [vllm_layout(DENSE, Parallel(tp_rank=r, tp_size=4)) for r in range(4)]
    k = "model.layers.0.self_attn.k_proj.weight"
    regs = [[x for x in lay.regions if x.source == k] for lay in lays]
    assert [x[0].src[0] for x in regs] == [(0, 8), (0, 8), (8, 8), (8, 8)]  # 2 kv heads, 2 replicas each
    assert [x[0].counted for x in regs] == [True, False, True, False]


def test_padded_vocab_rows():
    lays = [vllm_layout(DENSE, Parallel(tp_rank=r, tp_size=4)) for r in range(4)]
    e = "model.embed_tokens.weight"
    assert [lay.params[e][1] for lay in lays] == [(32, 32)] * 4  # 100 padded to 128
    assert [[x.src[0] for x in lay.regions if x.source == e] for lay in lays] == [[(0, 32)], [(32, 32)], [(64, 32)], [(96, 4)]]


def test_facts_that_do_not_split_fail_with_the_reason():
    with pytest.raises(BaseMismatchError, match="attention heads"):
        vllm_layout(DENSE, Parallel(tp_rank=0, tp_size=8))
    with pytest.raises(BaseMismatchError, match="expert intermediate"):
        vllm_layout(replace(MIXTRAL, moe=MoEFacts(style="mixtral", experts=4, intermediate=18)), Parallel(tp_rank=0, tp_size=4))


def test_expert_placement_matches_determine_expert_map():
    assert [local_experts(5, r, 2) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [local_experts(5, r, 2, "round_robin") for r in range(2)] == [[0, 2, 4], [1, 3]]


def test_translate_general_and_contiguous_paths_agree():
    src_shape, dst_shape = (6, 10), (2, 6, 4)
    reg = Region(source="s", param="p", src=((1, 4), (3, 4)), dst=((2, 4), (0, 4)), dst_index=(1,))
    pos = np.arange(60, dtype=np.int64)
    keep, local = translate(reg, src_shape, dst_shape, pos)
    full = torch.arange(60).reshape(src_shape)
    dst = torch.full(dst_shape, -1, dtype=torch.int64)
    dst.view(-1)[torch.from_numpy(local)] = full.view(-1)[torch.from_numpy(pos[keep])]
    assert torch.equal(dst[1, 2:6, 0:4], full[1:5, 3:7])
    assert int((dst >= 0).sum()) == 16


def test_a_wrong_blob_selection_is_caught_and_rolled_back():
    shapes = trainer_shapes(DENSE)
    states = trainer_steps(shapes, 1)
    enc = encode_delta(states[0], states[1], model="m", version=1, parent=0, options=SMALL)
    group = ThreadGroup(2)

    def rank(r):
        lay = vllm_layout(DENSE, Parallel(tp_rank=r, tp_size=2))
        params = engine_load(DENSE, states[0], 2, r)
        before = {n: t.clone() for n, t in params.items()}
        app = ShardedApplier(lay, params, comm=group.comm(r))
        fps = app.scan()
        need = set(app.needed_blobs(enc.manifest))
        if r == 1:
            need.discard(sorted(need)[0])  # this rank misses one blob it needs
        with pytest.raises(IntegrityError, match="rolled back on every rank"):
            app.stage_delta(prepare_needed(enc.manifest, enc.blobs, need), fps)
        for n, t in params.items():
            assert torch.equal(t.view(torch.int16), before[n].view(torch.int16)), n

    _, errs = run_ranks(2, rank)
    for e in errs:
        if e is not None:
            raise e


def test_unknown_engine_parameters_and_fp8_fail_closed():
    from deltasync.client.engines import check_engine_params

    lay = vllm_layout(DENSE, Parallel())
    params = engine_load(DENSE, trainer_steps(trainer_shapes(DENSE), 0)[0], 1, 0)
    check_engine_params(lay, params)
    scale = dict(params)
    scale["model.layers.0.self_attn.qkv_proj.weight_scale"] = torch.ones(1)
    with pytest.raises(UnsupportedError, match="qkv_proj.weight_scale"):
        check_engine_params(lay, scale)
    fp8 = dict(params)
    fp8["model.layers.1.mlp.down_proj.weight"] = params["model.layers.1.mlp.down_proj.weight"].to(torch.float8_e4m3fn)
    fp8["model.layers.0.mlp.down_proj.weight"] = params["model.layers.0.mlp.down_proj.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(UnsupportedError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*FP8"):
        check_engine_params(lay, fp8)


def test_sharded_applier_is_an_applier_and_full_verify_and_keyframe_rollback_work():
    from deltasync.client.appliers import Applier, Staged

    shapes = trainer_shapes(MIXTRAL)
    states = trainer_steps(shapes, 1, seed=9)
    enc = encode_delta(states[0], states[1], model="m", version=1, parent=0, options=SMALL)
    group = ThreadGroup(2)

    def rank(r):
        lay = vllm_layout(MIXTRAL, Parallel(tp_rank=r, tp_size=2))
        params = engine_load(MIXTRAL, states[0], 2, r, experts_tpl="experts.routed_experts.{w}_weight")
        app = ShardedApplier(lay, params, comm=group.comm(r))
        assert isinstance(app, Applier)
        fps = app.scan()
        st = app.stage_delta(prepare_needed(enc.manifest, enc.blobs, app.needed_blobs(enc.manifest)), fps, verify="full")
        assert isinstance(st, Staged) and st.fps == fingerprint_state(states[1])
        st.rollback()
        st.rollback()  # idempotent
        assert app.scan() == fps
        before = {n: t.clone() for n, t in params.items()}
        kf = app.stage_keyframe(states[1], fingerprint_state(states[1]))
        assert kf.fps == fingerprint_state(states[1]) and kf.touched
        kf.rollback()
        for n, t in params.items():
            assert torch.equal(t.view(torch.int16), before[n].view(torch.int16)), n
        with pytest.raises(IntegrityError, match="rolled back on every rank"):
            bad = dict(fingerprint_state(states[1]))
            bad["model.norm.weight"] ^= 1
            app.stage_keyframe(states[1], bad)
        for n, t in params.items():
            assert torch.equal(t.view(torch.int16), before[n].view(torch.int16)), n

    out, errs = run_ranks(2, rank)
    for e in sorted((e for e in errs if e is not None), key=lambda e: "Barrier" in type(e).__name__):
        raise e
