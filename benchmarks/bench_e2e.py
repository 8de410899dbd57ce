"""End-to-end benchmark: publish() to the last subscriber verified, and the trainer's blocking time.

Real servers (an origin and two relays in a chain of tiers: origin -> regional ->
cluster) on loopback, subscribers in auto mode (each version is applied and verified
as soon as it is ready), all on this one machine. Two workloads:

* the demo model (``deltasync.cli.demo``: a small GPT fine-tuned with AdamW on CPU),
  published every step, 4 subscribers;
* a ~100M-parameter transformer-shaped RL trace (``deltasync.testing.trace``: fp32
  master weights, Adam, bf16 served weights, lr giving ~99% unchanged elements per
  step), 2 subscribers.

Per step: *latency* = time from the publish() call until every subscriber has applied
and verified that version or a newer one; *blocking* = time publish() held the trainer;
*fraction* = blocking / (the trainer's own step time + blocking).

``run(quick)`` returns a Markdown section; ``python benchmarks/bench_e2e.py [--quick]``
prints it.
"""

from __future__ import annotations

import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.testing.trace import RLTrace, lr_for_unchanged, shape_for_params

KEY = bytes(range(32))
TREE = {"regional": ["origin"], "cluster": ["regional"]}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def _measure(name: str, steps: Iterator[tuple[dict[str, torch.Tensor], float]], like: dict[str, torch.Tensor], *,
             subscribers: int, keyframe_every: int, timeout: float) -> dict:
    """Publish each state from ``steps`` ((state, trainer step seconds)); returns the measurements."""
    applied: dict[int, dict[int, float]] = {}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-") as root:
        cluster = LocalCluster(root, key=KEY)
        subs: list[ThreadedSubscriber] = []
        try:
            cluster.start_tree(TREE)
            for i in range(subscribers):
                target = {n: torch.zeros_like(t) for n, t in like.items()}
                urls = [cluster.url("cluster"), cluster.url("regional"), cluster.origin]

                def on_applied(v: int, i=i) -> None:
                    with lock:
                        applied.setdefault(v, {})[i] = time.perf_counter()

                s = ThreadedSubscriber(urls, name, target, verifier=KEY, auto=True, on_applied=on_applied)
                s.start()
                subs.append(s)
            pub = Publisher(cluster.origin, name, cluster.token, KEY, keyframe_every=keyframe_every)
            published: dict[int, float] = {}
            rows = []
            try:
                for step, (state, train_s) in enumerate(steps):
                    t0 = time.perf_counter()
                    pending = pub.publish(step, state)
                    published[step] = t0
                    rows.append((step, pending, train_s))
                pub.flush(timeout)
            finally:
                pub.close(timeout)
            last = len(rows) - 1
            for s in subs:
                s.wait_version(last, timeout)
        finally:
            for s in subs:
                s.close()
            cluster.close()
    out = {"latency": [], "blocking": [], "fraction": [], "bytes": [], "raw": 0, "keyframe_latency": None}
    # When did subscriber i first run version v or newer? (A subscriber that fell behind catches up
    # with a squashed delta and skips versions; v has reached it once anything at or past v is applied.)
    per_sub: dict[int, list[tuple[int, float]]] = {}
    for v, by_sub in applied.items():
        for i, t in by_sub.items():
            per_sub.setdefault(i, []).append((v, t))

    def reached(v: int) -> float | None:
        times = []
        for i in range(subscribers):
            later = [t for (w, t) in per_sub.get(i, ()) if w >= v]
            if not later:
                return None
            times.append(min(later))
        return max(times)

    for step, pending, train_s in rows:
        res = pending.result(0)
        out["raw"] = res.raw_bytes
        t_reach = reached(step)
        lat = t_reach - published[step] if t_reach is not None else None
        if res.kind == "keyframe":
            out["keyframe_latency"] = lat
            continue
        if lat is not None:
            out["latency"].append(lat)
        out["blocking"].append(pending.blocking_s)
        out["fraction"].append(pending.blocking_s / (train_s + pending.blocking_s))
        out["bytes"].append(res.blob_bytes)
    return out


