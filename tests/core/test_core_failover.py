"""The one failover policy and the retry helpers, table-tested with a clock we pass in: no socket, no sleep."""

from __future__ import annotations

import asyncio

import pytest

from deltasync.errors import (
    FormatError,
    IntegrityError,
    NotFoundError,
    SignatureError,
    UpstreamError,
    UpstreamTimeout,
)
from deltasync.failover import Backoff, Failover
from deltasync.retry import describe, first_source, retry

B = Backoff(base=5.0, cap=60.0)


@pytest.mark.parametrize("failures, delay", [(0, 0.0), (1, 5.0), (2, 10.0), (3, 20.0), (4, 40.0), (5, 60.0),
                                             (6, 60.0), (1000, 60.0)])
def test_backoff_doubles_up_to_the_cap(failures, delay):
    assert B.delay(failures) == delay


@pytest.mark.parametrize("base, cap", [(-1.0, 1.0), (2.0, 1.0)])
def test_backoff_refuses_a_table_that_makes_no_sense(base, cap):
    with pytest.raises(ValueError, match="base"):
        Backoff(base=base, cap=cap)


# (events, now, expected order): an event is ("fail", source, at) or ("ok", source)
@pytest.mark.parametrize("events, now, order", [
    ([], 0.0, ["a", "b", "c"]),
    ([("fail", "a", 0.0)], 1.0, ["b", "c", "a"]),  # a cools down 5 s, still tried last
    ([("fail", "a", 0.0)], 5.0, ["a", "b", "c"]),  # cool-down over: back in front
    ([("fail", "a", 0.0), ("fail", "b", 1.0)], 2.0, ["c", "a", "b"]),  # cooling ones: soonest back first
    ([("fail", "b", 0.0), ("fail", "a", 1.0)], 2.0, ["c", "b", "a"]),
    ([("fail", "a", 0.0), ("fail", "a", 6.0)], 15.0, ["b", "c", "a"]),  # 2nd in a row: 10 s, until 16
    ([("fail", "a", 0.0), ("fail", "a", 6.0)], 16.0, ["a", "b", "c"]),
    ([("fail", "a", 0.0), ("fail", "a", 2.0)], 5.0, ["a", "b", "c"]),  # a failure while cooling is not counted
    ([("fail", "a", 0.0), ("fail", "a", 6.0), ("ok", "a")], 7.0, ["a", "b", "c"]),  # success: healthy at once
    ([("fail", "a", 0.0), ("fail", "b", 0.0), ("fail", "c", 0.0)], 1.0, ["a", "b", "c"]),  # all cooling: all tried
])
def test_order_after_failures(events, now, order):
    f = Failover(["a", "b", "c"], backoff=B)
    for ev in events:
        if ev[0] == "fail":
            f.failed(ev[1], ev[2], "x")
        else:
            f.succeeded(ev[1])
    assert f.order(now) == order


def test_failed_reports_the_cooldown_and_health_tells_the_state():
    f = Failover(["a", "b"], backoff=B)
    assert f.failed("a", 0.0, "refused") == 5.0
    assert f.failed("a", 1.0, "again") is None  # already cooling: not counted
    assert f.failed("a", 5.0, "timed out") == 10.0
    assert f.failures("a") == 2 and f.cooling("a", 14.9) and not f.cooling("a", 15.0)
    h = {s.source: s for s in f.health(6.0)}
    assert h["a"].failures == 2 and h["a"].cooling_until == 15.0 and h["a"].why == "timed out"
    assert h["b"].failures == 0 and h["b"].cooling_until == 0.0
    assert f.succeeded("a") is True and f.succeeded("a") is False
    assert f.failed("a", 20.0) == 5.0  # the count started over


@pytest.mark.parametrize("rotate, order", [(0, ["a", "b", "c"]), (1, ["b", "c", "a"]), (2, ["c", "a", "b"]),
                                           (4, ["b", "c", "a"])])
def test_rotate_starts_the_healthy_list_further_down(rotate, order):
    assert Failover(["a", "b", "c"], backoff=B).order(0.0, rotate=rotate) == order


def test_rotate_leaves_cooling_sources_last():
    f = Failover(["a", "b", "c"], backoff=B)
    f.failed("b", 0.0)
    assert f.order(1.0, rotate=1) == ["c", "a", "b"]


def test_bad_sources_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        Failover([], backoff=B)
    with pytest.raises(ValueError, match="distinct"):
        Failover(["a", "a"], backoff=B)
    with pytest.raises(KeyError, match="not one of the sources"):
        Failover(["a"], backoff=B).failed("z", 0.0)


# -- first_source: the one per-source loop -----------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _outage(e: BaseException) -> bool:
    return isinstance(e, (UpstreamError, IntegrityError, FormatError, OSError, asyncio.TimeoutError))


async def _run(script: dict, *, keep=(), rotate=0, policy=None):
    """Each source does what ``script`` says: a value to return or an exception to raise."""
    policy = policy or Failover(list(script), backoff=B)
    tried: list[str] = []
    told: list[tuple[str, str, float | None]] = []

    async def attempt(src: str):
        tried.append(src)
        out = script[src]
        if isinstance(out, BaseException):
            raise out
        return out

    try:
        result = await first_source(policy, attempt, what="thing", outage=_outage, keep=keep, rotate=rotate,
                                    on_failure=lambda s, e, c: told.append((s, type(e).__name__, c)),
                                    clock=Clock())
    except Exception as e:
        result = e
    return result, tried, told, policy


