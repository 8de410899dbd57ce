"""Serving-format streams over a real gloo group (torch.multiprocessing spawn, TP=2): each rank holds the FP8
block or INT4 tensors the serving layout map places (deltasync.quantlayout), follows deltas of a real AdamW
trace's quantized states through its ShardedApplier, and every rank rolls back together when one rank's patch
fails half-way, or when one rank holds a word the stream does not say it holds (a mismatched base, caught by the
full check); then the
steps apply on every rank and each ends holding exactly the final quantized state's placement."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.multiprocessing as mp

from deltasync import quant
from deltasync.layout import ModelFacts, Parallel, vllm_layout
from deltasync.quantlayout import constant_values, serving_layout

FACTS = ModelFacts(layers=1, hidden=256, heads=2, kv_heads=2, head_dim=128, intermediate=512, vocab=100)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def place(layout, state) -> dict[str, torch.Tensor]:
    """A rank's parameters filled from a whole serving state through the map (what the engine's loader does)."""
    params = {n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, (dt, shape) in layout.params.items()}
    for n, v in constant_values(layout).items():
        params[n] = torch.tensor(v, dtype=torch.int64)
    for r in layout.regions:
        src, dst = state[r.source], params[r.param]
        for i in r.dst_index:
            dst = dst[i]
        for d, ((s, k), (t, _)) in enumerate(zip(r.src, r.dst)):
            src, dst = src.narrow(d, s, k), dst.narrow(d, t, k)
        dst.copy_(src)
    return params


def _bits(t):
    return quant._words(t)


def worker(rank: int, world: int, port: int, fmt_name: str, out_dir: str) -> None:
    import datetime
    import os

    import torch.distributed as dist

    import deltasync.diffs
    from deltasync.client.sharded import ShardedApplier, prepare_needed
    from deltasync.codec import EncodeOptions, encode_delta
    from deltasync.errors import DeltaSyncError
    from deltasync.fingerprint import fingerprint_state
    from deltasync.testing.trace import ModelShape, RLTrace

    torch.set_num_threads(1)
    deltasync.diffs.MIN_CELL_WORDS = 16
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fmt = quant.ServingFormat(name=fmt_name)
        bf16 = vllm_layout(FACTS, Parallel(tp_rank=rank, tp_size=world))
        layout = serving_layout(bf16, fmt)
        tr = RLTrace(ModelShape(vocab=FACTS.vocab, hidden=FACTS.hidden, layers=1, ffn=FACTS.intermediate),
                     lr=3e-4, seed=4)
        names = {n: s for n, (_, s) in bf16.stream.items()}
        states = []
        for _ in range(3):
            st = tr.step()
            st = {n: st[n] for n in names}
            states.append(quant.serving_state(st, fmt))
        opts = EncodeOptions(chunk_words=256, blob_target=4096, cell_blob_min=1)
        encs = [encode_delta(a, b, model="m", version=i + 1, parent=i, options=opts)
                for i, (a, b) in enumerate(zip(states, states[1:]))]
        params = place(layout, states[0])
        app = ShardedApplier(layout, params)
        fps = app.scan()
        assert fps == fingerprint_state(states[0])
        report = {}

        def stage(e, fps, verify="incremental"):
            return app.stage_delta(prepare_needed(e.manifest, e.blobs, app.needed_blobs(e.manifest)), fps, verify=verify)

        before = {n: t.clone() for n, t in params.items()}
        real = app._rankmap

        class Failing:  # the last rank's patch raises half-way (half its tensors written)
            def patch(self, patches, *a, **k):
                items = list(patches.items())
                out = real.patch(dict(items[: len(items) // 2]), *a, **k)
                if rank == world - 1:
                    raise RuntimeError("injected failure on the last rank")
                out.update(real.patch(dict(items[len(items) // 2:]), *a, **k))
                return out

        app._rankmap = Failing()
        try:
            stage(encs[0], fps)
            raise AssertionError("the step should have failed on every rank")
        except DeltaSyncError as e:
            report["injected"] = f"{type(e).__name__}: {e}"
        app._rankmap = real
        for n, t in params.items():
            assert torch.equal(_bits(t), _bits(before[n])), n
        # a mismatched base on rank 0: a word the step changes is not what the stream says rank 0 holds. A step coded
        # as a ULP step moves a wrong word by the right amount, which the incremental check cannot see (a scrub's
        # to find, docs/ARCHITECTURE.md); the full check (verify="full") recomputes the changed tensors and every
        # rank refuses the step
        nxt = place(layout, states[1])
        scale_suffix = "_scale_inv" if fmt_name == "fp8-block" else "_scale"
        tampered = None
        for n in sorted(layout.params, key=lambda n: not n.endswith(scale_suffix)):
            diff = (_bits(params[n]) != _bits(nxt[n])).view(-1).nonzero()
            if len(diff):
                tampered = (n, int(diff[0]))
                break
        assert tampered is not None
        if rank == 0:
            _bits(params[tampered[0]]).view(-1)[tampered[1]] ^= 0x40
        try:
            stage(encs[0], fps, verify="full")
            raise AssertionError("the step should have failed on every rank")
        except DeltaSyncError as e:
            report["mismatch"] = f"{type(e).__name__}: {e}"
        if rank == 0:
            _bits(params[tampered[0]]).view(-1)[tampered[1]] ^= 0x40
        for n, t in params.items():
            assert torch.equal(_bits(t), _bits(before[n])), n
        for e in encs:
            st = stage(e, fps)
            st.commit()
            fps = st.fps
        assert fps == fingerprint_state(states[-1])
        final = place(layout, states[-1])
        for n, t in final.items():
            assert torch.equal(_bits(params[n]), _bits(t)), n
        report["changed"] = [e.manifest.changed_words for e in encs]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fmt", ["fp8-block", "int4"])
def test_serving_stream_commits_or_rolls_back_on_every_rank(tmp_path, fmt):
    mp.spawn(worker, args=(2, _port(), fmt, str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert "injected failure" in reports[1]["injected"] and "another rank" in reports[0]["injected"]
    assert "IntegrityError" in reports[0]["mismatch"] and reports[1]["mismatch"]
    assert all(c > 0 for c in reports[0]["changed"])
