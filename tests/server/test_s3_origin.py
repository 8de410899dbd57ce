"""Origins whose versions live in a bucket, end to end on loopback, against real S3 servers.

Which server each test uses (see s3_fixtures.py for what each honours):

* rclone serve s3 (no Range, no conditional writes -> writer lease):
  publish -> S3 origin -> relay -> subscriber bit-exact; SIGKILL the origin mid-publish,
  another origin on the same bucket, next step, subscribers converge; the second origin
  refused while the first holds the lease; a relay whose only parent is the bucket;
  a failing bucket gives the publisher 507 like a full disk; the orphan sweep.
* moto server (conditional writes): two origins racing to commit the same versions,
  exactly one wins each, the other's publisher gets a clear conflict error; the
  second origin serves what the first committed (stateless).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.errors import DeltaSyncError
from deltasync.server.storage.bucketlayout import decode_heads, parse_blob_key, parse_bucket_url, parse_manifest_key
from deltasync.server.config import BucketSettings
from deltasync.server.storage.s3objects import Bucket
from deltasync.server.storage.s3store import S3Store, orphans
from deltasync.testing.trace import ModelShape, RLTrace
from inprocess_servers import origin_config, serving
from s3_fixtures import BUCKET, bucket_env, moto_s3, rclone_s3  # noqa: F401  (fixtures)
from server_fixtures import (
    KEY, KEY_HEX, TOKEN, ServerProc, delta, get_bytes, keyframe, make_blob, put_blob, put_manifest, session, wait_head,
)

SHAPE = ModelShape(vocab=256, hidden=32, layers=2, ffn=96)


def exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[n].contiguous().view(-1).view(torch.uint8), b[n].contiguous().view(-1).view(torch.uint8))
        for n in a)


def blank(state):
    return {n: torch.full_like(t, 7.0) for n, t in state.items()}


def _files(workdir: Path) -> None:
    (workdir / "token").write_text(TOKEN + "\n")
    (workdir / "key").write_text(KEY_HEX + "\n")


def s3_origin(workdir: Path, server, prefix: str, name: str = "origin", *extra: str, port: int | None = None
              ) -> ServerProc:
    _files(workdir)
    args = ["--store", server.url(prefix), "--s3-endpoint", server.endpoint, "--token-file", str(workdir / "token"),
            "--key-file", str(workdir / "key"), "--no-fsync", "--s3-scratch", str(workdir / f"{name}-scratch"),
            "--bucket-poll", "0.3", "--heartbeat", "1", "--read-timeout", "5", *extra]
    return ServerProc("origin", workdir, name, args, port=port)


def wait_writer(proc: ServerProc, timeout: float = 30.0) -> ServerProc:
    """Wait until an origin on a bucket without conditional writes holds the writer lease (it starts on
    standby, serving reads, while another origin's lease is live): its /healthz says "ok"."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{proc.url}/healthz", timeout=1) as r:
                if json.loads(r.read())["status"] == "ok":
                    return proc
        except OSError:
            pass
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.log()}")
        time.sleep(0.05)
    raise TimeoutError(f"{proc.name} did not take the writer lease within {timeout} s:\n{proc.log()[-3000:]}")


def relay_proc(workdir: Path, name: str, parents: list[str], *extra: str) -> ServerProc:
    _files(workdir)
    args = ["--cache", str(workdir / name), "--heartbeat", "1", "--read-timeout", "5", "--key-file",
            str(workdir / "key"), "--no-fsync", *extra]
    for p in parents:
        args += ["--parent", p]
    return ServerProc("relay", workdir, name, args)


def bucket_objects(server, prefix: str) -> dict[str, int]:
    """Every object under the prefix, read straight from rclone's folder (no deltasync involved)."""
    root = server.data / BUCKET / prefix
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def check_consistent(server, prefix: str, model: str) -> tuple[dict, list[int]]:
    """No manifest in the bucket names a missing blob; returns the heads object and ``model``'s versions."""
    root = server.data / BUCKET / prefix
    objs = bucket_objects(server, prefix)
    blobs = {parse_blob_key(k): n for k, n in objs.items() if parse_blob_key(k)}
    versions = []
    for k in objs:
        mv = parse_manifest_key(k)
        if mv is None:
            continue
        if mv[0] == model:
            versions.append(mv[1])
        m = json.loads((root / k).read_bytes())
        for b in m["blobs"]:
            assert blobs.get(b["id"]) == b["size"], f"{k} names blob {b['id']}, which is not (whole) in the bucket"
    heads = decode_heads((root / "heads.json").read_bytes())
    return heads, sorted(versions)


# -- rclone ------------------------------------------------------------------------------------

