"""Issue 27, indefinite freeze / replayed head (TUF): a mirror that answers head reads and long-polls at once with
the validly signed manifest of an old version while the origin is ahead. ``subscribe --once`` must end at the
origin's head; a subscriber following that mirror alone must back off (it used to ask ~400 times a second).

The machine's decisions are table-tested (pure); the rest runs ``deltasync subscribe`` processes against a real
origin behind a real TCP mirror (``hostile_peers.HostilePeer``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from deltasync import syncmachine as sm
from deltasync.tensorfile import read_state_file
from deltasync.testing.trace import ModelShape
from core_support import same_state as _same
from hostile_peers import PROXY, Fixed, HostilePeer
from cluster_support import origin_only, publish_trace

KEY = bytes(range(21, 53))
SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)


# -- the machine (pure) ---------------------------------------------------------------------------------------

def _polling(live: int = 3) -> tuple[sm.SyncMachine, sm.PollHead]:
    m = sm.SyncMachine(sm.SyncConfig(model="m", backoff_min=0.2, backoff_max=5.0))
    (check,) = m.send(sm.Started(trusted=live))
    (poll,) = m.send(sm.InitialChecked(ticket=check.ticket, ok=True))
    assert isinstance(poll, sm.PollHead) and poll.after == live and not poll.probe
    return m, poll


@pytest.mark.parametrize("answers,waits", [
    ([True], [0.2]),
    ([True, True, True], [0.2, 0.4, 0.8]),
    ([True] * 8, [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]),  # capped: a replaying source costs < 1 request/s
    ([True, True, False, True], [0.2, 0.4, None, 0.2]),  # a held long-poll (a live source) resets the back-off
    ([False, False], [None, None]),  # the usual long-poll that ran out: ask again at once
])
def test_an_old_head_at_once_backs_off_and_probes_the_others(answers, waits):
    m, poll = _polling()
    for early, wait in zip(answers, waits):
        out = m.send(sm.HeadSeen(ticket=poll.ticket, stream="m", version=3, early=early))
        if wait is None:
            (poll,) = out
            assert isinstance(poll, sm.PollHead) and not poll.probe
            continue
        notify, w = out
        assert isinstance(notify, sm.Notify) and notify.kind == "stale" and isinstance(w, sm.Wait)
        assert w.seconds == pytest.approx(wait)
        (poll,) = m.send(sm.Woke(ticket=w.ticket))
        assert isinstance(poll, sm.PollHead) and poll.after == 3 and poll.probe  # the others are asked first


def test_a_newer_head_after_early_answers_is_followed_and_resets_the_back_off():
    m, poll = _polling()
    _, w = m.send(sm.HeadSeen(ticket=poll.ticket, stream="m", version=3, early=True))
    (poll,) = m.send(sm.Woke(ticket=w.ticket))
    (walk,) = m.send(sm.HeadSeen(ticket=poll.ticket, stream="m", version=5))
    assert isinstance(walk, sm.WalkChain) and walk.top == 5
    assert m._backoff == pytest.approx(0.2)


# -- on real servers ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with origin_only(tmp_path_factory.mktemp("fresh"), KEY) as c:
        yield c


@pytest.fixture(scope="module")
def published(cluster):
    return publish_trace(cluster, "fr", SHAPE, KEY, seed=5, steps=5)


def _replaying(cluster, version: int):
    """A plan: every head read and long-poll of ``fr`` answered at once with v``version``'s signed manifest."""
    with urllib.request.urlopen(f"{cluster.origin}/v1/models/fr/versions/{version}", timeout=10) as r:
        old = r.read()

    def plan(method: str, target: str) -> object:
        if target.startswith("/v1/models/fr/head"):
            return Fixed(200, {"Content-Type": "application/json", "X-Deltasync-Version": str(version)}, old)
        return PROXY
    return plan


def _cmd(cluster, sources, out, *extra):
    args = [a for s in sources for a in ("--from", s)]
    return [sys.executable, "-m", "deltasync.client.cli", "subscribe", *args, "--model", "fr",
            "--key-file", str(cluster.key_file), "--out", str(out), *extra]


def test_once_behind_a_mirror_replaying_an_old_head_ends_at_the_origins_head(cluster, published, tmp_path):
    with HostilePeer(cluster.origin, _replaying(cluster, 2)) as mirror:
        out = tmp_path / "out.safetensors"
        r = subprocess.run(_cmd(cluster, [mirror.url, cluster.origin], out, "--once", "--timeout", "60"),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert _same(read_state_file(out), published[-1])  # v4, not the mirror's v2
        assert mirror.count(lambda m, t: t.startswith("/v1/models/fr/head")) >= 1


def test_following_a_replaying_mirror_alone_backs_off(cluster, published, tmp_path):
    with HostilePeer(cluster.origin, _replaying(cluster, 2)) as mirror:
        out = tmp_path / "out.safetensors"
        p = subprocess.Popen(_cmd(cluster, [mirror.url], out, "--poll", "5"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not (out.exists() and mirror.count(lambda m, t: "after=" in t) >= 1):
                assert p.poll() is None and time.monotonic() < deadline, p.communicate(timeout=5)
                time.sleep(0.1)
            since = time.monotonic()
            time.sleep(10)
            n = mirror.count(lambda m, t: t.startswith("/v1/models/fr/head"), since=since)
            assert n < 2 * 10, n  # the issue measured ~400 requests/s
            assert p.poll() is None
        finally:
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=20)
        assert _same(read_state_file(out), published[2])  # what the mirror can prove, no more
