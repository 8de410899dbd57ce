"""``subscribe --out F`` patches F in place, crash-safe: real CLI processes SIGKILLed at every phase of an
apply (deterministic points through tests/kill_at_phase.py, and at random instants while a publisher keeps
publishing), F always exactly one published version after recovery, loadable by ``safetensors``."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import xxhash

from deltasync.cli.cluster import LocalCluster
from deltasync.client.filetarget import FileTarget, journal_path, recover
from deltasync.client.publisher import Publisher
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace

# long: real CLI processes, many runs; `make test-long` (which .ci/run also runs), not `make test`
pytestmark = pytest.mark.long

KEY = bytes(range(3, 35))
SHAPE = ModelShape(vocab=256, hidden=32, layers=2, ffn=64)
LAUNCHER = str(Path(__file__).resolve().parents[1] / "kill_at_phase.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("ends-sub"), key=KEY)
    try:
        c.start_tree({"relay": ["origin"]})
        yield c
    finally:
        c.close()


def _sub(cluster, model: str, out: Path, *extra: str) -> list[str]:
    return ["subscribe", "--from", cluster.url("relay"), "--from", cluster.origin, "--model", model,
            "--key-file", str(cluster.key_file), "--out", str(out), "--poll", "1", *extra]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _digest(state) -> str:
    h = xxhash.xxh3_128()
    for n in sorted(state):
        h.update(n.encode())
        h.update(state[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _version_of(out: Path) -> int:
    with safetensors.safe_open(str(out), framework="pt") as f:
        return int(f.metadata()["deltasync.version"])


def _check_one_version(out: Path, digests: dict[int, str]) -> int:
    """F is exactly the published version its header names, and safetensors itself loads it."""
    assert not journal_path(out).exists()
    v = _version_of(out)
    assert v in digests, f"{out} claims v{v}, never published"
    assert _digest(read_state_file(out)) == digests[v], f"{out} says v{v} but its bytes are not v{v}'s"
    assert _digest(safetensors.torch.load_file(str(out))) == digests[v]
    return v


@pytest.mark.parametrize("phase", ["journal-torn", "mid-patch", "patched", "header-torn", "header"])
def test_killed_at_each_phase_of_a_delta_recovers_to_the_old_version(cluster, tmp_path, phase):
    model = f"ph-{phase}"
    trace = RLTrace(SHAPE, lr=3e-4, seed=hash(phase) % 1000)
    out = tmp_path / "live.safetensors"
    states = {0: trace.step()}
    with Publisher(cluster.origin, model, cluster.token, KEY, keyframe_every=0) as pub:
        pub.publish(0, states[0])
        pub.flush(60)
        r = cli(*_sub(cluster, model, out, "--once", "--timeout", "60"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert _version_of(out) == 0
        for v in (1, 2):
            states[v] = trace.step()
            pub.publish(v, states[v])
        pub.flush(60)
    digests = {v: _digest(s) for v, s in states.items()}
    killed = subprocess.run([sys.executable, LAUNCHER, phase, *_sub(cluster, model, out, "--once", "--timeout", "60")],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    if phase != "journal-torn":
        assert journal_path(out).exists(), "killed mid-apply: the undo journal must still be there"
    info = recover(out)
    assert (info is None) == (phase == "journal-torn")  # a torn journal: F was never touched
    assert _check_one_version(out, digests) == 0
    r = cli(*_sub(cluster, model, out, "--once", "--timeout", "60"))
    assert r.returncode == 0 and "resuming" in r.stdout, r.stdout + r.stderr
    assert _check_one_version(out, digests) == 2


def test_the_cli_itself_rolls_back_a_journal_before_anything_else(cluster, tmp_path):
    model = "ph-cli"
    trace = RLTrace(SHAPE, lr=3e-4, seed=77)
    out = tmp_path / "live.safetensors"
    states = {0: trace.step()}
    with Publisher(cluster.origin, model, cluster.token, KEY, keyframe_every=0) as pub:
        pub.publish(0, states[0])
        pub.flush(60)
        assert cli(*_sub(cluster, model, out, "--once", "--timeout", "60")).returncode == 0
        states[1] = trace.step()
        pub.publish(1, states[1])
        pub.flush(60)
    killed = subprocess.run([sys.executable, LAUNCHER, "header", *_sub(cluster, model, out, "--once")],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert _version_of(out) == 1 and journal_path(out).exists()  # the header was written, the journal not yet removed
    r = cli(*_sub(cluster, model, out, "--once", "--timeout", "60"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rolled back the unfinished v1 to v0" in r.stdout and "resuming" in r.stdout
    assert _check_one_version(out, {v: _digest(s) for v, s in states.items()}) == 1


def test_killed_while_writing_the_first_keyframe_leaves_no_file(cluster, tmp_path):
    model = "ph-kf"
    trace = RLTrace(SHAPE, lr=3e-4, seed=78)
    out = tmp_path / "live.safetensors"
    s0 = trace.step()
    with Publisher(cluster.origin, model, cluster.token, KEY, keyframe_every=0) as pub:
        pub.publish(0, s0)
        pub.flush(60)
    killed = subprocess.run([sys.executable, LAUNCHER, "keyframe", *_sub(cluster, model, out, "--once")],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists() and list(tmp_path.glob(".live.safetensors.*.tmp")), "the half keyframe is a temp file"
    r = cli(*_sub(cluster, model, out, "--once", "--timeout", "60"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _check_one_version(out, {0: _digest(s0)}) == 0
    assert not list(tmp_path.glob(".live.safetensors.*.tmp"))


@pytest.mark.timeout(900)
def test_random_kills_while_following_a_live_stream(cluster, tmp_path):
    """SIGKILL at random instants while versions arrive every ~0.2 s: after each, recovery leaves F
    bit-exactly one published version; the next run resumes from it."""
    model = "ph-random"
    shape = ModelShape(vocab=1024, hidden=128, layers=2, ffn=512)  # ~0.5M bf16 words
    trace = RLTrace(shape, lr=3e-4, seed=79)
    out = tmp_path / "live.safetensors"
    digests: dict[int, str] = {}
    rng = random.Random(1234)
    stop = threading.Event()
    # side keyframes: a run resuming from a version the servers no longer keep (retention) resyncs from one
    with Publisher(cluster.origin, model, cluster.token, KEY, keyframe_every=4) as pub:
        s = trace.step()
        digests[0] = _digest(s)
        pub.publish(0, s)
        pub.flush(60)
        r = cli(*_sub(cluster, model, out, "--once", "--timeout", "60"))  # F holds v0: every kill below is a resume
        assert r.returncode == 0, r.stdout + r.stderr

        def publish_forever() -> None:
            v = 1
            while not stop.is_set():
                st = trace.step()
                digests[v] = _digest(st)
                pub.publish(v, st)
                pub.flush(60)
                v += 1
                time.sleep(0.2)

        t = threading.Thread(target=publish_forever, daemon=True)
        t.start()
        seen, kills, rolled = [], 0, 0
        try:
            for _ in range(6):
                p = subprocess.Popen([sys.executable, "-m", "deltasync.client.cli", *_sub(cluster, model, out)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                following = threading.Event()

                def read(p=p, following=following) -> None:
                    for line in p.stdout:
                        if " -> " in line:  # it applied a version: it is following the stream now
                            following.set()
                threading.Thread(target=read, daemon=True).start()
                assert following.wait(120), "the subscriber never applied a version"
                time.sleep(rng.uniform(0.0, 1.5))  # then a random instant: versions land every ~0.2 s
                p.send_signal(signal.SIGKILL)
                p.wait(30)
                kills += 1
                rolled += recover(out) is not None
                seen.append(_check_one_version(out, dict(digests)))
        finally:
            stop.set()
            t.join(60)
        pub.flush(60)
        last = max(digests)
    assert kills == 6 and len(seen) == 6
    assert seen == sorted(seen), "a version went backwards across restarts"
    assert seen[-1] > seen[0], "the runs never moved past their first version"
    r = cli(*_sub(cluster, model, out, "--until", str(last), "--timeout", "300"), timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _check_one_version(out, digests) == last
    print(f"random kills: {kills}, journals rolled back: {rolled}, versions seen: {seen}")


def test_a_file_written_elsewhere_is_rewritten_once_and_then_patched_in_place(tmp_path):
    s = RLTrace(SHAPE, lr=1e-4, seed=5).step()
    out = tmp_path / "f.safetensors"
    write_state_file(out, s, {"deltasync.model": "m", "deltasync.version": "4", "deltasync.state_fp": "ab" * 8})
    t = FileTarget(out, "m")
    try:
        assert t.version == 4 and t.file.header.data_start % 4096 == 0
        assert _digest(t.tensors()) == _digest(s)
        assert all(x.untyped_storage().data_ptr() for x in t.tensors().values())
    finally:
        t.close()
    assert _digest(safetensors.torch.load_file(str(out))) == _digest(s)
    other = FileTarget(out, "another-model")
    assert other.version is None and other.file is None  # not a version of that stream: a layout only
