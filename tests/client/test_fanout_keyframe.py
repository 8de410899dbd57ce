"""The full copy's fan-out (issue 10): a keyframe shard received through ``ShardSink``'s small reused buffer
and ``pwrite`` into the new file, its fingerprints summed from that buffer (a lane cut between two receives
carried over), and the head long-poll a subscriber started before the first version waits on (``after=-1``).

Real tensors, a real file, a real in-process origin on a loopback port; the receive pieces are cut at random
sizes (odd ones too: a bf16 lane split between two pieces) and against a buffer made small, so every carry
and every buffer boundary is crossed.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

import deltasync.client.filetarget as filetarget
from deltasync.client.filetarget import FileTarget, KeyframeWriter
from deltasync.client.http import HttpClient, Timeouts
from deltasync.errors import FormatError, IntegrityError
from deltasync.fingerprint import tensor_fingerprint
from deltasync.keyframe import encode_keyframe

from inprocess_servers import origin_config, serving
from server_fixtures import KEY, TOKEN

FAST = Timeouts(connect=2.0, read=2.0, request=20.0, ttfb=2.0, cooldown=0.2, hedge_after=None)


def _state(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 77, generator=g).bfloat16(),
        "b.ids": torch.randint(-100, 100, (331,), generator=g, dtype=torch.int8),  # 1-byte lanes, odd length
        "c.bias": torch.randn(129, generator=g),
        "d.empty": torch.empty(0, 3, dtype=torch.float16),
        "e.f64": torch.randn(13, generator=g, dtype=torch.float64),
    }


def _writer(tmp_path: Path, enc) -> tuple[FileTarget, KeyframeWriter]:
    layout = {t.name: (t.dtype, tuple(t.shape)) for t in enc.manifest.tensors}
    target = FileTarget(tmp_path / "f.safetensors", "m", layout=layout, open_existing=False)
    return target, KeyframeWriter(target, enc.manifest)


def _feed(sink, data: bytes, rng: random.Random) -> None:
    """The shard's bytes into ``sink`` as a receive loop would: ``buffer``, a piece of random size, ``received``."""
    view = memoryview(data)
    at = 0
    while at < len(view):
        room = sink.buffer(at)
        assert len(room) > 0
        k = min(len(room), len(view) - at, rng.choice((1, 2, 3, rng.randrange(1, 64), rng.randrange(1, 5000))))
        room[:k] = view[at:at + k]
        sink.received(at, k)
        at += k


