"""deltasync/lazytuple.py: a tuple whose items are made on first use, once, and that is a tuple to its readers."""

from __future__ import annotations

from deltasync.lazytuple import LazyTuple


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
