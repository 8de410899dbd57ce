"""Issue 9: one bad relay listed first does not stop its subscribers when a good source is listed.

A real origin (LocalCluster, subprocesses) and a tiny in-process aiohttp "bad relay" on loopback that serves
garbage heads/manifests, or the origin's manifests with a broken signature (blobs passed through intact).
``subscribe --from BAD --from ORIGIN --once`` (CLI, subprocess) and a ``Subscriber`` converge bit-exactly
from the origin, in bounded time."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from deltasync.cli.cluster import LocalCluster
from deltasync.client.http import HttpClient
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.errors import SignatureError, UpstreamError
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape
from core_support import same_state as _same
from cluster_support import origin_only, publish_trace

KEY = bytes(range(11, 43))
SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)
MODES = ("garbage", "badsig", "wrongversion")


class BadRelay:
    """An aiohttp server on its own thread; ``mode`` picks how it lies about heads and manifests."""

    def __init__(self, origin: str, mode: str) -> None:
        self.origin, self.mode = origin, mode
        self.hits = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(20)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._session = aiohttp.ClientSession()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path_qs
        async with self._session.get(self.origin + path) as r:
            body, status = await r.read(), r.status
            headers = {k: v for k, v in r.headers.items() if k.lower().startswith("x-deltasync") or k.lower() == "etag"}
        is_manifest = "/head" in path or "/versions/" in path or "/delta" in path
        if status != 200 or not is_manifest:
            return web.Response(status=status, body=body, headers=headers)  # blobs and the rest: intact
        self.hits += 1
        if self.mode == "garbage":
            body = b"<html>not json{" + body[:50]
        elif self.mode == "badsig":
            obj = json.loads(body)
            sig = obj["signature"]
            obj["signature"] = sig[:-1] + ("0" if sig[-1] != "0" else "1")
            body = json.dumps(obj).encode()
        else:  # a well-signed manifest of another version (a replay): verified, but not what was asked
            obj = json.loads(body)
            if "/versions/" in path and obj["version"] > 0:
                async with self._session.get(f"{self.origin}/v1/models/{obj['model']}/versions/0") as r0:
                    body = await r0.read()
        return web.Response(status=200, body=body, headers=headers, content_type="application/json")

    def close(self) -> None:
        async def stop():
            await self._session.close()
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(20)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(20)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with origin_only(tmp_path_factory.mktemp("bad-relay"), KEY) as c:
        yield c


@pytest.fixture(scope="module")
def published(cluster):
    """v0 keyframe, v1 and v2 deltas of model 'bf' on the origin."""
    return publish_trace(cluster, "bf", SHAPE, KEY, seed=33, steps=3)


@pytest.mark.parametrize("mode", MODES)
def test_subscribe_once_fails_over_from_a_bad_relay(cluster, published, tmp_path, mode):
    bad = BadRelay(cluster.origin, mode)
    try:
        out = tmp_path / "out.safetensors"
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "deltasync.client.cli", "subscribe", "--from", bad.url,
                            "--from", cluster.origin, "--model", "bf", "--key-file", str(cluster.key_file),
                            "--out", str(out), "--once", "--timeout", "60"], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert bad.hits > 0  # the bad relay was asked first, and lied
        assert _same(read_state_file(out), published[-1])
        assert took < 30, took
    finally:
        bad.close()


@pytest.mark.parametrize("mode", MODES)
def test_subscriber_converges_from_the_origin_behind_a_bad_relay(cluster, published, mode):
    bad = BadRelay(cluster.origin, mode)
    target = {n: torch.zeros_like(t) for n, t in published[-1].items()}
    try:
        sub = ThreadedSubscriber([bad.url, cluster.origin], "bf", target, verifier=KEY)
        try:
            sub.start()
            t0 = time.monotonic()
            assert sub.wait_version(2, 30) == 2
            assert time.monotonic() - t0 < 30
            assert _same(target, published[-1])
        finally:
            sub.close()
        assert bad.hits > 0
    finally:
        bad.close()


def test_a_bad_body_on_every_source_is_still_a_clear_error(cluster, published):
    bad = BadRelay(cluster.origin, "badsig")

    async def go():
        from deltasync.manifest import parse_manifest
        async with HttpClient([bad.url], check_manifest=lambda b: parse_manifest(b, verifier=KEY)) as c:
            with pytest.raises(SignatureError):
                await c.get_head("bf")
            with pytest.raises(SignatureError):
                await c.get_manifest("bf", 1)
        before = bad.hits
        async with HttpClient([bad.url, cluster.origin], check_manifest=lambda b: parse_manifest(b, verifier=KEY)) as c:
            head = await c.get_head("bf")
            assert head.version == 2 and c.last_url == cluster.origin
            assert c.failover.failures(bad.url) == 1  # marked down: the next read starts at the origin
            parse_manifest(await c.get_manifest("bf", 1), verifier=KEY)
            assert c.last_url == cluster.origin and bad.hits == before + 1
        garbage = BadRelay(cluster.origin, "garbage")
        try:
            async with HttpClient([garbage.url]) as c:
                with pytest.raises(UpstreamError, match="not JSON"):
                    await c.get_head("bf")
        finally:
            garbage.close()

    try:
        asyncio.run(go())
    finally:
        bad.close()
