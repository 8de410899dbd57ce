"""One cold relay's CPU per GB forwarded, against the blocking receive floor, in one run (issue 10).

An origin and one relay (real ``python -m deltasync.server.cli`` processes, fsync on as deployed, no
key unless ``--key``), one reader on loopback. Each round puts a fresh blob on the origin and reads
it through the relay (a cold miss: the relay receives, hashes, writes its cache and forwards
cut-through); the relay's user and system CPU over the read, per GB, best of ``--runs``. The floor
(``bench_relay._receive_floor``: a blocking loop doing only recv_into, xxh3, os.write) runs on the
same blob after each round (best of them), so both see the same load. ``--key``: the relay holds a verify key and the blob is named by a signed
manifest carrying its BLAKE3 digest (the relay checks it); ``--perf FILE``: record the relay with
``perf record -g`` during the reads (py-spy 0.4.3 cannot read this machine's Python processes).

``--before PYTHON``: a second relay run by another interpreter (e.g. main's venv), its rounds interleaved with
this one's, so a change is measured side by side under the same load.

``python benchmarks/relay_coldcpu.py [--size-mib 256] [--runs 3] [--key] [--perf perf.data] [--before PY]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_relay import TOKEN, _data, _get_ok, _manifest, _put_blob, _put_manifest, _receive_floor  # noqa: E402
from relay_procs import cpu_seconds, origin, relay, start, stop  # noqa: E402

KEY_HEX = bytes(range(32)).hex()


def _relay_with(python: str, work: Path, name: str, parents: list[str], *extra: str):
    """A relay run by another interpreter (another checkout's venv: the "before" of a side-by-side)."""
    real = sys.executable
    sys.executable = python  # relay_procs builds its command from it
    try:
        return relay(work, name, parents, *extra)
    finally:
        sys.executable = real


async def _run(size: int, runs: int, key: bool, pyspy: str | None, relay_args: tuple[str, ...] = (),
               before: str | None = None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="deltasync-coldcpu-"))
    try:
        extra: list[str] = list(relay_args)
        if key:
            (work / "key").write_text(KEY_HEX + "\n")
            extra += ["--key-file", str(work / "key")]
        o = origin(work, TOKEN)
        start(o)
        # --no-hinted-fetch: each round uploads its blob first and counts the relay's CPU from the read on
        # (bench_relay's "hinted" case counts a relay that copies the upload, from before it)
        r = relay(work, "relay", [o.url], "--no-hinted-fetch", *extra)
        start(r)
        if before is not None:
            rb = _relay_with(before, work, "relay-before", [o.url], *extra)
            start(rb)
        spy = None
        if pyspy:
            spy = subprocess.Popen(["perf", "record", "-F", "2999", "-g", "-p", str(r.pid), "-o", pyspy],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await asyncio.sleep(1.0)
        best = floor = None
        best_before = None
        runs_after: list[float] = []
        runs_before: list[float] = []
        src = None
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
                for i in range(runs):
                    if before is not None:  # the same round through the "before" relay, on its own blob
                        bid, data = _data(size, 900 + i)
                        await _put_blob(s, o.url, bid, data)
                        del data
                        await asyncio.to_thread(os.sync)
                        c0 = cpu_seconds(rb.pid, split=True)
                        await _get_ok(rb.url, bid, size)
                        c1 = cpu_seconds(rb.pid, split=True)
                        run = ((c1[0] - c0[0]) / (size / 1e9), (c1[1] - c0[1]) / (size / 1e9))
                        runs_before.append(sum(run))
                        if best_before is None or sum(run) < sum(best_before):
                            best_before = run
                    bid, data = _data(size, 700 + i)
                    await _put_blob(s, o.url, bid, data)
                    if key:  # a signed manifest names it (with its digest): the relay checks the digest
                        m = _manifest("coldcpu", i, None, [(bid, data)]).with_digests({bid: data}).sign(bytes(range(32)))
                        await _put_manifest(s, o.url, m)
                    del data
                    src = work / "origin" / "blobs" / bid[:2] / bid
                    await asyncio.to_thread(os.sync)
                    if key:  # the relay prefetches announced versions: wait until the fetch is done
                        c0 = cpu_seconds(r.pid, split=True)
                        t0 = time.monotonic()
                        while not (work / "relay" / "blobs" / bid[:2] / bid).exists():
                            await asyncio.sleep(0.02)
                            assert time.monotonic() - t0 < 120
                        c1 = cpu_seconds(r.pid, split=True)
                    else:
                        c0 = cpu_seconds(r.pid, split=True)
                        await _get_ok(r.url, bid, size)
                        c1 = cpu_seconds(r.pid, split=True)
                    gb = size / 1e9
                    run = ((c1[0] - c0[0]) / gb, (c1[1] - c0[1]) / gb)
                    runs_after.append(sum(run))
                    if best is None or sum(run) < sum(best):
                        best = run
                    # the floor on the same bytes, interleaved with the relay's rounds (the load drifts)
                    f = await asyncio.to_thread(_receive_floor, src, size, work / "floor.tmp")
                    if floor is None or sum(f) < sum(floor):
                        floor = f
        finally:
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
            stop(r, o, *([rb] if before is not None else []))
        return {"relay": best, "floor": floor, "size": size, "runs": runs, "key": key,
                "load": os.getloadavg()[0], "before": best_before, "all": runs_after, "all_before": runs_before}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--key", action="store_true")
    p.add_argument("--perf", dest="pyspy", metavar="FILE")
    p.add_argument("--no-fsync", action="store_true", help="the relay without fsync (to see what it costs)")
    p.add_argument("--before", metavar="PYTHON", help="also a relay run by this interpreter (another checkout's "
                   "venv, e.g. main's), its rounds interleaved with this one's (no key rounds only)")
    a = p.parse_args(argv)
    go = _run(a.size_mib << 20, a.runs, a.key, a.pyspy, ("--no-fsync",) if a.no_fsync else (),
              None if a.key else a.before)
    try:
        import uvloop
        res = uvloop.run(go)
    except ImportError:
        res = asyncio.run(go)
    ru, rk = res["relay"]
    fu, fk = res["floor"]
    what = "prefetch with BLAKE3 digest check (key)" if a.key else "cold GET through the relay (no key)"
    what += ", no fsync" if a.no_fsync else ""
    print(f"{what}: relay {ru + rk:.3f} CPU-s/GB (user {ru:.3f}, sys {rk:.3f}); floor {fu + fk:.3f} "
          f"(user {fu:.3f}, sys {fk:.3f}); ratio {(ru + rk) / (fu + fk):.2f}x; {res['size'] >> 20} MiB, best of "
          f"{res['runs']}, load {res['load']:.1f}")
    print("every round: " + " ".join(f"{x:.3f}" for x in res["all"]) + f" (median {statistics.median(res['all']):.3f})")
    if res["before"] is not None:
        bu, bk = res["before"]
        print(f"before ({a.before}): relay {bu + bk:.3f} CPU-s/GB (user {bu:.3f}, sys {bk:.3f}); ratio to the floor "
              f"{(bu + bk) / (fu + fk):.2f}x; after / before {(ru + rk) / (bu + bk):.2f}")
        mb, ma = statistics.median(res["all_before"]), statistics.median(res["all"])
        print("before, every round: " + " ".join(f"{x:.3f}" for x in res["all_before"])
              + f" (median {mb:.3f}); medians after / before {ma / mb:.2f}")


if __name__ == "__main__":
    main()
