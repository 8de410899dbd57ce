"""A history-coded stream (docs/FORMAT.md §4.5) through real servers: an origin and a relay (LocalCluster,
processes on 127.0.0.1), a Publisher with ``EncodeOptions(coding="history")`` and side keyframes, and
subscribers in this process: one that follows from the start, one that joins late (from a side keyframe), and
one that restarts at a version without its history (it resyncs from a keyframe, then follows), each bit for bit."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import SyncEvent, ThreadedSubscriber
from deltasync.codec import EncodeOptions
from deltasync.history import HISTORY_META
from deltasync.manifest import parse_manifest
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

# long: real server processes; `make test-long` (which .ci/run also runs), not `make test`
pytestmark = pytest.mark.long

KEY = bytes(range(7, 39))
SHAPE = ModelShape(vocab=256, hidden=32, layers=2, ffn=64)
HIST = EncodeOptions(coding="history")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("hist"), key=KEY)
    try:
        c.start_tree({"relay": ["origin"]})
        yield c
    finally:
        c.close()


def _manifest(cluster, model: str, v: int):
    return parse_manifest(urllib.request.urlopen(f"{cluster.origin}/v1/models/{model}/versions/{v}", timeout=10).read())


def _follow(cluster, model, states, version, events=None, **kw):
    target = {n: torch.zeros_like(t) for n, t in states[-1].items()}
    sub = ThreadedSubscriber(cluster.url("relay"), model, target, verifier=KEY,
                             on_event=(events.append if events is not None else None), **kw)
    sub.start()
    return sub, target


def test_history_coded_stream_is_followed_joined_late_and_resumed(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=31)
    states = [trace.step() for _ in range(12)]
    early_events: list[SyncEvent] = []
    early, early_target = _follow(cluster, "hist", states, 0, early_events)
    try:
        with Publisher(cluster.origin, "hist", cluster.token, KEY, keyframe_every=5, options=HIST) as pub:
            for v, s in enumerate(states[:8]):
                pub.publish(v, s)
                pub.flush(60)
            assert early.wait_version(7, 60) == 7
            assert _same(early_target, states[7])
            # the deltas are history-coded, since the last keyframe (v0, then the side keyframe at v5)
            metas = {v: _manifest(cluster, "hist", v).meta for v in range(1, 8)}
            assert all(m["deltasync.coding"] == "history" for m in metas.values())
            assert [metas[v][HISTORY_META] for v in range(1, 8)] == ["0:8"] * 5 + ["5:8"] * 2
            # a late joiner starts from the side keyframe at v5 and decodes the deltas after it
            late_events: list[SyncEvent] = []
            late, late_target = _follow(cluster, "hist", states, 7, late_events)
            try:
                assert late.wait_version(7, 60) == 7
                for v, s in enumerate(states[8:], 8):
                    pub.publish(v, s)
                pub.flush(60)
                assert early.wait_version(11, 60) == 11 and late.wait_version(11, 60) == 11
            finally:
                late.close()
        assert _same(early_target, states[11]) and _same(late_target, states[11])
        applied = [ev.version for ev in early_events if ev.kind == "applied"]
        assert applied == list(range(applied[0], 12)), applied  # walked every delta, none refused
        assert not [ev for ev in early_events if ev.kind in ("resync", "rolled-back")], early_events
        assert [ev.version for ev in late_events if ev.kind == "applied"][0] == 5  # the side keyframe
    finally:
        early.close()


@pytest.mark.parametrize("rebuild", [True, False])
def test_a_subscriber_without_the_history_takes_in_the_deltas_since_the_keyframe(cluster, rebuild, monkeypatch):
    """A target already at v3 (adopted: a restart with its state but no history) meets a delta coded since v0:
    it fetches v1..v3, takes them in and follows from v3; where that is more than it may fetch (REBUILD_MAX), it
    says so and resyncs from the side keyframe at v5 instead."""
    import deltasync.client.driver as driver

    model = f"hist2{'r' if rebuild else 'k'}"
    trace = RLTrace(SHAPE, lr=1e-4, seed=32)
    states = [trace.step() for _ in range(9)]
    with Publisher(cluster.origin, model, cluster.token, KEY, keyframe_every=5, options=HIST) as pub:
        for v, s in enumerate(states):
            pub.publish(v, s)
        pub.flush(60)
    if not rebuild:
        monkeypatch.setattr(driver, "REBUILD_MAX", 2)
    events: list[SyncEvent] = []
    target = {n: t.clone() for n, t in states[3].items()}
    sub = ThreadedSubscriber(cluster.url("relay"), model, target, verifier=KEY, on_event=events.append, version=3)
    try:
        sub.start()
        assert sub.wait_version(8, 60) == 8
    finally:
        sub.close()
    assert _same(target, states[8])
    applied = [ev.version for ev in events if ev.kind == "applied"]
    if rebuild:
        assert applied == [4, 5, 6, 7, 8], events
        assert not [ev for ev in events if ev.kind in ("resync", "error")], events
    else:
        errors = [ev for ev in events if ev.kind == "error"]
        assert errors and "history of the deltas since v0" in errors[0].detail, events
        assert any(ev.kind == "resync" for ev in events) and applied[0] == 5, events


def test_the_sidecar_publishes_history_coded_deltas_and_a_follower_keeps_up(cluster, tmp_path):
    """``Sidecar(coding="history")``: deltas since the last keyframe (its side keyframes reset the history), a
    restart rebuilds its history from the origin's deltas since that keyframe, and a subscriber that followed
    from the start decodes every step, bit for bit, without a resync."""
    import asyncio

    from deltasync.client.sidecar import Sidecar
    from deltasync.tensorfile import write_state_file

    trace = RLTrace(SHAPE, lr=1e-4, seed=33)
    states = {step: trace.step() for step in range(1, 9)}
    events: list[SyncEvent] = []
    follower, target = _follow(cluster, "histcar", list(states.values()), 0, events)

    async def scan(car):
        try:
            return await car.scan()
        finally:
            await car.close()

    try:
        for step in range(1, 6):
            write_state_file(tmp_path / f"step-{step}.safetensors", states[step])
        car = Sidecar(tmp_path, cluster.origin, "histcar", cluster.token, KEY, keyframe_every=3, coding="history")
        assert [e.kind for e in asyncio.run(scan(car))] == ["published"] * 5
        assert follower.wait_version(5, 60) == 5
        for step in range(6, 9):  # a new run of the sidecar: resumes at v5, its history rebuilt (v4's keyframe on)
            write_state_file(tmp_path / f"step-{step}.safetensors", states[step])
        car = Sidecar(tmp_path, cluster.origin, "histcar", cluster.token, KEY, keyframe_every=0, coding="history")
        assert [e.kind for e in asyncio.run(scan(car))] == ["published"] * 3
        assert follower.wait_version(8, 60) == 8
    finally:
        follower.close()
    assert _same(target, states[8])
    metas = {v: _manifest(cluster, "histcar", v).meta for v in range(2, 9)}
    assert all(m["deltasync.coding"] == "history" for m in metas.values())
    assert [metas[v][HISTORY_META] for v in range(2, 9)] == ["1:8", "1:8", "1:8", "4:8", "4:8", "4:8", "4:8"]
    assert not [ev for ev in events if ev.kind in ("resync", "rolled-back", "error")], events


def test_cli_sidecar_history_and_subscribe_out_once_across_restarts(cluster, tmp_path):
    """``deltasync sidecar --coding history --once`` publishes each checkpoint; ``subscribe --out --once`` run
    again after each (a new process: no history kept) takes in the deltas since the keyframe and patches its
    file to the head, bit for bit, without a keyframe download."""
    import subprocess
    import sys

    from deltasync.tensorfile import read_state_file, write_state_file

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "deltasync.client.cli", *args], capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        return r

    trace = RLTrace(SHAPE, lr=1e-4, seed=34)
    watch = tmp_path / "ckpt"
    watch.mkdir()
    out = tmp_path / "out.safetensors"
    car = ["sidecar", "--watch", str(watch), "--origin", cluster.origin, "--model", "histcli", "--token-file",
           str(cluster.token_file), "--key-file", str(cluster.key_file), "--coding", "history", "--once",
           "--keyframe-every", "0"]
    sub = ["subscribe", "--from", cluster.url("relay"), "--model", "histcli", "--key-file", str(cluster.key_file),
           "--out", str(out), "--once", "--timeout", "120"]
    states = {}
    for step in range(1, 6):
        states[step] = trace.step()
        write_state_file(watch / f"step-{step}.safetensors", states[step])
        cli(*car)
        if step in (1, 3, 5):
            r = cli(*sub)
            assert _same(read_state_file(out), states[step]), step
            if step > 1:
                assert "keyframe" not in r.stdout.lower().replace("keyframe_every", ""), r.stdout
    assert _manifest(cluster, "histcli", 5).meta[HISTORY_META] == "1:8"