def _mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.parametrize("bounce", [64, 4096, 1 << 20], ids=["tiny-buffer", "4k-buffer", "default-buffer"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shards_cut_anywhere_land_bit_exact_with_their_fingerprints(tmp_path, monkeypatch, bounce, seed):
    monkeypatch.setattr(filetarget, "BOUNCE", bounce)
    state = _state(seed)
    enc = encode_keyframe(state, model="m", version=2, shard_bytes=16 << 10)
    assert len(enc.manifest.blobs) > 1
    target, w = _writer(tmp_path, enc)
    rng = random.Random(seed)
    refs = list(enc.manifest.blobs)
    rng.shuffle(refs)  # shards arrive in any order
    for ref in refs:
        sink = w.shard_sink(ref.size)
        _feed(sink, enc.blobs[ref.id], rng)
        w.add_received(sink)
    w.commit()
    got = target.tensors()
    for n, t in state.items():
        if t.numel():
            assert torch.equal(got[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
    assert target.scan() == {n: tensor_fingerprint(t) for n, t in state.items()}
    assert target.version == 2
    target.close()


@pytest.mark.parametrize("parsed", [False, True], ids=["in-memory", "parsed-format-3"])
def test_a_keyframe_is_checked_from_its_columns_and_a_missing_shard_fails_the_commit(tmp_path, parsed):
    """A parsed format-3 keyframe is laid out, checked and committed from its table's columns (no record made:
    ~0.3 s at 70,000 tensors); a shard never received fails the commit, naming a tensor, and nothing is renamed
    into place."""
    from deltasync.manifest import parse_manifest, table_columns

    state = _state(4)
    enc = encode_keyframe(state, model="m", version=2, shard_bytes=16 << 10)
    m = parse_manifest(enc.manifest.compact().to_json()) if parsed else enc.manifest
    assert (table_columns(m) is not None) == parsed
    for drop in (False, True):
        path = tmp_path / f"{drop}.safetensors"
        target = FileTarget(path, "m", open_existing=False, layout_from_keyframe=True)
        w = KeyframeWriter(target, m)
        refs = list(m.blobs)
        for ref in refs[1:] if drop else refs:
            sink = w.shard_sink(ref.size)
            _feed(sink, enc.blobs[ref.id], random.Random(1))
            w.add_received(sink)
        if drop:
            with pytest.raises(IntegrityError, match="no shard held"):
                w.commit()
            w.abort()
            assert not path.exists() and not w._tmp.exists()
            continue
        w.commit()
        assert target.version == 2 and target.scan() == {n: tensor_fingerprint(t) for n, t in state.items()}
        target.close()
    if parsed:
        assert "made" not in m.tensors.__dict__  # no record was made


def test_a_flipped_byte_in_a_cut_lane_fails_the_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setattr(filetarget, "BOUNCE", 64)
    enc = encode_keyframe(_state(), model="m", version=2, shard_bytes=1 << 30)
    (ref,) = enc.manifest.blobs
    data = bytearray(enc.blobs[ref.id])
    data[-100] ^= 0x01  # in the last tensor's bytes (the shard header comes first)
    target, w = _writer(tmp_path, enc)
    sink = w.shard_sink(ref.size)
    _feed(sink, bytes(data), random.Random(5))
    with pytest.raises(IntegrityError, match="fingerprint"):
        w.add_received(sink)
    w.abort()
    assert not w._tmp.exists()


def test_receiving_a_keyframe_touches_no_page_of_the_new_files_map(tmp_path):
    """The bytes go in by ``pwrite`` and are summed from the buffer: the map stays unpopulated (no page faults
    on the way in, nothing to unmap at close), only the header page the file was created with may be in."""
    g = torch.Generator().manual_seed(9)
    state = {"w": torch.randn(1 << 20, generator=g).bfloat16()}  # 2 MiB: 512 pages
    enc = encode_keyframe(state, model="m", version=1, shard_bytes=1 << 30)
    target, w = _writer(tmp_path, enc)
    (ref,) = enc.manifest.blobs
    sink = w.shard_sink(ref.size)
    _feed(sink, enc.blobs[ref.id], random.Random(1))
    w.add_received(sink)
    assert _mapped_rss_kib(w._tmp) <= 64, "the receive wrote or read through the new file's map"
    w.commit()
    assert torch.equal(target.tensors()["w"].view(torch.int16), state["w"].view(torch.int16))
    target.close()


async def test_a_head_long_poll_after_minus_one_wakes_on_the_first_commit(tmp_path):
    enc = encode_keyframe(_state(), model="m", version=0, shard_bytes=16 << 10)
    m = enc.manifest.with_digests(enc.blobs).sign(KEY)
    async with serving(origin_config(store_dir=tmp_path / "o")) as (url, _):
        async with HttpClient(url, token=TOKEN, timeouts=FAST) as c:
            assert await c.get_head("m") is None
            waiting = asyncio.ensure_future(c.get_head("m", after=-1, wait=10))
            await asyncio.sleep(0)  # (only lets the request start; the answer waits on the commit)
            assert not waiting.done()
            for bid, data in enc.blobs.items():
                await c.put_blob(bid, data)
            await c.put_manifest("m", 0, m.to_json())
            head = await asyncio.wait_for(waiting, 10)
            assert head is not None and head.version == 0 and head.body == m.to_json()
            ran_out = await c.get_head("m2", after=-1, wait=0)  # nothing of m2: the long-poll runs out, 204
            assert ran_out is None
            with pytest.raises(FormatError):
                await c.get_head("m", after=-2, wait=0)


def test_subscribe_started_before_the_first_version_takes_the_keyframe_and_exits(tmp_path):
    """A real origin process and a real ``subscribe --out F --until 0`` started before anything is published:
    it waits on the head long-poll, streams the keyframe into F when v0 commits, and ends there (no
    subscriber is started for a version it already holds: its timeline has no ``subscriber-closed``)."""
    import os
    import subprocess
    import sys

    from deltasync.cli.cluster import LocalCluster
    from deltasync.client.publisher import Publisher
    from deltasync.tensorfile import read_state_file

    key = bytes(range(7, 39))
    state = _state(4)
    with LocalCluster(tmp_path / "servers", key=key) as c:
        c.start_origin()
        out = tmp_path / "out.safetensors"
        sub = subprocess.Popen([sys.executable, "-m", "deltasync.client.cli", "subscribe", "--from", c.origin,
                                "--model", "m", "--key-file", str(c.key_file), "--out", str(out), "--until", "0",
                                "--timeout", "120", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "DELTASYNC_TIMELINE": "1"})
        try:
            with Publisher(c.origin, "m", c.token, key, keyframe_every=0) as pub:
                pub.publish(0, state)
                pub.flush(60)
            log, _ = sub.communicate(timeout=120)
        finally:
            sub.kill()
        assert sub.returncode == 0, log
    assert "kf-seen" in log and "kf-committed" in log and "subscriber-closed" not in log, log
    got = read_state_file(out)
    for n, t in state.items():
        assert torch.equal(got[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
