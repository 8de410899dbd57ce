"""The keyframe's upload, publisher and origin: a cold ``deltasync publish STATE`` into an origin, this build
against another, side by side (issue 10; the part of the full copy before any relay can start).

One 512 MiB bf16 state (bench_shardcast's ``make_state``) on tmpfs; two origins (``deltasync.cli.cluster``,
``--no-fsync``, stores on tmpfs, a key file as in bench_shardcast), one run by this interpreter, one by ``--before
PYTHON`` (another checkout's venv, or a wrapper that points at one). Each round publishes the state as v0 of a new
model into each origin in turn (after, before, after, ...; the order flips every round), with that build's
``publish`` command. Per publish: the wall time from the command's start to its exit, the time from its start
to the origin's commit (its ``deltasync.timeline`` stamp), the publisher's CPU (``wait4``) and the origin's CPU
over the publish (``/proc``). Prints each round and the medians of each side.

    python benchmarks/keyframe_upload_cpu.py --before PYTHON [--size-mib 512] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shardcast import make_state  # noqa: E402
from keyframe_timeline import _Timed  # noqa: E402
from relay_procs import cpu_seconds  # noqa: E402
from step_timeline import stamps, work_folder  # noqa: E402

from deltasync.cli.cluster import LocalCluster  # noqa: E402

MiB = 1 << 20


def _cluster(python: str, root: Path, key: bytes) -> LocalCluster:
    real = sys.executable
    sys.executable = python  # cluster.py builds its command from it
    try:
        c = LocalCluster(root, key=key)
        c.start_origin()
        return c
    finally:
        sys.executable = real


def _touch(state: Path, r: int) -> None:
    """New bytes at the start of every tensor: each round's shards are new blobs (an origin holding a blob
    answers its upload without reading it)."""
    import json
    import struct

    with open(state, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        for name, e in header.items():
            if name != "__metadata__":
                f.seek(8 + n + e["data_offsets"][0])
                f.write(struct.pack("<I", r + 1) + os.urandom(4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, metavar="PYTHON")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    env = {**os.environ, "DELTASYNC_TIMELINE": "1"}
    with work_folder("deltasync-kf-upload-") as work:
        state = work / "state.safetensors"
        make_state(state, a.size_mib * MiB)
        key = os.urandom(32)
        sides = {"after": sys.executable, "before": a.before}
        got: dict[str, list[tuple[float, float, float, float]]] = {s: [] for s in sides}
        for r in range(a.runs):
            order = ("after", "before") if r % 2 == 0 else ("before", "after")
            line = [f"round {r} (load {os.getloadavg()[0]:.1f}):"]
            _touch(state, r)
            for side in order:
                # a fresh origin and store each time: tmpfs pages freed by the last one are reused (on a VM,
                # pages never touched before cost about twice as much to write the first time)
                c = _cluster(sides[side], work / f"{side}{r}", key)
                try:
                    o = c.servers["origin"]
                    cpu0 = cpu_seconds(o.proc.pid)
                    t0 = time.monotonic()
                    p = _Timed([sides[side], "-m", "deltasync.cli.main", "publish", "--origin", c.origin,
                                "--token-file", str(c.token_file), "--model", "up", "--key-file",
                                str(c.key_file), "--quiet", str(state)], work / f"{side}-publish-{r}.log", env=env)
                    p.wait(600)
                    wall = p.ended_mono - t0
                    ocpu = cpu_seconds(o.proc.pid) - cpu0
                    marks = stamps(o.log_path, t0)
                    commit = next((t for t, what, _ in marks if what == "committed"), float("nan")) - t0
                    first = next((t for t, what, _ in marks if what == "upload-start"), float("nan")) - t0
                finally:
                    c.close()
                    shutil.rmtree(work / f"{side}{r}", ignore_errors=True)
                pcpu = sum(p.cpu)
                got[side].append((wall, commit, pcpu, ocpu))
                line.append(f"{side}: exit {wall:.2f} s (first upload {first:.2f}, commit {commit:.2f}), CPU "
                            f"publish {pcpu:.2f} (user {p.cpu[0]:.2f}) origin {ocpu:.2f};")
            print(" ".join(line), flush=True)
        med = {s: [statistics.median(x[i] for x in v) for i in range(4)] for s, v in got.items()}
        print(f"{a.size_mib} MiB keyframe, medians of {a.runs}: " + "; ".join(
            f"{s}: exit {m[0]:.2f} s, commit {m[1]:.2f} s, publish CPU {m[2]:.2f}, origin CPU {m[3]:.2f}"
            for s, m in med.items()) + "; after/before: exit {:.2f}, CPU (publish + origin) {:.2f}".format(
            med["after"][0] / med["before"][0], (med["after"][2] + med["after"][3]) / (med["before"][2] + med["before"][3])))


if __name__ == "__main__":
    main()
