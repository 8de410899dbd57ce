"""GPU check (``make gpu-check``, under 8 minutes): the ``gpu`` tests, the Triton kernels' self-check,
and a benchmark of diff, patch and fingerprint on the device as GB/s and as a fraction of the
device's ``copy_`` bandwidth measured in the same run.

Exits with status 2 and a clear message where no CUDA device (or no triton) is present.
"""

from __future__ import annotations

import subprocess
import sys
import time


def _timed(fn, sync, n: int = 5) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def bench(gib: float = 2.0) -> str:
    import torch

    from deltasync.codec import diff_chunk
    from deltasync.dtypes import word_view
    from deltasync.fingerprint import tensor_fingerprint
    from deltasync.kernels import gpu

    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    n = int(gib * (1 << 30)) // 2
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
    rows = [f"device: {torch.cuda.get_device_name(dev)}; state {gib:.1f} GiB bf16", "",
            "| loop | unchanged | GB/s | of `copy_` |", "|---|---|---|---|"]
    dst = torch.empty_like(a)
    t_copy = _timed(lambda: dst.copy_(a), sync)
    copy_bw = 2 * a.numel() * 2 / t_copy / 1e9  # read + write
    rows.append(f"| `copy_` (read + write) | - | {copy_bw:.0f} | 1.00 |")
    nbytes = a.numel() * 2
    for unchanged in (0.99, 0.95):
        b = a.clone()
        wb = word_view(b)
        sel = torch.rand(n, device=dev, generator=g) > unchanged
        wb[sel] += 1
        wa = word_view(a)
        t = _timed(lambda: gpu.changed_positions(wa, wb), sync)
        rows.append(f"| compare + compaction (Triton) | {unchanged:.0%} | {2 * nbytes / t / 1e9:.0f} | "
                    f"{2 * nbytes / t / 1e9 / copy_bw:.2f} |")
        t = _timed(lambda: torch.nonzero(wa != wb), sync)
        rows.append(f"| compare + compaction (torch) | {unchanged:.0%} | {2 * nbytes / t / 1e9:.0f} | "
                    f"{2 * nbytes / t / 1e9 / copy_bw:.2f} |")
        t = _timed(lambda: diff_chunk(wa, wb, 0, wa.numel(), 2), sync)
        rows.append(f"| diff_chunk (to host) | {unchanged:.0%} | {2 * nbytes / t / 1e9:.0f} | "
                    f"{2 * nbytes / t / 1e9 / copy_bw:.2f} |")
        pos = gpu.changed_positions(wa, wb)
        vals = wb.index_select(0, pos) - wa.index_select(0, pos)
        raw = torch.zeros(pos.numel(), dtype=torch.bool, device=dev)
        live = wa.clone()
        t = _timed(lambda: gpu.patch_words(live, pos, raw, vals), sync)  # re-applies steps: speed only
        moved = pos.numel() * (8 + 2 + 1 + 2 * 2 + 2)
        rows.append(f"| patch (Triton), {pos.numel():,} changes | {unchanged:.0%} | {moved / t / 1e9:.0f} "
                    f"(bytes moved) | {moved / t / 1e9 / copy_bw:.2f} |")
    t = _timed(lambda: tensor_fingerprint(a), sync)
    rows.append(f"| fingerprint (Triton lane sums) | - | {nbytes / t / 1e9:.0f} | {nbytes / t / 1e9 / copy_bw:.2f} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    try:
        import torch
    except ImportError:
        print("gpu-check: torch does not import", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); run `make gpu-check` on a "
              "machine with an NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gpu-check: triton does not import; pip install triton (it ships with CUDA builds of torch)",
              file=sys.stderr)
        return 2
    from deltasync.kernels import gpu

    t0 = time.perf_counter()
    gpu.self_check("cuda")
    print(f"Triton self-check passed ({time.perf_counter() - t0:.1f} s)")
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/"])
    print(bench())
    return rc


if __name__ == "__main__":
    sys.exit(main())
