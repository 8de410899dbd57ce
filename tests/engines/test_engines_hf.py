"""A live Hugging Face-style model follows a stream published by the sidecar from its own checkpoint files.

transformers is not installed in this environment, so the model is a tiny ``nn.Module`` with Hugging Face
naming and tied embeddings (``lm_head.weight`` is ``model.embed_tokens.weight``), written like
transformers' Llama (RMSNorm, causal attention, SwiGLU MLP). Its checkpoints omit the tied copy, as
``save_pretrained`` does. The live model generates between applies; after the last apply its logits are
bit-identical to a fresh model loaded from the last checkpoint file."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from deltasync.cli.cluster import LocalCluster
from deltasync.client.hf import hf_applier
from deltasync.client.sidecar import Sidecar
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.errors import BaseMismatchError
from deltasync.tensorfile import write_state_file

V, H, F, L, HEADS = 96, 32, 64, 2, 4


class RMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(H)
        self.post_attention_layernorm = RMSNorm(H)
        self.self_attn = nn.Module()
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.self_attn, n, nn.Linear(H, H, bias=False))
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, F, bias=False)
        self.mlp.up_proj = nn.Linear(H, F, bias=False)
        self.mlp.down_proj = nn.Linear(F, H, bias=False)

    def forward(self, x):
        a = self.self_attn
        h = self.input_layernorm(x)
        b, t, _ = h.shape
        q, k, v = (p(h).view(b, t, HEADS, H // HEADS).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, H))
        h = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m.down_proj(torch.nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))


class TinyTiedLM(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H)
        self.model.layers = nn.ModuleList(Block() for _ in range(L))
        self.model.norm = RMSNorm(H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tie_word_embeddings

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for blk in self.model.layers:
            x = blk(x)
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def generate(self, ids, n: int):
        for _ in range(n):
            ids = torch.cat([ids, self(ids)[:, -1:].argmax(-1)], dim=1)
        return ids


def checkpoint(model: TinyTiedLM) -> dict[str, torch.Tensor]:
    """What save_pretrained writes: bf16, without the tied lm_head.weight."""
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("hf"))
    try:
        c.start_origin()
        yield c
    finally:
        c.close()


def test_live_hf_model_follows_its_checkpoint_stream(cluster, tmp_path):
    trainer = TinyTiedLM(seed=0)
    opt = torch.optim.AdamW(trainer.parameters(), lr=3e-3)
    data = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(1))
    live = TinyTiedLM(seed=99).to(torch.bfloat16).eval()
    applier = hf_applier(live)
    assert "lm_head.weight" not in applier.layout() and "model.embed_tokens.weight" in applier.layout()
    car = Sidecar(tmp_path, cluster.origin, "hf", cluster.token, keyframe_every=3)
    prompt = torch.tensor([[1, 2, 3]])
    outputs = []
    loop = asyncio.new_event_loop()  # the sidecar's session lives on one loop
    with ThreadedSubscriber(cluster.origin, "hf", applier, use_squash=False) as sub:
        for step in range(1, 5):
            logits = trainer(data[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), data[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            write_state_file(tmp_path / f"step-{step}.safetensors", checkpoint(trainer))
            loop.run_until_complete(car.scan())
            assert sub.sync(60) == step
            outputs.append(live.generate(prompt, 5))  # serving between applies
    loop.run_until_complete(car.close())
    loop.close()
    fresh = TinyTiedLM(seed=7).to(torch.bfloat16).eval()
    from safetensors.torch import load_file

    missing = fresh.load_state_dict(load_file(tmp_path / "step-4.safetensors"), strict=False)
    assert missing.missing_keys == ["lm_head.weight"]  # tied: loaded through the embedding
    with torch.no_grad():
        a, b = live(data), fresh(data)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.equal(live.lm_head.weight, live.model.embed_tokens.weight)  # still one tensor
    assert torch.equal(outputs[-1], fresh.generate(prompt, 5))


def test_a_stream_with_a_different_tensor_set_is_refused():
    live = TinyTiedLM(seed=1).to(torch.bfloat16)
    with pytest.raises(BaseMismatchError, match="does not have"):
        hf_applier(live, stream=["model.embed_tokens.weight"])
