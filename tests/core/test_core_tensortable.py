"""Manifest format 3 (docs/FORMAT.md §5.3): the tensor table, compact deltas, and what readers refuse."""

from __future__ import annotations

import base64
import json
import random

import pytest
import torch
import zstandard

from deltasync.codec import EncodeOptions, chunk_spans, encode_delta
from deltasync.errors import FormatError
from deltasync.fingerprint import fingerprint_state, state_fingerprint_of
from deltasync.keyframe import encode_keyframe
from deltasync.manifest import parse_manifest
from deltasync.squash import squash_chain
from deltasync.apply import apply_delta


def _states(n: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = {f"layer.{i:03d}.w": torch.randn(7 + i, generator=g).to(torch.bfloat16) for i in range(n)}
    a["big"] = torch.randn(64, 300, generator=g)
    a["ints"] = torch.arange(5, dtype=torch.int64)
    b = {k: v.clone() for k, v in a.items()}
    for i in range(0, n, 3):  # a third of the small tensors change
        b[f"layer.{i:03d}.w"].view(torch.int16)[0] += 1
    b["big"][3, 5] += 1.0
    b["big"][60, 299] -= 2.0
    return a, b


def test_a_delta_lists_only_what_it_changes_and_round_trips():
    a, b = _states()
    enc = encode_delta(a, b, model="m", version=1, parent=0, options=EncodeOptions(blob_target=64))
    full = enc.manifest
    m = full.compact()
    changed = {t.name for t in full.tensors if t.changed}
    assert {t.name for t in m.tensors} == changed and len(changed) < len(a)
    assert m.state_fp == full.state_fp and m.state_fp_before == full.state_fp_before
    assert not any(k.startswith("deltasync.spans.") for k in m.meta)
    back = parse_manifest(m.to_json())
    assert back == m and back.format == 3
    assert chunk_spans(back) == {t.name: [(c.start, c.stop) for c in t.chunks] for t in full.tensors if t.chunks}
    target = {k: v.clone() for k, v in a.items()}
    fps = apply_delta(target, back, enc.blobs, fingerprint_state(target))
    assert all(torch.equal(target[k].view(torch.uint8) if target[k].dtype != torch.int64 else target[k],
                           b[k].view(torch.uint8) if b[k].dtype != torch.int64 else b[k]) for k in a)
    assert state_fingerprint_of(target, fps) == m.state_fp


def test_a_keyframe_lists_every_tensor():
    a, _ = _states()
    m = encode_keyframe(a, model="m", version=0).manifest.compact()
    back = parse_manifest(m.to_json())
    assert back == m and len(back.tensors) == len(a)
    assert all(t.chunks[0].key == t.name for t in back.tensors)


def test_a_base_that_differs_in_an_unlisted_tensor_is_refused():
    a, b = _states()
    enc = encode_delta(a, b, model="m", version=1, parent=0)
    m = parse_manifest(enc.manifest.compact().to_json())
    target = {k: v.clone() for k, v in a.items()}
    target["ints"][2] = 99  # not changed by the delta, so not listed: the state fingerprint catches it
    before = {k: v.clone() for k, v in target.items()}
    with pytest.raises(Exception, match="not the delta's base"):
        apply_delta(target, m, enc.blobs, fingerprint_state(target))
    assert all(torch.equal(target[k], before[k]) for k in target)


def test_a_squash_of_a_format3_chain_is_format3_and_lands_on_the_last_state():
    a, b = _states()
    c = {k: v.clone() for k, v in b.items()}
    c["layer.001.w"].view(torch.int16)[2] += 3
    c["layer.000.w"].copy_(a["layer.000.w"])  # put back: the squash leaves it out
    e1 = encode_delta(a, b, model="m", version=1, parent=0)
    e2 = encode_delta(b, c, model="m", version=2, parent=1)
    blobs = {**e1.blobs, **e2.blobs}
    chain = [parse_manifest(e.manifest.compact().to_json()) for e in (e1, e2)]
    sq = squash_chain(chain, blobs.__getitem__)
    assert sq.manifest.format == 3 and "layer.000.w" not in {t.name for t in sq.manifest.tensors}
    m = parse_manifest(sq.manifest.to_json())
    target = {k: v.clone() for k, v in a.items()}
    fps = apply_delta(target, m, sq.blobs, fingerprint_state(target))
    assert state_fingerprint_of(target, fps) == e2.manifest.state_fp


def _table_of(m) -> bytes:
    return zstandard.ZstdDecompressor().decompress(base64.b64decode(json.loads(m.to_json())["table"]))


def _with_table(m, raw: bytes) -> bytes:
    obj = json.loads(m.to_json())
    obj["table"] = base64.b64encode(zstandard.ZstdCompressor().compress(raw)).decode()
    return json.dumps(obj).encode()


@pytest.mark.parametrize("kind", ["delta", "keyframe"])
def test_a_truncated_or_bit_flipped_table_raises_format_error_only(kind):
    a, b = _states(12)
    enc = encode_delta(a, b, model="m", version=1, parent=0) if kind == "delta" else encode_keyframe(b, model="m", version=0)
    m = enc.manifest.compact()
    raw = _table_of(m)
    rnd = random.Random(5)
    for cut in range(0, len(raw)):
        with pytest.raises(FormatError):
            parse_manifest(_with_table(m, raw[:cut]))
    with pytest.raises(FormatError):
        parse_manifest(_with_table(m, raw + b"\x00"))
    for _ in range(300):
        bad = bytearray(raw)
        bad[rnd.randrange(len(bad))] ^= 1 << rnd.randrange(8)
        try:
            parse_manifest(_with_table(m, bytes(bad)))
        except FormatError:
            pass  # most flips are caught; the rest change a fingerprint or count, caught at apply


def test_table_rules():
    a, b = _states(6)
    m = encode_delta(a, b, model="m", version=1, parent=0).manifest.compact()
    obj = json.loads(m.to_json())
    for bad, what in ((123, "base64"), ("not base64!", "base64"), (base64.b64encode(b"junk").decode(), "zstd")):
        o = dict(obj, table=bad)
        with pytest.raises(FormatError, match=what):
            parse_manifest(json.dumps(o).encode())
    o = dict(obj)
    o["tensors"] = []
    with pytest.raises(FormatError, match="fields"):
        parse_manifest(json.dumps(o).encode())


@pytest.mark.slow
def test_a_70k_tensor_step_manifest_is_under_a_megabyte():
    """Issue 22's target on a Kimi-K2-class layout (narrow dims): 69,975 tensors, every one changed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from seedscale_states import kimi_layout, make_state, step_state

    lay = kimi_layout(layers=61)
    a = make_state(lay)
    b = step_state(a, changed=0.01)
    enc = encode_delta(a, b, model="m", version=1, parent=0)
    full, m = enc.manifest, enc.manifest.compact()
    size = len(m.to_json())
    assert len(full.to_json()) > 15 << 20 and size < 1 << 20, size
    assert len(parse_manifest(m.to_json()).tensors) == sum(1 for t in full.tensors if t.changed)


@pytest.mark.parametrize("records", [True, False], ids=["records", "checked-only"])
def test_a_chunk_referenced_twice_is_refused_with_or_without_records(records):
    """Two tensors naming one chunk of one blob: refused whether the records are made or the table only checked
    (an origin commits with ``records=False``)."""
    import dataclasses

    a, b = _states()
    m = encode_delta(a, b, model="m", version=1, parent=0, options=EncodeOptions(blob_target=64)).manifest.compact()
    assert parse_manifest(m.to_json(), records=records).version == 1
    recs = list(m.tensors)
    first, second = recs[0], recs[1]
    twin = dataclasses.replace(second.chunks[0], blob=first.chunks[0].blob, index=first.chunks[0].index)
    recs[1] = dataclasses.replace(second, chunks=(twin,) + second.chunks[1:])
    forged = dataclasses.replace(m, tensors=tuple(recs))
    with pytest.raises(FormatError, match="referenced twice"):
        parse_manifest(forged.to_json(), records=records)


def _names_table(names: list[str]) -> bytes:
    """A keyframe table of ``names`` (one float32 scalar each, one shard a tensor), packed as written, the
    names' order as given (sorted or not)."""
    import numpy as np

    from deltasync.tensortable import pack_columns

    n = len(names)
    return pack_columns("keyframe", names, ["float32"], np.zeros(n, np.uint8), np.zeros(n, np.uint8), [],
                        np.zeros(n, np.uint64), np.zeros(n, np.uint64), np.ones(n, np.uint32), np.arange(n))


def test_a_tables_names_checked_once_are_not_checked_again_and_other_names_still_are():
    """The names of a table (a step's, every step alike) are checked once per process: a second table with the
    same names takes the first one's list, while names that differ by one byte (out of order, listed twice,
    empty, not UTF-8) are refused as ever."""
    import sys

    from deltasync import manifest as manifest_module
    from deltasync.tensortable import unpack_table

    names = [f"model.layers.{i // 384}.mlp.experts.{i % 384:03d}.w" for i in range(2048)]
    ids = [f"{i:032x}" for i in range(len(names))]
    limits = sys.modules[manifest_module.__name__]
    first = unpack_table(_names_table(names), "keyframe", ids, limits=limits, build="columns")
    again = unpack_table(_names_table(names), "keyframe", ids, limits=limits, build="columns")
    assert first.names == names and again.names is first.names
    for bad, what in (
        (names[:5] + [names[6], names[5]] + names[7:], "sorted"),
        (names[:5] + [names[4]] + names[6:], "twice"),
        ([""] + names[1:], "non-empty"),
    ):
        with pytest.raises(FormatError, match=what):
            unpack_table(_names_table(bad), "keyframe", ids, limits=limits, build=False)
    raw = zstandard.ZstdDecompressor().decompress(_names_table(names))
    at = raw.index(names[7].encode())
    bad_utf8 = raw[:at] + b"\xff" + raw[at + 1:]  # the same length, one byte not UTF-8
    with pytest.raises(FormatError, match="UTF-8"):
        unpack_table(zstandard.ZstdCompressor().compress(bad_utf8), "keyframe", ids, limits=limits, build=False)
    assert unpack_table(_names_table(names), "keyframe", ids, limits=limits, build="columns").names is first.names
