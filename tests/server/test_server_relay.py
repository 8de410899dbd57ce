"""Relay behaviour: cut-through, coalescing, hash failures, slow readers (upstream pace under test control),
and the cache size budget."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from server_fixtures import (
    FakeParent, GateProxy, delta, keyframe, make_blob, metrics, origin, publish, put_blob, relay, session,
    start_all, stop_all, wait_for, wait_head,
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    work = tmp_path_factory.mktemp("streaming")
    o = origin(work)
    gate = GateProxy(o.port)
    bad = FakeParent()
    r = relay(work, "relay", [gate.url], "--read-timeout", "15", "--write-timeout", "2")
    r2 = relay(work, "relay2", [bad.url, o.url])
    small = relay(work, "small", [o.url], "--cache-size", "3M", "--retention", "1")
    start_all(o, r, r2, small)
    yield o, gate, r, r2, bad, small
    gate.release()
    assert stop_all(r, r2, small, o) == [0, 0, 0, 0]
    gate.close()
    bad.close()


async def test_cut_through_child_gets_first_bytes_before_relay_has_the_last(servers):
    o, gate, r, *_ = servers
    bid, data = make_blob(8 << 20, 100)
    async with session() as s:
        assert await put_blob(s, o.url, bid, data) == 201
        gate.hold_after(1 << 20)  # the relay's parent link stalls after ~1 MiB
        try:
            async with s.get(f"{r.url}/v1/blobs/{bid}") as resp:
                assert resp.status == 200
                assert resp.headers["X-Deltasync-Cache"] == "miss"
                assert int(resp.headers["Content-Length"]) == len(data)
                first = await asyncio.wait_for(resp.content.read(64 << 10), 10)
                assert first == data[: len(first)] and len(first) > 0
                # The relay is still receiving: the blob is in flight and not in its store.
                mt = await metrics(s, r.url)
                assert mt["deltasync_inflight_blobs"] == 1
                assert mt["deltasync_store_blobs"] == 0
                assert mt["deltasync_bytes_in_total"] < len(data)
                gate.release()
                rest = await resp.read()
        finally:
            gate.release()
        assert first + rest == data

        async def stored():  # the last byte goes out once verified; the rename into the store follows
            mt = await metrics(s, r.url)
            return mt["deltasync_store_blobs"] == 1 and mt["deltasync_inflight_blobs"] == 0
        await wait_for(stored, 10, what="the blob to be moved into the store")
        # Now complete on disk: a hit, Range works
        async with s.get(f"{r.url}/v1/blobs/{bid}", headers={"Range": "bytes=1000-"}) as resp:
            assert resp.status == 206 and resp.headers["X-Deltasync-Cache"] == "hit"
            assert await resp.read() == data[1000:]


async def test_a_version_is_announced_before_its_parent_answers_for_the_blobs(tmp_path):
    """The manifest gives every blob's size: the relay makes room and announces the version at once, before
    any parent answered a blob GET, and a child asking for a blob is told its size and gets the bytes as they
    come (they used to wait for every answer's head)."""
    o = origin(tmp_path)
    start_all(o)
    gate = GateProxy(o.port)
    r = relay(tmp_path, "early", [gate.url])
    start_all(r)
    try:
        bid, data = make_blob(3 << 20, 140)
        async with session() as s:
            gate.hold_blob_answers()
            await publish(s, o.url, keyframe("early", 0, [(bid, data)]), [(bid, data)])
            await wait_head(s, r.url, "early", 0, timeout=15)  # while the relay's blob fetch has no answer
            mt = await metrics(s, r.url)
            assert mt["deltasync_inflight_blobs"] == 1 and mt["deltasync_bytes_in_total"] == 0
            async with s.get(f"{r.url}/v1/blobs/{bid}") as resp:
                assert resp.status == 200 and int(resp.headers["Content-Length"]) == len(data)
                gate.release()
                assert await resp.read() == data
    finally:
        gate.release()
        assert stop_all(r, o) == [0, 0]
        gate.close()


async def test_32_concurrent_requests_cause_one_upstream_fetch(servers):
    o, gate, r, *_ = servers
    bid, data = make_blob(4 << 20, 101)
    async with session(connector=aiohttp.TCPConnector(limit=0)) as s:
        assert await put_blob(s, o.url, bid, data) == 201
        before_r, before_o = await metrics(s, r.url), await metrics(s, o.url)
        gate.hold_after(256 << 10)
        try:
            async def fetch():
                async with s.get(f"{r.url}/v1/blobs/{bid}") as resp:
                    return resp.status, await resp.read()

            tasks = [asyncio.create_task(fetch()) for _ in range(32)]

            async def all_arrived():
                mt = await metrics(s, r.url)
                return mt["deltasync_blob_requests_total"] - before_r["deltasync_blob_requests_total"] >= 32
            await wait_for(all_arrived, 20, what="32 requests at the relay")
        finally:
            gate.release()
        results = await asyncio.gather(*tasks)
        assert all(st == 200 and body == data for st, body in results)
        after_r, after_o = await metrics(s, r.url), await metrics(s, o.url)
        assert after_r["deltasync_upstream_fetches_total"] - before_r["deltasync_upstream_fetches_total"] == 1
        assert after_r["deltasync_coalesced_total"] - before_r["deltasync_coalesced_total"] == 31
        assert after_o["deltasync_blob_requests_total"] - before_o["deltasync_blob_requests_total"] == 1


async def test_blob_failing_its_hash_is_discarded_refetched_and_never_served_complete(servers):
    o, _, _, r2, bad, _ = servers
    bid, data = make_blob(3 << 20, 102)
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0xFF
    bad.blobs[bid] = bytes(corrupt)  # r2's first parent lies about this blob
    async with session() as s:
        assert await put_blob(s, o.url, bid, data) == 201
        got = None
        try:
            async with s.get(f"{r2.url}/v1/blobs/{bid}") as resp:
                got = await resp.read()
        except aiohttp.ClientPayloadError:
            pass  # cut off: it had started streaming the bad copy
        assert got is None or got == data  # never the bad bytes as a complete blob
        async with s.get(f"{r2.url}/v1/blobs/{bid}") as resp:
            assert resp.status == 200 and await resp.read() == data
        mt = await metrics(s, r2.url)
        assert mt["deltasync_hash_failures_total"] >= 1
        assert mt["deltasync_upstream_failovers_total"] == 0  # the bad parent answered, its bytes were wrong
        blob_file = r2.workdir / "relay2" / "blobs" / bid[:2] / bid

        async def stored():
            return blob_file.exists()
        await wait_for(stored, 10, what="the good copy in the store")
    assert blob_file.read_bytes() == data


async def test_a_blob_no_parent_has_is_404(servers):
    _, _, _, r2, *_ = servers
    async with session() as s:
        async with s.get(f"{r2.url}/v1/blobs/{'0' * 32}") as resp:
            assert resp.status == 404, await resp.text()
            assert (await resp.json())["error"]["code"] == "not_found"
        async with s.head(f"{r2.url}/v1/blobs/{'0' * 32}") as resp:
            assert resp.status == 404


async def test_a_stalled_reader_does_not_hold_up_others_and_is_cut_off(servers):
    o, _, r, *_ = servers
    bid, data = make_blob(16 << 20, 103)
    async with session() as s:
        assert await put_blob(s, o.url, bid, data) == 201
        async with s.get(f"{r.url}/v1/blobs/{bid}") as resp:
            assert await resp.read() == data  # cached now
        before = await metrics(s, r.url)
        # A reader that asks and never reads, with a tiny receive buffer.
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", r.port))
        stalled.sendall(f"GET /v1/blobs/{bid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        try:
            await asyncio.sleep(0.3)
            for _ in range(3):  # others are served meanwhile
                async with s.get(f"{r.url}/v1/blobs/{bid}") as resp:
                    assert await resp.read() == data

            async def cut_off():
                mt = await metrics(s, r.url)
                return mt["deltasync_send_aborts_total"] > before["deltasync_send_aborts_total"]
            await wait_for(cut_off, 15, what="the stalled reader to be cut off (write timeout 2 s)")
        finally:
            stalled.close()


async def test_cache_budget_evicts_unpinned_blobs_and_refetches_them_on_demand(servers):
    o, *_, small = servers
    model = "budget"
    versions = [(keyframe(model, 1, b := [make_blob(1 << 20, 300)], key=None), b)]
    for v in range(2, 6):
        versions.append((delta(model, v, v - 1, b := [make_blob(1 << 20, 300 + v)], key=None), b))
    async with session() as s:
        for m, blobs in versions:
            await publish(s, o.url, m, blobs)
            await wait_head(s, small.url, model, m.version)

        async def settled():
            mt = await metrics(s, small.url)
            return mt["deltasync_inflight_blobs"] == 0 and mt["deltasync_evictions_total"] >= 2
        await wait_for(settled, what="evictions at the small relay")
        mt = await metrics(s, small.url)
        assert mt["deltasync_store_bytes"] <= 3 << 20
        assert mt["deltasync_store_pinned_bytes"] == 2 << 20  # newest version (retention 1) + newest keyframe
        assert mt["deltasync_store_budget_bytes"] == 3 << 20
        for m, blobs in (versions[0], versions[-1]):  # pinned: still here
            async with s.get(f"{small.url}/v1/blobs/{blobs[0][0]}") as r:
                assert r.headers["X-Deltasync-Cache"] == "hit" and await r.read() == blobs[0][1]
        for m, blobs in versions[1:-1]:  # evicted or not, every blob is still served, bit-exact
            async with s.get(f"{small.url}/v1/blobs/{blobs[0][0]}") as r:
                assert r.status == 200 and await r.read() == blobs[0][1]
        mt = await metrics(s, small.url)
        assert mt["deltasync_cache_misses_total"] >= 1
