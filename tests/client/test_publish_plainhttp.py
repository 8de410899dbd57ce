"""``client/plainhttp.py``: the ``publish`` command's head read, blob and manifest PUTs without aiohttp.

Against a real origin process (what it answers must be what ``HttpClient`` makes of the same answers: the
head, a missing model, a refused token, a manifest whose blobs are missing) and against small servers on
loopback that misbehave (a connection closed before the answer, a chunked answer, silence past the
status-line limit, a close in the middle of a body)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from aiohttp import web

from deltasync.blob import blob_id
from deltasync.errors import AuthError, DeltaSyncError, UpstreamError, UpstreamTimeout
from deltasync.client.http import HttpClient
from deltasync.client.httpbase import Timeouts
from deltasync.client.plainhttp import PlainOrigin, supports

from server_fixtures import TOKEN, keyframe, make_blob, origin, stop_all


@pytest.fixture
def live_origin(tmp_path):
    o = origin(tmp_path).start().wait_ready()
    try:
        yield o.url
    finally:
        stop_all(o)


async def test_against_a_real_origin_the_answers_are_httpclients(live_origin):
    bid, data = make_blob(100_000, 1)
    async with PlainOrigin(live_origin, token=TOKEN, read_token=TOKEN) as p:
        assert await p.get_head("m") is None  # no version yet
        m = keyframe("m", 0, [(bid, data)])
        with pytest.raises(DeltaSyncError) as e:  # a manifest before its blob: the origin's own error class
            await p.put_manifest("m", 0, m.to_json())
        assert e.value.http_status < 500 and not isinstance(e.value, UpstreamError)
        await p.put_blob(bid, data)
        await p.put_blob(bid, memoryview(data))  # idempotent, and any bytes-like body
        await p.put_manifest("m", 0, m.to_json())
        head = await p.get_head("m")
        assert p.requests == 6 and p.bytes_out == 2 * len(data) + len(m.to_json())
    async with HttpClient([live_origin], read_token=TOKEN) as h:
        want = await h.get_head("m")
    assert (head.version, head.kind, head.bytes, head.body) == (want.version, want.kind, want.bytes, want.body) == (
        0, "keyframe", len(data), want.body)
    async with PlainOrigin(live_origin, token="not-the-token", read_token=TOKEN) as p:
        with pytest.raises(AuthError):  # an answer, not retried
            await p.put_blob(bid, data)
        assert p.requests == 1


async def test_a_blob_sent_as_pieces_is_the_concatenation(live_origin, caplog):
    """A keyframe shard's body as a tuple of pieces (its header and views of a mapped file), never joined: the
    origin stores their concatenation. Bodies of 4 MiB and more take the origin's direct receive, which closes
    the connection after the answer: the next request opens a new one, not a retry."""
    import numpy as np

    words = np.arange(3 << 20, dtype=np.uint16)  # 6 MiB
    pieces = (b"header bytes", memoryview(words), memoryview(words)[: 1 << 20])
    whole = b"".join(bytes(p) for p in pieces)
    small = (b"a", memoryview(b"bc"), memoryview(bytearray(b"def")))
    async with PlainOrigin(live_origin, token=TOKEN, read_token=TOKEN) as p:
        with caplog.at_level("WARNING"):
            for body, data in ((pieces, whole), (small, b"abcdef"), (pieces, whole)):
                await p.put_blob(blob_id(data), body)
        assert p.requests == 3 and p.bytes_out == 2 * len(whole) + 6
        assert not [r for r in caplog.records if "retrying" in r.getMessage()]
    async with HttpClient([live_origin], read_token=TOKEN) as h:
        assert await h.get_blob(blob_id(whole)) == whole
        assert await h.get_blob(blob_id(b"abcdef")) == b"abcdef"
    async with HttpClient([live_origin], token=TOKEN, read_token=TOKEN) as h:  # the aiohttp client takes pieces too
        data = bytes(reversed(whole))
        await h.put_blob(blob_id(data), (data[:100], memoryview(data)[100:]))
        assert await h.get_blob(blob_id(data)) == data


def test_supports_plain_http_only():
    assert supports("http://127.0.0.1:1") and supports("HTTP://h/x")
    assert not supports("https://h") and not supports("unix:///x")
    with pytest.raises(ValueError):
        PlainOrigin("https://h")


async def _raw_server(answer) -> tuple[asyncio.AbstractServer, str, list[bytes]]:
    """A TCP server whose ``answer(n, request_head, reader, writer)`` handles the n-th request."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                seen.append(head)
                if not await answer(len(seen), head, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


async def test_a_put_whose_connection_closes_before_the_answer_is_retried_on_a_new_one():
    async def answer(n, head, reader, writer) -> bool:
        if n == 1:
            return False  # closed without a word: an outage, the PUT is sent again
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        return True

    server, url, seen = await _raw_server(answer)
    try:
        async with PlainOrigin(url, token="t") as p:
            await p.put_manifest("m", 3, b"{}")
        assert len(seen) == 2 and all(h.startswith(b"PUT /v1/models/m/versions/3 HTTP/1.1") for h in seen)
        assert b"Authorization: Bearer t" in seen[1]
    finally:
        server.close()


async def test_chunked_answers_and_kept_alive_connections():
    body = b'{"version": 4, "kind": "delta", "blobs": [{"size": 7}]}'

    async def answer(n, head, reader, writer) -> bool:
        if n == 1:  # chunked, with an extension and a trailer
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + b"%x;x=1\r\n" % 10 + body[:10] + b"\r\n" + b"%x\r\n" % (len(body) - 10) + body[10:]
                         + b"\r\n0\r\nX-T: 1\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 43\r\n\r\n"
                         b'{"error": "not_found", "message": "nope!!"}')
        await writer.drain()
        return True

    server, url, seen = await _raw_server(answer)
    try:
        async with PlainOrigin(url) as p:
            h = await p.get_head("m")
            assert (h.version, h.kind, h.bytes, h.body) == (4, "delta", 7, body)
            assert await p.get_head("m") is None  # 404: no version, as HttpClient says
        assert len(seen) == 2
    finally:
        server.close()


