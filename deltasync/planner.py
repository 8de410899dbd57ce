"""Catch-up planning: the cheapest byte path from a subscriber's version to the head.

Edges are what a server offers: a delta ``a → b`` (one step, or a squashed one)
and a keyframe ``→ v`` (usable from anywhere, also from nothing). Versions only
increase, so the cheapest path is a shortest path over a DAG.

The offers come from walking parent links back from the head: :class:`ChainWalk`
says which manifests to ask for next (pure: it guesses that versions are
consecutive and asks for a window of them at once, growing the window as the walk
goes on, so a subscriber 40 versions behind waits for a handful of round trips,
not 40), and :func:`walk_parents` runs it over a caller-given ``fetch`` coroutine,
the window's requests concurrently. It is the one parent-chain walk: subscribers,
relays and the CLI use it.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from .errors import NotFoundError
from .manifest import Manifest


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


class ChainWalk:
    """Walk parent links back from ``top`` through manifests fetched as it goes (pure: no I/O).

    Stops at a version ``<= floor`` (exclusive floor; None: none), at a keyframe (with
    ``stop_at_keyframe``), at a version the servers do not have, or after ``limit``
    manifests. Loop: ``wanted()`` lists versions to fetch now (empty once ``done``);
    report each with ``add`` or ``missing``. Versions asked for speculatively and never
    reached are ignored."""

    def __init__(self, top: int, *, floor: int | None = None, limit: int = 256, stop_at_keyframe: bool = True,
                 known: Mapping[int, Manifest] | None = None, batch: int = 4, max_batch: int = 32) -> None:
        if limit < 1 or batch < 1 or max_batch < batch:
            raise ValueError("limit and batch must be >= 1 and max_batch >= batch")
        self.top, self.floor, self.limit, self.stop_at_keyframe = top, floor, limit, stop_at_keyframe
        self._known: dict[int, Manifest] = dict(known or {})
        self._missing: set[int] = set()
        self._asked: set[int] = set()
        self._batch, self._max_batch = batch, max_batch
        self.chain: list[Manifest] = []  # from top down, each the parent of the one before
        self.cursor: int | None = top  # the next version on the chain, not yet known
        self.reason = ""  # why the walk stopped: "floor" | "keyframe" | "missing" | "limit" | "root"
        self._advance()

    @property
    def done(self) -> bool:
        return bool(self.reason)

    @property
    def reaches_floor(self) -> bool:
        return self.reason == "floor" and self.floor is not None and self.cursor == self.floor

    def _advance(self) -> None:
        while not self.reason:
            v = self.cursor
            if v is None:
                self.reason = "root"
            elif self.floor is not None and v <= self.floor:
                self.reason = "floor"
            elif len(self.chain) >= self.limit:
                self.reason = "limit"
            elif v in self._missing:
                self.reason = "missing"
            elif v in self._known:
                m = self._known[v]
                self.chain.append(m)
                if m.kind == "keyframe" and self.stop_at_keyframe:
                    self.reason = "keyframe"
                else:
                    self.cursor = m.parent
            else:
                return

    def wanted(self) -> list[int]:
        """Versions to fetch now: the next one on the chain and a window below it, newest first."""
        if self.reason or self.cursor is None:
            return []
        v = self.cursor
        lo = max(v - self._batch + 1, 0 if self.floor is None else self.floor + 1)
        lo = max(lo, v - (self.limit - len(self.chain)) + 1)
        out = [u for u in range(v, lo - 1, -1) if u not in self._known and u not in self._missing and u not in self._asked]
        if v not in out and v not in self._asked:
            out.insert(0, v)
        self._asked.update(out)
        self._batch = min(self._batch * 2, self._max_batch)
        return out

    def add(self, version: int, manifest: Manifest) -> None:
        self._asked.discard(version)
        self._known[version] = manifest
        self._advance()

    def missing(self, version: int) -> None:
        self._asked.discard(version)
        self._missing.add(version)
        self._advance()


async def walk_parents(fetch: Callable[[int], Awaitable[Manifest | None]], top: int, *, floor: int | None = None,
                       limit: int = 256, stop_at_keyframe: bool = True,
                       known: Mapping[int, Manifest] | None = None) -> ChainWalk:
    """Run a :class:`ChainWalk` over ``fetch(version)`` (a verified manifest, or None when the servers
    do not have it); each window of versions is fetched concurrently. Returns the finished walk
    (``chain``, ``reason``, ``reaches_floor``). An exception from ``fetch`` propagates."""
    walk = ChainWalk(top, floor=floor, limit=limit, stop_at_keyframe=stop_at_keyframe, known=known)
    while not walk.done:
        versions = walk.wanted()
        if not versions:
            raise RuntimeError(f"chain walk stuck at v{walk.cursor}")  # unreachable: wanted() always asks for the cursor
        got = await asyncio.gather(*(fetch(v) for v in versions))
        for v, m in zip(versions, got):
            if m is None:
                walk.missing(v)
            else:
                walk.add(v, m)
    return walk
