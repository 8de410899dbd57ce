"""Fuzzing (hypothesis) of the parsers that read bytes from disk or a blob store (issue 9).

Delta files, safetensors headers and shards (keyframe blobs, state files), keyframes and delta
blobs, each by structure-aware mutation of a real input (splices, truncations, duplicated or
deleted ranges, overwritten bytes) and by hostile safetensors headers. The library's own errors
(the deltasync.errors tree) are the only exceptions allowed; what parses must keep its promises.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.codec import decode_blob, encode_delta
from deltasync.deltafile import pack_delta_file, unpack_delta_file
from deltasync.errors import DeltaSyncError, FormatError, IntegrityError
from deltasync.keyframe import encode_keyframe, load_keyframe
from deltasync.tensorfile import load_shard, parse_header, save_shard

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = bytes(range(40, 72))

g = torch.Generator().manual_seed(2)
OLD = {"w": torch.randn(200, generator=g).to(torch.bfloat16), "m": torch.randn(4, 8, generator=g),
       "i": torch.randint(0, 9, (12,), generator=g, dtype=torch.int32)}
NEW = {k: v.clone() for k, v in OLD.items()}
NEW["w"].view(torch.int16)[[0, 5, 77, 199]] += 1
NEW["m"][2] = 0.25
NEW["i"][3] = 100
ENC = encode_delta(OLD, NEW, model="f", version=3, parent=2)
SIGNED = ENC.manifest.sign(KEY)
DELTA = pack_delta_file(SIGNED, ENC.blobs)
BLOBS = list(ENC.blobs.values())
SHARD = save_shard(NEW, {"deltasync.x": "y"})


@st.composite
def mutated(draw, data: bytes):
    """A real input with a few structural edits."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "dup", "del", "insert", "truncate"]))
        if not b:
            break
        i = draw(st.integers(0, len(b) - 1))
        j = min(len(b), i + draw(st.integers(1, 64)))
        if op == "flip":
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            b[i] = draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, ord("9"), ord("{"), ord('"')]))
        elif op == "cut":
            b = b[:i] + b[j:]
        elif op == "dup":
            b = b[:j] + b[i:j] + b[j:]
        elif op == "del":
            del b[i]
        elif op == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            b = b[:i]
    return bytes(b)


def _ours(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except DeltaSyncError as e:
        assert isinstance(e, FormatError | IntegrityError), type(e)
        return e


def test_real_inputs_parse():
    assert unpack_delta_file(DELTA, verifier=KEY).manifest == SIGNED
    assert set(load_shard(SHARD)) == set(NEW)
    for b in BLOBS:
        decode_blob(b)


@FUZZ
@given(mutated(DELTA), st.booleans())
def test_delta_file_mutations(data, with_key):
    r = _ours(unpack_delta_file, data, verifier=KEY if with_key else None)
    if not isinstance(r, DeltaSyncError):
        # accepted: every blob hashes to its id (checked inside), and with the key it is the signed original
        assert {ref.id for ref in r.manifest.blobs} == set(r.blobs)
        if with_key:
            assert r.manifest == SIGNED and r.blobs == ENC.blobs


@FUZZ
@given(mutated(SHARD))
def test_safetensors_shard_mutations(data):
    r = _ours(load_shard, data)
    if not isinstance(r, DeltaSyncError):
        assert all(isinstance(t, torch.Tensor) for t in r.values())


@FUZZ
@given(st.sampled_from(range(len(BLOBS))).flatmap(lambda i: mutated(BLOBS[i])))
def test_blob_mutations(data):
    _ours(decode_blob, data)


_dtype = st.sampled_from(["F32", "BF16", "U8", "I64", "F8_E4M3", "C64", "BOOL", "X", 7, None])
_shape = st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), st.text(max_size=3), st.none())
_offsets = st.one_of(st.lists(st.integers(-5, 2**63), min_size=0, max_size=3), st.none(), st.text(max_size=2))


@st.composite
def headers(draw):
    entries = {}
    for k in range(draw(st.integers(0, 3))):
        e = {"dtype": draw(_dtype), "shape": draw(_shape), "data_offsets": draw(_offsets)}
        if draw(st.integers(0, 6)) == 0:
            e[draw(st.sampled_from(["dtype", "shape", "data_offsets", "x"]))] = draw(st.integers())
        entries[draw(st.sampled_from(["a", "b", "__metadata__", f"t{k}"]))] = e
    if draw(st.booleans()):
        entries["__metadata__"] = draw(st.one_of(st.dictionaries(st.text(max_size=30), st.text(max_size=8), max_size=2),
                                                 st.integers(), st.just({"deltasync.dtype.a": "float8_e8m0fnu"})))
    h = json.dumps(entries).encode()
    n = draw(st.one_of(st.just(len(h)), st.integers(0, 2**64 - 1)))
    body = draw(st.binary(max_size=64))
    return struct.pack("<Q", n) + h + body


@FUZZ
@given(headers())
def test_safetensors_hostile_headers(data):
    r = _ours(parse_header, data)
    if not isinstance(r, DeltaSyncError):
        assert all(r.data_start <= e.start <= e.stop <= r.size for e in r.entries)
        _ours(load_shard, data)


@pytest.mark.parametrize("data", [b"", b"\0" * 7, struct.pack("<Q", 2**63) + b"{}", struct.pack("<Q", 2) + b"[]",
                                  struct.pack("<Q", 4) + b'{"a"', struct.pack("<Q", 2) + b"{}" + b"x"])
def test_safetensors_table(data):
    assert isinstance(_ours(load_shard, data), FormatError)


def test_keyframe_with_a_mutated_shard_is_refused():
    kf = encode_keyframe(NEW, model="f", version=3)
    man = kf.manifest
    (bid, data) = next(iter(kf.blobs.items()))
    ok_state, _ = load_keyframe(man, kf.blobs)
    assert set(ok_state) == set(NEW)
    for i in range(0, len(data), max(1, len(data) // 40)):
        bad = bytearray(data)
        bad[i] ^= 0x04
        r = _ours(load_keyframe, man, {**kf.blobs, bid: bytes(bad)})
        assert isinstance(r, DeltaSyncError), f"a flipped byte {i} of the keyframe shard was accepted"