async def test_silence_and_a_body_cut_short_are_bounded_outages():
    async def silent(n, head, reader, writer) -> bool:
        await asyncio.sleep(5)
        return False

    server, url, _ = await _raw_server(silent)
    try:
        async with PlainOrigin(url, timeouts=Timeouts(ttfb=0.2, read=0.2)) as p:
            t = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamTimeout):
                await p.get_head("m")
            assert asyncio.get_running_loop().time() - t < 2
    finally:
        server.close()

    async def cut(n, head, reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"version\"")
        await writer.drain()
        return False

    server, url, _ = await _raw_server(cut)
    try:
        async with PlainOrigin(url) as p:
            with pytest.raises(UpstreamError):
                await p.get_head("m")
    finally:
        server.close()


def test_publish_imports_no_aiohttp_for_a_plain_origin(tmp_path):
    """The CLI's publish to an http:// origin, a keyframe and a delta (``publish --base``): aiohttp is not among
    the modules the process imported."""
    from deltasync.cli.cluster import LocalCluster
    from deltasync.tensorfile import write_state_file
    from deltasync.testing.trace import ModelShape, RLTrace

    trace = RLTrace(ModelShape(vocab=128, hidden=16, layers=1, ffn=32), lr=1e-4, seed=2)
    paths = [tmp_path / f"s{i}.safetensors" for i in range(2)]
    for p in paths:
        write_state_file(p, trace.step())
    with LocalCluster(tmp_path / "tree", key=bytes(range(32))) as cluster:
        cluster.start_origin()
        pub = [sys.executable, "-X", "importtime", "-m", "deltasync.cli.main", "publish", "--origin", cluster.origin,
               "--model", "m", "--token-file", str(cluster.token_file), "--key-file", str(cluster.key_file)]
        r = subprocess.run([*pub, str(paths[0])], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "keyframe" in r.stdout, r.stderr[-2000:]
        imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
        assert "deltasync.client.plainhttp" in imported and not any(m.split(".")[0] == "aiohttp" for m in imported)
        r = subprocess.run([*pub, "--base", str(paths[0]), str(paths[1])], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "published m v1: delta" in r.stdout, r.stderr[-2000:]
        imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
        assert "deltasync.client.plainhttp" in imported and not any(m.split(".")[0] == "aiohttp" for m in imported)
