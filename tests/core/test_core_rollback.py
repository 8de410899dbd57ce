"""All or nothing: a failed apply leaves every tensor bit-identical to before; wrong bases are refused."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import deltasync.apply as apply_mod
from deltasync.apply import apply_delta, apply_prepared, prepare_delta, stage_prepared
from deltasync.codec import ChunkPatch, EncodeOptions, encode_delta
from deltasync.dtypes import DTYPES
from deltasync.errors import (
    ApplyError, BaseMismatchError, DeltaSyncError, FormatError, IntegrityError, SignatureError,
)
from deltasync.manifest import parse_manifest
from deltasync import kernels
from deltasync.fingerprint import tensor_fingerprint
from deltasync.values import Changes
from core_support import from_words, tensor_bytes, words_of

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
KEY = bytes(range(32))
SMALL = EncodeOptions(chunk_words=6, blob_target=40)


def snapshot(state) -> dict[str, bytes]:
    return {n: tensor_bytes(t) for n, t in state.items()}


def copy_state(state):
    return {n: from_words(words_of(t), t.dtype, t.shape) for n, t in state.items()}


def make_states(seed=0, dtypes=("bfloat16", "float32", "int8", "float8_e5m2"), n=40):
    """Old and new states: tensor 'a' sparse, 'b' bitmap-dense, 'c' re-initialised (dense chunk), 'd' sparse."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for name, dt, frac in zip("abcd", dtypes, (0.05, 0.4, 1.0, 0.1)):
        info = DTYPES[dt]
        w = np.frombuffer(rng.bytes(n * info.words_per_element * info.word_size), dtype=f"<u{info.word_size}").copy()
        if dt == "bool":
            w &= 1
        nw = w.copy()
        k = max(1, int(frac * w.size))
        p = rng.choice(w.size, k, replace=False)
        if frac == 1.0:
            nw = np.frombuffer(rng.bytes(w.nbytes), dtype=w.dtype).copy()
            if dt == "bool":
                nw &= 1
        elif dt == "bool":
            nw[p] ^= 1
        else:
            with np.errstate(over="ignore"):
                nw[p] += np.where(rng.random(k) < 0.5, 1, w.dtype.type(-1 % (1 << (8 * info.word_size)))).astype(w.dtype)
        old[name] = from_words(w, info.torch_dtype, (n,))
        new[name] = from_words(nw, info.torch_dtype, (n,))
    return old, new


def resign(manifest):
    """Re-sign and round-trip through JSON, as a publisher that made a mistake would ship it."""
    return parse_manifest(manifest.sign(KEY).to_json(), verifier=KEY)


def with_fp_after(manifest, name, fp):
    tensors = tuple(dataclasses.replace(t, fp_after=fp) if t.name == name else t for t in manifest.tensors)
    return dataclasses.replace(manifest, tensors=tensors)


def flip_fp(fp: str) -> str:
    return f"{int(fp, 16) ^ 1:016x}"


# -- a wrong fp_after on a later tensor: everything patched so far is undone ----------------------

@pytest.mark.parametrize("bad", ["b", "c", "d"])
@pytest.mark.parametrize("options", [None, SMALL], ids=["one-chunk", "many-chunks"])
@pytest.mark.parametrize("verify", ["incremental", "full"])
def test_wrong_fp_after_rolls_back_every_tensor(bad, options, verify):
    old, new = make_states(1)
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=options)
    m = resign(with_fp_after(enc.manifest, bad, flip_fp(enc.manifest.tensor(bad).fp_after)))
    target = copy_state(old)
    ptrs = {n: t.data_ptr() for n, t in target.items()}
    before = snapshot(target)
    with pytest.raises(IntegrityError) as ei:
        apply_delta(target, m, enc.blobs, verify=verify)
    assert not isinstance(ei.value, BaseMismatchError)
    assert bad in str(ei.value)
    assert snapshot(target) == before
    assert {n: t.data_ptr() for n, t in target.items()} == ptrs
    # and the honest manifest still applies afterwards
    apply_delta(target, enc.manifest, enc.blobs)
    assert snapshot(target) == snapshot(new)


