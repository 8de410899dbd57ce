"""Codec speed of two (or more) source trees side by side: bench_codec's encode and decode + apply + verify rows
(compiled kernels, 1 and 2 threads) and a ``copy_`` of the same bytes, one worker process per tree, rounds
interleaved so every tree sees the same load: metric by metric, the trees alternating run by run; best of the
rounds. By hand, not in ``make bench``:

    .venv/bin/python benchmarks/codec_before_after.py TREE_A TREE_B [--rounds 5] [--params 100000000]

A tree is a folder holding ``deltasync/`` (a worktree, or ``git archive REV | tar -x -C DIR``). The bench pairs
(bench_codec's trace, seed 7, 99% and 95% unchanged) are made once, saved in a temporary folder and loaded by
each worker, so every tree codes the same bytes; each worker checks that it applies them back exactly and
reports the size of its delta (the bytes must be the same in every tree).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS = (0.99, 0.95)


def make_pairs(folder: Path, params: int) -> list[Path]:
    import torch

    from deltasync.testing.trace import RLTrace, lr_for_unchanged, shape_for_params

    torch.set_num_threads(1)
    shape = shape_for_params(params)
    out = []
    for target in TARGETS:
        tr = RLTrace(shape, lr=lr_for_unchanged(target, shape), seed=7)
        tr.step()
        a = tr.step()
        b = tr.step()
        p = folder / f"pair{int(target * 100)}.pt"
        torch.save({"a": a, "b": b}, p)
        out.append(p)
    return out


WORKER = r"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
torch.set_num_threads(1)
from deltasync import kernels
from deltasync.apply import apply_prepared, prepare_delta
from deltasync.codec import encode_delta
from deltasync.fingerprint import fingerprint_state
kernels.select("numba")
pairs = []
for path in sys.argv[1:]:
    d = torch.load(path)
    a, b = d["a"], d["b"]
    fps = fingerprint_state(a)
    raw = sum(t.numel() * 2 for t in b.values())
    enc = encode_delta(a, b, model="bench", version=2, parent=1, base_fps=fps)
    size = sum(len(x) for x in enc.blobs.values())
    live = {k: v.clone() for k, v in a.items()}
    dst = {k: torch.empty_like(v) for k, v in b.items()}
    pairs.append((a, b, fps, raw, enc, size, live, dst))
pool = ThreadPoolExecutor(max_workers=2)

def measure(cmd):
    # GB/s of wall time, and GB per CPU-second of this process (time.process_time: the work whatever else the
    # machine runs; with 2 threads their sum)
    what, i, threads = cmd.split()
    a, b, fps, raw, enc, size, live, dst = pairs[int(i)]
    ex = pool if threads == "2" else None
    if what == "copy":
        c0, t0 = time.process_time(), time.perf_counter()
        for k, v in b.items():
            dst[k].copy_(v)
        return {"copy": raw / (time.perf_counter() - t0) / 1e9, "copy_cpu": raw / (time.process_time() - c0) / 1e9}
    if what == "enc":
        c0, t0 = time.process_time(), time.perf_counter()
        encode_delta(a, b, model="bench", version=2, parent=1, base_fps=fps, executor=ex)
        return {"enc": raw / (time.perf_counter() - t0) / 1e9, "enc_cpu": raw / (time.process_time() - c0) / 1e9}
    for k, v in live.items():
        v.copy_(a[k])
    c0, t0 = time.process_time(), time.perf_counter()
    prep = prepare_delta(enc.manifest, enc.blobs, executor=ex)
    c1, t1 = time.process_time(), time.perf_counter()
    apply_prepared(live, prep, fps, executor=ex)
    c2, t2 = time.process_time(), time.perf_counter()
    assert all(torch.equal(live[k].view(torch.int16), b[k].view(torch.int16)) for k in b)
    return {"dec": raw / (t2 - t0) / 1e9, "app": raw / (t2 - t1) / 1e9, "dec_cpu": raw / (c2 - c0) / 1e9,
            "app_cpu": raw / (c2 - c1) / 1e9}

for i in range(len(pairs)):  # load the kernels, fault the pages in
    for c in ("copy", "enc", "dec"):
        measure(f"{c} {i} 1")
print(json.dumps({"sizes": [p[5] for p in pairs]}), flush=True)
for line in sys.stdin:
    print(json.dumps(measure(line.strip())), flush=True)
"""


def main() -> None:
    args = sys.argv[1:]
    rounds, params = 5, 100_000_000
    if "--rounds" in args:
        i = args.index("--rounds")
        rounds = int(args[i + 1])
        del args[i : i + 2]
    if "--params" in args:
        i = args.index("--params")
        params = int(args[i + 1])
        del args[i : i + 2]
    trees = [Path(t).resolve() for t in args]
    with tempfile.TemporaryDirectory(prefix="ds-ab-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        t0 = time.perf_counter()
        pairs = make_pairs(Path(tmp), params)
        print(f"pairs made in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        procs = []
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
            code = f"import sys; sys.path.insert(0, {str(tree)!r}); import deltasync; " \
                   f"assert deltasync.__file__.startswith({str(tree)!r}), deltasync.__file__; exec({WORKER!r})"
            procs.append(subprocess.Popen([sys.executable, "-c", code, *map(str, pairs)], cwd=tree, env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        sizes = [json.loads(p.stdout.readline())["sizes"] for p in procs]
        best: list[dict[str, float]] = [{} for _ in procs]
        # metric by metric, the trees alternating run by run: each pair of runs sees about the same load
        for cmd in [f"{c} {i} {t}" for i in range(len(TARGETS)) for c, t in (("copy", 1), ("enc", 1), ("enc", 2),
                                                                             ("dec", 1), ("dec", 2))]:
            c, i, t = cmd.split()
            for r in range(rounds):
                for p in (procs if r % 2 == 0 else procs[::-1]):
                    p.stdin.write(cmd + "\n")
                    p.stdin.flush()
                    res = json.loads(p.stdout.readline())
                    for k, v in res.items():
                        key = f"{i}:{k}" if k.startswith("copy") else f"{i}:{k}{t}"
                        best[procs.index(p)][key] = max(best[procs.index(p)].get(key, 0.0), v)
        for p in procs:
            p.stdin.close()
            p.wait()
    print(f"best of {rounds} runs per metric and tree, trees alternating, {params / 1e6:.0f}M parameters; GB/s of "
          "bf16 state per second of wall time, and [per CPU-second of the process: the work whatever else the "
          "machine runs; with 2 threads their sum]\n")
    print("| tree | unchanged | delta bytes | copy_ | encode 1t | encode 2t | dec+apply+verify 1t | 2t | "
          "apply+verify 1t | 2t |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tree, b, sz in zip(trees, best, sizes):
        for i, target in enumerate(TARGETS):
            def g(k):
                return f"{b[f'{i}:{k}']:.2f} [{b[f'{i}:' + k.rstrip('12') + '_cpu' + k[-1:] if k[-1] in '12' else f'{i}:{k}_cpu']:.2f}]"
            print(f"| {tree.name} | {target:.0%} | {sz[i]:,} | {g('copy')} | {g('enc1')} | {g('enc2')} | "
                  f"{g('dec1')} | {g('dec2')} | {g('app1')} | {g('app2')} |")


if __name__ == "__main__":
    main()
