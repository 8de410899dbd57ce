"""Catch-up planning: the cheapest byte path from a subscriber's version to the head.

Edges are what a server offers: a delta ``a → b`` (one step, or a squashed one)
and a keyframe ``→ v`` (usable from anywhere, also from nothing). Versions only
increase, so the cheapest path is a shortest path over a DAG.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import NotFoundError


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    kind: str  # "keyframe" | "delta"
    source: int | None  # None for a keyframe
    target: int
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    steps: tuple[Step, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.steps)


def plan_catchup(
    current: int | None,
    head: int,
    *,
    deltas: Mapping[tuple[int, int], int],
    keyframes: Mapping[int, int],
) -> Plan:
    """Cheapest sequence of keyframes/deltas taking ``current`` (None: nothing) to ``head``.

    Ties prefer fewer steps. Raises NotFoundError when no path exists.
    """
    if current is not None and current == head:
        return Plan(steps=())
    if current is not None and current > head:
        raise NotFoundError(f"current version {current} is ahead of head {head}")
    out: dict[int | None, list[Step]] = {}
    for (a, b), size in deltas.items():
        if b <= head and a < b:
            out.setdefault(a, []).append(Step(kind="delta", source=a, target=b, size=size))
    # A keyframe replaces the whole state, so any keyframe up to the head is a start, even one
    # older than the current version (followed by a cheap squashed delta, say).
    key_steps = [Step(kind="keyframe", source=None, target=v, size=s) for v, s in keyframes.items() if v <= head]
    best: dict[int | None, tuple[int, int]] = {current: (0, 0)}
    prev: dict[int, Step] = {}
    heap: list[tuple[int, int, int]] = [(0, 0, -1 if current is None else current)]
    for st in key_steps:  # a keyframe is reachable from any state
        cost = (st.size, 1)
        if cost < best.get(st.target, (1 << 62, 0)):
            best[st.target] = cost
            prev[st.target] = st
            heapq.heappush(heap, (st.size, 1, st.target))
    while heap:
        cost, n, v = heapq.heappop(heap)
        node = None if v == -1 and current is None else v
        if best.get(node, (1 << 62, 0)) < (cost, n):
            continue
        if node == head:
            break
        for st in out.get(node, ()):
            c = (cost + st.size, n + 1)
            if c < best.get(st.target, (1 << 62, 0)):
                best[st.target] = c
                prev[st.target] = st
                heapq.heappush(heap, (*c, st.target))
    if head not in prev:
        start = "nothing" if current is None else f"v{current}"
        raise NotFoundError(f"no path from {start} to v{head}: no keyframe or delta chain covers it")
    steps = []
    v: int | None = head
    while v != current and v in prev:
        st = prev[v]
        steps.append(st)
        v = st.source
        if st.kind == "keyframe":
            break
    return Plan(steps=tuple(reversed(steps)))
