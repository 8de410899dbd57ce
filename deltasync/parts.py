"""Work cut into a few tasks of about equal size, for a thread pool.

A future per tensor or per chunk costs more than the work of most of them on a state of 70k small
tensors (a submit, a lock hand-off and a result each: ~25 µs, and the GIL between them), so every
hot path that spreads items over an executor cuts them into a few contiguous parts of about equal
weight and runs one task per part. Results come back in item order, the same as without threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from typing import TypeVar

import numpy as np

__all__ = ["TASKS", "split_counts", "map_parts"]

T = TypeVar("T")
R = TypeVar("R")

TASKS = 4  # parts per executor call: 2 per core on the 2-core machines we measure on, enough to balance


def split_counts(counts: Sequence[int] | np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[a, b)`` ranges of ``counts`` (non-negative) with about equal sums, at most ``parts`` of them
    (every item in exactly one range, none empty)."""
    if len(counts) > 64:  # many items (a blob's chunks): the same cuts found by binary search in the running sums
        return _split_sums(np.cumsum(np.asarray(counts, dtype=np.int64)), parts)
    return _split_loop(counts, parts)


def _split_loop(counts: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """:func:`split_counts` item by item: a cut after the item whose running sum first reaches each next
    ``1 / parts`` of the total."""
    total = sum(counts)
    if total <= 0:  # nothing to weigh by: equal numbers of items
        counts, total = [1] * len(counts), len(counts)
    out, a, acc = [], 0, 0
    for i, c in enumerate(counts):
        acc += c
        if acc * parts >= total * (len(out) + 1) and i + 1 < len(counts):
            out.append((a, i + 1))
            a = i + 1
    out.append((a, len(counts)))
    return [r for r in out if r[0] < r[1]]


def _split_sums(sums: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """:func:`split_counts` from the running sums of its counts: the loop's cut after item ``i`` is where the sum
    through ``i`` first reaches each next ``k / parts`` of the total, one cut an item, none after the last."""
    n = int(sums.size)
    total = int(sums[-1])
    if total <= 0:
        sums, total = np.arange(1, n + 1, dtype=np.int64), n
    scaled = sums * parts
    out, a, k = [], 0, 1
    while True:
        i = max(int(np.searchsorted(scaled, total * k, side="left")), a)  # the first item at or past the k-th mark
        if i + 1 >= n:
            break
        out.append((a, i + 1))
        a = i + 1
        k = len(out) + 1
    out.append((a, n))
    return [r for r in out if r[0] < r[1]]


def map_parts(fn: Callable[[T], R], items: Sequence[T], executor: Executor | None, *,
              weight: Callable[[T], int] | None = None, min_weight: int = 0, parts: int = TASKS) -> Iterator[R]:
    """``map(fn, items)``, on ``executor``'s threads in at most ``parts`` tasks of contiguous items of about
    equal ``weight`` (1 each by default). Serial when there is no executor, fewer than two items, or less
    than ``min_weight`` in all (a thread hand-off would cost more than it saves). The results are in item
    order; the first exception raised by ``fn`` is raised when its result is reached."""
    if executor is None or len(items) < 2:
        return map(fn, items)
    counts = [1] * len(items) if weight is None else [max(int(weight(x)), 1) for x in items]
    if min_weight and sum(counts) < min_weight:
        return map(fn, items)
    ranges = split_counts(counts, parts)
    if len(ranges) < 2:
        return map(fn, items)

    def run(r: tuple[int, int]) -> list[R]:
        return [fn(x) for x in items[r[0] : r[1]]]

    return _flatten(executor.map(run, ranges))


def _flatten(groups: Iterable[list[R]]) -> Iterator[R]:
    for g in groups:
        yield from g