def test_publish_s3_origin_relay_subscriber_bit_exact(rclone_s3, tmp_path, monkeypatch):
    bucket_env(rclone_s3, monkeypatch)  # the server processes inherit the AWS_* variables
    origin = s3_origin(tmp_path, rclone_s3, "fleet").start().wait_ready()
    relay = relay_proc(tmp_path, "relay", [origin.url]).start().wait_ready()
    trace = RLTrace(SHAPE, lr=3e-4, seed=11)
    target = blank(trace.state())
    sub = ThreadedSubscriber([relay.url], "s3m", target, verifier=KEY)
    try:
        sub.start()
        with Publisher(origin.url, "s3m", TOKEN, KEY, keyframe_every=3) as pub:
            for step in range(6):
                state = trace.step()
                pub.publish(step, state)
                assert sub.wait_version(step, 60) == step
                assert exact(target, state), f"subscriber differs from the trainer at v{step}"
        heads, versions = check_consistent(rclone_s3, "fleet", "s3m")
        assert versions == list(range(6)) and heads["s3m"].version == 5
        assert heads["s3m.kf"].version == 3  # the side keyframe stream lives in the bucket too
        assert "holding the writer lease" in origin.log()  # rclone ignores If-None-Match: the lease path
    finally:
        sub.close()
        relay.stop()
        origin.stop()


def test_sigkill_mid_publish_then_a_new_origin_on_the_bucket(rclone_s3, tmp_path, monkeypatch):
    bucket_env(rclone_s3, monkeypatch)
    a = s3_origin(tmp_path, rclone_s3, "crash", "a", "--s3-lease-ttl", "3").start().wait_ready()
    relay = relay_proc(tmp_path, "relay", [a.url]).start().wait_ready()
    trace = RLTrace(SHAPE, lr=3e-4, seed=12)
    targets = [blank(trace.state()) for _ in range(2)]
    subs = [ThreadedSubscriber([relay.url], "crash", t, verifier=KEY) for t in targets]
    try:
        for s in subs:
            s.start()
        pub = Publisher(a.url, "crash", TOKEN, KEY, keyframe_every=0)
        for step in range(3):
            state = trace.step()
            pub.publish(step, state)
        pub.flush(60)
        for s in subs:
            assert s.wait_version(2, 60) == 2
        # mid-publish: blobs of v3 reach the bucket, then the origin dies before (or while) committing
        asyncio.run(_upload_only(a.url, [make_blob(300_000, 99), make_blob(9 << 20, 98)]))
        state = trace.step()
        pub.publish(3, state)
        a.kill()
        with pytest.raises(DeltaSyncError):
            pub.close(30)  # the publisher reports the dead origin
        heads, versions = check_consistent(rclone_s3, "crash", "crash")  # no manifest names a missing blob
        assert max(versions) in (2, 3)
        # a second origin on the same bucket and port (a replacement pod behind one Service)
        t0 = time.monotonic()
        b = s3_origin(tmp_path, rclone_s3, "crash", "b", "--s3-lease-ttl", "3", port=a.port).start()
        wait_writer(b.wait_ready(30))  # on standby (reads only) until a's lease expires
        took = time.monotonic() - t0
        assert took < 15, f"the replacement origin took {took:.1f} s to get the lease"
        with Publisher(b.url, "crash", TOKEN, KEY, keyframe_every=0) as pub2:
            state = trace.step()
            pub2.publish(4, state)
        for s, t in zip(subs, targets):
            assert s.wait_version(4, 60) == 4
            assert exact(t, state), "a subscriber did not converge bit-exact after the origin was replaced"
        heads, versions = check_consistent(rclone_s3, "crash", "crash")
        assert heads["crash"].version == 4 and 4 in versions
        b.stop()
    finally:
        for s in subs:
            s.close()
        relay.stop()
        a.stop()


async def _upload_only(url: str, blobs) -> None:
    async with session() as s:
        for bid, data in blobs:
            assert await put_blob(s, url, bid, data) == 201


def test_second_origin_stays_on_standby_while_the_lease_is_held(rclone_s3, tmp_path, monkeypatch):
    """Issue 24: a second origin no longer refuses to start (nor blocks its start-up): it serves reads on standby
    and refuses writes with 503 while the first one holds the lease (tests/server/test_s3_standby.py: the take-over)."""
    bucket_env(rclone_s3, monkeypatch)
    a = s3_origin(tmp_path, rclone_s3, "lease", "a", "--s3-lease-ttl", "3").start().wait_ready()
    b = None
    try:
        b = s3_origin(tmp_path, rclone_s3, "lease", "b", "--s3-lease-ttl", "3").start().wait_ready(30)
        time.sleep(4.5)  # past one ttl: a renews, b stays on standby
        assert b.proc.poll() is None
        log = b.log()
        assert "holds the writer lease" in log and "does not honour conditional writes" in log, log[-2000:]

        async def refused() -> None:
            async with session() as s:
                st, _, body = await get_bytes(s, f"{b.url}/healthz")
                assert st == 200 and json.loads(body)["status"] == "standby", body
                assert await put_blob(s, b.url, *make_blob(1000, 5)) == 503
        asyncio.run(refused())
    finally:
        if b is not None:
            b.stop()
        a.stop()


