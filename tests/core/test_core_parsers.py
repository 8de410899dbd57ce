"""Parsers fed truncated, bit-flipped, byte-by-byte and garbage input raise deltasync's own errors
(FormatError / IntegrityError and their subclasses) and nothing else: never IndexError, ValueError,
KeyError, struct.error, OverflowError, RecursionError, zstd errors or MemoryError.
"""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.blob import STREAMS, BlobReader
from deltasync.codec import ChunkPatch, EncodeOptions, decode_blob, encode_delta
from deltasync.deltafile import pack_delta_file, unpack_delta_file
from deltasync.errors import DeltaSyncError, FormatError, IntegrityError, SignatureError
from deltasync.keyframe import encode_keyframe, load_keyframe, load_shard, save_shard
from deltasync.manifest import Manifest, parse_manifest
from deltasync.positions import decode_bitmap, decode_gaps, encode_bitmap, encode_gaps
from deltasync.values import detokenize
from deltasync.varint import decode_varints, encode_varints

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
KEY = bytes(range(32))
_PREFIX = struct.Struct("<8sII")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- fixtures: one of each kind of input ------------------------------------------------------------

def _states():
    g = torch.Generator().manual_seed(0)
    old = {
        "a": torch.randn(300, generator=g).to(torch.bfloat16),
        "b": torch.randn(6, 4, generator=g),
        "c": torch.randint(-100, 100, (20,), generator=g, dtype=torch.int8),
        "d": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "e": torch.randn(5, generator=g, dtype=torch.complex64),
    }
    new = {k: v.clone() for k, v in old.items()}
    a = new["a"].view(torch.int16)
    a[[0, 7, 100, 299]] += 1
    a[50] += 180
    a[60] ^= -32768
    new["b"].view(torch.int32)[::3] += 1
    new["c"][:] = torch.randint(-100, 100, (20,), generator=g, dtype=torch.int8)
    new["d"] = (old["d"].view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)
    new["e"].view(torch.int32)[3] -= 1
    return old, new


OLD, NEW = _states()
ENC = encode_delta(OLD, NEW, model="policy", version=7, parent=6)
ENC_MULTI = encode_delta(OLD, NEW, model="policy", version=7, parent=6, options=EncodeOptions(chunk_words=16, blob_target=60))
(BLOB,) = ENC.blobs.values()
SIGNED = ENC.manifest.sign(KEY)
MANIFEST_JSON = SIGNED.to_json()
DELTA_FILE = pack_delta_file(SIGNED, ENC.blobs)
SHARD = save_shard({"a": NEW["a"], "e": NEW["e"], "x": torch.zeros(3, dtype=torch.complex32),
                    "y": torch.tensor([3], dtype=torch.uint8).view(torch.float8_e8m0fnu)})


def check_patches(patches) -> None:
    """What decode_blob returns must be self-consistent, whatever bytes it was fed."""
    assert isinstance(patches, list)
    for p in patches:
        assert isinstance(p, ChunkPatch)
        assert 0 <= p.start < p.stop
        if p.dense is not None:
            assert p.dense.size == p.stop - p.start
        else:
            ch = p.changes
            assert 0 < ch.positions.size <= p.stop - p.start
            assert ch.raw.size == ch.values.size == ch.positions.size
            assert bool((np.diff(ch.positions) > 0).all()), "positions not strictly increasing"
            assert ch.positions[0] >= p.start and ch.positions[-1] < p.stop, "positions outside the chunk"


def only_our_errors(fn, *args, **kw):
    """Call fn; our errors are an acceptable answer (returned), anything else propagates and fails."""
    try:
        return fn(*args, **kw)
    except DeltaSyncError as e:
        assert isinstance(e, (FormatError, IntegrityError)), type(e)
        return e


def flips(data: bytes, every: int = 1):
    for i in range(0, len(data), every):
        for bit in range(8):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            yield i, bit, bytes(bad)


def unpack_container(blob: bytes) -> tuple[dict, dict[str, bytes]]:
    """(header, {stream: decompressed bytes}) of a blob, by the container layout alone."""
    _, _, hlen = _PREFIX.unpack_from(blob)
    header = json.loads(blob[_PREFIX.size:_PREFIX.size + hlen])
    body = blob[_PREFIX.size + hlen:]
    d = zstandard.ZstdDecompressor()
    streams = {n: d.decompress(body[o:o + c], max_output_size=r) for n, (o, c, r) in header["streams"].items()}
    return header, streams


def pack_container(header: dict, streams: dict[str, bytes], *, content_size: bool = True,
                   rlen: dict[str, int] | None = None) -> bytes:
    cctx = zstandard.ZstdCompressor(write_content_size=content_size)
    table, frames, off = {}, [], 0
    for name in sorted(streams):
        f = cctx.compress(streams[name])
        table[name] = [off, len(f), (rlen or {}).get(name, len(streams[name]))]
        frames.append(f)
        off += len(f)
    h = json.dumps(dict(header, streams=table), sort_keys=True, separators=(",", ":")).encode()
    return _PREFIX.pack(b"DSYNCBLB", 1, len(h)) + h + b"".join(frames)


