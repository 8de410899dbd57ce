"""Codec benchmark: bytes and speed on generated RL traces, against baselines in the same run.

Per target sparsity (99%, 95%, 80% of bf16 elements unchanged) on a ~100M-parameter
trace: raw bf16 size, zstd-1 of the full state, dense XOR + byte planes + zstd-1, a
PULSE-style codec (delta-coded uint32 indices + raw new values + zstd-1), and ours
(the whole delta file: manifest + blobs). Speeds are single-threaded, best of 3,
reported also as a fraction of a ``copy_`` of the same bytes measured here, for the compiled
kernels and the reference side by side (1 and 2 threads); then ``deltasync diff`` on a 1 GiB pair (no torch:
the files' words over their maps), the compiled kernels on 1 and 2 threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard

from deltasync import kernels
from deltasync.apply import apply_prepared, prepare_delta
from deltasync.codec import encode_delta
from deltasync.deltafile import pack_delta_file
from deltasync.dtypes import word_view
from deltasync.fingerprint import fingerprint_delta, fingerprint_state, tensor_fingerprint
from deltasync.testing.trace import RLTrace, lr_for_unchanged, shape_for_params, unchanged_fraction

TARGETS = (0.99, 0.95, 0.80)


def best(fn, n=3):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def zstd_full(state, cctx) -> int:
    return sum(len(cctx.compress(t.view(torch.int16).numpy().tobytes())) for t in state.values())


def dense_xor(a, b, cctx) -> int:
    total = 0
    for k in a:
        x = (a[k].view(torch.int16) ^ b[k].view(torch.int16)).numpy().view(np.uint8).reshape(-1, 2).T.copy()
        total += len(cctx.compress(x.tobytes()))
    return total


def pulse_style(a, b, cctx) -> int:
    """COO patch as PULSE/grail ship it: delta-coded uint32 indices + raw new values, zstd-1."""
    total = 0
    for k in a:
        o = a[k].view(torch.int16).reshape(-1).numpy()
        n = b[k].view(torch.int16).reshape(-1).numpy()
        idx = np.flatnonzero(o != n).astype(np.uint32)
        if idx.size == 0:
            continue
        deltas = np.diff(idx, prepend=np.uint32(0)).astype(np.uint32)
        total += len(cctx.compress(deltas.tobytes())) + len(cctx.compress(n[idx].tobytes()))
    return total


def diff_cli_speed(size: int) -> list[tuple[int, str, int, float, float, float]]:
    """``deltasync diff`` on two bf16 safetensors files of ``size`` bytes (1% of words changed by one
    ULP), with each kernel selection, the compiled ones on 1 and 2 threads (``--threads``): (size,
    selection, threads, wall seconds, start-up seconds, spread of the start-up runs)."""
    from safetensors.torch import save_file

    n = size // 2
    g = torch.Generator().manual_seed(3)
    with tempfile.TemporaryDirectory(prefix="ds-diff-") as tmp:
        d = Path(tmp)
        old = torch.randn(n // 4096, 4096, generator=g).to(torch.bfloat16)
        save_file({"w": old}, str(d / "old.safetensors"))
        flat = old.view(-1).view(torch.int16)
        flat[torch.randint(0, n, (n // 100,), generator=g)] += 1
        save_file({"w": old}, str(d / "new.safetensors"))
        del old, flat
        # the start-up baseline: the same kind of pair (1% of the words one ULP apart) at 64 KiB, so the
        # command takes the same code path (the same kernels loaded) and only the work differs
        small = torch.randn(8, 4096, generator=g).to(torch.bfloat16)
        save_file({"w": small}, str(d / "a.safetensors"))
        sflat = small.view(-1).view(torch.int16)
        sflat[torch.randint(0, sflat.numel(), (sflat.numel() // 100,), generator=g)] += 1
        save_file({"w": small}, str(d / "b.safetensors"))
        rows = []
        for sel, threads in (("reference", 2), ("numba", 1), ("numba", 2)):
            env = dict(os.environ, DELTASYNC_KERNELS=sel)

            def wall(a: str, b: str) -> float:
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "deltasync.cli.main", "diff", str(d / a), str(d / b), "-o",
                                str(d / "out.dsd"), "--quiet", "--threads", str(threads)], check=True, env=env)
                return time.perf_counter() - t0

            wall("a.safetensors", "b.safetensors")  # warm the kernel cache and the page cache
            wall("old.safetensors", "new.safetensors")
            small_s, big_s = [], []
            for _ in range(3):  # interleaved, so both sides see the same load; best of each
                small_s.append(wall("a.safetensors", "b.safetensors"))
                big_s.append(wall("old.safetensors", "new.safetensors"))
            rows.append((size, sel, threads, min(big_s), min(small_s), max(small_s) - min(small_s)))
        return rows


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    params = 20_000_000 if quick else 100_000_000
    shape = shape_for_params(params)
    cctx = zstandard.ZstdCompressor(level=1)
    rows, speed, fp_rows = [], [], []
    for target in TARGETS:
        lr = lr_for_unchanged(target, shape)
        tr = RLTrace(shape, lr=lr, seed=7)
        tr.step()
        a = tr.step()
        b = tr.step()
        raw = sum(t.numel() * 2 for t in b.values())
        unch = unchanged_fraction(a, b)
        fps = fingerprint_state(a)
        enc = encode_delta(a, b, model="bench", version=2, parent=1, base_fps=fps)
        ours = len(pack_delta_file(enc.manifest, enc.blobs))
        xor = dense_xor(a, b, cctx)
        pulse = pulse_style(a, b, cctx)
        full = zstd_full(b, cctx)
        rows.append((target, unch, raw, full, xor, pulse, ours))

        dst = {k: torch.empty_like(v) for k, v in b.items()}
        t_copy, _ = best(lambda: [dst[k].copy_(v) for k, v in b.items()])
        live = {k: v.clone() for k, v in a.items()}

        def dec_apply(executor=None):
            for k, v in live.items():
                v.copy_(a[k])
            t0 = time.perf_counter()
            prep = prepare_delta(enc.manifest, enc.blobs, executor=executor)
            t1 = time.perf_counter()
            apply_prepared(live, prep, fps, executor=executor)
            t2 = time.perf_counter()
            assert all(torch.equal(live[k].view(torch.int16), b[k].view(torch.int16)) for k in b)
            return t2 - t0, t2 - t1

        # Kernel vs reference, 1 and 2 threads, in this run (ratios hold under load).
        for sel in ("reference", "numba"):
            kernels.select(sel)
            for threads in (1, 2):
                with ThreadPoolExecutor(max_workers=2) as pool:
                    ex = pool if threads == 2 else None
                    te, _ = best(lambda: encode_delta(a, b, model="bench", version=2, parent=1, base_fps=fps,
                                                      executor=ex))
                    tb, _ = best(lambda: encode_delta(a, b, model="bench", version=2, parent=1, executor=ex))
                    td, ta = min(dec_apply(ex) for _ in range(3))
                    tf, _ = best(lambda: [tensor_fingerprint(t, executor=ex) for t in b.values()])
                speed.append((target, sel, threads, raw / te / 1e9, raw / tb / 1e9, raw / td / 1e9, raw / ta / 1e9,
                              raw / tf / 1e9, raw / t_copy / 1e9))
        kernels.select("auto")

        # Incremental verification: cost per changed element, at each density.
        big = max(b, key=lambda k: b[k].numel())
        ow, nw = word_view(a[big]), word_view(b[big])
        pos = torch.nonzero(ow != nw).squeeze(1)
        o, n = ow[pos], nw[pos]
        t_inc, _ = best(lambda: fingerprint_delta(pos, o, n, 2))
        fp_rows.append((target, pos.numel(), t_inc / max(pos.numel(), 1) * 1e9, t_inc * 1e3))

    diff_rows = diff_cli_speed(256 << 20 if quick else 1 << 30)

    out = [f"## Codec (issue 2): {shape.params / 1e6:.0f}M-parameter bf16 trace "
           f"(hidden {shape.hidden}, {shape.layers} layers, vocab {shape.vocab}), Adam on fp32 masters\n",
           "Bytes per step; ratio = raw bf16 bytes / bytes. *ours* is the whole delta file (manifest + blobs), lossless.\n",
           "| unchanged (target / measured) | raw bf16 | zstd-1 full | dense XOR+zstd-1 | PULSE-style | ours | ratio ours | ratio XOR | ratio PULSE | ours vs XOR | ours vs PULSE |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for target, unch, raw, full, xor, pulse, ours in rows:
        out.append(f"| {target:.0%} / {unch:.2%} | {raw / 1e6:.1f} MB | {full / 1e6:.1f} MB | {xor / 1e6:.2f} MB | "
                   f"{pulse / 1e6:.2f} MB | {ours / 1e6:.3f} MB | **{raw / ours:.1f}x** | {raw / xor:.1f}x | "
                   f"{raw / pulse:.1f}x | **{xor / ours:.2f}x** | {pulse / ours:.2f}x |")
    out += ["", "Targets: ratio ≥120x at 99%, ≥30x at 95%, ≥10x at 80%; ≥1.6x better than dense XOR + zstd at each.", "",
            "Speed, GB/s of bf16 state (best of 3), compiled kernels (numba, `deltasync.kernels`) against the numpy/torch "
            "reference (`DELTASYNC_KERNELS=reference`), 1 and 2 threads, all measured side by side in this run:", "",
            "| unchanged | kernels | threads | encode | encode, base fingerprint computed (no `base_fps`) | "
            "decode + apply in place + verify | of which apply + verify "
            "(the engine's pause) | fingerprint (full) | `copy_` of same bytes | encode / copy_ | decode+apply / copy_ |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for target, sel, threads, enc_r, encb_r, da_r, ap_r, fp_r, copy_r in speed:
        b_ = "**" if sel == "numba" else ""
        out.append(f"| {target:.0%} | {sel} | {threads} | {b_}{enc_r:.2f}{b_} | {encb_r:.2f} | {b_}{da_r:.2f}{b_} | "
                   f"{ap_r:.2f} | {fp_r:.2f} | {copy_r:.1f} | {enc_r / copy_r:.3f} | {da_r / copy_r:.3f} |")
    out += ["", "Targets (issue 10, per core): encode ≥2 GB/s at 99% unchanged and ≥1 GB/s at 95%; decode + apply + "
            "verify ≥4 GB/s at 99%. Without `base_fps` the base fingerprint comes from the compare pass itself (the "
            "`deltasync diff` and publish-from-files case). Decoding runs off the inference path; apply + verify is the pause between batches. "
            "Two threads: a 2-worker pool passed to `encode_delta` (spans compared, chunks symbol-coded and rANS-coded "
            "in parallel; the bytes are the same), "
            "`prepare_delta`/`apply_prepared` (chunks and tensors) and `tensor_fingerprint` (lane ranges).", "",
            "`deltasync diff` (the CLI, one process per run, files on disk, GB/s of the new state net of the "
            "command's start-up, measured with a 64 KiB pair of the same kind in the same run, best of 3 interleaved; "
            "shown where the difference is over twice the spread of the start-up runs and over 5% of the start-up):", "",
            "| state | unchanged | kernels | threads | wall s | start-up s | GB/s net |", "|---|---|---|---|---|---|---|"]
    for size, sel, threads, wall, startup, spread in diff_rows:
        # the work must stand out of the start-up's own noise: twice the spread of its runs, and 5% of it
        net = f"**{size / (wall - startup) / 1e9:.2f}**" if wall - startup > max(2 * spread, 0.05 * startup) \
            else "n/a (start-up noise ≥ the run)"
        out.append(f"| {size / 2**30:.2f} GiB bf16 | 99% | {sel} | {threads} | {wall:.2f} | {startup:.2f} | {net} |")
    out += ["", "Target: ≥1.5 GB/s net on a 1 GiB pair.", "",
            "Incremental verification (largest tensor, `fingerprint_delta` over its changed elements):", "",
            "| unchanged | changed elements | ns per changed element | total ms |", "|---|---|---|---|"]
    for target, count, ns, ms in fp_rows:
        out.append(f"| {target:.0%} | {count:,} | {ns:.1f} | {ms:.2f} |")
    out.append("\nThe cost per changed element stays flat as the count grows: verification is O(changed).")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
