"""Catch-up planning: table-driven cases plus a brute-force reference on random offers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.errors import NotFoundError
from deltasync.planner import Plan, Step, plan_catchup


def chain(a: int, b: int, size: int) -> dict[tuple[int, int], int]:
    return {(v, v + 1): size for v in range(a, b)}


def d(a, b, size):
    return Step(kind="delta", source=a, target=b, size=size)


def k(v, size):
    return Step(kind="keyframe", source=None, target=v, size=size)


CASES = [
    # (id, current, head, deltas, keyframes, expected steps)
    ("chain-only", 5, 8, chain(5, 8, 10), {}, [d(5, 6, 10), d(6, 7, 10), d(7, 8, 10)]),
    ("one-step", 7, 8, chain(0, 8, 10), {0: 1000}, [d(7, 8, 10)]),
    ("keyframe-cheaper", 1, 8, chain(1, 8, 100), {8: 500}, [k(8, 500)]),
    ("chain-cheaper-than-keyframe", 1, 8, chain(1, 8, 10), {8: 500}, [d(v, v + 1, 10) for v in range(1, 8)]),
    ("keyframe-then-chain", 2, 10, chain(2, 10, 50), {9: 300}, [k(9, 300), d(9, 10, 50)]),
    ("from-nothing-keyframe-then-chain", None, 8, chain(0, 8, 10), {4: 100, 8: 1000},
     [k(4, 100), d(4, 5, 10), d(5, 6, 10), d(6, 7, 10), d(7, 8, 10)]),
    ("from-nothing-keyframe-at-head", None, 8, chain(0, 8, 10), {8: 5}, [k(8, 5)]),
    ("squashed-edge", 5, 8, {**chain(5, 8, 10), (5, 8): 15}, {}, [d(5, 8, 15)]),
    ("squashed-dearer-than-chain", 5, 8, {**chain(5, 8, 10), (5, 8): 31}, {}, [d(5, 6, 10), d(6, 7, 10), d(7, 8, 10)]),
    ("squashed-partial", 5, 8, {**chain(5, 8, 10), (5, 7): 12}, {}, [d(5, 7, 12), d(7, 8, 10)]),
    ("squashed-from-keyframe", None, 8, {**chain(4, 8, 10), (4, 8): 11}, {4: 100}, [k(4, 100), d(4, 8, 11)]),
    ("tie-prefers-fewer-steps", 5, 7, {**chain(5, 7, 10), (5, 7): 20}, {}, [d(5, 7, 20)]),
    ("tie-keyframe-vs-chain", 5, 8, chain(5, 8, 10), {8: 30}, [k(8, 30)]),
    ("deltas-past-head-ignored", 5, 7, {**chain(5, 10, 10), (5, 9): 1}, {9: 1}, [d(5, 6, 10), d(6, 7, 10)]),
    ("backwards-delta-ignored", 5, 7, {**chain(5, 7, 10), (6, 5): 0, (7, 7): 0}, {}, [d(5, 6, 10), d(6, 7, 10)]),
    ("keyframe-at-current-ignored", 5, 6, chain(5, 6, 10), {5: 0}, [d(5, 6, 10)]),
    ("skip-over-a-gap-by-squash", 5, 8, {(5, 6): 10, (6, 8): 25}, {}, [d(5, 6, 10), d(6, 8, 25)]),
    ("zero-size-edges", 5, 7, chain(5, 7, 0), {}, [d(5, 6, 0), d(6, 7, 0)]),
]


@pytest.mark.parametrize("current,head,deltas,keyframes,want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_table(current, head, deltas, keyframes, want):
    plan = plan_catchup(current, head, deltas=deltas, keyframes=keyframes)
    assert isinstance(plan, Plan)
    assert list(plan.steps) == want
    assert plan.total_bytes == sum(s.size for s in want)


@pytest.mark.parametrize("current,head,deltas,keyframes", [
    (5, 5, {}, {}),
    (5, 5, chain(0, 9, 10), {5: 1, 9: 1}),
    (0, 0, {}, {}),
], ids=["nothing-offered", "everything-offered", "zero"])
def test_current_is_head_is_an_empty_plan(current, head, deltas, keyframes):
    plan = plan_catchup(current, head, deltas=deltas, keyframes=keyframes)
    assert plan.steps == () and plan.total_bytes == 0


@pytest.mark.parametrize("current,head,deltas,keyframes", [
    (5, 8, {(5, 6): 1, (7, 8): 1}, {}),  # a gap in the chain
    (5, 8, {(4, 8): 1}, {}),  # only a delta from an older base
    (5, 8, chain(5, 7, 1), {7: 1}),  # nothing reaches 8
    (None, 8, chain(0, 8, 1), {}),  # from nothing without a keyframe
    (None, 8, chain(0, 8, 1), {9: 1}),  # a keyframe past the head does not help
    (9, 8, chain(0, 10, 1), {8: 1}),  # ahead of the head
    (5, 8, {}, {}),
], ids=["gap", "older-base", "short", "nothing-no-keyframe", "keyframe-past-head", "ahead", "empty"])
def test_no_path_is_not_found(current, head, deltas, keyframes):
    with pytest.raises(NotFoundError) as ei:
        plan_catchup(current, head, deltas=deltas, keyframes=keyframes)
    assert ei.value.http_status == 404


def test_long_chain_is_fast_and_exact():
    import time
    t = time.perf_counter()
    plan = plan_catchup(0, 20000, deltas={**chain(0, 20000, 3), (100, 19000): 5}, keyframes={v: 10**6 for v in range(0, 20001, 1000)})
    assert time.perf_counter() - t < 5
    assert plan.steps[0] == d(0, 1, 3) and d(100, 19000, 5) in plan.steps
    assert plan.total_bytes == 100 * 3 + 5 + 1000 * 3 and len(plan.steps) == 1101


# -- brute-force reference --------------------------------------------------------------------------------

def reference(current, head, deltas, keyframes):
    """(bytes, steps) of the best plan by DP over versions in increasing order; None when unreachable.

    A keyframe is a full state, so any keyframe up to the head can start a plan, even one older than
    ``current`` (then followed by deltas from it)."""
    best: dict = {} if current is None else {current: (0, 0)}
    for v in range(0, head + 1):
        cands = [best[v]] if v in best else []
        if v in keyframes:
            cands.append((keyframes[v], 1))
        for (a, b), size in deltas.items():
            if b == v and a < b and a in best:
                c = best[a]
                cands.append((c[0] + size, c[1] + 1))
        if cands:
            best[v] = min(cands)
    return best.get(head)


offers = st.fixed_dictionaries({
    "current": st.one_of(st.none(), st.integers(0, 6)),
    "head": st.integers(0, 10),
    "deltas": st.dictionaries(st.tuples(st.integers(0, 10), st.integers(0, 10)), st.integers(0, 50), max_size=25),
    "keyframes": st.dictionaries(st.integers(0, 10), st.integers(0, 200), max_size=4),
})


@settings(max_examples=400, deadline=None)
@given(offers)
def test_plan_is_valid_and_optimal(o):
    current, head, deltas, keyframes = o["current"], o["head"], o["deltas"], o["keyframes"]
    if current is not None and current > head:
        with pytest.raises(NotFoundError):
            plan_catchup(current, head, deltas=deltas, keyframes=keyframes)
        return
    want = (0, 0) if current == head else reference(current, head, deltas, keyframes)
    if want is None:
        with pytest.raises(NotFoundError):
            plan_catchup(current, head, deltas=deltas, keyframes=keyframes)
        return
    plan = plan_catchup(current, head, deltas=deltas, keyframes=keyframes)
    assert (plan.total_bytes, len(plan.steps)) == want
    # the steps really link current to head through offered edges
    at = current
    for i, s in enumerate(plan.steps):
        if s.kind == "keyframe":
            assert s.source is None and keyframes.get(s.target) == s.size
        else:
            assert s.kind == "delta" and s.source == at and deltas.get((s.source, s.target)) == s.size
        at = s.target
    assert at == head
    # a keyframe, if any, is the first step (nothing before a full state is worth fetching)
    assert all(s.kind == "delta" for s in plan.steps[1:])


# -- the parent-chain walk -----------------------------------------------------------------------------------------

import asyncio  # noqa: E402

from deltasync.manifest import BlobRef, Manifest  # noqa: E402
from deltasync.planner import ChainWalk, walk_parents  # noqa: E402


def _m(v: int, parent: int | None, kind: str = "delta") -> Manifest:
    return Manifest(model="m", version=v, parent=parent, kind=kind, tensors=(), blobs=(BlobRef(id=f"b{v}", size=1),),
                    state_fp="0" * 16)


def _linear(a: int, b: int, keyframe_at: int | None = None) -> dict[int, Manifest]:
    return {v: _m(v, None if v == keyframe_at else v - 1, "keyframe" if v == keyframe_at else "delta")
            for v in range(a, b + 1)}


WALKS = [
    # (id, servers' manifests, top, floor, limit, expected chain (top down), reason, at most this many rounds)
    ("one-behind-known-head", _linear(0, 10), 10, 9, 256, [10], "floor", 1),
    ("forty-behind", _linear(0, 60), 60, 20, 256, list(range(60, 20, -1)), "floor", 7),
    ("stops-at-keyframe", _linear(0, 30, keyframe_at=25), 30, None, 256, [30, 29, 28, 27, 26, 25], "keyframe", 3),
    ("gap-stops-the-walk", {**_linear(0, 3), **_linear(7, 12)}, 12, 0, 256, [12, 11, 10, 9, 8, 7], "missing", 4),
    ("skipping-parents", {10: _m(10, 6), 6: _m(6, 2), 2: _m(2, 0), 0: _m(0, None, "keyframe")}, 10, None, 256,
     [10, 6, 2, 0], "keyframe", 4),
    ("limit", _linear(0, 100), 100, None, 10, list(range(100, 90, -1)), "limit", 3),
    ("down-to-the-root", {0: _m(0, None), 1: _m(1, 0)}, 1, None, 256, [1, 0], "root", 2),
    ("top-missing", _linear(0, 3), 5, 0, 256, [], "missing", 1),
    ("floor-at-top", _linear(0, 3), 3, 3, 256, [], "floor", 0),
]


@pytest.mark.parametrize("case", WALKS, ids=[c[0] for c in WALKS])
def test_chain_walk(case):
    _, servers, top, floor, limit, expected, reason, max_rounds = case
    known = {top: servers[top]} if case[0] == "one-behind-known-head" else None  # the head answer carried it
    walk = ChainWalk(top, floor=floor, limit=limit, known=known)
    rounds = 0
    while not walk.done:
        wanted = walk.wanted()
        assert wanted and len(set(wanted)) == len(wanted)
        assert all(floor is None or v > floor for v in wanted)
        rounds += 1
        for v in wanted:
            if v in servers:
                walk.add(v, servers[v])
            else:
                walk.missing(v)
    assert [m.version for m in walk.chain] == expected
    assert walk.reason == reason
    assert rounds <= max_rounds
    assert walk.reaches_floor == (reason == "floor" and floor is not None and walk.cursor == floor)


def test_walk_parents_fetches_each_window_concurrently():
    servers = _linear(0, 60)
    in_flight, peak, calls = 0, 0, 0

    async def fetch(v: int):
        nonlocal in_flight, peak, calls
        calls += 1
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0)
        in_flight -= 1
        return servers.get(v)

    walk = asyncio.run(walk_parents(fetch, 60, floor=20))
    assert [m.version for m in walk.chain] == list(range(60, 20, -1)) and walk.reaches_floor
    assert peak >= 8  # not one request per version behind
    assert calls == 40  # and nothing below the floor


def test_walk_parents_passes_fetch_errors_through():
    servers = _linear(0, 5)

    async def fetch(v: int):
        if v == 3:
            raise NotFoundError("boom")
        return servers[v]

    async def main():
        return await walk_parents(fetch, 5, floor=0)

    with pytest.raises(NotFoundError, match="boom"):
        asyncio.run(main())
