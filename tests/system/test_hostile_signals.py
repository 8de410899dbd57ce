"""Issue 27, runaway work: an apply obeys SIGTERM and ``--timeout`` within a few seconds, mid-apply included.

A signed state of very many tiny tensors makes a long, CPU-bound apply on the event loop's thread (the
seed-scale issue makes it long; this issue makes it stoppable): the apply checks a flag and the deadline
between pieces of its work (``client/interrupt.py``, ``deltasync.apply.stage_prepared(check=)``) and rolls
back. Real CLI processes against a real origin; F must afterwards be bit-exactly a published version, its
journal gone. Servers end on SIGTERM within a few seconds too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.client.filetarget import journal_path
from deltasync.client.publisher import Publisher
from deltasync.tensorfile import read_state_file

# long: a state of many tensors to publish and stream first (~1 min on 2 busy cores)
pytestmark = pytest.mark.long

KEY = bytes(range(5, 37))
N_TENSORS = int(os.environ.get("DELTASYNC_SIGNAL_TENSORS", "30000"))  # issue: 100k-200k; enough for a long apply


def _state(seed: int, base=None) -> dict[str, torch.Tensor]:
    if base is not None:
        return {k: (v.float() * 1.001 + 0.01).to(torch.bfloat16) for k, v in base.items()}
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.w": torch.randn(16, generator=g).to(torch.bfloat16) for i in range(N_TENSORS)}


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """An origin with v0 (keyframe) and v1 (a delta changing every tensor), and F holding v0 (a copy kept)."""
    root = tmp_path_factory.mktemp("signals")
    with LocalCluster(root / "c", key=KEY) as c:
        c.start_origin()
        s0 = _state(1)
        s1 = _state(0, s0)
        out = root / "v0.safetensors"
        with Publisher(c.origin, "many", c.token, KEY, keyframe_every=0) as pub:
            pub.publish(0, s0)
            pub.flush(300)
            r = subprocess.run(_sub(c, out, "--once", "--timeout", "300"), capture_output=True, text=True, timeout=400)
            assert r.returncode == 0, r.stdout + r.stderr
            pub.publish(1, s1)
            pub.flush(300)
        yield c, out, {0: s0, 1: s1}


def _sub(c: LocalCluster, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deltasync.client.cli", "subscribe", "--from", c.origin, "--model", "many",
            "--key-file", str(c.key_file), "--out", str(out), "--poll", "1", *extra]


def _same(out: Path, state: dict[str, torch.Tensor]) -> bool:
    got = read_state_file(out)
    return set(got) == set(state) and all(torch.equal(got[k].view(torch.int16), state[k].view(torch.int16))
                                          for k in state)


def _run_until_apply(cmd: list[str], *, signal_after: float | None):
    """Start ``cmd`` with timeline stamps; once it starts applying, SIGTERM it after ``signal_after`` s (None:
    never). Returns the process, the instant of the signal (or of the apply's start), its stderr lines so far
    and their reader thread."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "DELTASYNC_TIMELINE": "1"})
    started = threading.Event()
    err: list[str] = []

    def read() -> None:
        for line in p.stderr:
            err.append(line)
            if "apply-start" in line:
                started.set()
    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert started.wait(300), "the subscriber never started applying v1:\n" + "".join(err[-20:])
    at = time.monotonic()
    if signal_after is not None:
        time.sleep(signal_after)
        at = time.monotonic()
        p.send_signal(signal.SIGTERM)
    return p, at, err, t


def _fresh(many, tmp_path) -> Path:
    c, v0, states = many
    out = tmp_path / "live.safetensors"
    shutil.copyfile(v0, out)
    return out


def test_sigterm_mid_apply_ends_within_5s_and_leaves_a_published_version(many, tmp_path):
    c, _, states = many
    out = _fresh(many, tmp_path)
    p, at, err, reader = _run_until_apply(_sub(c, out, "--once", "--timeout", "600"), signal_after=0.5)
    rc = p.wait(30)
    took = time.monotonic() - at
    reader.join(10)
    log = "".join(err)
    assert took < 5.0, f"SIGTERM mid-apply took {took:.1f} s to end the subscriber:\n{log[-2000:]}"
    assert not journal_path(out).exists()
    if rc == 130:  # stopped mid-apply: rolled back, and said so
        assert "SIGTERM" in log and "rolled back" in log and "holds v0" in log, log[-2000:]
        assert _same(out, states[0])
    else:  # the apply ended before the signal (a fast machine): then it is done, and F is v1
        assert rc == 0 and _same(out, states[1]), log[-2000:]
    print(f"SIGTERM mid-apply: exit {rc} after {took:.2f} s")
    # and F resumes: the next run applies v1
    r = subprocess.run(_sub(c, out, "--once", "--timeout", "600"), capture_output=True, text=True, timeout=700)
    assert r.returncode == 0 and "resuming" in r.stdout, r.stdout + r.stderr
    assert _same(out, states[1])


def test_timeout_bounds_an_apply_in_progress(many, tmp_path):
    """``--timeout`` covers a CPU-bound apply: the command ends within a few seconds of its deadline even when
    the deadline falls mid-apply (rolled back), and F is v0 bit for bit."""
    c, _, states = many
    # how long a run takes here to reach its apply (a run killed there: F restored from the copy after)
    out = _fresh(many, tmp_path)
    started = time.monotonic()
    p, at, err, reader = _run_until_apply(_sub(c, out, "--once", "--timeout", "600"), signal_after=None)
    lead = at - started
    p.kill()
    p.wait(30)
    reader.join(10)
    journal_path(out).unlink(missing_ok=True)
    out = _fresh(many, tmp_path)
    limit = round(lead + 1.5, 1)  # the deadline falls about 1.5 s into the apply
    started = time.monotonic()
    p = subprocess.Popen(_sub(c, out, "--once", "--timeout", str(limit)), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = p.communicate(timeout=limit + 120)
    finally:
        p.kill()
    took = time.monotonic() - started
    assert took < limit + 5.0, f"--timeout {limit} took {took:.1f} s:\n{stderr[-2000:]}"
    assert not journal_path(out).exists()
    if p.returncode == 1:  # the deadline came before or during the apply: F is v0
        assert "--timeout" in stderr or f"after {limit:.0f}s" in stderr, stderr[-2000:]
        assert _same(out, states[0])
    else:  # the apply ended before the deadline (a fast machine)
        assert p.returncode == 0 and _same(out, states[1]), stderr[-2000:]
    print(f"--timeout {limit} (apply from ~{lead:.1f} s): exit {p.returncode} after {took:.2f} s; "
          f"{stderr.strip().splitlines()[-1:]}")


def test_servers_end_on_sigterm_within_seconds(many):
    """An origin holding open long-polls and event streams ends within 5 s of SIGTERM."""
    import urllib.request

    c, _, _ = many
    o = c.servers["origin"]
    polls = []
    for path in ("/v1/models/many/head?after=1&wait=60", "/v1/events"):
        t = threading.Thread(target=lambda u=o.url + path: _quiet(urllib.request.urlopen, u, timeout=90), daemon=True)
        t.start()
        polls.append(t)
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(o.proc.pid, signal.SIGTERM)
    o.proc.wait(30)
    took = time.monotonic() - t0
    assert took < 5.0, f"the origin took {took:.1f} s to end on SIGTERM"
    print(f"origin: SIGTERM to exit {took:.2f} s")


def _quiet(fn, *a, **kw):
    try:
        r = fn(*a, **kw)
        r.read()
    except Exception:
        pass
