"""Tensor and state fingerprints against an independent reference of the formula in
deltasync/fingerprint.py's docstring.

The constants (table seed, block seed, C0) are part of the format: fingerprints travel in
manifests, so a subscriber built from another release must compute the same values. If the
reference test fails after an intended change, bump the manifest format version.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.dtypes import DTYPES, dtype_info, word_view
from deltasync.fingerprint import (
    fingerprint_delta, fingerprint_state, fp_hex, lane_bits, parse_fp, state_fingerprint, state_fingerprint_of,
    tensor_fingerprint, update_fingerprint,
)
from core_support import tensor_bytes

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
DTYPE_NAMES = sorted(DTYPES)


# -- an independent reference ---------------------------------------------------------------------

_C0 = 0x2545F4914F6CDD1D
_SEED_T = 0x6A09E667F3BCC908
_SEED_B = 0xBB67AE8584CAA73B
U = np.uint64


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + U(0x9E3779B97F4A7C15)
        z = (z ^ (z >> U(30))) * U(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> U(27))) * U(0x94D049BB133111EB)
        return z ^ (z >> U(31))


_T = _splitmix(np.arange(65536, dtype=np.uint64) + U(_SEED_T)) | U(1)


def ref_keys(i: np.ndarray) -> np.ndarray:
    i = i.astype(np.uint64)
    with np.errstate(over="ignore"):
        return _T[(i & U(0xFFFF)).astype(np.int64)] * (_splitmix((i >> U(16)) ^ U(_SEED_B)) | U(1))


def ref_lanes(t: torch.Tensor) -> np.ndarray:
    lane = "<u1" if dtype_info(t.dtype).word_size == 1 else "<u2"
    return np.frombuffer(tensor_bytes(t), dtype=lane).astype(np.uint64)


def ref_fingerprint(t: torch.Tensor) -> int:
    lanes = ref_lanes(t)
    with np.errstate(over="ignore"):
        s = int((lanes * ref_keys(np.arange(lanes.size))).sum(dtype=np.uint64)) if lanes.size else 0
    return (s + lanes.size * _C0) % (1 << 64)


def from_bytes(raw: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    if not raw:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def random_tensor(rng, dt: str, shape) -> torch.Tensor:
    info = DTYPES[dt]
    n = int(np.prod(shape, dtype=np.int64)) * info.element_size
    b = np.frombuffer(rng.bytes(n), dtype=np.uint8).copy()
    if dt == "bool":
        b &= 1
    return from_bytes(b.tobytes(), info.torch_dtype, shape)


# -- the formula ------------------------------------------------------------------------------------

def test_pinned_values():
    """Literal fingerprints: these travel in manifests and must never change silently."""
    assert fp_hex(tensor_fingerprint(torch.empty(0, dtype=torch.bfloat16))) == "0000000000000000"
    assert fp_hex(tensor_fingerprint(torch.zeros(3, dtype=torch.float32))) == fp_hex(6 * _C0)
    got = {
        "u8": fp_hex(tensor_fingerprint(torch.arange(10, dtype=torch.uint8))),
        "i32": fp_hex(tensor_fingerprint(torch.arange(10, dtype=torch.int32))),
        "bf16": fp_hex(tensor_fingerprint(torch.tensor([1.0, -2.5, float("inf")], dtype=torch.bfloat16))),
    }
    want = {n: fp_hex(ref_fingerprint(t)) for n, t in {
        "u8": torch.arange(10, dtype=torch.uint8), "i32": torch.arange(10, dtype=torch.int32),
        "bf16": torch.tensor([1.0, -2.5, float("inf")], dtype=torch.bfloat16)}.items()}
    assert got == want
    assert got == {"u8": PINNED_U8, "i32": PINNED_I32, "bf16": PINNED_BF16}


PINNED_U8 = "b2d804405a9aa9b5"
PINNED_I32 = "7fcff174480e81a5"
PINNED_BF16 = "66eb03c65cd6f837"


@pytest.mark.parametrize("dt", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (7,), (5, 3), (2, 3, 4)])
def test_matches_reference_every_dtype_small(dt, shape):
    t = random_tensor(np.random.default_rng(len(shape) * 100 + len(dt)), dt, shape)
    assert tensor_fingerprint(t) == ref_fingerprint(t)
    assert lane_bits(dt) == (8 if DTYPES[dt].word_size == 1 else 16)


# lanes around the 65536-lane block and the 262144-lane (4-block) full-recompute step
BOUNDARY_LANES = [65535, 65536, 65537, 131071, 262143, 262144, 262145, 524288 + 3]


@pytest.mark.parametrize("lanes", BOUNDARY_LANES)
@pytest.mark.parametrize("dt", ["uint8", "bfloat16", "float32", "float64"])
def test_matches_reference_at_block_boundaries(lanes, dt):
    info = DTYPES[dt]
    per = 1 if info.word_size == 1 else info.element_size // 2
    numel = lanes // per
    t = random_tensor(np.random.default_rng(lanes), dt, (numel,))
    assert tensor_fingerprint(t) == ref_fingerprint(t)


# -- incremental == full -----------------------------------------------------------------------------

def _signed_words(t: torch.Tensor) -> torch.Tensor:
    return word_view(from_bytes(tensor_bytes(t), t.dtype, t.shape))


def _change(rng, t: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
    info = dtype_info(t.dtype)
    w = np.frombuffer(tensor_bytes(t), dtype=f"<u{info.word_size}").copy()
    if positions.size:
        if info.name == "bool":
            w[positions] ^= 1
        else:
            r = np.frombuffer(rng.bytes(positions.size * info.word_size), dtype=w.dtype)
            w[positions] = np.where(r == w[positions], ~r, r)  # always a different word
    return from_bytes(w.tobytes(), t.dtype, t.shape)


@pytest.mark.parametrize("dt", DTYPE_NAMES)
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.1, 1.0])
def test_incremental_equals_full_every_dtype(dt, frac):
    rng = np.random.default_rng(int(frac * 1000) + len(dt))
    info = DTYPES[dt]
    numel = 70000 // info.element_size + 3  # crosses a block boundary for every lane width
    old = random_tensor(rng, dt, (numel,))
    nwords = numel * info.words_per_element
    k = int(frac * nwords)
    pos = np.sort(rng.choice(nwords, size=k, replace=False)) if k else np.empty(0, np.int64)
    new = _change(rng, old, pos)
    ow, nw = _signed_words(old), _signed_words(new)
    p = torch.from_numpy(pos.astype(np.int64))
    d = fingerprint_delta(p, ow[p], nw[p], info.word_size)
    fp_old = tensor_fingerprint(old)
    assert update_fingerprint(fp_old, d) == tensor_fingerprint(new) == ref_fingerprint(new)
    if k == 0:
        assert d == 0


@pytest.mark.parametrize("dt", ["uint8", "float16", "float32", "complex128"])
@pytest.mark.parametrize("start,length", [(0, 1), (5, 40), (32760, 20), (65530, 20), (131060, 200), (262100, 300)])
def test_words_range_delta_equals_full(dt, start, length):
    from deltasync.fingerprint import words_range_delta

    info = DTYPES[dt]
    rng = np.random.default_rng(start + length)
    nwords = start + length + 7
    numel = -(-nwords // info.words_per_element)
    old = random_tensor(rng, dt, (numel,))
    pos = np.arange(start, start + length)
    new = _change(rng, old, pos[rng.random(length) < 0.5])
    ow, nw = _signed_words(old), _signed_words(new)
    d = words_range_delta(ow[start:start + length], nw[start:start + length], start, info.word_size)
    assert update_fingerprint(tensor_fingerprint(old), d) == tensor_fingerprint(new)


@settings(max_examples=60, deadline=None)
@given(dt=st.sampled_from(DTYPE_NAMES), numel=st.integers(0, 300), seed=st.integers(0, 2**32 - 1),
       frac=st.floats(0, 1))
def test_property_incremental_equals_full(dt, numel, seed, frac):
    rng = np.random.default_rng(seed)
    info = DTYPES[dt]
    old = random_tensor(rng, dt, (numel,))
    nwords = numel * info.words_per_element
    pos = np.flatnonzero(rng.random(nwords) < frac)
    new = _change(rng, old, pos)
    p = torch.from_numpy(pos.astype(np.int64))
    d = fingerprint_delta(p, _signed_words(old)[p], _signed_words(new)[p], info.word_size)
    assert update_fingerprint(tensor_fingerprint(old), d) == tensor_fingerprint(new) == ref_fingerprint(new)


# -- layout independence ---------------------------------------------------------------------------

@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_same_for_contiguous_and_non_contiguous_copies(dt):
    rng = np.random.default_rng(len(dt))
    t = random_tensor(rng, dt, (6, 5, 4))
    fp = tensor_fingerprint(t)
    es = t.element_size()
    b = t.reshape(-1).view(torch.uint8).reshape(6, 5, 4, es)
    transposed = b.permute(2, 1, 0, 3).contiguous().view(t.dtype).squeeze(-1).permute(2, 1, 0)
    buf = torch.zeros(12, 5, 4, es, dtype=torch.uint8)
    buf[::2] = b
    sliced = buf.view(t.dtype).squeeze(-1)[::2]
    for other in (transposed, sliced):
        assert not other.is_contiguous()
        assert tensor_bytes(other) == tensor_bytes(t)
        assert tensor_fingerprint(other) == fp
    assert tensor_fingerprint(t.clone()) == fp


def test_channels_last_and_expanded_tensors():
    t = torch.randn(2, 3, 4, 5)
    assert tensor_fingerprint(t.to(memory_format=torch.channels_last)) == tensor_fingerprint(t)
    e = torch.arange(4, dtype=torch.float32).expand(3, 4)  # stride 0
    assert tensor_fingerprint(e) == tensor_fingerprint(e.contiguous()) == ref_fingerprint(e.contiguous())


# -- sensitivity ------------------------------------------------------------------------------------

def test_every_single_lane_change_changes_it():
    """Odd keys: any change of one lane moves the sum, at block edges and everywhere else."""
    n = 262144 + 70000
    rng = np.random.default_rng(0)
    base = random_tensor(rng, "bfloat16", (n,))
    fp = tensor_fingerprint(base)
    raw = bytearray(tensor_bytes(base))
    lanes = [0, 1, 65535, 65536, 65537, 131072, 262143, 262144, 262145, n - 1] + list(rng.integers(0, n, 10))
    for lane in lanes:
        for delta in (1, 0x8000, 0xFFFF, 0x0100):
            mod = bytearray(raw)
            v = (mod[2 * lane] | mod[2 * lane + 1] << 8) ^ delta
            mod[2 * lane], mod[2 * lane + 1] = v & 0xFF, v >> 8
            assert tensor_fingerprint(from_bytes(bytes(mod), torch.bfloat16, (n,))) != fp, (lane, delta)
    # and for every lane of the tensor: its key is odd, so any lane change d (0 < |d| < 2**16) moves
    # the sum by d * K(i) != 0 mod 2**64
    from deltasync.kernels.fpkeys import lane_keys

    keys = lane_keys(torch.arange(n, dtype=torch.int64))
    assert bool(((keys & 1) == 1).all())
    assert np.array_equal(keys.numpy().view(np.uint64), ref_keys(np.arange(n)))


@pytest.mark.parametrize("dt", ["uint8", "bfloat16", "float32", "int64"])
def test_swapping_two_different_elements_changes_it(dt):
    rng = np.random.default_rng(1)
    numel = 300000 // DTYPES[dt].element_size
    t = random_tensor(rng, dt, (numel,))
    fp = tensor_fingerprint(t)
    es = DTYPES[dt].element_size
    raw = tensor_bytes(t)
    pairs = [(0, 1), (0, numel - 1), (65535 // es, 65536 // es + 1)] + [tuple(rng.integers(0, numel, 2)) for _ in range(10)]
    for i, j in pairs:
        i, j = int(i), int(j)
        a, b = raw[i * es:(i + 1) * es], raw[j * es:(j + 1) * es]
        if a == b or i == j:
            continue
        mod = bytearray(raw)
        mod[i * es:(i + 1) * es], mod[j * es:(j + 1) * es] = b, a
        assert tensor_fingerprint(from_bytes(bytes(mod), t.dtype, t.shape)) != fp, (i, j)


def test_zeros_of_different_lengths_differ():
    fps = {tensor_fingerprint(torch.zeros(n, dtype=torch.uint8)) for n in range(0, 50)}
    assert len(fps) == 50


# -- state fingerprints -------------------------------------------------------------------------------

def test_state_fingerprint_is_order_independent_and_sensitive():
    a = {"x": torch.arange(4, dtype=torch.float32), "y": torch.ones(2, 2, dtype=torch.bfloat16)}
    b = {"y": a["y"].clone(), "x": a["x"].clone()}
    sa = state_fingerprint_of(a)
    assert sa == state_fingerprint_of(b)
    assert len(sa) == 16 and int(sa, 16) >= 0
    fps = fingerprint_state(a)
    recs = [(n, dtype_info(t.dtype).name, tuple(t.shape), fps[n]) for n, t in a.items()]
    assert state_fingerprint(recs) == state_fingerprint(list(reversed(recs))) == sa
    variants = [
        [("x2", *recs[0][1:]), recs[1]],  # renamed
        [(recs[0][0], "int32", *recs[0][2:]), recs[1]],  # dtype
        [(recs[0][0], recs[0][1], (2, 2), recs[0][3]), recs[1]],  # shape
        [(*recs[0][:3], recs[0][3] ^ 1), recs[1]],  # tensor fp
        [recs[0]],  # a tensor fewer
    ]
    outs = {state_fingerprint(v) for v in variants}
    assert sa not in outs and len(outs) == len(variants)


def test_fp_hex_and_parse_round_trip():
    for v in (0, 1, 2**63, 2**64 - 1):
        assert parse_fp(fp_hex(v)) == v
        assert len(fp_hex(v)) == 16
    assert fp_hex(-1) == "ffffffffffffffff"
    assert update_fingerprint(2**64 - 1, 1) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_same_on_gpu_as_on_cpu(dt):
    t = random_tensor(np.random.default_rng(5), dt, (300001 // DTYPES[dt].element_size,))
    assert tensor_fingerprint(t.cuda()) == tensor_fingerprint(t)
    pos = torch.arange(0, t.numel() * DTYPES[dt].words_per_element, 997)
    w = word_view(t)
    nw = w.clone()
    nw[pos] ^= 1
    assert fingerprint_delta(pos.cuda(), w[pos].cuda(), nw[pos].cuda(), DTYPES[dt].word_size) == \
        fingerprint_delta(pos, w[pos], nw[pos], DTYPES[dt].word_size)


def test_state_fingerprint_matches_the_spec_text():
    """docs/FORMAT.md §2: xxh3-64 over `name \\0 dtype \\0 shape \\0 fp-hex \\n`, names in UTF-8 byte order."""
    import xxhash

    recs = [("\u00e9.w", "bfloat16", (2, 3), 0x1234), ("Z", "float32", (), 2**64 - 1), ("a", "int8", (0,), 0),
            ("\U0001f600", "complex64", (4,), 7), ("ab", "bool", (1, 1, 1), 5)]
    h = xxhash.xxh3_64(seed=0)
    for name, dt, shape, fp in sorted(recs, key=lambda r: r[0].encode("utf-8")):
        h.update(name.encode() + b"\0" + dt.encode() + b"\0" + ",".join(map(str, shape)).encode() + b"\0"
                 + f"{fp:016x}".encode() + b"\n")
    assert state_fingerprint(recs) == h.hexdigest()
    assert len(h.hexdigest()) == 16
