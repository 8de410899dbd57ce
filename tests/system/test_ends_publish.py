"""``deltasync publish --base PREV STATE``: a delta diffed against a local, mapped base that must be the
origin's head (checked by state fingerprint), no model download; the first version streamed as shards."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deltasync.cli.cluster import LocalCluster
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

# long: real CLI processes, many runs; `make test-long` (which .ci/run also runs), not `make test`
pytestmark = pytest.mark.long

KEY = bytes(range(9, 41))
SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("ends-pub"), key=KEY)
    try:
        c.start_tree({"relay": ["origin"]})
        yield c
    finally:
        c.close()


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_publish_with_base_is_a_delta_and_a_wrong_base_fails_loudly(cluster, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=40)
    key = str(cluster.key_file)
    pub = ["publish", "--origin", cluster.origin, "--model", "pb", "--token-file", str(cluster.token_file), "--key-file", key]
    out = tmp_path / "out.safetensors"
    sub = ["subscribe", "--from", cluster.url("relay"), "--model", "pb", "--key-file", key, "--out", str(out),
           "--once", "--timeout", "60"]
    s = {}
    for i in range(5):
        s[i] = trace.step()
        write_state_file(tmp_path / f"s{i}.safetensors", s[i])
    p = lambda i: str(tmp_path / f"s{i}.safetensors")  # noqa: E731
    r = cli(*pub, "--base", p(0), p(0))  # nothing on the origin yet: a keyframe, --base unused
    assert r.returncode == 0 and "published pb v0: keyframe" in r.stdout, r.stdout + r.stderr
    r = cli(*pub, "--base", p(0), p(1))
    assert r.returncode == 0 and "published pb v1: delta" in r.stdout, r.stdout + r.stderr
    assert cli(*sub).returncode == 0
    assert _same(read_state_file(out), s[1])
    # s0 is not the head (v1): refused, both fingerprints named, nothing published
    r = cli(*pub, "--base", p(0), p(2))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "state fingerprint" in r.stderr and "head pb v1" in r.stderr and "--keyframe-on-mismatch" in r.stderr
    r = cli(*pub, "--base", p(0), p(2), "--keyframe-on-mismatch")
    assert r.returncode == 0 and "published pb v2: keyframe" in r.stdout, r.stdout + r.stderr
    assert cli(*sub).returncode == 0
    assert _same(read_state_file(out), s[2])
    # the subscriber's own file is a valid base; a side keyframe rides along on request
    r = cli(*pub, "--base", str(out), p(3), "--keyframe")
    assert r.returncode == 0 and "published pb v3: delta" in r.stdout and "side keyframe" in r.stdout, r.stdout + r.stderr
    assert cli(*sub).returncode == 0
    assert _same(read_state_file(out), s[3])
    r = cli(*pub, "--base", p(3), p(4), "--step", "3")
    assert r.returncode == 1 and "not after the origin's head v3" in r.stderr
    r = cli(*pub, p(4), "--keyframe-on-mismatch")
    assert r.returncode == 2 and "needs --base" in r.stderr


def test_publish_with_base_never_downloads_the_model(tmp_path):
    """The origin's transfer counters (an origin alone: no relay prefetching): a --base publish reads the
    head manifest only, not one blob byte (without --base the head state is rebuilt from the origin)."""
    with LocalCluster(tmp_path / "tree", key=KEY) as cluster:
        cluster.start_origin()
        _no_download(cluster, tmp_path)


def _no_download(cluster, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=41)
    key = str(cluster.key_file)
    pub = ["publish", "--origin", cluster.origin, "--model", "pb2", "--token-file", str(cluster.token_file), "--key-file", key]
    for i in range(2):
        write_state_file(tmp_path / f"s{i}.safetensors", trace.step())
    assert cli(*pub, str(tmp_path / "s0.safetensors")).returncode == 0
    import urllib.request
    metrics = lambda: urllib.request.urlopen(cluster.origin + "/metrics", timeout=10).read().decode()  # noqa: E731
    def blob_reads(text: str) -> float:
        total = 0.0
        for line in text.splitlines():
            if line.startswith("deltasync_bytes_out_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total
    before = blob_reads(metrics())
    r = cli(*pub, "--base", str(tmp_path / "s0.safetensors"), str(tmp_path / "s1.safetensors"))
    assert r.returncode == 0 and "delta" in r.stdout, r.stdout + r.stderr
    assert blob_reads(metrics()) == before
    write_state_file(tmp_path / "s2.safetensors", trace.step())
    r = cli(*pub, str(tmp_path / "s2.safetensors"))  # no --base: the old way, the model is downloaded
    assert r.returncode == 0 and "delta" in r.stdout, r.stdout + r.stderr
    assert blob_reads(metrics()) > before  # so the counter does see downloads