V1 = EncodeOptions(format=1)  # the container helpers below speak blob format 1 (readers still accept it)


def _gap_blob():
    """A real one-chunk uint8 blob in gap mode with changes at 299, 599, 603 (two escaped gaps)."""
    old = torch.zeros(700, dtype=torch.uint8)
    new = old.clone()
    new[[299, 599, 603]] = 1
    (blob,) = encode_delta({"a": old}, {"a": new}, model="m", version=2, parent=1, options=V1).blobs.values()
    header, streams = unpack_container(blob)
    assert [c["mode"] for c in header["chunks"]] == ["gap"]
    return header, streams


def _dense_blob():
    old = torch.zeros(4, dtype=torch.float32)
    new = -torch.ones(4, dtype=torch.float32)
    (blob,) = encode_delta({"a": old}, {"a": new}, model="m", version=2, parent=1, options=V1).blobs.values()
    header, streams = unpack_container(blob)
    assert [c["mode"] for c in header["chunks"]] == ["dense"]
    return header, streams


GAP_HEADER, GAP_STREAMS = _gap_blob()
DENSE_HEADER, DENSE_STREAMS = _dense_blob()
CHUNK_KEYS = sorted(GAP_HEADER["chunks"][0])  # whatever today's format records per chunk


def test_container_helpers_round_trip():
    check_patches(decode_blob(pack_container(GAP_HEADER, GAP_STREAMS)))
    check_patches(decode_blob(pack_container(DENSE_HEADER, DENSE_STREAMS)))


# -- blobs -----------------------------------------------------------------------------------------------

def test_valid_inputs_parse():
    check_patches(decode_blob(BLOB))
    for data in ENC_MULTI.blobs.values():
        check_patches(decode_blob(data))
    assert parse_manifest(MANIFEST_JSON, verifier=KEY) == SIGNED
    assert unpack_delta_file(DELTA_FILE, verifier=KEY).manifest == SIGNED
    assert set(load_shard(SHARD)) == {"a", "e", "x", "y"}


def test_blob_every_prefix_is_a_format_error():
    """One byte at a time, as it arrives: every strict prefix is refused, the whole blob parses."""
    for n in range(len(BLOB)):
        with pytest.raises(FormatError):
            decode_blob(BLOB[:n])
    check_patches(decode_blob(BLOB))


def test_blob_with_trailing_bytes_is_a_format_error():
    for tail in (b"\0", b"\x28\xb5\x2f\xfd", BLOB):
        with pytest.raises(FormatError):
            decode_blob(BLOB + tail)


@pytest.mark.parametrize("blob", [BLOB, *ENC_MULTI.blobs.values()][:4], ids=lambda b: f"{len(b)}B")
def test_blob_every_bit_flip_raises_ours_or_decodes_consistently(blob):
    outcomes = {"error": 0, "decoded": 0}
    for _, _, bad in flips(blob):
        r = only_our_errors(decode_blob, bad)
        if isinstance(r, DeltaSyncError):
            outcomes["error"] += 1
        else:
            check_patches(r)
            outcomes["decoded"] += 1
    assert outcomes["error"] > outcomes["decoded"]


@FUZZ
@given(st.binary(max_size=300))
def test_blob_garbage(data):
    with pytest.raises(FormatError):
        decode_blob(data)
    with pytest.raises(FormatError):
        decode_blob(_PREFIX.pack(b"DSYNCBLB", 1, len(data)) + data)


_ints = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**32, 2**40, 2**62, 2**63 - 1]))
_vals = st.one_of(_ints, st.none(), st.booleans(), st.text(max_size=4), st.floats(allow_nan=False),
                  st.lists(st.integers(0, 5), max_size=3))
_names = st.sampled_from(sorted(STREAMS))


@st.composite
def blob_headers(draw):
    """Well-formed-looking headers with hostile values, and a body of real zstd frames."""
    frames, table, off = [], {}, 0
    cctx = zstandard.ZstdCompressor(write_content_size=draw(st.booleans()))
    for name in draw(st.lists(_names, max_size=5, unique=True)):
        raw = draw(st.binary(max_size=24))
        f = cctx.compress(raw)
        rlen = draw(st.one_of(st.just(len(raw)), st.integers(0, 64)))
        table[name] = [off, len(f), rlen]
        frames.append(f)
        off += len(f)
    chunks = []
    for _ in range(draw(st.integers(0, 3))):
        rec = {"tensor": draw(st.sampled_from(["a", "b", ""])),
               "dtype": draw(st.sampled_from(["bfloat16", "uint8", "float32", "int64", "complex128", "bool", "nope"])),
               "mode": draw(st.sampled_from(["gap", "bitmap", "dense", "other"]))}
        for k in CHUNK_KEYS:
            if k not in rec:
                rec[k] = draw(st.one_of(_ints, st.integers(0, 30)))
        if draw(st.integers(0, 9)) == 0:
            rec[draw(st.sampled_from(list(rec)))] = draw(_vals)
        chunks.append(rec)
    header = {"streams": table, "chunks": chunks}
    if draw(st.integers(0, 9)) == 0:
        header[draw(st.sampled_from(["streams", "chunks", "x"]))] = draw(_vals)
    h = json.dumps(header).encode()
    return _PREFIX.pack(b"DSYNCBLB", 1, len(h)) + h + b"".join(frames)


