"""Issue 9: hedged, bounded reads. A first source that accepts TCP and never answers costs a few seconds, not a
read timeout each time its cool-down ends (the issue measured 66 s for ``subscribe --once``).

The hedged loop itself runs on fake attempts (pure timing); the rest on a real origin (LocalCluster, subprocesses)
behind a "stalled" listener: a socket that completes TCP handshakes (kernel backlog) and never reads or answers."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest
import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.client.http import HttpClient, Timeouts, shared_failover
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.errors import UpstreamError, UpstreamTimeout
from deltasync.failover import Backoff, Failover
from deltasync.retry import SlowerThanHedge, answering, first_source
from deltasync.tensorfile import read_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same
from cluster_support import origin_only, publish_trace

KEY = bytes(range(7, 39))
SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)


# -- the hedged loop (core, fake sources) --------------------------------------------------------------------

def _outage(e: BaseException) -> bool:
    return isinstance(e, (UpstreamError, TimeoutError))


async def test_a_silent_first_source_is_hedged_and_marked_down():
    policy = Failover(["a", "b"], backoff=Backoff(base=5, cap=60))
    started = {}

    async def attempt(src: str) -> str:
        started[src] = time.monotonic()
        if src == "a":
            await asyncio.sleep(30)  # accepts, never answers
        answering()
        return src

    t0 = time.monotonic()
    assert await first_source(policy, attempt, what="x", outage=_outage, hedge_after=0.2) == "b"
    took = time.monotonic() - t0
    assert 0.15 < started["b"] - t0 < 0.5 and took < 0.6, (started, took)
    assert policy.failures("a") == 1 and policy.failures("b") == 0
    assert policy.order(time.monotonic()) == ["b", "a"]  # every later request starts at b while a cools down
    assert "no answer" in policy.health(time.monotonic())[0].why


async def test_a_source_that_has_begun_to_answer_is_not_hedged():
    policy = Failover(["a", "b"], backoff=Backoff(base=5, cap=60))
    asked = []

    async def attempt(src: str) -> str:
        asked.append(src)
        answering()  # status line in; the body takes its time
        await asyncio.sleep(0.5)
        return src

    assert await first_source(policy, attempt, what="x", outage=_outage, hedge_after=0.05) == "a"
    assert asked == ["a"]


async def test_a_failure_starts_the_next_source_at_once_and_answers_propagate():
    policy = Failover(["a", "b", "c"], backoff=Backoff(base=5, cap=60))

    async def attempt(src: str) -> str:
        if src == "a":
            raise UpstreamError("down")
        if src == "b":
            raise UpstreamTimeout("silent")
        return src

    t0 = time.monotonic()
    assert await first_source(policy, attempt, what="x", outage=_outage, hedge_after=5) == "c"
    assert time.monotonic() - t0 < 1

    async def refused(src: str) -> str:
        raise ValueError("an answer, not an outage")

    with pytest.raises(ValueError):
        await first_source(Failover(["a", "b"], backoff=Backoff(base=1, cap=1)), refused, what="x", outage=_outage,
                           hedge_after=5)

    async def all_silent(src: str) -> str:
        await asyncio.sleep(0.3)
        raise UpstreamTimeout(f"{src}: no answer")

    with pytest.raises(UpstreamTimeout, match="every source timed out"):
        await first_source(Failover(["a", "b"], backoff=Backoff(base=1, cap=1)), all_silent, what="x",
                           outage=_outage, hedge_after=0.1)
    assert issubclass(SlowerThanHedge, UpstreamTimeout)


def test_one_policy_per_process_and_url_list():
    a = HttpClient(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    b = HttpClient(["http://127.0.0.1:1/", "http://127.0.0.1:2"])
    assert a.failover is b.failover is shared_failover(a.urls, cooldown=a.timeouts.cooldown)
    assert HttpClient(["http://127.0.0.1:2", "http://127.0.0.1:1"]).failover is not a.failover
    own = Failover(a.urls, backoff=Backoff(base=1, cap=1))
    assert HttpClient(a.urls, failover=own).failover is own
    with pytest.raises(ValueError, match="sources"):
        HttpClient(["http://127.0.0.1:3"], failover=own)
    with pytest.raises(ValueError, match="ttfb"):
        Timeouts(ttfb=0)


# -- on real servers ------------------------------------------------------------------------------------------

@pytest.fixture()
def stalled():
    """A listener that completes handshakes and never answers (not even accept())."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(512)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with origin_only(tmp_path_factory.mktemp("hedge"), KEY) as c:
        yield c


@pytest.fixture(scope="module")
def published(cluster):
    return publish_trace(cluster, "hd", SHAPE, KEY, seed=41, steps=3)


