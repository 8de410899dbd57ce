"""The Applier seam and LiveState on real tensors: staged apply, subset prepare, signed-state checks."""

from __future__ import annotations

import pytest
import torch

from deltasync.apply import apply_prepared, prepare_delta, stage_prepared
from deltasync.codec import EncodeOptions, encode_delta
from deltasync.errors import FormatError
from deltasync.fingerprint import fingerprint_state
from deltasync.client.appliers import Applier, TensorApplier, as_applier
from deltasync.client.livestate import LiveState
from deltasync.client.ready import ReadyStep


def _states(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = {n: torch.randn(64, 32, generator=g).to(torch.bfloat16) for n in ("a", "b", "c")}
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        t.view(torch.int16)[::3] += 1
    return old, new


def _bits(state):
    return {n: t.view(torch.int16).clone() for n, t in state.items()}


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def _encoded(old, new, **opts):
    return encode_delta(old, new, model="m", version=1, parent=0, options=EncodeOptions(**opts))


def test_stage_then_rollback_restores_every_word_and_commit_keeps_them():
    old, new = _states()
    enc = _encoded(old, new)
    live = {n: t.clone() for n, t in old.items()}
    before = _bits(live)
    staged = stage_prepared(live, prepare_delta(enc.manifest, enc.blobs))
    assert _same(live, new) and staged.fps == fingerprint_state(new)
    staged.rollback()
    assert _same(live, old) and all(torch.equal(before[n], live[n].view(torch.int16)) for n in live)
    staged.rollback()  # idempotent
    assert _same(live, old)
    staged = stage_prepared(live, prepare_delta(enc.manifest, enc.blobs))
    staged.commit()
    staged.rollback()  # after commit: nothing to undo
    assert _same(live, new)
    # the one-shot API is unchanged
    live2 = {n: t.clone() for n, t in old.items()}
    assert apply_prepared(live2, prepare_delta(enc.manifest, enc.blobs)) == fingerprint_state(new)


def test_prepare_a_subset_of_blobs_leaves_whole_tensors_out():
    old, new = _states(1)
    enc = _encoded(old, new, blob_target=64)  # about one blob per tensor
    assert len(enc.manifest.blobs) >= 3
    owner = {c.blob: r.name for r in enc.manifest.tensors for c in r.chunks}
    only = {bid for bid, name in owner.items() if name == "a"}
    prepared = prepare_delta(enc.manifest, {b: enc.blobs[b] for b in only}, only=only)
    assert set(prepared.patches) == {"a"} and prepared.skipped == {"b", "c"}
    full = prepare_delta(enc.manifest, enc.blobs)
    assert full.skipped == frozenset() and set(full.patches) == {"a", "b", "c"}
    with pytest.raises(FormatError, match="no blobs"):
        prepare_delta(enc.manifest, enc.blobs, only={"0" * 64})


def test_prepare_a_subset_that_splits_a_tensor_is_refused():
    old, new = _states(2)
    enc = _encoded(old, new, chunk_words=256, blob_target=32)  # each tensor spread over several blobs
    rec = enc.manifest.tensor("a")
    blobs = sorted({c.blob for c in rec.chunks})
    assert len(blobs) >= 2
    from dataclasses import replace as _replace

    unspanned = _replace(enc.manifest, meta={})  # no chunk spans recorded (an older writer, a squash)
    with pytest.raises(FormatError, match="only= leaves out"):
        prepare_delta(unspanned, enc.blobs, only={blobs[0]})


def test_prepare_a_subset_of_a_tensor_with_chunk_spans_checks_each_chunk_against_its_span():
    from dataclasses import replace as _replace

    from deltasync.codec import SPANS_META_PREFIX

    old, new = _states(2)
    enc = _encoded(old, new, chunk_words=256, blob_target=32)
    rec = enc.manifest.tensor("a")
    first = rec.chunks[0].blob
    got = prepare_delta(enc.manifest, enc.blobs, only={first})
    assert [(p.start, p.stop) for p in got.patches["a"]][:1] == [(0, 256)]
    assert all(p.stop <= 2048 for p in got.patches["a"])
    lying = dict(enc.manifest.meta)
    spans = lying[SPANS_META_PREFIX + "a"].split(",")
    spans[0] = "0:255"
    lying[SPANS_META_PREFIX + "a"] = ",".join(spans)
    with pytest.raises(FormatError, match="recorded span"):
        prepare_delta(_replace(enc.manifest, meta=lying), enc.blobs, only={first})


def test_tensor_applier_layout_scan_and_duck_typing():
    old, _ = _states(3)
    ta = as_applier(old)
    assert isinstance(ta, TensorApplier) and isinstance(ta, Applier)
    assert ta.layout() == {n: ("bfloat16", (64, 32)) for n in old}
    assert ta.scan() == fingerprint_state(old)
    assert as_applier(ta) is ta  # anything with stage_delta is used as it is
    with pytest.raises(TypeError):
        as_applier([1, 2])


def _step(enc, state_fp: str, generation: int = 0) -> ReadyStep:
    return ReadyStep(kind="delta", version=1, base=0, state_fp=state_fp, manifest=enc.manifest, generation=generation,
                     prepared=prepare_delta(enc.manifest, enc.blobs))


def test_live_state_applies_when_the_signed_state_matches():
    old, new = _states(4)
    enc = _encoded(old, new)
    live = {n: t.clone() for n, t in old.items()}
    ls = LiveState(TensorApplier(live), version=0)
    ls.fps = fingerprint_state(old)
    out = ls.apply(_step(enc, enc.manifest.state_fp))
    assert out.applied and out.failure is None and [t.kind for t in out.told] == ["applied"]
    assert ls.version == 1 and ls.fps == fingerprint_state(new) and _same(live, new) and ls.verify_state == "ok"


def test_live_state_rolls_back_a_delta_that_does_not_reach_the_signed_state():
    old, new = _states(5)
    enc = _encoded(old, new)
    live = {n: t.clone() for n, t in old.items()}
    ls = LiveState(TensorApplier(live), version=0)
    ls.fps = fingerprint_state(old)
    out = ls.apply(_step(enc, "0" * 16))  # e.g. an unsigned squashed delta that leads elsewhere
    assert not out.applied and out.failure == "integrity" and out.told[0].kind == "rollback"
    assert _same(live, old) and ls.version == 0 and ls.counts["rollbacks"] == 1 and ls.verify_state == "rolled-back"


def test_live_state_refuses_a_delta_for_another_base():
    old, new = _states(6)
    enc = _encoded(old, new)
    ls = LiveState(TensorApplier({n: t.clone() for n, t in old.items()}), version=5)
    ls.fps = fingerprint_state(old)
    out = ls.apply(_step(enc, enc.manifest.state_fp))
    assert out.failure == "base_mismatch" and "live state is v5" in out.told[0].detail


def test_live_state_scrub_finds_a_scribble():
    old, _ = _states(7)
    live = {n: t.clone() for n, t in old.items()}
    ls = LiveState(TensorApplier(live), version=0, scrub_every=1)
    assert ls.adopt(0, None) is False and ls.version is None  # the servers no longer know v0
    ls.version, ls.fps = 0, fingerprint_state(old)
    told = []
    assert ls.scrub(told) is None and "all 3" in told[-1].detail
    live["b"].view(torch.int16)[0] ^= 1
    assert ls.scrub(told) == "scrub" and ls.verify_state == "mismatch" and "['b']" in told[-1].detail


# -- a dict target's layout kept from step to step (TensorApplier._layout) -------------------------

def _many(seed: int, n: int = 300):
    """``n`` small bf16 tensors and a ~1%-changed step of them (enough tensors for the columnar paths)."""
    g = torch.Generator().manual_seed(seed)
    old = {f"layers.{i}.w": torch.randn(16, 16, generator=g).to(torch.bfloat16) for i in range(n)}
    new = {k: t.clone() for k, t in old.items()}
    for t in new.values():
        t.view(torch.int16).view(-1)[::37] += 1
    return old, new


def _parsed_step(old, new, version):
    from deltasync.manifest import parse_manifest

    enc = encode_delta(old, new, model="m", version=version, parent=version - 1)
    m = parse_manifest(enc.manifest.compact().to_json())  # what a subscriber parses: format 3, a table
    return ReadyStep(kind="delta", prepared=prepare_delta(m, enc.blobs), version=version, base=version - 1,
                     state_fp=m.state_fp, manifest=m, generation=0, nbytes=0, squashed=False)


def test_a_dict_targets_layout_is_kept_between_steps_and_made_again_when_a_tensor_is_replaced(monkeypatch):
    from deltasync.client import appliers

    a, b = _many(5)
    target = {n: t.clone() for n, t in a.items()}
    ap = TensorApplier(target)
    live = LiveState(ap, version=0)
    live.fps = fingerprint_state(a)
    asked = []
    real = appliers._Layout.addresses
    monkeypatch.setattr(appliers._Layout, "addresses",
                        lambda self, names: asked.append(len(names)) or real(self, names))

    assert live.apply(_parsed_step(a, b, 1)).applied and _same(target, b)
    kept = ap._kept
    assert kept is not None and asked  # the patch took the kept addresses
    assert live.apply(_parsed_step(b, a, 2)).applied and _same(target, a)
    assert ap._kept is kept  # the same tensors: the layout was not made again

    # one tensor replaced by a copy (another address): the layout is made again and the step lands in the copy,
    # not in the memory of the tensor it replaced
    old_t = target["layers.7.w"]
    target["layers.7.w"] = old_t.clone()
    old_bits = old_t.view(torch.int16).clone()
    assert live.apply(_parsed_step(a, b, 3)).applied and _same(target, b)
    assert ap._kept is not kept
    assert torch.equal(old_t.view(torch.int16), old_bits)  # the replaced tensor was not written

    # a square tensor replaced by its transpose (same address, dtype and shape; other strides): the layout is made
    # again, and the step does to the target exactly what it does to a target never seen before
    kept = ap._kept
    name = "layers.9.w"
    twin = {n: t.clone() for n, t in target.items()}
    target[name] = target[name].t()
    twin[name] = twin[name].t()
    step = _parsed_step(b, a, 4)
    got = live.apply(step)
    assert ap._kept is not kept
    fresh = LiveState(TensorApplier(twin), version=3)
    fresh.fps = fingerprint_state(b)
    want = fresh.apply(step)
    assert got.applied == want.applied
    assert all(torch.equal(target[n].contiguous().view(torch.int16), twin[n].contiguous().view(torch.int16))
               for n in target)


def test_state_lines_of_a_dict_target_give_the_state_fingerprint():
    from deltasync.fingerprint import state_fingerprint

    a, _ = _many(6, 40)
    ap = TensorApplier({n: t.clone() for n, t in a.items()})
    names, lines = ap.state_lines()
    fps = fingerprint_state(a)
    import numpy as np

    have = np.array([fps[n] for n in names], np.uint64)
    assert lines.digest(have) == state_fingerprint((n, "bfloat16", tuple(a[n].shape), fps[n]) for n in a)