@FUZZ
@given(blob_headers())
def test_blob_hostile_headers(data):
    r = only_our_errors(decode_blob, data)
    if not isinstance(r, DeltaSyncError):
        check_patches(r)


def _blob(header, body=b"") -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return _PREFIX.pack(b"DSYNCBLB", 1, len(h)) + h + body


@pytest.mark.parametrize("header", [
    b"", b"null", b"[]", b"{}", b'{"streams":{},"chunks":{}}', b'{"streams":[],"chunks":[]}',
    b'{"streams":{},"chunks":[1]}', b'{"streams":{"zzz":[0,0,0]},"chunks":[]}',
    b'{"streams":{"tok":[0,1]},"chunks":[]}', b'{"streams":{"tok":[-1,1,1]},"chunks":[]}',
    b'{"streams":{"tok":[0,true,1]},"chunks":[]}', b'{"streams":{"tok":[0,5,1]},"chunks":[]}',
    b'{"streams":{},"chunks":[{}]}', b"\xff\xfe", b'{"streams":{},"chunks":[],"x":1}',
])
def test_blob_malformed_headers_table(header):
    with pytest.raises(FormatError):
        decode_blob(_blob(header))


@pytest.mark.parametrize("prefix", [
    b"DSYNCBLC" + struct.pack("<II", 1, 2) + b"{}",
    struct.pack("<8sII", b"DSYNCBLB", 2, 2) + b"{}",
    struct.pack("<8sII", b"DSYNCBLB", 1, 2**32 - 1) + b"{}",
    struct.pack("<8sII", b"DSYNCBLB", 1, 3) + b"{}",
])
def test_blob_bad_prefix(prefix):
    with pytest.raises(FormatError):
        decode_blob(prefix)


def test_blob_deeply_nested_header_is_a_format_error():
    """Regression (found here): json.loads' RecursionError escaped BlobReader."""
    with pytest.raises(FormatError):
        decode_blob(_blob(b"[" * 100_000 + b"]" * 100_000))


def _mutated(header: dict, **changes) -> dict:
    rec = dict(header["chunks"][0], **changes)
    for k in [k for k, v in changes.items() if v is _DROP]:
        del rec[k]
    return dict(header, chunks=[rec] + header["chunks"][1:])


class _Drop:
    """A record field removed, not set (its repr keeps test ids the same in every process: pytest-xdist)."""

    def __repr__(self) -> str:
        return "<dropped>"


_DROP = _Drop()


_FIELD_CASES = [
    ("dtype", "float128"), ("dtype", 7), ("tensor", None), ("mode", "sparse"), ("mode", ["gap"]),
    ("start", -1), ("start", 1.0), ("start", True), ("start", "0"), ("stop", 0), ("count", 0), ("count", 10**6),
    ("count", 2), ("ng", 99), ("ngx", 99), ("nt", 9), ("ne", 3), ("nr", 5), ("start", _DROP), ("extra", 1),
]
def _field_params():
    for base in ("gap", "dense"):
        for field, value in _FIELD_CASES:
            # (dense records with non-zero ng/ngx/nt/ne/nr were accepted before a fix found here)
            yield pytest.param(base, field, value, id=f"{base}-{field}={value!r}"[:40])


@pytest.mark.parametrize("base,field,value", list(_field_params()))
def test_blob_chunk_record_fields_table(base, field, value):
    header, streams = (GAP_HEADER, GAP_STREAMS) if base == "gap" else (DENSE_HEADER, DENSE_STREAMS)
    if field not in header["chunks"][0] and field != "extra":
        pytest.skip(f"this format has no {field!r}")
    bad = pack_container(_mutated(header, **{field: value}), streams)
    r = only_our_errors(decode_blob, bad)
    assert isinstance(r, FormatError), f"accepted {field}={value!r}: {r}"


@pytest.mark.parametrize("stream", sorted(set(GAP_STREAMS) | set(DENSE_STREAMS)))
@pytest.mark.parametrize("how", ["drop", "extra-byte", "short"])
def test_blob_streams_that_do_not_match_their_chunks(stream, how):
    header, streams = (GAP_HEADER, GAP_STREAMS) if stream in GAP_STREAMS else (DENSE_HEADER, DENSE_STREAMS)
    streams = dict(streams)
    if how == "drop":
        del streams[stream]
    elif how == "extra-byte":
        streams[stream] = streams[stream] + b"\0" * (8 if stream[-1].isdigit() else 1)
    else:
        streams[stream] = streams[stream][:-1]
    assert isinstance(only_our_errors(decode_blob, pack_container(header, streams)), FormatError)