def test_relay_with_only_the_bucket_as_parent_serves_bit_exact(rclone_s3, tmp_path, monkeypatch):
    bucket_env(rclone_s3, monkeypatch)
    origin = s3_origin(tmp_path, rclone_s3, "solo").start().wait_ready()
    relay = relay_proc(tmp_path, "relay", [rclone_s3.url("solo")], "--s3-endpoint", rclone_s3.endpoint,
                       "--bucket-poll", "0.2").start().wait_ready()
    trace = RLTrace(SHAPE, lr=3e-4, seed=13)
    target = blank(trace.state())
    sub = ThreadedSubscriber([relay.url], "solo", target, verifier=KEY)
    try:
        with Publisher(origin.url, "solo", TOKEN, KEY, keyframe_every=2) as pub:
            for step in range(2):
                pub.publish(step, trace.step())
        sub.start()  # joins late: catches up from the bucket
        assert sub.wait_version(1, 60) == 1
        pub = Publisher(origin.url, "solo", TOKEN, KEY, keyframe_every=0)
        # continue the stream: a fresh publisher starts with a keyframe at the next step
        for step in range(2, 5):
            state = trace.step()
            pub.publish(step, state)
            assert sub.wait_version(step, 60) == step
            assert exact(target, state), f"subscriber behind a bucket-only relay differs at v{step}"
        pub.close(30)
        origin.stop()  # the origin is gone: the relay still serves what is in the bucket
        target2 = blank(trace.state())
        late = ThreadedSubscriber([relay.url], "solo", target2, verifier=KEY)
        try:
            late.start()
            assert late.wait_version(4, 60) == 4 and exact(target2, state)
        finally:
            late.close()
        assert "bucket parent" in relay.log()
    finally:
        sub.close()
        relay.stop()
        origin.stop()


