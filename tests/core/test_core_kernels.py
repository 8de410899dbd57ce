"""Compiled kernels (deltasync.kernels, numba) against the numpy/torch reference, bit for bit.

Every kernel entry point runs twice on the same inputs, once per selection, and the outputs
(positions, words, streams, fingerprints, errors) must be identical. Inputs: random words of
every word width the codec uses (1, 2, 4, 8 bytes: fp8/int8, bf16/fp16, fp32, fp64/int64), ULP
steps and raw rewrites, empty and all-changed chunks, changes at the 64-word block and 2**16
lane-block edges, NaN payloads, -0.0 and sign flips; then whole encode/decode/apply/fingerprint
runs through the public API under each selection.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from deltasync import kernels
from deltasync.apply import apply_delta
from deltasync.codec import EncodeOptions, decode_blob, diff_states, encode_delta
from deltasync.errors import FormatError
from deltasync.fingerprint import FP_SPLIT_LANES, copy_fingerprint, fingerprint_delta, lanes_sum, tensor_fingerprint

pytest.importorskip("numba")

from core_support import WORD, restore_kernels  # noqa: E402,F401  (restore_kernels: autouse)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def both(fn):
    """fn() under the reference and under numba: (reference result, kernel result)."""
    kernels.select("reference")
    ref = fn()
    kernels.select("numba")
    return ref, fn()


def same(a, b) -> None:
    if isinstance(a, tuple) or isinstance(a, list):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    elif hasattr(a, "positions"):  # Changes
        same((a.positions, a.raw, a.values), (b.positions, b.raw, b.values))
    else:
        assert a == b


SPECIAL = {  # NaN payloads, -0.0, infinities, sign flips, as raw words
    1: [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x81],
    2: [0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x8001, 0xFFFF],
    4: [0, 0x80000000, 0x7FC00000, 0x7FC00001, 0xFFC00001, 0x7F800000, 1, 0xFFFFFFFF],
    8: [0, 1 << 63, 0x7FF8000000000000, 0x7FF8000000000001, 0xFFF0000000000001, 1, (1 << 64) - 1],
}


@st.composite
def word_pairs(draw):
    """(word size, old words, new words) with a mix of ULP steps, big steps and rewrites."""
    w = draw(st.sampled_from((1, 2, 4, 8)))
    dt = WORD[w]
    n = draw(st.sampled_from((0, 1, 63, 64, 65, 127, 200, 1000, 4099)))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from((0.0, 0.003, 0.05, 0.3, 1.0)))
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    if draw(st.booleans()) and n:
        old[rng.integers(0, n, max(n // 8, 1))] = rng.choice(np.array(SPECIAL[w], dtype=dt), max(n // 8, 1))
    new = old.copy()
    sel = np.flatnonzero(rng.random(n) < density) if density < 1 else np.arange(n)
    kind = rng.integers(0, 4, sel.size)
    steps = rng.choice(np.array([1, -1, 2, -3, 127, -128, 300, -70000], dtype=np.int64), sel.size)
    with np.errstate(over="ignore"):
        stepped = (old[sel].astype(np.uint64) + steps.astype(np.uint64)).astype(dt)
    rewritten = rng.integers(0, np.iinfo(dt).max, sel.size, dtype=dt, endpoint=True)
    special = rng.choice(np.array(SPECIAL[w], dtype=dt), sel.size)
    new[sel] = np.where(kind == 0, rewritten, np.where(kind == 1, special, stepped))
    if draw(st.booleans()) and n:
        new[-1] ^= dt(1)  # the last word of the chunk
    return w, old, new


@SETTINGS
@given(word_pairs(), st.sampled_from((0, 5, 65535, 65536 * 3 - 7)), st.booleans())
def test_diff_words_matches_reference(pair, start, update_old):
    w, old, new = pair
    ref_old, k_old = old.copy(), old.copy()
    kernels.select("reference")
    ref = kernels.diff_words(ref_old, new, start, w, update_old)
    kernels.select("numba")
    got = kernels.diff_words(k_old, new, start, w, update_old)
    if ref is None:
        assert got is None
    else:
        same(ref, got)
    assert np.array_equal(ref_old, k_old)
    if update_old:
        assert np.array_equal(k_old, new)


@SETTINGS
@given(word_pairs(), st.booleans())
def test_value_coding_matches_reference(pair, is_float):
    w, old, new = pair
    rel = np.flatnonzero(old != new)
    ow, nw = old[rel], new[rel]
    ref, got = both(lambda: kernels.changes_from_words(rel, ow, nw, is_float=is_float))
    same(ref, got)
    ref_s, got_s = both(lambda: kernels.encode_values(ref))
    same(ref_s, got_s)
    ref_d, got_d = both(lambda: kernels.decode_values(rel, *ref_s, w))
    same(ref_d, got_d)
    same(ref_d, ref)


@SETTINGS
@given(word_pairs())
def test_position_coding_matches_reference(pair):
    w, old, new = pair
    n = old.size
    rel = np.flatnonzero(old != new)
    gaps_ref, gaps_got = both(lambda: kernels.encode_gaps(rel))
    same(gaps_ref, gaps_got)
    bm_ref, bm_got = both(lambda: kernels.encode_bitmap(rel, n))
    same(bm_ref, bm_got)
    same(*both(lambda: kernels.decode_gaps(*gaps_ref, rel.size, n)))
    same(*both(lambda: kernels.decode_bitmap(bm_ref, rel.size, n)))


def test_long_gaps_and_lane_block_edges():
    n = 3 * 65536 + 5
    rel = np.array([0, 1, 255, 256, 511, 65535, 65536, 65537, 70000, n - 1], dtype=np.int64)
    small, big = kernels.encode_gaps(rel)
    same(*both(lambda: kernels.encode_gaps(rel)))
    same(*both(lambda: kernels.decode_gaps(small, big, rel.size, n)))
    for w, dt in WORD.items():
        old = np.zeros(n, dt)
        new = old.copy()
        new[rel] = dt(1)
        r, g = both(lambda: kernels.diff_words(old.copy(), new, 65536 - 3, w))
        same(r, g)


def _bad_streams(draw_bytes: bytes):
    return np.frombuffer(draw_bytes, np.uint8)


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=24), st.binary(max_size=8), st.binary(max_size=6), st.integers(0, 40),
       st.sampled_from((1, 2, 4, 8)))
def test_malformed_value_streams_fail_alike(sym, tok, ext, count, w):
    """Corrupt streams: both selections raise FormatError, or both decode the same changes."""
    dt = WORD[w]
    raw = np.zeros(count // 3, dt)
    pos = np.arange(count, dtype=np.int64)
    out = []
    for sel in ("reference", "numba"):
        kernels.select(sel)
        try:
            out.append(kernels.decode_values(pos, _bad_streams(sym), _bad_streams(tok), _bad_streams(ext), raw, w))
        except FormatError:
            out.append("FormatError")
    if out[0] == "FormatError" or out[1] == "FormatError":
        assert out[0] == out[1] == "FormatError"
    else:
        same(out[0], out[1])


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=40), st.binary(max_size=6), st.integers(0, 40), st.integers(1, 300))
def test_malformed_position_streams_fail_alike(gaps, gapx, count, length):
    for decode in (lambda: kernels.decode_gaps(_bad_streams(gaps), _bad_streams(gapx), count, length),
                   lambda: kernels.decode_bitmap(_bad_streams(gaps), count, length)):
        out = []
        for sel in ("reference", "numba"):
            kernels.select(sel)
            try:
                out.append(decode())
            except FormatError:
                out.append("FormatError")
        if isinstance(out[0], str) or isinstance(out[1], str):
            assert out[0] == out[1] == "FormatError"
        else:
            same(out[0], out[1])


@SETTINGS
@given(word_pairs(), st.integers(0, 3 * 65536))
def test_fingerprints_match_reference(pair, offset):
    w, old, new = pair
    lane = np.uint8 if w == 1 else np.uint16
    lanes = torch.from_numpy(new.view(lane).copy())
    signed = lanes.view(torch.int8 if w == 1 else torch.int16)
    same(*both(lambda: lanes_sum(signed, offset)))
    t = torch.from_numpy(new.view(np.dtype(f"i{w}")).copy())
    same(*both(lambda: tensor_fingerprint(t)))
    rel = np.flatnonzero(old != new)
    sdt = np.dtype(f"i{w}")
    args = (torch.from_numpy(rel + offset), torch.from_numpy(old[rel].view(sdt)), torch.from_numpy(new[rel].view(sdt)))
    same(*both(lambda: fingerprint_delta(*args, w)))


@SETTINGS
@given(word_pairs(), st.booleans())
def test_copy_fingerprint_matches_copy_then_scrub(pair, from_bytes):
    """The fused copy + fingerprint (a keyframe landing in a map, a shard being built) writes exactly the
    source's bytes and returns tensor_fingerprint of them, under both selections, threaded or not."""
    w, old, new = pair
    src = torch.from_numpy(new.view(np.dtype(f"i{w}")).copy())
    expect = tensor_fingerprint(src)

    def run(executor=None):
        dst = torch.from_numpy(old.view(np.dtype(f"i{w}")).copy())
        given_src = src.numpy().view(np.uint8) if from_bytes else src
        fp = copy_fingerprint(dst, given_src, executor=executor)
        return fp, dst.numpy().copy()

    ref, got = both(run)
    same(ref, got)
    assert got[0] == expect and np.array_equal(got[1].view(np.uint8), new.view(np.uint8))
    with ThreadPoolExecutor(max_workers=2) as pool:
        same(run(pool), got)


