"""Campaign finding: a relay's squash worker process (server/catchup.py) outlived its relay, after SIGKILL and
after a clean SIGTERM alike. Real origin and relay processes; the relay builds a real squash (so its worker
runs), then the relay is killed and the worker must be gone within a few seconds."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from deltasync.testing.trace import ModelShape, RLTrace
from server_fixtures import KEY, TOKEN, fetch_squash, origin, relay, stop_all

SHAPE = ModelShape(vocab=256, hidden=32, layers=2, ffn=64)
GONE_S = 5.0


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited (its reaper may be slow)


def _worker_pids(relay_pid: int) -> list[int]:
    pids = []
    for c in _children(relay_pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing" in cmd:  # the worker (spawn_main) and the resource tracker
            pids.append(c)
    return pids


def _relay_with_squash(tmp_path):
    from deltasync.client.publisher import Publisher

    (tmp_path / "token").write_text(TOKEN)
    o = origin(tmp_path, "o", "--no-fsync", key=True).start().wait_ready(120)
    r = relay(tmp_path, "r", [o.url], "--no-fsync", key=True).start().wait_ready(120)
    trace = RLTrace(SHAPE, lr=1e-4, seed=3)
    with Publisher(o.url, "sq", TOKEN, KEY, keyframe_every=0) as p:
        for v in range(4):
            p.publish(v, {k: t.clone() for k, t in trace.step().items()})
        p.flush(60)
    asyncio.run(fetch_squash(r.url, "sq", 0, 3))
    workers = _worker_pids(r.pid)
    assert any(b"spawn_main" in Path(f"/proc/{w}/cmdline").read_bytes() for w in workers), \
        f"no squash worker under relay pid {r.pid}: {_children(r.pid)}"
    return o, r, workers


def _wait_gone(pids: list[int], bound: float) -> list[int]:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to find the worker")
def test_a_sigkilled_relays_squash_worker_exits_with_it(tmp_path):
    o, r, workers = _relay_with_squash(tmp_path)
    try:
        os.kill(r.pid, signal.SIGKILL)
        r.proc.wait(10)
        left = _wait_gone(workers, GONE_S)
        assert not left, f"squash worker(s) {left} still running {GONE_S:g} s after their relay was SIGKILLed"
    finally:
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        stop_all(o)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to find the worker")
def test_a_relay_stopped_with_sigterm_joins_its_squash_worker(tmp_path):
    o, r, workers = _relay_with_squash(tmp_path)
    try:
        t0 = time.monotonic()
        assert stop_all(r) == [0], r.log()[-3000:]
        assert time.monotonic() - t0 < 10.0
        left = _wait_gone(workers, 1.0)
        assert not left, f"squash worker(s) {left} still running after their relay exited on SIGTERM"
    finally:
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        stop_all(o)
