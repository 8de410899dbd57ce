"""SGLang's custom-weight-loader hook driving deltasync on every TP rank.

No SGLang CPU wheel exists, so the ranks are modules with SGLang's parameter layout reproduced from
its model files (sglang/srt/models/qwen2.py stacked_params_mapping, layers/linear.py,
layers/vocab_parallel_embedding.py; the arithmetic lives in tests/engine_loaders.py), each with a
Hugging Face config, running in threads over an in-process group (``group_for``). The loader function
is called exactly as SGLang's ``update_weights_from_tensor(load_format=...)`` calls it:
``loader(model, named_tensors)``. The stream comes from a real Publisher through a real origin."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import deltasync.client.sglang as sg
from deltasync.cli.cluster import LocalCluster
from deltasync.client.publisher import Publisher
from deltasync.codec import EncodeOptions
from engine_loaders import ThreadGroup, engine_load, run_ranks, trainer_shapes, trainer_steps
from test_layout_engines import DENSE


def module_from(params: dict[str, torch.Tensor], config) -> nn.Module:
    root = nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    root.config = config
    return root


CONFIG = types.SimpleNamespace(model_type="qwen2", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=100,
                               tie_word_embeddings=False)


@pytest.fixture()
def cluster(tmp_path, monkeypatch):
    import deltasync.diffs

    monkeypatch.setattr(deltasync.diffs, "MIN_CELL_WORDS", 16)  # row cells for these tiny tensors too
    c = LocalCluster(tmp_path)
    try:
        c.start_origin()
        yield c
    finally:
        c.close()


def test_loader_hook_follows_the_stream_on_every_rank(cluster, monkeypatch):
    tp = 2
    states = trainer_steps(trainer_shapes(DENSE), 3, seed=4)
    models = [module_from(engine_load(DENSE, states[0], tp, r), CONFIG) for r in range(tp)]
    group = ThreadGroup(tp)
    comms = {id(m): group.comm(r) for r, m in enumerate(models)}
    monkeypatch.setattr(sg, "group_for", lambda model: comms[id(model)])

    def start(r):
        sg.deltasync_weight_loader(models[r], sg.command("start", urls=[cluster.origin], model="sg", tp_rank=r,
                                                         tp_size=tp, start_timeout=30))

    _raise(run_ranks(tp, start))
    opts = EncodeOptions(chunk_words=256, blob_target=4096, cell_blob_min=1)
    with Publisher(cluster.origin, "sg", cluster.token, keyframe_every=0, options=opts) as pub:
        for step, s in enumerate(states[1:], start=1):
            pub.publish(step, s)
        pub.flush(60)

    def wait(r):
        sg.deltasync_weight_loader(models[r], sg.command("wait", version=3, timeout=60))
        return sg.rank_status(models[r])

    status = _raise(run_ranks(tp, wait))
    assert [s["version"] for s in status] == [3, 3]
    for r, m in enumerate(models):
        want = engine_load(DENSE, states[3], tp, r)
        got = dict(m.named_parameters())
        for n, t in want.items():
            assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), (r, n)
    _raise(run_ranks(tp, lambda r: sg.deltasync_weight_loader(models[r], sg.command("stop"))))


def test_commands_are_checked():
    with pytest.raises(ValueError, match="deltasync.command"):
        sg.deltasync_weight_loader(nn.Module(), [("model.norm.weight", torch.zeros(2))])
    with pytest.raises(Exception, match="before 'start'"):
        sg.deltasync_weight_loader(nn.Module(), sg.command("apply"))
    assert sg.read_command(sg.command("wait", version=3)) == ("wait", {"version": 3})


def _raise(res):
    out, errs = res
    for e in sorted((e for e in errs if e is not None), key=lambda e: "Barrier" in type(e).__name__):
        raise e
    return out
