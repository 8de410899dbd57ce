"""fingerprint.StateLines / state_fingerprint_columns: the digest state_fingerprint's line by line text gives."""

from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from deltasync import fingerprint
from deltasync.fingerprint import StateLines, state_fingerprint, state_fingerprint_columns
from deltasync.tensortable import fp_texts, fp_values


def _reference(records) -> str:
    """The definition (docs/FORMAT.md): xxh3-64 over the sorted records' lines."""
    text = "".join(f"{n}\x00{d}\x00{','.join(map(str, map(int, s)))}\x00{fp & (2**64 - 1):016x}\n"
                   for n, d, s, fp in sorted(records, key=lambda r: r[0]))
    return xxhash.xxh3_64_hexdigest(text.encode())


def _records(n: int, seed: int = 7):
    rng = random.Random(seed)
    recs = [(f"model.layers.{i}.mlp.experts.{i % 16}.w{i % 3}.weight" if i % 5 else f"blk.{i}.é.weight",
             rng.choice(["bfloat16", "float32"]), rng.choice([(32, 64), (64, 32), [64], (), (2, 0, 3)]),
             rng.getrandbits(64)) for i in range(n)]
    rng.shuffle(recs)
    return recs


@pytest.mark.parametrize("n", [0, 1, 7, 300, 5000])
@pytest.mark.parametrize("lines_min", [0, 10**9])
def test_same_digest_as_the_definition(n, lines_min, monkeypatch):
    monkeypatch.setattr(fingerprint, "LINES_MIN", lines_min)
    recs = _records(n)
    assert state_fingerprint(recs) == state_fingerprint(iter(recs)) == _reference(recs)
    other = [(a, d, s, fp ^ 1) for a, d, s, fp in recs]
    assert state_fingerprint(other) == _reference(other)
    if n:
        assert state_fingerprint(other) != state_fingerprint(recs)


def test_lines_digest_any_set_of_fingerprints_in_the_records_order():
    recs = _records(2000, seed=3)
    lines = StateLines([r[0] for r in recs], [r[1] for r in recs], [r[2] for r in recs])
    for k in range(3):
        fps = np.random.default_rng(k).integers(0, 2**64, len(recs), dtype=np.uint64, endpoint=False)
        want = _reference([(a, d, s, int(f)) for (a, d, s, _), f in zip(recs, fps)])
        assert lines.digest(fps) == want
        assert state_fingerprint_columns([r[0] for r in recs], [r[1] for r in recs], [r[2] for r in recs], fps) == want
    assert fp_values([f"{r[3]:016x}" for r in recs]).tolist() == [r[3] for r in recs]
    assert fp_texts(fp_values([f"{r[3]:016x}" for r in recs])) == [f"{r[3]:016x}" for r in recs]
    assert fp_values(["0" * 15]) is None and fp_values(["x" * 16]) is None


def test_fingerprints_outside_64_bits_are_masked_as_the_lines_spell_them(monkeypatch):
    monkeypatch.setattr(fingerprint, "LINES_MIN", 0)
    recs = [(f"t{i}", "float32", (2,), -1 - i if i % 2 else 2**64 + i) for i in range(50)]
    assert state_fingerprint(recs) == _reference(recs)
