"""Fuzzing (hypothesis) of every parser that takes bytes or text from the network (issue 9).

Manifests (structure-aware: a real signed manifest with hostile values in each field), head
answers, the event-stream decoder (any chunking, garbage, long lines), Range / If-None-Match /
If-Range headers, key files and token-ish text, the servers' command-line value parsers. Each
must answer with the library's own errors (the deltasync.errors tree) or a value that keeps its
promises — never another exception. tests/core/test_core_parsers.py covers blobs, varints, positions
and values; tests/system/test_fuzz_files.py the file formats; tests/fuzz/run_atheris.py runs the
coverage-guided fuzzer (``make fuzz``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deltasync.codec import encode_delta
from deltasync.errors import DeltaSyncError, FormatError, RangeError, SignatureError
from deltasync.manifest import Manifest, parse_manifest
from deltasync.signing import load_key
from deltasync.sse import SSEDecoder, SSEEvent, format_event

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = bytes(range(32))


def _manifest() -> Manifest:
    g = torch.Generator().manual_seed(1)
    old = {"w": torch.randn(64, generator=g).to(torch.bfloat16), "b": torch.randn(3, 5, generator=g)}
    new = {k: v.clone() for k, v in old.items()}
    new["w"].view(torch.int16)[[3, 9]] += 1
    new["b"][0] = 2.0
    return encode_delta(old, new, model="policy", version=5, parent=4).manifest.sign(KEY)


SIGNED = _manifest()
OBJ = json.loads(SIGNED.to_json())

_hostile = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([2**40, 2**48 * 16, 2**63, -1, 0]),
    st.floats(allow_nan=True), st.text(max_size=12), st.lists(st.integers(-3, 2**41), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(obj, prefix=()):
    """Every (path, value) inside a JSON object, containers included."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


PATHS = [p for p, _ in _paths(OBJ) if p]


def _set(obj, path, value):
    obj = json.loads(json.dumps(obj))
    at = obj
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return obj


def _only_ours(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except DeltaSyncError as e:
        return e


def test_the_real_manifest_parses():
    assert parse_manifest(SIGNED.to_json(), verifier=KEY) == SIGNED
    assert len(PATHS) > 20


@FUZZ
@given(path=st.sampled_from(PATHS), value=_hostile, verify=st.booleans())
@example(path=("key_id",), value=None, verify=True)  # the unsigned key-id hint dropped: still the signed manifest
def test_manifest_with_one_hostile_field(path, value, verify):
    data = json.dumps(_set(OBJ, path, value)).encode()
    r = _only_ours(parse_manifest, data, verifier=KEY if verify else None)
    if isinstance(r, Manifest):
        # accepted: it must be self-consistent, and with a key it must be the signed original
        assert r.to_obj() == json.loads(r.to_json())
        if verify:  # every signed field is the original's; the key id is an unsigned hint that may be dropped
            assert r.key_id in (SIGNED.key_id, None), f"a changed {path} verified"
            assert dataclasses.replace(r, key_id=SIGNED.key_id) == SIGNED, f"a changed {path} verified"
    else:
        assert isinstance(r, FormatError | SignatureError), type(r)


@FUZZ
@given(path=st.sampled_from(PATHS), value=_hostile)
def test_manifest_re_signed_with_hostile_field(path, value):
    """A key holder signing nonsense: the parser still answers with its own errors only (no 2 TiB alloc)."""
    obj = _set(OBJ, path, value)
    r = _only_ours(parse_manifest, json.dumps(obj).encode())
    if isinstance(r, Manifest):
        re_signed = r.sign(KEY)
        assert parse_manifest(re_signed.to_json(), verifier=KEY) == re_signed
        assert r.total_bytes >= 0 and r.raw_bytes >= 0


@FUZZ
@given(st.binary(max_size=400))
def test_manifest_garbage_bytes(data):
    r = _only_ours(parse_manifest, data, verifier=KEY)
    assert isinstance(r, FormatError | SignatureError), type(r)


@FUZZ
@given(st.integers(0, len(SIGNED.to_json()) - 1), st.integers(0, 7))
def test_manifest_every_bit_flip_is_refused_with_the_key(i, bit):
    data = bytearray(SIGNED.to_json())
    data[i] ^= 1 << bit
    r = _only_ours(parse_manifest, bytes(data), verifier=KEY)
    if isinstance(r, Manifest):  # a flip JSON cannot see (e.g. in insignificant case of an escape)
        assert r == SIGNED
    else:
        assert isinstance(r, FormatError | SignatureError)


@pytest.mark.parametrize("text", [b"[" * 50_000 + b"]" * 50_000, b'{"version": ' + b"9" * 5000 + b"}",
                                  b'{"format": 1e999}', b"\xff\xfe{}", b""])
def test_manifest_pathological_json(text):
    assert isinstance(_only_ours(parse_manifest, text), FormatError)


# -- head answers -------------------------------------------------------------------------------------------

def _head(body: bytes):
    from deltasync.client.http import HeadInfo
    return HeadInfo.from_body(body, model="policy", url="http://relay")


_json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**65, 2**65), st.text(max_size=5)),
                            lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)),
                            max_leaves=12)


