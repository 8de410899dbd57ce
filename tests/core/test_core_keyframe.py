"""Keyframes: every dtype round-trips through safetensors shards; shards open with plain safetensors."""

from __future__ import annotations

import dataclasses
import json
import struct
import warnings

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from deltasync.apply import apply_delta
from deltasync.codec import encode_delta
from deltasync.dtypes import DTYPES
from deltasync.errors import FormatError, IntegrityError
from deltasync.fingerprint import fp_hex, state_fingerprint_of, tensor_fingerprint
from deltasync.keyframe import apply_keyframe, encode_keyframe, load_keyframe, load_shard, save_shard
from deltasync.manifest import parse_manifest
from core_support import tensor_bytes

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
DTYPE_NAMES = sorted(DTYPES)
# what safetensors itself can name; the rest travel as U8 [..., element_size] plus metadata
NATIVE = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "bfloat16",
          "float32", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "complex64"}


def random_tensor(rng, dt: str, shape) -> torch.Tensor:
    info = DTYPES[dt]
    n = int(np.prod(shape, dtype=np.int64)) * info.element_size
    b = np.frombuffer(rng.bytes(n), dtype=np.uint8).copy()
    if dt == "bool":
        b &= 1
    if n == 0:
        return torch.empty(tuple(shape), dtype=info.torch_dtype)
    return torch.from_numpy(b).view(info.torch_dtype).reshape(tuple(shape))


