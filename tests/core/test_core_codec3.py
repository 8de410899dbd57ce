"""Blob format 3 (docs/FORMAT.md §4.4): the base-conditioned ``ansx`` coding. Round trips through
apply for every dtype, empty and all-changed chunks, NaN payloads, -0.0, chunk edges; decoding needs
the base (and refuses the wrong one or none); squash refuses such chains; the option is checked."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.apply import apply_delta, prepare_delta
from deltasync.blob import BlobReader
from deltasync.codec import EncodeOptions, decode_blob, diff_ranks, diff_states, encode_delta, encode_diff
from deltasync.conditioned import CondTables
from deltasync.errors import FormatError, UnsupportedError
from deltasync.fingerprint import tensor_fingerprint
from deltasync.squash import squash_chain
from deltasync.varint import encode_varints

from core_support import from_words, tensor_bytes, words_of

COND = EncodeOptions(coding="base-conditioned")
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8,
          torch.float8_e4m3fn, torch.complex64, torch.float64]


def _adam_like(rng, n: int, dtype: torch.dtype, changed: float, edges: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """An old tensor and a new one with about ``changed`` of its words moved: mostly ±1 steps, some big
    steps and sign flips (raw words), NaN payloads, -0.0 and infinities in the base."""
    if dtype.is_floating_point or dtype.is_complex:
        a = torch.from_numpy(rng.normal(0, 0.05, n).astype(np.float32)).to(torch.float64)
        a = (a.to(torch.complex64) if dtype.is_complex else a.to(dtype))
    else:
        a = torch.from_numpy(rng.integers(-1000, 1000, n)).to(dtype)
    w = words_of(a)
    if edges and w.size >= 8:
        special = {torch.bfloat16: [0x7FC1, 0xFFC5, 0x8000, 0x7F80], torch.float16: [0x7E01, 0xFE11, 0x8000, 0x7C00],
                   torch.float32: [0x7FC00001, 0xFFC00011, 0x80000000, 0x7F800000]}.get(dtype)
        if special:
            w[:4] = special  # NaN payloads, -0.0, +inf
    new = w.copy()
    k = max(1, int(w.size * changed)) if w.size else 0
    pos = rng.choice(w.size, size=min(k, w.size), replace=False) if w.size else np.empty(0, np.int64)
    bits = w.dtype.itemsize * 8
    step = rng.choice([1, -1, 1, -1, 1, -1, 3, -200, 1 << (bits - 2)], size=pos.size).astype(np.int64)
    with np.errstate(over="ignore"):
        new[pos] = (w[pos].astype(np.int64) + step).astype(np.uint64).astype(w.dtype)
        flips = pos[rng.random(pos.size) < 0.05]
        new[flips] = w[flips] ^ w.dtype.type(1 << (bits - 1))
    if edges and w.size:
        new[0] = w[0] ^ 1  # the first and last word of the chunk change
        new[-1] = w[-1] ^ 2
    shape = a.shape
    return from_words(w, a.dtype, shape), from_words(new, a.dtype, shape)


def _apply(old, enc, executor=None):
    target = {n: t.clone() for n, t in old.items()}
    apply_delta(target, enc.manifest, enc.blobs, executor=executor)
    return target


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES), n=st.sampled_from([1, 7, 300, 5000]),
       changed=st.sampled_from([0.0, 0.003, 0.05, 1.0]), chunk=st.sampled_from([64, 1000, 1 << 20]))
def test_base_conditioned_round_trips_through_apply(seed, dtype, n, changed, chunk):
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for k in range(3):
        a, b = _adam_like(rng, n + k, dtype, changed, edges=changed > 0)
        old[f"t{k}"], new[f"t{k}"] = a, b
    options = EncodeOptions(coding="base-conditioned", chunk_words=chunk)
    enc = encode_delta(old, new, model="m", version=1, parent=0, options=options)
    assert enc.manifest.coding == "base-conditioned"
    got = _apply(old, enc)
    assert {k: tensor_bytes(v) for k, v in got.items()} == {k: tensor_bytes(v) for k, v in new.items()}
    # the same changes as the base-free coding
    plain = encode_delta(old, new, model="m", version=1, parent=0, options=EncodeOptions(chunk_words=chunk))
    assert [t.changed for t in plain.manifest.tensors] == [t.changed for t in enc.manifest.tensors]


def test_all_changed_and_single_word_chunks():
    rng = np.random.default_rng(3)
    a = torch.from_numpy(rng.normal(0, 1, 4096).astype(np.float32)).to(torch.bfloat16)
    b = (a.view(torch.int16) + 1).view(torch.bfloat16)  # every word +1 ULP: not dense (steps), all changed
    one_a = torch.tensor([1.5], dtype=torch.bfloat16)
    one_b = (one_a.view(torch.int16) - 3).view(torch.bfloat16)  # a single word, a step (a sign flip would be dense)
    old, new = {"a": a, "one": one_a}, {"a": b, "one": one_b}
    enc = encode_delta(old, new, model="m", version=1, parent=0, options=COND)
    modes = [c["mode"] for blob in enc.blobs.values() for c in BlobReader(blob).chunks]
    assert modes == ["ansx", "ansx"]
    got = _apply(old, enc)
    assert tensor_bytes(got["a"]) == tensor_bytes(b) and tensor_bytes(got["one"]) == tensor_bytes(one_b)


def test_smaller_than_base_free_on_an_adam_like_step():
    rng = np.random.default_rng(1)
    n = 1 << 20
    master = rng.normal(0, 0.02, n).astype(np.float32)
    a = torch.from_numpy(master).to(torch.bfloat16)
    upd = np.sign(rng.normal(0, 1, n)).astype(np.float32) * 1e-5  # Adam: ~lr per element, whatever |w|
    b = torch.from_numpy(master + upd).to(torch.bfloat16)
    free = encode_delta({"w": a}, {"w": b}, model="m", version=1, parent=0)
    cond = encode_delta({"w": a}, {"w": b}, model="m", version=1, parent=0, options=COND)
    fb, cb = sum(map(len, free.blobs.values())), sum(map(len, cond.blobs.values()))
    assert cb < 0.85 * fb, (cb, fb)
    assert tensor_bytes(_apply({"w": a}, cond)["w"]) == tensor_bytes(b)


def test_decoding_needs_the_base():
    rng = np.random.default_rng(5)
    a, b = _adam_like(rng, 20000, torch.bfloat16, 0.01)
    enc = encode_delta({"w": a}, {"w": b}, model="m", version=1, parent=0, options=COND)
    (blob,) = enc.blobs.values()
    assert BlobReader(blob).version == 3
    (patch,) = decode_blob(blob)
    assert patch.count == enc.manifest.tensors[0].changed
    with pytest.raises(UnsupportedError, match="base-conditioned"):
        patch.as_changes()
    good = patch.resolve(words_of(a))
    assert good.changes.positions.size == patch.count
    # decoded against another base: refused, or (if by chance it decodes) different changes — the
    # fingerprint check of apply then refuses it; here the base is shuffled, so the groups differ
    wrong = words_of(a)[::-1].copy()
    try:
        bad = patch.resolve(wrong).changes
    except FormatError:
        pass
    else:
        assert not np.array_equal(bad.positions, good.changes.positions)
    with pytest.raises(FormatError, match="base words"):
        patch.resolve(words_of(a)[:-1])


def test_prepared_then_applied_with_threads_equals_serial():
    rng = np.random.default_rng(7)
    old, new = {}, {}
    for k in range(6):
        old[f"t{k}"], new[f"t{k}"] = _adam_like(rng, 30000, torch.bfloat16, 0.01)
    options = EncodeOptions(coding="base-conditioned", chunk_words=4096, blob_target=1 << 10)
    enc = encode_delta(old, new, model="m", version=1, parent=0, options=options)
    assert len(enc.blobs) > 1
    with ThreadPoolExecutor(2) as ex:
        got = _apply(old, enc, executor=ex)
    assert {k: tensor_bytes(v) for k, v in got.items()} == {k: tensor_bytes(v) for k, v in new.items()}


def test_encode_diff_with_ranks_taken_before_the_reference_moves_on():
    """The publisher's way: ranks from its reference right after the diff (updated in place), encoded later."""
    rng = np.random.default_rng(11)
    a, b = _adam_like(rng, 50000, torch.bfloat16, 0.01)
    _, c = _adam_like(rng, 50000, torch.bfloat16, 0.01)
    ref = {"w": a.clone()}
    diff = diff_states(ref, {"w": b}, update_old=True)
    ranks = diff_ranks(diff, ref)  # ref now holds b: equal to a off the changed positions
    ref["w"].copy_(c)  # the reference moves on before the encoder runs
    enc = encode_diff(diff, model="m", version=1, parent=0, options=COND, ranks=ranks)
    direct = encode_delta({"w": a}, {"w": b}, model="m", version=1, parent=0, options=COND)
    assert enc.blobs == direct.blobs
    with pytest.raises(ValueError, match="needs the base"):
        encode_diff(diff, model="m", version=1, parent=0, options=COND)


