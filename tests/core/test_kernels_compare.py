"""The compare pass (helper D, issue 10) against the numpy/torch reference, bit for bit.

* ``kernels.diff_span``'s 64-word vector compare (``cpu._neq_mask64``): a difference in any one bit of any
  lane of a block is found, on every word width, in blocks on either side of unaligned span ends, and in
  read-only inputs; the outputs equal ``np.flatnonzero`` + the reference fingerprint change;
* ``codec._span_words`` (the torch fast path: a one-word dtype viewed as the integer of its width) gives the
  words ``dtypes.host_words`` gives, for every supported dtype, tensors that need grad, views and 0-d ones;
* ``diff_states`` over a state of many small tensors (pieces of one chunk and of several, with and without a
  pool) equals the reference selection's chunks and fingerprints.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from deltasync import kernels
from deltasync.codec import _span_words, diff_states
from deltasync.dtypes import DTYPES, dtype_info, host_words
from deltasync.fingerprint import fingerprint_delta, lanes_sum

numba = pytest.importorskip("numba")

from core_support import WORD, restore_kernels  # noqa: E402,F401  (restore_kernels: autouse)

SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _reference(w, old, new, first, last):
    rel = np.flatnonzero(old[first:last] != new[first:last]) + first
    sdt = np.dtype(f"i{w}")
    fpd = fingerprint_delta(torch.from_numpy(rel), torch.from_numpy(old[rel].view(sdt)),
                            torch.from_numpy(new[rel].view(sdt)), w) if rel.size else 0
    kernels.select("reference")
    lanes = torch.from_numpy(old[first:last].copy()).view(SIGNED[w]).view(torch.int8 if w == 1 else torch.int16)
    lsum = lanes_sum(lanes, first * max(w // 2, 1))
    kernels.select("numba")
    return rel, fpd & (2**64 - 1), lsum


def _check(w, old, new, first, last):
    kernels.select("numba")
    pos, ow, nw, fpd, lsum = kernels.diff_span(old, new, first, last, w, want_lanes=True)
    rel, want_fpd, want_lanes = _reference(w, old, new, first, last)
    np.testing.assert_array_equal(pos, rel)
    np.testing.assert_array_equal(ow, old[rel])
    np.testing.assert_array_equal(nw, new[rel])
    assert fpd == want_fpd and lsum == want_lanes


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_every_bit_of_every_lane_is_seen(w):
    """Lane j of block b differs from its old word in bit (b * 7 + j) % (8 * w) only: every lane position of
    the vector compare and every bit of a word (the sign bit, a wide word's high half) in some block."""
    dt = WORD[w]
    blocks = 8 * w + 3
    rng = np.random.default_rng(w)
    old = rng.integers(0, np.iinfo(dt).max, 64 * blocks + 17, dtype=dt, endpoint=True)
    new = old.copy()
    for b in range(blocks):
        for j in range(64):
            if (b + j) % 3 == 0 or b == 1:  # some lanes left equal; block 1 all changed
                new[64 * b + j] ^= dt(1) << dt((b * 7 + j) % (8 * w))
    new[-1] ^= dt(1) << dt(8 * w - 1)  # the tail, past the last whole block
    ro_old, ro_new = old.copy(), new.copy()
    ro_old.flags.writeable = ro_new.flags.writeable = False
    for first, last in ((0, old.size), (1, old.size - 1), (63, 64 * 5 + 1), (64, 128), (70, 71)):
        _check(w, old, new, first, last)
        _check(w, ro_old, ro_new, first, last)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.sampled_from((1, 2, 4, 8)), n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1),
       density=st.sampled_from((0.0, 0.001, 0.01, 0.3, 1.0)), cut=st.data())
def test_random_spans_match_the_reference(w, n, seed, density, cut):
    dt = WORD[w]
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    new = old.copy()
    sel = np.flatnonzero(rng.random(n) < density)
    new[sel] ^= (rng.integers(1, 1 << 8, sel.size)).astype(dt)
    first = cut.draw(st.integers(0, n - 1))
    last = cut.draw(st.integers(first + 1, n))
    _check(w, old, new, first, last)


