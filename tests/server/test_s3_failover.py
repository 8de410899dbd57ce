"""Bucket store failure paths, against rclone serve s3 (no conditional writes, no Range):

* an origin SIGKILLed in the middle of a blob upload leaves nothing of that blob visible;
* an origin paused past its writer lease loses it to a replacement, and its next commit is
  refused with a conflict instead of overwriting the replacement's versions;
* a relay whose only parent is the bucket's plain HTTP URL (anonymous, read-only, no LIST)
  serves a subscriber bit-exact.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp

from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.testing.trace import RLTrace
from s3_fixtures import BUCKET, bucket_env, rclone_s3  # noqa: F401  (fixtures)
from server_fixtures import KEY, TOKEN, delta, keyframe, make_blob, put_blob, put_manifest, session, wait_head
from test_s3_origin import SHAPE, blank, bucket_objects, exact, relay_proc, s3_origin, wait_writer


def test_sigkill_during_a_blob_upload_leaves_nothing_visible(rclone_s3, tmp_path, monkeypatch):
    bucket_env(rclone_s3, monkeypatch)
    a = s3_origin(tmp_path, rclone_s3, "cut").start().wait_ready()
    bid, data = make_blob(24 << 20, 7)  # three multipart parts

    async def upload() -> None:
        async def body():
            for i in range(0, len(data), 1 << 20):
                if i == 12 << 20:
                    a.kill()  # SIGKILL with half the blob sent (and parts of it already in the bucket)
                yield data[i:i + (1 << 20)]
        async with session() as s:
            try:
                async with s.put(f"{a.url}/v1/blobs/{bid}", data=body(),
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Length": str(len(data))}) as r:
                    await r.read()
                    raise AssertionError(f"the upload to a killed origin answered {r.status}")
            except (aiohttp.ClientError, ConnectionError):
                pass
    asyncio.run(upload())
    objs = bucket_objects(rclone_s3, "cut")
    assert not any(bid in k for k in objs), f"a part of the cut blob is visible: {sorted(objs)}"
    a.stop()


def test_a_paused_origin_loses_the_lease_and_cannot_commit(rclone_s3, tmp_path, monkeypatch):
    bucket_env(rclone_s3, monkeypatch)
    a = s3_origin(tmp_path, rclone_s3, "pause", "a", "--s3-lease-ttl", "2").start().wait_ready()
    b = None
    try:
        base = make_blob(10_000, 1)

        async def first() -> None:
            async with session() as s:
                assert await put_blob(s, a.url, *base) == 201
                status, body = await put_manifest(s, a.url, keyframe("pause", 1, [base]))
                assert status == 201, body
        asyncio.run(first())
        os.kill(a.pid, signal.SIGSTOP)  # a GC pause, a frozen VM...
        try:
            b = s3_origin(tmp_path, rclone_s3, "pause", "b", "--s3-lease-ttl", "2").start().wait_ready(30)
            wait_writer(b)  # standby until a's lease expires, then b holds it
        finally:
            os.kill(a.pid, signal.SIGCONT)
        time.sleep(0.5)

        async def race() -> None:
            async with session() as s:
                await wait_head(s, b.url, "pause", 1)  # b serves what a committed
                nb = make_blob(10_000, 2)
                assert await put_blob(s, b.url, *nb) == 201
                status, body = await put_manifest(s, b.url, delta("pause", 2, 1, [nb]))
                assert status == 201, body
                na = make_blob(10_000, 3)
                assert await put_blob(s, a.url, *na) in (200, 201, 507)
                status, body = await put_manifest(s, a.url, delta("pause", 3, 2, [na]))
                assert status == 409 and body["error"]["code"] == "chain", body
                assert "writer lease" in body["error"]["message"], body
                async with s.get(f"{b.url}/v1/models/pause/head") as r:
                    assert r.headers["X-Deltasync-Version"] == "2"
        asyncio.run(race())
    finally:
        if b is not None:
            b.stop()
        a.stop()


def test_relay_on_a_plain_url_bucket_serves_bit_exact(rclone_s3, tmp_path, monkeypatch):
    bucket_env(rclone_s3, monkeypatch)
    origin = s3_origin(tmp_path, rclone_s3, "public").start().wait_ready()
    anon = rclone_s3.anonymous_view()
    relay = relay_proc(tmp_path, "relay", [f"bucket+{anon.endpoint}/{BUCKET}/public"], "--bucket-poll", "0.2")
    trace = RLTrace(SHAPE, lr=3e-4, seed=31)
    target = blank(trace.state())
    sub = None
    try:
        relay.start().wait_ready()
        sub = ThreadedSubscriber([relay.url], "pub", target, verifier=KEY)
        sub.start()
        with Publisher(origin.url, "pub", TOKEN, KEY, keyframe_every=0) as pub:
            for step in range(3):
                state = trace.step()
                pub.publish(step, state)
                assert sub.wait_version(step, 60) == step
                assert exact(target, state), f"subscriber behind a plain-URL bucket parent differs at v{step}"
    finally:
        if sub is not None:
            sub.close()
        relay.stop()
        anon.stop()
        origin.stop()
