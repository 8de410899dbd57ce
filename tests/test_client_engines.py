"""Engine adapters: fused parameters patched through views; tensor-parallel shards with partial fingerprints."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from deltasync.apply import apply_delta, prepare_delta
from deltasync.client.engines import (
    Shard, TPShardApplier, combine_partials, fused_target, llama_fused_rules, partial_fingerprint, shard_tensor,
    vllm_module,
)
from deltasync.codec import encode_delta
from deltasync.errors import BaseMismatchError
from deltasync.fingerprint import tensor_fingerprint
from deltasync.testing.trace import ModelShape, RLTrace

SHAPE = ModelShape(vocab=128, hidden=32, layers=2, ffn=64)


class FusedEngineModel(nn.Module):
    """An engine-style layout (stacked q/k/v and gate/up), built here: a real module, not a mock."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.model.layers = nn.ModuleList()
        for _ in range(s.layers):
            layer = nn.Module()
            layer.input_layernorm = nn.Module()
            layer.input_layernorm.weight = nn.Parameter(torch.zeros(s.hidden))
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = nn.Linear(s.hidden, 3 * s.hidden, bias=False)
            layer.self_attn.o_proj = nn.Linear(s.hidden, s.hidden, bias=False)
            layer.post_attention_layernorm = nn.Module()
            layer.post_attention_layernorm.weight = nn.Parameter(torch.zeros(s.hidden))
            layer.mlp = nn.Module()
            layer.mlp.gate_up_proj = nn.Linear(s.hidden, 2 * s.ffn, bias=False)
            layer.mlp.down_proj = nn.Linear(s.ffn, s.hidden, bias=False)
            self.model.layers.append(layer)
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.zeros(s.hidden))
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.int16)


def test_fused_engine_parameters_are_patched_in_place_through_views():
    trace = RLTrace(SHAPE, lr=1e-4, seed=0)
    s0, s1 = trace.step(), trace.step()
    engine = FusedEngineModel(SHAPE).to(torch.bfloat16)
    shapes = {n: tuple(t.shape) for n, t in s0.items()}
    target = fused_target(engine, llama_fused_rules(), trainer_shapes=shapes)
    assert set(target) == set(s0)
    with torch.no_grad():
        for n, t in target.items():
            t.copy_(s0[n])  # the engine loaded v0 (fused)
    enc = encode_delta(s0, s1, model="m", version=1, parent=0)
    apply_delta(target, enc.manifest, enc.blobs)  # the core's verified, transactional apply, unchanged
    layer = engine.model.layers[1]
    qkv = torch.cat([s1[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([s1["model.layers.1.mlp.gate_proj.weight"], s1["model.layers.1.mlp.up_proj.weight"]])
    assert torch.equal(_bits(layer.self_attn.qkv_proj.weight), _bits(qkv))
    assert torch.equal(_bits(layer.mlp.gate_up_proj.weight), _bits(gate_up))
    assert torch.equal(_bits(engine.lm_head.weight), _bits(s1["lm_head.weight"]))


def test_fused_target_refuses_shapes_that_do_not_add_up():
    engine = FusedEngineModel(SHAPE)
    shapes = {n: tuple(t.shape) for n, t in RLTrace(SHAPE, lr=1e-4).state().items()}
    shapes["model.layers.0.self_attn.k_proj.weight"] = (SHAPE.hidden // 2, SHAPE.hidden)
    with pytest.raises(BaseMismatchError, match="rows"):
        fused_target(engine, llama_fused_rules(), trainer_shapes=shapes)


def _tp_split(state, world):
    """Megatron-style: q/k/v/gate/up column-parallel (rows), o/down row-parallel (columns), the rest replicated."""
    shards = [{} for _ in range(world)]
    for n, t in state.items():
        if any(k in n for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            dim = 0
        elif any(k in n for k in ("o_proj", "down_proj")):
            dim = 1
        else:
            continue
        for r in range(world):
            shards[r][n] = Shard(dim=dim, rank=r, world=world, full_shape=tuple(t.shape))
    return shards


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_shards_patch_and_verify_by_summed_partials(world):
    trace = RLTrace(SHAPE, lr=1e-4, seed=1)
    s0, s1 = trace.step(), trace.step()
    specs = _tp_split(s0, world)
    ranks = []
    for r in range(world):
        local = {n: (shard_tensor(t, specs[r][n]) if n in specs[r] else t.clone()) for n, t in s0.items()}
        ranks.append(TPShardApplier(local, specs[r]))
    # the partial sums of a rank's shards add up to the full tensor's fingerprint
    name = "model.layers.0.self_attn.o_proj.weight"
    assert combine_partials([rk.partials[name] for rk in ranks], s0[name].shape, s0[name].dtype) == tensor_fingerprint(s0[name])
    enc = encode_delta(s0, s1, model="m", version=1, parent=0)
    prepared = prepare_delta(enc.manifest, enc.blobs)
    partials = [rk.begin(prepared) for rk in ranks]
    # stand-in for the engine's all-reduce (a plain sum over the simulated ranks of this process)
    totals = {n: sum(p[n] for p in partials) for n in partials[0]}
    assert all(rk.check(prepared, totals) for rk in ranks)
    for rk in ranks:
        rk.commit()
    for r, rk in enumerate(ranks):
        for n, t in rk.tensors.items():
            want = shard_tensor(s1[n], specs[r][n]) if n in specs[r] else s1[n]
            assert torch.equal(_bits(t), _bits(want)), (r, n)


def test_a_bad_shard_fails_the_check_on_every_rank_and_all_roll_back():
    trace = RLTrace(SHAPE, lr=1e-4, seed=2)
    s0, s1 = trace.step(), trace.step()
    specs = _tp_split(s0, 2)
    ranks = [TPShardApplier({n: (shard_tensor(t, specs[r][n]) if n in specs[r] else t.clone()) for n, t in s0.items()},
                            specs[r]) for r in range(2)]
    before = [{n: t.clone() for n, t in rk.tensors.items()} for rk in ranks]
    enc = encode_delta(s0, s1, model="m", version=1, parent=0)
    prepared = prepare_delta(enc.manifest, enc.blobs)
    partials = [rk.begin(prepared) for rk in ranks]
    name = "model.layers.1.mlp.up_proj.weight"
    ranks[1].tensors[name].view(torch.int16).view(-1)[3] ^= 0x10  # memory went bad on rank 1
    partials[1][name] = partial_fingerprint(ranks[1].tensors[name], specs[1][name])
    totals = {n: sum(p[n] for p in partials) for n in partials[0]}
    assert not any(rk.check(prepared, totals) for rk in ranks)
    for rk in ranks:
        rk.rollback()
    assert torch.equal(_bits(ranks[0].tensors[name]), _bits(before[0][name]))
    for n in s0:
        if n != name:
            assert torch.equal(_bits(ranks[1].tensors[n]), _bits(before[1][n]))


def test_vllm_module_is_found_without_importing_vllm():
    # MOCK: vLLM cannot run on this machine; this stand-in only mimics the attribute path of an LLM object.
    model = nn.Linear(2, 2)
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_executor=types.SimpleNamespace(
        driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model)))))
    assert vllm_module(llm) is model
    with pytest.raises(TypeError, match="cannot find the model"):
        vllm_module(object())
