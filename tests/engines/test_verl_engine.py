"""deltasync as verl's checkpoint engine (``checkpoint_engine.backend=deltasync``,
``custom_backend_module=deltasync.client.verl``), driven as verl 0.9.1 drives an engine.

verl needs Ray and, for its own engines, CUDA: it does not run here. Its registry and engine ABC are reproduced
in ``tests/verl_standin.py`` (copied from verl 0.9.1's source); everything else is real: a real origin on
loopback, the real Publisher on the actor's side, a real Subscriber on the rollout's side. The test makes verl's
calls in verl's order: ``CheckpointEngineRegistry.new(backend, is_master=, bucket_size=, **engine_kwargs)`` on two
trainer ranks and one rollout worker, ``prepare`` on all, ``build_topology`` (each value a list per worker, as
the manager asserts), ``init_process_group(**kwargs)``, then per step the actor ranks' ``send_weights(generator,
global_steps=)`` beside the rollout's ``receive_weights(global_steps=)`` fed to a stand-in server adapter that
copies each ``(name, tensor)`` into its weights (as verl's ``update_weights(..., wire_format="named_tensors")``
loads them), then ``finalize``.

Not run: verl itself (Ray workers, its vLLM/SGLang rollout adapters, ``CheckpointEngineManager``), any GPU."""

from __future__ import annotations

import asyncio

import pytest
import torch

import verl_standin
from server_fixtures import KEY_HEX, TOKEN, origin


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.weight": torch.randn(48, 40, generator=g) for i in range(6)}


async def test_verl_checkpoint_engine_contract(monkeypatch, tmp_path):
    registry = verl_standin.install(monkeypatch)
    import deltasync.client.verl as dv

    assert registry.get("deltasync") is dv.DeltaSyncCheckpointEngine
    server = origin(tmp_path, key=True).start().wait_ready()
    kwargs = {"origin": server.url, "token": TOKEN, "urls": [server.url], "model": "verl-policy", "key_hex": KEY_HEX,
              "dtype": "bfloat16", "keyframe_every": 0, "timeout": 60}
    bucket = 64 << 20
    actors = [registry.new("deltasync", is_master=r == 0, bucket_size=bucket, **kwargs) for r in range(2)]
    rollout = registry.new("deltasync", bucket_size=bucket, **kwargs)
    engines = actors + [rollout]
    try:
        # CheckpointEngineManager.build_process_group
        metadata = [e.prepare() for e in engines]
        actor_kw, rollout_kw = type(rollout).build_topology(2, 1, metadata)
        assert all(len(v) == 2 for v in actor_kw.values()) and all(len(v) == 1 for v in rollout_kw.values())
        for i, e in enumerate(actors):
            e.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
        rollout.init_process_group(**{k: v[0] for k, v in rollout_kw.items()})
        assert rollout.wire_format == "named_tensors"

        trainer = _state(0)  # fp32 masters; the stream carries bf16
        served = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in trainer.items()}  # the rollout engine
        consumed = [0, 0]

        def per_tensor_param(rank: int):  # verl's get_per_tensor_param(): a generator every rank iterates
            for n, t in trainer.items():
                consumed[rank] += 1
                yield n, t

        async def load(global_steps: int) -> list[str]:  # the server adapter's update_weights(named_tensors)
            names = []
            async for n, t in rollout.receive_weights(global_steps=global_steps):
                served[n].copy_(t)
                names.append(n)
            return names

        for step in range(3):
            if step:
                with torch.no_grad():
                    for n in list(trainer)[:2]:  # a step that changes 2 of the 6 tensors
                        trainer[n].add_(torch.randn(trainer[n].shape) * 1e-2)
            metrics = await asyncio.gather(*(a.send_weights(per_tensor_param(r), global_steps=step)
                                             for r, a in enumerate(actors)))
            names = await load(step)
            assert metrics[1] == {} and metrics[0]["deltasync/version"] == step, metrics
            assert consumed == [6 * (step + 1)] * 2, "a trainer rank did not iterate verl's generator"
            assert sorted(names) == sorted(trainer if step == 0 else list(trainer)[:2]), (step, names)
            for n, t in trainer.items():
                assert torch.equal(served[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), (step, n)
        for e in engines:
            e.finalize()

        # bounded: a step nobody publishes
        rollout.timeout = 1.0
        with pytest.raises(dv.SyncTimeout, match="waiting for v9"):
            await load(9)
    finally:
        for e in engines:
            e.shutdown()
        server.stop()
