"""Issue 9 (campaign finding, relay-disk-full): a relay whose disk fills up must not wedge the children that
also list another source. Real origin and relay processes on loopback, the relay's cache on a real 8 MB tmpfs
(mounting needs root: skipped with the reason otherwise), real ~2 MB tensor states published with the
``Publisher``, a real ``ThreadedSubscriber`` following ``[relay, origin]``.

Before the fix the relay retried one manifest write every 2 s forever, kept answering the follower's long-poll
with its old head, and the follower stayed behind for as long as anyone waited."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import aiohttp
import pytest
import torch

from deltasync.testing.trace import RLTrace, shape_for_params
from server_fixtures import KEY, TOKEN, origin, relay, stop_all

STATE = shape_for_params(1_000_000)  # ~2 MB of bf16 per state: a few fill the 8 MB disk
CONVERGE_S = 45.0  # the follower's bound to reach the newest version once the relay's disk is full


@pytest.fixture()
def tiny_disk(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting an 8 MB tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


async def _health(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/healthz") as r:
            return r.status, await r.json(content_type=None)


async def _head(url: str, model: str, after: int) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/models/{model}/head?after={after}&wait=5",
                         timeout=aiohttp.ClientTimeout(total=20)) as r:
            body = await r.read()
            return r.status, (await r.json(content_type=None)) if body else {}


def test_a_follower_behind_a_full_relay_moves_on_to_the_origin(tmp_path, tiny_disk):
    from deltasync.client.publisher import Publisher
    from deltasync.client.subscriber import ThreadedSubscriber

    (tmp_path / "token").write_text(TOKEN)
    o = origin(tmp_path, "o", "--no-fsync", key=True).start().wait_ready(120)
    r = relay(tmp_path, "r", [o.url], "--no-fsync", key=True)
    r.args[r.args.index("--cache") + 1] = str(tiny_disk / "cache")
    r.start().wait_ready(120)
    sub = None
    try:
        states = [RLTrace(STATE, lr=3e-4, seed=4000 + v).state() for v in range(7)]  # unrelated: ~2 MB deltas
        with Publisher(o.url, "m", TOKEN, KEY, keyframe_every=0) as p:
            p.publish(0, states[0]).result(90)
            target = {k: torch.zeros_like(t) for k, t in states[0].items()}
            sub = ThreadedSubscriber([r.url, o.url], "m", target, verifier=KEY, auto=True)
            sub.start()
            assert sub.wait_version(0, 60) == 0
            for v in range(1, len(states)):
                p.publish(v, states[v]).result(90)
            p.flush(60)
        last = len(states) - 1
        cleared = time.monotonic()
        try:
            assert sub.wait_version(last, CONVERGE_S) >= last
        except Exception as e:
            raise AssertionError(f"follower not at v{last} {time.monotonic() - cleared:.0f} s after it was "
                                 f"published ({e}); relay log: {r.log()[-3000:]}") from e
        with sub.hold():
            assert all(torch.equal(target[n].view(torch.uint8), states[last][n].view(torch.uint8)) for n in target)
        # the relay says why: degraded, and a long-poll for what it cannot hold is a 507 at once, not a wait
        status, health = asyncio.run(_health(r.url))
        if status == 503:
            assert health["status"] == "degraded" and health["storage"], health
            rhead = health["models"].get("m")
            t0 = time.monotonic()
            code, body = asyncio.run(_head(r.url, "m", rhead if rhead is not None else 0))
            assert code == 507 and body["error"]["code"] == "insufficient_storage", (code, body)
            assert time.monotonic() - t0 < 3.0
        log = r.log()
        assert "disk full" in log, log[-3000:]  # it tried to evict before giving up
        blamed = [ln for ln in log.splitlines() if f"parent {o.url} failed" in ln
                  and ("space" in ln or "Storage" in ln)]
        assert not blamed, blamed  # the full disk is not blamed on the parent (a timeout under load may be)
    finally:
        if sub is not None:
            sub.close()
        assert stop_all(r, o) == [0, 0], [r.log()[-3000:], o.log()[-3000:]]


def test_a_keyframe_file_the_disk_cannot_hold_fails_at_creation_and_leaves_nothing(tiny_disk):
    """``subscribe --out`` on a disk too small for the version: the new file's preallocation fails with a clear
    StorageError before a byte is received (a sparse file used to stand in, and the disk filled mid-receive),
    and no temp file is left beside the target."""
    from deltasync.client.filetarget import FileTarget
    from deltasync.errors import StorageError

    layout = {"w": ("bfloat16", (8 << 20,))}  # 16 MB on an 8 MB disk
    target = FileTarget(tiny_disk / "model.safetensors", "m", layout=layout, open_existing=False)
    with pytest.raises(StorageError, match="cannot create"):
        target._new_file(layout, 0, "00" * 16)
    assert list(tiny_disk.iterdir()) == []
