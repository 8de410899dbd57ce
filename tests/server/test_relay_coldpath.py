"""The relay's cold path: ``BlobGetter`` (server/http/blobget.py) against real aiohttp servers on loopback.

Bodies arrive in the pieces the socket gives, are handed over without copies, and a reused
keep-alive connection carries the next blob; a parent that cuts a body short, sends a chunked
body or goes silent is an ``UpstreamError`` (``UpstreamTimeout`` for silence), never a hang."""

from __future__ import annotations

import asyncio
import os

import pytest
from aiohttp import web

from deltasync.errors import UpstreamError, UpstreamTimeout
from deltasync.server.http.blobget import BlobGetter
from deltasync.server.parents.fetcher import _body_range


@pytest.fixture
async def parent():
    blobs = {"a" * 32: os.urandom(5 << 20), "b" * 32: os.urandom(1000)}
    peers: list[object] = []

    async def blob(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        bid = request.match_info["id"]
        if bid == "c" * 32:  # cut short: promises 1 MiB, sends 1000 bytes, closes
            resp = web.StreamResponse(headers={"Content-Length": str(1 << 20)})
            await resp.prepare(request)
            await resp.write(b"x" * 1000)
            request.transport.close()
            return resp
        if bid == "d" * 32:  # chunked
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(b"x" * 10)
            await resp.write_eof()
            return resp
        if bid == "e" * 32:  # silent after the head
            resp = web.StreamResponse(headers={"Content-Length": "100"})
            await resp.prepare(request)
            await asyncio.sleep(30)
            return resp
        data = blobs.get(bid)
        if data is None:
            raise web.HTTPNotFound()
        start = 0
        rng = request.headers.get("Range")
        status = 200
        headers = {"Content-Length": str(len(data))}
        if rng:
            start = int(rng.split("=")[1].rstrip("-"))
            status = 206
            headers = {"Content-Length": str(len(data) - start),
                       "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        view = memoryview(data)[start:]
        for i in range(0, len(view), 777_777):  # odd piece sizes
            await resp.write(view[i:i + 777_777])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/blobs/{id}", blob)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", blobs, peers
    await runner.cleanup()


async def _get(getter: BlobGetter, url: str, bid: str, offset: int = 0) -> tuple[int, int, bytes]:
    got = bytearray()
    pieces = []
    span = {}

    def on_head(resp) -> bool:
        if resp.status == 404:
            span["status"] = 404
            return False
        span["start"], span["total"] = _body_range(resp, offset)
        return True

    def on_body(piece: memoryview) -> None:
        pieces.append(len(piece))
        got.extend(piece)  # the buffer is reused after this returns: copy here, as the file write does

    await getter.get(url, bid, offset, on_head=on_head, on_body=on_body)
    if span.get("status") == 404:
        return 404, 0, b""
    assert len(pieces) >= 1
    return span["start"], span["total"], bytes(got)


async def test_bodies_arrive_whole_and_keep_alive_reuses_the_connection(parent):
    url, blobs, peers = parent
    g = BlobGetter(connect_timeout=5, read_timeout=5, user_agent="test")
    try:
        a, b = "a" * 32, "b" * 32
        start, total, body = await _get(g, url, a)
        assert (start, total) == (0, len(blobs[a])) and body == blobs[a]
        start, total, body = await _get(g, url, b)
        assert body == blobs[b]
        start, total, body = await _get(g, url, a, offset=3_000_001)  # Range resume
        assert (start, total) == (3_000_001, len(blobs[a])) and body == blobs[a][3_000_001:]
        assert len(peers) == 3 and len(set(peers)) == 1, "one keep-alive connection for the three answers"
        assert await _get(g, url, "f" * 32) == (404, 0, b"")
    finally:
        g.close()


async def test_a_body_cut_short_or_chunked_is_an_upstream_error(parent):
    url, _, _ = parent
    g = BlobGetter(connect_timeout=5, read_timeout=5, user_agent="test")
    try:
        with pytest.raises(UpstreamError):
            await _get(g, url, "c" * 32)
        with pytest.raises(UpstreamError, match="chunked"):
            await _get(g, url, "d" * 32)
        # and the getter still works afterwards
        assert (await _get(g, url, "b" * 32))[2]
    finally:
        g.close()


async def test_a_silent_parent_times_out(parent):
    url, _, _ = parent
    g = BlobGetter(connect_timeout=5, read_timeout=0.5, user_agent="test")
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(UpstreamTimeout):
            await _get(g, url, "e" * 32)
        assert loop.time() - t0 < 5
    finally:
        g.close()


async def test_a_dead_port_is_an_upstream_error():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    g = BlobGetter(connect_timeout=2, read_timeout=2, user_agent="test")
    with pytest.raises(UpstreamError):
        await _get(g, f"http://127.0.0.1:{port}", "a" * 32)
    assert not BlobGetter.supports("https://example.org") and BlobGetter.supports("http://127.0.0.1:1")
