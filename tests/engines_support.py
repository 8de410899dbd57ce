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


def tiny_qwen2_moe_config(*, vocab: int = VOCAB):
    """Qwen2-MoE: 4 routed experts (top 2, intermediate 64: a multiple of the CPU MoE kernel's 32, so vLLM does
    not pad it), a shared expert with its sigmoid gate, q/k/v biases; every layer sparse."""
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, use_sliding_window=False,
    )
    cfg.torch_dtype = DTYPE
    cfg.dtype = DTYPE
    return cfg


def tiny_draft_config(*, vocab: int = VOCAB):
    """A smaller Qwen2 (1 layer, hidden 64, 2 heads of 32 over 2 KV heads) with the target's vocabulary: a
    speculative draft model with weights of its own."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, use_sliding_window=False,
    )
    cfg.torch_dtype = DTYPE
    cfg.dtype = DTYPE
    return cfg


def qwen3_moe128_config(*, vocab: int = VOCAB):
    """Qwen3-MoE at a seed model's expert count, narrow: 128 routed experts per layer (top 8), hidden 64, expert
    intermediate 64 (vLLM-CPU's AMX MoE kernel needs 32 per rank: at TP=2 without EP each rank holds 32 of them),
    2 layers, 4 heads of 32 over 2 KV heads, q/k norms, no shared expert. The stream names the experts per expert
    (``mlp.experts.{e}.gate_proj.weight``), as Hugging Face checkpoints of this family do."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    )
    cfg.torch_dtype = DTYPE
    cfg.dtype = DTYPE
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


ARCHS = {"qwen2": tiny_qwen2_config, "qwen2_moe": tiny_qwen2_moe_config, "draft": tiny_draft_config,
         "qwen3_moe128": qwen3_moe128_config}


class AdamStreamTrainer:
    """fp32 masters under a config's Hugging Face names (experts per expert), stepped by Adam with random
    heavy-tailed gradients and weight decay (AdamW), served as their bf16 cast: at the default lr a step changes
    6-10% of the words, in every expert. No forward pass: for a model whose only test is following the stream bit-exactly (the
    TinyTrainer's transformers model would hold the experts stacked, transformers 5 style)."""

    def __init__(self, cfg, *, seed: int = 0, lr: float = 2e-5, weight_decay: float = 0.01) -> None:
        from types import SimpleNamespace

        from deltasync.layout import ModelFacts
        from engine_loaders import trainer_shapes

        self.model = SimpleNamespace(config=cfg)  # what save_checkpoint reads
        self.lr, self.wd = lr, weight_decay
        self.gen = torch.Generator().manual_seed(seed)
        self.master: dict[str, torch.Tensor] = {}
        for name, shape in trainer_shapes(ModelFacts.from_hf_config(cfg)).items():
            if name.endswith("norm.weight"):
                w = 1.0 + 0.05 * torch.randn(shape, generator=self.gen)
            else:
                w = torch.randn(shape, generator=self.gen) / shape[-1] ** 0.5
            self.master[name] = w
        self.m = {n: torch.zeros_like(w) for n, w in self.master.items()}
        self.v = {n: torch.zeros_like(w) for n, w in self.master.items()}
        self.steps = 0

    def step(self) -> float:
        self.steps += 1
        c1, c2 = 1 - 0.9 ** self.steps, 1 - 0.999 ** self.steps
        with torch.no_grad():
            for n, w in self.master.items():
                g = torch.randn(w.shape, generator=self.gen) * torch.exp(torch.randn(w.shape[0], *([1] * (w.dim() - 1)),
                                                                                     generator=self.gen))
                self.m[n].mul_(0.9).add_(g, alpha=0.1)
                self.v[n].mul_(0.999).addcmul_(g, g, value=0.001)
                w.mul_(1 - self.lr * self.wd).addcdiv_(self.m[n], (self.v[n] / c2).sqrt_().add_(1e-8), value=-self.lr / c1)
        return 0.0

    def state(self) -> dict[str, torch.Tensor]:
        return {n: w.to(DTYPE).contiguous() for n, w in self.master.items()}


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

    def __init__(self, *, seed: int = 0, lr: float = 3e-3, vocab: int = VOCAB, arch: str = "qwen2") -> None:
        import transformers

        torch.manual_seed(seed)
        cls = transformers.Qwen2MoeForCausalLM if arch == "qwen2_moe" else transformers.Qwen2ForCausalLM
        self.model = cls(ARCHS[arch](vocab=vocab)).float()
        # config.save_pretrained (save_checkpoint) writes what the config says; without ``architectures`` vLLM
        # resolves a qwen2_moe config to the pooling Qwen2MoeModel instead of the causal LM
        self.model.config.architectures = [cls.__name__]
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
    prepared: list[dict[str, torch.Tensor]] = field(default_factory=list)  # trained ahead, not yet published
    owns_server: bool = True

    @property
    def url(self) -> str:
        return self.server.url

    def prepare(self, steps: int) -> list[Path]:
        """Train ``steps`` steps ahead and save their checkpoints (versions ``version+1 ..``) without publishing
        them: the next ``publish_step`` calls publish these states in order. Lets a reference engine load the
        checkpoints of steps the live engine has not received yet. Returns the checkpoint directories."""
        out = []
        for _ in range(steps):
            self.trainer.step()
            state = self.trainer.state()
            v = self.version + 1 + len(self.prepared)
            self.checkpoints[v] = save_checkpoint(self.trainer.model, state, self.workdir / f"ckpt-v{v}")
            self.prepared.append(state)
            out.append(self.checkpoints[v])
        return out

    def publish_step(self, *, train: bool = True, timeout: float = 60.0) -> int:
        """Train one step (unless ``train=False``: version 0 is the initial weights; or take the next state
        :meth:`prepare` trained ahead), publish it as the next version, wait for its commit, and save its
        checkpoint. Returns the version."""
        v = self.version + 1
        if self.prepared:
            state = self.prepared.pop(0)
        else:
            if train:
                self.trainer.step()
            state = self.trainer.state()
            self.checkpoints[v] = save_checkpoint(self.trainer.model, state, self.workdir / f"ckpt-v{v}")
        result = self.publisher.publish(v, state).result(timeout)
        self.results[v] = result
        self.version = v
        return v

    def close(self) -> None:
        try:
            self.publisher.close()
        finally:
            if self.owns_server:
                self.server.stop()


def start_train_run(workdir: Path, *, model_name: str = "tiny-qwen2", seed: int = 0, arch: str = "qwen2",
                    server: ServerProc | None = None, options=None) -> TrainRun:
    """An origin (signing key on) on 127.0.0.1 (or ``server``: a second stream on a run's origin) and a
    publisher over a fresh tiny trainer of ``arch`` (see ARCHS); version 0 (the initial weights, a keyframe)
    is published and checkpointed before it returns. Closing the run stops the server it started. ``options``:
    the publisher's EncodeOptions (its coding)."""
    workdir.mkdir(parents=True, exist_ok=True)
    own = server is None
    if own:
        server = origin(workdir, key=True).start().wait_ready()
    try:
        trainer = (AdamStreamTrainer(ARCHS[arch](), seed=seed) if arch == "qwen3_moe128"
                   else TinyTrainer(seed=seed, arch=arch))
        pub = Publisher(server.url, model_name, TOKEN, KEY, keyframe_every=0, options=options)
    except BaseException:
        if own:
            server.stop()
        raise
    run = TrainRun(workdir=workdir, model_name=model_name, server=server, trainer=trainer, publisher=pub, owns_server=own)
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