def _tensors():
    """One (6, 5) tensor of each supported dtype this torch has, from random bytes (so every bit pattern)."""
    g = torch.Generator().manual_seed(5)
    for name in sorted(DTYPES):
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            continue
        size = DTYPES[name].element_size
        raw = torch.randint(0, 256, (6, 5 * size), generator=g, dtype=torch.uint8)
        if dt == torch.bool:
            yield name, raw[:, :5] % 2 == 1
        else:
            yield name, raw.view(dt)


@pytest.mark.parametrize("name,t", list(_tensors()), ids=[n for n, _ in _tensors()])
def test_span_words_fast_path_is_host_words(name, t):
    info = dtype_info(t.dtype)
    cases = [t, t[2:4], t.reshape(-1)[:1], t.reshape(-1)[0], t.t()]
    if t.dtype.is_floating_point or t.dtype.is_complex:
        cases.append(t.clone().requires_grad_(True))
    for c in cases:
        got = _span_words(c, info)
        want = host_words(c)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
        if c.is_contiguous() and c.numel() > 1:
            assert np.shares_memory(got, c.detach().view(torch.uint8).numpy())  # a view, not a copy


def _many(seed: int):
    g = torch.Generator().manual_seed(seed)
    a = {f"t{i:03d}": torch.randn(int(s), generator=g).to(torch.bfloat16)
         for i, s in enumerate(torch.randint(1, 3000, (60,), generator=g))}
    a["wide"] = torch.randn(40, 500, generator=g)
    a["bytes"] = torch.randint(0, 255, (999,), generator=g, dtype=torch.uint8)
    b = {n: t.clone() for n, t in a.items()}
    for n, t in b.items():
        words = t.view(-1).view(SIGNED[t.element_size()])
        k = int(torch.randint(0, 4, (1,), generator=g))
        if k:
            words[torch.randint(0, words.numel(), (k * max(1, words.numel() // 100),), generator=g)] += 1
    return a, b


@pytest.mark.parametrize("chunk_words", [256, 1 << 20])
@pytest.mark.parametrize("threaded", [False, True])
def test_diff_states_of_many_tensors_matches_the_reference(chunk_words, threaded):
    a, b = _many(3)
    kernels.select("reference")
    want = diff_states(a, b, chunk_words=chunk_words)
    kernels.select("numba")
    with ThreadPoolExecutor(2) as pool:
        got = diff_states(a, b, chunk_words=chunk_words, executor=pool if threaded else None)
    assert got.layout == want.layout
    assert got.fps_before == want.fps_before and got.fps_after == want.fps_after
    assert got.chunks.keys() == want.chunks.keys()
    for name, chunks in want.chunks.items():
        assert [(c.start, c.stop) for c in got.chunks[name]] == [(c.start, c.stop) for c in chunks]
        for g_, w_ in zip(got.chunks[name], chunks):
            np.testing.assert_array_equal(g_.positions, w_.positions)
            np.testing.assert_array_equal(g_.old, w_.old)
            np.testing.assert_array_equal(g_.new, w_.new)


@pytest.mark.parametrize("pattern", ["none", "sampled", "between_samples", "dense"])
def test_long_spans_sized_from_a_sample_match_the_reference(pattern):
    """Spans of 2**20+ words size their outputs from a sample of the words (``kernels._estimated_changes``):
    right when the sample sees the density, far too small when every change falls between sample points
    (the outputs grow), and generous when nothing changed."""
    n = (1 << 20) + 777
    rng = np.random.default_rng(9)
    old = rng.integers(0, 2**16, n, dtype=np.uint16)
    new = old.copy()
    step = (n - 5) // kernels._SAMPLES
    if pattern == "sampled":
        new[rng.integers(0, n, n // 50)] += np.uint16(1)
    elif pattern == "between_samples":  # every word except the sampled ones: the estimate sees nothing
        new += np.uint16(1)
        new[5::step] = old[5::step]
    elif pattern == "dense":
        new ^= np.uint16(0x8000)
    est = kernels._estimated_changes(old, new, 5, n)
    if pattern == "between_samples":
        assert est < 10_000  # the case really takes the growing path
    _check(2, old, new, 5, n)