def test_copy_fingerprint_split_across_threads_and_read_only_bytes():
    """Pieces of FP_SPLIT_LANES lanes on two threads, from a read-only byte view (a received shard)."""
    src = (torch.randn(FP_SPLIT_LANES * 2 + 12345) * 3).to(torch.bfloat16)
    raw = src.view(torch.int16).numpy().view(np.uint8).copy()
    raw.flags.writeable = False
    for sel in ("reference", "numba"):
        kernels.select(sel)
        dst = torch.zeros_like(src)
        with ThreadPoolExecutor(max_workers=2) as pool:
            fp = copy_fingerprint(dst, raw, executor=pool)
        assert fp == tensor_fingerprint(src) and torch.equal(dst.view(torch.int16), src.view(torch.int16))
    with pytest.raises(ValueError, match="source bytes"):
        copy_fingerprint(torch.zeros(4, dtype=torch.bfloat16), raw[:7])


@SETTINGS
@given(word_pairs())
def test_patch_words_matches_reference_apply(pair):
    w, old, new = pair
    rel = np.flatnonzero(old != new)
    kernels.select("reference")
    ch = kernels.changes_from_words(rel, old[rel], new[rel], is_float=True)
    ref = old.copy()
    kernels.apply_changes_np(ref, ch)
    assert np.array_equal(ref, new)
    kernels.select("numba")
    got = old.copy()
    before, fpd = kernels.patch_words(got, ch, w)
    assert np.array_equal(got, new) and np.array_equal(before, old[rel])
    assert fpd == kernels.fingerprint_delta_np(rel, old[rel], new[rel], w)
    got2 = old.copy()
    kernels.apply_changes_np(got2, ch)
    assert np.array_equal(got2, new)


DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int64, torch.uint8,
          torch.float8_e4m3fn, torch.bool, torch.complex64)


def _state(seed: int, dtype: torch.dtype, n: int):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", (0.0, 0.01, 0.2, 1.0))
def test_encode_decode_apply_identical_under_both(dtype, density):
    """The whole pipeline: same manifest and blobs, same decoded chunks, same applied tensors."""
    n = 70_000
    a = {"x": _state(1, dtype, n), "y": _state(2, dtype, 300).reshape(30, 10)}
    b = {k: v.clone() for k, v in a.items()}
    g = torch.Generator().manual_seed(3)
    for k, v in b.items():
        words = v.reshape(-1).view(torch.uint8)
        sel = torch.rand(words.numel(), generator=g) < density
        words[sel] ^= 1
    opts = EncodeOptions(chunk_words=1 << 14)
    ref, got = both(lambda: encode_delta(a, b, model="m", version=2, parent=1, options=opts))
    assert ref.manifest.to_json() == got.manifest.to_json()
    assert ref.blobs == got.blobs
    for bid, data in ref.blobs.items():
        r, k = both(lambda: decode_blob(data))
        for x, y in zip(r, k):
            assert (x.tensor, x.start, x.stop) == (y.tensor, y.start, y.stop)
            same(x.as_changes(), y.as_changes())

    def applied():
        live = {k: v.clone() for k, v in a.items()}
        fps = apply_delta(live, ref.manifest, ref.blobs)
        return live, fps

    (lr, fr), (lk, fk) = both(applied)
    assert fr == fk
    for k in b:
        assert torch.equal(lk[k].view(torch.uint8), b[k].view(torch.uint8))


def test_threaded_diff_equals_serial():
    g = torch.Generator().manual_seed(5)
    a = {"w": torch.randn(2048, 600, generator=g).to(torch.bfloat16)}
    b = {"w": a["w"].clone()}
    flat = b["w"].view(-1).view(torch.int16)
    idx = torch.randint(0, flat.numel(), (20_000,), generator=g)
    flat[idx] += 1
    kernels.select("numba")
    one = diff_states(a, b, chunk_words=1 << 16)
    with ThreadPoolExecutor(2) as pool:
        two = diff_states(a, b, chunk_words=1 << 16, executor=pool)
        assert tensor_fingerprint(b["w"], executor=pool) == tensor_fingerprint(b["w"])
    assert one.fps_after == two.fps_after
    for x, y in zip(one.chunks["w"], two.chunks["w"]):
        same((x.positions, x.old, x.new), (y.positions, y.old, y.new))


def test_select_rejects_unknown_names():
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.select("fast")
    assert kernels.select("reference") == "reference" and kernels.active() == "reference"
    assert kernels.select("auto") == "numba"


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter():
    """The Triton kernels of deltasync.kernels.gpu on CPU tensors under TRITON_INTERPRET=1 (no GPU here),
    against the torch reference; the same check runs on a real device in `make gpu-check`."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:  # not imported here: its extension reports leaks at exit
        pytest.skip("triton is not installed (make venv installs it on Linux x86-64)")

    code = "from deltasync.kernels import gpu; gpu.self_check('cpu', n=20_011); print('self-check ok')"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "self-check ok" in out.stdout, out.stderr[-2000:]


def test_gpu_check_fails_clearly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no CUDA device" in out.stderr
