"""The one retry helper and the one per-source loop, for every caller that talks to servers.

* :func:`first_source` asks the sources of a :class:`~deltasync.failover.Failover` in its
  order until one delivers: the client's reads (its URLs), a relay's manifest, HEAD
  and blob fetches and its event stream (its parents).
* :func:`retry` runs one call again after a back-off when it fails in a way the
  caller says is worth retrying: the client's writes, Range resumes of a cut
  blob, a relay's refetch of a blob and its prefetch rounds.

With ``hedge_after``, :func:`first_source` is *hedged*: when the source it asked has not
begun to answer within that many seconds (the attempt calls :func:`answering` once
it has a status line), the next source is asked in parallel; the first to deliver
wins, the others are cancelled, and a source that had not begun to answer by then is
marked failed like one that timed out (so every request of the process skips it
while it cools down).

Both take the caller's coroutine function; neither knows HTTP. Which errors are an
outage (try the next source / try again) and which are an answer (raise at once) is
the caller's ``outage`` predicate. ``asyncio.sleep`` is the only wait here.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .errors import DeltaSyncError, IntegrityError, NotFoundError, UpstreamError, UpstreamTimeout
from .failover import Backoff, Failover

T = TypeVar("T")

#: The back-off between retries of one call (writes, refetches, prefetch rounds).
RETRY_BACKOFF = Backoff(base=0.2, cap=2.0)
#: Resuming a cut transfer: at once, the bytes already in hand are kept.
RESUME_NOW = Backoff(base=0.0, cap=0.0)


#: set by a hedged :func:`first_source` in each attempt's task: the attempt's "I have begun to answer"
_ANSWERING: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("deltasync_answering", default=None)


def answering() -> None:
    """Tell a hedged :func:`first_source` that the current attempt's source has begun to answer
    (a status line arrived): no further source is started in parallel on its account. A no-op
    outside a hedged attempt."""
    ev = _ANSWERING.get()
    if ev is not None:
        ev.set()


class SlowerThanHedge(UpstreamTimeout):
    """A source that had not begun to answer when another source, asked after it, delivered."""


class FellBehind(UpstreamTimeout):
    """A source that answers, but sends its headers or body slower than the minimum rate (:class:`Pace`):
    the next source is asked (from the byte in hand, where the caller can resume), never this one again
    for the same transfer."""


#: A body must average at least this many bytes per second once its grace has passed (``Pace``).
DEFAULT_MIN_RATE = 64 << 10
#: Seconds a body may take before ``DEFAULT_MIN_RATE`` applies to it.
DEFAULT_RATE_GRACE = 10.0


class Pace:
    """The minimum rate of one transfer (a body, or an answer's headers): once ``grace`` seconds have
    passed since ``start``, at least ``min_rate`` bytes per second on average. Equivalently, with
    ``have`` bytes in hand the next byte is due by ``start + grace + have / min_rate``: a body of ``n``
    bytes has ``grace + n / min_rate`` seconds in all, and a source that falls behind is told by
    :meth:`check` (``FellBehind``), however often it sends a byte. Pure: the caller passes its clock."""

    __slots__ = ("min_rate", "grace", "start", "what")

    def __init__(self, *, min_rate: float, grace: float, start: float, what: str = "the body") -> None:
        if not min_rate > 0 or not grace > 0:
            raise ValueError(f"a pace needs a positive min_rate and grace, found {min_rate!r}, {grace!r}")
        self.min_rate, self.grace, self.start, self.what = float(min_rate), float(grace), start, what

    def due(self, have: int) -> float:
        """The time by which more than ``have`` bytes must be in."""
        return self.start + self.grace + have / self.min_rate

    def left(self, have: int, now: float) -> float:
        """Seconds until :meth:`due` (negative: behind)."""
        return self.due(have) - now

    def check(self, have: int, now: float) -> None:
        """FellBehind when ``have`` bytes at ``now`` is behind the pace."""
        if now > self.due(have):
            raise FellBehind(f"{self.what}: {have:,} bytes in {now - self.start:.1f} s, slower than the minimum of "
                             f"{self.min_rate:,.0f} B/s after a {self.grace:g} s grace; asking the next source")


def describe(e: BaseException | None) -> str:
    """A short one-line account of an error for logs and messages."""
    if e is None:
        return "no source answered"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) and not isinstance(e, DeltaSyncError):
        return "timed out"
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _timed_out(e: BaseException) -> bool:
    return isinstance(e, (asyncio.TimeoutError, TimeoutError, UpstreamTimeout))


async def first_source(policy: Failover, attempt: Callable[[str], Awaitable[T]], *, what: str,
                       outage: Callable[[BaseException], bool],
                       on_failure: Callable[[str, BaseException, float | None], None] | None = None,
                       keep: tuple[type[DeltaSyncError], ...] = (), rotate: int = 0,
                       clock: Callable[[], float] = time.monotonic, hedge_after: float | None = None,
                       proven_first: bool = False) -> T:
    """``await attempt(source)`` for each source in ``policy.order(clock())`` until one returns.

    * A result: the source is marked healthy and the result returned.
    * ``NotFoundError``: the next source is asked (one behind its parent may not have it yet),
      unless it is cooling down (failing: it would most likely cost a timeout to learn the same).
    * An error ``outage(e)`` accepts: the source is marked failed (``on_failure(source, e,
      cooldown)`` is told), the next one is asked.
    * Anything else (an answer such as a 4xx, a cancellation) propagates at once.

    When no source delivered: ``NotFoundError`` if some source said not found and none sent
    bytes that failed a check (the rest were down); else the last error if it is one of
    ``keep``; else ``UpstreamTimeout`` if every failure was a timeout; else ``UpstreamError``
    naming each source's failure.

    ``hedge_after`` (seconds): hedged, see the module docstring. ``proven_first``: see
    ``Failover.order``.
    """
    failures: list[tuple[str, BaseException]] = []
    not_found: list[NotFoundError] = []
    if hedge_after is not None:
        return await _hedged(policy, attempt, what=what, outage=outage, on_failure=on_failure, keep=keep,
                             rotate=rotate, clock=clock, hedge_after=hedge_after)
    for source in policy.order(clock(), rotate=rotate, proven_first=proven_first):
        if not_found and policy.cooling(source, clock()):
            break  # a source answered "not found": one that is failing is not worth a wait for the same
        try:
            result = await attempt(source)
        except NotFoundError as e:
            not_found.append(e)
            continue
        except BaseException as e:
            if not outage(e):
                raise
            failures.append((source, e))
            cooldown = policy.failed(source, clock(), describe(e))
            if on_failure is not None:
                on_failure(source, e, cooldown)
            continue
        policy.succeeded(source)
        return result
    _give_up(what, failures, not_found, keep)


def _give_up(what: str, failures: list[tuple[str, BaseException]], not_found: list[NotFoundError],
             keep: tuple[type[DeltaSyncError], ...]):
    """The error of a loop in which no source delivered (see ``first_source``)."""
    if not_found and not any(isinstance(e, IntegrityError) for _, e in failures):
        raise NotFoundError(f"{what}: not found on the sources that answered: "
                            + "; ".join(str(e) for e in not_found)) from not_found[-1]
    last = failures[-1][1] if failures else None
    if isinstance(last, keep):
        raise last
    listed = "; ".join(f"{source}: {describe(e)}" for source, e in failures)
    if failures and all(_timed_out(e) for _, e in failures):
        raise UpstreamTimeout(f"{what}: every source timed out: {listed}") from last
    raise UpstreamError(f"{what}: every source failed: {listed or 'no source answered'}") from last


async def _hedged(policy: Failover, attempt: Callable[[str], Awaitable[T]], *, what: str,
                  outage: Callable[[BaseException], bool],
                  on_failure: Callable[[str, BaseException, float | None], None] | None,
                  keep: tuple[type[DeltaSyncError], ...], rotate: int, clock: Callable[[], float],
                  hedge_after: float) -> T:
    """``first_source`` with a parallel attempt on the next source whenever none of those running has
    begun to answer within ``hedge_after`` seconds (or the last one started failed)."""
    queue = list(policy.order(clock(), rotate=rotate))
    failures: list[tuple[str, BaseException]] = []
    not_found: list[NotFoundError] = []
    running: dict[asyncio.Task, tuple[str, asyncio.Event]] = {}

    def fail(source: str, e: BaseException) -> None:
        failures.append((source, e))
        cooldown = policy.failed(source, clock(), describe(e))
        if on_failure is not None:
            on_failure(source, e, cooldown)

    def launch() -> None:
        source = queue.pop(0)
        answered = asyncio.Event()

        async def one() -> T:
            _ANSWERING.set(answered)  # this task's own context
            return await attempt(source)

        running[asyncio.ensure_future(one())] = (source, answered)

    launch()
    try:
        while running:
            waiting = queue and not any(ev.is_set() for _, ev in running.values())
            done, _ = await asyncio.wait(running, timeout=hedge_after if waiting else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:  # nobody has begun to answer (checked again: one may have since): ask the next too
                if not any(ev.is_set() for _, ev in running.values()):
                    launch()
                continue
            for task in done:
                source, _ = running.pop(task)
                if task.cancelled():
                    raise asyncio.CancelledError()
                e = task.exception()
                if e is None:
                    policy.succeeded(source)
                    for other, (slow, ev) in list(running.items()):
                        if not ev.is_set():  # started first, still silent while this one delivered
                            fail(slow, SlowerThanHedge(f"{slow}: no answer while {source} delivered {what}"))
                    return task.result()
                if isinstance(e, NotFoundError):
                    not_found.append(e)
                elif outage(e):
                    fail(source, e)
                else:
                    raise e
            if not_found:  # a source answered "not found": those failing are not worth a wait for the same
                queue[:] = [q for q in queue if not policy.cooling(q, clock())]
            if queue and not any(ev.is_set() for _, ev in running.values()):
                launch()  # a failure: the next source now, whatever the others are doing
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
    _give_up(what, failures, not_found, keep)


async def retry(call: Callable[[], Awaitable[T]], *, backoff: Backoff, attempts: int | None,
                again: Callable[[BaseException], bool],
                on_retry: Callable[[int, BaseException, float], None] | None = None) -> T:
    """``await call()``; when it raises an error ``again(e)`` accepts, wait ``backoff.delay(n)``
    (n = failures so far) and call again, at most ``attempts`` times in all (None: until it
    succeeds). The last error propagates; so does any error ``again`` refuses.
    ``on_retry(n, error, delay)`` is told before each wait."""
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be at least 1, found {attempts}")
    n = 0
    while True:
        try:
            return await call()
        except BaseException as e:
            n += 1
            if not again(e) or (attempts is not None and n >= attempts):
                raise
            delay = backoff.delay(n)
            if on_retry is not None:
                on_retry(n, e, delay)
        await asyncio.sleep(delay)
