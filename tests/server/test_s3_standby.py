"""A replacement origin on a bucket without conditional writes (issue 24): standby, not silence.

A real moto S3 server on loopback, told to act as a server without conditional writes (``--s3-conditional no``:
the origins take turns through the writer lease). Origin A commits two versions and is SIGKILLed, leaving its
lease live for up to one ttl. Origin B, started at once, answers ``/healthz`` within seconds with
``"status": "standby"`` and the holder, serves the versions A committed, refuses uploads with 503 naming the
holder, says "standby" in its log, and takes over writes when A's lease expires: then it commits.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from s3_fixtures import bucket_env, moto_s3  # noqa: F401  (fixtures)
from server_fixtures import delta, get_bytes, keyframe, make_blob, put_blob, put_manifest, session, wait_head
from test_s3_origin import s3_origin

TTL = 8.0  # the lease's lifetime: short for the test (--s3-lease-ttl; 30 s by default)
LEASE = ("--s3-conditional", "no", "--s3-lease-ttl", str(TTL))


def healthz(url: str) -> tuple[int, dict] | None:
    """GET /healthz with a short timeout: (status, body), or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=0.5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return None


def test_a_replacement_origin_serves_reads_on_standby_then_takes_over_writes(moto_s3, tmp_path, monkeypatch):
    bucket_env(moto_s3, monkeypatch)
    a = s3_origin(tmp_path, moto_s3, "standby", "a", *LEASE).start().wait_ready()
    b = None
    blobs = [make_blob(20_000, 1), make_blob(30_000, 2)]
    try:
        async def commit_on_a() -> None:
            async with session() as s:
                assert await put_blob(s, a.url, *blobs[0]) == 201
                assert (await put_manifest(s, a.url, keyframe("sb", 1, [blobs[0]])))[0] == 201
                assert await put_blob(s, a.url, *blobs[1]) == 201
                assert (await put_manifest(s, a.url, delta("sb", 2, 1, [blobs[1]])))[0] == 201
        asyncio.run(commit_on_a())
        assert "holding the writer lease" in a.log()
        a.kill()  # SIGKILL: its lease stays in the bucket, live for up to one ttl

        t0 = time.monotonic()
        b = s3_origin(tmp_path, moto_s3, "standby", "b", *LEASE).start()
        first = None
        while first is None and time.monotonic() - t0 < TTL:
            first = healthz(b.url)
            if first is None:
                time.sleep(0.05)
        answered = time.monotonic() - t0
        print(f"replacement origin: /healthz answered {answered:.2f} s after its start")
        assert first is not None, f"/healthz did not answer within the lease's {TTL} s:\n{b.log()}"
        status, body = first
        assert status == 200 and body["status"] == "standby", body
        assert body["writer"]["lease"] == "standby" and body["writer"]["holder"], body
        assert body["writer"]["expires_in"] > 0 and body["models"] == {"sb": 2}, body
        assert answered < 4.0, f"/healthz took {answered:.2f} s"  # process start-up included; not the lease's ttl
        b.wait_ready(5)

        async def on_standby() -> None:
            async with session() as s:
                await wait_head(s, b.url, "sb", 2)  # what A committed
                st, _, got = await get_bytes(s, f"{b.url}/v1/blobs/{blobs[1][0]}")
                assert st == 200 and got == blobs[1][1]
                st, _, man = await get_bytes(s, f"{b.url}/v1/models/sb/versions/2")
                assert st == 200 and json.loads(man)["parent"] == 1
                new = make_blob(10_000, 3)
                async with s.put(f"{b.url}/v1/blobs/{new[0]}", data=new[1],
                                 headers={"Authorization": "Bearer test-token-0123456789"}) as r:
                    refused = await r.json(content_type=None)
                    assert r.status == 503, refused
                assert refused["error"]["code"] == "unavailable" and "standby" in refused["error"]["message"]
                assert body["writer"]["holder"] in refused["error"]["message"]
        asyncio.run(on_standby())
        assert "standby" in b.log()

        took_over = None
        while time.monotonic() - t0 < TTL + 10:
            h = healthz(b.url)
            if h is not None and h[1]["status"] == "ok":
                took_over = time.monotonic() - t0
                assert h[1]["writer"]["lease"] == "holding", h
                break
            time.sleep(0.1)
        print(f"replacement origin: took over writes {took_over} s after its start (lease ttl {TTL} s)")
        assert took_over is not None, f"never took over the writer lease:\n{b.log()}"
        assert "standby over" in b.log()

        async def write_on_b() -> None:
            async with session() as s:
                new = make_blob(10_000, 3)
                assert await put_blob(s, b.url, *new) == 201
                status, res = await put_manifest(s, b.url, delta("sb", 3, 2, [new]))
                assert status == 201, res
                await wait_head(s, b.url, "sb", 3)
        asyncio.run(write_on_b())
    finally:
        if b is not None:
            b.stop()
        a.stop()


def test_a_standby_beside_a_live_holder_stays_standby_and_takes_over_when_it_stops(moto_s3, tmp_path, monkeypatch):
    bucket_env(moto_s3, monkeypatch)
    ttl = 3.0
    args = ("--s3-conditional", "no", "--s3-lease-ttl", str(ttl))
    a = s3_origin(tmp_path, moto_s3, "live", "a", *args).start().wait_ready()
    b = s3_origin(tmp_path, moto_s3, "live", "b", *args).start().wait_ready(30)
    try:
        time.sleep(ttl * 1.5)  # A renews: B must still be on standby (it used to exit here)
        h = healthz(b.url)
        assert h is not None and h[1]["status"] == "standby" and b.proc.poll() is None, (h, b.log()[-2000:])
        assert "does not honour conditional writes" in b.log() and "holds the writer lease" in b.log()
        t0 = time.monotonic()
        assert a.stop() == 0  # a clean stop releases the lease
        took = None
        while time.monotonic() - t0 < ttl + 5:
            h = healthz(b.url)
            if h is not None and h[1]["status"] == "ok":
                took = time.monotonic() - t0
                break
            time.sleep(0.1)
        print(f"standby took over {took} s after the holder stopped")
        assert took is not None and took < 3.0, b.log()[-2000:]  # released: no wait for the ttl
    finally:
        b.stop()
        a.stop()
