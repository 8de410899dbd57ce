"""``deltasync publish`` and ``deltasync subscribe`` as a user runs them (subprocesses, real files)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deltasync.cli.cluster import LocalCluster
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

KEY = bytes(range(7, 39))
SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("cli"), key=KEY)
    try:
        c.start_tree({"relay": ["origin"]})
        yield c
    finally:
        c.close()


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_publish_then_subscribe_once(cluster, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=20)
    key = str(cluster.key_file)
    pub = ["publish", "--origin", cluster.origin, "--model", "cli", "--token-file", str(cluster.token_file), "--key-file", key]
    sub = ["subscribe", "--from", cluster.url("relay"), "--from", cluster.origin, "--model", "cli", "--key-file", key,
           "--out", str(tmp_path / "out.safetensors"), "--once", "--timeout", "60"]
    states = []
    for i in range(3):
        states.append(trace.step())
        write_state_file(tmp_path / f"s{i}.safetensors", states[-1])
    r = cli(*pub, str(tmp_path / "s0.safetensors"))
    assert r.returncode == 0, r.stderr
    assert "published cli v0: keyframe" in r.stdout
    r = cli(*pub, str(tmp_path / "s1.safetensors"))
    assert r.returncode == 0 and "published cli v1: delta" in r.stdout, r.stdout + r.stderr
    r = cli(*sub)
    assert r.returncode == 0, r.stderr
    assert _same(read_state_file(tmp_path / "out.safetensors"), states[1])
    r = cli(*pub, str(tmp_path / "s2.safetensors"), "--step", "7", "--keyframe", "--quiet")
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    r = cli(*sub, "--quiet")
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert _same(read_state_file(tmp_path / "out.safetensors"), states[2])
    r = cli(*pub, str(tmp_path / "s2.safetensors"), "--step", "7")
    assert r.returncode == 1 and "not after the origin's head v7" in r.stderr


def test_bad_token_and_wrong_key_fail_loudly(cluster, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=21)
    write_state_file(tmp_path / "s.safetensors", trace.step())
    bad = tmp_path / "bad-token"
    bad.write_text("nope")
    r = cli("publish", "--origin", cluster.origin, "--model", "cli2", "--token-file", str(bad), str(tmp_path / "s.safetensors"))
    assert r.returncode == 1 and "token" in r.stderr, r.stderr
    r = cli("publish", "--origin", cluster.origin, "--model", "cli2", "--token-file", str(cluster.token_file),
            "--key-file", str(cluster.key_file), str(tmp_path / "s.safetensors"))
    assert r.returncode == 0, r.stderr
    wrong = tmp_path / "wrong-key"
    wrong.write_text("00" * 32)
    r = cli("subscribe", "--from", cluster.url("relay"), "--model", "cli2", "--key-file", str(wrong),
            "--out", str(tmp_path / "o.safetensors"), "--once", "--timeout", "5")
    assert r.returncode == 1 and "signature" in r.stderr.lower(), r.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_every_command_has_help_and_quiet():
    for cmd in ("publish", "subscribe", "sidecar"):
        r = cli(cmd, "--help")
        assert r.returncode == 0 and "--quiet" in r.stdout
