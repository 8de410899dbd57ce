"""The origin's write path: every refusal has its documented status, and nothing is stored."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess

import pytest

from server_fixtures import (
    AUTH, KEY, TOKEN, delta, keyframe, make_blob, metrics, origin, put_blob, put_manifest, relay, session,
    start_all, stop_all,
)

MODEL = "writes"
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    work = tmp_path_factory.mktemp("writes")
    o = origin(work, "origin", "--max-blob-size", str(LIMIT), "--read-timeout", "1", key=True)
    r = relay(work, "relay", [o.url], key=True)
    start_all(o, r)
    yield o, r, work
    assert stop_all(r, o) == [0, 0]


async def _error(resp) -> dict:
    body = json.loads(await resp.read())
    assert set(body) == {"error"}
    assert body["error"]["status"] == resp.status
    assert resp.headers["Content-Type"].startswith("application/json")
    return body["error"]


async def _blob_absent(s, url, bid) -> bool:
    async with s.head(f"{url}/v1/blobs/{bid}") as r:
        return r.status == 404


def _tmp_empty(work) -> bool:
    return not any((work / "origin" / "tmp").iterdir())


async def test_blob_upload_is_idempotent_and_served(servers):
    o, _, _ = servers
    bid, data = make_blob(200_000, 1)
    async with session() as s:
        assert await put_blob(s, o.url, bid, data) == 201
        assert await put_blob(s, o.url, bid, data) == 200
        async with s.get(f"{o.url}/v1/blobs/{bid}") as r:
            assert r.status == 200 and await r.read() == data
            assert r.headers["X-Deltasync-Cache"] == "hit"
        async with s.head(f"{o.url}/v1/blobs/{bid}") as r:
            assert r.status == 200 and int(r.headers["Content-Length"]) == len(data)
        async with s.get(f"{o.url}/v1/blobs/{bid}", headers={"Range": "bytes=-10"}) as r:
            assert r.status == 206 and await r.read() == data[-10:]
            assert r.headers["Content-Range"] == f"bytes {len(data) - 10}-{len(data) - 1}/{len(data)}"
        async with s.get(f"{o.url}/v1/blobs/{bid}", headers={"Range": f"bytes={len(data)}-"}) as r:
            assert r.status == 416 and r.headers["Content-Range"] == f"bytes */{len(data)}"
            assert (await _error(r))["code"] == "range_not_satisfiable"
        async with s.get(f"{o.url}/v1/blobs/{bid}", headers={"If-None-Match": f'"{bid}"'}) as r:
            assert r.status == 304


@pytest.mark.parametrize("headers, code", [
    ({}, "unauthorized"),
    ({"Authorization": "Bearer wrong-token"}, "unauthorized"),
    ({"Authorization": f"Basic {TOKEN}"}, "unauthorized"),
])
async def test_writes_need_the_token(servers, headers, code):
    o, _, work = servers
    bid, data = make_blob(1000, 2)
    m = keyframe(MODEL, 1, [(bid, data)], key=KEY)
    async with session() as s:
        async with s.put(f"{o.url}/v1/blobs/{bid}", data=data, headers=headers) as r:
            assert r.status == 401 and (await _error(r))["code"] == code
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        async with s.put(f"{o.url}/v1/models/{MODEL}/versions/1", data=m.to_json(), headers=headers) as r:
            assert r.status == 401
        assert await _blob_absent(s, o.url, bid)
        async with s.get(f"{o.url}/v1/models/{MODEL}/versions/1") as r:
            assert r.status == 404


@pytest.mark.parametrize("bad, status", [
    ("ABCDEF0123456789ABCDEF0123456789", 400),  # upper case
    ("0123456789abcdef0123456789abcde", 400),  # 31 digits
    ("0123456789abcdef0123456789abcdef0", 400),  # 33 digits
    ("0123456789abcdef0123456789abcdeg", 400),  # not hex
    ("..%2F..%2Fetc%2Fpasswd", 400),  # encoded traversal reaches the handler and fails validation
    ("../../etc/passwd", 404),  # a literal slash never matches the route
])
async def test_bad_blob_ids_are_refused(servers, bad, status):
    o, r, _ = servers
    async with session() as s:
        for url in (o.url, r.url):
            async with s.get(f"{url}/v1/blobs/{bad}") as resp:
                assert resp.status == status
                await _error(resp)
        async with s.put(f"{o.url}/v1/blobs/{bad}", data=b"x", headers=AUTH) as resp:
            assert resp.status == status


async def test_hash_mismatch_oversize_and_truncated_uploads_store_nothing(servers):
    o, _, work = servers
    bid, data = make_blob(5000, 3)
    big_id, big = make_blob(LIMIT + 1, 4)
    async with session() as s:
        before = await metrics(s, o.url)
        async with s.put(f"{o.url}/v1/blobs/{bid}", data=data[:-1] + b"!", headers=AUTH) as r:
            assert r.status == 422 and (await _error(r))["code"] == "integrity"
        async with s.put(f"{o.url}/v1/blobs/{big_id}", data=big, headers=AUTH) as r:
            assert r.status == 413 and (await _error(r))["code"] == "too_large"

        async def chunked():  # no Content-Length: the limit is enforced while streaming
            for i in range(0, len(big), 1 << 16):
                yield big[i:i + (1 << 16)]
        async with s.put(f"{o.url}/v1/blobs/{big_id}", data=chunked(), headers=AUTH) as r:
            assert r.status == 413
        assert await _blob_absent(s, o.url, bid) and await _blob_absent(s, o.url, big_id)

        # truncated: declare the full length, send half, close the connection
        port = int(o.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write((f"PUT /v1/blobs/{bid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n").encode() + data[: len(data) // 2])
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        await asyncio.sleep(0.3)
        assert await _blob_absent(s, o.url, bid)
        assert _tmp_empty(work)
        after = await metrics(s, o.url)
        assert after["deltasync_upload_rejections_total"] - before["deltasync_upload_rejections_total"] >= 3
        assert after["deltasync_uploads_total"] == before["deltasync_uploads_total"]


async def test_a_stalled_upload_times_out_and_stores_nothing(servers):
    o, _, work = servers
    bid, data = make_blob(5000, 6)
    reader, writer = await asyncio.open_connection("127.0.0.1", o.port)
    writer.write((f"PUT /v1/blobs/{bid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n").encode() + data[:100])
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # read timeout is 1 s
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()
    async with session() as s:
        assert await _blob_absent(s, o.url, bid)
    assert _tmp_empty(work)


async def test_manifest_commit_rules(servers):
    o, _, _ = servers
    kb = [make_blob(10_000, 10)]
    db = [make_blob(2_000, 11)]
    kf = keyframe(MODEL, 10, kb, key=KEY)
    async with session() as s:
        # blobs missing: refused, and the list says which
        status, body = await put_manifest(s, o.url, kf)
        assert status == 409 and body["error"]["code"] == "missing_blobs" and body["error"]["missing"] == [kb[0][0]]
        for bid, data in kb + db:
            assert await put_blob(s, o.url, bid, data) == 201
        # bad signature, unsigned, signed with another key
        forged = dataclasses.replace(kf, meta={"x": "y"})
        status, body = await put_manifest(s, o.url, forged)
        assert status == 403 and body["error"]["code"] == "signature"
        status, body = await put_manifest(s, o.url, keyframe(MODEL, 10, kb, key=None))
        assert status == 403
        status, body = await put_manifest(s, o.url, keyframe(MODEL, 10, kb, key=b"k" * 32))
        assert status == 403
        # not JSON / not a manifest
        status, body = await put_manifest(s, o.url, kf, body=b"{not json")
        assert status == 400 and body["error"]["code"] == "format"
        # path and body disagree
        async with s.put(f"{o.url}/v1/models/{MODEL}/versions/11", data=kf.to_json(), headers=AUTH) as r:
            assert r.status == 400
        # a blob whose size the manifest gets wrong
        wrong = keyframe(MODEL, 10, [(kb[0][0], kb[0][1] + b"xx")], key=KEY)
        status, body = await put_manifest(s, o.url, wrong)
        assert status == 422
        # a delta whose parent is not committed
        status, body = await put_manifest(s, o.url, delta(MODEL, 9, 8, db, key=KEY))
        assert status == 409 and body["error"]["code"] == "chain"
        async with s.get(f"{o.url}/v1/models/{MODEL}/head") as r:
            assert r.status == 404  # nothing refused became visible

        status, body = await put_manifest(s, o.url, kf)
        assert status == 201 and body["created"] is True
        status, body = await put_manifest(s, o.url, kf)
        assert status == 200 and body["created"] is False  # idempotent
        # a different manifest for a committed version, an older version, a wrong base state
        status, body = await put_manifest(s, o.url, keyframe(MODEL, 10, db, key=KEY))
        assert status == 409 and body["error"]["code"] == "chain"
        status, body = await put_manifest(s, o.url, keyframe(MODEL, 9, kb, key=KEY))
        assert status == 409
        status, body = await put_manifest(s, o.url, delta(MODEL, 11, 10, db, key=KEY, base_fp="f" * 16))
        assert status == 409 and body["error"]["code"] == "base_mismatch"
        status, body = await put_manifest(s, o.url, delta(MODEL, 11, 10, db, key=KEY))
        assert status == 201
        async with s.get(f"{o.url}/v1/models/{MODEL}/head") as r:
            assert r.headers["X-Deltasync-Version"] == "11"


async def test_bad_model_names_versions_and_oversize_manifests(servers):
    o, _, _ = servers
    async with session() as s:
        for path in ("/v1/models/-bad/head", "/v1/models/ok/versions/x1", "/v1/models/ok/versions/-1",
                     "/v1/models/ok/versions/99999999999999999999", "/v1/models/ok/head?after=a&wait=1",
                     "/v1/models/ok/head?after=1&wait=nan", "/v1/models/ok/delta"):
            async with s.get(o.url + path) as r:
                assert r.status == 400, path
                assert (await _error(r))["code"] == "format"
        async with s.put(f"{o.url}/v1/models/{MODEL}/versions/20", data=b" " * (65 << 20), headers=AUTH) as r:
            assert r.status == 413


async def test_relays_refuse_writes(servers):
    _, r, _ = servers
    bid, data = make_blob(100, 5)
    async with session() as s:
        async with s.put(f"{r.url}/v1/blobs/{bid}", data=data, headers=AUTH) as resp:
            assert resp.status == 405 and (await _error(resp))["code"] == "read_only"
            assert resp.headers["Allow"] == "GET, HEAD"
        async with s.put(f"{r.url}/v1/models/{MODEL}/versions/1", data=b"{}", headers=AUTH) as resp:
            assert resp.status == 405
        async with s.delete(f"{r.url}/v1/blobs/{bid}") as resp:
            assert resp.status == 405 and (await _error(resp))["code"] == "method_not_allowed"


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs: a real full disk (needs root and mount permission; skipped otherwise)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


async def test_full_disk_refuses_the_upload_keeps_nothing_and_recovers(tiny_disk):
    o = origin(tiny_disk)
    start_all(o)
    try:
        small_id, small = make_blob(64 << 10, 901)
        big_id, big = make_blob(6 << 20, 902)  # more than the disk holds
        async with session() as s:
            async with s.put(f"{o.url}/v1/blobs/{big_id}", data=big, headers=AUTH) as r:
                assert r.status == 507
                body = await r.json()
                assert body["error"]["code"] == "insufficient_storage"
            async with s.get(f"{o.url}/v1/blobs/{big_id}") as r:
                assert r.status == 404
            leftovers = [p for p in (tiny_disk / "origin" / "tmp").iterdir()]
            assert leftovers == []  # the partial upload was removed, freeing the space
            assert await put_blob(s, o.url, small_id, small) == 201  # the server still works
            async with s.get(f"{o.url}/v1/blobs/{small_id}") as r:
                assert await r.read() == small
            async with s.get(f"{o.url}/healthz") as r:
                assert r.status == 200
    finally:
        stop_all(o)
