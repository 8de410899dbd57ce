"""Large uploads received straight into one buffer (server/http/uploadrecv.py): the same checks as through aiohttp
(hash, digest memory for the commit check, truncation, a stall), each on a real origin process; the
connection closes after the answer and the origin keeps serving."""

from __future__ import annotations

import asyncio
import socket

import pytest

from deltasync.manifest import BlobRef, Manifest

from server_fixtures import KEY, TOKEN, make_blob, metrics, origin, put_blob, put_manifest, session, start_all, stop_all

BIG = 9 << 20  # above uploadrecv.DIRECT_MIN


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    work = tmp_path_factory.mktemp("direct")
    o = origin(work, "origin", "--body-timeout", "1", "--min-upload-rate", "0", key=True)
    start_all(o)
    yield o, work
    assert stop_all(o) == [0]


def _tmp_empty(work) -> bool:
    return not any((work / "origin" / "tmp").iterdir())


async def test_a_large_upload_is_stored_and_its_digest_checked_at_commit(srv):
    o, work = srv
    bid, data = make_blob(BIG + 12345, 1)
    async with session() as s:
        before = (await metrics(s, o.url)).get("deltasync_uploads_direct_total", 0)
        assert await put_blob(s, o.url, bid, data) == 201
        assert (await metrics(s, o.url))["deltasync_uploads_direct_total"] == before + 1
        assert await put_blob(s, o.url, bid, data) == 200  # stored: answered without reading it
        async with s.get(f"{o.url}/v1/blobs/{bid}") as r:
            assert r.status == 200 and await r.read() == data
        # the commit checks the signed digest against what the upload hashed as it came in
        m = Manifest(model="direct", version=0, parent=None, kind="keyframe", tensors=(),
                     blobs=(BlobRef(id=bid, size=len(data)),), state_fp="0" * 16)
        status, body = await put_manifest(s, o.url, m.with_digests({bid: data}).sign(KEY))
        assert status == 201, body
        bad = Manifest(model="direct2", version=0, parent=None, kind="keyframe", tensors=(),
                       blobs=(BlobRef(id=bid, size=len(data)),), state_fp="0" * 16)
        status, body = await put_manifest(s, o.url, bad.with_digests({bid: data[:-1] + b"?"}).sign(KEY))
        assert status == 422, body
    assert _tmp_empty(work)


async def test_a_large_upload_that_does_not_hash_to_its_id_is_refused(srv):
    o, work = srv
    bid, data = make_blob(BIG, 2)
    async with session() as s:
        assert await put_blob(s, o.url, bid, data[:-1] + bytes([data[-1] ^ 1])) == 422
        async with s.head(f"{o.url}/v1/blobs/{bid}") as r:
            assert r.status == 404
        assert await put_blob(s, o.url, bid, data) == 201  # and the next one goes through
    assert _tmp_empty(work)


def _raw_put(url: str, bid: str, size: int, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    c = socket.create_connection((host, int(port)))
    c.sendall(f"PUT /v1/blobs/{bid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
              f"Content-Length: {size}\r\n\r\n".encode() + body)
    return c


async def _wait_tmp_empty(work, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if _tmp_empty(work):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the cut upload's temp file was kept")


async def test_a_cut_upload_keeps_nothing_and_the_origin_serves_on(srv):
    o, work = srv
    bid, data = make_blob(BIG, 3)
    c = _raw_put(o.url, bid, len(data), data[: len(data) // 2])
    await asyncio.sleep(0.3)
    c.close()  # mid-body
    await _wait_tmp_empty(work)
    async with session() as s:
        async with s.head(f"{o.url}/v1/blobs/{bid}") as r:
            assert r.status == 404
        assert await put_blob(s, o.url, bid, data) == 201


async def test_a_stalled_upload_times_out_and_closes(srv):
    o, work = srv
    bid, data = make_blob(BIG, 4)
    c = _raw_put(o.url, bid, len(data), data[: 6 << 20])
    c.settimeout(10)
    got = b""
    while chunk := await asyncio.to_thread(c.recv, 65536):  # the answer, then the close
        got += chunk
    c.close()
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert b"\r\nconnection: close\r\n" in got.split(b"\r\n\r\n")[0].lower() + b"\r\n"  # and it says so
    await _wait_tmp_empty(work)


async def test_the_connection_closes_after_a_direct_upload(srv):
    o, _ = srv
    bid, data = make_blob(BIG, 5)
    c = _raw_put(o.url, bid, len(data), data)
    c.settimeout(10)
    got = b""
    while chunk := await asyncio.to_thread(c.recv, 65536):
        got += chunk
    c.close()
    assert got.startswith(b"HTTP/1.1 201") and f'"{bid}"'.encode() in got
    assert b"\r\nconnection: close\r\n" in got.split(b"\r\n\r\n")[0].lower() + b"\r\n"  # it says so