def test_squash_refuses_base_conditioned_chains():
    rng = np.random.default_rng(13)
    a, b = _adam_like(rng, 5000, torch.bfloat16, 0.01)
    _, c = _adam_like(rng, 5000, torch.bfloat16, 0.01)
    c = torch.where(torch.rand(5000) < 0.5, b, c)
    e1 = encode_delta({"w": a}, {"w": b}, model="m", version=1, parent=0, options=COND)
    e2 = encode_delta({"w": b}, {"w": c}, model="m", version=2, parent=1, options=COND)
    blobs = {**e1.blobs, **e2.blobs}
    read = []
    with pytest.raises(UnsupportedError, match="cannot be squashed without the model"):
        squash_chain([e1.manifest, e2.manifest], lambda bid: read.append(bid) or blobs[bid])
    assert read == []  # refused from the manifests alone
    # a format-3 blob under a manifest that does not say so is refused too
    from dataclasses import replace
    m1 = replace(e1.manifest, meta={})
    with pytest.raises(UnsupportedError, match="format 3"):
        squash_chain([m1, replace(e2.manifest, meta={})], blobs.__getitem__)
    # walking the chain works
    t = _apply({"w": a}, e1)
    t = _apply(t, e2)
    assert tensor_bytes(t["w"]) == tensor_bytes(c)


