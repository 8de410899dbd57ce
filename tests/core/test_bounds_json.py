"""Every JSON (and key/token text) parser of network or disk input answers crafted input with the library's own
errors only (issue 9): non-integer sizes, deep nesting (json's RecursionError), integers of thousands of digits,
wrong container types. Each parser is driven with hypothesis and with the pathological bodies that once escaped
(``HeadInfo.from_body``: TypeError / RecursionError, tests/system/test_fuzz_wire.py).

Parsers swept: head answers (client/http.py), error bodies (deltasync.errors.from_wire), event data
(deltasync.sse.SSEEvent.json, what a relay's prefetch and a subscriber read), manifests with hostile nested
values (deltasync.manifest.parse_manifest), publisher parts (client/publisher.py Part.from_bytes), PEM key
files (deltasync.signing), token files (server/http/tokens.py), a manifest's residual summary (deltasync.budget).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.errors import DeltaSyncError, FormatError
from deltasync.sse import SSEEvent

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DEEP = [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b"[" * 100_000]
HUGE = [b"9" * 5000, b"-" + b"9" * 5000, b"1e999", b"-1e999", b"NaN", b"Infinity"]

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                  st.text(max_size=6), st.sampled_from([2**63, -1, 0, 2**40]))
_json = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                st.dictionaries(st.text(max_size=6), c, max_size=3)), max_leaves=15)


def _only_ours(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except DeltaSyncError as e:
        return e


def _bodies(fields: list[str]) -> list[bytes]:
    """The pathological bodies, alone and as the value of each named field."""
    out = [*DEEP]
    for f in fields:
        out += [b'{"%s": %s}' % (f.encode(), v) for v in (*HUGE, DEEP[0], b'"7"', b"null", b"[]", b"{}", b"true")]
    return out


# -- head answers -------------------------------------------------------------------------------------------

def _head(body: bytes):
    from deltasync.client.http import HeadInfo
    return HeadInfo.from_body(body, model="m", url="http://x")


@pytest.mark.parametrize("body", [*_bodies(["version", "blobs", "kind"]),
                                  b'{"version": 3, "blobs": [{"size": "7"}]}', b'{"version": 3, "blobs": [{"size": 1e3}]}',
                                  b'{"version": 3, "blobs": [{"size": false}]}', b'{"version": 3, "blobs": [{"size": [1]}]}',
                                  b'{"version": 3, "blobs": [{"size": ' + b"9" * 5000 + b"}]}"])
def test_head_pathological(body):
    r = _only_ours(_head, body)
    assert isinstance(r, DeltaSyncError), r


@FUZZ
@given(version=_json, blobs=st.one_of(_json, st.lists(st.dictionaries(st.sampled_from(["size", "id"]), _json), max_size=3)))
def test_head_hostile_fields(version, blobs):
    r = _only_ours(_head, json.dumps({"version": version, "blobs": blobs}).encode())
    if not isinstance(r, DeltaSyncError):
        assert type(r.version) is int and r.version >= 0
        assert r.bytes is None or (type(r.bytes) is int and r.bytes >= 0)


def test_head_good_answer_still_parses():
    r = _head(b'{"version": 4, "kind": "delta", "blobs": [{"size": 3}, {"size": 5}]}')
    assert (r.version, r.kind, r.bytes) == (4, "delta", 8)


# -- error bodies -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", _bodies(["error"]) + [b'{"error": {"code": ' + b"[" * 100_000 + b"}}",
                                                        b'{"error": {"code": "not_found", "message": ' + b"9" * 5000 + b"}}"])
def test_error_body_pathological(body):
    from deltasync.errors import from_wire
    err = from_wire(502, body, where="http://x")
    assert isinstance(err, DeltaSyncError) and err.status == 502


@FUZZ
@given(_json, st.sampled_from([400, 404, 409, 413, 500, 502, 503, 507]))
def test_error_body_hostile(obj, status):
    from deltasync.errors import from_wire
    err = from_wire(status, json.dumps({"error": obj}).encode())
    assert isinstance(err, DeltaSyncError)


# -- event data ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [d.decode() for d in DEEP + HUGE])
def test_event_data_pathological(data):
    r = _only_ours(SSEEvent(event="version", data=data).json)
    assert isinstance(r, FormatError), r


@FUZZ
@given(st.text(max_size=200))
def test_event_data_garbage(data):
    r = _only_ours(SSEEvent(event="version", data=data).json)
    assert isinstance(r, dict | FormatError)


# -- manifests: hostile nested values -----------------------------------------------------------------------

def _manifest_obj() -> dict:
    import torch

    from deltasync.codec import encode_delta
    old = {"w": torch.arange(64, dtype=torch.float32)}
    new = {"w": old["w"].clone()}
    new["w"][3] = -1.0
    return json.loads(encode_delta(old, new, model="m", version=2, parent=1).manifest.to_json())


@pytest.mark.parametrize("value", [*HUGE, DEEP[0], DEEP[1]])
@pytest.mark.parametrize("field", ["meta", "blobs", "tensors", "version", "parent", "format"])
def test_manifest_pathological_field(field, value):
    from deltasync.manifest import parse_manifest
    text = json.dumps({**_manifest_obj(), field: "@@"}).encode().replace(b'"@@"', value)
    r = _only_ours(parse_manifest, text)
    assert isinstance(r, FormatError), r


# -- publisher parts (sent between a sharded publisher's ranks) -------------------------------------------

@pytest.mark.parametrize("body", _bodies(["main", "side"]) + [b"[1]", b'"x"', b"{}"])
def test_publisher_part_pathological(body):
    from deltasync.client.publisher import Part
    assert isinstance(_only_ours(Part.from_bytes, body), DeltaSyncError)


@FUZZ
@given(st.binary(max_size=300))
def test_publisher_part_garbage(data):
    from deltasync.client.publisher import Part
    assert isinstance(_only_ours(Part.from_bytes, data), DeltaSyncError)


# -- a manifest's residual summary (meta text, signed or not) -----------------------------------------------

@pytest.mark.parametrize("text", [d.decode() for d in DEEP + HUGE] + ["[]", "x"])
def test_residual_summary_pathological(text):
    from deltasync.budget import META_RESIDUAL, residual_of
    from deltasync.manifest import parse_manifest
    m = parse_manifest(json.dumps({**_manifest_obj(), "meta": {META_RESIDUAL: text}}).encode())
    assert residual_of(m) is None


# -- key and token files ------------------------------------------------------------------------------------

_pem = st.one_of(st.binary(max_size=300),
                 st.builds(lambda kind, body: f"-----BEGIN {kind}-----\n{body}\n-----END {kind}-----\n".encode(),
                           st.sampled_from(["PUBLIC KEY", "PRIVATE KEY", "RSA PUBLIC KEY", "EC PRIVATE KEY",
                                            "CERTIFICATE", "X"]),
                           st.text(alphabet="ABCDEFGHabcdef0123456789+/=\n", max_size=120)))


@FUZZ
@given(_pem)
def test_key_files_garbage(data):
    from deltasync.signing import load_signing_key, load_verify_key
    for load in (load_signing_key, load_verify_key):
        r = _only_ours(load, data)
        assert isinstance(r, FormatError), (load.__name__, r)


def test_key_files_of_another_algorithm():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from deltasync.signing import load_signing_key, load_verify_key
    k = ec.generate_private_key(ec.SECP256R1())
    priv = k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pub = k.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert isinstance(_only_ours(load_signing_key, priv), FormatError)
    assert isinstance(_only_ours(load_verify_key, pub), FormatError)


@FUZZ
@given(st.text(max_size=300))
def test_token_files_garbage(text):
    from deltasync.server.http.tokens import TokenTable
    r = _only_ours(TokenTable.parse, text)
    assert isinstance(r, TokenTable | FormatError)