@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_rollback_every_dtype_with_non_contiguous_live_tensors(dt):
    old, new = make_states(2, dtypes=(dt, dt, dt, dt), n=30)
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    m = with_fp_after(enc.manifest, "d", flip_fp(enc.manifest.tensor("d").fp_after))
    # live tensors are strided views into buffers with junk between the elements
    bufs, target = {}, {}
    for n, t in old.items():
        es = t.element_size()
        b = torch.full((60, es), 0x5A if dt != "bool" else 1, dtype=torch.uint8)
        b[::2] = t.reshape(-1).view(torch.uint8).reshape(30, es)
        bufs[n] = b
        target[n] = b.view(t.dtype).squeeze(-1)[::2]
        assert not target[n].is_contiguous()
    before = {n: tensor_bytes(b) for n, b in bufs.items()}
    with pytest.raises(IntegrityError):
        apply_delta(target, m, enc.blobs)
    assert {n: tensor_bytes(b) for n, b in bufs.items()} == before
    apply_delta(target, enc.manifest, enc.blobs)
    assert snapshot(target) == snapshot(new)


def test_rollback_in_nn_module_keeps_storage():
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    old = {k: v.detach().clone() for k, v in mod.state_dict().items()}
    new = {}
    for i, (k, v) in enumerate(sorted(old.items())):
        w = words_of(v)
        w[i % w.size] += 1
        new[k] = from_words(w, v.dtype, v.shape)
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    last = enc.manifest.tensors[-1].name
    m = with_fp_after(enc.manifest, last, flip_fp(enc.manifest.tensor(last).fp_after))
    sd = mod.state_dict(keep_vars=True)
    ptrs = {k: v.data_ptr() for k, v in sd.items()}
    with pytest.raises(IntegrityError):
        apply_delta(mod, m, enc.blobs)
    assert snapshot(mod.state_dict()) == snapshot(old)
    assert {k: v.data_ptr() for k, v in mod.state_dict(keep_vars=True).items()} == ptrs


# -- a corrupt chunk of a later tensor -------------------------------------------------------------

def _prepared_with(enc, name, mutate):
    prepared = prepare_delta(enc.manifest, enc.blobs)
    patches = dict(prepared.patches)
    patches[name] = [mutate(p) for p in patches[name]]
    return dataclasses.replace(prepared, patches=patches)


def _bad_values(p: ChunkPatch) -> ChunkPatch:
    if p.dense is not None:
        d = p.dense.copy()
        d[0] ^= 1
        return dataclasses.replace(p, dense=d)
    ch = p.changes
    v = ch.values.copy()
    v[-1] ^= 1
    return dataclasses.replace(p, changes=Changes(positions=ch.positions, raw=ch.raw, values=v))


def _bad_positions(p: ChunkPatch) -> ChunkPatch:
    ch = p.as_changes()
    pos = ch.positions.copy()
    pos[-1] = 10**9  # far outside the tensor
    return dataclasses.replace(p, dense=None, changes=Changes(positions=pos, raw=ch.raw, values=ch.values))


@pytest.mark.parametrize("name", ["b", "c", "d"])
def test_corrupt_chunk_values_of_later_tensor_rolls_back(name):
    old, new = make_states(3)
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    target = copy_state(old)
    before = snapshot(target)
    with pytest.raises(IntegrityError):
        apply_prepared(target, _prepared_with(enc, name, _bad_values))
    assert snapshot(target) == before


@pytest.mark.parametrize("name", ["b", "c", "d"])
def test_out_of_range_positions_raise_apply_error_and_roll_back(name):
    old, new = make_states(4)
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    target = copy_state(old)
    before = snapshot(target)
    with pytest.raises(ApplyError) as ei:
        apply_prepared(target, _prepared_with(enc, name, _bad_positions))
    assert ei.value.__cause__ is not None
    assert snapshot(target) == before


