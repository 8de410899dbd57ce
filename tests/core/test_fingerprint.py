"""fingerprint.record_prefixes / state_fingerprint_of_lines: the digest state_fingerprint gives."""

from __future__ import annotations

import random

from deltasync.fingerprint import record_prefixes, state_fingerprint, state_fingerprint_of_lines


def test_same_digest_as_state_fingerprint():
    rng = random.Random(7)
    recs = sorted((f"model.layers.{i}.mlp.experts.{j}.w{k}.weight", rng.choice(["bfloat16", "float32"]),
                   rng.choice([(32, 64), (64, 32), (64,), ()]), rng.getrandbits(64))
                  for i in range(4) for j in range(16) for k in (1, 2, 3))
    prefixes = record_prefixes([(n, d, s) for n, d, s, _ in recs])
    assert state_fingerprint_of_lines(prefixes, [f"{fp:016x}" for *_, fp in recs]) == state_fingerprint(recs)
    other = [(n, d, s, fp ^ 1) for n, d, s, fp in recs]
    assert state_fingerprint_of_lines(prefixes, [f"{fp:016x}" for *_, fp in other]) == state_fingerprint(other)
    assert state_fingerprint(other) != state_fingerprint(recs)


def test_list_shapes_read_as_tuples():
    assert record_prefixes([("a", "float32", [2, 3]), ("b", "float32", (2, 3))]) == \
        ["a\x00float32\x002,3\x00", "b\x00float32\x002,3\x00"]