@FUZZ
@given(st.dictionaries(st.sampled_from(["version", "kind", "blobs", "model", "x"]), _json_values, max_size=4))
def test_head_answer_hostile_json(obj):
    r = _only_ours(_head, json.dumps(obj).encode())
    if not isinstance(r, DeltaSyncError):
        assert isinstance(r.version, int)
        assert r.bytes is None or isinstance(r.bytes, int)


@pytest.mark.parametrize("body", [b'{"version": 1, "blobs": [{"size": "7"}]}', b'{"version": 1, "blobs": [{"size": null}]}',
                                  b'{"version": 1, "blobs": [{"size": 1.5}]}', b'{"version": 1, "blobs": [{"size": -3}]}',
                                  b'{"version": true}', b'{"version": -1}', b'{"version": ' + b"9" * 5000 + b"}",
                                  b"[" * 100_000 + b"]" * 100_000, b'{"version": 1, "x": ' + b"[" * 100_000 + b"}"])
def test_head_answer_found_here(body):
    """Once a finding (issue 9: TypeError on non-int sizes, RecursionError on deep nesting): now the source's fault."""
    assert isinstance(_only_ours(_head, body), DeltaSyncError)


@FUZZ
@given(st.binary(max_size=200))
def test_head_answer_garbage(data):
    r = _only_ours(_head, data)  # anything but the library's own errors fails the test
    if not isinstance(r, DeltaSyncError):
        assert isinstance(r.version, int) and r.version >= 0


# -- event streams --------------------------------------------------------------------------------------------

def _decode(chunks: list[bytes], max_line: int = 1 << 20) -> list[SSEEvent]:
    d = SSEDecoder(max_line=max_line)
    out = []
    for c in chunks:
        out += d.feed(c)
    return out


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


_events = st.lists(st.tuples(st.sampled_from(["version", "heartbeat", "message", "x y"]),
                             st.dictionaries(st.text(max_size=5), st.integers(0, 99), max_size=3),
                             st.one_of(st.none(), st.text(alphabet="0123456789abc", max_size=4))), max_size=5)


@FUZZ
@given(events=_events, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_sse_any_chunking_decodes_what_was_formatted(events, cuts):
    data = b"".join(format_event(e, d, id=i) for e, d, i in events)
    got = _decode(_split(data, cuts))
    assert [(e.event, e.json()) for e in got] == [(e, d) for e, d, _ in events]


@FUZZ
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 600), max_size=10))
def test_sse_garbage_any_chunking_is_the_same_as_one_shot(data, cuts):
    one = _only_ours(_decode, [data], 64)
    many = _only_ours(_decode, _split(data, cuts), 64)
    if isinstance(one, DeltaSyncError) or isinstance(many, DeltaSyncError):
        assert isinstance(one, FormatError) or isinstance(many, FormatError)
        return
    assert one == many
    for ev in one:
        r = _only_ours(ev.json)
        assert isinstance(r, dict | FormatError)


def test_sse_endless_line_is_bounded():
    d = SSEDecoder(max_line=1000)
    with pytest.raises(FormatError):
        for _ in range(100):
            d.feed(b"data: " + b"x" * 100)


# -- Range and conditional headers ------------------------------------------------------------------------------

_range_text = st.one_of(
    st.text(max_size=30),
    st.builds(lambda a, b: f"bytes={a}-{b}", st.one_of(st.just(""), st.integers(0, 2**70).map(str)),
              st.one_of(st.just(""), st.integers(0, 2**70).map(str))),
    st.sampled_from(["bytes=0-0,5-9", "bytes=-0", "bytes=--1", "bytes= 1-2", "BYTES=0-1", "bytes=0-1\n"]),
)


@FUZZ
@given(header=st.one_of(st.none(), _range_text), size=st.integers(0, 2**40))
def test_range_header(header, size):
    from deltasync.server.http.ranges import parse_range

    r = _only_ours(parse_range, header, size)
    if isinstance(r, DeltaSyncError):
        assert isinstance(r, RangeError)
    elif r is not None:
        start, end = r
        assert 0 <= start < end <= size


@FUZZ
@given(header=st.one_of(st.none(), st.text(max_size=40)), etag=st.text(min_size=1, max_size=10))
def test_conditional_headers(header, etag):
    from deltasync.server.http.ranges import etag_matches, if_range_allows

    assert isinstance(etag_matches(header, f'"{etag}"'), bool)
    assert isinstance(if_range_allows(header, f'"{etag}"'), bool)


# -- key files, token text, command-line values ------------------------------------------------------------------

@FUZZ
@given(st.one_of(st.text(max_size=80), st.binary(max_size=80)))
def test_key_file_contents(text):
    r = _only_ours(load_key, text)
    if isinstance(r, bytes):
        assert len(r) >= 16
    else:
        assert isinstance(r, FormatError)


@FUZZ
@given(st.text(max_size=40))
def test_server_command_line_values(text):
    from deltasync.server.cli import parse_listen, parse_parent, parse_size

    for parse in (parse_size, parse_listen, parse_parent):
        try:
            parse(text)
        except argparse.ArgumentTypeError:
            pass


def test_key_file_that_is_not_text_is_a_format_error():
    """Regression (found here): bytes that are not UTF-8 raised UnicodeDecodeError out of load_key."""
    with pytest.raises(FormatError):
        load_key(b"\x80" + b"00" * 32)