@pytest.mark.parametrize("exc", [RuntimeError("device lost"), KeyboardInterrupt()], ids=["error", "interrupt"])
@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_failure_midway_is_rolled_back(monkeypatch, exc, fail_at):
    """Inject a failure into the n-th per-chunk fingerprint update of the apply loop (what a device error
    would do there): everything written before it is undone."""
    old, new = make_states(5)
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    prepared = prepare_delta(enc.manifest, enc.blobs)
    # the chunk-by-chunk path (a plain dict of chunks: no columns), whose per-chunk fingerprint update fails
    prepared = dataclasses.replace(prepared, patches=dict(prepared.patches))
    n_chunks = sum(len(v) for v in prepared.patches.values())
    assert n_chunks > fail_at
    real = apply_mod.update_fingerprint
    calls = []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == fail_at:
            raise exc
        return real(*args, **kw)

    monkeypatch.setattr(apply_mod, "update_fingerprint", flaky)
    target = copy_state(old)
    before = snapshot(target)
    expected = ApplyError if isinstance(exc, Exception) else KeyboardInterrupt
    with pytest.raises(expected):
        apply_prepared(target, prepared)
    assert snapshot(target) == before


@pytest.mark.parametrize("exc", [RuntimeError("device lost"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_failure_after_the_columnar_patch_is_rolled_back(exc):
    """A delta prepared as columns (apply.ColumnarPatches) patched word size by word size by the compiled jobs
    kernel; the caller's check fails between two word sizes (a signal, a deadline): everything is undone."""
    if kernels.cpu_kernels() is None:
        pytest.skip("the columnar path needs the compiled kernels")
    old, new = make_states(5)
    for state in (old, new):
        del state["c"]  # its dense chunk is not a column
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=SMALL)
    prepared = prepare_delta(enc.manifest, enc.blobs)
    assert type(prepared.patches) is apply_mod.ColumnarPatches
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:  # before the stage, before the first word size, before the second: fail
            raise exc

    target = copy_state(old)
    before = snapshot(target)
    with pytest.raises(ApplyError if isinstance(exc, Exception) else KeyboardInterrupt):
        stage_prepared(target, prepared, check=check)
    assert len(calls) == 3
    assert snapshot(target) == before
    # and the same delta, uninterrupted, lands exactly
    fps = apply_prepared(target, prepared)
    assert snapshot(target) == snapshot(new) and fps == {n: tensor_fingerprint(t) for n, t in new.items()}


# -- wrong base ---------------------------------------------------------------------------------------

def test_applying_the_same_delta_twice_is_refused():
    old, new = make_states(6)
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    target = copy_state(old)
    fps = apply_delta(target, enc.manifest, enc.blobs)
    after = snapshot(target)
    for tracked in (None, fps):
        with pytest.raises(BaseMismatchError):
            apply_delta(target, enc.manifest, enc.blobs, tracked)
        assert snapshot(target) == after


@pytest.mark.parametrize("how", ["one-word", "other-tensor", "missing", "extra", "dtype", "shape", "stale-fps"])
def test_wrong_base_is_refused_untouched(how):
    old, new = make_states(7)
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    target = copy_state(old)
    fps = None
    if how == "one-word":
        w = words_of(target["d"])
        w[5] ^= 0x80
        target["d"] = from_words(w, target["d"].dtype, target["d"].shape)
    elif how == "other-tensor":
        target["a"], target["d"] = copy_state(new)["a"], target["d"]
    elif how == "missing":
        del target["c"]
    elif how == "extra":
        target["z"] = torch.zeros(3)
    elif how == "dtype":
        target["b"] = target["b"].view(torch.int32)
    elif how == "shape":
        target["b"] = target["b"].reshape(4, 10)
    elif how == "stale-fps":  # the caller's tracked fingerprints claim another state
        from deltasync.fingerprint import tensor_fingerprint
        fps = {n: tensor_fingerprint(t) for n, t in copy_state(new).items()}
    before = snapshot(target)
    with pytest.raises(BaseMismatchError):
        apply_delta(target, enc.manifest, enc.blobs, fps)
    assert snapshot(target) == before


def test_apply_a_keyframe_manifest_as_delta_is_a_format_error():
    from deltasync.keyframe import encode_keyframe
    old, _ = make_states(8)
    kf = encode_keyframe(old, model="m", version=1)
    with pytest.raises(FormatError):
        prepare_delta(kf.manifest, kf.blobs)


def test_blob_of_wrong_size_is_an_integrity_error():
    old, new = make_states(9)
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    bid = enc.manifest.blobs[0].id
    blobs = dict(enc.blobs)
    blobs[bid] = blobs[bid] + b"\0"
    with pytest.raises(IntegrityError):
        prepare_delta(enc.manifest, blobs)


def test_chunk_swapped_between_tensors_is_refused():
    old, new = make_states(10, dtypes=("float32", "float32", "float32", "float32"))
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    ta, tb = enc.manifest.tensor("a"), enc.manifest.tensor("b")
    tensors = tuple(dataclasses.replace(t, chunks=tb.chunks) if t.name == "a" else
                    dataclasses.replace(t, chunks=ta.chunks) if t.name == "b" else t for t in enc.manifest.tensors)
    with pytest.raises(FormatError):
        prepare_delta(dataclasses.replace(enc.manifest, tensors=tensors), enc.blobs)


def test_signed_manifest_with_changed_fp_after_is_refused_without_resigning():
    old, new = make_states(11)
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    signed = enc.manifest.sign(KEY)
    forged = with_fp_after(signed, "b", flip_fp(signed.tensor("b").fp_after))
    with pytest.raises(SignatureError):
        parse_manifest(forged.to_json(), verifier=KEY)


# -- bit-flipped blobs: the fingerprints catch what the decoder lets through --------------------------

def _flip_outcomes(enc, old, new, positions):
    """For each (byte, bit): flip it in the blob (same id, same size: the apply path does not rehash) and
    apply. Returns the counts of refused / applied-correctly outcomes; anything else fails the test."""
    bid = enc.manifest.blobs[-1].id
    data = enc.blobs[bid]
    refused = ok = 0
    before = snapshot(old)
    for i, bit in positions:
        bad = bytearray(data)
        bad[i] ^= 1 << bit
        blobs = dict(enc.blobs)
        blobs[bid] = bytes(bad)
        target = copy_state(old)
        try:
            apply_delta(target, enc.manifest, blobs)
        except DeltaSyncError:
            refused += 1
            assert snapshot(target) == before, f"flip {i}:{bit} left a half-applied state"
        else:  # a flip the data does not depend on (e.g. a zstd window size bit)
            ok += 1
            assert snapshot(target) == snapshot(new), f"flip {i}:{bit} applied WRONG bytes and was not noticed"
    return refused, ok


def test_every_bit_flip_of_a_small_blob_is_refused_or_harmless():
    old, new = make_states(12, dtypes=("bfloat16", "float32", "int16", "float8_e4m3fn"), n=12)
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    assert len(enc.manifest.blobs) == 1
    size = len(enc.blobs[enc.manifest.blobs[0].id])
    refused, ok = _flip_outcomes(enc, old, new, [(i, b) for i in range(size) for b in range(8)])
    assert refused > 0.9 * (refused + ok)


def test_bit_flips_in_the_frames_of_a_multi_chunk_blob():
    old, new = make_states(13, n=200)
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=EncodeOptions(chunk_words=32))
    data = enc.blobs[enc.manifest.blobs[-1].id]
    (hlen,) = np.frombuffer(data[12:16], dtype="<u4")
    body = range(16 + int(hlen), len(data))
    rng = np.random.default_rng(0)
    picks = [(int(i), int(rng.integers(8))) for i in body]
    refused, ok = _flip_outcomes(enc, old, new, picks)
    assert refused > 0.8 * (refused + ok)


@pytest.mark.parametrize("what", ["delta", "keyframe"])
def test_missing_blob_is_not_found(what):
    from deltasync.errors import NotFoundError
    from deltasync.keyframe import encode_keyframe, load_keyframe

    old, new = make_states(14)
    with pytest.raises(NotFoundError):
        if what == "delta":
            enc = encode_delta(old, new, model="m", version=2, parent=1)
            prepare_delta(enc.manifest, {})
        else:
            kf = encode_keyframe(old, model="m", version=1)
            load_keyframe(kf.manifest, {})


# -- live tensors that share memory -----------------------------------------------------------------------

def _shared_buffer_states():
    buf = torch.arange(12, dtype=torch.float32)
    old = {"a": buf[0:6].clone(), "b": buf[4:10].clone()}
    new = {"a": old["a"] + 1, "b": old["b"] + 2}
    return buf, old, new


def test_overlapping_live_views_are_refused_untouched():
    buf, old, new = _shared_buffer_states()
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    before = tensor_bytes(buf)
    with pytest.raises(DeltaSyncError):  # ApplyError: cannot patch overlapping views independently
        apply_delta({"a": buf[0:6], "b": buf[4:10]}, enc.manifest, enc.blobs)
    assert tensor_bytes(buf) == before
    reinterpreted = {"a": buf[0:6], "b": buf[0:6].view(torch.int32)}  # same bytes, another dtype
    old2 = {"a": reinterpreted["a"].clone(), "b": reinterpreted["b"].clone()}
    new2 = {"a": old2["a"] * 2, "b": old2["b"]}
    enc2 = encode_delta(old2, new2, model="m", version=2, parent=1)
    with pytest.raises(DeltaSyncError):
        apply_delta(reinterpreted, enc2.manifest, enc2.blobs)
    assert tensor_bytes(buf) == before


def test_disjoint_views_of_one_buffer_apply():
    buf = torch.arange(12, dtype=torch.float32)
    live = {"a": buf[0:5], "b": buf[5:12]}
    old = {k: v.clone() for k, v in live.items()}
    new = {"a": old["a"] + 1, "b": -old["b"]}
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    apply_delta(live, enc.manifest, enc.blobs)
    assert tensor_bytes(buf) == tensor_bytes(torch.cat([new["a"], new["b"]]))


def test_aliases_changed_differently_are_refused():
    w = torch.arange(6, dtype=torch.float32)
    old = {"embed": w.clone(), "head": w.clone()}
    new = {"embed": w + 1, "head": w + 2}  # a delta that unties them cannot be applied to tied weights
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    live = torch.arange(6, dtype=torch.float32)
    with pytest.raises(BaseMismatchError):
        apply_delta({"embed": live, "head": live}, enc.manifest, enc.blobs)
    assert tensor_bytes(live) == tensor_bytes(w)


def test_tied_weights_roll_back_together():
    w = torch.arange(6, dtype=torch.float32)
    old = {"embed": w.clone(), "head": w.clone(), "z": torch.zeros(3)}
    new = {"embed": w + 1, "head": w + 1, "z": torch.ones(3)}
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    m = with_fp_after(enc.manifest, "z", flip_fp(enc.manifest.tensor("z").fp_after))
    live = w.clone()
    z = torch.zeros(3)
    with pytest.raises(IntegrityError):
        apply_delta({"embed": live, "head": live, "z": z}, m, enc.blobs)
    assert tensor_bytes(live) == tensor_bytes(w) and not z.any()
    fps = apply_delta({"embed": live, "head": live, "z": z}, enc.manifest, enc.blobs)
    assert tensor_bytes(live) == tensor_bytes(w + 1) and fps["embed"] == fps["head"]


@pytest.mark.parametrize("what", ["delta", "keyframe"])
def test_blob_that_does_not_hash_to_its_id_is_refused_before_patching(what):
    from deltasync.keyframe import encode_keyframe, load_keyframe

    old, new = make_states(15)
    enc = encode_delta(old, new, model="m", version=2, parent=1) if what == "delta" else \
        encode_keyframe(new, model="m", version=2)
    bid = enc.manifest.blobs[0].id
    data = enc.blobs[bid]
    forged = bytearray(data)
    if what == "delta":
        forged[-1] ^= 0x01  # the last byte of the last frame: decodes to different patches
    else:  # a padding space of the safetensors header becomes a tab: the same tensors, other bytes
        hlen = int(np.frombuffer(data[:8], dtype="<u8")[0])
        pad = data.rindex(b" ", 8, 8 + hlen)
        forged[pad] = 0x09
    assert bytes(forged) != data and len(forged) == len(data)
    blobs = dict(enc.blobs)
    blobs[bid] = bytes(forged)
    with pytest.raises(IntegrityError):
        if what == "delta":
            prepare_delta(enc.manifest, blobs)
        else:
            load_keyframe(enc.manifest, blobs)
