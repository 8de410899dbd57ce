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

__all__ = ["TASKS", "split_counts", "map_parts"]

T = TypeVar("T")
R = TypeVar("R")

TASKS = 4  # parts per executor call: 2 per core on the 2-core machines we measure on, enough to balance


def split_counts(counts: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[a, b)`` ranges of ``counts`` with about equal sums, at most ``parts`` of them (every
    item in exactly one range, none empty)."""
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
