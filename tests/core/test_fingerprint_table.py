"""fingerprint.NameIndex / FingerprintTable: a layout's fingerprints as one array (the follower's state at 100k+
tensors), and StateLines.digest writing its digits a window of lines at a time (compiled) against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from deltasync import fingerprint, kernels
from deltasync.apply import fp_array
from deltasync.fingerprint import FingerprintTable, NameIndex, StateLines

from core_support import restore_kernels  # noqa: F401  (autouse: the kernel selection put back)

NAMES = [f"model.layers.{i // 7}.mlp.experts.{i % 7}.weight" for i in range(50)]


def _table(seed: int = 0) -> FingerprintTable:
    rng = np.random.default_rng(seed)
    return FingerprintTable(NameIndex(sorted(NAMES)), rng.integers(0, 2**64, len(NAMES), np.uint64, endpoint=False))


def test_a_table_is_a_read_only_mapping_of_its_names():
    t = _table()
    names = t.names.names
    assert list(t) == names and len(t) == 50 and names[3] in t and "nope" not in t
    assert dict(t) == {n: int(v) for n, v in zip(names, t.values.tolist())}
    assert t[names[7]] == int(t.values[7]) and t.get("nope") is None
    with pytest.raises(ValueError):
        t.values[0] = 1  # immutable: a change makes a new table
    with pytest.raises(KeyError):
        t["nope"]


def test_rows_of_another_list_are_remembered_and_found_again_by_content():
    idx = NameIndex(sorted(NAMES))
    sub = idx.names[5:20:3]
    rows = idx.rows(sub)
    assert rows.tolist() == list(range(5, 20, 3)) and not rows.flags.writeable
    assert idx.rows(sub) is rows  # the same list: remembered
    assert idx.rows(list(sub)) is rows  # the same names in a new list (the next step's table): compared
    assert idx.rows(list(idx.names)).tolist() == list(range(50))  # every name, in order: no lookup
    assert idx.rows([*sub, "nope"]) is None
    with pytest.raises(ValueError):
        NameIndex(["a", "a"])


def test_take_replaced_and_of_keep_the_values_and_the_index():
    t = _table(1)
    names = t.names.names
    assert fp_array(t, names) is t.values  # the layout's own list: the array itself
    pick = [names[9], names[2]]
    assert fp_array(t, pick).tolist() == [t[names[9]], t[names[2]]]
    assert fp_array(t, ["nope"]) is None
    rows = t.names.rows(pick)
    new = t.replaced(rows, np.array([1, 2], np.uint64))
    assert new[names[9]] == 1 and new[names[2]] == 2 and new.names is t.names
    assert t[names[9]] != 1  # the old table unchanged
    assert {n: new[n] for n in names if n not in pick} == {n: t[n] for n in names if n not in pick}
    plain = dict(new)
    again = FingerprintTable.of(t.names, plain)
    assert again is not None and again.values.tolist() == new.values.tolist()
    assert FingerprintTable.of(t.names, new) is new
    assert FingerprintTable.of(t.names, {**plain, "extra": 1}) is None  # other names: not this layout's
    del plain[names[0]]
    assert FingerprintTable.of(t.names, {**plain, "other": 1}) is None
    assert FingerprintTable.of(t.names, {**dict(new), names[0]: -1}) is None  # not a 64-bit fingerprint


@pytest.mark.parametrize("window", [1 << 18, 1, 200])  # one window; a line a window; a few lines a window
@pytest.mark.parametrize("which", ["numba", "reference"])
def test_lines_digest_matches_the_definition_with_any_kernels(which, window, monkeypatch):
    kernels.select(which)
    monkeypatch.setattr(fingerprint, "_WINDOW", window)
    rng = np.random.default_rng(4)
    names, dtypes, shapes = sorted(NAMES), ["bfloat16"] * 50, [(3, 4)] * 50
    made = StateLines(names, dtypes, shapes)
    # lines read back read-only (headercache.load_lines maps them): only read, still described
    template = made.template.copy()
    template.flags.writeable = False
    kept = StateLines.of_parts(made.order.copy(), made.hex_at.copy(), template)
    for k in range(3):
        fps = rng.integers(0, 2**64, 50, np.uint64, endpoint=False)
        if k == 2:
            fps.flags.writeable = False  # a FingerprintTable's values
        text = "".join(f"{n}\x00bfloat16\x003,4\x00{int(f):016x}\n" for n, f in zip(names, fps.tolist()))
        want = xxhash.xxh3_64_hexdigest(text.encode())
        assert made.digest(fps) == kept.digest(fps) == want
        assert kept.describes(names, dtypes, shapes) and made.describes(names, dtypes, shapes)
    assert not kept.describes([*names[:-1], "zz"], dtypes, shapes)
