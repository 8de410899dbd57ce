"""The store's retention window and LRU budget policy (server/storage/retention.py), as tables: no I/O."""

from __future__ import annotations

import pytest

from deltasync.server.storage.retention import BlobLedger, Eviction, plan_eviction, retention_window


@pytest.mark.parametrize("order, head, keyframe, retention, expected", [
    ([], None, None, 4, []),                              # nothing announced
    ([1, 2, 3], None, None, 4, []),                       # stored but never announced: nothing pinned
    ([1, 2, 3], 3, 1, 4, [1, 2, 3]),                      # fewer than retention
    ([1, 2, 3, 4, 5], 5, 1, 2, [1, 4, 5]),                # newest two, plus the older keyframe first
    ([1, 2, 3, 4, 5], 5, 4, 2, [4, 5]),                   # keyframe already inside the window
    ([1, 2, 3, 4, 5], 3, 1, 2, [1, 2, 3]),                # versions above head are not pinned yet
    ([1, 2, 3, 4, 5], 3, None, 1, [3]),                   # no keyframe known
    ([2, 5, 9], 9, None, 2, [5, 9]),                      # gaps in the version numbers
    ([2, 5, 9], 6, None, 2, [2, 5]),                      # head between stored versions
])
def test_retention_window(order, head, keyframe, retention, expected):
    assert retention_window(order, head=head, newest_keyframe=keyframe, retention=retention) == expected


LRU = [("a", 100), ("b", 200), ("c", 300), ("d", 400)]  # least recently used first


@pytest.mark.parametrize("need, protected, victims, freed, over", [
    (0, set(), (), 0, False),                   # nothing needed: nothing evicted
    (-50, set(), (), 0, False),
    (1, set(), ("a",), 100, False),             # oldest first
    (100, set(), ("a",), 100, False),           # exactly enough
    (101, set(), ("a", "b"), 300, False),
    (150, {"a"}, ("b",), 200, False),           # protected ones are skipped, not counted
    (450, {"b", "c"}, ("a", "d"), 500, False),
    (600, {"b", "c"}, ("a", "d"), 500, True),   # everything unprotected gone, still short
    (10, {"a", "b", "c", "d"}, (), 0, True),    # all protected: over budget, nothing dropped
    (1000, set(), ("a", "b", "c", "d"), 1000, False),
])
def test_plan_eviction(need, protected, victims, freed, over):
    assert plan_eviction(LRU, need=need, protected=protected) == Eviction(victims=victims, freed=freed,
                                                                          over_budget=over)


def _ledger(budget: int | None) -> BlobLedger:
    led = BlobLedger(budget=budget)
    for bid, size in LRU:
        led.add(bid, size)
    return led


@pytest.mark.parametrize("steps, incoming, victims, over", [
    ([], 0, (), False),                                         # 1000 of 1000: fits
    ([], 1, ("a",), False),
    ([("touch", "a")], 1, ("b",), False),                       # a touched: b is now the oldest
    ([("pin", {"a", "b"})], 250, ("c",), False),
    ([("lease", ["a"])], 1, ("b",), False),
    ([("lease", ["a"]), ("lease", ["a"]), ("unlease", ["a"])], 1, ("b",), False),  # leases count
    ([("lease", ["a"]), ("unlease", ["a"])], 1, ("a",), False),
    ([("reserve", 300)], 0, ("a", "b"), False),                 # reserved bytes count as used
    ([("reserve", 300), ("release", 300)], 0, (), False),
    ([("release", 50)], 0, (), False),                          # releasing more than reserved: floor 0
    ([("drop", "d")], 500, ("a",), False),                      # 600 used + 500 incoming: free 100
    ([("pin", {"a", "b", "c", "d"})], 1, (), True),
])
def test_ledger_plan(steps, incoming, victims, over):
    led = _ledger(1000)
    for op, arg in steps:
        {"touch": led.touch, "pin": led.set_pins, "lease": led.lease, "unlease": led.unlease,
         "reserve": led.reserve, "release": led.release, "drop": led.drop}[op](arg)
    plan = led.plan(incoming)
    assert (plan.victims, plan.over_budget) == (victims, over)


def test_ledger_accounting():
    led = _ledger(None)
    assert led.plan(10**12) == Eviction()  # no budget: never evicts
    assert len(led) == 4 and led.used == 1000 and "c" in led and led.size("c") == 300
    led.add("c", 300)  # adding again only marks it recently used
    assert led.used == 1000 and list(b for b, _ in plan_order(led)) == ["a", "b", "d", "c"]
    assert led.drop("zz") == 0 and led.drop("b") == 200 and led.used == 800 and "b" not in led
    led.set_pins({"a", "zz"})
    assert led.pinned_bytes == 100  # pins of absent blobs weigh nothing


def plan_order(led: BlobLedger):
    led.budget = 0
    order = led.plan(0).victims
    led.budget = None
    return [(b, led.size(b)) for b in order]