async def test_failing_bucket_gives_the_publisher_507_like_a_full_disk(rclone_s3, tmp_path, monkeypatch):
    bucket_env(rclone_s3, monkeypatch)
    config = origin_config(store_kind="s3", store_dir=tmp_path / "scratch", s3_endpoint=rclone_s3.endpoint,
                           bucket=BucketSettings(url=rclone_s3.url("full"), lease_ttl=3.0, poll=0, gc_interval=0))
    async with serving(config) as (url, svc):
        assert isinstance(svc.store, S3Store)
        async with session() as s:
            bid, data = make_blob(100_000, 1)
            assert await put_blob(s, url, bid, data) == 201
            rclone_s3.stop()  # the bucket fails
            bid2, data2 = make_blob(2 << 20, 2)
            async with s.put(f"{url}/v1/blobs/{bid2}", data=data2, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                body = await r.json(content_type=None)
            assert r.status == 507 and body["error"]["code"] == "insufficient_storage", body
            assert "nothing partial was kept" in body["error"]["message"]
            status, body = await put_manifest(s, url, keyframe("full", 1, [(bid, data)]))
            assert status == 507 and body["error"]["code"] == "insufficient_storage", body
            assert not svc.store.has_blob(bid2) and svc.store.head("full") is None


async def test_orphan_sweep_deletes_only_old_unreferenced_blobs(rclone_s3, tmp_path, monkeypatch):
    bucket_env(rclone_s3, monkeypatch)
    config = origin_config(store_kind="s3", store_dir=tmp_path / "scratch", s3_endpoint=rclone_s3.endpoint,
                           bucket=BucketSettings(url=rclone_s3.url("gc"), lease_ttl=3.0, poll=0, gc_interval=0,
                                                 gc_grace=3600))
    async with serving(config) as (url, svc):
        async with session() as s:
            kept, orphan = make_blob(50_000, 1), make_blob(60_000, 2)
            for bid, data in (kept, orphan):
                assert await put_blob(s, url, bid, data) == 201
            status, body = await put_manifest(s, url, keyframe("gc", 1, [kept]))
            assert status == 201, body
        store: S3Store = svc.store
        assert await store.sweep_orphans() == []  # the orphan is younger than the grace period
        later = datetime.now(timezone.utc) + timedelta(hours=2)
        assert await store.sweep_orphans(now=later) == [orphan[0]]
        objs = bucket_objects(rclone_s3, "gc")
        assert f"blobs/{kept[0][:2]}/{kept[0]}" in objs and f"blobs/{orphan[0][:2]}/{orphan[0]}" not in objs


def test_orphan_rule_table():
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    from deltasync.server.storage.s3objects import ObjectInfo

    def o(age_s: float) -> ObjectInfo:
        return ObjectInfo(key="k", size=1, modified=now - timedelta(seconds=age_s), etag=None)
    listing = {"a" * 32: o(10), "b" * 32: o(7200), "c" * 32: o(7200)}
    assert orphans(listing, {"c" * 32}, now=now, grace=3600) == ["b" * 32]
    assert orphans(listing, set(), now=now, grace=3600) == ["b" * 32, "c" * 32]
    assert orphans(listing, set(), now=now, grace=0) == sorted(listing)


# -- moto (conditional writes) ------------------------------------------------------------------

async def test_two_origins_race_to_commit_exactly_one_wins(moto_s3, tmp_path, monkeypatch):
    bucket_env(moto_s3, monkeypatch)
    prefix = f"race-{os.urandom(3).hex()}"

    def cfg(name: str):
        return origin_config(store_kind="s3", store_dir=tmp_path / name, s3_endpoint=moto_s3.endpoint,
                             bucket=BucketSettings(url=moto_s3.url(prefix), poll=0.2, gc_interval=0))
    async with serving(cfg("a")) as (a_url, a_svc), serving(cfg("b")) as (b_url, b_svc):
        assert a_svc.store.files.conditional and b_svc.store.files.conditional  # no lease: both may write
        async with session() as s:
            base = make_blob(20_000, 1)
            for url in (a_url, b_url):
                assert await put_blob(s, url, *base) in (200, 201)
            status, body = await put_manifest(s, a_url, keyframe("race", 1, [base]))
            assert status == 201, body
            wins = {"a": 0, "b": 0}
            for v in range(2, 6):
                ba, bb = make_blob(10_000, 10 * v), make_blob(10_000, 10 * v + 1)
                assert await put_blob(s, a_url, *ba) == 201 and await put_blob(s, b_url, *bb) == 201
                ma, mb = delta("race", v, v - 1, [ba]), delta("race", v, v - 1, [bb])
                (sa, ra), (sb, rb) = await asyncio.gather(put_manifest(s, a_url, ma), put_manifest(s, b_url, mb))
                assert sorted([sa, sb]) == [201, 409], (sa, ra, sb, rb)
                loser = ra if sa == 409 else rb
                assert loser["error"]["code"] == "chain", loser
                assert "another origin" in loser["error"]["message"] or "already committed" in loser["error"]["message"]
                wins["a" if sa == 201 else "b"] += 1
                winner = ma if sa == 201 else mb
                for url in (a_url, b_url):  # both origins now serve the winner (stateless)
                    await wait_head(s, url, "race", v)
                    async with s.get(f"{url}/v1/models/race/versions/{v}") as r:
                        assert r.status == 200 and await r.read() == winner.to_json()
            bucket = Bucket(parse_bucket_url(moto_s3.url(prefix), endpoint=moto_s3.endpoint))
            heads = decode_heads(await bucket.get("heads.json"))
            assert heads["race"].version == 5


def test_publishers_on_two_origins_one_gets_a_conflict(moto_s3, tmp_path, monkeypatch):
    bucket_env(moto_s3, monkeypatch)
    prefix = f"pubs-{os.urandom(3).hex()}"
    a = s3_origin(tmp_path, moto_s3, prefix, "a")
    b = s3_origin(tmp_path, moto_s3, prefix, "b")
    a.start(), b.start()
    a.wait_ready(60), b.wait_ready(60)
    try:
        ta, tb = RLTrace(SHAPE, lr=3e-4, seed=21), RLTrace(SHAPE, lr=3e-4, seed=22)
        with Publisher(a.url, "dup", TOKEN, KEY, keyframe_every=0) as pa:
            pa.publish(0, ta.step())
        pb = Publisher(b.url, "dup", TOKEN, KEY, keyframe_every=0, check_origin=False)
        pb.publish(0, tb.step())  # the same version, other content, through the other origin
        with pytest.raises(DeltaSyncError) as err:  # PublishError, naming the origin's 409
            pb.close(60)
        assert "ChainError" in str(err.value) and "dup v0 is already committed" in str(err.value), err.value
        # and origin b serves the version a committed, without any copy to its disk
        target = blank(ta.state())
        sub = ThreadedSubscriber([b.url], "dup", target, verifier=KEY)
        try:
            sub.start()
            assert sub.wait_version(0, 60) == 0
        finally:
            sub.close()
    finally:
        a.stop(), b.stop()