def _subscribe_once(cluster, sources: list[str], out, *extra: str) -> float:
    """Seconds one ``subscribe --once`` process took (interpreter start included)."""
    args = [a for src in sources for a in ("--from", src)]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "deltasync.client.cli", "subscribe", *args, "--model", "hd",
                        "--key-file", str(cluster.key_file), "--out", str(out), "--once", "--timeout", "120", *extra],
                       capture_output=True, text=True, timeout=180)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    return took


@pytest.mark.long
def test_subscribe_once_behind_a_stalled_first_source_takes_seconds(cluster, published, stalled, tmp_path):
    """The issue's 66 s (137 s on main on this loaded machine, against 17 s from the origin alone): now bounded
    by the hedge (default 2 s). Compared with a run from the origin alone, in the same test (the machine's load
    makes absolute times meaningless)."""
    control = _subscribe_once(cluster, [cluster.origin], tmp_path / "control.safetensors")
    out = tmp_path / "out.safetensors"
    took = _subscribe_once(cluster, [stalled, cluster.origin], out)
    assert _same(read_state_file(out), published[-1])
    assert took < control + 12, (took, control)


@pytest.mark.long
def test_without_hedging_the_ttfb_limit_bounds_each_stall(cluster, published, stalled, tmp_path):
    control = _subscribe_once(cluster, [cluster.origin], tmp_path / "control.safetensors")
    out = tmp_path / "out.safetensors"
    took = _subscribe_once(cluster, [stalled, cluster.origin], out, "--hedge-after", "0", "--ttfb-timeout", "2")
    assert _same(read_state_file(out), published[-1])
    assert took < control + 12, (took, control)


def test_a_following_subscriber_gets_new_versions_promptly_behind_a_stall(cluster, published, stalled):
    target = {n: torch.zeros_like(t) for n, t in published[-1].items()}
    sub = ThreadedSubscriber([stalled, cluster.origin], "hd", target, verifier=KEY,
                             timeouts=Timeouts(poll=5, ttfb=3, hedge_after=0.5, cooldown=2))
    try:
        sub.start()
        assert sub.wait_version(2, 20) == 2
        trace = RLTrace(SHAPE, lr=1e-4, seed=42)
        nxt = [trace.step() for _ in range(2)]
        lags = []
        with Publisher(cluster.origin, "hd2", cluster.token, KEY, keyframe_every=0) as pub:
            pub.publish(0, nxt[0])
            pub.flush(60)
        # a second stream through the same URL list: the shared policy already knows the stall
        t2 = {n: torch.zeros_like(t) for n, t in nxt[0].items()}
        sub2 = ThreadedSubscriber([stalled, cluster.origin], "hd2", t2, verifier=KEY,
                                  timeouts=Timeouts(poll=5, ttfb=3, hedge_after=0.5, cooldown=2))
        try:
            t0 = time.monotonic()
            sub2.start()
            assert sub2.wait_version(0, 20) == 0
            lags.append(time.monotonic() - t0)
            with Publisher(cluster.origin, "hd2", cluster.token, KEY, keyframe_every=0) as pub:
                t0 = time.monotonic()
                pub.publish(1, nxt[1])
                pub.flush(60)
            assert sub2.wait_version(1, 30) == 1
            lags.append(time.monotonic() - t0)
            assert _same(t2, nxt[1])
        finally:
            sub2.close()
        assert max(lags) < 10, lags
        assert _same(target, published[-1])
    finally:
        sub.close()


async def test_a_relay_behind_a_stalled_first_parent_follows_the_next_within_the_ttfb_bound(tmp_path, stalled):
    """The relay's event stream, manifest and blob reads from a parent that never answers fail over after the
    TTFB limit (2 s here), and manifest reads are hedged: a version published on the origin reaches the relay."""
    from server_fixtures import KEY as SKEY, TOKEN, keyframe, make_blob, origin, publish, relay, session, start_all, \
        stop_all, wait_for

    (tmp_path / "token").write_text(TOKEN)
    o = origin(tmp_path, "o", "--no-fsync", key=True)
    r = relay(tmp_path, "r", [stalled, o.url], "--no-fsync", "--ttfb-timeout", "2", "--hedge-after", "0.5", key=True)
    start_all(o, r)
    try:
        async with session() as s:
            blobs = [make_blob(5000, 3)]
            t0 = time.monotonic()
            await publish(s, o.url, keyframe("st", 0, blobs, key=SKEY), blobs)

            async def announced():
                async with s.get(f"{r.url}/v1/models/st/head") as resp:
                    return resp.status == 200
            await wait_for(announced, 30, interval=0.2, what="the relay to announce v0")
            took = time.monotonic() - t0
            async with s.get(f"{r.url}/v1/blobs/{blobs[0][0]}") as resp:
                assert resp.status == 200 and await resp.read() == blobs[0][1]
        assert took < 12, took
    finally:
        assert stop_all(r, o) == [0, 0], [r.log()[-3000:], o.log()[-3000:]]
