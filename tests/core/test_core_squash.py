"""Squashing a chain v→v+k equals applying it step by step, bit for bit."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.apply import apply_delta
from deltasync.codec import EncodeOptions, decode_blob, encode_delta
from deltasync.dtypes import DTYPES
from deltasync.errors import BaseMismatchError, ChainError
from deltasync.keyframe import encode_keyframe
from deltasync.manifest import parse_manifest
from deltasync.squash import check_chain, compose_changes, squash_chain
from deltasync.values import Changes, apply_changes_np
from core_support import from_words, tensor_bytes, words_of

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
DTYPE_NAMES = sorted(DTYPES)
STEP_KINDS = ("none", "ulp", "revert", "raw", "dense", "sign", "big", "mixed")


def snapshot(state):
    return {n: tensor_bytes(t) for n, t in state.items()}


def copy_state(state):
    return {n: from_words(words_of(t), t.dtype, t.shape) for n, t in state.items()}


def _rand_words(rng, info, n):
    w = np.frombuffer(rng.bytes(n * info.word_size), dtype=f"<u{info.word_size}").copy()
    if info.name == "bool":
        w &= 1
    return w


def next_words(rng, info, hist: list[np.ndarray], kind: str) -> np.ndarray:
    cur = hist[-1]
    new = cur.copy()
    n = cur.size
    if n == 0 or kind == "none":
        return new
    if kind == "dense":
        return _rand_words(rng, info, n)
    if kind == "revert":  # every position the last step changed goes back to what it was before
        if len(hist) >= 2:
            back = hist[-2] != cur
            new[back] = hist[-2][back]
            return new
        kind = "ulp"
    if kind == "mixed":
        kind = str(rng.choice(["ulp", "raw", "sign", "big"]))
    p = rng.choice(n, size=max(1, n // 5), replace=False)
    if info.name == "bool":
        new[p] ^= 1
        return new
    bits = info.word_size * 8
    with np.errstate(over="ignore"):
        if kind == "ulp":
            new[p] += np.where(rng.random(p.size) < 0.5, 1, (1 << bits) - 1).astype(np.uint64).astype(new.dtype)
        elif kind == "big":
            new[p] += rng.integers(1 << (bits // 2), 1 << min(bits - 1, 62), p.size, dtype=np.uint64).astype(new.dtype)
        elif kind == "sign":
            new[p] ^= new.dtype.type(1 << (bits - 1))
        else:
            new[p] = _rand_words(rng, info, p.size)
    return new


def make_chain(seed: int, tensors, kinds_per_step):
    """tensors: [(name, dtype, shape)]; kinds_per_step: [[kind per tensor] per step]. Returns states."""
    rng = np.random.default_rng(seed)
    hists = {}
    for name, dt, shape in tensors:
        info = DTYPES[dt]
        n = int(np.prod(shape, dtype=np.int64)) * info.words_per_element
        hists[name] = [_rand_words(rng, info, n)]
    for kinds in kinds_per_step:
        for (name, dt, _), kind in zip(tensors, kinds):
            hists[name].append(next_words(rng, DTYPES[dt], hists[name], kind))
    states = []
    for i in range(len(kinds_per_step) + 1):
        states.append({name: from_words(hists[name][i], DTYPES[dt].torch_dtype, shape) for name, dt, shape in tensors})
    return states


def encode_chain(states, options=None, model="policy"):
    encs = []
    for i in range(1, len(states)):
        encs.append(encode_delta(states[i - 1], states[i], model=model, version=10 + i, parent=9 + i, options=options))
    blobs = {}
    for e in encs:
        blobs.update(e.blobs)
    return encs, blobs


def check_squash(states, options=None, squash_options=None):
    encs, blobs = encode_chain(states, options)
    manifests = [e.manifest for e in encs]
    sq = squash_chain(manifests, blobs.__getitem__, options=squash_options)
    m = parse_manifest(sq.manifest.to_json())  # a valid manifest
    assert m == sq.manifest
    assert (m.parent, m.version, m.kind) == (manifests[0].parent, manifests[-1].version, "delta")
    assert m.state_fp_before == manifests[0].state_fp_before and m.state_fp == manifests[-1].state_fp
    for rec in m.tensors:
        assert rec.fp_before == manifests[0].tensor(rec.name).fp_before
        assert rec.fp_after == manifests[-1].tensor(rec.name).fp_after
    # sequential
    seq = copy_state(states[0])
    for e in encs:
        apply_delta(seq, e.manifest, e.blobs)
    # squashed
    one = copy_state(states[0])
    apply_delta(one, m, sq.blobs)
    assert snapshot(seq) == snapshot(states[-1])
    assert snapshot(one) == snapshot(seq)
    return m, sq


# -- table ------------------------------------------------------------------------------------------

TENSORS = [("a.bf16", "bfloat16", (40,)), ("b.f32", "float32", (6, 7)), ("c.i8", "int8", (33,)),
           ("d.fp8", "float8_e4m3fn", (5, 5)), ("e.c64", "complex64", (9,)), ("f.bool", "bool", (17,))]


@pytest.mark.parametrize("steps", [
    [["ulp"] * 6, ["ulp"] * 6],
    [["ulp"] * 6, ["revert"] * 6],  # changed then changed back: the squash drops (steps) or keeps (raw) them
    [["raw"] * 6, ["revert"] * 6],
    [["dense"] * 6, ["ulp"] * 6, ["dense"] * 6],
    [["raw"] * 6, ["ulp"] * 6, ["sign"] * 6, ["big"] * 6],
    [["mixed"] * 6, ["mixed"] * 6, ["revert"] * 6, ["none"] * 6, ["mixed"] * 6],
    [["none"] * 6, ["none"] * 6],
    [["ulp", "raw", "dense", "none", "sign", "big"], ["revert", "revert", "ulp", "dense", "raw", "ulp"]],
], ids=["ulp-ulp", "ulp-revert", "raw-revert", "dense-ulp-dense", "raw-ulp-sign-big", "mixed5", "nothing", "per-tensor"])
@pytest.mark.parametrize("options", [None, EncodeOptions(chunk_words=8, blob_target=64)], ids=["default", "small"])
def test_squash_equals_sequential_apply(steps, options):
    states = make_chain(len(steps) * 7 + len(steps[0]), TENSORS, steps)
    check_squash(states, options, options)


def test_step_then_inverse_step_cancels_completely():
    states = make_chain(1, TENSORS[:3], [["ulp"] * 3, ["revert"] * 3])
    assert snapshot(states[2]) == snapshot(states[0])
    m, sq = check_squash(states)
    assert all(r.changed == 0 and r.chunks == () and r.fp_before == r.fp_after for r in m.tensors)
    assert sq.blobs == {} and m.blobs == ()


def test_squash_with_other_chunking_than_the_chain():
    states = make_chain(2, TENSORS, [["mixed"] * 6] * 3)
    check_squash(states, EncodeOptions(chunk_words=5, blob_target=30), EncodeOptions(chunk_words=64, blob_target=10**6))
    check_squash(states, None, EncodeOptions(chunk_words=3, blob_target=16))


def test_squash_changed_counts_words_written_not_words_that_differ():
    """Squash is model-free: it cannot see that a raw word put back the base value, so a squashed record's
    ``changed`` is the number of words the delta *writes*, an upper bound of the words that differ (the
    TensorRecord comment says "words that differ from the base"; see the report)."""
    states = make_chain(3, TENSORS[:2], [["raw"] * 2, ["revert"] * 2])
    assert snapshot(states[0]) == snapshot(states[-1])
    m, sq = check_squash(states)
    patches = {}
    for data in sq.blobs.values():
        for p in decode_blob(data):
            patches[p.tensor] = patches.get(p.tensor, 0) + p.count
    for rec in m.tensors:
        assert rec.fp_before == rec.fp_after
        assert rec.changed == patches.get(rec.name, 0) > 0


def test_squashed_delta_is_refused_on_an_intermediate_state():
    states = make_chain(4, TENSORS[:2], [["ulp"] * 2] * 3)
    encs, blobs = encode_chain(states)
    sq = squash_chain([e.manifest for e in encs], blobs.__getitem__)
    mid = copy_state(states[1])
    with pytest.raises(BaseMismatchError):
        apply_delta(mid, sq.manifest, sq.blobs)
    assert snapshot(mid) == snapshot(states[1])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1),
       dts=st.lists(st.sampled_from(DTYPE_NAMES), min_size=1, max_size=3),
       numel=st.integers(1, 60),
       steps=st.lists(st.lists(st.sampled_from(STEP_KINDS), min_size=3, max_size=3), min_size=2, max_size=5),
       chunk=st.sampled_from([2, 7, 1000]))
def test_property_squash_equals_sequential(seed, dts, numel, steps, chunk):
    tensors = [(f"t{i}", dt, (numel,)) for i, dt in enumerate(dts)]
    states = make_chain(seed, tensors, [s[: len(dts)] for s in steps])
    opts = EncodeOptions(chunk_words=chunk, blob_target=50)
    check_squash(states, opts, opts)


# -- compose_changes -------------------------------------------------------------------------------

def _ch(pos, raw, vals, dtype=np.uint16):
    return Changes(positions=np.array(pos, np.int64), raw=np.array(raw, bool), values=np.array(vals, dtype))


@pytest.mark.parametrize("first,second,want", [
    (_ch([1], [False], [1]), _ch([1], [False], [0xFFFF]), _ch([], [], [])),  # +1 then -1: dropped
    (_ch([1], [False], [2]), _ch([1], [False], [3]), _ch([1], [False], [5])),  # steps add
    (_ch([1], [True], [7]), _ch([1], [False], [1]), _ch([1], [True], [8])),  # a step after raw moves the raw word
    (_ch([1], [False], [5]), _ch([1], [True], [9]), _ch([1], [True], [9])),  # raw replaces
    (_ch([1], [True], [7]), _ch([1], [True], [3]), _ch([1], [True], [3])),
    (_ch([0, 4], [False, True], [1, 2]), _ch([2], [False], [3]), _ch([0, 2, 4], [False, False, True], [1, 3, 2])),
    (_ch([], [], []), _ch([3], [True], [1]), _ch([3], [True], [1])),
    (_ch([3], [False], [0x8000]), _ch([3], [False], [0x8000]), _ch([], [], [])),  # wraps modulo 2**16
])
def test_compose_changes_table(first, second, want):
    got = compose_changes(first, second)
    assert got.positions.tolist() == want.positions.tolist()
    assert got.raw.tolist() == want.raw.tolist()
    assert got.values.astype(np.uint64).tolist() == want.values.astype(np.uint64).tolist()
    # and it agrees with applying both in order to any base
    base = np.arange(8, dtype=np.uint16) * np.uint16(4099)
    a, b = base.copy(), base.copy()
    apply_changes_np(a, first)
    apply_changes_np(a, second)
    apply_changes_np(b, got)
    assert a.tolist() == b.tolist()


# -- chain checks -------------------------------------------------------------------------------------

def _chain3():
    states = make_chain(5, TENSORS[:2], [["ulp"] * 2] * 3)
    encs, blobs = encode_chain(states)
    return [e.manifest for e in encs], blobs, states


@pytest.mark.parametrize("how", ["empty", "gap", "reorder", "mixed-models", "keyframe", "wrong-base-state"])
def test_check_chain_refuses(how):
    ms, blobs, states = _chain3()
    if how == "empty":
        ms = []
    elif how == "gap":
        ms = [ms[0], ms[2]]
    elif how == "reorder":
        ms = [ms[1], ms[0], ms[2]]
    elif how == "mixed-models":
        ms = [ms[0], dataclasses.replace(ms[1], model="other"), ms[2]]
    elif how == "keyframe":
        ms = [encode_keyframe(states[1], model="policy", version=11).manifest, ms[1]]
    else:
        ms = [ms[0], dataclasses.replace(ms[1], state_fp_before="0" * 16), ms[2]]
    with pytest.raises(ChainError):
        check_chain(ms)
    with pytest.raises(ChainError):
        squash_chain(ms, blobs.__getitem__)


def test_squash_of_one_delta_reencodes_it():
    ms, blobs, states = _chain3()
    sq = squash_chain(ms[:1], blobs.__getitem__)
    t = copy_state(states[0])
    apply_delta(t, sq.manifest, sq.blobs)
    assert snapshot(t) == snapshot(states[1])
    assert sq.manifest.meta == {"squashed": "10..11"}
    patches = [p for data in sq.blobs.values() for p in decode_blob(data)]
    assert sum(p.count for p in patches) == sq.manifest.changed_words
