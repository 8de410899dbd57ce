"""Blob format 2 (docs/FORMAT.md §4.3): rANS-coded positions and steps, round trips, corrupt input,
old blobs still decoding, and chains mixing both formats squashing to the direct delta."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.kernels import rans
from deltasync.apply import apply_delta
from deltasync.blob import BlobReader
from deltasync.codec import ChunkPacker, EncodeOptions, decode_blob, encode_delta
from deltasync.dtypes import dtype_info, numpy_word_dtype
from deltasync.entropy import AnsTables
from deltasync.errors import FormatError
from deltasync.squash import squash_chain
from deltasync.values import Changes

from core_support import from_words, tensor_bytes, words_of

WORD = {1: "uint8", 2: "bfloat16", 4: "float32", 8: "int64"}


def _changes(rng, n_words: int, count: int, w: int, big: float, raw: float) -> Changes:
    wdt = numpy_word_dtype(w)
    pos = np.sort(rng.choice(n_words, size=count, replace=False)).astype(np.int64)
    half = (1 << (8 * w - 1)) - 1
    mag = np.where(rng.random(count) < big, rng.integers(1, half, count, dtype=np.int64, endpoint=True) if w < 8
                   else rng.integers(1, 1 << 62, count, dtype=np.int64), rng.integers(1, 3, count))
    neg = rng.random(count) < 0.5
    with np.errstate(over="ignore"):
        m = mag.astype(np.uint64).astype(wdt)
        values = np.where(neg, ~m + wdt.type(1), m).astype(wdt)
    is_raw = rng.random(count) < raw
    values[is_raw] = rng.integers(0, 1 << min(8 * w, 63), int(is_raw.sum()), dtype=np.uint64).astype(wdt)
    return Changes(positions=pos, raw=is_raw, values=values)


def _pack(chunks, options=None):
    packer = ChunkPacker(options or EncodeOptions())
    for name, w, start, stop, ch in chunks:
        packer.add(name, dtype_info(WORD[w]), start, stop, ch)
    packer.close_blob()
    return packer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), w=st.sampled_from([1, 2, 4, 8]), density=st.sampled_from([0.001, 0.02, 0.3, 0.9]),
       big=st.sampled_from([0.0, 0.05, 1.0]), raw=st.sampled_from([0.0, 0.01, 0.5]))
def test_ans_chunks_round_trip_bit_for_bit(seed, w, density, big, raw):
    rng = np.random.default_rng(seed)
    chunks = []
    for k, n in enumerate((1, 5, 3000)):
        count = max(1, min(n, int(n * density)))
        ch = _changes(rng, n, count, w, big, raw)
        start = 10_000 * k
        chunks.append((f"t{k}", w, start, start + n, Changes(positions=ch.positions + start, raw=ch.raw, values=ch.values)))
    packer = _pack(chunks)
    (blob,) = packer.blobs.values()
    assert BlobReader(blob).version == 4
    (blob2,) = _pack(chunks, EncodeOptions(format=2)).blobs.values()  # the same chunks under JSON records
    assert BlobReader(blob2).version == 2
    assert [(p.tensor, p.start, p.stop, p.count) for p in decode_blob(blob2)] == \
        [(p.tensor, p.start, p.stop, p.count) for p in decode_blob(blob)]
    patches = decode_blob(blob)
    assert len(patches) == len(chunks)
    for p, (name, _, start, stop, ch) in zip(patches, chunks):
        assert (p.tensor, p.start, p.stop) == (name, start, stop)
        got = p.as_changes()
        assert np.array_equal(got.positions, ch.positions)
        assert np.array_equal(got.raw, ch.raw)
        assert np.array_equal(got.values, ch.values)


def test_format2_is_smaller_than_format1_on_an_adam_like_delta():
    rng = np.random.default_rng(1)
    n = 1 << 20
    old = rng.normal(0, 0.02, n).astype(np.float32)
    a = torch.from_numpy(old).to(torch.bfloat16)
    w = a.view(torch.int16).clone()
    idx = torch.from_numpy(rng.choice(n, n // 200, replace=False))
    w[idx] += torch.from_numpy(rng.choice([-1, 1], idx.numel()).astype(np.int16))
    b = w.view(torch.bfloat16)
    size = {f: sum(map(len, encode_delta({"x": a}, {"x": b}, model="m", version=1, parent=0,
                                         options=EncodeOptions(format=f)).blobs.values())) for f in (1, 2)}
    # random positions at 0.5% and +-1 steps: ~9.1 bits of gap + 1 bit of step per change is the entropy
    assert size[2] * 8 / (n // 200) < 10.6, size
    assert size[2] < 0.97 * size[1], size  # format 1 pays escapes of gaps >= 255 (~8% of them here)


def test_parallel_decode_equals_serial():
    rng = np.random.default_rng(2)
    chunks = [(f"t{k}", 2, 0, 5000, _changes(rng, 5000, 300, 2, 0.05, 0.01)) for k in range(6)]
    (blob,) = _pack(chunks).blobs.values()
    with ThreadPoolExecutor(2) as pool:
        par = decode_blob(blob, executor=pool)
    ser = decode_blob(blob)
    for p, q in zip(par, ser):
        assert np.array_equal(p.changes.positions, q.changes.positions)
        assert np.array_equal(p.changes.values, q.changes.values)


def test_huge_gaps_and_the_largest_steps():
    """Gaps past 2**32 (a 2**40-word tensor chunk; nothing is allocated per word) and |d| = 2**63."""
    pos = np.array([0, 1 << 33, (1 << 40) - 1], dtype=np.int64)
    values = np.array([1 << 63, (1 << 63) + 1, 5], dtype=np.uint64)
    ch = Changes(positions=pos, raw=np.zeros(3, np.bool_), values=values)
    packer = _pack([("t", 8, 0, 1 << 40, ch)], EncodeOptions(chunk_words=1 << 40))
    (p,) = decode_blob(next(iter(packer.blobs.values())))
    assert p.changes.positions.tolist() == pos.tolist()
    assert p.changes.values.tolist() == values.tolist()


def test_truncated_or_corrupt_messages_are_format_errors():
    rng = np.random.default_rng(3)
    ch = _changes(rng, 5000, 400, 2, 0.05, 0.01)
    gaps = np.diff(ch.positions, prepend=-1) - 1
    from deltasync.values import step_symbols
    sym, bneg, bmag, _ = step_symbols(ch, rans.SMALL, rans.BIG, rans.RAW)
    t = AnsTables.from_freqs(rans.normalize(np.bincount([int(g).bit_length() for g in gaps], minlength=rans.N_GAP)),
                             rans.normalize(np.bincount(sym, minlength=rans.N_VAL)))
    words = rans.encode_chunk(gaps, sym, bneg, bmag, t.g[0], t.g[1], t.v[0], t.v[1])
    ok = rans.decode_chunk(words, 400, 5000, *t.g, *t.v)
    assert ok[-1] == rans.OK and np.array_equal(ok[0], ch.positions)
    assert rans.decode_chunk(words[:-1], 400, 5000, *t.g, *t.v)[-1] != rans.OK
    assert rans.decode_chunk(np.concatenate([words, words[:1]]), 400, 5000, *t.g, *t.v)[-1] != rans.OK
    assert rans.decode_chunk(words, 399, 5000, *t.g, *t.v)[-1] != rans.OK  # state not back at L
    assert rans.decode_chunk(words, 400, int(ch.positions[-1]), *t.g, *t.v)[-1] == rans.E_GAP
    with pytest.raises(FormatError):
        AnsTables.parse(t.to_bytes()[:-1])
    bad = np.concatenate([t.g[0], t.v[0]]).astype(np.uint64)
    bad[0] += 1
    from deltasync.varint import encode_varints
    with pytest.raises(FormatError, match="sum to"):
        AnsTables.parse(encode_varints(bad))


def test_format1_blobs_still_decode_and_mixed_chains_squash_to_the_direct_delta():
    """A relay holding a chain published partly before the upgrade (format 1) and partly after (2)
    squashes it without the model; the squashed delta (format 2) applied to v0 equals v3."""
    rng = np.random.default_rng(4)
    n = 50_000
    base = rng.normal(0, 0.05, n).astype(np.float32)
    states = [torch.from_numpy(base).to(torch.bfloat16)]
    for _ in range(3):
        w = states[-1].view(torch.int16).clone()
        idx = torch.from_numpy(rng.choice(n, 800, replace=False))
        w[idx] += torch.from_numpy(rng.integers(-3, 4, 800).astype(np.int16))
        w[idx[:3]] ^= -32768  # sign flips: raw words
        states.append(w.view(torch.bfloat16))
    encs = [encode_delta({"x": a}, {"x": b}, model="m", version=v + 1, parent=v, options=EncodeOptions(format=f))
            for v, (a, b, f) in enumerate(zip(states, states[1:], (1, 2, 1)))]
    versions = [BlobReader(b).version for e in encs for b in e.blobs.values()]
    assert versions == [1, 2, 1]
    blobs = {k: v for e in encs for k, v in e.blobs.items()}
    sq = squash_chain([e.manifest for e in encs], blobs.__getitem__)
    assert all(BlobReader(b).version == 2 for b in sq.blobs.values())  # the chain's newest format
    sq1 = squash_chain([e.manifest for e in encs[:1]] , blobs.__getitem__)
    assert all(BlobReader(b).version == 1 for b in sq1.blobs.values())  # a format 1 chain stays readable by old readers
    live = {"x": states[0].clone()}
    apply_delta(live, sq.manifest, sq.blobs)
    assert tensor_bytes(live["x"]) == tensor_bytes(states[3])
    direct = encode_delta({"x": states[0]}, {"x": states[3]}, model="m", version=3, parent=0)
    d_patch = [p for b in direct.blobs.values() for p in decode_blob(b)]
    s_patch = [p for b in sq.blobs.values() for p in decode_blob(b)]
    # the same changes (positions and final words), whatever the coding chose for each
    def final_words(patches):
        out = words_of(states[0]).copy()
        for p in patches:
            c = p.as_changes()
            with np.errstate(over="ignore"):
                out[c.positions] = np.where(c.raw, c.values, out[c.positions] + c.values)
        return out
    assert np.array_equal(final_words(d_patch), final_words(s_patch))
    assert sum(len(p.as_changes()) for p in d_patch) == sum(len(p.as_changes()) for p in s_patch)


def test_chains_mixing_versions_2_and_4_squash_in_version_4():
    """A chain published across the upgrade to blob version 4 (2, 4, 2) squashes, without the model, into version
    4 (the newest in the chain), equal to its versions applied one by one; a base-conditioned (version 3) blob
    after a version-4 one is still refused (the check is per blob, not on the newest version seen)."""
    rng = np.random.default_rng(9)
    n = 20_000
    states = [torch.from_numpy(rng.normal(0, 0.05, n).astype(np.float32)).to(torch.bfloat16)]
    for _ in range(3):
        w = states[-1].view(torch.int16).clone()
        idx = torch.from_numpy(rng.choice(n, 300, replace=False))
        w[idx] += torch.from_numpy(rng.integers(1, 4, 300).astype(np.int16))
        states.append(w.view(torch.bfloat16))
    encs = [encode_delta({"x": a}, {"x": b}, model="m", version=v + 1, parent=v, options=EncodeOptions(format=f))
            for v, (a, b, f) in enumerate(zip(states, states[1:], (2, 4, 2)))]
    assert [BlobReader(b).version for e in encs for b in e.blobs.values()] == [2, 4, 2]
    blobs = {k: v for e in encs for k, v in e.blobs.items()}
    sq = squash_chain([e.manifest for e in encs], blobs.__getitem__)
    assert {BlobReader(b).version for b in sq.blobs.values()} == {4}
    live = {"x": states[0].clone()}
    apply_delta(live, sq.manifest, sq.blobs)
    assert tensor_bytes(live["x"]) == tensor_bytes(states[3])
    cond = encode_delta({"x": states[2]}, {"x": states[3]}, model="m", version=3, parent=2,
                        options=EncodeOptions(coding="base-conditioned"))
    blobs.update(cond.blobs)
    from deltasync.errors import UnsupportedError
    with pytest.raises(UnsupportedError, match="base-conditioned"):
        squash_chain([encs[0].manifest, encs[1].manifest, replace(cond.manifest, meta={})], blobs.__getitem__)


def test_format_option_is_checked():
    with pytest.raises(ValueError, match="format"):
        EncodeOptions(format=3)
    a = from_words(np.arange(10, dtype=np.uint16), torch.bfloat16, (10,))
    assert a.numel() == 10