def _demo_steps(n: int) -> tuple[Iterator, dict[str, torch.Tensor], int]:
    from deltasync.cli import demo

    text = demo.make_corpus()
    chars = demo.Chars(text)
    data = torch.tensor(chars.encode(text))
    cfg = demo.LMConfig(vocab=len(chars.chars))
    model = demo.TinyLM(cfg)
    opt = demo.pretrain(model, data, 60, lr=3e-3, seed=0)
    for g in opt.param_groups:
        g["lr"] = 3e-5
    serving = {k: p.detach().to(torch.bfloat16) for k, p in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)

    def it():
        for _ in range(n):
            t0 = time.perf_counter()
            demo.train_step(model, opt, data, gen)
            with torch.no_grad():
                for k, p in model.state_dict().items():
                    serving[k].copy_(p)
            yield serving, time.perf_counter() - t0

    return it(), serving, sum(p.numel() for p in model.parameters())


def _trace_steps(n: int, params: int) -> tuple[Iterator, dict[str, torch.Tensor], int, float]:
    shape = shape_for_params(params)
    lr = lr_for_unchanged(0.99, shape)
    trace = RLTrace(shape, lr=lr, seed=0)
    for _ in range(3):  # past Adam's first steps, whose updates are all large
        trace.step()
    like = trace.state()

    def it():
        for _ in range(n):
            t0 = time.perf_counter()
            state = trace.step()
            yield state, time.perf_counter() - t0

    return it(), like, shape.params, lr


def _row(label: str, params: int, r: dict, subscribers: int) -> str:
    lat = [x * 1e3 for x in r["latency"]]
    blk = [x * 1e3 for x in r["blocking"]]
    frac = r["fraction"]
    b = statistics.median(r["bytes"]) if r["bytes"] else float("nan")
    kf = f"{r['keyframe_latency'] * 1e3:,.0f}" if r["keyframe_latency"] is not None else "-"
    return (f"| {label} | {params / 1e6:,.1f}M | {subscribers} | {len(r['bytes'])} | "
            f"{statistics.median(lat):,.0f} / {_pct(lat, 0.9):,.0f} / {max(lat):,.0f} | {kf} | "
            f"{statistics.median(blk):,.1f} | {100 * statistics.median(frac):.1f}% | "
            f"{b / 1e3:,.1f} KB ({100 * b / r['raw']:.2f}%) |")


def run(quick: bool = False) -> str:
    torch.set_num_threads(2)
    demo_steps = 10 if quick else 30
    trace_steps = 3 if quick else 8
    demo_it, demo_like, demo_params = _demo_steps(demo_steps)
    demo = _measure("bench-demo", demo_it, demo_like, subscribers=4, keyframe_every=20, timeout=300)
    trace_it, trace_like, trace_params, lr = _trace_steps(trace_steps, 100_000_000)
    trace = _measure("bench-trace", trace_it, trace_like, subscribers=2, keyframe_every=0, timeout=600)
    lines = [
        "## End to end: publish() to the last subscriber verified",
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, {_cpus()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}. Origin -> regional relay -> cluster relay -> "
        "subscribers (auto mode: each version applied and verified as soon as it is ready), all processes on this "
        "machine over loopback, manifests signed. Latency: from the publish() call until every subscriber runs that "
        "version or a newer one (verified; a subscriber that falls behind catches up with a squashed delta and "
        "skips versions). Blocking: time publish() held the trainer; fraction: of the trainer's step (its own compute + "
        "publish). Delta size: median, % of the bf16 state. First-version keyframe latency shown apart."
        + (" Quick mode (fewer steps)." if quick else ""),
        "",
        "| workload | params | subscribers | deltas | latency ms median / p90 / max | keyframe ms | "
        "publish() blocking ms (median) | blocking / step | delta size |",
        "|---|---|---|---|---|---|---|---|---|",
        _row("demo GPT, AdamW lr 3e-5", demo_params, demo, 4),
        _row(f"RL trace, Adam lr {lr:.1e} (~99% unchanged)", trace_params, trace, 2),
        "",
    ]
    return "\n".join(lines)


def _cpus() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
