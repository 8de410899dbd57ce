"""Parents dying mid-blob, and servers restarting with everything they acknowledged."""

from __future__ import annotations

import asyncio
import json

import pytest

from server_fixtures import (
    GateProxy, KEY, keyframe, make_blob, metrics, origin, publish, put_blob, relay, session, start_all, stop_all,
    wait_for, wait_head,
)

MODEL = "failover"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    work = tmp_path_factory.mktemp("failover")
    o = origin(work)
    gate = GateProxy(o.port)
    a = relay(work, "a", [gate.url])
    b = relay(work, "b", [o.url])
    c = relay(work, "c", [a.url, b.url])
    start_all(o, a, b)
    start_all(c)  # after its parents, so it starts out following its primary
    yield o, gate, a, b, c
    gate.release()
    stop_all(c, b, a, o)
    gate.close()


async def test_parent_killed_mid_blob_child_finishes_from_fallback(servers):
    o, gate, a, b, c = servers
    bid, data = make_blob(12 << 20, 200)
    async with session() as s:
        assert await put_blob(s, o.url, bid, data) == 201

        async def c_follows_a():  # a counts as healthy again (it may have started after c)
            async with s.get(f"{c.url}/healthz") as r:
                return (await r.json())["following"] == a.url
        await wait_for(c_follows_a, what="c to follow its primary parent")
        before_b = await metrics(s, b.url)
        gate.hold_after(2 << 20)  # a gets ~2 MiB from the origin, then its link stalls
        async with s.get(f"{c.url}/v1/blobs/{bid}") as resp:
            assert resp.status == 200
            first = await asyncio.wait_for(resp.content.readexactly(256 << 10), 10)
            a.kill()  # the primary parent dies with the blob half delivered
            rest = await asyncio.wait_for(resp.read(), 30)
        assert first + rest == data
        mt = await metrics(s, c.url)
        assert mt["deltasync_upstream_resumes_total"] >= 1
        assert mt["deltasync_upstream_failovers_total"] >= 1
        assert mt["deltasync_hash_failures_total"] == 0
        after_b = await metrics(s, b.url)
        assert after_b["deltasync_blob_requests_total"] > before_b["deltasync_blob_requests_total"]
        # c resumed: it took fewer bytes from b than the whole blob
        assert mt["deltasync_bytes_in_total"] == len(data)
    assert "resum" in c.log().lower() or mt["deltasync_upstream_resumes_total"] >= 1
    gate.release()


async def test_servers_restart_with_everything_they_acknowledged(servers):
    o, _, a, b, c = servers
    blobs = [make_blob(1 << 20, 201), make_blob(777, 202)]
    kf = keyframe(MODEL, 1, blobs, key=KEY)
    async with session() as s:
        await publish(s, o.url, kf, blobs)
        await wait_head(s, c.url, MODEL, 1)  # c now follows b (a is dead)
        async with s.get(f"{c.url}/v1/blobs/{blobs[0][0]}") as r:
            assert await r.read() == blobs[0][1]

        async def c_complete():
            return (await metrics(s, c.url))["deltasync_inflight_blobs"] == 0
        await wait_for(c_complete, what="c to finish prefetching")

    o.restart()
    async with session() as s:
        async with s.get(f"{o.url}/v1/models/{MODEL}/head") as r:
            assert r.status == 200 and await r.read() == kf.to_json()
        for bid, data in blobs:
            async with s.get(f"{o.url}/v1/blobs/{bid}") as r:
                assert await r.read() == data

    stop_all(o, b)
    c.restart()  # no parent is alive: whatever c serves now comes from its own disk
    async with session() as s:
        for bid, data in [*blobs, make_blob(12 << 20, 200)]:
            async with s.get(f"{c.url}/v1/blobs/{bid}") as r:
                assert r.status == 200 and r.headers["X-Deltasync-Cache"] == "hit"
                assert await r.read() == data
        async with s.get(f"{c.url}/v1/models/{MODEL}/head") as r:
            assert r.status == 200 and json.loads(await r.read())["version"] == 1
        async with s.get(f"{c.url}/v1/models/{MODEL}/versions/1") as r:
            assert await r.read() == kf.to_json()
        mt = await metrics(s, c.url)
        assert mt["deltasync_upstream_fetches_total"] == 0
        assert mt["deltasync_store_blobs"] == 3
        async with s.get(f"{c.url}/healthz") as r:
            body = await r.json()
            assert r.status == 200 and body["role"] == "relay" and body["models"] == {MODEL: 1}


@pytest.mark.parametrize("damage", ["bitrot", "torn", "zeros"])
async def test_relay_drops_a_blob_corrupted_on_its_disk_and_refetches_it(tmp_path, damage):
    """A relay trusts nothing it did not verify in this run: blobs found on disk at start are
    rehashed before they are first served, so a corrupted cache heals instead of being re-served.
    This is also what makes a relay's blobs safe without fsync: after a power loss a blob renamed into
    place before its pages reached the disk is short (``torn``) or reads as zeros (``zeros``)."""
    o = origin(tmp_path)
    r = relay(tmp_path, "r", [o.url])
    start_all(o, r)
    try:
        bid, data = make_blob(3 << 20, 77)
        async with session() as s:
            assert await put_blob(s, o.url, bid, data) == 201
            async with s.get(f"{r.url}/v1/blobs/{bid}") as resp:
                assert await resp.read() == data

            async def stored():
                return (await metrics(s, r.url))["deltasync_inflight_blobs"] == 0
            await wait_for(stored, what="the relay to store the blob")
        path = tmp_path / "r" / "blobs" / bid[:2] / bid
        assert path.exists()
        r.stop()
        raw = bytearray(path.read_bytes())
        if damage == "bitrot":
            raw[12345] ^= 0x01  # bit rot while the relay was down
        elif damage == "torn":
            del raw[len(raw) // 2:]  # the tail never reached the disk
        else:
            raw[1 << 20:] = bytes(len(raw) - (1 << 20))  # allocated blocks never written: zeros
        path.write_bytes(bytes(raw))
        r.restart()
        async with session() as s:
            async with s.get(f"{r.url}/v1/blobs/{bid}") as resp:
                assert resp.status == 200
                assert await resp.read() == data  # refetched from the origin, not the rotten copy
            mt = await metrics(s, r.url)
            assert mt["deltasync_corrupt_dropped_total"] == 1
            assert mt["deltasync_upstream_fetches_total"] == 1

            async def stored_again():
                return (await metrics(s, r.url))["deltasync_inflight_blobs"] == 0
            await wait_for(stored_again, what="the relay to store the refetched blob")
            async with s.get(f"{r.url}/v1/blobs/{bid}") as resp:  # now verified: a plain hit
                assert await resp.read() == data and resp.headers["X-Deltasync-Cache"] == "hit"
        assert path.read_bytes() == data
    finally:
        stop_all(r, o)
