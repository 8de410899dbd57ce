"""A live Hugging Face ``transformers`` model (real ``Qwen2ForCausalLM``, tiny config, tied embeddings) follows a
stream the sidecar publishes from its own ``save_pretrained`` checkpoints.

``save_pretrained`` leaves the tied ``lm_head.weight`` out of the file; the live model generates between applies;
after the last apply its logits are bit-identical to a fresh ``from_pretrained`` of the last checkpoint. Needs
transformers (installed with the ``vllm`` extra): runs under ``make test-engines``, skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test-engines has it)")

from deltasync.cli.cluster import LocalCluster  # noqa: E402
from deltasync.client.hf import hf_applier  # noqa: E402
from deltasync.client.sidecar import Sidecar  # noqa: E402
from deltasync.client.subscriber import ThreadedSubscriber  # noqa: E402

pytestmark = pytest.mark.engine

VOCAB = 100  # not a multiple of 64


def tiny_config():
    return transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=True, torch_dtype="bfloat16")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("hf-tf"))
    try:
        c.start_origin()
        yield c
    finally:
        c.close()


def test_live_transformers_model_follows_its_save_pretrained_stream(cluster, tmp_path):
    torch.manual_seed(0)
    trainer = transformers.Qwen2ForCausalLM(tiny_config())  # fp32 master weights
    opt = torch.optim.AdamW(trainer.parameters(), lr=3e-3)
    torch.manual_seed(99)
    # built the way from_pretrained builds it (bf16 parameters, fp32 rotary buffers), random: all from the stream
    live = transformers.Qwen2ForCausalLM._from_config(tiny_config(), torch_dtype=torch.bfloat16).eval()
    assert live.lm_head.weight.data_ptr() == live.model.embed_tokens.weight.data_ptr()
    applier = hf_applier(live)
    saver = transformers.Qwen2ForCausalLM._from_config(tiny_config(), torch_dtype=torch.bfloat16)
    watch = tmp_path / "watch"
    watch.mkdir()
    car = Sidecar(watch, cluster.origin, "hf-tf", cluster.token, keyframe_every=3)
    data = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    prompt = torch.tensor([[1, 2, 3]])
    loop = asyncio.new_event_loop()
    outputs = []
    try:
        with ThreadedSubscriber(cluster.origin, "hf-tf", applier, use_squash=False) as sub:
            for step in range(1, 5):
                loss = trainer(input_ids=data, labels=data).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                out = tmp_path / f"ckpt-{step}"
                saver.load_state_dict(trainer.state_dict())  # the bf16 checkpoint of the fp32 masters
                saver.save_pretrained(out, safe_serialization=True)
                shutil.copy(out / "model.safetensors", watch / f"step-{step}.safetensors")
                loop.run_until_complete(car.scan())
                assert sub.sync(60) == step
                with torch.no_grad():  # serving between applies
                    outputs.append(live.generate(prompt, max_new_tokens=5, do_sample=False))
    finally:
        loop.run_until_complete(car.close())
        loop.close()
    from safetensors import safe_open

    with safe_open(str(watch / "step-4.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # what save_pretrained writes: the tied copy is left out
    fresh = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "ckpt-4", torch_dtype=torch.bfloat16).eval()
    for (n, x), (_, y) in zip(live.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), n
    with torch.no_grad():
        a, b = live(input_ids=data).logits, fresh(input_ids=data).logits
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert torch.equal(outputs[-1], fresh.generate(prompt, max_new_tokens=5, do_sample=False))
    assert live.lm_head.weight.data_ptr() == live.model.embed_tokens.weight.data_ptr()  # still one tensor


@pytest.mark.parametrize("written_by", ["save_pretrained", "state_dict"])
def test_the_readme_subscriber_call_on_a_plain_transformers_model(cluster, tmp_path, written_by):
    """Issue 24: ``ThreadedSubscriber(urls, "policy", model)`` with the model itself (no ``hf_applier``), the stream
    published from ``save_pretrained``'s files (no ``lm_head.weight``) or from the whole ``state_dict()``."""
    from safetensors.torch import load_file

    from deltasync.client.publisher import Publisher

    model = f"hf-readme-{written_by}".replace("_", "-")
    torch.manual_seed(0)
    trainer = transformers.Qwen2ForCausalLM(tiny_config())
    opt = torch.optim.AdamW(trainer.parameters(), lr=3e-3)
    torch.manual_seed(98)
    live = transformers.Qwen2ForCausalLM._from_config(tiny_config(), torch_dtype=torch.bfloat16).eval()
    saver = transformers.Qwen2ForCausalLM._from_config(tiny_config(), torch_dtype=torch.bfloat16)
    data = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    with Publisher(cluster.origin, model, cluster.token, keyframe_every=0) as pub:
        with ThreadedSubscriber(cluster.origin, model, live, use_squash=False) as sub:  # the README's call
            for step in range(3):
                loss = trainer(input_ids=data, labels=data).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                saver.load_state_dict(trainer.state_dict())
                if written_by == "save_pretrained":
                    saver.save_pretrained(tmp_path / f"ckpt-{step}", safe_serialization=True)
                    state = load_file(str(tmp_path / f"ckpt-{step}" / "model.safetensors"))
                    assert "lm_head.weight" not in state
                else:
                    state = {n: t.detach().clone() for n, t in saver.state_dict().items()}
                    assert "lm_head.weight" in state
                pub.publish(step, state)
                pub.flush(60)
                assert sub.sync(60) == step
    for (n, x), (_, y) in zip(live.state_dict().items(), saver.state_dict().items()):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), n
    with torch.no_grad():
        assert torch.equal(live(input_ids=data).logits.view(torch.int16), saver(input_ids=data).logits.view(torch.int16))
    assert live.lm_head.weight.data_ptr() == live.model.embed_tokens.weight.data_ptr()
