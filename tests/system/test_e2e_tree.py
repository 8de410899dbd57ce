"""End to end on loopback: trainer -> origin -> two tiers of relays -> subscribers.

Real server processes (``deltasync.server.cli``) on ephemeral ports, real tensors
from the RL trace generator, signed manifests. Every comparison is bit for bit
through integer views.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import SyncEvent, ThreadedSubscriber
from deltasync.tensorfile import read_state_file
from deltasync.testing.trace import ModelShape, RLTrace

KEY = bytes(range(100, 132))
SHAPE = ModelShape(vocab=512, hidden=64, layers=2, ffn=192)
TREE = {"eu": ["origin"], "us": ["origin"], "eu-a": ["eu", "us"], "us-a": ["us", "eu"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("tree"), key=KEY)
    try:
        c.start_tree(TREE)
        yield c
    finally:
        c.close()


def exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and torch.equal(a[n].contiguous().view(-1).view(torch.uint8), b[n].contiguous().view(-1).view(torch.uint8))
        for n in a)


def blank(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(t, 7.0) for n, t in state.items()}


def test_tree_eight_subscribers_twenty_steps_bit_exact(cluster):
    trace = RLTrace(SHAPE, lr=3e-4, seed=1)
    leaves = ["eu-a", "us-a"]
    targets = [blank(trace.state()) for _ in range(8)]
    subs = []
    try:
        for i, t in enumerate(targets):
            leaf = leaves[i % 2]
            other = leaves[1 - i % 2]
            subs.append(ThreadedSubscriber([cluster.url(leaf), cluster.url(other), cluster.origin], "tree", t, verifier=KEY))
            subs[-1].start()
        with Publisher(cluster.origin, "tree", cluster.token, KEY, keyframe_every=8) as pub:
            for step in range(20):
                state = trace.step()
                pub.publish(step, state)
                for s, t in zip(subs, targets):
                    assert s.wait_version(step, 60) == step
                    assert exact(t, state), f"subscriber differs from the trainer at v{step}"
            results = list(pub.results)
        assert [r.kind for r in results] == ["keyframe"] + ["delta"] * 19
        assert [r.version for r in results if r.side_keyframe] == [8, 16]
        for s in subs:
            st = s.status
            assert st.version == 19 and st.verify == "ok" and st.rollbacks == 0 and st.lag == 0
        # deltas, not copies: after the first keyframe each subscriber received far less than 19 full states
        full = sum(t.numel() * t.element_size() for t in state.values())
        assert all(s.status.bytes_received < 1 * full + 19 * full // 2 for s in subs)
    finally:
        for s in subs:
            s.close()


def wait_head(url: str, model: str, version: int, timeout: float = 60) -> None:
    """Block until the server at ``url`` holds ``model`` at ``version`` or later (its long-polled head)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = f"{url}/v1/models/{model}/head?after={version - 1}&wait=2"
        try:
            with urllib.request.urlopen(q, timeout=10) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError:  # a relay that has not heard of the stream yet answers 404
            time.sleep(0.1)
    raise AssertionError(f"{url} did not reach {model}@{version} within {timeout} s")


def test_subscriber_joining_at_step_15_catches_up_from_a_recent_keyframe(cluster):
    trace = RLTrace(SHAPE, lr=3e-4, seed=2)
    events: list[SyncEvent] = []
    target = blank(trace.state())
    sub = ThreadedSubscriber([cluster.url("eu-a"), cluster.origin], "join", target, verifier=KEY, on_event=events.append)
    with Publisher(cluster.origin, "join", cluster.token, KEY, keyframe_every=10) as pub:
        for step in range(20):
            state = trace.step()
            pub.publish(step, state)
            if step == 15:
                pub.flush(60)
                # the relay the subscriber asks first has the side keyframe (a relay still following the origin
                # would offer only v0's keyframe and a squash, which is also correct but not what this tests)
                wait_head(cluster.url("eu-a"), "join.kf", 10)
                wait_head(cluster.url("eu-a"), "join", 15)
                sub.start()
                assert sub.wait_version(15, 60) >= 15
        pub.flush(60)
    try:
        assert sub.wait_version(19, 60) == 19
        assert exact(target, state)
        applied = [e for e in events if e.kind == "applied"]
        assert applied[0].version == 10, "should start from the side keyframe of v10, not from v0"
        assert "keyframe" in applied[0].detail
    finally:
        sub.close()


