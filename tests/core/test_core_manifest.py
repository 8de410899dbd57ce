"""Manifests: canonical JSON, HMAC signatures, strict validation of every field."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from deltasync.codec import EncodeOptions, encode_delta
from deltasync.errors import NotFoundError, FormatError, SignatureError, UnsupportedError
from deltasync.keyframe import encode_keyframe
from deltasync.manifest import BlobRef, ChunkRef, Manifest, TensorRecord, load_key, parse_manifest

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def _states():
    g = torch.Generator().manual_seed(0)
    old = {"w.a": torch.randn(40, generator=g).to(torch.bfloat16), "w.b": torch.randn(3, 5, generator=g),
           "w.c": torch.zeros(4, dtype=torch.int32)}
    new = {k: v.clone() for k, v in old.items()}
    new["w.a"].view(torch.int16)[[1, 9, 30]] += 1
    new["w.b"][0, 0] = -new["w.b"][0, 0]
    return old, new


OLD, NEW = _states()
DELTA = encode_delta(OLD, NEW, model="policy", version=8, parent=7, meta={"step": "8", "run": "r1"},
                     options=EncodeOptions(chunk_words=16, blob_target=1)).manifest
KEYFRAME = encode_keyframe(NEW, model="policy", version=8, shard_bytes=64).manifest
assert len(DELTA.blobs) >= 2 and len(KEYFRAME.blobs) >= 2


def obj_of(m: Manifest) -> dict:
    return json.loads(m.to_json())


# -- canonical JSON ----------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [DELTA, KEYFRAME, DELTA.sign(KEY)], ids=["delta", "keyframe", "signed"])
def test_json_round_trip_is_stable(m):
    data = m.to_json()
    back = parse_manifest(data)
    assert back == m
    assert back.to_json() == data
    assert parse_manifest(data.decode()) == m  # str input
    assert parse_manifest(json.loads(data)) == m  # already-decoded object


def test_canonical_form_ignores_input_key_order_and_whitespace():
    obj = obj_of(DELTA.sign(KEY))
    shuffled = json.dumps(dict(reversed(list(obj.items()))), indent=3, sort_keys=False)
    m = parse_manifest(shuffled, verifier=KEY)
    assert m.to_json() == DELTA.sign(KEY).to_json()


def test_canonical_bytes_format():
    data = DELTA.to_json()
    assert data == json.dumps(obj_of(DELTA), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert b" " not in data and data.isascii()
    assert b'"signature"' not in DELTA.canonical_bytes()
    assert DELTA.sign(KEY).canonical_bytes() == DELTA.canonical_bytes()


def test_non_ascii_meta_and_names_are_escaped_and_round_trip():
    m = dataclasses.replace(DELTA, meta={"note": "schritt \u00fc \u2603"})
    data = m.to_json()
    assert data.isascii() and b"\\u2603" in data
    assert parse_manifest(data) == m


def test_views():
    assert DELTA.total_bytes == sum(b.size for b in DELTA.blobs)
    assert DELTA.changed_words == 4
    assert DELTA.raw_bytes == 40 * 2 + 15 * 4 + 4 * 4
    assert DELTA.tensor("w.b").changed == 1
    assert DELTA.tensor("w.c").chunks == ()
    with pytest.raises(NotFoundError):
        DELTA.tensor("nope")


# -- signatures ----------------------------------------------------------------------------------------

def test_sign_verify_round_trip():
    s = DELTA.sign(KEY)
    assert s.signature.startswith("hmac-sha256:") and len(s.signature) == len("hmac-sha256:") + 64
    s.verify_signature(KEY)
    assert parse_manifest(s.to_json(), verifier=KEY) == s
    assert s.sign(KEY) == s  # re-signing is idempotent (the signature does not cover itself)


def test_wrong_key_and_unsigned_are_refused():
    s = DELTA.sign(KEY)
    with pytest.raises(SignatureError):
        s.verify_signature(OTHER_KEY)
    with pytest.raises(SignatureError):
        parse_manifest(s.to_json(), verifier=OTHER_KEY)
    with pytest.raises(SignatureError):
        parse_manifest(DELTA.to_json(), verifier=KEY)
    with pytest.raises(SignatureError):
        DELTA.verify_signature(KEY)
    # a signature over another manifest does not transfer
    other = KEYFRAME.sign(KEY)
    with pytest.raises(SignatureError):
        dataclasses.replace(DELTA, signature=other.signature).verify_signature(KEY)


def _tensor_tamper(field, value):
    def f(m: Manifest) -> Manifest:
        t = m.tensors[0]
        return dataclasses.replace(m, tensors=(dataclasses.replace(t, **{field: value}),) + m.tensors[1:])
    return f


TAMPERS = {
    "model": lambda m: dataclasses.replace(m, model="policy2"),
    "version": lambda m: dataclasses.replace(m, version=m.version + 1),
    "parent": lambda m: dataclasses.replace(m, parent=m.parent - 1),
    "state_fp": lambda m: dataclasses.replace(m, state_fp="0" * 16),
    "state_fp_before": lambda m: dataclasses.replace(m, state_fp_before="1" * 16),
    "meta-value": lambda m: dataclasses.replace(m, meta={**m.meta, "step": "9"}),
    "meta-added": lambda m: dataclasses.replace(m, meta={**m.meta, "x": ""}),
    "meta-removed": lambda m: dataclasses.replace(m, meta={}),
    "format": lambda m: dataclasses.replace(m, format=1),  # a downgrade to the old format (this build writes 2)
    "blob-size": lambda m: dataclasses.replace(m, blobs=(BlobRef(id=m.blobs[0].id, size=m.blobs[0].size + 1),) + m.blobs[1:]),
    "blob-order": lambda m: dataclasses.replace(m, blobs=tuple(reversed(m.blobs))),
    "tensor-dropped": lambda m: dataclasses.replace(m, tensors=m.tensors[1:]),
    "tensor-name": _tensor_tamper("name", "w.z"),
    "tensor-dtype": _tensor_tamper("dtype", "float16"),
    "tensor-shape": _tensor_tamper("shape", (5, 8)),
    "tensor-fp_before": _tensor_tamper("fp_before", "2" * 16),
    "tensor-fp_after": _tensor_tamper("fp_after", "3" * 16),
    "tensor-changed": _tensor_tamper("changed", 2),
    "tensor-chunks": lambda m: _tensor_tamper("chunks", tuple(reversed(m.tensors[0].chunks)))(m),
    "tensor-chunk-index": lambda m: _tensor_tamper(
        "chunks", (ChunkRef(blob=m.tensors[0].chunks[0].blob, index=99),) + m.tensors[0].chunks[1:])(m),
}


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_every_tampered_field_breaks_the_signature(name):
    s = DELTA.sign(KEY)
    forged = TAMPERS[name](s)
    assert forged != s and forged.signature == s.signature
    assert forged.canonical_bytes() != s.canonical_bytes()
    with pytest.raises(SignatureError):
        forged.verify_signature(KEY)
    # on the wire: refused by parse (FormatError where the forgery is also malformed)
    with pytest.raises((SignatureError, FormatError)):
        parse_manifest(forged.to_json(), verifier=KEY)


def test_kind_swap_breaks_the_signature():
    s = KEYFRAME.sign(KEY)
    forged = dataclasses.replace(s, kind="delta", parent=7, state_fp_before=s.state_fp)
    with pytest.raises(SignatureError):
        forged.verify_signature(KEY)


@pytest.mark.parametrize("text,ok", [
    ("00" * 16, True), ("  " + "ab" * 16 + "\n", True), ("0a 1b\n" * 8, True), (("ff" * 32).encode(), True),
    ("00" * 15, False), ("zz" * 16, False), ("", False), ("0" * 33, False),
])
def test_load_key(text, ok):
    if ok:
        k = load_key(text)
        assert isinstance(k, bytes) and len(k) >= 16
    else:
        with pytest.raises(FormatError):
            load_key(text)


# -- strict validation: every field ---------------------------------------------------------------------

def _set(path, value):
    def f(o):
        cur = o
        for p in path[:-1]:
            cur = cur[p]
        cur[path[-1]] = value
    return f


def _del(path):
    def f(o):
        cur = o
        for p in path[:-1]:
            cur = cur[p]
        del cur[path[-1]]
    return f


def _do(*fs):
    def f(o):
        for g in fs:
            g(o)
    return f


BLOB0 = DELTA.blobs[0].id
DELTA_CASES = {
    # top level
    "extra-field": (_set(["extra"], 1), FormatError),
    "missing-meta": (_del(["meta"]), FormatError),
    "format-4": (_set(["format"], 4), UnsupportedError),  # this build reads formats 1, 2 and 3
    "format-2-as-3": (_set(["format"], 3), FormatError),  # a format-3 manifest has a table, not tensors
    "format-0": (_set(["format"], 0), UnsupportedError),
    "format-str": (_set(["format"], "1"), FormatError),
    "format-bool": (_set(["format"], True), FormatError),
    "model-empty": (_set(["model"], ""), FormatError),
    "model-slash": (_set(["model"], "a/b"), FormatError),
    "model-dot-first": (_set(["model"], ".hidden"), FormatError),
    "model-too-long": (_set(["model"], "m" * 129), FormatError),
    "model-int": (_set(["model"], 5), FormatError),
    "version-negative": (_set(["version"], -1), FormatError),
    "version-float": (_set(["version"], 8.0), FormatError),
    "version-bool": (_set(["version"], True), FormatError),
    "version-huge": (_set(["version"], 2**63), FormatError),
    "version-str": (_set(["version"], "8"), FormatError),
    "kind-unknown": (_set(["kind"], "full"), FormatError),
    "kind-list": (_set(["kind"], ["delta"]), FormatError),
    "parent-none": (_set(["parent"], None), FormatError),
    "parent-equal": (_set(["parent"], 8), FormatError),
    "parent-newer": (_set(["parent"], 9), FormatError),
    "parent-negative": (_set(["parent"], -1), FormatError),
    "state_fp-upper": (_set(["state_fp"], "ABCDEF0123456789"), FormatError),
    "state_fp-short": (_set(["state_fp"], "0" * 15), FormatError),
    "state_fp-null": (_set(["state_fp"], None), FormatError),
    "state_fp_before-null": (_set(["state_fp_before"], None), FormatError),
    "state_fp_before-int": (_set(["state_fp_before"], 5), FormatError),
    "meta-list": (_set(["meta"], []), FormatError),
    "meta-int-value": (_set(["meta", "step"], 8), FormatError),
    "meta-null-value": (_set(["meta", "step"], None), FormatError),
    "signature-int": (_set(["signature"], 5), FormatError),
    "signature-long": (_set(["signature"], "x" * 300), FormatError),
    # blobs
    "blobs-dict": (_set(["blobs"], {}), FormatError),
    "blob-extra-key": (_set(["blobs", 0, "x"], 1), FormatError),
    "blob-id-upper": (_set(["blobs", 0, "id"], BLOB0.upper()), FormatError),
    "blob-id-short": (_set(["blobs", 0, "id"], BLOB0[:-1]), FormatError),
    "blob-size-negative": (_set(["blobs", 0, "size"], -1), FormatError),
    "blob-size-huge": (_set(["blobs", 0, "size"], 2**49), FormatError),
    "blob-size-float": (_set(["blobs", 0, "size"], 1.5), FormatError),
    "blob-duplicate": (lambda o: o["blobs"].append(dict(o["blobs"][0])), FormatError),
    "blob-not-object": (_set(["blobs", 0], BLOB0), FormatError),
    # tensors
    "tensors-dict": (_set(["tensors"], {}), FormatError),
    "tensor-not-object": (_set(["tensors", 0], "w.a"), FormatError),
    "tensor-extra-key": (_set(["tensors", 0, "x"], 1), FormatError),
    "tensor-missing-key": (_del(["tensors", 0, "changed"]), FormatError),
    "tensor-name-empty": (_set(["tensors", 0, "name"], ""), FormatError),
    "tensor-name-int": (_set(["tensors", 0, "name"], 3), FormatError),
    "tensor-name-too-long": (_set(["tensors", 0, "name"], "n" * 1025), FormatError),
    "tensor-duplicate": (lambda o: o["tensors"].insert(1, copy.deepcopy(o["tensors"][0])), FormatError),
    "tensors-unsorted": (lambda o: o["tensors"].reverse(), FormatError),
    "dtype-unknown": (_set(["tensors", 0, "dtype"], "float128"), UnsupportedError),
    "dtype-torch-repr": (_set(["tensors", 0, "dtype"], "torch.bfloat16"), UnsupportedError),
    "dtype-int": (_set(["tensors", 0, "dtype"], 16), FormatError),
    "shape-int": (_set(["tensors", 0, "shape"], 40), FormatError),
    "shape-negative": (_set(["tensors", 0, "shape"], [-40]), FormatError),
    "shape-float": (_set(["tensors", 0, "shape"], [40.0]), FormatError),
    "shape-17-dims": (_set(["tensors", 0, "shape"], [1] * 17), FormatError),
    "shape-dim-huge": (_set(["tensors", 0, "shape"], [2**49]), FormatError),
    "changed-more-than-words": (_set(["tensors", 0, "changed"], 41), FormatError),
    "changed-negative": (_set(["tensors", 0, "changed"], -1), FormatError),
    "changed-zero-with-chunks": (_set(["tensors", 0, "changed"], 0), FormatError),
    "unchanged-fp-differs": (_set(["tensors", 2, "fp_after"], "0" * 16), FormatError),
    "fp_before-null": (_set(["tensors", 0, "fp_before"], None), FormatError),
    "fp_after-null": (_set(["tensors", 0, "fp_after"], None), FormatError),
    "fp_after-17": (_set(["tensors", 0, "fp_after"], "0" * 17), FormatError),
    "chunks-dict": (_set(["tensors", 0, "chunks"], {}), FormatError),
    "chunk-not-object": (_set(["tensors", 0, "chunks", 0], BLOB0), FormatError),
    "chunk-unknown-blob": (_set(["tensors", 0, "chunks", 0, "blob"], "0" * 32), FormatError),
    "chunk-blob-list": (_set(["tensors", 0, "chunks", 0, "blob"], [BLOB0]), FormatError),
    "chunk-no-blob": (_del(["tensors", 0, "chunks", 0, "blob"]), FormatError),
    "chunk-key-in-delta": (_do(_del(["tensors", 0, "chunks", 0, "index"]), _set(["tensors", 0, "chunks", 0, "key"], "w.a")), FormatError),
    "chunk-index-negative": (_set(["tensors", 0, "chunks", 0, "index"], -1), FormatError),
    "chunk-index-str": (_set(["tensors", 0, "chunks", 0, "index"], "0"), FormatError),
    "chunk-extra-key": (_set(["tensors", 0, "chunks", 0, "x"], 0), FormatError),
}


@pytest.mark.parametrize("case", sorted(DELTA_CASES))
def test_delta_manifest_validation(case):
    mutate, err = DELTA_CASES[case]
    obj = obj_of(DELTA)
    mutate(obj)
    assert json.dumps(obj, sort_keys=True) != json.dumps(obj_of(DELTA), sort_keys=True)
    with pytest.raises(err) as ei:
        parse_manifest(json.dumps(obj).encode())
    if err is FormatError:
        assert isinstance(ei.value, FormatError)
    # the same through the dict entry point
    with pytest.raises(err):
        parse_manifest(obj)


KEYFRAME_CASES = {
    "parent-set": (_set(["parent"], 7), FormatError),
    "state_fp_before-set": (_set(["state_fp_before"], "0" * 16), FormatError),
    "fp_before-set": (_set(["tensors", 0, "fp_before"], "0" * 16), FormatError),
    "chunk-index": (_do(_del(["tensors", 0, "chunks", 0, "key"]), _set(["tensors", 0, "chunks", 0, "index"], 0)), FormatError),
    "chunk-key-int": (_set(["tensors", 0, "chunks", 0, "key"], 0), FormatError),
    "two-chunks": (lambda o: o["tensors"][0]["chunks"].append(dict(o["tensors"][0]["chunks"][0])), FormatError),
    "no-chunks": (_set(["tensors", 0, "chunks"], []), FormatError),
}


@pytest.mark.parametrize("case", sorted(KEYFRAME_CASES))
def test_keyframe_manifest_validation(case):
    mutate, err = KEYFRAME_CASES[case]
    obj = obj_of(KEYFRAME)
    mutate(obj)
    with pytest.raises(err):
        parse_manifest(json.dumps(obj).encode())


@pytest.mark.parametrize("data", [
    b"", b"null", b"[]", b"1", b'"x"', b"{", b"\xff\xfe\x00", b"{}", b'{"format":1}',
    b'{"a":NaN}', b"\x00" * 10,
])
def test_not_a_manifest(data):
    with pytest.raises(FormatError):
        parse_manifest(data)


def test_oversized_manifest_refused_before_parsing(monkeypatch):
    import deltasync.manifest as mm
    monkeypatch.setattr(mm, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(FormatError):
        parse_manifest(b" " * 101)


def test_empty_state_manifests_are_valid():
    m = Manifest(model="m", version=1, parent=None, kind="keyframe", tensors=(), blobs=(), state_fp="0" * 16)
    assert parse_manifest(m.to_json()) == m
    d = Manifest(model="m", version=2, parent=1, kind="delta", tensors=(), blobs=(), state_fp="0" * 16,
                 state_fp_before="0" * 16)
    assert parse_manifest(d.sign(KEY).to_json(), verifier=KEY) == d.sign(KEY)


def test_record_types_are_frozen_value_types():
    t = TensorRecord(name="a", dtype="float32", shape=(2,), fp_before=None, fp_after="0" * 16, changed=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.name = "b"
    assert t.words == 2
    assert TensorRecord(name="c", dtype="complex64", shape=(3, 2), fp_before=None, fp_after="0" * 16, changed=0).words == 12


def test_a_parsed_manifest_is_verified_and_sent_with_the_table_it_came_with(monkeypatch):
    """Verifying or re-sending a parsed format-3 manifest packs nothing (its table text is what the signature
    covers; re-packing it cost ~0.3 s a manifest at 70,000 tensors on every server and subscriber), and a table
    tampered on the wire still fails."""
    import base64

    from deltasync import manifest as manifest_mod

    s = DELTA.compact().sign(KEY)
    wire = s.to_json()

    def no_packing(*a, **k):
        raise AssertionError("the table was packed again")

    monkeypatch.setattr(manifest_mod, "pack_table", no_packing)
    m = parse_manifest(wire, verifier=KEY)
    assert m.to_json() == wire and m == s
    obj = json.loads(wire)
    raw = bytearray(base64.b64decode(obj["table"]))
    raw[-1] ^= 1
    obj["table"] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises((SignatureError, FormatError)):
        parse_manifest(json.dumps(obj).encode(), verifier=KEY)


def test_a_manifest_parsed_without_its_records_verifies_and_refuses_their_use(monkeypatch):
    """``records=False`` (a publisher checking its base against the origin's head, an origin's commit): no record
    is made, the fields, the table and the signature are checked as always, and reading a record raises instead
    of seeing none."""
    import base64

    from deltasync import manifest as manifest_mod

    for m in (DELTA.compact().sign(KEY), KEYFRAME.compact().sign(KEY)):
        wire = m.to_json()
        manifest_mod._PARSED.clear()
        with monkeypatch.context() as p:
            real = manifest_mod.unpack_table
            p.setattr(manifest_mod, "unpack_table", lambda *a, build=True, **k: pytest.fail("records were made")
                      if build else real(*a, build=build, **k))
            head = parse_manifest(wire, verifier=KEY, records=False)
        assert (head.state_fp, head.version, head.kind, head.blobs) == (m.state_fp, m.version, m.kind, m.blobs)
        manifest_mod._TABLES.clear()  # its table text is its own, not only remembered
        assert head.to_json() == wire
        head.verify_signature(KEY)
        for use in (lambda: len(head.tensors), lambda: list(head.tensors), lambda: head.tensors[0],
                    lambda: head.changed_words):
            with pytest.raises(RuntimeError, match="without its tensor records"):
                use()
        obj = json.loads(wire)
        obj["state_fp"] = "0" * 16
        with pytest.raises(SignatureError):
            parse_manifest(json.dumps(obj).encode(), verifier=KEY, records=False)
        obj = json.loads(wire)
        obj["table"] = 7
        with pytest.raises(FormatError, match="table must be a base64 string"):
            parse_manifest(json.dumps(obj).encode(), records=False)
        obj = json.loads(wire)
        raw = bytearray(base64.b64decode(obj["table"]))
        raw[-1] ^= 1
        obj["table"] = base64.b64encode(bytes(raw)).decode()
        with pytest.raises(FormatError):  # the table is checked all the same
            parse_manifest(json.dumps(obj).encode(), records=False)


def test_fields_only_reads_no_table_and_still_verifies_it(monkeypatch):
    """``records=None`` (a publisher reading the origin's head: its version and state fingerprint): the table is
    neither decoded nor checked, yet the signature still covers it; a parse that checked it is not served by one
    that did not, and a records use raises."""
    import base64

    from deltasync import manifest as manifest_mod

    for m in (DELTA.compact().sign(KEY), KEYFRAME.compact().sign(KEY)):
        wire = m.to_json()
        manifest_mod._PARSED.clear()
        with monkeypatch.context() as p:
            p.setattr(manifest_mod, "unpack_table", lambda *a, **k: pytest.fail("the table was read"))
            head = parse_manifest(wire, verifier=KEY, records=None)
        assert (head.state_fp, head.version, head.kind, head.blobs) == (m.state_fp, m.version, m.kind, m.blobs)
        manifest_mod._TABLES.clear()
        assert head.to_json() == wire
        with pytest.raises(RuntimeError, match="without its tensor records"):
            len(head.tensors)
        checked = parse_manifest(wire, records=False)  # checking is never skipped for one who asks for it
        assert checked is not head
        assert parse_manifest(wire, records=None) is checked  # a deeper parse serves a shallower one
        obj = json.loads(wire)
        raw = bytearray(base64.b64decode(obj["table"]))
        raw[-1] ^= 1
        obj["table"] = base64.b64encode(bytes(raw)).decode()
        corrupt = json.dumps(obj).encode()
        assert parse_manifest(corrupt, records=None).state_fp == m.state_fp  # not read: not refused
        with pytest.raises(SignatureError):  # but not what was signed
            parse_manifest(corrupt, verifier=KEY, records=None)
        with pytest.raises(FormatError):
            parse_manifest(corrupt, records=False)
        obj["table"] = 7
        with pytest.raises(FormatError, match="table must be a string"):
            parse_manifest(json.dumps(obj).encode(), records=None)


def test_a_body_parsed_again_is_the_same_manifest_and_still_verified(monkeypatch):
    """The last few bodies parsed are kept by their bytes (a subscriber parsed one keyframe manifest four
    times: 0.35 s each at 70,000 tensors); a repeat unpacks nothing, is verified against the verifier asked
    for each time, and still serializes to its wire bytes after the remembered tables moved on."""
    from deltasync import manifest as manifest_mod

    wire = DELTA.compact().sign(KEY).to_json()
    first = parse_manifest(wire, verifier=KEY)
    with monkeypatch.context() as p:
        p.setattr(manifest_mod, "unpack_table", lambda *a, **k: pytest.fail("the table was unpacked again"))
        manifest_mod._TABLES.clear()
        again = parse_manifest(bytearray(wire), verifier=KEY)
        assert again is first and again.to_json() == wire
        assert parse_manifest(wire, records=False) is first  # a parse with its records serves one without
        with pytest.raises(SignatureError):
            parse_manifest(wire, verifier=b"another key of 32 bytes........")
    tampered = wire.replace(b'"version":8', b'"version":9')
    assert tampered != wire
    with pytest.raises(SignatureError):
        parse_manifest(tampered, verifier=KEY)
