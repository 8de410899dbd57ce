"""The whole-span encode kernels (helper K, issue 10) against the numpy/torch reference, bit for bit.

* ``kernels.diff_span`` (compare + gather + fingerprint change + the base's lanes sum, one pass) against
  ``np.flatnonzero`` + ``fingerprint_delta`` + the torch ``lanes_sum``, on every word width, unaligned
  spans, outputs that must grow, read-only inputs and in-place updates;
* ``kernels.diff_jobs`` (many spans in one call, shared outputs grown by projection) against ``diff_span``;
* ``diff_states(base_fps=None)`` (the base fingerprint from that same pass) against ``tensor_fingerprint``,
  serial and threaded;
* ``rans.word_symbols`` / ``rans.chunk_symbols`` against ``values.changes_from_words`` +
  ``values.step_symbols`` + the gap buckets and counts of ``entropy``;
* ``rans.encode_chunk_pos`` (reciprocal division) against ``rans.encode_chunk``, and the reciprocal
  itself against ``//``;
* whole blobs: the bytes written with the kernels equal the reference's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from deltasync import kernels
from deltasync.kernels import rans
from deltasync.codec import EncodeOptions, diff_states, encode_delta, encode_diff
from deltasync.entropy import _buckets
from deltasync.fingerprint import fingerprint_delta, lanes_sum, tensor_fingerprint
from deltasync.values import Changes, changes_from_words, step_symbols

numba = pytest.importorskip("numba")

from core_support import WORD, restore_kernels  # noqa: E402,F401  (restore_kernels: autouse)
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def spans(draw):
    """(word size, old, new, first, last): words with steps, rewrites and sign flips at some density."""
    w = draw(st.sampled_from((1, 2, 4, 8)))
    dt = WORD[w]
    n = draw(st.sampled_from((1, 63, 64, 65, 200, 4099, 70_000)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    new = old.copy()
    density = draw(st.sampled_from((0.0, 0.002, 0.05, 0.5, 1.0)))
    sel = np.flatnonzero(rng.random(n) < density)
    with np.errstate(over="ignore"):
        new[sel] = np.where(rng.random(sel.size) < 0.8, old[sel] + dt(1), rng.integers(0, 255, sel.size).astype(dt))
    new[sel] = np.where(new[sel] == old[sel], old[sel] ^ dt(1), new[sel])
    if n > 1 and draw(st.booleans()):
        new[-1] ^= dt(1 << (8 * w - 1))  # a sign flip in the last word
    first = draw(st.integers(0, n - 1))
    last = draw(st.integers(first + 1, n))
    return w, old, new, first, last


def _reference_span(w, old, new, first, last):
    rel = np.flatnonzero(old[first:last] != new[first:last]) + first
    sdt = np.dtype(f"i{w}")
    fpd = fingerprint_delta(torch.from_numpy(rel), torch.from_numpy(old[rel].view(sdt)),
                            torch.from_numpy(new[rel].view(sdt)), w) if rel.size else 0
    kernels.select("reference")
    lanes_dt = torch.int8 if w == 1 else torch.int16
    per = max(w // 2, 1)
    lanes = lanes_sum(torch.from_numpy(old[first:last].copy()).view(SIGNED[w]).view(lanes_dt), first * per)
    kernels.select("numba")
    return rel, old[rel], new[rel], fpd & (2**64 - 1), lanes


@SETTINGS
@given(spans(), st.booleans(), st.sampled_from((0, 1, 200)))
def test_diff_span_matches_reference(span, update_old, cap):
    w, old, new, first, last = span
    rel, ow, nw, fpd, lanes = _reference_span(w, old, new, first, last)
    o = old.copy()
    pos, got_old, got_new, got_fpd, got_lanes = kernels.diff_span(o, new, first, last, w, want_lanes=True,
                                                                  update_old=update_old, cap=cap)
    assert pos.dtype == np.int64 and got_old.dtype == old.dtype
    assert np.array_equal(pos, rel) and np.array_equal(got_old, ow) and np.array_equal(got_new, nw)
    assert got_fpd == fpd and got_lanes == lanes
    expect = old.copy()
    if update_old:
        expect[rel] = nw
    assert np.array_equal(o, expect)  # nothing else written
    _, _, _, _, none = kernels.diff_span(old.copy(), new, first, last, w)
    assert none is None


def test_diff_span_grows_past_a_tiny_buffer_and_reads_read_only_words():
    rng = np.random.default_rng(1)
    old = rng.integers(0, 2**16, 300_001, dtype=np.uint16)
    new = old.copy()
    new[::3] += np.uint16(1)  # a third of the words: the buffer doubles many times
    old.setflags(write=False)
    new.setflags(write=False)
    rel, ow, nw, fpd, lanes = _reference_span(2, old, new, 5, old.size)
    pos, got_old, got_new, got_fpd, got_lanes = kernels.diff_span(old, new, 5, old.size, 2, want_lanes=True, cap=1)
    assert np.array_equal(pos, rel) and np.array_equal(got_old, ow) and np.array_equal(got_new, nw)
    assert (got_fpd, got_lanes) == (fpd, lanes)


@pytest.mark.parametrize("w", (1, 2, 4, 8))
@pytest.mark.parametrize("room", (1 << 40, 1024))
def test_diff_jobs_equals_diff_span_per_span(monkeypatch, w, room):
    """``kernels.diff_jobs`` (many tensors' spans in one call, shared outputs that start tiny and grow by
    projection when ``room`` is huge) gives each span exactly what ``diff_span`` gives it, and updates the
    old words in place alike; densities differ from span to span (the projection is off and must regrow)."""
    monkeypatch.setattr(kernels, "_DIFF_ROOM", room)
    rng = np.random.default_rng(w)
    dt = np.dtype(f"u{w}")
    spans = []
    for i, (size, density) in enumerate(((70_001, 0.001), (5, 1.0), (130_000, 0.3), (64, 0.5), (9_999, 0.0),
                                         (200_003, 0.02))):
        old = rng.integers(0, np.iinfo(dt).max, size, dtype=dt, endpoint=True)
        new = old.copy()
        sel = rng.random(size) < density
        new[sel] += dt.type(1 + i)
        first, last = (3, size - 2) if size > 8 else (0, size)
        spans.append((old, new, first, last))
    for want, update in ((True, False), (False, True)):
        expect = [kernels.diff_span(o.copy(), n, a, b, w, want_lanes=want, update_old=update) for o, n, a, b in spans]
        olds = [o.copy() for o, _, _, _ in spans]
        got = kernels.diff_jobs([(oc, n, a, b) for oc, (_, n, a, b) in zip(olds, spans)], w, want_lanes=want,
                                update_old=update)
        for (pe, oe, ne, fe, le), (pg, og, ng, fg, lg), oc, (o, n, a, b) in zip(expect, got, olds, spans):
            assert np.array_equal(pe, pg) and np.array_equal(oe, og) and np.array_equal(ne, ng)
            assert (fe, le) == (fg, lg)
            ref = o.copy()
            if update:
                ref[pe] = ne
            assert np.array_equal(oc, ref)


def _states(seed: int):
    g = torch.Generator().manual_seed(seed)
    a = {
        "emb": torch.randn(1100, 600, generator=g).to(torch.bfloat16),  # cut into row cells
        "f32": torch.randn(70_001, generator=g),
        "f64": torch.randn(333, generator=g, dtype=torch.float64),
        "i8": torch.randint(-128, 127, (5000,), generator=g, dtype=torch.int8),
        "flag": torch.rand(999, generator=g) < 0.5,
        "empty": torch.zeros(0, dtype=torch.bfloat16),
        "same": torch.randn(64, 64, generator=g).half(),
    }
    b = {k: v.clone() for k, v in a.items()}
    for k, v in b.items():
        if k in ("same", "empty"):
            continue
        words = v.reshape(-1).view(torch.uint8)
        sel = torch.rand(words.numel(), generator=g) < 0.01
        words[sel] ^= 1
    b["f32"][:50] = -b["f32"][:50]  # sign flips: raw words
    return a, b


def test_diff_states_computes_the_base_fingerprint_in_the_compare_pass():
    a, b = _states(4)
    kernels.select("reference")
    ref = diff_states(a, b, chunk_words=1 << 15)
    fps_a = {k: tensor_fingerprint(v) for k, v in a.items()}
    fps_b = {k: tensor_fingerprint(v) for k, v in b.items()}
    kernels.select("numba")
    seen = []
    one = diff_states(a, b, chunk_words=1 << 15, progress=lambda d, t: seen.append((d, t)))
    with ThreadPoolExecutor(2) as pool:
        two = diff_states(a, b, chunk_words=1 << 15, executor=pool)
    given_fps = diff_states(a, b, chunk_words=1 << 15, base_fps=fps_a)
    for got in (one, two, given_fps):
        assert got.fps_before == fps_a == ref.fps_before
        assert got.fps_after == fps_b == ref.fps_after
        assert got.chunks.keys() == ref.chunks.keys()
        for name, cs in ref.chunks.items():
            assert [(c.start, c.stop) for c in cs] == [(c.start, c.stop) for c in got.chunks[name]]
            for x, y in zip(cs, got.chunks[name]):
                for f in ("positions", "old", "new"):
                    assert np.array_equal(getattr(x, f), getattr(y, f)) and getattr(x, f).dtype == getattr(y, f).dtype
    total = sum(v.numel() * v.element_size() for v in b.values())
    assert seen and seen[-1] == (total, total) and all(x[0] <= y[0] for x, y in zip(seen, seen[1:]))


def test_diff_states_update_old_patches_the_reference_in_place():
    a, b = _states(5)
    ref = {k: v.clone() for k, v in a.items()}
    with ThreadPoolExecutor(2) as pool:
        d = diff_states(ref, b, chunk_words=1 << 14, update_old=True, executor=pool)
    for k in b:
        assert torch.equal(ref[k].view(torch.uint8), b[k].view(torch.uint8))
    assert d.fps_after == {k: tensor_fingerprint(v) for k, v in b.items()}


@st.composite
def changed_words(draw):
    w = draw(st.sampled_from((1, 2, 4, 8)))
    dt = WORD[w]
    n = draw(st.sampled_from((1, 7, 300, 5000)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    start = draw(st.sampled_from((0, 9, 1 << 20)))
    gaps = rng.choice(np.array([0, 1, 5, 300, 70_000, 1 << 26], dtype=np.int64), n, p=[.4, .2, .2, .1, .07, .03])
    positions = start + np.cumsum(gaps + 1) - 1
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    steps = rng.choice(np.array([1, -1, 2, -2, 8, -8, 9, -9, 1000, -(1 << 20), 1 << 40], dtype=np.int64), n)
    with np.errstate(over="ignore"):
        new = (old.astype(np.uint64) + steps.astype(np.uint64)).astype(dt)
    new = np.where(new == old, old ^ dt(1), new)
    return w, positions, start, old, new


def _reference_symbols(positions, start, changes):
    rel = positions - start
    gaps = np.diff(rel, prepend=-1) - 1
    sym, bigneg, bigmag, raw = step_symbols(changes, rans.SMALL, rans.BIG, rans.RAW)
    return (sym, bigneg, bigmag, raw, np.bincount(_buckets(gaps), minlength=rans.N_GAP),
            np.bincount(sym, minlength=rans.N_VAL), gaps.astype(np.int64))


@SETTINGS
@given(changed_words(), st.booleans())
def test_symbol_kernels_match_reference(case, is_float):
    w, positions, start, old, new = case
    changes = changes_from_words(positions, old, new, is_float=is_float)
    sym, bigneg, bigmag, raw, gcount, vcount, _ = _reference_symbols(positions, start, changes)
    from deltasync.values import _raw_limit

    for got in ("words", "changes"):
        gc = np.full(rans.N_GAP, 7, np.int64)
        vc = np.full(rans.N_VAL, 3, np.int64)
        if got == "words":
            out = rans.word_symbols(positions, start, old, new, _raw_limit(8 * w), is_float, gc, vc)
        else:
            out = rans.chunk_symbols(positions, start, changes.raw, changes.values, gc, vc)
        s, bn, bm, r, zero = out
        assert not zero
        assert np.array_equal(s, sym) and np.array_equal(bn, bigneg) and np.array_equal(bm, bigmag)
        assert r.dtype == raw.dtype and np.array_equal(r, raw)
        assert np.array_equal(gc - 7, gcount) and np.array_equal(vc - 3, vcount)


def test_symbol_kernels_flag_a_zero_step_and_count_nothing():
    pos = np.arange(3, dtype=np.int64)
    gc = np.zeros(rans.N_GAP, np.int64)
    vc = np.zeros(rans.N_VAL, np.int64)
    zero = np.array([1, 0, 5], np.uint16)
    assert rans.chunk_symbols(pos, 0, np.zeros(3, np.bool_), zero, gc, vc)[4]
    assert rans.word_symbols(pos, 0, zero, zero, 200, True, gc, vc)[4]
    assert not gc.any() and not vc.any()
    with pytest.raises(ValueError, match="zero step"):
        from deltasync.entropy import AnsBlobCoder

        AnsBlobCoder().add({}, pos, Changes(positions=pos, raw=np.zeros(3, np.bool_), values=zero))


@SETTINGS
@given(changed_words(), st.booleans(), st.booleans())
def test_encode_chunk_pos_matches_encode_chunk(case, is_float, rare):
    w, positions, start, old, new = case
    changes = changes_from_words(positions, old, new, is_float=is_float)
    sym, bigneg, bigmag, _, gcount, vcount, gaps = _reference_symbols(positions, start, changes)
    if rare:  # every symbol possible, most at frequency 1: the shift path and tiny reciprocals
        gcount, vcount = gcount + 1, vcount + 1
        gcount[0] += 10**6
    gf, gc, _ = rans.tables(rans.normalize(gcount))
    vf, vc, _ = rans.tables(rans.normalize(vcount))
    ref = rans.encode_chunk(gaps, sym, bigneg, bigmag, gf, gc, vf, vc)
    got = rans.encode_chunk_pos(positions, start, sym, bigneg, bigmag, gf, gc, vf, vc)
    assert got.dtype == ref.dtype and np.array_equal(got, ref)


@numba.njit
def _all_quotients_ok(freqs, xs):
    cm, rc = rans._recips(freqs)
    for i in range(freqs.size):
        f = np.uint64(freqs[i])
        if f < 2:
            continue
        for x in xs:
            for d in (np.uint64(0), np.uint64(1), f - np.uint64(1)):  # around multiples of f
                y = (x // f) * f + d
                if y < np.uint64(1 << 32) and rans._mulhi(y, rc[i]) != y // f:
                    return False
            if rans._mulhi(x, rc[i]) != x // f:
                return False
    return True


def test_reciprocal_division_is_exact_over_the_state_range():
    freqs = np.arange(rans.M + 1, dtype=np.uint32)
    rng = np.random.default_rng(0)
    xs = np.concatenate([np.array([0, 1, rans.L, (1 << 31) - 1, 1 << 31, (1 << 32) - 1], np.uint64),
                         rng.integers(0, 1 << 32, 400, dtype=np.uint64)])
    assert _all_quotients_ok(freqs, xs)


@pytest.mark.parametrize("threads", (1, 2))
def test_blobs_identical_to_the_reference_path(threads):
    """Whole deltas (format 2 and format 1, mixed dtypes, raw words, a rewritten chunk) under both selections."""
    a, b = _states(6)
    b["i8"] = torch.randint(-128, 127, (5000,), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    for fmt in (2, 1):
        opts = EncodeOptions(chunk_words=1 << 14, format=fmt)
        kernels.select("reference")
        ref = encode_delta(a, b, model="m", version=2, parent=1, options=opts)
        kernels.select("numba")
        with ThreadPoolExecutor(threads) as pool:
            got = encode_delta(a, b, model="m", version=2, parent=1, options=opts,
                               executor=pool if threads == 2 else None)
            again = encode_diff(diff_states(a, b, chunk_words=1 << 14, executor=pool), model="m", version=2, parent=1,
                                options=opts)
        assert ref.manifest.to_json() == got.manifest.to_json() == again.manifest.to_json()
        assert ref.blobs == got.blobs == again.blobs


def test_diff_states_of_host_tensors_fingerprints_the_base_in_the_pass():
    """Torch-free states (``HostTensor`` words, as a publisher from files has them): the same diff, with the
    base fingerprint from the compare pass, as for the torch tensors they view."""
    from deltasync.dtypes import HostTensor, dtype_info, host_words

    a, b = _states(7)

    def host(state):
        return {k: HostTensor(dtype=dtype_info(v.dtype).name, shape=tuple(v.shape), words=host_words(v))
                for k, v in state.items()}

    ref = diff_states(a, b, chunk_words=1 << 15)
    got = diff_states(host(a), host(b), chunk_words=1 << 15)
    assert got.fps_before == ref.fps_before == {k: tensor_fingerprint(v) for k, v in a.items()}
    assert got.fps_after == ref.fps_after
    assert got.layout == ref.layout
    for name, cs in ref.chunks.items():
        for x, y in zip(cs, got.chunks[name], strict=True):
            assert (x.start, x.stop) == (y.start, y.stop) and np.array_equal(x.positions, y.positions)
            assert np.array_equal(x.old, y.old) and np.array_equal(x.new, y.new)
