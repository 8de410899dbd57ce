"""Issue 9: a relay's full disk is its own fault, one server per store directory, a negative cache for blobs no
parent has. Real server processes on loopback; the full disk is a real 20 MB tmpfs (mounting needs root: the
test is skipped with the reason otherwise)."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import time

import pytest

from server_fixtures import (
    KEY,
    TOKEN,
    keyframe,
    make_blob,
    metrics,
    origin,
    publish,
    put_blob,
    relay,
    session,
    start_all,
    stop_all,
    wait_for,
)


def test_a_second_server_on_one_store_directory_exits_with_a_clear_error(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    first = origin(tmp_path, "a", "--no-fsync")
    start_all(first)
    try:
        part = first.workdir / "a" / "tmp" / "keep.part"
        part.write_bytes(b"x")  # a temp file the first server owns
        second = origin(tmp_path, "a", "--no-fsync")
        second.name, second.log_path = "a2", tmp_path / "a2.log"
        second.start()
        assert second.proc.wait(30) != 0
        text = second.log()
        assert "in use by another server" in text and f"pid {first.pid}" in text, text
        assert part.exists()  # not wiped by the second one
        assert (first.workdir / "a" / "lock").read_text().strip() == str(first.pid)
    finally:
        assert stop_all(first) == [0], first.log()
    again = origin(tmp_path, "a", "--no-fsync")  # the lock goes with the process
    again.name, again.log_path = "a3", tmp_path / "a3.log"
    start_all(again)
    assert stop_all(again) == [0]


async def test_random_blob_ids_are_not_each_forwarded_upstream(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    o = origin(tmp_path, "o", "--no-fsync")
    r = relay(tmp_path, "r", [o.url], "--no-fsync")
    start_all(o, r)
    try:
        async with session() as s:
            bid = secrets.token_hex(16)
            before = (await metrics(s, o.url))["deltasync_blob_requests_total"]
            for _ in range(20):
                async with s.get(f"{r.url}/v1/blobs/{bid}") as resp:
                    assert resp.status == 404
                    assert (await resp.json())["error"]["code"] == "not_found"
                async with s.head(f"{r.url}/v1/blobs/{bid}") as resp:
                    assert resp.status == 404
            asked = (await metrics(s, o.url))["deltasync_blob_requests_total"] - before
            assert asked == 1, asked
            assert (await metrics(s, r.url))["deltasync_negative_hits_total"] == 39
            # the entry is short-lived: once the blob exists upstream, it is served within the TTL
            data = os.urandom(1000)
            from deltasync.blob import blob_id
            real = blob_id(data)
            async with s.get(f"{r.url}/v1/blobs/{real}") as resp:
                assert resp.status == 404
            assert await put_blob(s, o.url, real, data) in (200, 201)

            async def served():
                async with s.get(f"{r.url}/v1/blobs/{real}") as resp:
                    return resp.status == 200 and await resp.read() == data
            await wait_for(served, 10, interval=0.3, what="the blob after the negative entry expired")
    finally:
        assert stop_all(r, o) == [0, 0], [r.log(), o.log()]


@pytest.fixture()
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a 20 MB tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_a_full_disk_is_the_relays_own_fault(tmp_path, small_disk):
    (tmp_path / "token").write_text(TOKEN)
    o = origin(tmp_path, "o", "--no-fsync", key=True)
    r = relay(tmp_path, "r", [o.url], "--no-fsync", key=True)
    r.args[r.args.index("--cache") + 1] = str(small_disk / "cache")
    start_all(o, r)
    try:
        async with session() as s:
            big = make_blob(24 << 20, 1)  # more than the whole disk
            log_start = len(r.log())  # (the relay may have found its parent not yet listening at start)
            await publish(s, o.url, keyframe("full", 0, [big]), [big])
            async with s.get(f"{r.url}/v1/blobs/{big[0]}") as resp:
                body = await resp.json(content_type=None)
                assert resp.status == 507, body  # not a 200 and a cut-off body
                assert body["error"]["code"] == "insufficient_storage"
            async with s.get(f"{r.url}/healthz") as resp:
                health = await resp.json()
                assert resp.status == 503 and health["status"] == "degraded" and health["storage"], health
            await asyncio.sleep(2.0)  # the relay's prefetch has tried too
            async with s.get(f"{r.url}/v1/models/full/head") as resp:
                assert resp.status == 404  # v0 is not announced: it cannot be held
            log = r.log()[log_start:]
            assert "parent " + o.url + " failed" not in log, log[-3000:]
            assert (await metrics(s, r.url))["deltasync_upstream_failovers_total"] == 0
            # what fits is still served, and the relay is healthy again once a blob is stored
            small = make_blob(1 << 20, 2)
            await publish(s, o.url, keyframe("fits", 0, [small]), [small])
            async with s.get(f"{r.url}/v1/blobs/{small[0]}") as resp:
                assert resp.status == 200 and await resp.read() == small[1]

            async def healthy():
                async with s.get(f"{r.url}/healthz") as resp:
                    return resp.status == 200
            await wait_for(healthy, 10, what="healthz ok after a blob was stored")
            async with s.get(f"{o.url}/v1/blobs/{big[0]}") as resp:  # the origin was never at fault
                assert resp.status == 200
    finally:
        assert stop_all(r, o) == [0, 0], [r.log()[-3000:], o.log()[-3000:]]


async def test_a_relay_rechecks_manifests_it_serves_from_disk_and_refetches_bad_ones(tmp_path):
    """Issue 9: a relay whose cached manifests are damaged (garbage, or a changed signature) serves the good
    copy from its parent, for versions, the head and event replays alike."""
    import json

    o = origin(tmp_path, "o", "--no-fsync", key=True)
    (tmp_path / "token").write_text(TOKEN)
    r = relay(tmp_path, "r", [o.url], "--no-fsync", key=True)
    start_all(o, r)
    try:
        async with session() as s:
            blobs = [make_blob(1000, 7)]
            for v in (0, 1):  # each announced by the relay before the next (both are on its disk)
                await publish(s, o.url, keyframe("mc", v, blobs), blobs)

                async def announced():
                    async with s.get(f"{r.url}/v1/models/mc/head") as resp:
                        return resp.status == 200 and (await resp.json())["version"] == v
                await wait_for(announced, 20, what=f"the relay to announce v{v}")
            good = {}
            for v in (0, 1):
                async with s.get(f"{o.url}/v1/models/mc/versions/{v}") as resp:
                    good[v] = await resp.read()
            mdir = tmp_path / "r" / "models" / "mc"
            (mdir / f"{0:020d}.json").write_bytes(b"<html>garbage{")
            obj = json.loads(good[1])
            sig = obj["signature"]
            obj["signature"] = sig[:-1] + ("0" if sig[-1] != "0" else "1")
            (mdir / f"{1:020d}.json").write_bytes(json.dumps(obj).encode())
            for v in (0, 1):
                async with s.get(f"{r.url}/v1/models/mc/versions/{v}") as resp:
                    assert resp.status == 200 and await resp.read() == good[v]
            (mdir / f"{1:020d}.json").write_bytes(json.dumps(obj).encode())  # damaged again, after a good serve
            async with s.get(f"{r.url}/v1/models/mc/head") as resp:
                assert resp.status == 200 and await resp.read() == good[1]
            assert (mdir / f"{1:020d}.json").read_bytes() == good[1]  # repaired on disk
            assert (await metrics(s, r.url))["deltasync_corrupt_dropped_total"] == 3
            assert (await metrics(s, r.url))["deltasync_upstream_failovers_total"] == 0
    finally:
        assert stop_all(r, o) == [0, 0], [r.log()[-3000:], o.log()[-3000:]]


async def test_a_restarted_relay_rechecks_the_blobs_a_squash_reads_and_refetches_a_damaged_one(tmp_path):
    """A squash reads its chain's blobs from the relay's disk: after a restart they are rehashed first, as a
    blob served to a child is, so one damaged on disk (same size, other bytes) is dropped and fetched again
    and the squashed delta is the origin's, byte for byte (it used to be built from the damaged bytes)."""
    from deltasync.client.publisher import Publisher
    from deltasync.manifest import parse_manifest
    from deltasync.testing.trace import ModelShape, RLTrace
    from server_fixtures import fetch_squash, wait_for, wait_head

    o = origin(tmp_path, "o", "--no-fsync", key=True)
    r = relay(tmp_path, "r", [o.url], "--no-fsync", key=True)
    start_all(o, r)
    try:
        trace = RLTrace(ModelShape(vocab=256, hidden=32, layers=2, ffn=64), lr=1e-4, seed=5)
        with Publisher(o.url, "sq", TOKEN, KEY, keyframe_every=0) as p:
            for v in range(4):
                p.publish(v, {k: t.clone() for k, t in trace.step().items()})
            p.flush(60)
        async with session() as s:
            await wait_head(s, r.url, "sq", 3)
            async with s.get(f"{o.url}/v1/models/sq/versions/2") as resp:
                m2 = parse_manifest(await resp.read())
        victim = tmp_path / "r" / "blobs" / m2.blobs[0].id[:2] / m2.blobs[0].id
        # a relay announces a version once its blob fetch has started, so the head alone does not say the
        # blob is in the cache yet: wait until the copy is committed before stopping the relay
        async def cached():
            return victim.exists()
        await wait_for(cached, 30, what="the relay to cache v2's blob")
        assert stop_all(r) == [0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))  # same size, one byte changed
        start_all(r)
        got = await fetch_squash(r.url, "sq", 0, 3)
        assert got == await fetch_squash(o.url, "sq", 0, 3)
        async with session() as s:
            assert (await metrics(s, r.url))["deltasync_corrupt_dropped_total"] == 1
        assert victim.read_bytes() != bytes(data)  # fetched again
    finally:
        assert stop_all(r, o) == [0, 0], [r.log()[-3000:], o.log()[-3000:]]