def test_coding_option_is_checked():
    with pytest.raises(ValueError, match="coding"):
        EncodeOptions(coding="exponent")
    with pytest.raises(ValueError, match="format 1"):
        EncodeOptions(format=1, coding="base-conditioned")
    with pytest.raises(ValueError, match="format 3"):
        EncodeOptions(format=3)
    assert EncodeOptions(coding="base-conditioned").blob_format == 3
    assert EncodeOptions(format=3, coding="base-conditioned").blob_format == 3
    assert EncodeOptions().blob_format == 4
    assert EncodeOptions(format=2, coding="base-conditioned").blob_format == 3


def test_corrupt_messages_and_tables_are_format_errors():
    rng = np.random.default_rng(17)
    a, b = _adam_like(rng, 20000, torch.bfloat16, 0.02)
    enc = encode_delta({"w": a}, {"w": b}, model="m", version=1, parent=0, options=COND)
    (blob,) = enc.blobs.values()
    reader = BlobReader(blob)
    tables = CondTables.parse(reader.stream("ansxm"))
    assert CondTables.parse(tables.to_bytes()).gfreq.keys() == tables.gfreq.keys()
    for bad in (tables.to_bytes()[:-1], np.concatenate([tables.to_bytes(), [1]]).astype(np.uint8),
                encode_varints(np.array([1, 5, 1, 3, 4000, 0])),  # G_5 sums to 4000
                encode_varints(np.array([2, 5, 1, 3, 4096, 0, 5, 1, 3, 4096, 0])),  # contexts out of order
                encode_varints(np.array([1, 5, 0, 0]))):  # an empty G_5
        with pytest.raises(FormatError):
            CondTables.parse(bad)
    (patch,) = decode_blob(blob)
    base = words_of(a)
    words = patch.pending.words
    from dataclasses import replace
    for mutated in (words[:-1], np.concatenate([words, words[:1]]), words ^ np.uint16(0x5A5A)):
        p = replace(patch, pending=replace(patch.pending, words=np.ascontiguousarray(mutated, dtype=np.uint16)))
        try:
            got = p.resolve(base).changes
        except FormatError:
            continue
        assert not np.array_equal(got.positions, patch.resolve(base).changes.positions)


def test_stage_through_prepare_keeps_the_fingerprint_check():
    rng = np.random.default_rng(19)
    a, b = _adam_like(rng, 10000, torch.float32, 0.01)
    enc = encode_delta({"w": a}, {"w": b}, model="m", version=1, parent=0, options=COND)
    prep = prepare_delta(enc.manifest, enc.blobs)
    assert prep.patches["w"][0].pending is not None
    target = {"w": a.clone()}
    from deltasync.apply import apply_prepared
    fps = apply_prepared(target, prep, {"w": tensor_fingerprint(a)})
    assert tensor_bytes(target["w"]) == tensor_bytes(b)
    assert fps["w"] == tensor_fingerprint(b)
