"""Test support: the engines' own loader arithmetic, reproduced independently of deltasync.layout.

vLLM cannot run multi-rank here and SGLang has no CPU wheel, so these functions reproduce, line for
line, what the engines' ``load_weights`` does with a Hugging Face state dict on one rank (vLLM 0.32.0:
``models/qwen2.py``/``llama.py``/``qwen3.py``/``mixtral.py``/``qwen2_moe.py`` ``load_weights`` with
``stacked_params_mapping`` and the expert mapping; ``layers/linear.py`` QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear ``weight_loader``; ``layers/vocab_parallel_embedding.py``
VocabParallelEmbedding ``weight_loader``; ``layers/fused_moe/routed_experts.py`` ``_load_w13``/``_load_w2``
and ``expert_map_manager.py`` ``determine_expert_map``. SGLang's ``python/sglang/srt`` equivalents use the
same arithmetic). Parameter shapes follow the layers' ``create_weights``. Nothing here imports
deltasync.layout: the tests compare the two.

Also :class:`ThreadGroup`, an in-process transport for the applier's two collectives (threads and a
barrier), so the rank matrix runs without spawning processes; the gloo tests use real processes.
"""

from __future__ import annotations

import re
import threading

import torch

from deltasync.layout import ModelFacts


def pad(v: int, to: int = 64) -> int:
    return (v + to - 1) // to * to


