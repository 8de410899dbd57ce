"""Support for the real-engine tests: a tiny Qwen2 built locally, a few AdamW steps, every step
published to a real origin on loopback, and each step's Hugging Face checkpoint kept on disk.

Nothing here imports an inference engine; ``transformers`` is imported lazily (it is only in
the engine venv, ``make venv-vllm``). No network: the model is built from a config with random
weights and saved with ``save_pretrained``; prompts are token ids (no tokenizer).

The tiny model has the traits that break naive layout maps: vocab 200 (not a multiple of 64, so
engines pad it), 4 attention heads over 2 KV heads (KV heads replicated once TP > 2), q/k/v biases
(Qwen2 has them), untied ``lm_head``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltasync.client.publisher import Publisher, PublishResult

from server_fixtures import KEY, TOKEN, ServerProc, origin

VOCAB = 200
HIDDEN = 128  # 4 heads of 32: a head size every CPU attention backend supports
HEADS = 4
KV_HEADS = 2
LAYERS = 2
INTERMEDIATE = 256
DTYPE = torch.bfloat16  # what the engine serves and the stream carries; the trainer keeps fp32 masters


def tiny_qwen2_config(*, vocab: int = VOCAB):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
        tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        use_sliding_window=False,
    )
    cfg.torch_dtype = DTYPE  # older transformers read torch_dtype, newer ones dtype
    cfg.dtype = DTYPE
    return cfg


def serving_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state the trainer publishes: its fp32 masters cast to the serving dtype, under HF names."""
    return {n: t.detach().to(DTYPE).contiguous() for n, t in model.state_dict().items()}


def save_checkpoint(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path) -> Path:
    """An HF checkpoint directory (config.json + model.safetensors) holding ``state`` exactly."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    from safetensors.torch import save_file

    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    # vLLM reads generation defaults from here; keep them neutral and local.
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


class TinyTrainer:
    """A tiny Qwen2 and its AdamW optimizer on fixed random token batches (deterministic)."""

    def __init__(self, *, seed: int = 0, lr: float = 3e-3, vocab: int = VOCAB) -> None:
        from transformers import Qwen2ForCausalLM

        torch.manual_seed(seed)
        self.model = Qwen2ForCausalLM(tiny_qwen2_config(vocab=vocab)).float()
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        g = torch.Generator().manual_seed(seed + 1)
        self.batches = [torch.randint(3, vocab, (4, 24), generator=g) for _ in range(4)]
        self.steps = 0

    def step(self) -> float:
        batch = self.batches[self.steps % len(self.batches)]
        out = self.model(input_ids=batch, labels=batch)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        self.opt.step()
        self.steps += 1
        return float(out.loss.detach())

    def state(self) -> dict[str, torch.Tensor]:
        return serving_state(self.model)


@dataclass(slots=True, kw_only=True)
class TrainRun:
    """A trainer publishing every step to a real origin; ``checkpoints[v]`` is version v's HF dir."""

    workdir: Path
    model_name: str
    server: ServerProc
    trainer: TinyTrainer
    publisher: Publisher
    checkpoints: dict[int, Path] = field(default_factory=dict)
    results: dict[int, PublishResult] = field(default_factory=dict)
    version: int = -1

    @property
    def url(self) -> str:
        return self.server.url

    def publish_step(self, *, train: bool = True, timeout: float = 60.0) -> int:
        """Train one step (unless ``train=False``: version 0 is the initial weights), publish it as the
        next version, wait for its commit, and save its checkpoint. Returns the version."""
        if train:
            self.trainer.step()
        state = self.trainer.state()
        v = self.version + 1
        result = self.publisher.publish(v, state).result(timeout)
        self.results[v] = result
        self.checkpoints[v] = save_checkpoint(self.trainer.model, state, self.workdir / f"ckpt-v{v}")
        self.version = v
        return v

    def close(self) -> None:
        try:
            self.publisher.close()
        finally:
            self.server.stop()


def start_train_run(workdir: Path, *, model_name: str = "tiny-qwen2", seed: int = 0) -> TrainRun:
    """An origin (signing key on) on 127.0.0.1 and a publisher over a fresh tiny trainer; version 0
    (the initial weights, a keyframe) is published and checkpointed before it returns."""
    workdir.mkdir(parents=True, exist_ok=True)
    server = origin(workdir, key=True).start().wait_ready()
    try:
        trainer = TinyTrainer(seed=seed)
        pub = Publisher(server.url, model_name, TOKEN, KEY, keyframe_every=0)
    except BaseException:
        server.stop()
        raise
    run = TrainRun(workdir=workdir, model_name=model_name, server=server, trainer=trainer, publisher=pub)
    run.publish_step(train=False)
    return run


def wait_until(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