@pytest.mark.parametrize("script, expect, tried", [
    ({"a": 1, "b": 2}, 1, ["a"]),
    ({"a": OSError("refused"), "b": 2}, 2, ["a", "b"]),
    ({"a": NotFoundError("no"), "b": 2}, 2, ["a", "b"]),  # behind its parent: ask the next
    ({"a": NotFoundError("no"), "b": NotFoundError("no")}, NotFoundError, ["a", "b"]),
    ({"a": NotFoundError("no"), "b": OSError("down")}, NotFoundError, ["a", "b"]),  # the one that answered said so
    ({"a": NotFoundError("no"), "b": IntegrityError("hashes to x")}, UpstreamError, ["a", "b"]),  # b has it
    ({"a": OSError("down"), "b": UpstreamError("502")}, UpstreamError, ["a", "b"]),
    ({"a": asyncio.TimeoutError(), "b": UpstreamTimeout("slow")}, UpstreamTimeout, ["a", "b"]),
    ({"a": OSError("down"), "b": asyncio.TimeoutError()}, UpstreamError, ["a", "b"]),
    ({"a": ValueError("a bug"), "b": 2}, ValueError, ["a"]),  # not an outage: raised at once
    ({"a": NotFoundError("no"), "b": SignatureError("forged")}, UpstreamError, ["a", "b"]),
])
async def test_first_source(script, expect, tried):
    result, seen, told, policy = await _run(script)
    assert seen == tried
    if isinstance(expect, type):
        assert type(result) is expect, result
    else:
        assert result == expect
    failed = [s for s, out in script.items() if s in seen and _outage(out) and not isinstance(out, NotFoundError)]
    assert [s for s, _, _ in told] == failed
    assert all(policy.cooling(s, 100.0) for s in failed)


async def test_first_source_message_names_every_failure_and_keeps_chosen_errors():
    result, _, _, _ = await _run({"a": OSError("refused"), "b": IntegrityError("content hashes to ff")})
    assert isinstance(result, UpstreamError)
    assert "thing" in str(result) and "a: OSError: refused" in str(result) and "hashes to ff" in str(result)
    result, _, _, _ = await _run({"a": OSError("down"), "b": SignatureError("forged")}, keep=(SignatureError,))
    assert isinstance(result, SignatureError) and str(result) == "forged"


async def test_first_source_marks_success_and_prefers_healthy_sources():
    policy = Failover(["a", "b"], backoff=B)
    policy.failed("a", 99.0)  # cooling at t=100
    result, tried, _, _ = await _run({"a": 1, "b": 2}, policy=policy)
    assert (result, tried) == (2, ["b"])
    policy = Failover(["a", "b"], backoff=B)
    policy.failed("a", 90.0)  # over by 100: a is asked first and, answering, is healthy again
    result, tried, _, _ = await _run({"a": 1, "b": 2}, policy=policy)
    assert (result, tried) == (1, ["a"]) and policy.failures("a") == 0


async def test_first_source_cooling_source_is_still_tried_last():
    policy = Failover(["a", "b"], backoff=B)
    policy.failed("a", 99.0)
    result, tried, told, _ = await _run({"a": 1, "b": OSError("down")}, policy=policy)
    assert (result, tried) == (1, ["b", "a"])
    assert told == [("b", "OSError", 5.0)]


async def test_first_source_rotate():
    result, tried, _, _ = await _run({"a": 1, "b": 2, "c": 3}, rotate=1)
    assert (result, tried) == (2, ["b"])


async def test_first_source_lets_cancellation_through():
    policy = Failover(["a", "b"], backoff=B)

    async def attempt(src: str):
        raise asyncio.CancelledError()

    with pytest.raises(asyncio.CancelledError):
        await first_source(policy, attempt, what="x", outage=_outage)
    assert policy.failures("a") == 0


# -- retry: the one helper that waits between attempts ----------------------------------------------

async def _retry(outcomes: list, *, attempts, again=lambda e: isinstance(e, OSError)):
    calls: list[int] = []
    waits: list[float] = []

    async def call():
        calls.append(len(calls))
        out = outcomes[min(len(calls) - 1, len(outcomes) - 1)]
        if isinstance(out, BaseException):
            raise out
        return out

    try:
        result = await retry(call, backoff=Backoff(base=0.001, cap=0.004), attempts=attempts, again=again,
                             on_retry=lambda n, e, d: waits.append(d))
    except Exception as e:
        result = e
    return result, len(calls), waits


@pytest.mark.parametrize("outcomes, attempts, expect, calls, waits", [
    (["ok"], 3, "ok", 1, []),
    ([OSError(), "ok"], 3, "ok", 2, [0.001]),
    ([OSError(), OSError(), "ok"], 3, "ok", 3, [0.001, 0.002]),
    ([OSError(), OSError(), OSError(), "ok"], 3, OSError, 3, [0.001, 0.002]),  # the last error propagates
    ([OSError()] * 5 + ["ok"], None, "ok", 6, [0.001, 0.002, 0.004, 0.004, 0.004]),  # forever, capped
    ([ValueError("answer"), "ok"], 3, ValueError, 1, []),  # not worth retrying: at once
    ([OSError()], 1, OSError, 1, []),
])
async def test_retry(outcomes, attempts, expect, calls, waits):
    result, n, seen = await _retry(outcomes, attempts=attempts)
    assert n == calls and seen == waits
    if isinstance(expect, type):
        assert isinstance(result, expect)
    else:
        assert result == expect


async def test_retry_refuses_zero_attempts():
    with pytest.raises(ValueError, match="attempts"):
        await retry(lambda: asyncio.sleep(0), backoff=Backoff(base=0, cap=0), attempts=0, again=lambda e: True)


@pytest.mark.parametrize("err, text", [
    (asyncio.TimeoutError(), "timed out"), (OSError("refused"), "OSError: refused"), (None, "no source answered"),
    (UpstreamTimeout("slow"), "UpstreamTimeout: slow"), (KeyError(), "KeyError"),
])
def test_describe(err, text):
    assert describe(err) == text