def engine_shapes(f: ModelFacts, tp: int, rank: int, ep: int = 1, ep_rank: int = 0, experts_tpl="experts.{w}_weight"):
    """name -> local shape of every engine parameter (create_weights of each layer)."""
    d, h = f.head_dim, f.hidden
    nh = f.heads // tp
    nkv = 1 if tp >= f.kv_heads else f.kv_heads // tp
    out = {}
    P = pad(f.vocab)
    out["model.embed_tokens.weight"] = (P // tp, h)
    for i in range(f.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out[f"{p}.self_attn.qkv_proj.weight"] = ((nh + 2 * nkv) * d, h)
        if f.qkv_bias:
            out[f"{p}.self_attn.qkv_proj.bias"] = ((nh + 2 * nkv) * d,)
        out[f"{p}.self_attn.o_proj.weight"] = (h, f.heads * d // tp)
        if f.qk_norm:
            out[f"{p}.self_attn.q_norm.weight"] = (d,)
            out[f"{p}.self_attn.k_norm.weight"] = (d,)
        m = f.moe
        if m is None or i < m.first_dense:
            out[f"{p}.mlp.gate_up_proj.weight"] = (2 * f.intermediate // tp, h)
            out[f"{p}.mlp.down_proj.weight"] = (h, f.intermediate // tp)
            continue
        blk = "block_sparse_moe" if m.style == "mixtral" else "mlp"
        out[f"{p}.{blk}.gate.weight"] = (m.experts, h)
        if m.score_bias:
            out[f"{p}.{blk}.gate.e_score_correction_bias"] = (m.experts,)
        mtp = 1 if ep > 1 else tp
        n_local = len(expert_ids(m.experts, ep, ep_rank))
        out[f"{p}.{blk}.{experts_tpl.format(w='w13')}"] = (n_local, 2 * m.intermediate // mtp, h)
        out[f"{p}.{blk}.{experts_tpl.format(w='w2')}"] = (n_local, h, m.intermediate // mtp)
        if m.shared_intermediate:
            nm = "shared_expert" if m.style == "qwen2_moe" else "shared_experts"
            out[f"{p}.mlp.{nm}.gate_up_proj.weight"] = (2 * m.shared_intermediate // tp, h)
            out[f"{p}.mlp.{nm}.down_proj.weight"] = (h, m.shared_intermediate // tp)
            if m.style == "qwen2_moe":
                out[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    out["model.norm.weight"] = (h,)
    if not f.tie_word_embeddings:
        out["lm_head.weight"] = (P // tp, h)
    return out


def expert_ids(n: int, ep: int, rank: int) -> list[int]:
    """determine_expert_map, linear placement: global ids on this EP rank."""
    if ep == 1:
        return list(range(n))
    base, rem = divmod(n, ep)
    local = base + 1 if rank < rem else base
    start = rank * base + min(rank, rem)
    return list(range(start, start + local))


def engine_load(f: ModelFacts, state: dict, tp: int, rank: int, ep: int = 1, ep_rank: int = 0,
                experts_tpl="experts.{w}_weight", dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """One rank's parameters after the engine's load_weights(state.items()) into zero-initialised params."""
    params = {n: torch.zeros(s, dtype=dtype) for n, s in engine_shapes(f, tp, rank, ep, ep_rank, experts_tpl).items()}
    d = f.head_dim
    nh = f.heads // tp
    if tp >= f.kv_heads:
        nkv, reps = 1, tp // f.kv_heads
    else:
        nkv, reps = f.kv_heads // tp, 1
    stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    m = f.moe
    mixtral = m is not None and m.style == "mixtral"
    gate_n, up_n, down_n = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    mtp, mrank = (1, 0) if ep > 1 else (tp, rank)
    local_of = {g: i for i, g in enumerate(expert_ids(m.experts, ep, ep_rank))} if m else {}
    for name, w in state.items():
        if f.tie_word_embeddings and name == "lm_head.weight":
            continue  # load_weights skips it: lm_head is embed_tokens
        em = re.match(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if em and m is not None:  # expert_params_mapping + FusedMoE.weight_loader
            base, x, which = em.group(1), int(em.group(2)), em.group(3)
            if x not in local_of:
                continue
            le = local_of[x]
            if which in (gate_n, up_n):
                p = params[f"{base}.{experts_tpl.format(w='w13')}"][le]
                shard = p.shape[0] // 2
                dst = p.narrow(0, 0 if which == gate_n else shard, shard)
                dst.copy_(w.narrow(0, shard * mrank, shard))
            else:
                p = params[f"{base}.{experts_tpl.format(w='w2')}"][le]
                shard = p.shape[1]
                p.copy_(w.narrow(1, shard * mrank, shard))
            continue
        sm = re.match(r"^(.*)\.experts\.(gate_up_proj|down_proj)$", name)
        if sm and m is not None:  # fused checkpoint experts [E, 2I, H] / [E, H, I]
            base, which = sm.group(1), sm.group(2)
            for x, le in local_of.items():
                if which == "gate_up_proj":
                    p = params[f"{base}.{experts_tpl.format(w='w13')}"][le]
                    shard = p.shape[0] // 2
                    inter = w.shape[1] // 2
                    p.narrow(0, 0, shard).copy_(w[x].narrow(0, shard * mrank, shard))
                    p.narrow(0, shard, shard).copy_(w[x].narrow(0, inter + shard * mrank, shard))
                else:
                    p = params[f"{base}.{experts_tpl.format(w='w2')}"][le]
                    p.copy_(w[x].narrow(1, p.shape[1] * mrank, p.shape[1]))
            continue
        for pname, wname, sid in stacked:
            if f".{wname}." not in name:
                continue
            target = name.replace(wname, pname)
            p = params[target]
            if pname == "qkv_proj":  # QKVParallelLinear.weight_loader
                if sid == "q":
                    off, size = 0, nh * d
                elif sid == "k":
                    off, size = nh * d, nkv * d
                else:
                    off, size = (nh + nkv) * d, nkv * d
                shard_rank = rank if sid == "q" else rank // reps
                p.narrow(0, off, size).copy_(w.narrow(0, shard_rank * size, size))
            else:  # MergedColumnParallelLinear.weight_loader
                size = w.shape[0] // tp
                off = sid * size
                p.narrow(0, off, size).copy_(w.narrow(0, rank * size, size))
            break
        else:
            p = params[name]
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":  # VocabParallelEmbedding
                per = p.shape[0]
                start = rank * per
                end = min(start + per, f.vocab)
                if end > start:
                    p[: end - start].copy_(w[start:end])
            elif name.endswith(("o_proj.weight", "down_proj.weight")):  # RowParallelLinear: input_dim = 1
                size = p.shape[1]
                p.copy_(w.narrow(1, rank * size, size))
            else:  # replicated (norms, router, shared_expert_gate, default_weight_loader)
                p.copy_(w)
    return params


def trainer_shapes(f: ModelFacts, *, tied_in_stream: bool = False) -> dict[str, tuple[int, ...]]:
    """Hugging Face checkpoint names and shapes for the facts."""
    d, h = f.head_dim, f.hidden
    out = {"model.embed_tokens.weight": (f.vocab, h)}
    for i in range(f.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        for n, rows in (("q", f.heads * d), ("k", f.kv_heads * d), ("v", f.kv_heads * d)):
            out[f"{p}.self_attn.{n}_proj.weight"] = (rows, h)
            if f.qkv_bias:
                out[f"{p}.self_attn.{n}_proj.bias"] = (rows,)
        out[f"{p}.self_attn.o_proj.weight"] = (h, f.heads * d)
        if f.qk_norm:
            out[f"{p}.self_attn.q_norm.weight"] = (d,)
            out[f"{p}.self_attn.k_norm.weight"] = (d,)
        m = f.moe
        if m is None or i < m.first_dense:
            out[f"{p}.mlp.gate_proj.weight"] = (f.intermediate, h)
            out[f"{p}.mlp.up_proj.weight"] = (f.intermediate, h)
            out[f"{p}.mlp.down_proj.weight"] = (h, f.intermediate)
            continue
        blk = "block_sparse_moe" if m.style == "mixtral" else "mlp"
        out[f"{p}.{blk}.gate.weight"] = (m.experts, h)
        if m.score_bias:
            out[f"{p}.{blk}.gate.e_score_correction_bias"] = (m.experts,)
        g, u, dn = ("w1", "w3", "w2") if m.style == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        if m.stacked:
            out[f"{p}.{blk}.experts.gate_up_proj"] = (m.experts, 2 * m.intermediate, h)
            out[f"{p}.{blk}.experts.down_proj"] = (m.experts, h, m.intermediate)
        else:
            for x in range(m.experts):
                out[f"{p}.{blk}.experts.{x}.{g}.weight"] = (m.intermediate, h)
                out[f"{p}.{blk}.experts.{x}.{u}.weight"] = (m.intermediate, h)
                out[f"{p}.{blk}.experts.{x}.{dn}.weight"] = (h, m.intermediate)
        if m.shared_intermediate:
            nm = "shared_expert" if m.style == "qwen2_moe" else "shared_experts"
            out[f"{p}.mlp.{nm}.gate_proj.weight"] = (m.shared_intermediate, h)
            out[f"{p}.mlp.{nm}.up_proj.weight"] = (m.shared_intermediate, h)
            out[f"{p}.mlp.{nm}.down_proj.weight"] = (h, m.shared_intermediate)
            if m.style == "qwen2_moe":
                out[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    out["model.norm.weight"] = (h,)
    if not f.tie_word_embeddings or tied_in_stream:
        out["lm_head.weight"] = (f.vocab, h)
    return out


def trainer_steps(shapes: dict, steps: int, *, seed: int = 0, density: float = 0.05, tied: bool = False):
    """``steps + 1`` bf16 states: random init, then sparse ULP-sized changes (a few rewritten words)."""
    g = torch.Generator().manual_seed(seed)
    s = {n: (torch.randn(sh, generator=g) * 0.05).to(torch.bfloat16) for n, sh in shapes.items()}
    if tied and "lm_head.weight" in s:
        s["lm_head.weight"] = s["model.embed_tokens.weight"].clone()
    out = [s]
    for _ in range(steps):
        nxt = {}
        for n, t in out[-1].items():
            w = t.clone().view(torch.int16).reshape(-1)
            mask = torch.rand(w.shape, generator=g) < density
            step = torch.randint(-2, 3, w.shape, generator=g, dtype=torch.int16)
            w[mask] += step[mask]
            nxt[n] = w.view(torch.bfloat16).reshape(t.shape)
        if tied and "lm_head.weight" in nxt:
            nxt["lm_head.weight"] = nxt["model.embed_tokens.weight"].clone()
        out.append(nxt)
    return out


class ThreadGroup:
    """In-process collectives for ``n`` ranks running in threads (the applier's GroupComm interface)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._barrier = threading.Barrier(n, timeout=60)
        self._slots: list = [None] * n

    def comm(self, rank: int) -> "_ThreadComm":
        return _ThreadComm(self, rank)

    def _exchange(self, rank: int, value) -> list:
        self._slots[rank] = value
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()
        return got


class _ThreadComm:
    def __init__(self, g: ThreadGroup, rank: int) -> None:
        self.g, self.rank, self.size = g, rank, g.n

    def min_max(self, values):
        got = self.g._exchange(self.rank, list(values))
        return [min(c) for c in zip(*got)], [max(c) for c in zip(*got)]

    def sum_u64(self, values):
        got = self.g._exchange(self.rank, list(values))
        return [sum(c) & ((1 << 64) - 1) for c in zip(*got)]


def run_ranks(n: int, fn):
    """Run fn(rank) on n threads; return the results (re-raising the first error)."""
    out: list = [None] * n
    errs: list = [None] * n

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return out, errs


def gloo_worker(rank: int, world: int, port: int, facts_name: str, ep: int, out_dir: str) -> None:
    """One rank of a real gloo group: follow two deltas, survive a failing rank, end identical to the loader."""
    import datetime
    import json
    import os

    import torch.distributed as dist

    from deltasync.client.sharded import ShardedApplier, prepare_needed
    from deltasync.codec import EncodeOptions, encode_delta
    from deltasync.errors import DeltaSyncError
    from deltasync.fingerprint import fingerprint_state
    from deltasync.layout import Parallel, vllm_layout
    import deltasync.diffs

    torch.set_num_threads(1)
    deltasync.diffs.MIN_CELL_WORDS = 16
    facts = GLOO_FACTS[facts_name]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        tpl = "experts.routed_experts.{w}_weight"
        er = rank if ep > 1 else 0
        states = trainer_steps(trainer_shapes(facts), 2, seed=3)
        opts = EncodeOptions(chunk_words=256, blob_target=4096, cell_blob_min=1)
        encs = [encode_delta(a, b, model="m", version=i + 1, parent=i, options=opts)
                for i, (a, b) in enumerate(zip(states, states[1:]))]
        params = engine_load(facts, states[0], world, rank, ep, er, tpl)
        app = ShardedApplier(vllm_layout(facts, Parallel(tp_rank=rank, tp_size=world, ep_rank=er, ep_size=ep)), params)
        fps = app.scan()
        assert fps == fingerprint_state(states[0])
        report = {"fetched": [], "total": []}

        def stage(e, fps):
            need = app.needed_blobs(e.manifest)
            report["fetched"].append(app.last_needed_bytes)
            report["total"].append(sum(b.size for b in e.manifest.blobs))
            return app.stage_delta(prepare_needed(e.manifest, e.blobs, need), fps)

        st = stage(encs[0], fps)
        st.commit()
        fps = st.fps
        before = {n: t.clone() for n, t in params.items()}
        # fault injection (this rank's patching raises half-way: half the tensors written): every rank must
        # roll back, bit-exact
        real = app._rankmap

        class Failing:
            def patch(self, patches, *a, **k):
                items = list(patches.items())
                out = real.patch(dict(items[: len(items) // 2]), *a, **k)
                if rank == world - 1:
                    raise RuntimeError("injected failure on the last rank")
                out.update(real.patch(dict(items[len(items) // 2:]), *a, **k))
                return out

        app._rankmap = Failing()
        try:
            stage(encs[1], fps)
            raise AssertionError("the step should have failed on every rank")
        except DeltaSyncError as e:
            report["error"] = f"{type(e).__name__}: {e}"
        app._rankmap = real
        for n, t in params.items():
            assert torch.equal(t.view(torch.int16), before[n].view(torch.int16)), n
        st = stage(encs[1], fps)
        st.commit()
        assert st.fps == fingerprint_state(states[2])
        final = engine_load(facts, states[2], world, rank, ep, er, tpl)
        for n, t in final.items():
            assert torch.equal(params[n].view(torch.int16), t.view(torch.int16)), n
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


from deltasync.layout import MoEFacts  # noqa: E402

GLOO_FACTS = {
    "qwen2": ModelFacts(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=100, qkv_bias=True),
    "mixtral": ModelFacts(layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=32, vocab=100,
                          moe=MoEFacts(style="mixtral", experts=4, intermediate=16)),
}
