"""Issue 27, TUF's fast-forward: a mirror listed first advertises a head 10 versions past the real one, with a
manifest it cannot sign (the real head renumbered with its old signature, or signed by another key), or with a
real, validly signed manifest of another chain (another model, same publisher key). ``subscribe --once`` must end
bit-exactly at the origin's real head, nothing applied from the fake; a follower listing the mirror first must
not put the honest origin down on the mirror's word (the behind-probe checks what the other source proves).

Real origin (``LocalCluster``), real ``deltasync subscribe`` processes, the mirror a real TCP server in front of
the origin (``hostile_peers.HostilePeer``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from deltasync.client.publisher import Publisher
from deltasync.manifest import parse_manifest
from deltasync.tensorfile import read_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same
from cluster_support import origin_only, publish_trace
from hostile_peers import PROXY, Fixed, HostilePeer

KEY = bytes(range(41, 73))
SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)
AHEAD = 10


def test_a_head_answer_naming_another_model_is_that_sources_fault():
    """Pure: the head summary refuses another model's manifest before anything trusts its version."""
    from deltasync.client.httpbase import HeadInfo
    from deltasync.errors import UpstreamError

    body = json.dumps({"model": "ff-other", "version": 13, "blobs": []}).encode()
    with pytest.raises(UpstreamError, match="asked for the head of 'ff', the answer is 'ff-other' v13"):
        HeadInfo.from_body(body, model="ff", url="http://mirror")
    assert HeadInfo.from_body(body, model="ff-other").version == 13


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with origin_only(tmp_path_factory.mktemp("ff"), KEY) as c:
        yield c


@pytest.fixture(scope="module")
def published(cluster):
    states = publish_trace(cluster, "ff", SHAPE, KEY, seed=9, steps=4)  # v0..v3
    with Publisher(cluster.origin, "ff-other", cluster.token, KEY, keyframe_every=0) as pub:  # another chain
        pub.publish(3 + AHEAD, RLTrace(SHAPE, lr=1e-4, seed=10).step())
        pub.flush(60)
    return states


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _fake(cluster, kind: str) -> bytes:
    real = _get(f"{cluster.origin}/v1/models/ff/versions/3")
    if kind == "other-chain":
        return _get(f"{cluster.origin}/v1/models/ff-other/versions/{3 + AHEAD}")
    m = dataclasses.replace(parse_manifest(real), version=3 + AHEAD, parent=2 + AHEAD)
    if kind == "wrong-key":
        return m.sign(bytes(range(100, 132))).to_json()
    obj = json.loads(m.to_json())
    obj["signature"] = json.loads(real)["signature"]  # the real signature, over other fields
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _plan(fake: bytes):
    def plan(method: str, target: str) -> object:
        if target.startswith("/v1/models/ff/head"):
            return Fixed(200, {"Content-Type": "application/json", "X-Deltasync-Version": str(3 + AHEAD)}, fake)
        if target.startswith("/v1/models/ff/versions/") and int(target.split("?")[0].rsplit("/", 1)[1]) > 3:
            return Fixed(200, {"Content-Type": "application/json"}, fake)
        return PROXY
    return plan


def _cmd(cluster, sources, out, *extra):
    args = [a for s in sources for a in ("--from", s)]
    return [sys.executable, "-m", "deltasync.client.cli", "subscribe", *args, "--model", "ff",
            "--key-file", str(cluster.key_file), "--out", str(out), "--hedge-after", "0.5", *extra]


@pytest.mark.parametrize("kind", ["renumbered", "wrong-key", "other-chain"])
def test_once_behind_a_mirror_claiming_a_head_ten_ahead_ends_at_the_real_head(cluster, published, tmp_path, kind):
    with HostilePeer(cluster.origin, _plan(_fake(cluster, kind))) as mirror:
        out = tmp_path / "out.safetensors"
        t0 = time.monotonic()
        r = subprocess.run(_cmd(cluster, [mirror.url, cluster.origin], out, "--once", "--timeout", "60"),
                           capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr[-3000:]
        assert _same(read_state_file(out), published[-1])  # the origin's v3, nothing from the fake
        assert "ff v3 ->" in r.stdout + r.stderr and f"v{3 + AHEAD}" not in r.stdout
        assert mirror.count(lambda m, t: t.startswith("/v1/models/ff/head")) >= 1  # the fake was offered
        assert took < 45, took  # ~5 s on an idle machine; the shared cores at load 13 took longer once


def test_a_follower_does_not_put_the_origin_down_on_the_mirrors_claim(cluster, published, tmp_path):
    """In follow mode with the mirror first, the origin at v3 is quiet; the behind-probe used to read the
    mirror's X-Deltasync-Version (v13) and mark the honest origin failed every few seconds. It now checks the
    mirror's head manifest and finds nothing it can prove."""
    with HostilePeer(cluster.origin, _plan(_fake(cluster, "other-chain"))) as mirror:
        out = tmp_path / "out.safetensors"
        p = subprocess.Popen(_cmd(cluster, [mirror.url, cluster.origin], out, "--poll", "1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not out.exists():
                assert p.poll() is None and time.monotonic() < deadline, p.communicate(timeout=5)
                time.sleep(0.1)
            time.sleep(8)  # several long-polls of the quiet origin: the probe runs after two of them
        finally:
            p.terminate()
            _, err = p.communicate(timeout=20)
        assert _same(read_state_file(out), published[-1])
        assert "is behind" not in err, err[-3000:]
