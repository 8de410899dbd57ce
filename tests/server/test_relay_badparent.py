"""A relay's parent that lies (wrong Content-Length, cut bodies, bytes that fail the signed digest).

Real aiohttp servers in this process on 127.0.0.1 (origin and relay), with the fault campaign's proxy
(tests/faults/proxy.py) as the relay's preferred parent and the origin as its second. Whatever the
proxy does, a child of the relay either gets the blob's exact bytes or a response cut short (never
a clean end of wrong bytes), the lying parent is put down in the relay's failover at once, and the
child has the blob within a few seconds (the servers' read timeout here is 5 s: a relay that waited
for bytes a parent never sends would show it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import pytest

from deltasync.digest import blob_digest
from deltasync.server.config import ServerConfig
from faults.proxy import FaultProxy
from inprocess_servers import FAST, origin_config, relay_config, serving
from server_fixtures import KEY, TOKEN, keyframe, make_blob, publish, put_blob, session, wait_head

MODEL = "liar"
CONVERGE = 4.0  # seconds a child may take to hold the blob (the read timeout is 5 s)


async def _child_gets(s: aiohttp.ClientSession, url: str, bid: str, data: bytes, *, within: float) -> tuple[int, float]:
    """GET the blob from ``url`` until a response ends cleanly; every clean end must be the exact bytes.
    Returns (responses cut short, seconds taken)."""
    t0 = time.monotonic()
    cut = 0
    while True:
        try:
            async with s.get(f"{url}/v1/blobs/{bid}") as r:
                if r.status == 200:
                    body = await r.read()
                    assert len(body) == len(data) and body == data, (
                        f"a clean {len(body)}-byte answer that is not the blob ({len(data)} bytes)")
                    return cut, time.monotonic() - t0
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            cut += 1
        assert time.monotonic() - t0 < within, f"no good copy within {within} s ({cut} cut short)"
        await asyncio.sleep(0.05)


def _put_down(svc, parent: str) -> bool:
    return svc.upstream.failover.failures(parent) >= 1


@pytest.mark.parametrize("mode,delta", [("length", 9), ("length", -9), ("truncate", 0)],
                         ids=["length+9", "length-9", "truncate"])
async def test_liar_without_manifest_cuts_children_and_is_put_down(tmp_path, mode, delta):
    """A blob no manifest names (a child asks first): the parent's size is only its word."""
    async with serving(origin_config(store_dir=tmp_path / "o")) as (o_url, _):
        proxy = FaultProxy(int(o_url.rsplit(":", 1)[1]), mode="pass", delta=delta)
        try:
            async with serving(relay_config([proxy.url, o_url], store_dir=tmp_path / "r")) as (r_url, r_svc):
                async with session() as s:
                    bid, data = make_blob(3 << 20, 7)
                    assert await put_blob(s, o_url, bid, data) == 201
                    proxy.set_mode(mode)
                    await _child_gets(s, r_url, bid, data, within=CONVERGE)
                    assert _put_down(r_svc, proxy.url), r_svc.upstream.failover.health(time.monotonic())
                    assert r_svc.store.has_blob(bid) or r_svc.fetcher.inflight(bid) is not None
                    # the relay's cached copy is the blob (served from disk now)
                    await _child_gets(s, r_url, bid, data, within=CONVERGE)
        finally:
            proxy.close()


@pytest.mark.parametrize("mode,delta", [("length", 9), ("length", -9), ("truncate", 0)],
                         ids=["length+9", "length-9", "truncate"])
async def test_liar_with_manifest_is_refused_at_the_head(tmp_path, mode, delta):
    """A published version: the relay knows each blob's size from the manifest, so a parent announcing
    another is put down before a byte is taken, and the version reaches the child within seconds."""
    async with serving(origin_config(store_dir=tmp_path / "o")) as (o_url, _):
        proxy = FaultProxy(int(o_url.rsplit(":", 1)[1]), mode=mode, delta=delta)
        try:
            async with serving(relay_config([proxy.url, o_url], store_dir=tmp_path / "r")) as (r_url, r_svc):
                async with session() as s:
                    blobs = [make_blob(2 << 20, 11), make_blob(300_000, 12)]
                    t0 = time.monotonic()
                    await publish(s, o_url, keyframe(MODEL, 1, blobs), blobs)
                    await wait_head(s, r_url, MODEL, 1, timeout=CONVERGE)
                    for bid, data in blobs:
                        await _child_gets(s, r_url, bid, data, within=CONVERGE)
                    assert time.monotonic() - t0 < CONVERGE + 1
                    assert _put_down(r_svc, proxy.url)
                    assert r_svc.metrics.get("hash_failures") == 0  # refused at the head, not after the bytes
        finally:
            proxy.close()


async def test_relay_with_key_checks_the_signed_digest(tmp_path):
    """The bytes hash to their id (xxh3) but not to the digest the signed manifest gives: a relay that holds
    the key never hands them on as a complete blob nor caches them; a relay without a key relays them (its
    children, holding the key, check the digest themselves)."""
    origin = ServerConfig(role="origin", host="127.0.0.1", port=0, store_kind="disk", store_dir=tmp_path / "o",
                          token=TOKEN, verifier=None, fsync=False, timeouts=FAST)  # no key: cannot check digests
    async with serving(origin) as (o_url, _):
        bid, data = make_blob(1 << 20, 21)
        m = keyframe(MODEL, 1, [(bid, data)], key=None)
        wrong = blob_digest(data[:-1] + bytes([data[-1] ^ 1]))
        m = dataclasses.replace(m, format=2, blobs=(dataclasses.replace(m.blobs[0], digest=wrong),)).sign(KEY)
        async with session() as s:
            await publish(s, o_url, m, [(bid, data)])
            async with serving(relay_config([o_url], store_dir=tmp_path / "k")) as (k_url, k_svc), \
                    serving(dataclasses.replace(relay_config([o_url], store_dir=tmp_path / "n"), verifier=None)) as (n_url, _):
                await wait_head(s, n_url, MODEL, 1)
                await _child_gets(s, n_url, bid, data, within=CONVERGE)  # no key: relayed on xxh3
                clean = 0
                t0 = time.monotonic()
                while time.monotonic() - t0 < 3.0:
                    try:
                        async with s.get(f"{k_url}/v1/blobs/{bid}") as r:
                            if r.status == 200:
                                await r.read()
                                clean += 1
                    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                        pass
                    await asyncio.sleep(0.1)
                assert clean == 0, "a relay holding the key handed on bytes that fail the signed digest"
                assert not k_svc.store.has_blob(bid)