def test_blob_chunk_start_beyond_int64_is_a_format_error():
    stop = GAP_HEADER["chunks"][0]["stop"]
    bad = pack_container(_mutated(GAP_HEADER, start=2**70, stop=2**70 + stop), GAP_STREAMS)
    assert isinstance(only_our_errors(decode_blob, bad), FormatError)


def test_gap_overflow_is_a_format_error():
    assert GAP_STREAMS["gap"] == bytes([255, 255, 3])  # positions 299, 599, 603
    gapx = encode_varints(np.array([2**63 - 2 - 255] * 2, dtype=np.uint64)).tobytes()
    streams = dict(GAP_STREAMS, gap=bytes([255, 255, 4]), gapx=gapx)  # gaps 2**63-2 twice, then 4 -> last = 2
    bad = pack_container(_mutated(GAP_HEADER, ngx=len(gapx)), streams)
    r = only_our_errors(decode_blob, bad)
    assert isinstance(r, FormatError), f"decoded: {[p.changes.positions.tolist() for p in r]}"


def test_gap_decoder_direct_overflow_case():
    """Regression (found here): wrapping escaped gaps gave positions outside the chunk."""
    gapx = encode_varints(np.array([2**63 - 2 - 255] * 2, dtype=np.uint64))
    r = only_our_errors(decode_gaps, np.array([255, 255, 4], np.uint8), gapx, 3, 10)
    assert isinstance(r, FormatError), f"decode_gaps returned {r.tolist()} for a chunk of 10 words"


def test_blob_huge_declared_stream_length_is_a_format_error():
    name = next(n for n in DENSE_STREAMS if n.startswith("dense"))
    bad = pack_container(DENSE_HEADER, DENSE_STREAMS, content_size=False, rlen={name: 2**40})
    assert isinstance(only_our_errors(decode_blob, bad), FormatError)


def test_blob_stream_decompresses_to_other_length_than_declared():
    name = next(n for n in DENSE_STREAMS if n.startswith("dense"))
    n = len(DENSE_STREAMS[name])
    for content_size in (True, False):
        for rlen in (0, n - 1, n + 1, n + 8):
            bad = pack_container(DENSE_HEADER, DENSE_STREAMS, content_size=content_size, rlen={name: rlen})
            assert isinstance(only_our_errors(decode_blob, bad), FormatError), (content_size, rlen)
    _, _, hlen = _PREFIX.unpack_from(pack_container(DENSE_HEADER, DENSE_STREAMS))
    good = pack_container(DENSE_HEADER, DENSE_STREAMS)
    body = bytearray(good[_PREFIX.size + hlen:])
    body[:4] = b"\0\0\0\0"  # not a zstd frame any more
    with pytest.raises(FormatError):
        decode_blob(good[:_PREFIX.size + hlen] + bytes(body))


def test_blob_reader_word_stream_length_not_a_multiple():
    f = zstandard.ZstdCompressor().compress(b"\1\2\3")
    r = BlobReader(_blob({"streams": {"raw2": [0, len(f), 3]}, "chunks": []}, f))
    with pytest.raises(FormatError):
        r.stream("raw2")


# -- manifests -------------------------------------------------------------------------------------------

def test_manifest_every_prefix_is_a_format_error():
    for n in range(len(MANIFEST_JSON)):
        with pytest.raises(FormatError):
            parse_manifest(MANIFEST_JSON[:n])
    assert parse_manifest(MANIFEST_JSON) == SIGNED


def test_manifest_every_bit_flip_is_refused_with_a_key():
    """Without a key a flip may parse (a different, unsigned-checked manifest); with the key never."""
    parsed_unkeyed = 0
    for i, bit, bad in flips(MANIFEST_JSON):
        with pytest.raises((FormatError, SignatureError)):
            parse_manifest(bad, verifier=KEY)
        r = only_our_errors(parse_manifest, bad)
        if isinstance(r, Manifest):
            parsed_unkeyed += 1
            assert r != SIGNED
    assert parsed_unkeyed > 0  # e.g. a hex digit of a fingerprint: exactly why manifests are signed


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_manifest_garbage(data):
    with pytest.raises(FormatError):
        parse_manifest(data)


_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)


@FUZZ
@given(field=st.sampled_from(["format", "model", "version", "parent", "kind", "state_fp_before", "state_fp", "meta",
                              "tensors", "blobs", "signature"]),
       sub=st.sampled_from([None, "name", "dtype", "shape", "fp_before", "fp_after", "changed", "chunks"]),
       value=_json_values)
