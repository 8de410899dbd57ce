"""Golden bytes for one tiny delta.

IF THIS FAILS, THE WIRE FORMAT CHANGED. Blobs and manifests already published (and subscribers
already deployed) read the old bytes. If the change is intended: bump the format version
(``deltasync.blob.VERSION`` and/or ``deltasync.manifest.FORMAT_VERSION``), describe the new layout in
docs/FORMAT.md, keep a reader for the old version if deployed data must stay readable, and only then
regenerate the constants below.

The one exception: ``test_golden_blob_bytes`` also pins zstd's output. The frames here are tiny
"raw" blocks, so a zstd upgrade is very unlikely to change them; if only that test fails while
``test_golden_streams_below_zstd`` and ``test_golden_bytes_still_decode`` pass, the container is
unchanged and only the compressor's choice moved.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
import zstandard

from deltasync.apply import apply_delta
from deltasync.blob import BlobReader, blob_id
from deltasync.codec import EncodeOptions, decode_blob, diff_states, encode_delta
from deltasync.deltafile import pack_delta_file, unpack_delta_file
from deltasync.errors import BaseMismatchError, UnsupportedError
from deltasync.fingerprint import fp_hex, tensor_fingerprint
from deltasync.history import StateHistory
from deltasync.manifest import parse_manifest

KEY = bytes(range(32))


def golden_states():
    a0 = (torch.arange(300, dtype=torch.float32) * 0.37 - 10.0).to(torch.bfloat16)
    a0[5], a0[6], a0[7] = float("nan"), float("-inf"), -0.0
    a1 = a0.clone().view(torch.int16)
    a1[0] += 1  # +1 ULP
    a1[3] -= 1  # -1 ULP
    a1[10] += 200  # a big step: token 252 + a varint in the ext stream
    a1[40] ^= -32768  # sign flip: a raw word
    a1[299] += 1  # after a gap of 258 words: escaped to the gapx stream
    b0 = torch.tensor([[1.0, -2.0], [0.25, 1.0]], dtype=torch.float32)
    b1 = b0.clone()
    b1[1, 1] = -1.0  # sign flip in a small tensor: bitmap mode, raw word
    c0 = torch.tensor([1, -2, 3], dtype=torch.int64)  # unchanged: no chunks
    d0 = torch.tensor([1.0, -2.0, 0.5, 448.0], dtype=torch.float32).to(torch.float8_e5m2)
    d1 = (d0.view(torch.uint8) ^ 0x80).view(torch.float8_e5m2)  # every word rewritten: dense mode
    old = {"a": a0, "b": b0, "c": c0, "d": d0}
    new = {"a": a1.view(torch.bfloat16), "b": b1, "c": c0.clone(), "d": d1}
    return old, new


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


GOLDEN_BLOB_HEX = (
    "4453594e43424c4201000000090200007b226368756e6b73223a5b7b22636f756e74223a352c226474797065223a2262"
    "666c6f61743136222c226d6f6465223a22676170222c226e65223a312c226e67223a352c226e6778223a312c226e7222"
    "3a312c226e74223a322c227374617274223a302c2273746f70223a3330302c2274656e736f72223a2261227d2c7b2263"
    "6f756e74223a312c226474797065223a22666c6f61743332222c226d6f6465223a226269746d6170222c226e65223a30"
    "2c226e67223a302c226e6778223a302c226e72223a312c226e74223a312c227374617274223a302c2273746f70223a34"
    "2c2274656e736f72223a2262227d2c7b22636f756e74223a342c226474797065223a22666c6f6174385f65356d32222c"
    "226d6f6465223a2264656e7365222c226e65223a302c226e67223a302c226e6778223a302c226e72223a302c226e7422"
    "3a302c227374617274223a302c2273746f70223a342c2274656e736f72223a2264227d5d2c2273747265616d73223a7b"
    "226269746d6170223a5b302c31302c315d2c2264656e736531223a5b31302c31332c345d2c22657874223a5b32332c31"
    "302c315d2c22676170223a5b33332c31342c355d2c2267617078223a5b34372c31302c315d2c2272617732223a5b3537"
    "2c31312c325d2c2272617734223a5b36382c31332c345d2c2273796d223a5b38312c31322c335d2c22746f6b223a5b39"
    "332c31322c335d7d7d28b52ffd20010900000828b52ffd2004210000bc40b8df28b52ffd20010900004928b52ffd2005"
    "2900000002061dff28b52ffd20010900000328b52ffd20021100009ac028b52ffd2004210000000080bf28b52ffd2003"
    "190000a4000228b52ffd2003190000fcfefe"
)
GOLDEN_MANIFEST = (
    '{"blobs":[{"digest":null,"id":"5bda32f1eaa742416b2140871afeda4a","size":642}],"format":2,"key_id":null,'
    '"kind":"delta","meta":{},'
    '"model":"policy","parent":1,"signature":null,"state_fp":"7c53280750e88324","state_fp_before":"83399e'
    '61d36f45d3","tensors":[{"changed":5,"chunks":[{"blob":"5bda32f1eaa742416b2140871afeda4a","index":0}]'
    ',"dtype":"bfloat16","fp_after":"2fb6990bb1c93e6c","fp_before":"001d964929711a3f","name":"a","shape":'
    '[300]},{"changed":1,"chunks":[{"blob":"5bda32f1eaa742416b2140871afeda4a","index":1}],"dtype":"float3'
    '2","fp_after":"1340bb0ec7e3db68","fp_before":"83e4949d27fe5b68","name":"b","shape":[2,2]},{"changed"'
    ':0,"chunks":[],"dtype":"int64","fp_after":"7bfc05a38f444ad3","fp_before":"7bfc05a38f444ad3","name":"'
    'c","shape":[3]},{"changed":4,"chunks":[{"blob":"5bda32f1eaa742416b2140871afeda4a","index":2}],"dtype'
    '":"float8_e5m2","fp_after":"18c53af8b22bb773","fp_before":"4b2b7f268342dc73","name":"d","shape":[4]}'
    '],"version":2}'
)
GOLDEN_BLOB = bytes.fromhex("".join(GOLDEN_BLOB_HEX))
GOLDEN_BLOB_ID = "5bda32f1eaa742416b2140871afeda4a"
GOLDEN_SIGNATURE = "hmac-sha256:0d25e8b61f3b97b37c8f3226c9a67a575a8bdc28987824b006705174bb38d8d6"  # manifest format 2
# decompressed streams, concatenated over the blob's chunks (docs/FORMAT.md "blob", "positions", "values")
GOLDEN_STREAMS = {
    "bitmap": "08",  # b: word 3 changed
    "dense1": "bc40b8df",  # d: every fp8 word with its sign flipped
    "ext": "49",  # a[10]: m - 126 = 199 - 126 = 73
    "gap": "0002061dff",  # a: positions 0, 3, 10, 40, then 255 = escape ...
    "gapx": "03",  # ... 258 - 255 = 3 -> position 299
    "raw2": "9ac0",  # a[40] with its sign flipped
    "raw4": "000080bf",  # b[1, 1] = -1.0f
    "sym": "a40002",  # a: +1, -1, token, token, +1 (2-bit symbols, 4 per byte); b: token
    "tok": "fcfefe",  # a: big +, raw; b: raw
}
GOLDEN_CHUNKS = [
    {"count": 5, "dtype": "bfloat16", "mode": "gap", "ne": 1, "ng": 5, "ngx": 1, "nr": 1, "nt": 2, "start": 0, "stop": 300, "tensor": "a"},
    {"count": 1, "dtype": "float32", "mode": "bitmap", "ne": 0, "ng": 0, "ngx": 0, "nr": 1, "nt": 1, "start": 0, "stop": 4, "tensor": "b"},
    {"count": 4, "dtype": "float8_e5m2", "mode": "dense", "ne": 0, "ng": 0, "ngx": 0, "nr": 0, "nt": 0, "start": 0, "stop": 4, "tensor": "d"},
]
GOLDEN_DELTA_FILE_PREFIX = "4453594e43444c540100000000000000ae03000000000000"  # DSYNCDLT, v1, reserved 0, mlen


V1 = EncodeOptions(format=1)  # the constants above are blob format 1, which we still write on request


def test_golden_blob_bytes():
    old, new = golden_states()
    enc = encode_delta(old, new, model="policy", version=2, parent=1, options=V1)
    assert list(enc.blobs) == [GOLDEN_BLOB_ID]
    assert enc.blobs[GOLDEN_BLOB_ID].hex() == GOLDEN_BLOB.hex()
    assert blob_id(GOLDEN_BLOB) == GOLDEN_BLOB_ID


def test_golden_manifest_json():
    old, new = golden_states()
    enc = encode_delta(old, new, model="policy", version=2, parent=1, options=V1)
    assert enc.manifest.to_json().decode() == "".join(GOLDEN_MANIFEST)
    # the fingerprints in it are those of the states (pins the fingerprint function too)
    m = json.loads("".join(GOLDEN_MANIFEST))
    for rec in m["tensors"]:
        assert rec["fp_before"] == fp_hex(tensor_fingerprint(old[rec["name"]]))
        assert rec["fp_after"] == fp_hex(tensor_fingerprint(new[rec["name"]]))


def test_golden_streams_below_zstd():
    magic, version, hlen = struct.unpack_from("<8sII", GOLDEN_BLOB)
    assert (magic, version) == (b"DSYNCBLB", 1)
    header = json.loads(GOLDEN_BLOB[16:16 + hlen])
    assert header["chunks"] == GOLDEN_CHUNKS
    reader = BlobReader(GOLDEN_BLOB)
    got = {n: reader.stream(n).view(np.uint8).tobytes().hex() for n in sorted(reader.stream_names)}
    assert got == GOLDEN_STREAMS
    # streams are laid out back to back in name order
    offsets = [header["streams"][n][0] for n in sorted(header["streams"])]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_golden_bytes_still_decode():
    """A reader must keep decoding the pinned bytes (whatever today's encoder writes)."""
    old, new = golden_states()
    patches = decode_blob(GOLDEN_BLOB)
    assert [(p.tensor, p.dtype, p.start, p.stop, p.count) for p in patches] == [
        ("a", "bfloat16", 0, 300, 5), ("b", "float32", 0, 4, 1), ("d", "float8_e5m2", 0, 4, 4)]
    a = patches[0].changes
    assert a.positions.tolist() == [0, 3, 10, 40, 299]
    assert a.raw.tolist() == [False, False, False, True, False]
    assert a.values.tolist() == [1, 0xFFFF, 200, int(new["a"].view(torch.int16)[40]) & 0xFFFF, 1]
    assert patches[2].dense.tolist() == list(tensor_bytes(new["d"]))
    m = parse_manifest("".join(GOLDEN_MANIFEST))
    target = {n: t.clone() for n, t in old.items()}
    apply_delta(target, m, {GOLDEN_BLOB_ID: GOLDEN_BLOB})
    assert {n: tensor_bytes(t) for n, t in target.items()} == {n: tensor_bytes(t) for n, t in new.items()}


def test_golden_signature():
    m = parse_manifest("".join(GOLDEN_MANIFEST))
    signed = m.sign(KEY)
    assert signed.signature == GOLDEN_SIGNATURE
    assert parse_manifest(signed.to_json(), verifier=KEY) == signed


def test_golden_delta_file():
    m = parse_manifest("".join(GOLDEN_MANIFEST))
    data = pack_delta_file(m, {GOLDEN_BLOB_ID: GOLDEN_BLOB})
    mj = "".join(GOLDEN_MANIFEST).encode()
    assert data == bytes.fromhex(GOLDEN_DELTA_FILE_PREFIX) + mj + GOLDEN_BLOB
    assert struct.unpack_from("<Q", data, 16)[0] == len(mj)
    df = unpack_delta_file(data)
    assert df.manifest == m and df.blobs == {GOLDEN_BLOB_ID: GOLDEN_BLOB}


# -- blob format 2 (what encode_delta writes by default): the same states ---------------------------------

GOLDEN2_BLOB_HEX = (
    "4453594e43424c4202000000cc00000028b52ffd608300150600c24c251d70a7d50146f5d12243afa1d14a3e762caa2a"
    "96faff27a9aab2d2ff3304cbb2d2519e38943a9d673e194a7d0818f4573aca67a1d4f955183fd0d151ea641df357caa3"
    "73a354516fc21a8cebafc588316d5d4312a20d8e4448e7a0fc6266357ceb5af48d416ac38beb1b75842cae9f6ae898f3"
    "bd8e59dd9097f82e32b2370040b0ba190a22e213eae80eaf6045a957c01d020a56021100d00c178ae3f8ff5a317000fc"
    "c1603dcb0f0cc6039d003f2e180c2c02287a4104ec9b2f544975a93d28b52ffd200e71000039f20d0069d5bf914e9b02"
    "f7110028b52ffd204ced000090ab0500d60aab0500aa050000d60aaa05d60a03004e21189000ac240128b52ffd200421"
    "0000bc40b8df28b52ffd20021100009ac028b52ffd2004210000000080bf"
)
GOLDEN2_BLOB = bytes.fromhex(GOLDEN2_BLOB_HEX)
GOLDEN2_BLOB_ID = "8ff795c9d39d15c520e77be3b363c69c"
GOLDEN2_MANIFEST = "".join(GOLDEN_MANIFEST).replace(GOLDEN_BLOB_ID, GOLDEN2_BLOB_ID).replace('"size":642', '"size":318')
# FORMAT.md §4.3. ansm: model G (49 frequencies; gaps 0, 2, 6, 29, 258 of a and 3 of b: bucket 0 -> 683,
# 2 -> 1366, 3 -> 683, 5 -> 682, 9 -> 682),
# then model V (18: +1 -> 1366, -1 -> 682, BIG -> 682, RAW -> 1366), LEB128 each, summing to 4096 per model.
GOLDEN2_STREAMS = {
    "ans": "39f20d0069d5bf914e9b02f71100",  # a: 5 words, b: 2 words (rANS state first, then the renormalised words)
    "ansm": "ab0500d60aab0500aa05000000aa05" + "00" * 39 + "d60aaa05" + "00" * 14 + "aa05d60a",
    "dense1": "bc40b8df",
    "raw2": "9ac0",
    "raw4": "000080bf",
}
GOLDEN2_CHUNKS = [
    {"count": 5, "dtype": "bfloat16", "mode": "ans", "na": 5, "nr": 1, "start": 0, "stop": 300, "tensor": "a"},
    {"count": 1, "dtype": "float32", "mode": "ans", "na": 2, "nr": 1, "start": 0, "stop": 4, "tensor": "b"},
    {"count": 4, "dtype": "float8_e5m2", "mode": "dense", "na": 0, "nr": 0, "start": 0, "stop": 4, "tensor": "d"},
]


def test_golden2_blob_bytes():
    """Also pins zstd's output for the (compressed) header frame: if only this fails while the two tests
    below pass, only the compressor's choice moved."""
    old, new = golden_states()
    enc = encode_delta(old, new, model="policy", version=2, parent=1, options=EncodeOptions(format=2))
    assert list(enc.blobs) == [GOLDEN2_BLOB_ID]
    assert enc.blobs[GOLDEN2_BLOB_ID].hex() == GOLDEN2_BLOB.hex()
    assert enc.manifest.to_json().decode() == GOLDEN2_MANIFEST


def test_golden2_streams_below_zstd():
    magic, version, hlen = struct.unpack_from("<8sII", GOLDEN2_BLOB)
    assert (magic, version) == (b"DSYNCBLB", 2)
    header = json.loads(zstandard.ZstdDecompressor().decompress(GOLDEN2_BLOB[16:16 + hlen]))
    assert header["chunks"] == GOLDEN2_CHUNKS
    reader = BlobReader(GOLDEN2_BLOB)
    got = {n: reader.stream(n).view(np.uint8).tobytes().hex() for n in sorted(reader.stream_names)}
    assert got == GOLDEN2_STREAMS


def test_golden2_bytes_still_decode():
    old, new = golden_states()
    patches = decode_blob(GOLDEN2_BLOB)
    assert [(p.tensor, p.dtype, p.start, p.stop, p.count) for p in patches] == [
        ("a", "bfloat16", 0, 300, 5), ("b", "float32", 0, 4, 1), ("d", "float8_e5m2", 0, 4, 4)]
    a = patches[0].changes
    assert a.positions.tolist() == [0, 3, 10, 40, 299]
    assert a.raw.tolist() == [False, False, False, True, False]
    assert a.values.tolist() == [1, 0xFFFF, 200, int(new["a"].view(torch.int16)[40]) & 0xFFFF, 1]
    target = {n: t.clone() for n, t in old.items()}
    apply_delta(target, parse_manifest(GOLDEN2_MANIFEST), {GOLDEN2_BLOB_ID: GOLDEN2_BLOB})
    assert {n: tensor_bytes(t) for n, t in target.items()} == {n: tensor_bytes(t) for n, t in new.items()}


# -- blob format 3 (EncodeOptions(coding="base-conditioned"), docs/FORMAT.md §4.4): the same states ------------

# Blob version 4 (FORMAT.md §4.6, what encoders write by default): GOLDEN2's chunks and streams, its records as
# binary columns. The header frame decompresses to GOLDEN4_HEADER.
GOLDEN4_BLOB = bytes.fromhex(
    "4453594e43424c42040000009200000028b52ffd600b00450400d2881c1d60a933060a3b55a1c2b0a298b5a308124037115a5ac0549"
    "0ad806e2405ff5a1b09b21204d17fbdb18e1448897fc2a6451a38ac29cc22a2a140807ec07ffcc76271e04bc774575d035fb2443ca43e"
    "4edbea32f0e54a152545a90fd3a8d3b431f872aaa898fab8d5c634005f56544cc52f0807000a468005b5391e186ce5b6a24625344c332"
    "8b52ffd200e71000039f20d0069d5bf914e9b02f7110028b52ffd204ced000090ab0500d60aab0500aa050000d60aaa05d60a03004e2"
    "1189000ac240128b52ffd2004210000bc40b8df28b52ffd20021100009ac028b52ffd2004210000000080bf")
GOLDEN4_BLOB_ID = "cdc4a7bc7dc19551de16555b193b00f1"
GOLDEN4_MANIFEST = GOLDEN2_MANIFEST.replace(GOLDEN2_BLOB_ID, GOLDEN4_BLOB_ID).replace('"size":318', '"size":260')
GOLDEN4_HEADER = (
    # u32 88, the streams' JSON (as version 2's "streams")
    b'X\x00\x00\x00{"ans":[0,23,14],"ansm":[23,38,76],"dense1":[61,13,4],"raw2":[74,11,2],"raw4":[85,13,4]}'
    # u32 n = 3 chunks, u32 k = 3 dtypes, u32 28 + the dtype names, u32 5 + the tensor names
    + b"\x03\x00\x00\x00\x03\x00\x00\x00\x1c\x00\x00\x00bfloat16\nfloat32\nfloat8_e5m2\x05\x00\x00\x00a\nb\nd"
    + bytes([0, 1, 2])  # u8 dtype per chunk
    + bytes([0, 0, 1])  # u8 mode per chunk: ans, ans, dense
    # start (0, 0, 0), stop (300, 4, 4), count (5, 1, 4), na (5, 2, 0), nr (1, 1, 0) as u64, byte-plane shuffled:
    # the 15 low bytes, then the 15 second bytes (300 = 0x012c), then 13 x 15 zero bytes
    + bytes([0, 0, 0, 0x2C, 4, 4, 5, 1, 4, 5, 2, 0, 1, 1, 0]) + bytes([0, 0, 0, 1] + [0] * 11) + bytes(15 * 6))


def test_golden4_blob_bytes():
    """What encoders write by default; also pins zstd's output for the header frame (if only this fails while
    the two tests below pass, only the compressor's choice moved)."""
    old, new = golden_states()
    enc = encode_delta(old, new, model="policy", version=2, parent=1)
    assert list(enc.blobs) == [GOLDEN4_BLOB_ID] and blob_id(GOLDEN4_BLOB) == GOLDEN4_BLOB_ID
    assert enc.blobs[GOLDEN4_BLOB_ID].hex() == GOLDEN4_BLOB.hex()
    assert enc.manifest.to_json().decode() == GOLDEN4_MANIFEST


def test_golden4_header_and_streams_below_zstd():
    magic, version, hlen = struct.unpack_from("<8sII", GOLDEN4_BLOB)
    assert (magic, version, 16 + hlen) == (b"DSYNCBLB", 4, 16 + 0x92)
    assert zstandard.ZstdDecompressor().decompress(GOLDEN4_BLOB[16:16 + hlen]) == GOLDEN4_HEADER
    reader = BlobReader(GOLDEN4_BLOB)
    assert reader.chunks == GOLDEN2_CHUNKS  # version 2's records, from the columns
    got = {n: reader.stream(n).view(np.uint8).tobytes().hex() for n in sorted(reader.stream_names)}
    assert got == GOLDEN2_STREAMS


def test_golden4_bytes_still_decode():
    old, new = golden_states()
    patches = decode_blob(GOLDEN4_BLOB)
    v2 = decode_blob(GOLDEN2_BLOB)
    assert [(p.tensor, p.dtype, p.start, p.stop, p.count) for p in patches] == [
        (p.tensor, p.dtype, p.start, p.stop, p.count) for p in v2]
    target = {n: t.clone() for n, t in old.items()}
    apply_delta(target, parse_manifest(GOLDEN4_MANIFEST), {GOLDEN4_BLOB_ID: GOLDEN4_BLOB})
    assert {n: tensor_bytes(t) for n, t in target.items()} == {n: tensor_bytes(t) for n, t in new.items()}


GOLDEN3_BLOB_HEX = (
    "4453594e43424c4203000000ce00000028b52ffd608c0025060032cd251d7049aa0366506113fda6d5386af653d0feff"
    "15f4cc489a02acf4ff0b0149a290cf5da0a72c32fe4d9ca7ac3958af56c8e736e6297babe2f7cb7d93b28795b96f5c52"
    "2259782cf622ac5552a314061b330e820500a00232e6dc4957b3cfc1c6625dcac91e5c8475c9c6b722ac9f7dad46d9d5"
    "ea22c0b69a65863bea168fcb1508149a65878468d444363603672892b290a0190c188a041100d60c87c5b368ae0740c3"
    "8a9803e00f06f3597e61301ee804f875c1606011f0f88516000f05b5700628b52ffd200c610000e27b6904bf686a8210"
    "80040028b52ffd2074e50200e2c4111cc0251dfff73e005305b8b5d6482294ff3feb5fbfd448b2b1c896490685cfb680"
    "affae913d68120e0d72fbb54a600fff8b6437968b864a64b8f3f350879a8a624c851f86c150107002a4340358c60469b"
    "a7a01d1096abc40128b52ffd2004210000bc40b8df28b52ffd20021100009ac028b52ffd2004210000000080bf"
)
GOLDEN3_BLOB = bytes.fromhex(GOLDEN3_BLOB_HEX)
GOLDEN3_BLOB_ID = "6f126f3065721f2101ce71ed8e42814f"
GOLDEN3_MANIFEST = ("".join(GOLDEN_MANIFEST).replace(GOLDEN_BLOB_ID, GOLDEN3_BLOB_ID).replace('"size":642', '"size":381')
                    .replace('"meta":{}', '"meta":{"deltasync.coding":"base-conditioned"}'))
# ansxm: 12 contexts (a's bf16 exponents, b's float32 ones), each: e, G_e's (symbol, freq) pairs, V_e's pairs
GOLDEN3_STREAMS = {
    "ansx": "e27b6904bf686a8210800400",  # a: 4 words, b: 2 words
    "ansxm": "0c0001318020007801318020007d01318020007e01318020007f0201d50a31ab15011180208001013180200081010302d60a"
             "04d50a31d50a0210801011801082010300d60a02d50a31d50a02008010018010830101318020008401013180200085010207"
             "801031801001008020ff010131802000",
    "dense1": "bc40b8df",
    "raw2": "9ac0",
    "raw4": "000080bf",
}
GOLDEN3_CHUNKS = [
    {"count": 5, "dtype": "bfloat16", "mode": "ansx", "na": 4, "nr": 1, "start": 0, "stop": 300, "tensor": "a"},
    {"count": 1, "dtype": "float32", "mode": "ansx", "na": 2, "nr": 1, "start": 0, "stop": 4, "tensor": "b"},
    {"count": 4, "dtype": "float8_e5m2", "mode": "dense", "na": 0, "nr": 0, "start": 0, "stop": 4, "tensor": "d"},
]


def test_golden3_blob_bytes():
    old, new = golden_states()
    enc = encode_delta(old, new, model="policy", version=2, parent=1, options=EncodeOptions(coding="base-conditioned"))
    assert list(enc.blobs) == [GOLDEN3_BLOB_ID]
    assert enc.blobs[GOLDEN3_BLOB_ID].hex() == GOLDEN3_BLOB.hex()
    assert enc.manifest.to_json().decode() == GOLDEN3_MANIFEST


def test_golden3_streams_below_zstd():
    magic, version, hlen = struct.unpack_from("<8sII", GOLDEN3_BLOB)
    assert (magic, version) == (b"DSYNCBLB", 3)
    header = json.loads(zstandard.ZstdDecompressor().decompress(GOLDEN3_BLOB[16:16 + hlen]))
    assert header["chunks"] == GOLDEN3_CHUNKS
    reader = BlobReader(GOLDEN3_BLOB)
    got = {n: reader.stream(n).view(np.uint8).tobytes().hex() for n in sorted(reader.stream_names)}
    assert got == GOLDEN3_STREAMS


def test_golden3_bytes_still_decode_against_the_base():
    old, new = golden_states()
    patches = decode_blob(GOLDEN3_BLOB)
    assert [(p.tensor, p.dtype, p.start, p.stop, p.count) for p in patches] == [
        ("a", "bfloat16", 0, 300, 5), ("b", "float32", 0, 4, 1), ("d", "float8_e5m2", 0, 4, 4)]
    base = old["a"].view(torch.int16).numpy().view(np.uint16)
    a = patches[0].resolve(base).changes
    assert a.positions.tolist() == [0, 3, 10, 40, 299]
    assert a.raw.tolist() == [False, False, False, True, False]
    assert a.values.tolist() == [1, 0xFFFF, 200, int(new["a"].view(torch.int16)[40]) & 0xFFFF, 1]
    target = {n: t.clone() for n, t in old.items()}
    apply_delta(target, parse_manifest(GOLDEN3_MANIFEST), {GOLDEN3_BLOB_ID: GOLDEN3_BLOB})
    assert {n: tensor_bytes(t) for n, t in target.items()} == {n: tensor_bytes(t) for n, t in new.items()}


# -- manifest format 3 (docs/FORMAT.md §5.3): the golden-2 delta as committed ---------------------------------
GOLDEN_M3 = (
    '{"blobs":[{"digest":null,"id":"8ff795c9d39d15c520e77be3b363c69c","size":318}],"format":3,"key_id":null,'
    '"kind":"delta","meta":{},"model":"policy","parent":1,"signature":null,"state_fp":"7c53280750e88324",'
    '"state_fp_before":"83399e61d36f45d3","table":"KLUv/SDzZQQAtAVEU1QBAQEBAAMAAAQAAAAFAAAAYQpiCmQcAAAAYmZsb2F0'
    'MTYKMzI4X2U1bTIAAQIBAgEsAQACAARsPsmxC5m2L2jb48cOu0ATc7crsvg6xRgBBAQAAAAAAAAAFgCQZWMIAABWHnILP1cACCDAjmBm'
    'QB7ADwkodrkF1GAHyAIIAIPhbgXTXDl86+Y=","version":2}'
)
# the same manifest as written before the table's zstd level went from 3 to 2 (tensortable.TABLE_LEVEL): it reads
# alike (any level decompresses the same columns)
GOLDEN_M3_LEVEL3 = (
    '{"blobs":[{"digest":null,"id":"8ff795c9d39d15c520e77be3b363c69c","size":318}],"format":3,"key_id":null,'
    '"kind":"delta","meta":{},"model":"policy","parent":1,"signature":null,"state_fp":"7c53280750e88324",'
    '"state_fp_before":"83399e61d36f45d3","table":"KLUv/SDzVQQA1AVEU1QBAQEBAAMAAAQAAAAFAAAAYQpiCmQcAAAAYmZsb2F0'
    'MTYKMzI4X2U1bTIAAQIBAgEsAQACAARsPsmxC5m2L2jb48cOu0ATc7crsvg6xRgBAAEEBAAAAAAAAAAUAJBlYwgAAIC7qd4ACCDAjmBm'
    'gKkIAIN4BNQQBsgCCACD4W4F01w5fOvm","version":2}'
)
# its table decompressed (FORMAT.md §5.3): 3 changed tensors of 4 (c is unchanged and not listed)
GOLDEN_M3_TABLE = (
    "44535401" "01" "01" "01" "00" "03000000" "03000000" "04000000"  # magic, delta, spans, v1, n 3, c 3, d 4
    "05000000" "610a620a64"  # names a, b, d
    "1c000000" + "bfloat16\nfloat32\nfloat8_e5m2".encode().hex()  # the dtypes
    + "000102" "01" "02" "01"  # dtype codes, ranks 1 2 1
    + "2c01000000000000" "0200000000000000" "0200000000000000" "0400000000000000"  # dims 300 | 2x2 | 4
)


def test_golden_manifest_format3():
    old, new = golden_states()
    enc = encode_delta(old, new, model="policy", version=2, parent=1, options=EncodeOptions(format=2))
    compact = enc.manifest.compact()
    assert compact.to_json().decode() == GOLDEN_M3
    m = parse_manifest(GOLDEN_M3)
    assert [(t.name, t.dtype, t.shape, t.changed, [(c.index, c.start, c.stop) for c in t.chunks]) for t in m.tensors] == [
        ("a", "bfloat16", (300,), 5, [(0, 0, 300)]), ("b", "float32", (2, 2), 1, [(1, 0, 4)]),
        ("d", "float8_e5m2", (4,), 4, [(2, 0, 4)])]
    assert all(t.fp_before is None for t in m.tensors) and m == compact
    table = zstandard.ZstdDecompressor().decompress(__import__("base64").b64decode(json.loads(GOLDEN_M3)["table"]))
    assert table.hex().startswith(GOLDEN_M3_TABLE)
    old3 = parse_manifest(GOLDEN_M3_LEVEL3)  # written at the earlier level: the same records
    assert old3.tensors == m.tensors and old3.state_fp == m.state_fp and old3.blobs == m.blobs
    assert zstandard.ZstdDecompressor().decompress(
        __import__("base64").b64decode(json.loads(GOLDEN_M3_LEVEL3)["table"])) == table
    target = {n: t.clone() for n, t in old.items()}
    apply_delta(target, m, {GOLDEN2_BLOB_ID: GOLDEN2_BLOB})
    assert {n: tensor_bytes(t) for n, t in target.items()} == {n: tensor_bytes(t) for n, t in new.items()}


# -- the history coding (EncodeOptions(coding="history"), docs/FORMAT.md §4.5): three steps, an empty history --

def golden_history_states():
    """v0..v3 of a stream published history-coded since v0 (depth 8). Flat positions (§4.5): a (int32, 3 words) at 0,
    b (bfloat16, 40) at 3, c (float32, 4) at 43, d (float8_e5m2, 4) at 47. v1: b +1/-1/+3 steps and a sign flip, c
    two steps, d rewritten (a dense chunk: all four words enter the history). v2: b again at 1, 9, 30 (age 1) and
    new words, c at 2 and 3, d[2] (its chunk all history: no cold group). v3: b at 1, 9, 30 (age 1, interval 1:
    context 2), 4 (age 2: context 7; a sign flip), 18 (age 1: context 1), 25 (cold; a sign flip, coded before
    b[4] but its raw word after: position order), 33 (cold), a BIG step at b[30]; c at 0 (context 7) and 3
    (context 1); a[1] +5 (an int32 chunk: any dtype is ansh)."""
    a0 = torch.tensor([7, -1, 100000], dtype=torch.int32)
    b0 = (torch.arange(40, dtype=torch.float32) * 0.37 - 5.0).to(torch.bfloat16)
    c0 = torch.tensor([[1.0, -2.0], [0.25, 3.0]], dtype=torch.float32)
    d0 = torch.tensor([1.0, -2.0, 0.5, 448.0], dtype=torch.float32).to(torch.float8_e5m2)
    states = [{"a": a0, "b": b0, "c": c0, "d": d0}]

    def step(prev, b_steps, c_steps, d=None, a=None):
        s = {k: v.clone() for k, v in prev.items()}
        b = s["b"].view(torch.int16)
        for p, dv in b_steps.items():
            if dv == "flip":
                b[p] ^= -32768
            else:
                b[p] += dv
        c = s["c"].view(torch.int32).reshape(-1)
        for p, dv in c_steps.items():
            c[p] += dv
        if d == "flip":
            s["d"] = (s["d"].view(torch.uint8) ^ 0x80).view(torch.float8_e5m2)
        elif d is not None:
            s["d"].view(torch.uint8)[d] += 1
        if a is not None:
            s["a"][a[0]] += a[1]
        return s

    states.append(step(states[0], {1: 1, 4: -1, 9: 1, 17: 3, 30: "flip"}, {0: 1, 1: -1}, d="flip"))
    states.append(step(states[1], {1: 1, 9: 1, 18: -1, 30: 1, 39: 1}, {2: 1, 3: 1}, d=2))
    states.append(step(states[2], {1: 1, 4: "flip", 9: -2, 18: -1, 25: "flip", 30: 200, 33: 1}, {0: -1, 3: 1},
                       a=(1, 5)))
    return states


def _history(states, depth: int = 8) -> StateHistory:
    """An empty history since v0, as both ends start it."""
    return StateHistory({k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in states[0].items()},
                        since=0, depth=depth)


GOLDENH = [  # (blob id, blob, manifest) of v1, v2, v3
    ("06a4f519fdb3f0dcad5ef6b15b3e510b",
     bytes.fromhex(
         "4453594e43424c4203000000c600000028b52ffd607500e50500220c241e6067ab03461523b5d16b30ccb4599a4e471128101846"
         "beb88b2a8220e002cb92f2882710903a0994f3d379813f03a4c6a753bc38c744eae429f198374815f5266ab9b77e5a8c18b3962d"
         "24311640e11c26b3c82f3658eddab2f57c73d488f6d637eae7d45b1fd58ef947ad98efc33265f5425ae27b804fb5810083d50b51"
         "f010df503f96688715a45e0196381c560211006a184573bdff8f158301201d0cd6b3fcc2603cd009f0eb8211201d18187c7ba119"
         "40767e5a880228b52ffd200c610000dcb403009a51872e37d2ed0228b52ffd2022110100010006008f0701c70302c703038e0704"
         "c703318e070400dc0d01920904c90411c90428b52ffd2004210000bc40b8df28b52ffd2002110000c3c0"),
     (
         '{"blobs":[{"digest":null,"id":"06a4f519fdb3f0dcad5ef6b15b3e510b","size":302}],"format":2,"key_id":null,"'
         'kind":"delta","meta":{"deltasync.coding":"history","deltasync.history":"0:8"},"model":"policy","parent":'
         '0,"signature":null,"state_fp":"2647db9b09eeac25","state_fp_before":"9b3a5cea349069c8","tensors":[{"chang'
         'ed":0,"chunks":[],"dtype":"int32","fp_after":"853a29339900c88c","fp_before":"853a29339900c88c","name":"a'
         '","shape":[3]},{"changed":5,"chunks":[{"blob":"06a4f519fdb3f0dcad5ef6b15b3e510b","index":0}],"dtype":"bf'
         'loat16","fp_after":"59839e1699f00d06","fp_before":"36839333dd92d700","name":"b","shape":[40]},{"changed"'
         ':2,"chunks":[{"blob":"06a4f519fdb3f0dcad5ef6b15b3e510b","index":1}],"dtype":"float32","fp_after":"470211'
         'd7613fa5e9","fp_before":"673b9ed6d26e33a8","name":"c","shape":[2,2]},{"changed":4,"chunks":[{"blob":"06a'
         '4f519fdb3f0dcad5ef6b15b3e510b","index":2}],"dtype":"float8_e5m2","fp_after":"18c53af8b22bb773","fp_befor'
         'e":"4b2b7f268342dc73","name":"d","shape":[4]}],"version":1}')),
    ("8bacefe15fe218da314a38732a1363f7",
     bytes.fromhex(
         "4453594e43424c42030000009e00000028b52ffd605000a5040052891c1a70c73aa89e09c948bd0c94b024a0feff8554a9915d51"
         "56faff85731a675db0ae52a1763716ba4a3f85366ae9588b2b7d633a71441b041092924a9f3eac8e50beb6fe59ea056e642bfda3"
         "8ecf576af67c2bf231ab5b029d6f005a060d84c3eab61c36f109f53e06226e0ab52c3c4641dc040c0034c2f3ffb012064941c780"
         "4b170c00f685472fb400787f41f3d2ac980128b52ffd200e71000036f6e000734224657100fb06210028b52ffd20284101000200"
         "0400d60a04aa0505aa0531d60a02008018018008010400c90401920902c90431dc0d01008020"),
     (
         '{"blobs":[{"digest":null,"id":"8bacefe15fe218da314a38732a1363f7","size":246}],"format":2,"key_id":null,"'
         'kind":"delta","meta":{"deltasync.coding":"history","deltasync.history":"0:8"},"model":"policy","parent":'
         '1,"signature":null,"state_fp":"bc986ba98dd7242a","state_fp_before":"2647db9b09eeac25","tensors":[{"chang'
         'ed":0,"chunks":[],"dtype":"int32","fp_after":"853a29339900c88c","fp_before":"853a29339900c88c","name":"a'
         '","shape":[3]},{"changed":5,"chunks":[{"blob":"8bacefe15fe218da314a38732a1363f7","index":0}],"dtype":"bf'
         'loat16","fp_after":"8250532f4d36820b","fp_before":"59839e1699f00d06","name":"b","shape":[40]},{"changed"'
         ':2,"chunks":[{"blob":"8bacefe15fe218da314a38732a1363f7","index":1}],"dtype":"float32","fp_after":"fb58bb'
         'e24d0a2b77","fp_before":"470211d7613fa5e9","name":"c","shape":[2,2]},{"changed":1,"chunks":[{"blob":"8ba'
         'cefe15fe218da314a38732a1363f7","index":2}],"dtype":"float8_e5m2","fp_after":"158e0b0f85414ad4","fp_befor'
         'e":"18c53af8b22bb773","name":"d","shape":[4]}],"version":2}')),
    ("962ac8e21df05f2f18a4141066cd1802",
     bytes.fromhex(
         "4453594e43424c4203000000b400000028b52ffd605c00550500b24a201c70a7d50146f58324c2ee530515177da2a82a2e66fd96"
         "925256faff85312ae2c7dc1493d449b09eaf907164bcc8a446ae9079912f49133544167b0b7d157d94cc9383422481cc2e370030"
         "301ebdac7e0e36b6fe511bdcbeb5d02fead7fc54afe6bb00dbb29a111ce23bcfb600ab99a16009be516f3bb8c34952438176281c"
         "4e02100034c2dbffd82e1800d28181816fd00cc00cb8f88281c0331884173ec366b6502ed2ac440128b52ffd2010810000ab9225"
         "00cca87d23af1a3f000044820028b52ffd204c1d0200c2c40f17c0251ddfcb3f5f55250000a642ca8c4d66d936d952ca143ef187"
         "7cf44b804b5fd60d2d3b0a5e227ffc928ff6b1b7e6925cda0dadc000471146a9514654040028b52ffd2004210000608840c0"),
     (
         '{"blobs":[{"digest":null,"id":"962ac8e21df05f2f18a4141066cd1802","size":310}],"format":2,"key_id":null,"'
         'kind":"delta","meta":{"deltasync.coding":"history","deltasync.history":"0:8"},"model":"policy","parent":'
         '2,"signature":null,"state_fp":"95a11e7c6d199d1d","state_fp_before":"bc986ba98dd7242a","tensors":[{"chang'
         'ed":1,"chunks":[{"blob":"962ac8e21df05f2f18a4141066cd1802","index":0}],"dtype":"int32","fp_after":"59755'
         'b01f4c92f8e","fp_before":"853a29339900c88c","name":"a","shape":[3]},{"changed":7,"chunks":[{"blob":"962a'
         'c8e21df05f2f18a4141066cd1802","index":1}],"dtype":"bfloat16","fp_after":"14a78e27152649cc","fp_before":"'
         '8250532f4d36820b","name":"b","shape":[40]},{"changed":2,"chunks":[{"blob":"962ac8e21df05f2f18a4141066cd1'
         '802","index":2}],"dtype":"float32","fp_after":"b7ae358f6c324ee3","fp_before":"fb58bbe24d0a2b77","name":"'
         'c","shape":[2,2]},{"changed":0,"chunks":[],"dtype":"float8_e5m2","fp_after":"158e0b0f85414ad4","fp_befor'
         'e":"158e0b0f85414ad4","name":"d","shape":[4]}],"version":3}')),
]
GOLDENH_FINAL = {  # v3's words, as bytes (little-endian)
    "a": "0700000004000000a0860100",
    "b": ("a0c097c088c079c060404ac032c01ac003c0d6bfa6bf6ebf0fbf43be383e0d3f6c3fa83fd23f0240"
          "1a40314049406140784088c09440a040ac40b7408cc1cf40db40e840f340fe4005410b4111411841"),
    "c": "0000803fffffffbf0100803e02004040",
    "d": "bc40b9df",
}

# below zstd: per version, each chunk's (tensor, mode, count, na, nr) and the streams. anshm: the tables of the
# contexts the blob's chunks have (v1: only the cold group 0, v2: 0 and 1, v3: 0, 1, 2 and 7), laid out as ansxm
GOLDENH_CHUNKS = [
    [("b", "ansh", 5, 4, 1), ("c", "ansh", 2, 2, 0), ("d", "dense", 4, 0, 0)],
    [("b", "ansh", 5, 3, 0), ("c", "ansh", 2, 2, 0), ("d", "ansh", 1, 2, 0)],
    [("a", "ansh", 1, 2, 0), ("b", "ansh", 7, 4, 2), ("c", "ansh", 2, 2, 0)],
]
GOLDENH_STREAMS = [
    {"ansh": "dcb403009a51872e37d2ed02",
     "anshm": "010006008f0701c70302c703038e0704c703318e070400dc0d01920904c90411c904",
     "dense1": "bc40b8df", "raw2": "c3c0"},
    {"ansh": "36f6e000734224657100fb062100",
     "anshm": "02000400d60a04aa0505aa0531d60a02008018018008010400c90401920902c90431dc0d01008020"},
    {"ansh": "ab922500cca87d23af1a3f0000448200",
     "anshm": "04000401b30603b30605b30631e70c0300d60a08d50a11d50a01030080080180083180100200801001801002020080183180"
              "080300d60a03d50a10d50a070200801031801002018010118010",
     "raw2": "604088c0"},  # b[4] then b[25]: position order, though b[25] (cold group) is coded first
]


def test_goldenh_blobs_and_manifests():
    """Published history-coded from an empty history (since 0, depth 8): the same bytes, step after step."""
    states = golden_history_states()
    assert {k: tensor_bytes(t).hex() for k, t in states[3].items()} == GOLDENH_FINAL
    pub = _history(states)
    for v, (bid, blob, manifest) in enumerate(GOLDENH, 1):
        enc = encode_delta(states[v - 1], states[v], model="policy", version=v, parent=v - 1,
                           options=EncodeOptions(coding="history"), history=pub)
        assert list(enc.blobs) == [bid] and blob_id(blob) == bid
        assert enc.blobs[bid].hex() == blob.hex(), v
        assert enc.manifest.to_json().decode() == manifest
        pub.advance_diff(v, diff_states(states[v - 1], states[v]))


def test_goldenh_streams_below_zstd():
    for (_, blob, _), chunks, streams in zip(GOLDENH, GOLDENH_CHUNKS, GOLDENH_STREAMS):
        assert struct.unpack_from("<8sI", blob) == (b"DSYNCBLB", 3)
        reader = BlobReader(blob)
        assert [(c["tensor"], c["mode"], c["count"], c["na"], c["nr"]) for c in reader.chunks] == chunks
        assert {n: reader.stream(n).view(np.uint8).tobytes().hex() for n in sorted(reader.stream_names)} == streams


def test_goldenh_bytes_still_decode_with_a_fresh_history():
    """A subscriber holding v0 and an empty history since v0 applies the stored bytes to v3 bit for bit, its history
    taking each delta in; without it, or with another one, it refuses before decoding."""
    states = golden_history_states()
    live = {n: t.clone() for n, t in states[0].items()}
    sub = _history(states)
    pub = _history(states)
    for v, (bid, blob, manifest) in enumerate(GOLDENH, 1):
        m = parse_manifest(manifest)
        assert m.coding == "history" and m.meta["deltasync.history"] == "0:8"
        with pytest.raises(UnsupportedError, match="history"):
            apply_delta({n: t.clone() for n, t in live.items()}, m, {bid: blob})
        with pytest.raises(BaseMismatchError, match="keyframe"):  # another depth: another history
            apply_delta({n: t.clone() for n, t in live.items()}, m, {bid: blob}, history=_history(states, depth=4))
        apply_delta(live, m, {bid: blob}, history=sub)
        assert sub.version == v
        assert {n: tensor_bytes(t) for n, t in live.items()} == {n: tensor_bytes(t) for n, t in states[v].items()}
        pub.advance_diff(v, diff_states(states[v - 1], states[v]))  # the publisher's side: the same history
        assert np.array_equal(sub.positions, pub.positions) and np.array_equal(sub.last, pub.last)
        assert np.array_equal(sub.gap, pub.gap)
    assert {n: tensor_bytes(t).hex() for n, t in live.items()} == GOLDENH_FINAL
