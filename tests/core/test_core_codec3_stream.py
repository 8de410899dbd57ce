"""A base-conditioned stream (docs/FORMAT.md §4.4) through real servers: an origin and a relay
(LocalCluster, processes on 127.0.0.1), a Publisher with ``EncodeOptions(coding="base-conditioned")``,
and a late subscriber that asks the relay for a squashed catch-up: the relay refuses it (400
unsupported, before reading a blob), and the subscriber walks the chain to the head, bit for bit."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from deltasync.blob import blob_version
from deltasync.cli.cluster import LocalCluster
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import SyncEvent, ThreadedSubscriber
from deltasync.codec import EncodeOptions
from deltasync.manifest import parse_manifest
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

# long: real server and CLI processes; `make test-long` (which .ci/run also runs), not `make test`
pytestmark = pytest.mark.long

KEY = bytes(range(1, 33))
SHAPE = ModelShape(vocab=256, hidden=32, layers=2, ffn=64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("cond"), key=KEY)
    try:
        c.start_tree({"relay": ["origin"]})
        yield c
    finally:
        c.close()


def test_a_late_subscriber_walks_a_base_conditioned_chain_the_relay_will_not_squash(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=21)
    states = [trace.step() for _ in range(6)]
    with Publisher(cluster.origin, "cond", cluster.token, KEY, keyframe_every=0,
                   options=EncodeOptions(coding="base-conditioned")) as pub:
        for v, s in enumerate(states):
            pub.publish(v, s)
        pub.flush(60)
    head = urllib.request.urlopen(f"{cluster.origin}/v1/models/cond/versions/5", timeout=10).read()
    m = parse_manifest(head)
    assert m.kind == "delta" and m.coding == "base-conditioned"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{cluster.url('relay')}/v1/models/cond/delta?from=0&to=5", timeout=30)
    assert e.value.code == 400 and b"cannot be squashed without the model" in e.value.read()
    events: list[SyncEvent] = []
    target = {n: torch.zeros_like(t) for n, t in states[-1].items()}
    sub = ThreadedSubscriber(cluster.url("relay"), "cond", target, verifier=KEY, on_event=events.append,
                             use_squash=True, squash_min_chain=2)
    try:
        sub.start()
        assert sub.wait_version(5, 60) == 5
    finally:
        sub.close()
    assert _same(target, states[-1])
    applied = [ev.version for ev in events if ev.kind == "applied"]
    assert applied[-1] == 5 and len(applied) >= 2, applied


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _cli_stream(cluster, tmp_path, model: str, steps: int, seed: int, *publish_options: str):
    """A CLI stream's commands and states: (``publish`` args with ``publish_options``, ``subscribe --out --once``
    args from the relay, its file, the trace's ``steps`` states, written as ``s{i}.safetensors``)."""
    trace = RLTrace(SHAPE, lr=1e-4, seed=seed)
    key, token = cluster.key_file, cluster.token_file
    pub = ["publish", "--origin", cluster.origin, "--model", model, "--token-file", str(token),
           "--key-file", str(key), *publish_options]
    out = tmp_path / "out.safetensors"
    sub = ["subscribe", "--from", cluster.url("relay"), "--model", model, "--key-file", str(key), "--out", str(out),
           "--once", "--timeout", "120"]
    states = [trace.step() for _ in range(steps)]
    for i, st in enumerate(states):
        write_state_file(tmp_path / f"s{i}.safetensors", st)
    return pub, sub, out, states


def test_cli_publish_base_conditioned_and_subscribe_out_patches_the_file(cluster, tmp_path):
    """``publish --base --coding base-conditioned`` and ``subscribe --out`` (the file target decodes each
    chunk against the file's own words, under its journal)."""
    pub, sub, out, s = _cli_stream(cluster, tmp_path, "condcli", 3, 22, "--coding", "base-conditioned")
    p = lambda i: str(tmp_path / f"s{i}.safetensors")  # noqa: E731
    r = _cli(*pub, "--base", p(0), p(0))
    assert r.returncode == 0 and "keyframe" in r.stdout, r.stdout + r.stderr
    r = _cli(*sub)
    assert r.returncode == 0, r.stdout + r.stderr
    for i in (1, 2):
        r = _cli(*pub, "--base", p(i - 1), p(i))
        assert r.returncode == 0 and f"v{i}: delta" in r.stdout, r.stdout + r.stderr
    m = parse_manifest(urllib.request.urlopen(f"{cluster.origin}/v1/models/condcli/versions/2", timeout=10).read())
    assert m.coding == "base-conditioned"
    r = _cli(*sub)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _same(read_state_file(out), s[2])


def test_cli_publish_blob_format_2_reaches_a_subscriber(cluster, tmp_path):
    """``publish --base --blob-format 2`` (a fleet not yet reading blob format 4): the origin stores version-2 blobs,
    the relay serves them and ``subscribe --out`` patches the file to the step, bit for bit."""
    pub, sub, out, s = _cli_stream(cluster, tmp_path, "fmt2cli", 2, 23, "--blob-format", "2")
    r = _cli(*pub, str(tmp_path / "s0.safetensors"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _cli(*sub).returncode == 0
    r = _cli(*pub, "--base", str(tmp_path / "s0.safetensors"), str(tmp_path / "s1.safetensors"))
    assert r.returncode == 0 and "v1: delta" in r.stdout, r.stdout + r.stderr
    m = parse_manifest(urllib.request.urlopen(f"{cluster.origin}/v1/models/fmt2cli/versions/1", timeout=10).read())
    for ref in m.blobs:
        data = urllib.request.urlopen(f"{cluster.origin}/v1/blobs/{ref.id}", timeout=10).read()
        assert blob_version(data) == 2
    r = _cli(*sub)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _same(read_state_file(out), s[1])
