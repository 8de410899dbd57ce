"""What a store keeps and what it may evict: the retention window and the LRU size budget.

Pure policy, no I/O. ``retention_window`` says which versions of a model pin their
blobs (the newest ``retention`` up to head, and the newest keyframe); ``plan_eviction``
picks the blobs to drop to make room, least recently used first, skipping every
protected one; ``BlobLedger`` keeps the accounting those decisions need (complete
blobs in LRU order with their sizes, pins, leases held by squash builds, and bytes
reserved for blobs being written). The store applies the decisions to its files.

When everything left is pinned or leased the plan says ``over_budget``: the store
then goes over its budget rather than refuse data it must serve.

Every byte a store keeps counts against its budget: blobs (evicted least recently
used first) and the small files beside them, manifests and squashed manifests
(``BlobLedger.meta``, not evicted by LRU: they leave by ``manifest_floor``). A store
that prunes its history (a relay) drops the manifests of versions below the floor:
no subscriber can still need them, since one that far behind catches up from the
newest keyframe, which is at or above the floor (docs/PROTOCOL.md §6.4).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Container, Iterable
from dataclasses import dataclass


def retention_window(order: list[int], *, head: int | None, newest_keyframe: int | None,
                     retention: int) -> list[int]:
    """The versions (of the sorted ``order``) whose blobs are pinned: the newest ``retention`` up to
    ``head``, preceded by the newest keyframe when it is older than those."""
    if head is None:
        return []
    hi = bisect.bisect_right(order, head)
    out = order[max(0, hi - retention):hi]
    if newest_keyframe is not None and newest_keyframe not in out:
        out = [newest_keyframe, *out]
    return out


def manifest_floor(order: list[int], *, head: int | None, newest_keyframe: int | None,
                   retention: int) -> int | None:
    """The oldest version whose manifest a pruning store keeps (None: keep all): the oldest version of the
    retention window, which is the newest keyframe whenever that is older than the newest ``retention``
    versions. Every version from the floor up to the head stays, so the chain from the newest keyframe to the
    head (and every squash built on it) can be walked; versions below it are gone (catch up from a keyframe)."""
    window = retention_window(order, head=head, newest_keyframe=newest_keyframe, retention=retention)
    if not window or newest_keyframe is None:
        return None  # no keyframe yet: a new subscriber needs the whole chain
    return window[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class Eviction:
    """A decision of the budget policy: drop ``victims`` (``freed`` bytes); ``over_budget`` if even that
    is not enough."""

    victims: tuple[str, ...] = ()
    freed: int = 0
    over_budget: bool = False


def plan_eviction(lru: Iterable[tuple[str, int]], *, need: int, protected: Container[str]) -> Eviction:
    """Free at least ``need`` bytes from ``lru`` ((id, size), least recently used first), never a protected id."""
    if need <= 0:
        return Eviction()
    victims: list[str] = []
    freed = 0
    for bid, size in lru:
        if freed >= need:
            break
        if bid in protected:
            continue
        victims.append(bid)
        freed += size
    return Eviction(victims=tuple(victims), freed=freed, over_budget=freed < need)


class _Protected:
    """``in`` over the pinned set and the leases, without building their union."""

    __slots__ = ("_pinned", "_leases")

    def __init__(self, pinned: Container[str], leases: Container[str]) -> None:
        self._pinned, self._leases = pinned, leases

    def __contains__(self, bid: object) -> bool:
        return bid in self._pinned or bid in self._leases


class BlobLedger:
    """The complete blobs of a store in least-recently-used order, and what protects them from eviction.

    Not thread-safe: the store uses it from the event loop only.
    """

    def __init__(self, *, budget: int | None) -> None:
        self.budget = budget
        self._sizes: OrderedDict[str, int] = OrderedDict()  # id -> size, least recently used first
        self.used = 0
        self.reserved = 0
        #: bytes of manifests and squashed manifests kept beside the blobs (counted, never LRU-evicted)
        self.meta = 0
        self.pinned: frozenset[str] = frozenset()
        self._leases: dict[str, int] = {}

    # -- the blobs ---------------------------------------------------------------------------
    def __contains__(self, bid: object) -> bool:
        return bid in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size(self, bid: str) -> int | None:
        return self._sizes.get(bid)

    def add(self, bid: str, size: int) -> None:
        """Count a complete blob (as the most recently used)."""
        if bid not in self._sizes:
            self._sizes[bid] = size
            self.used += size
        self._sizes.move_to_end(bid)

    def drop(self, bid: str) -> int:
        """Stop counting a blob; returns its size (0 if it was not counted)."""
        size = self._sizes.pop(bid, None)
        if size is None:
            return 0
        self.used -= size
        return size

    def touch(self, bid: str) -> None:
        if bid in self._sizes:
            self._sizes.move_to_end(bid)

    # -- protection ----------------------------------------------------------------------------
    def set_pins(self, pinned: Iterable[str]) -> None:
        self.pinned = frozenset(pinned)

    @property
    def pinned_bytes(self) -> int:
        return sum(self._sizes.get(b, 0) for b in self.pinned)

    def lease(self, ids: Iterable[str]) -> None:
        for b in ids:
            self._leases[b] = self._leases.get(b, 0) + 1

    def unlease(self, ids: Iterable[str]) -> None:
        for b in ids:
            n = self._leases.get(b, 0) - 1
            if n > 0:
                self._leases[b] = n
            else:
                self._leases.pop(b, None)

    def leased(self, bid: str) -> bool:
        return bid in self._leases

    def reserve(self, nbytes: int) -> None:
        self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved = max(0, self.reserved - nbytes)

    # -- the budget ----------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Every byte counted against the budget: blobs, manifests, and reservations for blobs being written."""
        return self.used + self.meta + self.reserved

    def plan(self, incoming: int, *, keep: str | None = None) -> Eviction:
        """What to evict so that ``incoming`` more bytes fit the budget (nothing, without a budget); ``keep``:
        a blob that must stay whatever its age (one just written)."""
        if self.budget is None:
            return Eviction()
        need = self.total + incoming - self.budget
        protected = _Protected(self.pinned, self._leases if keep is None else {**self._leases, keep: 1})
        return plan_eviction(self._sizes.items(), need=need, protected=protected)

    def plan_free(self, nbytes: int) -> Eviction:
        """What to evict to free ``nbytes`` whatever the budget (the disk itself is full): the oldest blobs
        that are neither pinned nor leased."""
        return plan_eviction(self._sizes.items(), need=nbytes, protected=_Protected(self.pinned, self._leases))
