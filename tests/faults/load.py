"""Load and soak (issue 9): ``python tests/faults/load.py [--subs 500] [--versions 1000] --out docs/RELIABILITY.md``.

**Load**: one origin, one relay (server processes), ``--subs`` asyncio ``Subscriber`` clients spread
over ``--workers`` processes, all following the relay (event streams and long-polls held, blobs
streamed). ``--load-versions`` versions are published 1 s apart; each worker records when each of
its subscribers first held each version. Reported: relay RSS (peak, sampled), p50 / p99 / max time
from a version's acknowledgement to a subscriber holding it, subscribers starved (missing the last
version at the end), wrong states (compared bit-exactly).

**Soak**: ``--versions`` versions of a small state through origin → relay → relay (3 tiers), published
back to back, while subscribers join (one every ``--join-every`` versions, on either relay) and leave
(the oldest once more than 4 are following); each leaving subscriber and every one left at the end
is compared bit-exactly with the state of the version it holds. Disk: the relays run with
``--cache-size``, which their blob caches must stay within (plus one version's bytes of slack);
manifests are reported beside them.

The figures go between the load/soak markers of ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from faults.harness import KEY, Env, exact, raise_nofile  # noqa: E402
from faults.run import write_between_markers  # noqa: E402

BEGIN, END = "<!-- load-soak:begin -->", "<!-- load-soak:end -->"


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# -- load: a worker process with many subscribers -------------------------------------------------------------

async def _worker(url: str, model: str, n: int, last: int, out: Path, ready: Path, deadline_s: float) -> None:
    import torch

    from deltasync.client.subscriber import Subscriber
    from deltasync.manifest import parse_manifest
    from deltasync.client.http import HttpClient
    from deltasync.dtypes import dtype_info

    async with HttpClient([url]) as h:
        head = await h.get_head(model)
    m = parse_manifest(head.body, verifier=KEY)
    seen: list[dict[int, float]] = [dict() for _ in range(n)]
    subs = []
    for i in range(n):
        target = {t.name: torch.zeros(t.shape, dtype=dtype_info(t.dtype).torch_dtype) for t in m.tensors}
        s = Subscriber([url], model, target, verifier=KEY, download_concurrency=1)
        subs.append(s)
        await s.start()
    ready.write_text("ok")
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for i, s in enumerate(subs):
            v = s.apply_pending()
            if v is not None and v not in seen[i]:
                seen[i][v] = time.time()
        if all(s.version is not None and s.version >= last for s in subs):
            break
        await asyncio.sleep(0.05)
    states = {}
    for i, s in enumerate(subs):
        states[i] = s.version
    # bit-exact check of each subscriber against the first one that holds the same version (the
    # main process checks one state per version against the publisher's)
    from deltasync.tensorfile import write_state_file
    by_version: dict[int, int] = {}
    wrong = 0
    for i, s in enumerate(subs):
        if s.version is None:
            continue
        j = by_version.setdefault(s.version, i)
        if j != i and not exact(subs[i].target, subs[j].target):
            wrong += 1
    for v, i in by_version.items():
        write_state_file(out.with_suffix(f".v{v}.safetensors"), subs[i].target, {})
    for s in subs:
        await s.close()
    out.write_text(json.dumps({"seen": [{str(k): t for k, t in d.items()} for d in seen],
                               "versions": [states[i] for i in range(n)], "wrong": wrong}))


def run_load(env: Env, subs: int, workers: int, versions: int) -> dict:
    raise_nofile(65536)
    o = env.origin()
    r = env.relay("relay", [o.url], extra=["--max-wait", "60"])
    trace = env.trace(seed=77)
    states = {0: trace.step()}
    pub = env.publisher(o.url, "load")
    env.publish(pub, 0, states[0])
    per = [subs // workers + (1 if k < subs % workers else 0) for k in range(workers)]
    procs, outs, readies = [], [], []
    last = versions
    for k, n in enumerate(per):
        out, ready = env.root / f"load-w{k}.json", env.root / f"load-w{k}.ready"
        code = (f"import asyncio, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r}); "
                f"from faults.load import _worker; from pathlib import Path; "
                f"asyncio.run(_worker({r.url!r}, 'load', {n}, {last}, Path({str(out)!r}), Path({str(ready)!r}), 900))")
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=open(env.root / f"load-w{k}.log", "wb"),
                                      stderr=subprocess.STDOUT))
        outs.append(out)
        readies.append(ready)
    peak = [rss_mb(r.pid)]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak.append(rss_mb(r.pid))
            time.sleep(0.5)
    threading.Thread(target=sample, daemon=True).start()
    t_ready = time.monotonic()
    while not all(p.exists() for p in readies):
        if any(p.poll() is not None for p in procs) or time.monotonic() - t_ready > 600:
            raise RuntimeError("load workers did not start: " + "; ".join(
                (env.root / f"load-w{k}.log").read_text()[-800:] for k in range(workers)))
        time.sleep(0.2)
    rss_idle = rss_mb(r.pid)
    acked = {}
    for v in range(1, versions + 1):
        time.sleep(1.0)
        states[v] = trace.step()
        env.publish(pub, v, states[v])
        acked[v] = time.time()
    pub.close(60)
    for p in procs:
        p.wait(900)
    stop.set()
    lat, starved, wrong = [], 0, 0
    for out in outs:
        d = json.loads(out.read_text())
        wrong += d["wrong"]
        for seen, final in zip(d["seen"], d["versions"]):
            if final is None or final < last:
                starved += 1
            held = sorted((int(k), t) for k, t in seen.items())
            for v, t_ack in acked.items():
                first = next((t for k, t in held if k >= v), None)
                if first is not None:
                    lat.append(max(0.0, first - t_ack))
        for f in out.parent.glob(out.stem + ".v*.safetensors"):
            from deltasync.tensorfile import read_state_file
            v = int(f.suffixes[-2][2:])
            if not exact(read_state_file(f), states[v]):
                wrong += 1
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")  # noqa: E731
    env.close()
    return {"subs": subs, "workers": workers, "versions": versions, "rss_idle_mb": rss_idle, "rss_peak_mb": max(peak),
            "p50_s": q(0.5), "p99_s": q(0.99), "max_s": lat[-1] if lat else float("nan"), "starved": starved,
            "wrong": wrong, "samples": len(lat)}


# -- soak -----------------------------------------------------------------------------------------------------

def run_soak(env: Env, versions: int, join_every: int, cache_size: str) -> dict:
    import torch

    from deltasync.client.subscriber import ThreadedSubscriber

    o = env.origin()
    a = env.relay("tier1", [o.url], extra=["--cache-size", cache_size])
    b = env.relay("tier2", [a.url, o.url], extra=["--cache-size", cache_size])
    trace = env.trace(seed=88)
    pub = env.publisher(o.url, "soak", keyframe_every=50)
    live: list[tuple[ThreadedSubscriber, dict]] = []
    states: dict[int, dict] = {}
    verified = wrong = joined = 0
    max_version_bytes = 0
    t0 = time.monotonic()

    def check(sub, target) -> None:
        nonlocal verified, wrong
        v = sub.version
        sub.apply_pending()
        v = sub.version
        if v is None:
            return
        verified += 1
        if not exact(target, states[v]):
            wrong += 1

    for v in range(versions):
        states[v] = trace.step()
        res = env.publish(pub, v, states[v])
        if res is not None:
            max_version_bytes = max(max_version_bytes, res.blob_bytes)
        # every state is kept (40 KB each): a subscriber may hold a version far behind (found: 173 behind)
        if v % join_every == join_every - 1:
            target = {n: torch.zeros_like(t) for n, t in states[v].items()}
            s = ThreadedSubscriber([(b if joined % 2 else a).url, o.url], "soak", target, verifier=KEY, auto=True)
            s.start()
            live.append((s, target))
            joined += 1
            if len(live) > 4:
                s_old, t_old = live.pop(0)
                with s_old.hold():
                    check(s_old, t_old)
                s_old.close()
    pub.close(120)
    last = versions - 1
    for s, t in live:
        s.wait_version(last, 120)
        with s.hold():
            check(s, t)
        if s.version != last:
            wrong += 1
        s.close()
    took = time.monotonic() - t0
    disk = {"origin": du(env.root / "origin"), "tier1": du(env.root / "tier1"), "tier2": du(env.root / "tier2"),
            "tier1_blobs": du(env.root / "tier1" / "blobs"), "tier2_blobs": du(env.root / "tier2" / "blobs")}
    env.close()
    from deltasync.server.cli import parse_size
    budget = parse_size(cache_size) + max_version_bytes
    return {"versions": versions, "joined": joined, "verified": verified, "wrong": wrong, "seconds": took,
            "disk": disk, "budget": budget, "within_budget": disk["tier1_blobs"] <= budget and disk["tier2_blobs"] <= budget}


def report(load: dict | None, soak: dict | None) -> str:
    lines = [f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores (shared with "
             f"other jobs: figures are upper bounds; rerun `make soak` on a quiet machine)."]
    if load:
        lines += ["", f"**Load**: one relay, {load['subs']} asyncio subscribers in {load['workers']} processes, "
                  f"{load['versions']} versions 1 s apart.", "",
                  "| relay RSS idle MB | relay RSS peak MB | p50 s | p99 s | max s | starved | wrong | samples |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {load['rss_idle_mb']:.0f} | {load['rss_peak_mb']:.0f} | {load['p50_s']:.2f} | {load['p99_s']:.2f} | "
                  f"{load['max_s']:.2f} | {load['starved']} | {load['wrong']} | {load['samples']} |"]
    if soak:
        d = soak["disk"]
        lines += ["", f"**Soak**: {soak['versions']} versions through origin → relay → relay in {soak['seconds']:.0f} s; "
                  f"{soak['joined']} subscribers joined and left, {soak['verified']} bit-exact checks, "
                  f"{soak['wrong']} wrong. Disk at the end: origin {d['origin'] / 1e6:.1f} MB, relays "
                  f"{d['tier1'] / 1e6:.1f} / {d['tier2'] / 1e6:.1f} MB, of which blobs {d['tier1_blobs'] / 1e6:.1f} / "
                  f"{d['tier2_blobs'] / 1e6:.1f} MB (blob budget {soak['budget'] / 1e6:.1f} MB each: "
                  f"{'within' if soak['within_budget'] else 'OVER'})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subs", type=int, default=500)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--load-versions", type=int, default=10)
    ap.add_argument("--versions", type=int, default=1000)
    ap.add_argument("--join-every", type=int, default=50)
    ap.add_argument("--cache-size", default="4M")
    ap.add_argument("--only", choices=["load", "soak"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="deltasync-load-"))
    load = soak = None
    if args.only in (None, "load"):
        load = run_load(Env(root / "load"), args.subs, args.workers, args.load_versions)
        print("load:", json.dumps(load), flush=True)
    if args.only in (None, "soak"):
        soak = run_soak(Env(root / "soak"), args.versions, args.join_every, args.cache_size)
        print("soak:", json.dumps(soak), flush=True)
    text = report(load, soak)
    print(text)
    if args.out:
        write_between_markers(args.out, text, BEGIN, END)
    ok = (load is None or (load["starved"] == 0 and load["wrong"] == 0)) and \
         (soak is None or (soak["wrong"] == 0 and soak["within_budget"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