def state_for(dt: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    s = {
        f"{dt}.scalar": random_tensor(rng, dt, ()),
        f"{dt}.empty": random_tensor(rng, dt, (0, 3)),
        f"{dt}.vec": random_tensor(rng, dt, (13,)),
        f"{dt}.mat": random_tensor(rng, dt, (4, 6)),
    }
    s[f"{dt}.transposed"] = random_tensor(rng, dt, (5, 3)).t()  # non-contiguous source
    return s


def assert_same(got, want):
    assert set(got) == set(want)
    for n in want:
        assert got[n].dtype == want[n].dtype, n
        assert tuple(got[n].shape) == tuple(want[n].shape), n
        assert tensor_bytes(got[n]) == tensor_bytes(want[n]), n


@pytest.mark.parametrize("dt", DTYPE_NAMES)
@pytest.mark.parametrize("shard_bytes", [1, 40, 1 << 20], ids=["shard-per-tensor", "small-shards", "one-shard"])
def test_round_trip_every_dtype(dt, shard_bytes):
    state = state_for(dt)
    enc = encode_keyframe(state, model="policy", version=3, shard_bytes=shard_bytes, meta={"why": "test"})
    m = parse_manifest(enc.manifest.sign(b"k" * 16).to_json(), verifier=b"k" * 16)
    assert m.kind == "keyframe" and m.parent is None and m.state_fp_before is None
    assert m.state_fp == state_fingerprint_of(state)
    if shard_bytes == 1:
        assert len(m.blobs) == len(state)
    if shard_bytes == 1 << 20:
        assert len(m.blobs) == 1
    for rec in m.tensors:
        assert rec.fp_after == fp_hex(tensor_fingerprint(state[rec.name]))
        assert rec.changed == state[rec.name].numel() * DTYPES[dt].words_per_element
    loaded, fps = load_keyframe(m, enc.blobs)
    assert_same(loaded, state)
    assert fps == {n: tensor_fingerprint(t) for n, t in state.items()} == enc.fps
    for b in m.blobs:
        assert len(enc.blobs[b.id]) == b.size


@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_shards_open_with_plain_safetensors(dt):
    state = state_for(dt, seed=1)
    enc = encode_keyframe(state, model="policy", version=3)
    (data,) = enc.blobs.values()
    plain = safetensors.torch.load(data)
    assert set(plain) == set(state)
    (hlen,) = struct.unpack_from("<Q", data)
    meta = json.loads(data[8:8 + hlen]).get("__metadata__") or {}
    for n, t in state.items():
        p = plain[n]
        if dt in NATIVE:
            assert p.dtype == t.dtype and tuple(p.shape) == tuple(t.shape)
            assert f"deltasync.dtype.{n}" not in meta
        else:  # raw bytes with the element as a trailing axis, real dtype in the metadata
            assert p.dtype == torch.uint8 and tuple(p.shape) == (*t.shape, t.element_size())
            assert meta[f"deltasync.dtype.{n}"] == dt
        assert tensor_bytes(p) == tensor_bytes(t)


def test_shard_file_opens_with_safe_open(tmp_path):
    state = {"w": torch.randn(4, 4).to(torch.bfloat16), "x": torch.zeros(2, dtype=torch.complex128)}
    enc = encode_keyframe(state, model="policy", version=1)
    (data,) = enc.blobs.values()
    path = tmp_path / "shard.safetensors"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == {"w", "x"}
        assert torch.equal(f.get_tensor("w"), state["w"])
        assert f.metadata() == {"deltasync.dtype.x": "complex128"}


def test_save_shard_keeps_user_metadata_and_load_shard_restores_dtypes():
    state = {"a": torch.zeros(3, dtype=torch.complex32), "b": torch.ones(2, dtype=torch.float8_e8m0fnu)}
    data = save_shard(state, {"step": "7"})
    back = load_shard(data)
    assert_same(back, state)
    (hlen,) = struct.unpack_from("<Q", data)
    assert json.loads(data[8:8 + hlen])["__metadata__"]["step"] == "7"


def test_big_tensor_gets_its_own_shard_and_names_stay_sorted():
    state = {"c": torch.zeros(10), "a": torch.zeros(1000), "b": torch.zeros(10), "d": torch.zeros(10)}
    enc = encode_keyframe(state, model="m", version=1, shard_bytes=100)
    groups = [sorted(load_shard(enc.blobs[b.id])) for b in enc.manifest.blobs]
    assert groups == [["a"], ["b", "c"], ["d"]]
    assert [t.name for t in enc.manifest.tensors] == ["a", "b", "c", "d"]


# -- into live targets ------------------------------------------------------------------------------

class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 4).to(torch.bfloat16)
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("table", torch.zeros(3, 2, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("verify", ["full", "none"])
def test_apply_keyframe_into_module_in_place(verify):
    torch.manual_seed(0)
    src, dst = Net(), Net()
    with torch.no_grad():
        src.count.fill_(41)
        src.table.copy_(torch.randn(3, 2).to(torch.float8_e4m3fn))
    state = {k: v.detach().clone() for k, v in src.state_dict().items()}
    enc = encode_keyframe(state, model="m", version=5, shard_bytes=32)
    sd = dst.state_dict(keep_vars=True)
    ptrs = {k: v.data_ptr() for k, v in sd.items()}
    objs = {k: id(v) for k, v in sd.items()}
    fps = apply_keyframe(dst, parse_manifest(enc.manifest.to_json()), enc.blobs, verify=verify)
    sd2 = dst.state_dict(keep_vars=True)
    assert {k: v.data_ptr() for k, v in sd2.items()} == ptrs
    assert {k: id(v) for k, v in sd2.items()} == objs
    assert_same({k: v.detach() for k, v in sd2.items()}, state)
    assert fps == enc.fps


def test_keyframe_then_delta_chain():
    torch.manual_seed(1)
    s1 = {"a": torch.randn(50).to(torch.bfloat16), "b": torch.randn(3, 3)}
    s2 = {k: v.clone() for k, v in s1.items()}
    s2["a"].view(torch.int16)[[3, 7]] += 1
    kf = encode_keyframe(s1, model="m", version=1)
    delta = encode_delta(s1, s2, model="m", version=2, parent=1, base_fps=kf.fps)
    target = {"a": torch.zeros(50, dtype=torch.bfloat16), "b": torch.zeros(3, 3).t()}  # a non-contiguous live tensor
    fps = apply_keyframe(target, kf.manifest, kf.blobs)
    apply_delta(target, delta.manifest, delta.blobs, fps)
    assert_same(target, s2)


@pytest.mark.parametrize("how", ["missing", "extra", "dtype", "shape"])
def test_apply_keyframe_refuses_other_layouts_untouched(how):
    state = {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, dtype=torch.int8)}
    enc = encode_keyframe(state, model="m", version=1)
    target = {"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int8)}
    if how == "missing":
        del target["b"]
    elif how == "extra":
        target["c"] = torch.zeros(1)
    elif how == "dtype":
        target["a"] = torch.zeros(4, dtype=torch.float64)
    else:
        target["a"] = torch.zeros(2, 2)
    before = {n: tensor_bytes(t) for n, t in target.items()}
    with pytest.raises(IntegrityError):
        apply_keyframe(target, enc.manifest, enc.blobs)
    assert {n: tensor_bytes(t) for n, t in target.items()} == before


# -- integrity ---------------------------------------------------------------------------------------

def _kf():
    state = {"a": torch.arange(8, dtype=torch.float32), "b": torch.arange(6, dtype=torch.int16).reshape(2, 3)}
    return state, encode_keyframe(state, model="m", version=1, shard_bytes=1)


def test_other_content_under_the_same_id_is_an_integrity_error():
    state, enc = _kf()
    bid = enc.manifest.tensor("a").chunks[0].blob
    forged = dict(enc.blobs)
    other = {"a": state["a"].clone()}
    other["a"][3] = 99.0
    data = save_shard(other)
    assert len(data) == len(enc.blobs[bid])
    forged[bid] = data
    with pytest.raises(IntegrityError):
        load_keyframe(enc.manifest, forged)
    target = {n: torch.zeros_like(t) for n, t in state.items()}
    with pytest.raises(IntegrityError):
        apply_keyframe(target, enc.manifest, forged)
    assert all(not t.any() for t in target.values())  # nothing was copied


@pytest.mark.parametrize("how", ["fp", "size", "key", "shape", "dtype", "delta"])
def test_load_keyframe_refuses(how):
    state, enc = _kf()
    m, blobs = enc.manifest, dict(enc.blobs)
    ta = m.tensor("a")
    if how == "fp":
        m = dataclasses.replace(m, tensors=(dataclasses.replace(ta, fp_after="0" * 16), m.tensors[1]))
        err = IntegrityError
    elif how == "size":
        blobs[ta.chunks[0].blob] += b" "
        err = IntegrityError
    elif how == "key":
        m = dataclasses.replace(m, tensors=(dataclasses.replace(ta, chunks=(dataclasses.replace(ta.chunks[0], key="zz"),)), m.tensors[1]))
        err = FormatError
    elif how == "shape":
        m = dataclasses.replace(m, tensors=(dataclasses.replace(ta, shape=(2, 4)), m.tensors[1]))
        err = FormatError
    elif how == "dtype":
        m = dataclasses.replace(m, tensors=(dataclasses.replace(ta, dtype="int32"), m.tensors[1]))
        err = FormatError
    else:
        m = encode_delta(state, state, model="m", version=2, parent=1).manifest
        err = FormatError
    with pytest.raises(err):
        load_keyframe(m, blobs)


def test_load_keyframe_accepts_a_callable_blob_source():
    state, enc = _kf()
    seen = []

    def get(bid):
        seen.append(bid)
        return enc.blobs[bid]

    loaded, _ = load_keyframe(enc.manifest, get)
    assert_same(loaded, state)
    assert seen == [b.id for b in enc.manifest.blobs]