def test_subscriber_killed_mid_apply_restarts_and_recovers(cluster, tmp_path):
    trace = RLTrace(SHAPE, lr=3e-4, seed=3)
    out = tmp_path / "live.safetensors"
    key_file = tmp_path / "key"
    key_file.write_text(KEY.hex())
    argv = [sys.executable, "-m", "deltasync.client.cli", "subscribe", "--from", cluster.url("us-a"),
            "--from", cluster.origin, "--model", "crash", "--key-file", str(key_file), "--out", str(out),
            "--until", "9", "--poll", "2", "--timeout", "60"]
    states = {}
    with Publisher(cluster.origin, "crash", cluster.token, KEY, keyframe_every=0) as pub:
        for step in range(4):
            states[step] = trace.step()
            pub.publish(step, states[step])
        pub.flush(60)
        killed = [sys.executable, str(Path(__file__).resolve().parents[1] / "kill_after_apply.py"), "6", *argv[3:]]
        proc = subprocess.Popen(killed, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert out.exists(), "the subscriber never wrote its file"
            for step in range(4, 10):
                states[step] = trace.step()
                pub.publish(step, states[step])
                pub.flush(60)
                time.sleep(0.3)
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert rc == -signal.SIGKILL, proc.stdout.read().decode()
    # dead between applying v>=6 in memory and replacing the file: the file is an older, intact version
    # (which one depends on timing: a subscriber that starts late catches up with a squashed delta)
    import safetensors
    with safetensors.safe_open(str(out), framework="pt") as f:
        v = int(f.metadata()["deltasync.version"])
    assert 0 <= v < 6
    assert exact(read_state_file(out), states[v])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming" in done.stdout
    assert exact(read_state_file(out), states[9])
    assert not list(tmp_path.glob(".live.safetensors.*.tmp"))


def _blob_file(root: Path, blob_id: str) -> Path:
    return root / "blobs" / blob_id[:2] / blob_id


def test_corrupted_blob_at_a_relay_never_reaches_a_model(cluster):
    trace = RLTrace(SHAPE, lr=3e-4, seed=4)
    s0 = trace.step()
    only_eu = {n: t.clone() for n, t in s0.items()}
    with_fallback = {n: t.clone() for n, t in s0.items()}
    with Publisher(cluster.origin, "corrupt", cluster.token, KEY, keyframe_every=0) as pub:
        pub.publish(0, s0)
        s1 = trace.step()
        res = pub.publish(1, s1).result(60)
    # the relay follows the origin's events and prefetches v1's blobs; corrupt them on its disk
    eu_dir = cluster.servers["eu"].data_dir
    files = [_blob_file(eu_dir, ref.id) for ref in res.manifest.blobs]
    deadline = time.monotonic() + 30
    while not all(f.exists() and f.stat().st_size == r.size for f, r in zip(files, res.manifest.blobs)):
        assert time.monotonic() < deadline, "relay eu never cached v1's blobs"
        time.sleep(0.05)
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x40
        f.write_bytes(bytes(data))
    # both hold v0; b fails over to the origin and is exact; a has no other server: it stays at v0, untouched
    a = ThreadedSubscriber([cluster.url("eu")], "corrupt", only_eu, verifier=KEY, version=0)
    b = ThreadedSubscriber([cluster.url("eu"), cluster.origin], "corrupt", with_fallback, verifier=KEY, version=0)
    try:
        a.start()
        b.start()
        assert b.wait_version(1, 60) == 1
        assert exact(with_fallback, s1)
        assert b.subscriber.client.stats.corrupt_blobs >= 1
        time.sleep(2.0)
        a.apply_pending()
        assert a.version == 0
        assert exact(only_eu, s0)
        assert a.status.last_error is not None and "hashes to" in a.status.last_error
    finally:
        a.close()
        b.close()
