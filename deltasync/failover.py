"""The one failover policy: ordered sources, per-source health, exponential cool-down.

Pure logic: the caller passes the clock (``now``, seconds on any monotonic scale),
nothing here sleeps or touches the network. Used by the client's ``HttpClient``
(its URLs), and by a relay's ``Upstream`` (its parents).

A source that fails is put in a cool-down of ``backoff.delay(n)`` seconds, ``n``
being its consecutive failures (doubling from ``backoff.base`` up to
``backoff.cap``). A failure reported while the source is already cooling down (several
requests failed at once) does not lengthen it. ``order(now)`` lists the healthy
sources in preference order, then the cooling ones soonest-back first: a cooling
source is still tried, last, rather than giving up. ``succeeded`` makes a source
healthy again at once, so a preferred source is back in front as soon as it answers.

Thread-safe (a lock guards each call, nothing waits under it): one policy is meant to be
shared by every request of a process that talks to the same sources, so a source that
stalled one request is skipped by all of them while it cools down (the client's
``shared_failover``), even across the event loops of several subscribers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """The one back-off table: ``base * 2**(n-1)`` seconds after the n-th failure in a row, at most ``cap``."""

    base: float
    cap: float

    def __post_init__(self) -> None:
        if self.base < 0 or self.cap < self.base:
            raise ValueError(f"a back-off needs 0 <= base <= cap, found base={self.base} cap={self.cap}")

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row (0 for none)."""
        if failures <= 0:
            return 0.0
        return min(self.base * 2.0 ** min(failures - 1, 64), self.cap)


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceHealth:
    """One source as the policy sees it at a moment."""

    source: str
    failures: int  # consecutive failures; 0 = healthy
    cooling_until: float  # 0.0 when not cooling down
    why: str = ""  # what the last failure was


class Failover:
    """Ordered sources with per-source health. ``sources`` are most preferred first."""

    def __init__(self, sources: Sequence[str], *, backoff: Backoff) -> None:
        if not sources:
            raise ValueError("failover needs at least one source")
        if len(set(sources)) != len(sources):
            raise ValueError(f"sources must be distinct, found {list(sources)}")
        self.sources: tuple[str, ...] = tuple(sources)
        self.backoff = backoff
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}
        self._why: dict[str, str] = {}
        self._lock = threading.Lock()

    def _check(self, source: str) -> None:
        if source not in self.sources:
            raise KeyError(f"{source!r} is not one of the sources {list(self.sources)}")

    def cooling(self, source: str, now: float) -> bool:
        return self._until.get(source, 0.0) > now

    def order(self, now: float, *, rotate: int = 0, proven_first: bool = False) -> list[str]:
        """Sources to try, in order: healthy ones by preference, then cooling ones, soonest back first.

        ``rotate`` starts the healthy list further down (to avoid, say, a source whose bytes just
        failed their hash check). ``proven_first`` puts healthy sources that have not failed since
        their last success ahead of those whose cool-down ended but have not answered well since
        (for requests that are slow by design, such as long-polls, where a stall costs the most)."""
        with self._lock:
            return self._order(now, rotate, proven_first)

    def _order(self, now: float, rotate: int, proven_first: bool) -> list[str]:
        healthy = [s for s in self.sources if not self.cooling(s, now)]
        if healthy and rotate:
            k = rotate % len(healthy)
            healthy = healthy[k:] + healthy[:k]
        if proven_first:
            healthy.sort(key=lambda s: self._failures.get(s, 0) > 0)  # stable: preference kept within each
        cooling = sorted((s for s in self.sources if self.cooling(s, now)), key=lambda s: self._until[s])
        return healthy + cooling

    def failed(self, source: str, now: float, why: str = "") -> float | None:
        """Record a failure. Returns the cool-down it started, or None when the source was already
        cooling down (the failure is then not counted again)."""
        self._check(source)
        with self._lock:
            if self.cooling(source, now):
                return None
            n = self._failures[source] = self._failures.get(source, 0) + 1
            delay = self.backoff.delay(n)
            self._until[source] = now + delay
            self._why[source] = why
            return delay

    def succeeded(self, source: str) -> bool:
        """Record a success; the source is healthy again. Returns whether it had been failing."""
        self._check(source)
        with self._lock:
            self._until.pop(source, None)
            self._why.pop(source, None)
            return self._failures.pop(source, None) is not None

    def failures(self, source: str) -> int:
        return self._failures.get(source, 0)

    def health(self, now: float) -> list[SourceHealth]:
        """Every source's state, in preference order."""
        with self._lock:
            return self._health(now)

    def _health(self, now: float) -> list[SourceHealth]:
        return [SourceHealth(source=s, failures=self._failures.get(s, 0),
                             cooling_until=self._until[s] if self.cooling(s, now) else 0.0, why=self._why.get(s, ""))
                for s in self.sources]
