"""The HTTP client against misbehaving servers on loopback: cut transfers resume, silence times out, 5xx fails over."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from deltasync.blob import blob_id
from deltasync.errors import UpstreamError as TransportError
from deltasync.client.http import HttpClient, Timeouts
from deltasync.errors import NotFoundError

DATA = bytes(range(256)) * 4096  # 1 MiB
BID = blob_id(DATA)


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_a_cut_transfer_resumes_with_range():
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        rng = request.headers.get("Range")
        seen.append(rng)
        if rng is None:  # first try: promise everything, send half, drop the connection
            resp = web.StreamResponse(headers={"Content-Length": str(len(DATA))})
            await resp.prepare(request)
            await resp.write(DATA[: len(DATA) // 2])
            request.transport.abort()
            return resp
        start = int(rng.split("=")[1].rstrip("-"))
        return web.Response(status=206, body=DATA[start:], headers={"Content-Range": f"bytes {start}-{len(DATA) - 1}/{len(DATA)}"})

    runner, url = await _serve(handler)
    try:
        async with HttpClient(url) as c:
            assert await c.get_blob(BID, len(DATA)) == DATA
            assert c.stats.resumes == 1
        assert seen[0] is None and seen[1] is not None and seen[1].startswith("bytes=")
    finally:
        await runner.cleanup()


async def test_a_silent_server_times_out_and_the_next_one_answers():
    async def silent(request: web.Request) -> web.Response:
        await asyncio.sleep(3)
        return web.Response(body=b"")

    async def good(request: web.Request) -> web.Response:
        return web.Response(body=DATA)

    r1, slow = await _serve(silent)
    r2, fast = await _serve(good)
    try:
        async with HttpClient([slow, fast], timeouts=Timeouts(connect=1, read=0.5, request=5)) as c:
            t0 = time.monotonic()
            assert await c.get_blob(BID) == DATA
            assert time.monotonic() - t0 < 5
            assert c.stats.failovers == 1 and c.last_url == fast
        async with HttpClient([slow], timeouts=Timeouts(connect=1, read=0.5, request=5)) as c:
            with pytest.raises(TransportError):
                await c.get_manifest("m", 1)
    finally:
        await r1.cleanup()
        await r2.cleanup()


async def test_5xx_and_corrupt_bytes_fail_over_404_everywhere_is_not_found():
    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded")

    async def corrupt(request: web.Request) -> web.Response:
        return web.Response(body=DATA[:-1] + b"\0")

    async def good(request: web.Request) -> web.Response:
        return web.Response(body=DATA)

    async def missing(request: web.Request) -> web.Response:
        return web.json_response({"error": {"status": 404, "code": "not_found", "message": "no"}}, status=404)

    servers = [await _serve(h) for h in (broken, corrupt, good, missing)]
    (_, b), (_, x), (_, g), (_, m) = servers
    try:
        async with HttpClient([b, x, g]) as c:
            assert await c.get_blob(BID, len(DATA)) == DATA
            assert c.stats.corrupt_blobs == 1 and c.stats.failovers == 2
        async with HttpClient([x]) as c:
            with pytest.raises(TransportError, match="hashes to"):
                await c.get_blob(BID)
        async with HttpClient([m, b]) as c:
            with pytest.raises(NotFoundError):
                await c.get_manifest("m", 3)
    finally:
        for runner, _ in servers:
            await runner.cleanup()
