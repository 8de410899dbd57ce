"""Relay tree benchmark: cut-through, fan-out, coalescing and a WAN-shaped tree, all in one run.

Every server is a real ``python -m deltasync.server.cli`` process on 127.0.0.1 (fsync on,
as deployed). Links are shaped, where stated, by benchmarks/relay_shaper.py (a userspace
TCP proxy, one process per link: serialization at the given rate plus one-way delay;
the kernel here has no netem). Readers are raw-socket HTTP clients that hash every body
(xxh3-128) and check it against the blob id. Baselines run in the same run, on the same
files, with the same readers.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import threading
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import xxhash

from deltasync.blob import blob_id
from deltasync.manifest import BlobRef, Manifest
from deltasync.server.metrics import parse_metrics
from relay_procs import FileServer, Shaper, cpu_seconds, http_get, max_rss_mb, origin, relay, start, stop

TOKEN = "bench-token"
GBIT = 125e6  # 1 Gbit/s in bytes per second
MiB = 1 << 20


def _data(n: int, seed: int) -> tuple[str, bytes]:
    data = np.random.default_rng(seed).bytes(n)
    return blob_id(data), data


async def _put_blob(s: aiohttp.ClientSession, url: str, bid: str, data: bytes) -> None:
    async with s.put(f"{url}/v1/blobs/{bid}", data=data, headers={"Authorization": f"Bearer {TOKEN}",
                                                                   "X-Deltasync-Model": "bench"}) as r:
        assert r.status in (200, 201), await r.text()


async def _put_manifest(s: aiohttp.ClientSession, url: str, m: Manifest) -> None:
    async with s.put(f"{url}/v1/models/{m.model}/versions/{m.version}", data=m.to_json(),
                     headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status in (200, 201), await r.text()


async def _metrics(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(f"{url}/metrics") as r:
        return parse_metrics(await r.text())


async def _get_ok(url: str, bid: str, size: int):
    got = await http_get(url, f"/v1/blobs/{bid}")
    assert got.status == 200 and got.nbytes == size and got.digest == bid, (url, got.status, got.nbytes)
    return got


def _manifest(model: str, version: int, parent: int | None, blobs: list[tuple[str, bytes]]) -> Manifest:
    return Manifest(model=model, version=version, parent=parent, kind="keyframe" if parent is None else "delta",
                    tensors=(), blobs=tuple(BlobRef(id=b, size=len(d)) for b, d in blobs),
                    state_fp=f"{version:016x}", state_fp_before=None if parent is None else f"{parent:016x}")


def _cpu(procs) -> list[float]:
    return [cpu_seconds(p.pid) for p in procs]


# -- 1. cut-through through a chain of three relays -------------------------------------------------

async def _chain(work: Path, s, o, size: int, *, shaped: bool, runs: int) -> dict:
    """Direct read vs the same read through 3 relays, ``runs`` times with a fresh blob each (best kept)."""
    tag = "shaped" if shaped else "loopback"
    blobs = []
    for i in range(runs):
        bid, data = _data(size, (1 if shaped else 2) * 100 + i)
        await _put_blob(s, o.url, bid, data)
        blobs.append(bid)
        del data
    links, relays = [], []
    if shaped:
        direct = Shaper(work, f"{tag}-direct", o.port, rate=GBIT, delay=0)
        links.append(direct)
    up_port, up_url = o.port, o.url
    for i in range(3):
        if shaped:
            link = Shaper(work, f"{tag}-link{i}", up_port, rate=GBIT, delay=0)
            links.append(link)
            up_url = link.url
        r = relay(work, f"{tag}-r{i}", [up_url])
        relays.append(r)
        up_port, up_url = r.port, r.url
    last = Shaper(work, f"{tag}-last", up_port, rate=GBIT, delay=0) if shaped else None
    if last:
        links.append(last)
    start(*links, *relays)
    await asyncio.sleep(0.5)
    gb = size / 1e9
    best: dict | None = None
    try:
        for bid in blobs:
            await asyncio.to_thread(os.sync)
            c0 = _cpu_split([o])
            d = await _get_ok(direct.url if shaped else o.url, bid, size)
            origin_cpu = _diff(c0, _cpu_split([o]))[0]
            c0 = _cpu_split(relays + links)
            chain = await _get_ok(last.url if shaped else relays[-1].url, bid, size)
            cpu = _diff(c0, _cpu_split(relays + links))
            await asyncio.sleep(0.3)  # let the last relay move the blob into its store
            c0 = _cpu_split([relays[-1]])
            warm = await _get_ok(last.url if shaped else relays[-1].url, bid, size)
            warm_cpu = _diff(c0, _cpu_split([relays[-1]]))[0]
            run = {"size": size, "direct": d, "chain": chain, "warm": warm,
                   "origin_cpu_per_gb": sum(origin_cpu) / gb,
                   "relay_cpu_per_gb": [(u / gb, k / gb) for u, k in cpu[:3]],
                   "link_cpu_per_gb": [(u + k) / gb for u, k in cpu[3:]],
                   "warm_cpu_per_gb": sum(warm_cpu) / gb, "runs": runs}
            if best is None or chain.seconds < best["chain"].seconds:
                best = run
        best["rss"] = [max_rss_mb(r.pid) for r in relays]
        if not shaped:
            src = work / "origin" / "blobs" / blobs[0][:2] / blobs[0]
            best["floor"] = await asyncio.to_thread(_receive_floor, src, size, work / "floor.tmp")
    finally:
        stop(*relays, *links)
    return best


def _receive_floor(src: Path, size: int, scratch: Path) -> tuple[float, float]:
    """CPU s/GB of a minimal blocking loop doing a relay's unavoidable receive work: ``recv_into`` a reused
    buffer, xxh3, ``os.write`` into a new file (best of 2). The sender (sendfile) runs on another thread
    and is not counted. Returns (user, system) s/GB."""
    best = None
    for _ in range(2):
        a, b = socket.socketpair()

        def send() -> None:
            fd = os.open(src, os.O_RDONLY)
            off = 0
            while off < size:
                off += os.sendfile(a.fileno(), fd, off, size - off)
            os.close(fd)
            a.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        out = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        hasher = xxhash.xxh3_128()
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        while n := b.recv_into(view):
            hasher.update(view[:n])
            os.write(out, view[:n])
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        sender.join()
        os.close(out)
        a.close()
        b.close()
        os.unlink(scratch)
        run = ((r1.ru_utime - r0.ru_utime) / (size / 1e9), (r1.ru_stime - r0.ru_stime) / (size / 1e9))
        if best is None or sum(run) < sum(best):
            best = run
    return best


async def _aiohttp_floor(work: Path, s, o, size: int) -> tuple[float, float]:
    """CPU s/GB (user, system) of a bare aiohttp receive loop (benchmarks/relay_recv_aiohttp.py) reading a
    blob from the origin: what the relay's receive side cost through aiohttp's client (best of 2)."""
    import subprocess
    import sys
    bid, data = _data(size, 950)
    await _put_blob(s, o.url, bid, data)
    del data
    best = None
    for _ in range(2):
        await asyncio.to_thread(os.sync)
        r = await asyncio.to_thread(
            subprocess.run, [sys.executable, str(Path(__file__).with_name("relay_recv_aiohttp.py")),
                             f"{o.url}/v1/blobs/{bid}", str(work / "aiohttp-floor.tmp")],
            capture_output=True, text=True, check=True)
        u, k, digest = r.stdout.split()
        assert digest == bid
        run = (float(u) / (size / 1e9), float(k) / (size / 1e9))
        if best is None or sum(run) < sum(best):
            best = run
    return best


async def _single(work: Path, s, o, size: int, runs: int) -> dict[str, tuple[float, float]]:
    """CPU s/GB (user, kernel) of ONE cold relay forwarding a blob to one reader: the chain's figure
    without three relays, the origin and the reader fighting over two cores (best of ``runs``), for each
    of three cases, interleaved: ``"asked"``, a blob a reader asks for first (no manifest names it: the
    relay takes its size on the parent's word); ``"published"``, a blob of a published version (the relay
    prefetches it when the version is announced, its size known from the manifest; the reader joins that
    fetch); ``"hinted"``, the same version with the relay following the origin's upload hints (the
    deployed default: it copies the blob while it is uploaded, and the reader asks once the version is
    announced). The first two run on a relay started with ``--no-hinted-fetch``; the third on a relay and an
    origin of its own, started for its round (a relay following an origin that holds other versions would
    prefetch them first, and the first relay would prefetch the hinted rounds' versions). Each run is counted
    from before the upload until the reader has every byte and the relay's copy is committed."""
    plain = relay(work, "single", [o.url], "--no-hinted-fetch")
    start(plain)
    best: dict[str, tuple[float, float]] = {}
    cases = (("asked", False), ("published", True), ("hinted", True))
    try:
        for i in range(runs):
            for j, (case, published) in enumerate(cases):  # interleaved: the load drifts
                r, ro, rdir = plain, o, work / "single"
                if case == "hinted":
                    own = work / f"hinted{i}"
                    own.mkdir()
                    ro = origin(own, TOKEN)
                    r, rdir = relay(own, "relay", [ro.url]), own / "relay"
                    start(ro, r)
                    await asyncio.sleep(0.5)  # following the origin's events
                bid, data = _data(size, 900 + 10 * i + j)
                # the hinted case: a model of its own per round (its fresh relay catches up on no older version)
                model, version = (f"hinted{i}", 0) if case == "hinted" else (f"single{j}", i)
                m = _manifest(model, version, None, [(bid, data)]) if published else None
                await asyncio.to_thread(os.sync)
                c0 = _cpu_split([r])
                await _put_blob(s, ro.url, bid, data)
                del data
                if m is not None:  # the relay prefetches the announced version; the reader joins that fetch
                    await _put_manifest(s, ro.url, m)
                    await _head(r.url, version - 1, model)  # announced: a subscriber would ask now
                got = await http_get(r.url, f"/v1/blobs/{bid}")
                assert got.status == 200 and got.nbytes == size and got.digest == bid, (case, got.status, got.nbytes)
                stored = rdir / "blobs" / bid[:2] / bid  # counted until the relay's copy is committed
                for _ in range(600):
                    if stored.exists():
                        break
                    await asyncio.sleep(0.05)
                u, k = (x / (size / 1e9) for x in _diff(c0, _cpu_split([r]))[0])
                if case not in best or u + k < sum(best[case]):
                    best[case] = (u, k)
                if r is not plain:
                    stop(r, ro)
                # the round's copies leave the page cache: with 9 rounds' blobs kept (4.6 GiB) every later round
                # allocated pages under more pressure and cost more (the same case rose from ~0.8 to ~1.3 CPU-s/GB)
                stored.unlink(missing_ok=True)
                (Path(ro.cmd[ro.cmd.index("--store") + 1]) / "blobs" / bid[:2] / bid).unlink(missing_ok=True)
    finally:
        stop(plain)
    return best


def _cpu_split(procs) -> list[tuple[float, float]]:
    return [cpu_seconds(p.pid, split=True) for p in procs]


def _diff(before, after) -> list[tuple[float, float]]:
    return [(a[0] - b[0], a[1] - b[1]) for b, a in zip(before, after)]


# -- 2. fan-out of a keyframe, against plain FileResponse servers ---------------------------------------

async def _fanout(work: Path, s, o, blob_size: int, nblobs: int, readers: int) -> dict:
    blobs = [_data(blob_size, 100 + i) for i in range(nblobs)]
    for bid, data in blobs:
        await _put_blob(s, o.url, bid, data)
    ids = [(bid, len(data)) for bid, data in blobs]
    m = _manifest("fanout", 1, None, blobs)
    del blobs
    # --no-hinted-fetch: the coalescing round uploads a blob while these relays run; it times 32 readers
    # joining one fetch, which an upload hint would have started (and finished) before they ask
    ra, rb = relay(work, "fan-a", [o.url], "--no-hinted-fetch"), relay(work, "fan-b", [o.url], "--no-hinted-fetch")
    start(ra, rb)
    await asyncio.sleep(0.5)
    total = readers * sum(n for _, n in ids)

    async def reader(url: str, wait_head: bool) -> float:
        if wait_head:
            got = await http_get(url, "/v1/models/fanout/head?after=0&wait=60", verify=False)
            assert got.status == 200
        for bid, n in ids:
            await _get_ok(url, bid, n)
        return time.perf_counter()

    urls = [ra.url if i < readers // 2 else rb.url for i in range(readers)]
    try:
        tasks = [asyncio.create_task(reader(u, True)) for u in urls]
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        c0 = _cpu([o, ra, rb])
        await _put_manifest(s, o.url, m)
        cold = max(await asyncio.gather(*tasks)) - t0
        c1 = _cpu([o, ra, rb])
        await asyncio.sleep(0.5)
        await asyncio.to_thread(os.sync)
        warm = float("inf")
        for _ in range(2):  # best of 2
            c2 = _cpu([ra, rb])
            t0 = time.perf_counter()
            took = max(await asyncio.gather(*(reader(u, False) for u in urls))) - t0
            if took < warm:
                warm, c3 = took, _cpu([ra, rb])
                warm_cpu = sum(c3) - sum(c2)
        mt = [await _metrics(s, r.url) for r in (ra, rb)]
        coalesce = await _coalesce(work, s, o, ra, blob_size)
        rss = [max_rss_mb(r.pid) for r in (ra, rb)]
    finally:
        stop(ra, rb)
    base = {}
    for loop_name in ("asyncio", "uvloop"):
        servers = [FileServer(work, f"fileserver-{loop_name}-{i}", o_blobs(work), uvloop=loop_name == "uvloop")
                   for i in range(2)]
        start(*servers)
        try:
            for _ in range(2):  # best of 2
                c0 = _cpu(servers)
                t0 = time.perf_counter()
                done = await asyncio.gather(*(reader(servers[0 if i < readers // 2 else 1].url, False)
                                              for i in range(readers)))
                run = (max(done) - t0, sum(_cpu(servers)) - sum(c0))
                if loop_name not in base or run[0] < base[loop_name][0]:
                    base[loop_name] = run
        finally:
            stop(*servers)
    gb = total / 1e9
    return {"total": total, "cold": cold, "warm": warm, "base": base, "readers": readers, "nblobs": nblobs,
            "blob_size": blob_size, "cold_cpu": [(b - a) / gb for a, b in zip(c0, c1)],
            "warm_cpu_per_gb": warm_cpu / gb, "upstream": [x["deltasync_upstream_fetches_total"] for x in mt],
            "coalesce": coalesce, "rss": rss}


def o_blobs(work: Path) -> Path:
    return work / "origin" / "blobs"


async def _coalesce(work: Path, s, o, r, size: int) -> dict:
    bid, data = _data(size, 7)
    await _put_blob(s, o.url, bid, data)
    del data
    before_r, before_o = await _metrics(s, r.url), await _metrics(s, o.url)
    t0 = time.perf_counter()
    got = await asyncio.gather(*(http_get(r.url, f"/v1/blobs/{bid}") for _ in range(32)))
    took = time.perf_counter() - t0
    after_r, after_o = await _metrics(s, r.url), await _metrics(s, o.url)
    ok = all(g.status == 200 and g.digest == bid for g in got)
    return {"ok": ok, "seconds": took, "size": size,
            "upstream": after_r["deltasync_upstream_fetches_total"] - before_r["deltasync_upstream_fetches_total"],
            "coalesced": after_r["deltasync_coalesced_total"] - before_r["deltasync_coalesced_total"],
            "hits": after_r["deltasync_cache_hits_total"] - before_r["deltasync_cache_hits_total"],
            "origin_gets": after_o["deltasync_blob_requests_total"] - before_o["deltasync_blob_requests_total"]}


# -- 3. a WAN-shaped tree ----------------------------------------------------------------------------------

async def _wan(work: Path, s, o, blob_size: int, nblobs: int, delay: float, rounds: int) -> dict:
    mids, leaves, links = [], [], []
    for i in range(2):
        link = Shaper(work, f"wan-o-m{i}", o.port, rate=GBIT, delay=delay)
        links.append(link)
        # --no-hinted-fetch: the blobs are uploaded before the timed window (commit -> every leaf); with upload
        # hints the relays would copy them during the upload, outside it (the shardcast scenario times that path)
        mids.append(relay(work, f"wan-m{i}", [link.url], "--no-hinted-fetch",
                          *os.environ.get("DELTASYNC_BENCH_RELAY_ARGS", "").split()))
    for i in range(4):
        link = Shaper(work, f"wan-m-l{i}", mids[i // 2].port, rate=GBIT, delay=delay)
        links.append(link)
        leaves.append(relay(work, f"wan-l{i}", [link.url], "--no-hinted-fetch",
                            *os.environ.get("DELTASYNC_BENCH_RELAY_ARGS", "").split()))
    direct = Shaper(work, "wan-direct", o.port, rate=GBIT, delay=delay)
    start(*links, direct, *mids, *leaves)

    async def following(r) -> bool:
        async with s.get(f"{r.url}/healthz") as resp:
            return (await resp.json()).get("following") is not None
    deadline = time.monotonic() + 60
    while not all([await following(r) for r in (*mids, *leaves)]):
        if time.monotonic() > deadline:
            raise RuntimeError("WAN relays did not all connect to their parents' event streams in 60 s")
        await asyncio.sleep(0.05)
    procs = [o, *mids, *leaves, *links, direct]

    async def subscriber(url: str, after: int) -> tuple[float, float]:
        """Long-poll the head, then fetch every blob of it at once; (head seen, all bytes in)."""
        got = await _head(url, after)
        seen = time.perf_counter()
        await asyncio.gather(*(_get_ok(url, b["id"], b["size"]) for b in got["blobs"]))
        return seen, time.perf_counter()

    results = []
    try:
        for rnd in range(rounds):
            version = rnd + 1
            blobs = [_data(blob_size, 1000 * version + i) for i in range(nblobs)]
            for bid, data in blobs:
                await _put_blob(s, o.url, bid, data)
            m = _manifest("wan", version, None if version == 1 else version - 1, blobs)
            del blobs
            subs = [asyncio.create_task(subscriber(direct.url, version - 1))]
            subs += [asyncio.create_task(subscriber(leaf.url, version - 1)) for leaf in leaves]
            await asyncio.sleep(1.0)  # every long-poll is parked at its server
            c0 = sum(_cpu(procs))
            t0 = time.perf_counter()
            await _put_manifest(s, o.url, m)
            done = await asyncio.gather(*subs)
            busy = (sum(_cpu(procs)) - c0) / (time.perf_counter() - t0)
            results.append({"direct": [x - t0 for x in done[0]], "leaves": [[x - t0 for x in d] for d in done[1:]],
                            "busy": busy})
        mt = [await _metrics(s, r.url) for r in mids]
    finally:
        stop(*leaves, *mids, *links, direct)
    return {"rounds": results, "size": blob_size * nblobs, "nblobs": nblobs, "delay": delay,
            "mid_upstream": [x["deltasync_upstream_fetches_total"] for x in mt]}


async def _head(url: str, after: int, model: str = "wan") -> dict:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /v1/models/{model}/head?after={after}&wait=60 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                 .encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 90)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split()[1] == b"200", head[:200]
    return json.loads(body)


# -- report -------------------------------------------------------------------------------------------------

def _mbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:,.0f}"


def _report(shaped: dict, lo: dict, fan: dict, wan: dict, quick: bool, load: tuple[float, float]) -> str:
    out = ["## Relay tree (bench_relay)", ""]
    out.append(
        "Real origin and relay processes on 127.0.0.1 (fsync on). Shaped links are "
        "`benchmarks/relay_shaper.py`, a userspace TCP proxy per link (serialization at 1 Gbit/s plus one-way "
        "delay, a window of rate x delay + 4 MiB; TCP slow start across the delay is not modelled). Readers "
        "hash every body and check it against the blob id. CPU figures are user+system seconds of the named "
        "process from /proc. This machine is shared: load average "
        f"{load[0]:.1f} before and {load[1]:.1f} after this section, so absolute times are noisy."
        + (" **Quick mode: small sizes.**" if quick else ""))
    out.append("")

    def chain_rows(r: dict, label: str) -> list[str]:
        d, c, w = r["direct"], r["chain"], r["warm"]
        size = r["size"]
        return [
            f"| {label}: origin → client (1 link) | {d.seconds:.3f} | {d.first_byte * 1000:.1f} | "
            f"{_mbps(size, d.seconds)} | 1.00 |",
            f"| {label}: origin → 3 relays → client (4 links), cold | {c.seconds:.3f} | {c.first_byte * 1000:.1f} | "
            f"{_mbps(size, c.seconds)} | **{c.seconds / d.seconds:.2f}** |",
            f"| {label}: last relay → client, cached (sendfile) | {w.seconds:.3f} | {w.first_byte * 1000:.1f} | "
            f"{_mbps(size, w.seconds)} | {w.seconds / d.seconds:.2f} |",
        ]

    out += [f"### Cut-through: one {shaped['size'] / MiB:.0f} MiB blob through a chain of 3 relays", "",
            "| path | seconds | first byte ms | MB/s | time / direct |", "|---|---:|---:|---:|---:|",
            *chain_rows(shaped, "1 Gbit/s links"), *chain_rows(lo, "loopback"), ""]
    sf = 4 * shaped["direct"].seconds
    out.append(f"Shaped: store-and-forward would take about 4 link transfers ≈ {sf:.2f} s "
               f"(4.00x); the wire time of one link is {shaped['size'] / GBIT:.2f} s. Target ≤ 1.2x.")
    out.append("")
    out += [f"CPU seconds per GB forwarded (loopback run, best of {lo['runs']} by chain time; transfers are CPU-bound "
            "on 2 cores):", "",
            "| process | CPU s/GB | of which kernel |", "|---|---:|---:|",
            f"| origin, serving the direct read (sendfile) | {lo['origin_cpu_per_gb']:.3f} | |"]
    for i, (u, k) in enumerate(lo["relay_cpu_per_gb"]):
        out.append(f"| relay {i + 1} of 3, cold (receive, hash, write to cache, cut-through sendfile) | {u + k:.3f} | "
                   f"{k:.3f} |")
    out.append(f"| relay 3, cached blob (sendfile) | {lo['warm_cpu_per_gb']:.3f} | |")
    single = lo["single"]
    su, sk = single["published"]
    out.append(f"| **one relay alone, cold: a published version** (origin → relay → one reader, no other relay "
               f"competing for the 2 cores; the relay prefetches the announced version, the reader joins the fetch; "
               f"counted until the relay's copy is committed) | **{su + sk:.3f}** | {sk:.3f} |")
    hu, hk = single["hinted"]
    out.append(f"| the same, the relay following the origin's upload hints (the default: it copies the blob while "
               f"it is uploaded; the reader asks once the version is announced; counted from before the upload) | "
               f"{hu + hk:.3f} | {hk:.3f} |")
    qu, qk = single["asked"]
    out.append(f"| the same, a blob no manifest names (a reader asks first) | {qu + qk:.3f} | {qk:.3f} |")
    fu, fk = lo["floor"]
    out.append(f"| floor: a minimal blocking loop doing only the receive side (recv_into, xxh3, os.write), same "
               f"bytes, this run | {fu + fk:.3f} | {fk:.3f} |")
    au, ak = lo["aiohttp_floor"]
    out.append(f"| baseline: a bare aiohttp receive loop (aiohttp client on uvloop, readchunk, xxh3, os.write), "
               f"same size, this run | {au + ak:.3f} | {ak:.3f} |")
    out.append(f"| shaper, per 1 Gbit/s link (shaped run, mean of 4) | {statistics.mean(shaped['link_cpu_per_gb']):.3f} | |")
    out.append("")
    out.append(f"One cold relay costs **{(su + sk) / (fu + fk):.2f}x** the blocking floor and "
               f"{(su + sk) / (au + ak):.2f}x a bare aiohttp receive loop that does only the receiving (issue 10's "
               "target: 0.6 CPU-s/GB where the floor is 0.28, about 2.1x). The relay reads bodies from its parents "
               "with server/http/blobget.py (the event loop receives into one 1 MiB buffer; pieces are hashed and written "
               "from there, no copies in Python) and forwards them with sendfile. Its two halves, each measured "
               f"alone in this run: the receive floor ({fu + fk:.3f}) plus a cached blob's sendfile to one reader "
               f"({lo['warm_cpu_per_gb']:.3f}, relay 3 above; on loopback the sender also runs the reader's TCP "
               f"receive path) = {fu + fk + lo['warm_cpu_per_gb']:.3f} CPU-s/GB, which the 0.6 target is "
               f"{'under' if fu + fk + lo['warm_cpu_per_gb'] > 0.6 else 'over'} on this machine.")
    out.append("")
    out.append("A cold relay's figure covers receiving (socket copy, xxh3, one copy into the page cache, fsync) and "
               "sending (sendfile, zero-copy); it is mostly kernel time. On loopback the sender's CPU also runs the "
               "receiving side's TCP processing (softirq), so a relay pays part of its child's receive work, and "
               "perf shows the page-cache copy, socket copies and that TCP work on top; the Python share (user "
               "time, including the one copy out of the event loop's read buffer) is small. The floor row does "
               "only the receive half, without the event loop, fsync or any sending.")
    out.append("")
    out.append(f"Relay peak RSS (loopback run): {', '.join(f'{x:.0f}' for x in lo['rss'])} MiB "
               "(servers do not import torch).")
    out.append("")

    base_t, base_cpu = min(fan["base"].values(), key=lambda x: x[0])
    best_loop = min(fan["base"], key=lambda k: fan["base"][k][0])
    total = fan["total"]
    out += [f"### Fan-out: a {fan['nblobs']} x {fan['blob_size'] / MiB:.0f} MiB keyframe, origin → 2 relays → "
            f"{fan['readers']} concurrent readers", "",
            "Warm and baseline rows are the best of 2.", "",
            "| run | seconds | aggregate MB/s | egress vs FileResponse |", "|---|---:|---:|---:|",
            f"| cold: publish → every reader has every byte (relays fetch from the origin meanwhile) | "
            f"{fan['cold']:.3f} | {_mbps(total, fan['cold'])} | {base_t / fan['cold']:.2f} |",
            f"| warm: relays serve from their caches | {fan['warm']:.3f} | {_mbps(total, fan['warm'])} | "
            f"**{base_t / fan['warm']:.2f}** |"]
    for name, (t, cpu) in fan["base"].items():
        out.append(f"| baseline: 2 plain aiohttp `FileResponse` servers ({name} loop), same files and readers | "
                   f"{t:.3f} | {_mbps(total, t)} | {base_t / t:.2f} |")
    out.append("")
    out.append(f"Egress fraction = relay egress MB/s / best baseline MB/s ({best_loop} loop); target ≥ 0.8. "
               f"Each relay fetched each blob once from the origin (upstream fetches: "
               f"{', '.join(f'{x:.0f}' for x in fan['upstream'])}). Relay CPU when warm: "
               f"{fan['warm_cpu_per_gb']:.3f} s/GB served; relay peak RSS "
               f"{', '.join(f'{x:.0f}' for x in fan['rss'])} MiB.")
    out.append("")
    c = fan["coalesce"]
    out += ["### Coalescing", "",
            f"32 simultaneous GETs of one {c['size'] / MiB:.0f} MiB blob missing at a relay: "
            f"**{c['upstream']:.0f} upstream fetch**: {c['coalesced']:.0f} requests joined the fetch in flight, "
            f"{c['hits']:.0f} arrived after it had landed and were served from disk; the origin saw "
            f"{c['origin_gets']:.0f} GET. All 32 bodies verified: {c['ok']}; {c['seconds']:.2f} s "
            f"({_mbps(32 * c['size'], c['seconds'])} MB/s aggregate).", ""]

    rtt = 2 * wan["delay"]
    transfer = wan["size"] / GBIT
    out += [f"### WAN-shaped tree: {wan['delay'] * 1000:.0f} ms one-way delay, 1 Gbit/s per link, a "
            f"{wan['nblobs']} x {wan['size'] / wan['nblobs'] / MiB:.0f} MiB version", "",
            "Origin →(WAN)→ 2 relays →(WAN)→ 4 leaf relays →(loopback)→ one subscriber per leaf, as a cluster "
            "relay would sit next to its inference servers; the baseline subscriber reads from the origin over "
            "one WAN link, so the leaves are one WAN tier further away. Subscribers long-poll the head, then "
            "fetch every blob at once. Seconds from the commit at the origin:", "",
            "| version | direct: head seen | direct: all bytes | leaves: head seen (max) | leaves: all bytes "
            "(max) | extra per WAN tier | CPU cores busy (servers + shapers) |", "|---|---:|---:|---:|---:|---:|---:|"]
    extras = []
    for i, r in enumerate(wan["rounds"]):
        d_seen, d_done = r["direct"]
        l_seen = max(x[0] for x in r["leaves"])
        l_done = max(x[1] for x in r["leaves"])
        extra = l_done - d_done  # the leaves sit one WAN tier further than the direct subscriber
        extras.append(extra)
        out.append(f"| v{i + 1} | {d_seen:.3f} | {d_done:.3f} | {l_seen:.3f} | {l_done:.3f} | {extra:.3f} | "
                   f"{r['busy']:.2f} |")
    out.append("")
    out.append(
        f"One transfer over a link takes {transfer:.3f} s and one round trip {rtt:.3f} s. The extra WAN tier "
        f"costs {statistics.median(extras):.3f} s (median over the versions), against ≈ "
        f"{transfer + rtt:.3f} s (one more transfer and round trip) for store-and-forward. A version is "
        f"announced one tier down about one one-way delay later (head seen: "
        f"{statistics.median(max(x[0] for x in r['leaves']) - r['direct'][0] for r in wan['rounds']):.3f} s "
        "later at the leaves than at the origin). Where the CPU column nears 2.0 the byte times are bounded by "
        "this 2-core machine (servers, shapers and readers share it), not by the links. "
        "Each mid relay fetched each blob once (upstream fetches: "
        f"{', '.join(f'{x:.0f}' for x in wan['mid_upstream'])}).")
    return "\n".join(out) + "\n"


async def _run(quick: bool) -> str:
    work = Path(tempfile.mkdtemp(prefix="deltasync-bench-relay-"))
    load0 = os.getloadavg()[0]
    o = origin(work, TOKEN)
    start(o)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            chain_size = 64 * MiB if quick else 256 * MiB
            # Each experiment starts with the page cache's dirty data written out, so the previous
            # one's writeback does not stall this one's file creations.
            await asyncio.to_thread(os.sync)
            shaped = await _chain(work, s, o, chain_size, shaped=True, runs=1)
            await asyncio.to_thread(os.sync)
            lo = await _chain(work, s, o, chain_size, shaped=False, runs=3)
            await asyncio.to_thread(os.sync)
            lo["single"] = await _single(work, s, o, chain_size, runs=3)
            await asyncio.to_thread(os.sync)
            lo["aiohttp_floor"] = await _aiohttp_floor(work, s, o, chain_size)
            await asyncio.to_thread(os.sync)
            # A fresh origin for the fan-out too: its relays would otherwise prefetch the earlier scenarios'
            # versions (the single-relay rounds' keyframes) while its cold round is timed.
            fan_work = work / "fan"
            fan_work.mkdir()
            o1 = origin(fan_work, TOKEN)
            start(o1)
            try:
                fan = await _fanout(fan_work, s, o1, (16 if quick else 64) * MiB, 8, 8)
            finally:
                stop(o1)
            await asyncio.to_thread(os.sync)
            # A fresh origin: relays prefetch every model their parent has, and the fan-out keyframe
            # would otherwise share the WAN links with the versions being timed.
            wan_work = work / "wan"
            wan_work.mkdir()
            o2 = origin(wan_work, TOKEN)
            start(o2)
            try:
                wan = await _wan(wan_work, s, o2, (4 if quick else 16) * MiB, 4, 0.075, 3)
            finally:
                stop(o2)
    finally:
        stop(o)
        if os.environ.get("DELTASYNC_BENCH_KEEP") is None:
            shutil.rmtree(work, ignore_errors=True)
    return _report(shaped, lo, fan, wan, quick, (load0, os.getloadavg()[0]))


def run(quick: bool = False) -> str:
    try:
        import uvloop
        return uvloop.run(_run(quick))
    except ImportError:
        return asyncio.run(_run(quick))


if __name__ == "__main__":
    import sys
    print(run(quick="--quick" in sys.argv))
