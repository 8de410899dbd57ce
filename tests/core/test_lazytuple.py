"""deltasync/lazytuple.py: a tuple whose items are made on first use, once, and that is a tuple to its readers."""

from __future__ import annotations

import numpy as np

from deltasync.lazytuple import LazyTuple, lazy_zip


class _Squares(LazyTuple):
    calls = 0

    def _build(self):
        type(self).calls += 1
        return (i * i for i in range(5))


def test_made_once_on_first_use_and_a_tuple_to_its_readers():
    _Squares.calls = 0
    t = _Squares()
    assert _Squares.calls == 0 and isinstance(t, tuple)
    assert list(t) == [0, 1, 4, 9, 16] and _Squares.calls == 1
    assert len(t) == 5 and t[2] == 4 and t[-1] == 16 and t[1:3] == (1, 4) and 9 in t and 7 not in t
    assert list(reversed(t)) == [16, 9, 4, 1, 0]
    assert t == (0, 1, 4, 9, 16) and (0, 1, 4, 9, 16) == t and t != (0,) and t == _Squares()
    assert hash(t) == hash((0, 1, 4, 9, 16)) and repr(t) == "(0, 1, 4, 9, 16)"
    assert tuple(t) == (0, 1, 4, 9, 16) and [*t] == [0, 1, 4, 9, 16]
    assert _Squares.calls == 2  # the second instance made its own; the first none again


def test_lazy_zip_is_the_dict_made_on_first_use():
    """``lazy_zip`` (a compare's fingerprints and layout, from its columns): nothing made until read, then
    exactly ``dict(zip(...))``, its numpy values as Python ints; a zip of pairs is taken once."""
    names = [f"t{i}" for i in range(5)]
    fps = np.arange(5, dtype=np.uint64) * np.uint64(2**62)
    d = lazy_zip(names, fps)
    assert dict.__len__(d) == 0  # nothing made yet
    assert d["t3"] == 3 * 2**62 % 2**64 and type(d["t3"]) is int
    assert d == dict(zip(names, fps.tolist())) and len(d) == 5
    layout = lazy_zip(names, zip(["bf16"] * 5, [(i, 2) for i in range(5)]))
    assert dict(layout) == {n: ("bf16", (i, 2)) for i, n in enumerate(names)}
    assert list(layout) == names  # made once: the zip is not read again
