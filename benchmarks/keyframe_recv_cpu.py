"""CPU seconds one ``subscribe --out F`` spends receiving a keyframe, this build against another, side by side.

One origin (``deltasync.cli.cluster``, ``--no-fsync``, store on tmpfs) and a 512 MiB bf16 state (bench_shardcast's
``make_state``). Each round publishes the state under a new model name to two ``subscribe --out F --until 0``
processes started before it and idle (imports done, long-polling): one run by this interpreter, one by
``--before PYTHON`` (another checkout's venv, or a wrapper that points at one). Both receive the same keyframe
at the same time from the same origin, so the load is the same for both; each one's user and system CPU from
idle to exit comes from ``wait4``. Prints every round and the median of each side.

    python benchmarks/keyframe_recv_cpu.py --before PYTHON [--size-mib 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shardcast import _idle, make_state  # noqa: E402
from keyframe_timeline import _Timed  # noqa: E402
from step_timeline import work_folder  # noqa: E402
from relay_procs import cpu_seconds  # noqa: E402

from deltasync.cli.cluster import LocalCluster  # noqa: E402

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, metavar="PYTHON")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    with work_folder("deltasync-kf-recv-cpu-") as work:
        state = work / "state.safetensors"
        make_state(state, a.size_mib * MiB)
        cluster = LocalCluster(work / "servers", key=os.urandom(32))
        got: dict[str, list[tuple[float, float]]] = {"after": [], "before": []}
        try:
            cluster.start_origin()
            for r in range(a.runs):
                model = f"kf{r}"
                subs = {}
                for side, py in (("after", sys.executable), ("before", a.before)):
                    out = work / f"{side}.safetensors"
                    out.unlink(missing_ok=True)
                    subs[side] = _Timed([py, "-m", "deltasync.cli.main", "subscribe", "--from", cluster.origin,
                                         "--model", model, "--key-file", str(cluster.key_file), "--out", str(out),
                                         "--until", "0", "--timeout", "600", "--quiet"], work / f"{side}-{r}.log")
                _idle(list(subs.values()))
                cpu0 = {side: cpu_seconds(s.proc.pid, split=True) for side, s in subs.items()}
                pub = _Timed([sys.executable, "-m", "deltasync.cli.main", "publish", "--origin", cluster.origin,
                              "--token-file", str(cluster.token_file), "--model", model, "--key-file",
                              str(cluster.key_file), "--quiet", str(state)], work / f"publish-{r}.log")
                pub.wait(600)
                for s in subs.values():
                    s.wait(600)
                line = [f"round {r} (load {os.getloadavg()[0]:.1f}):"]
                for side, s in subs.items():
                    u, k = s.cpu[0] - cpu0[side][0], s.cpu[1] - cpu0[side][1]
                    got[side].append((u, k))
                    line.append(f"{side} {u + k:.3f} (user {u:.3f}, sys {k:.3f})")
                print(" ".join(line), flush=True)
        finally:
            cluster.close()
        med = {side: statistics.median(u + k for u, k in v) for side, v in got.items()}
        print(f"{a.size_mib} MiB keyframe, CPU-s per subscriber, median of {a.runs}: after {med['after']:.3f}, "
              f"before {med['before']:.3f}, after/before {med['after'] / med['before']:.2f}")


if __name__ == "__main__":
    main()
