"""Tied weights (issue 24): the README's ``ThreadedSubscriber(urls, "policy", model, verifier=key)`` on an ``nn.Module``
whose ``lm_head.weight`` IS ``model.embed_tokens.weight`` (shared storage), against a real origin on loopback.

The stream is published both ways: the whole ``state_dict()`` (both names), and without the tied copy, as
Hugging Face's ``save_pretrained`` writes checkpoints (either name left out). The live module follows it
bit for bit and its tie survives; a restart with a trusted ``version=`` adopts the live state without a
keyframe; a left-out name that shares memory with nothing the stream carries is refused, naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deltasync.cli.cluster import LocalCluster
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.errors import BaseMismatchError

KEY = bytes(range(7, 39))
VOCAB, HIDDEN = 96, 16


class TinyLM(nn.Module):
    """Named like a Hugging Face causal LM; ``tie`` shares the embedding with the output head."""

    def __init__(self, *, tie: bool) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.model.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(self.model.embed_tokens(ids)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("tied"), key=KEY)
    try:
        c.start_origin()
        yield c
    finally:
        c.close()


def _train(trainer: TinyLM, opt, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(seed))
    loss = nn.functional.cross_entropy(trainer(ids).flatten(0, 1), ids.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()


def _published(trainer: TinyLM, leave_out: str | None) -> dict[str, torch.Tensor]:
    """The bf16 state a step publishes (from fp32 masters), optionally without one tied name."""
    state = {n: t.detach().to(torch.bfloat16) for n, t in trainer.state_dict().items()}
    if leave_out is not None:
        del state[leave_out]
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16)


@pytest.mark.parametrize("leave_out", [None, "lm_head.weight", "model.embed_tokens.weight"],
                         ids=["whole-state-dict", "save-pretrained-style", "embedding-left-out"])
def test_a_tied_module_follows_the_stream_published_with_or_without_the_tied_copy(cluster, leave_out):
    model = f"tied-{leave_out or 'all'}".replace(".", "-")
    torch.manual_seed(0)
    trainer = TinyLM(tie=True)
    opt = torch.optim.AdamW(trainer.parameters(), lr=3e-3)
    torch.manual_seed(1)
    live = TinyLM(tie=True).to(torch.bfloat16)  # random: everything comes from the stream
    assert live.lm_head.weight.data_ptr() == live.model.embed_tokens.weight.data_ptr()
    with Publisher(cluster.origin, model, cluster.token, KEY, keyframe_every=0) as pub:
        with ThreadedSubscriber(cluster.origin, model, live, verifier=KEY, use_squash=False) as sub:  # the README's call
            for step in range(4):  # v0 a keyframe, then deltas
                _train(trainer, opt, step)
                pub.publish(step, _published(trainer, leave_out))
                pub.flush(60)
                assert sub.sync(60) == step
                want = _published(trainer, None)
                for n, t in live.state_dict().items():
                    assert torch.equal(_bits(t), _bits(want[n])), (step, n)
            assert sub.status.verify == "ok" and sub.status.rollbacks == 0
        assert live.lm_head.weight.data_ptr() == live.model.embed_tokens.weight.data_ptr()  # still one tensor
        # a restart that trusts the live state: adopted by a scan (no keyframe), then it follows on
        with ThreadedSubscriber(cluster.origin, model, live, verifier=KEY, version=3) as sub:
            assert sub.version == 3 and sub.status.verify == "ok"
            _train(trainer, opt, 4)
            pub.publish(4, _published(trainer, leave_out))
            pub.flush(60)
            assert sub.wait_version(4, 60) == 4
            assert sub.status.bytes_received < 20_000  # a delta, not the model again
        want = _published(trainer, None)
        for n, t in live.state_dict().items():
            assert torch.equal(_bits(t), _bits(want[n])), n


def test_an_untied_target_the_stream_lacks_a_name_of_is_refused_naming_the_fix(cluster):
    torch.manual_seed(0)
    trainer = TinyLM(tie=True)
    live = TinyLM(tie=False).to(torch.bfloat16)  # lm_head has memory of its own: nothing can fill it
    before = {n: t.clone() for n, t in live.state_dict().items()}
    with Publisher(cluster.origin, "untied", cluster.token, KEY) as pub:
        pub.publish(0, _published(trainer, "lm_head.weight"))
        pub.flush(60)
        with ThreadedSubscriber(cluster.origin, "untied", live, verifier=KEY) as sub:
            with pytest.raises(BaseMismatchError) as e:
                sub.sync(60)
    msg = str(e.value)
    assert "['lm_head.weight']" in msg and "share memory with no tensor" in msg
    assert "publish the full state_dict()" in msg and "tie_weights()" in msg
    for n, t in live.state_dict().items():
        assert torch.equal(_bits(t), _bits(before[n])), n  # nothing was written


def test_a_target_lacking_a_stream_tensor_is_refused_naming_engine_appliers(cluster):
    torch.manual_seed(0)
    trainer = TinyLM(tie=True)
    state = _published(trainer, None)
    state["model.extra.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    live = TinyLM(tie=True).to(torch.bfloat16)
    with Publisher(cluster.origin, "extra", cluster.token, KEY) as pub:
        pub.publish(0, state)
        pub.flush(60)
        with ThreadedSubscriber(cluster.origin, "extra", live, verifier=KEY) as sub:
            with pytest.raises(BaseMismatchError) as e:
                sub.sync(60)
    assert "['model.extra.weight'] the target lacks" in str(e.value) and "hf_applier" in str(e.value)
