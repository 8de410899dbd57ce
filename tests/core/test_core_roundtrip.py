"""Core round trips: ``apply(encode(a, b), a) == b`` bit for bit, for every dtype and shape.

Everything is compared through byte views, so NaN payloads, -0.0, infinities and the
exotic dtypes (fp8, fp4x2, complex32) compare exactly. Values are random *bit patterns*
(so NaNs, infs and -0.0 occur), changed with a controlled density and kind of change.
"""

from __future__ import annotations

import warnings
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.apply import apply_delta, apply_prepared, live_tensors, prepare_delta
from deltasync.codec import EncodeOptions, decode_blob, encode_delta
from deltasync.dtypes import DTYPES, dtype_info
from deltasync.errors import ChainError, IntegrityError
from deltasync.fingerprint import fp_hex, state_fingerprint_of, tensor_fingerprint
from deltasync.manifest import parse_manifest

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")

DTYPE_NAMES = sorted(DTYPES)
DENSITIES = ("none", "one", "sparse", "tenth", "half", "all")
KINDS = ("ulp", "big", "sign", "raw", "mixed")


# -- helpers (kept local so every core test file stands alone) ---------------------------------

def tensor_bytes(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor in row-major order, whatever its strides."""
    t = t.detach()
    if t.numel() == 0:
        return b""
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 1:  # torch calls a 1-element tensor contiguous whatever its stride
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8).numpy().tobytes()


def state_bytes(state) -> dict[str, bytes]:
    return {n: tensor_bytes(t) for n, t in state.items()}


def words_of(t: torch.Tensor) -> np.ndarray:
    info = dtype_info(t.dtype)
    return np.frombuffer(tensor_bytes(t), dtype=f"<u{info.word_size}").copy()


def from_words(words: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` whose bytes are ``words``."""
    info = dtype_info(dtype)
    raw = np.ascontiguousarray(words).view(np.uint8)
    if raw.size == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.from_numpy(raw.copy()).view(info.torch_dtype).reshape(tuple(shape))


def with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same logical tensor, stored contiguous, transposed or as a strided slice."""
    if layout == "contig" or t.dim() == 0 or t.numel() <= 1:
        # (one-element strided views: see test_one_element_strided_view_round_trips)
        return t.clone() if t.numel() else t
    es = t.element_size()
    b = t.contiguous().reshape(-1).view(torch.uint8).reshape(*t.shape, es)
    if layout == "transposed" and t.dim() >= 2:
        perm = list(range(t.dim()))
        perm[0], perm[1] = perm[1], perm[0]
        stored = b.permute(*perm, t.dim()).contiguous()  # physical (s1, s0, ..., es)
        out = stored.view(t.dtype).squeeze(-1).transpose(0, 1)
    else:  # every other row of a twice-as-tall buffer (filled with junk)
        buf = torch.full((2 * t.shape[0], *t.shape[1:], es), 0xA5, dtype=torch.uint8)
        if t.dtype == torch.bool:
            buf.fill_(1)
        buf[::2] = b
        out = buf.view(t.dtype).squeeze(-1)[::2]
    assert tensor_bytes(out) == tensor_bytes(t)
    return out


def random_words(rng: np.random.Generator, info, n: int) -> np.ndarray:
    w = np.frombuffer(rng.bytes(n * info.word_size), dtype=f"<u{info.word_size}").copy()
    if info.name == "bool":
        w &= 1
    return w


def pick_positions(rng: np.random.Generator, n: int, density: str) -> np.ndarray:
    if n == 0 or density == "none":
        return np.empty(0, dtype=np.int64)
    if density == "one":
        return rng.integers(0, n, 1)
    if density == "all":
        return np.arange(n)
    frac = {"sparse": 0.01, "tenth": 0.1, "half": 0.5}[density]
    k = max(1, int(round(frac * n)))
    return np.sort(rng.choice(n, size=k, replace=False))


def mutate(rng: np.random.Generator, words: np.ndarray, info, density: str, kind: str) -> np.ndarray:
    """New words: ``words`` changed at positions picked by ``density`` in the way ``kind`` says."""
    new = words.copy()
    p = pick_positions(rng, words.size, density)
    if p.size == 0:
        return new
    if info.name == "bool":
        new[p] ^= 1
        return new
    bits = info.word_size * 8
    wdt = new.dtype
    kinds = rng.choice(["ulp", "big", "sign", "raw"], size=p.size) if kind == "mixed" else np.full(p.size, kind)
    with np.errstate(over="ignore"):
        for k in ("ulp", "big", "sign", "raw"):
            sel = p[kinds == k]
            if sel.size == 0:
                continue
            if k == "ulp":
                step = np.where(rng.random(sel.size) < 0.5, 1, -1).astype(np.int64).astype(wdt)
                new[sel] = new[sel] + step
            elif k == "big":
                lo = min(200, 1 << (bits - 2))
                mag = rng.integers(lo, 1 << min(bits - 1, 62), sel.size, dtype=np.uint64, endpoint=True)
                new[sel] = new[sel] + mag.astype(wdt)
            elif k == "sign":
                new[sel] = new[sel] ^ wdt.type(1 << (bits - 1))
            else:
                new[sel] = random_words(rng, info, sel.size)
    return new


def make_pair(seed: int, spec):
    """spec: list of (name, dtype name, shape, density, kind, old layout, new layout)."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for name, dt, shape, density, kind, lo, ln in spec:
        info = DTYPES[dt]
        n = int(np.prod(shape, dtype=np.int64)) * info.words_per_element
        ow = random_words(rng, info, n)
        nw = mutate(rng, ow, info, density, kind)
        old[name] = with_layout(from_words(ow, info.torch_dtype, shape), lo)
        new[name] = with_layout(from_words(nw, info.torch_dtype, shape), ln)
    return old, new


def contiguous_copy(state):
    return {n: from_words(words_of(t), t.dtype, t.shape) for n, t in state.items()}


def roundtrip(old, new, options=None, *, target=None, verify="incremental"):
    enc = encode_delta(old, new, model="policy", version=2, parent=1, options=options)
    # the manifest survives its own JSON
    m = parse_manifest(enc.manifest.to_json())
    assert m == enc.manifest
    target = contiguous_copy(old) if target is None else target
    fps = apply_delta(target, m, enc.blobs, verify=verify)
    return enc, target, fps


def assert_state_equal(got, want):
    assert set(got) == set(want)
    for n in want:
        assert got[n].dtype == want[n].dtype, n
        assert tuple(got[n].shape) == tuple(want[n].shape), n
        assert tensor_bytes(got[n]) == tensor_bytes(want[n]), f"{n}: bytes differ"


def changed_words(old, new) -> dict[str, int]:
    return {n: int((words_of(old[n]) != words_of(new[n])).sum()) for n in old}


# -- deterministic: every dtype x density x kind ------------------------------------------------

SMALL = EncodeOptions(chunk_words=7, blob_target=48)


@pytest.mark.parametrize("dt", DTYPE_NAMES)
@pytest.mark.parametrize("density", DENSITIES)
def test_every_dtype_every_density(dt, density):
    spec = [
        ("a.scalar", dt, (), density, "mixed", "contig", "contig"),
        ("b.empty", dt, (0, 5), density, "mixed", "contig", "contig"),
        ("c.vec", dt, (37,), density, "ulp", "contig", "sliced"),
        ("d.mat", dt, (9, 11), density, "mixed", "transposed", "contig"),
        ("e.cube", dt, (3, 4, 5), density, "raw", "sliced", "transposed"),
        ("f.big", dt, (300,), density, "big", "contig", "contig"),
        ("g.sign", dt, (23,), density, "sign", "contig", "contig"),
    ]
    old, new = make_pair(zlib.crc32(f"{dt}-{density}".encode()), spec)
    for options in (None, SMALL):
        enc, target, fps = roundtrip(old, new, options)
        assert_state_equal(target, new)
        # fingerprints: returned == manifest == encoder == a full scrub of the result
        for rec in enc.manifest.tensors:
            assert fp_hex(fps[rec.name]) == rec.fp_after == fp_hex(tensor_fingerprint(target[rec.name]))
            assert fp_hex(enc.fps[rec.name]) == rec.fp_after
            assert rec.fp_before == fp_hex(tensor_fingerprint(old[rec.name]))
        assert enc.manifest.state_fp == state_fingerprint_of(target)
        assert enc.manifest.state_fp_before == state_fingerprint_of(old)
        # ``changed`` counts exactly the words that differ
        want = changed_words(old, new)
        assert {r.name: r.changed for r in enc.manifest.tensors} == want
        if density == "none" or all(v == 0 for v in want.values()):
            assert enc.manifest.blobs == ()


@pytest.mark.parametrize("dt", [d for d in DTYPE_NAMES if DTYPES[d].is_float])
def test_special_float_values_round_trip(dt):
    """Every transition among +-0, +-inf, NaNs with payloads, min/max subnormals, ±1 ULP."""
    info = DTYPES[dt]
    bits = info.word_size * 8
    top = 1 << (bits - 1)
    full = (1 << bits) - 1
    specials = sorted({0, top, 1, top | 1, full, top - 1, full >> 1, (full >> 1) - 1,
                       top >> 1, (top >> 1) + 1, top | (top >> 1), 0x7C00 & full, 0x7F80 & full,
                       0x7E00 & full, 0xFC00 & full, 0xFF80 & full, 0x80 & full, 0x7F & full, 0xFF & full})
    sp = np.array(specials, dtype=np.uint64).astype(f"<u{info.word_size}")
    ow = np.repeat(sp, sp.size)
    nw = np.tile(sp, sp.size)
    shape = (ow.size // info.words_per_element,)
    ow, nw = ow[: shape[0] * info.words_per_element], nw[: shape[0] * info.words_per_element]
    old = {"w": from_words(ow, info.torch_dtype, shape)}
    new = {"w": from_words(nw, info.torch_dtype, shape)}
    for options in (None, EncodeOptions(chunk_words=5, blob_target=32)):
        _, target, _ = roundtrip(old, new, options)
        assert_state_equal(target, new)
        # and back again
        _, back, _ = roundtrip(new, old, options)
        assert_state_equal(back, old)


def test_all_dtypes_in_one_state_many_chunks_and_blobs():
    spec = [(f"t{i:02d}.{dt}", dt, (5, 13), "tenth", "mixed", "contig", "contig") for i, dt in enumerate(DTYPE_NAMES)]
    old, new = make_pair(7, spec)
    opts = EncodeOptions(chunk_words=4, blob_target=64)
    enc, target, _ = roundtrip(old, new, opts)
    assert_state_equal(target, new)
    assert len(enc.manifest.blobs) > 5
    # every blob decodes, chunks are within their tensors and carry the word width of their dtype
    for ref in enc.manifest.blobs:
        assert len(enc.blobs[ref.id]) == ref.size
        for p in decode_blob(enc.blobs[ref.id]):
            assert 0 <= p.start < p.stop
            assert p.stop - p.start <= 4
    # chunk refs of each tensor are in word order and never overlap
    for rec in enc.manifest.tensors:
        patches = {}
        for ref in enc.manifest.blobs:
            patches[ref.id] = decode_blob(enc.blobs[ref.id])
        spans = [(patches[c.blob][c.index].start, patches[c.blob][c.index].stop) for c in rec.chunks]
        assert spans == sorted(spans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("words", [1, 6, 7, 8, 13, 14, 15, 49, 50])
@pytest.mark.parametrize("chunk_words", [1, 7])
def test_sizes_around_chunk_boundaries(words, chunk_words):
    opts = EncodeOptions(chunk_words=chunk_words, blob_target=20)
    for density in ("one", "half", "all"):
        for kind in ("ulp", "raw"):
            old, new = make_pair(words * 31 + chunk_words, [("x", "bfloat16", (words,), density, kind, "contig", "contig")])
            enc, target, _ = roundtrip(old, new, opts)
            assert_state_equal(target, new)
            n_chunks = sum(len(r.chunks) for r in enc.manifest.tensors)
            assert n_chunks <= -(-words // chunk_words)


def test_dense_and_sparse_modes_all_appear():
    """A re-initialised tensor goes dense, a 30% change uses the bitmap, a sparse one gaps (blob format 1;
    format 2's modes: tests/core/test_core_codec2.py)."""
    rng = np.random.default_rng(3)
    n = 4096
    ow = random_words(rng, DTYPES["float16"], n)
    sparse = ow.copy()
    sparse[rng.choice(n, 5, replace=False)] += 1
    sparse[0] += 1  # gap 0 at the front
    sparse[n - 1] += 1  # and a long gap (> 255, escaped to gapx) before the end
    mid = ow.copy()
    mid[rng.choice(n, n * 3 // 10, replace=False)] -= 1
    old = {n_: from_words(ow, torch.float16, (n,)) for n_ in ("a", "b", "c")}
    new = {"a": from_words(sparse, torch.float16, (n,)), "b": from_words(mid, torch.float16, (n,)),
           "c": from_words(random_words(rng, DTYPES["float16"], n), torch.float16, (n,))}
    enc, target, _ = roundtrip(old, new, EncodeOptions(format=1))
    assert_state_equal(target, new)
    modes = {}
    import json
    import struct
    for data in enc.blobs.values():
        (hlen,) = struct.unpack_from("<I", data, 12)
        header = json.loads(data[16:16 + hlen])
        for c in header["chunks"]:
            modes[c["tensor"]] = c["mode"]
        assert "gapx" in header["streams"]
    assert modes == {"a": "gap", "b": "bitmap", "c": "dense"}


# -- property test ----------------------------------------------------------------------------

shapes = st.one_of(
    st.just(()), st.just((0,)), st.just((4, 0)),
    st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    st.integers(1, 700).map(lambda n: (n,)),
)
layouts = st.sampled_from(["contig", "transposed", "sliced"])


@st.composite
def specs(draw):
    n = draw(st.integers(1, 3))
    out = []
    for i in range(n):
        out.append((f"layer{i}.w", draw(st.sampled_from(DTYPE_NAMES)), draw(shapes), draw(st.sampled_from(DENSITIES)),
                    draw(st.sampled_from(KINDS)), draw(layouts), draw(layouts)))
    return out


options_st = st.one_of(
    st.just(None),
    st.builds(lambda c, b: EncodeOptions(chunk_words=c, blob_target=b),
              st.sampled_from([1, 2, 3, 5, 8, 64, 1000]), st.sampled_from([1, 16, 100, 5000])),
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), seed=st.integers(0, 2**32 - 1), options=options_st, live_layout=layouts)
def test_property_apply_encode_round_trip(spec, seed, options, live_layout):
    old, new = make_pair(seed, spec)
    # the live target may itself be non-contiguous: a strided view into a larger buffer
    target = {n: with_layout(from_words(words_of(t), t.dtype, t.shape), live_layout) for n, t in old.items()}
    objects = {n: t for n, t in target.items()}
    enc, target, fps = roundtrip(old, new, options, target=target)
    assert_state_equal(target, new)
    for n, t in target.items():
        assert t is objects[n]  # patched in place, the very same tensor objects
        assert fp_hex(fps[n]) == fp_hex(tensor_fingerprint(new[n]))
        if t._base is not None:  # the junk around a strided view is untouched
            expect = with_layout(from_words(words_of(new[n]), t.dtype, t.shape), live_layout)
            assert tensor_bytes(t._base) == tensor_bytes(expect._base)
    # reverse direction too (a delta is only valid on its own base)
    _, back, _ = roundtrip(new, old, options)
    assert_state_equal(back, old)


@pytest.mark.parametrize("where", ["old", "new", "live"])
def test_one_element_strided_view_round_trips(where):
    buf = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    one = buf[::2][:1]  # shape (1,), stride (2,): is_contiguous() is True
    assert one.is_contiguous() and one.stride() == (2,)
    old = {"a": one if where == "old" else one.clone()}
    new_t = torch.tensor([7.0], dtype=torch.bfloat16)
    new = {"a": buf[1::2][:1].copy_(new_t) if where == "new" else new_t}
    target = {"a": buf[::2][:1]} if where == "live" else contiguous_copy(old)
    before = tensor_bytes(target["a"])
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    apply_delta(target, enc.manifest, enc.blobs)
    assert tensor_bytes(target["a"]) == tensor_bytes(new_t) != before


# -- API behaviour ------------------------------------------------------------------------------

def test_base_fps_given_equals_computed_and_progress_reaches_total():
    old, new = make_pair(11, [("a", "float32", (50, 3), "tenth", "mixed", "contig", "contig"),
                              ("b", "int64", (17,), "one", "raw", "contig", "contig")])
    seen = []
    e1 = encode_delta(old, new, model="m", version=5, parent=4, options=SMALL, progress=lambda d, t: seen.append((d, t)))
    e2 = encode_delta(old, new, model="m", version=5, parent=4, options=SMALL,
                      base_fps={n: tensor_fingerprint(t) for n, t in old.items()})
    assert e1.manifest == e2.manifest and e1.blobs == e2.blobs
    total = 50 * 3 * 4 + 17 * 8
    assert seen and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_encoding_is_deterministic():
    old, new = make_pair(12, [("a", "bfloat16", (64, 8), "tenth", "mixed", "contig", "contig")])
    e1 = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    e2 = encode_delta(contiguous_copy(old), contiguous_copy(new), model="m", version=2, parent=1, options=SMALL)
    assert e1.manifest.to_json() == e2.manifest.to_json()
    assert e1.blobs == e2.blobs


@pytest.mark.parametrize("change", ["added", "removed", "dtype", "shape"])
def test_layout_change_is_a_chain_error(change):
    old = {"a": torch.zeros(4), "b": torch.zeros(2, 2)}
    new = {"a": torch.zeros(4), "b": torch.zeros(2, 2)}
    if change == "added":
        new["c"] = torch.zeros(1)
    elif change == "removed":
        del new["b"]
    elif change == "dtype":
        new["b"] = torch.zeros(2, 2, dtype=torch.float16)
    else:
        new["b"] = torch.zeros(4)
    with pytest.raises(ChainError):
        encode_delta(old, new, model="m", version=2, parent=1)


def test_identical_states_make_an_empty_delta_that_applies():
    old, _ = make_pair(13, [("a", "float16", (8,), "none", "ulp", "contig", "contig")])
    enc, target, fps = roundtrip(old, contiguous_copy(old))
    assert enc.blobs == {} and enc.manifest.blobs == ()
    assert all(r.changed == 0 and r.chunks == () and r.fp_before == r.fp_after for r in enc.manifest.tensors)
    assert_state_equal(target, old)


def test_verify_full_equals_incremental():
    old, new = make_pair(14, [("a", "float8_e4m3fn", (40, 3), "half", "mixed", "transposed", "contig"),
                              ("b", "complex64", (9,), "sparse", "ulp", "contig", "contig")])
    _, t1, f1 = roundtrip(old, new, SMALL, verify="incremental")
    _, t2, f2 = roundtrip(old, new, SMALL, verify="full")
    assert f1 == f2
    assert_state_equal(t1, t2)


def test_prepare_then_apply_prepared_with_tracked_fps():
    old, new = make_pair(15, [("a", "bfloat16", (33, 7), "tenth", "ulp", "contig", "contig")])
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    prepared = prepare_delta(enc.manifest, lambda bid: enc.blobs[bid])  # a callable blob source works too
    target = contiguous_copy(old)
    fps = {n: tensor_fingerprint(t) for n, t in target.items()}
    new_fps = apply_prepared(target, prepared, fps)
    assert_state_equal(target, new)
    assert new_fps == enc.fps


# -- nn.Module targets: in place, no reallocation ---------------------------------------------

class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)
        self.emb = torch.nn.Embedding(32, 16).to(torch.bfloat16)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(8, dtype=torch.bool))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _module_states(seed):
    torch.manual_seed(seed)
    m = Tiny()
    old = {k: v.detach().clone() for k, v in m.state_dict().items()}
    rng = np.random.default_rng(seed)
    new = {}
    for k, v in old.items():
        info = dtype_info(v.dtype)
        new[k] = from_words(mutate(rng, words_of(v), info, "tenth", "mixed"), v.dtype, v.shape)
    return m, old, new


@pytest.mark.parametrize("verify", ["incremental", "full"])
def test_apply_into_module_in_place(verify):
    m, old, new = _module_states(0)
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    sd = m.state_dict(keep_vars=True)
    ptrs = {k: v.data_ptr() for k, v in sd.items()}
    params = {k: id(v) for k, v in sd.items()}
    requires = {k: v.requires_grad for k, v in sd.items()}
    fps = apply_delta(m, enc.manifest, enc.blobs, verify=verify)
    sd2 = m.state_dict(keep_vars=True)
    assert {k: v.data_ptr() for k, v in sd2.items()} == ptrs  # no reallocation
    assert {k: id(v) for k, v in sd2.items()} == params  # the same Parameter/buffer objects
    assert {k: v.requires_grad for k, v in sd2.items()} == requires
    assert_state_equal({k: v.detach() for k, v in sd2.items()}, new)
    assert fps == enc.fps
    assert "scratch" not in live_tensors(m)


def test_apply_into_module_with_non_contiguous_parameter():
    m, _, _ = _module_states(1)
    with torch.no_grad():
        m.lin.weight = torch.nn.Parameter(m.lin.weight.detach().t().contiguous().t())  # column-major storage
    assert not m.lin.weight.is_contiguous()
    old = {k: v.detach().clone() for k, v in m.state_dict().items()}
    rng = np.random.default_rng(1)
    new = {k: from_words(mutate(rng, words_of(v), dtype_info(v.dtype), "half", "mixed"), v.dtype, v.shape)
           for k, v in old.items()}
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    w = m.lin.weight
    ptr, stride = w.data_ptr(), w.stride()
    apply_delta(m, enc.manifest, enc.blobs)
    assert m.lin.weight is w and w.data_ptr() == ptr and w.stride() == stride
    assert_state_equal({k: v.detach() for k, v in m.state_dict().items()}, new)


def _tied_states():
    torch.manual_seed(2)

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # weight tying, as in most LLMs

    m = Tied()
    old = {k: v.detach().clone() for k, v in m.state_dict().items()}
    assert set(old) == {"embed.weight", "head.weight"}
    w = words_of(old["embed.weight"])
    w[3] += 1  # +1 ULP
    w[17] -= 1  # -1 ULP
    t = from_words(w, torch.float32, old["embed.weight"].shape)
    new = {"embed.weight": t, "head.weight": t.clone()}
    return m, old, new


@pytest.mark.parametrize("target_kind", ["module", "dict"])
def test_apply_into_tied_weights(target_kind):
    m, old, new = _tied_states()
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    target = m if target_kind == "module" else {"embed.weight": m.embed.weight.data, "head.weight": m.embed.weight.data}
    try:
        apply_delta(target, enc.manifest, enc.blobs)
    finally:
        # whatever happens, the shared weight is either the new version or untouched -- never a third state
        got = tensor_bytes(m.embed.weight)
        assert got in (tensor_bytes(new["embed.weight"]), tensor_bytes(old["embed.weight"])), "silently corrupted"
    assert got == tensor_bytes(new["embed.weight"])


def test_apply_into_tied_weights_full_verify_refuses_and_rolls_back():
    """With a full re-scrub the double patch is noticed and undone (the fallback until aliasing is handled)."""
    m, old, new = _tied_states()
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    try:
        apply_delta(m, enc.manifest, enc.blobs, verify="full")
    except IntegrityError:
        assert tensor_bytes(m.embed.weight) == tensor_bytes(old["embed.weight"])
    else:
        assert tensor_bytes(m.embed.weight) == tensor_bytes(new["embed.weight"])


# -- odd but legal inputs ---------------------------------------------------------------------------

def test_parameters_that_require_grad_encode_and_apply():
    torch.manual_seed(3)
    old = {"w": torch.nn.Parameter(torch.randn(5, 4)), "b": torch.nn.Parameter(torch.randn(4))}
    new = {k: torch.nn.Parameter(v.detach() * 1.5) for k, v in old.items()}
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    live = {k: torch.nn.Parameter(v.detach().clone()) for k, v in old.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    apply_delta(live, enc.manifest, enc.blobs)
    assert_state_equal(live, new)
    assert all(v.requires_grad and v.data_ptr() == ptrs[k] for k, v in live.items())


def test_unusual_tensor_names_round_trip():
    names = ["\u00fc/\u5c42.weight", "a b", "x.y-z_0", "n" * 1024, "\u2603"]
    old = {n: torch.full((3,), float(i)) for i, n in enumerate(names)}
    new = {n: t + 1 for n, t in old.items()}
    enc, target, _ = roundtrip(old, new, SMALL)
    assert_state_equal(target, new)


def test_empty_state_round_trips():
    enc, target, fps = roundtrip({}, {})
    assert target == {} and fps == {} and enc.manifest.tensors == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_gpu_encode_and_apply_match_cpu(dt):
    old, new = make_pair(zlib.crc32(dt.encode()), [("a", dt, (300, 7), "tenth", "mixed", "contig", "transposed"),
                                                     ("b", dt, (5,), "all", "raw", "contig", "contig")])
    cpu = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    gpu = encode_delta({n: t.cuda() for n, t in old.items()}, {n: t.cuda() for n, t in new.items()},
                       model="m", version=2, parent=1, options=SMALL)
    assert gpu.manifest == cpu.manifest and gpu.blobs == cpu.blobs  # only the sparse result crossed to the host
    live = {n: from_words(words_of(t), t.dtype, t.shape).cuda() for n, t in old.items()}
    ptrs = {n: t.data_ptr() for n, t in live.items()}
    apply_delta(live, cpu.manifest, cpu.blobs)
    assert {n: t.data_ptr() for n, t in live.items()} == ptrs
    assert_state_equal({n: t.cpu() for n, t in live.items()}, new)


def test_default_chunk_boundary_with_real_sizes():
    """Words around the default 4 Mi-word chunk edge, with the default options (one tensor of 8 MiB)."""
    from deltasync.codec import DEFAULT_CHUNK_WORDS

    n = DEFAULT_CHUNK_WORDS + 5
    rng = np.random.default_rng(21)
    ow = random_words(rng, DTYPES["bfloat16"], n)
    nw = ow.copy()
    edge = DEFAULT_CHUNK_WORDS
    p = np.array([0, 1, edge - 2, edge - 1, edge, edge + 1, n - 1] + list(rng.choice(n, 2000, replace=False)))
    nw[p] += 1
    nw[edge - 1] ^= 0x8000  # a raw word right before the edge
    old = {"big": from_words(ow, torch.bfloat16, (n,))}
    new = {"big": from_words(nw, torch.bfloat16, (n,))}
    enc, target, fps = roundtrip(old, new)
    assert len(enc.manifest.tensor("big").chunks) == 2
    assert_state_equal(target, new)
    assert fps["big"] == tensor_fingerprint(new["big"])
