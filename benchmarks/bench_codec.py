"""Codec benchmark: bytes and speed on generated RL traces, against baselines in the same run.

Per target sparsity (99%, 95%, 80% of bf16 elements unchanged) on a ~100M-parameter
trace: raw bf16 size, zstd-1 of the full state, dense XOR + byte planes + zstd-1, a
PULSE-style codec (delta-coded uint32 indices + raw new values + zstd-1), and ours
(the whole delta file: manifest + blobs). Speeds are single-threaded, best of 3,
reported also as a fraction of a ``copy_`` of the same bytes measured here.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zstandard

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
        t_enc, enc = best(lambda: encode_delta(a, b, model="bench", version=2, parent=1, base_fps=fps))
        ours = len(pack_delta_file(enc.manifest, enc.blobs))
        xor = dense_xor(a, b, cctx)
        pulse = pulse_style(a, b, cctx)
        full = zstd_full(b, cctx)
        rows.append((target, unch, raw, full, xor, pulse, ours))

        live = {k: v.clone() for k, v in a.items()}
        backup = {k: v.clone() for k, v in a.items()}

        def dec_apply(executor=None):
            for k, v in live.items():
                v.copy_(backup[k])
            t0 = time.perf_counter()
            prep = prepare_delta(enc.manifest, enc.blobs, executor=executor)
            t1 = time.perf_counter()
            apply_prepared(live, prep, fps, executor=executor)
            t2 = time.perf_counter()
            assert all(torch.equal(live[k].view(torch.int16), b[k].view(torch.int16)) for k in b)
            return t2 - t0, t2 - t1

        t_da, t_ap = min(dec_apply() for _ in range(3))
        with ThreadPoolExecutor(max_workers=2) as pool:
            t_da2 = min(dec_apply(pool)[0] for _ in range(3))
        dst = {k: torch.empty_like(v) for k, v in b.items()}
        t_copy, _ = best(lambda: [dst[k].copy_(v) for k, v in b.items()])
        speed.append((target, raw / t_enc / 1e9, raw / t_da / 1e9, raw / t_copy / 1e9, raw / t_ap / 1e9,
                      raw / t_da2 / 1e9))

        # Incremental verification: cost per changed element, at each density.
        big = max(b, key=lambda k: b[k].numel())
        ow, nw = word_view(a[big]), word_view(b[big])
        pos = torch.nonzero(ow != nw).squeeze(1)
        o, n = ow[pos], nw[pos]
        t_inc, _ = best(lambda: fingerprint_delta(pos, o, n, 2))
        fp_rows.append((target, pos.numel(), t_inc / max(pos.numel(), 1) * 1e9, t_inc * 1e3))

    t_fp, _ = best(lambda: [tensor_fingerprint(t) for t in b.values()])
    fp_rate = raw / t_fp / 1e9

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
            "Speed, one thread, GB/s of bf16 state (best of 3):", "",
            "| unchanged | encode | decode + apply in place + verify | of which apply + verify (the engine's pause) | "
            "decode + apply + verify, 2 threads | `copy_` of same bytes | encode / copy_ | decode+apply / copy_ |",
            "|---|---|---|---|---|---|---|---|"]
    for target, enc_r, da_r, copy_r, ap_r, da2_r in speed:
        out.append(f"| {target:.0%} | **{enc_r:.2f}** | **{da_r:.2f}** | {ap_r:.2f} | {da2_r:.2f} | {copy_r:.1f} | "
                   f"{enc_r / copy_r:.3f} | {da_r / copy_r:.3f} |")
    out += ["", "Targets: encode ≥1 GB/s per core, decode + apply + verify ≥2 GB/s. Decoding runs off the inference "
            "path (in the background, while the engine serves); apply + verify is the pause between batches. The 2-thread "
            "column passes a 2-worker pool to `prepare_delta`/`apply_prepared` (chunks and tensors in parallel).", "",
            "What bounds the denser cases: every changed word costs about a dozen vectorized numpy/torch passes "
            "(gather, step, token, position and fingerprint-key arithmetic) at ~1 ns each, so time grows with the change "
            "count; the compare pass alone runs at ~3 GB/s. A fused kernel (C++ or a GPU) would remove the passes.", "",
            f"Fingerprint, full recompute on CPU, one thread: **{fp_rate:.2f} GB/s** (target ≥2 GB/s).", "",
            "Incremental verification (largest tensor, `fingerprint_delta` over its changed elements):", "",
            "| unchanged | changed elements | ns per changed element | total ms |", "|---|---|---|---|"]
    for target, count, ns, ms in fp_rows:
        out.append(f"| {target:.0%} | {count:,} | {ns:.1f} | {ms:.2f} |")
    out.append("\nThe cost per changed element stays flat as the count grows: verification is O(changed).")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys
    print(run(quick="--quick" in sys.argv))