def test_manifest_hostile_field_values(field, sub, value):
    if field == "signature" and isinstance(value, str) and not value.isascii():
        return  # see test_manifest_non_ascii_signature_is_a_signature_error
    obj = json.loads(MANIFEST_JSON)
    if sub is not None and field == "tensors":
        if obj["tensors"][1][sub] == value:
            return
        obj["tensors"][1][sub] = value
    else:
        if obj[field] == value:
            return
        obj[field] = value
    r = only_our_errors(parse_manifest, json.dumps(obj).encode())
    if isinstance(r, Manifest):
        with pytest.raises(SignatureError):
            r.verify_signature(KEY)


@pytest.mark.parametrize("sig", ["\x80", "hmac-sha256:\u00e9"])
def test_manifest_non_ascii_signature_is_a_signature_error(sig):
    """Regression (found here): a non-ASCII signature raised TypeError from hmac.compare_digest."""
    obj = json.loads(MANIFEST_JSON)
    obj["signature"] = sig
    with pytest.raises((SignatureError, FormatError)):
        parse_manifest(json.dumps(obj).encode(), verifier=KEY)


def test_manifest_deeply_nested_and_huge():
    with pytest.raises(FormatError):
        parse_manifest(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(FormatError):
        parse_manifest(b'{"x":' * 100_000)


# -- delta files -----------------------------------------------------------------------------------------

def test_delta_file_every_prefix_is_a_format_error():
    for n in range(len(DELTA_FILE)):
        with pytest.raises(FormatError):
            unpack_delta_file(DELTA_FILE[:n])
    assert unpack_delta_file(DELTA_FILE, verifier=KEY).blobs == ENC.blobs


def test_delta_file_every_bit_flip_is_refused_with_a_key():
    reserved = range(12, 16)  # the reserved u32 is not checked by readers (see the report)
    step = 1 if len(DELTA_FILE) < 4000 else 3
    for i, bit, bad in flips(DELTA_FILE, step):
        if i in reserved:
            continue
        with pytest.raises((FormatError, IntegrityError)):
            unpack_delta_file(bad, verifier=KEY)


def test_delta_file_flips_without_key_raise_ours_or_parse():
    for i, bit, bad in flips(DELTA_FILE, 5):
        only_our_errors(unpack_delta_file, bad)


@FUZZ
@given(st.binary(max_size=200))
def test_delta_file_garbage(data):
    with pytest.raises(FormatError):
        unpack_delta_file(data)
    with pytest.raises(FormatError):
        unpack_delta_file(struct.pack("<8sIIQ", b"DSYNCDLT", 1, 0, len(data)) + data)


def test_delta_file_trailing_bytes_and_wrong_key():
    with pytest.raises(FormatError):
        unpack_delta_file(DELTA_FILE + b"\0")
    with pytest.raises(SignatureError):
        unpack_delta_file(DELTA_FILE, verifier=b"k" * 32)
    with pytest.raises(FormatError):
        unpack_delta_file(struct.pack("<8sIIQ", b"DSYNCDLT", 2, 0, 0))
    with pytest.raises(FormatError):
        unpack_delta_file(struct.pack("<8sIIQ", b"DSYNCDLT", 1, 0, 2**64 - 1))


# -- keyframe shards -------------------------------------------------------------------------------------

def test_shard_every_prefix_is_a_format_error():
    for n in range(len(SHARD)):
        with pytest.raises(FormatError):
            load_shard(SHARD[:n])


def test_shard_every_bit_flip_raises_ours_or_loads():
    for _, _, bad in flips(SHARD):
        r = only_our_errors(load_shard, bad)
        if not isinstance(r, DeltaSyncError):
            assert isinstance(r, dict) and all(isinstance(t, torch.Tensor) for t in r.values())


@FUZZ
@given(st.binary(max_size=200))
def test_shard_garbage(data):
    with pytest.raises(FormatError):
        load_shard(data)
    with pytest.raises(FormatError):
        load_shard(struct.pack("<Q", len(data)) + data)


def _st_bytes(header: dict, body: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


@pytest.mark.parametrize("header,body", [
    ({"__metadata__": [1]}, b""),
    ({"__metadata__": {"deltasync.dtype.a": "complex32"}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"__metadata__": {"deltasync.dtype.a": "complex32"}, "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}, b"\0" * 3),
    ({"__metadata__": {"deltasync.dtype.a": "complex32"}, "a": {"dtype": "U8", "shape": [], "data_offsets": [0, 1]}}, b"\0"),
    ({"__metadata__": {"deltasync.dtype.a": "float128"}, "a": {"dtype": "U8", "shape": [1, 16], "data_offsets": [0, 16]}}, b"\0" * 16),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4),
    ([1, 2], b""),
])
def test_shard_malformed_table(header, body):
    with pytest.raises(FormatError):
        load_shard(_st_bytes(header, body) if isinstance(header, dict) else struct.pack("<Q", 5) + b"[1,2]")


def test_keyframe_with_flipped_shard_is_refused():
    kf = encode_keyframe(NEW, model="policy", version=7, shard_bytes=256)
    for bid, data in kf.blobs.items():
        for _, _, bad in flips(data, 7):
            blobs = dict(kf.blobs)
            blobs[bid] = bad
            r = only_our_errors(load_keyframe, kf.manifest, blobs)
            if not isinstance(r, DeltaSyncError):  # a flip in JSON whitespace or unused header bytes
                state, _ = r
                for n, t in state.items():
                    assert torch.equal(t.contiguous().view(torch.uint8), NEW[n].contiguous().view(torch.uint8))


# -- varints, positions, values ------------------------------------------------------------------------

@FUZZ
@given(st.lists(st.integers(0, 2**64 - 1), max_size=20))
def test_varints_round_trip_and_prefixes(values):
    enc = encode_varints(np.array(values, dtype=np.uint64))
    assert decode_varints(enc, len(values)).tolist() == values
    for n in range(enc.size):
        with pytest.raises(FormatError):
            decode_varints(enc[:n], len(values))
    with pytest.raises(FormatError):
        decode_varints(np.concatenate([enc, np.array([0], np.uint8)]), len(values))


@FUZZ
@given(st.binary(max_size=40), st.integers(0, 12))
def test_varints_garbage(data, count):
    r = only_our_errors(decode_varints, np.frombuffer(data, np.uint8), count)
    if not isinstance(r, DeltaSyncError):
        assert r.dtype == np.uint64 and r.size == count


def test_varint_longer_than_ten_bytes():
    with pytest.raises(FormatError):
        decode_varints(np.array([0x80] * 10 + [1], np.uint8), 1)


@FUZZ
@given(st.sets(st.integers(0, 5000), max_size=60))
def test_positions_round_trip(ps):
    pos = np.array(sorted(ps), dtype=np.int64)
    small, big = encode_gaps(pos)
    assert decode_gaps(small, big, pos.size, 5001).tolist() == pos.tolist()
    bm = encode_bitmap(pos, 5001)
    assert decode_bitmap(bm, pos.size, 5001).tolist() == pos.tolist()
    if pos.size:
        with pytest.raises(FormatError):  # the last position must lie inside the chunk
            decode_gaps(small, big, pos.size, int(pos[-1]))


@FUZZ
@given(small=st.binary(max_size=30), big=st.lists(st.integers(0, 2**56), max_size=8),
       count=st.integers(0, 30), length=st.integers(0, 2**40))
def test_gaps_garbage_yield_valid_positions_or_format_error(small, big, count, length):
    r = only_our_errors(decode_gaps, np.frombuffer(small, np.uint8),
                        encode_varints(np.array(big, dtype=np.uint64)), count, length)
    if not isinstance(r, DeltaSyncError):
        assert r.size == count
        assert bool((np.diff(r) > 0).all())
        if r.size:
            assert 0 <= r[0] and r[-1] < length


@FUZZ
@given(packed=st.binary(max_size=20), count=st.integers(0, 40), length=st.integers(0, 160))
def test_bitmap_garbage(packed, count, length):
    r = only_our_errors(decode_bitmap, np.frombuffer(packed, np.uint8), count, length)
    if not isinstance(r, DeltaSyncError):
        assert r.size == count and bool((np.diff(r) > 0).all())
        if r.size:
            assert r[-1] < length


@FUZZ
@given(tokens=st.binary(max_size=20), ext=st.binary(max_size=20), nraw=st.integers(0, 20),
       word=st.sampled_from([1, 2, 4, 8]))
def test_detokenize_garbage(tokens, ext, nraw, word):
    tok = np.frombuffer(tokens, np.uint8)
    raw = np.zeros(nraw, dtype=f"<u{word}")
    r = only_our_errors(detokenize, np.arange(tok.size, dtype=np.int64), tok, np.frombuffer(ext, np.uint8), raw, word)
    if not isinstance(r, DeltaSyncError):
        assert r.values.dtype == np.dtype(f"<u{word}") and r.values.size == tok.size


@st.composite
def changes_st(draw):
    from deltasync.values import Changes

    word = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(0, 40))
    bits = 8 * word
    raw = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    small = st.sampled_from([1, (1 << bits) - 1, 2, (1 << bits) - 2, 127, 128, 129, (1 << bits) - 129])
    vals = draw(st.lists(st.one_of(small, st.integers(1, (1 << bits) - 1)), min_size=n, max_size=n))
    values = np.array(vals, dtype=np.uint64).astype(f"<u{word}")
    return Changes(positions=np.arange(n, dtype=np.int64) * 3, raw=raw, values=values), word


def _same_changes(a, b):
    assert a.positions.tolist() == b.positions.tolist()
    assert a.raw.tolist() == b.raw.tolist()
    assert a.values.dtype == b.values.dtype
    assert a.values.tolist() == b.values.tolist()


@FUZZ
@given(changes_st())
def test_values_coding_round_trips(cw):
    from deltasync.values import tokenize

    ch, word = cw
    tokens, ext, raw = tokenize(ch)
    _same_changes(detokenize(ch.positions, tokens, ext, raw, word), ch)
    try:
        from deltasync.values import decode_values, encode_values
    except ImportError:  # an older value coding without 2-bit symbols
        return
    sym, tok, ext, raw = encode_values(ch)
    _same_changes(decode_values(ch.positions, sym, tok, ext, raw, word), ch)


@FUZZ
@given(sym=st.binary(max_size=12), tokens=st.binary(max_size=20), ext=st.binary(max_size=12),
       count=st.integers(0, 40), nraw=st.integers(0, 10), word=st.sampled_from([1, 2, 4, 8]))
def test_decode_values_garbage(sym, tokens, ext, count, nraw, word):
    decode_values = pytest.importorskip("deltasync.values").__dict__.get("decode_values")
    if decode_values is None:
        pytest.skip("no 2-bit symbol coding in this build")
    r = only_our_errors(decode_values, np.arange(count, dtype=np.int64), np.frombuffer(sym, np.uint8),
                        np.frombuffer(tokens, np.uint8), np.frombuffer(ext, np.uint8),
                        np.zeros(nraw, dtype=f"<u{word}"), word)
    if not isinstance(r, DeltaSyncError):
        assert r.values.size == r.raw.size == count and r.values.dtype == np.dtype(f"<u{word}")
        assert bool((r.values[~r.raw] != 0).all()), "a decoded step of zero is not a change"


def test_write_and_read_delta_file(tmp_path):
    from deltasync.deltafile import read_delta_file, write_delta_file

    path = tmp_path / "v7.dsd"
    n = write_delta_file(path, SIGNED, ENC.blobs)
    assert n == path.stat().st_size == len(DELTA_FILE)
    df = read_delta_file(path, verifier=KEY)
    assert df.manifest == SIGNED and df.blobs == ENC.blobs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v7.dsd"]  # no temp file left behind
    write_delta_file(path, SIGNED, ENC.blobs)  # replacing is atomic and fine
    assert read_delta_file(path).manifest == SIGNED


@pytest.mark.parametrize("token,ext", [(252, 2**64 - 127), (253, 2**64 - 127), (252, 2**64 - 1), (252, 2**63)])
def test_detokenize_refuses_out_of_range_8_byte_steps(token, ext):
    r = only_our_errors(detokenize, np.arange(1, dtype=np.int64), np.array([token], np.uint8),
                        encode_varints(np.array([ext], np.uint64)), np.zeros(0, np.uint64), 8)
    assert isinstance(r, FormatError), f"decoded step {r.values.tolist()}"


def test_detokenize_refuses_out_of_range_narrow_steps():
    for word in (1, 2, 4):
        bits = 8 * word
        r = only_our_errors(detokenize, np.arange(1, dtype=np.int64), np.array([252], np.uint8),
                            encode_varints(np.array([1 << (bits - 1)], np.uint64)), np.zeros(0, f"<u{word}"), word)
        assert isinstance(r, FormatError), word


@pytest.mark.parametrize("variant", ["symbols", "tokens", "raw-words", "big-step-token"])
def test_decoder_accepts_every_valid_choice_of_coding(variant):
    """FORMAT.md §3.2: decoders MUST accept any valid token for any word; the encoder's choice is not format."""
    header, streams = dict(GAP_HEADER), dict(GAP_STREAMS)
    if "sym" not in streams:
        pytest.skip("no 2-bit symbol stream in this format")
    rec = dict(header["chunks"][0])
    count = rec["count"]
    assert count == 3
    want = 1
    if variant == "tokens":  # +1 as token 0 instead of symbol 0
        streams["sym"] = bytes([0b101010])
        streams["tok"] = bytes([0, 0, 0])
        rec.update(nt=3)
    elif variant == "raw-words":  # the new words themselves
        streams["sym"] = bytes([0b101010])
        streams["tok"] = bytes([254, 254, 254])
        streams["raw1"] = bytes([1, 1, 1])
        rec.update(nt=3, nr=3)
    elif variant == "big-step-token":  # +128 (the encoder would send it raw): positive step, m = 126 + 1
        streams["sym"] = bytes([0b101010])
        streams["tok"] = bytes([252, 252, 252])
        streams["ext"] = bytes([1, 1, 1])
        rec.update(nt=3, ne=3)
        want = 128
    header["chunks"] = [rec]
    patches = decode_blob(pack_container(header, streams))
    check_patches(patches)
    words = np.zeros(700, np.uint8)
    from deltasync.values import apply_changes_np

    apply_changes_np(words, patches[0].changes)
    assert np.flatnonzero(words).tolist() == [299, 599, 603] and set(words[[299, 599, 603]]) == {want}


# -- blob version 4: binary chunk columns (docs/FORMAT.md §4.6) -----------------------------------------------

def _v4_parts():
    """(streams JSON, chunk block) of a real version-4 blob of two ans chunks and its bytes."""
    old = {"a": torch.arange(300, dtype=torch.float32).to(torch.bfloat16), "b": torch.ones(40, dtype=torch.float32)}
    new = {n: t.clone() for n, t in old.items()}
    new["a"].view(torch.int16)[::7] += 1
    new["b"][3] = -1.0
    (blob,) = encode_delta(old, new, model="m", version=1, parent=0).blobs.values()
    hlen = _PREFIX.unpack_from(blob)[2]
    text = zstandard.ZstdDecompressor().decompress(blob[16:16 + hlen])
    slen = struct.unpack_from("<I", text)[0]
    return text[4:4 + slen], text[4 + slen:], blob[16 + hlen:]


def _v4(streams: bytes, block: bytes, body: bytes) -> bytes:
    h = zstandard.ZstdCompressor().compress(struct.pack("<I", len(streams)) + streams + block)
    return _PREFIX.pack(b"DSYNCBLB", 4, len(h)) + h + body


def test_blob_v4_parts_round_trip():
    streams, block, body = _v4_parts()
    patches = decode_blob(_v4(streams, block, body))
    assert [(p.tensor, p.count) for p in patches] == [("a", 43), ("b", 1)]


def _v4_cases():
    streams, block, body = _v4_parts()
    n = 2
    names_at = 12 + struct.unpack_from("<I", block, 8)[0]  # after u32 n, u32 k, u32 dlen and the dtype names
    cols_at = names_at + 4 + struct.unpack_from("<I", block, names_at)[0]
    ints_at = cols_at + 2 * n  # after u8 dtype[n], u8 mode[n]
    assert len(block) == ints_at + 40 * n
    return {
        "truncated block": (streams, block[:-1]),
        "block too long": (streams, block + b"\0"),
        "no block": (streams, b""),
        "more chunks declared": (streams, struct.pack("<I", n + 1) + block[4:]),
        "more dtypes declared": (streams, block[:4] + struct.pack("<I", 9) + block[8:]),
        "dtype text past the end": (streams, block[:8] + struct.pack("<I", 1 << 30) + block[12:]),
        "names not utf-8": (streams, block[:names_at + 4] + b"\xff" + block[names_at + 5:]),
        "dtype index past the names": (streams, block[:cols_at] + b"\x07" + block[cols_at + 1:]),
        "unknown mode": (streams, block[:cols_at + n] + b"\x05" + block[cols_at + n + 1:]),
        "ansx mode code": (streams, block[:cols_at + n] + b"\x02" + block[cols_at + n + 1:]),
        # the 5n u64 values are byte-plane shuffled: byte k of value j at ints_at + k * 5n + j; values: start[n],
        # stop[n], count[n], na[n], nr[n]
        "start past 2**48": (streams, block[:ints_at + 6 * 5 * n] + b"\x7f" + block[ints_at + 6 * 5 * n + 1:]),
        "count zero": (streams, block[:ints_at + 2 * n] + b"\0" * n + block[ints_at + 3 * n:]),
        "streams not an object": (b"[]", block),
        "a v1 stream": (streams[:-1] + b',"gap":[0,0,0]}', block),
    }


@pytest.mark.parametrize("case", sorted(_v4_cases()))
def test_blob_v4_malformed_columns_are_format_errors(case):
    streams, block = _v4_cases()[case]
    _, _, body = _v4_parts()
    with pytest.raises(FormatError):
        decode_blob(_v4(streams, block, body))


def test_blob_v4_streams_length_past_the_header():
    streams, block, body = _v4_parts()
    h = zstandard.ZstdCompressor().compress(struct.pack("<I", 1 << 20) + streams + block)
    with pytest.raises(FormatError, match="streams' JSON"):
        decode_blob(_PREFIX.pack(b"DSYNCBLB", 4, len(h)) + h + body)


def test_blob_v4_falls_back_to_v2_for_a_newline_in_a_name():
    """A tensor name holding a newline cannot be listed in version 4's names: that blob is written in version 2
    (JSON records), by the chunk packer and by the columnar encoder alike, and decodes to the same chunks."""
    from deltasync import columnar

    names = [f"t{i}" for i in range(40)] + ["odd\nname"]
    old = {n: torch.zeros(64, dtype=torch.bfloat16) for n in names}
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        t.view(torch.int16)[5] += 1
    saved = columnar.FLAT_MIN
    try:
        for flat_min in (saved, 1):  # the packer's path, then the columnar encoder's
            columnar.FLAT_MIN = flat_min
            enc = encode_delta(old, new, model="m", version=1, parent=0)
            assert {BlobReader(b).version for b in enc.blobs.values()} == {2}
            got = {p.tensor: p.count for b in enc.blobs.values() for p in decode_blob(b)}
            assert got == {n: 1 for n in names}
    finally:
        columnar.FLAT_MIN = saved
