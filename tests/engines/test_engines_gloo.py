"""Cross-rank verify / commit / rollback over real gloo process groups (torch.multiprocessing spawn).

Each rank holds the layout vLLM would give it (its parameters come from the reproduced loader
arithmetic in tests/engine_loaders.py), follows deltas through its own ShardedApplier with only the
blobs it needs, and one rank fails half-way through patching a step (an injected exception): every
rank must raise and end bit-exact at the previous version; the step then applies on every rank and
each ends byte-identical to the engine's loader fed the final weights."""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp

from engine_loaders import gloo_worker


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world,facts,ep", [(2, "qwen2", 1), (4, "qwen2", 1), (2, "mixtral", 2)],
                         ids=["tp2-dense", "tp4-dense-replicated-kv", "ep2-moe"])
def test_group_commits_or_rolls_back_together(tmp_path, world, facts, ep):
    mp.spawn(gloo_worker, args=(world, _port(), facts, ep, str(tmp_path)), nprocs=world, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    errors = [r["error"] for r in reports]
    assert "injected failure" in errors[-1]
    assert all("another rank" in e for e in errors[:-1])
    for r in reports:
        assert all(f <= t for f, t in zip(r["fetched"], r["total"]))
    assert any(f < t for r in reports for f, t in zip(r["fetched"], r["total"]))
