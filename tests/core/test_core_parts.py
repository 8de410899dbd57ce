"""deltasync.parts: work cut into a few balanced tasks, results in item order."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from deltasync.parts import map_parts, split_counts


def test_split_counts_covers_every_item_once_in_balanced_contiguous_ranges():
    counts = [5, 1, 1, 1, 1, 1, 5, 1, 1, 3]
    ranges = split_counts(counts, 4)
    assert len(ranges) <= 4
    assert ranges[0][0] == 0 and ranges[-1][1] == len(counts)
    assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
    sums = [sum(counts[a:b]) for a, b in ranges]
    assert max(sums) <= 2 * sum(counts) / 4 + max(counts)


def test_split_counts_with_no_weight_splits_by_item_count_not_per_item():
    assert split_counts([0] * 100, 4) == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert split_counts([], 4) == [(0, 0)][:0] or split_counts([], 4) == []


def test_map_parts_runs_few_tasks_and_keeps_order():
    items = list(range(10_000))
    threads: set[int] = set()
    calls = []

    def fn(x):
        threads.add(threading.get_ident())
        return x * 2

    with ThreadPoolExecutor(2) as ex:
        real_map = ex.map

        def counting_map(f, it):
            it = list(it)
            calls.append(len(it))
            return real_map(f, it)

        ex.map = counting_map
        out = list(map_parts(fn, items, ex))
    assert out == [x * 2 for x in items]
    assert calls == [4]  # 4 tasks for 10,000 items, not a future per item


def test_map_parts_serial_below_min_weight_and_raises_the_first_error_in_order():
    with ThreadPoolExecutor(2) as ex:
        assert list(map_parts(lambda x: x + 1, [1, 2, 3], ex, min_weight=100)) == [2, 3, 4]

        def fn(x):
            if x in (3, 7):
                raise ValueError(f"bad {x}")
            return x

        with pytest.raises(ValueError, match="bad 3"):
            list(map_parts(fn, list(range(10)), ex))


def test_many_counts_are_cut_where_the_loop_cuts_them():
    """split_counts of more than 64 counts (a blob's chunks) finds the same cuts by binary search in the running
    sums as the item-by-item loop: zeros, one heavy item, all weight first or last, any number of parts."""
    import random

    import numpy as np

    from deltasync.parts import _split_loop as loop
    from deltasync.parts import split_counts

    rng = random.Random(3)
    for _ in range(3000):
        n = rng.choice([65, 70, 200, 3000])
        shape = rng.random()
        if shape < 0.2:
            counts = [0] * n
        elif shape < 0.4:
            counts = [rng.choice([1, 1, 1, 10**6]) for _ in range(n)]
        elif shape < 0.5:
            counts = [0] * (n - 1) + [5]
        elif shape < 0.6:
            counts = [7] + [0] * (n - 1)
        else:
            counts = [rng.randrange(0, 1000) for _ in range(n)]
        p = rng.choice([1, 2, 3, 4, 7, 16])
        want = loop(counts, p)
        assert split_counts(counts, p) == want and split_counts(np.array(counts, np.int64), p) == want
