"""The full copy's critical path, stamp by stamp: from the cold ``publish STATE`` command's start (a keyframe)
to the last of 4 already-running ``subscribe --out`` processes' exit.

Shardcast's scenario (benchmarks/bench_shardcast.py, its helpers): origin -> 2 relays -> 4 ``deltasync subscribe
--out F --until 0`` processes started on an empty origin and idle, 2 per relay, servers ``--no-fsync``, everything
on tmpfs. Every stamp is ``time.monotonic()`` from a ``deltasync.timeline`` log line: each blob's upload at the
origin (server/intake.py), the commit (server/routes.py), each relay's event, announce and per-blob fetch (answer,
stored: server/parents/fetcher.py), each subscriber's keyframe head, per-blob receive and commit (client/cli.py,
``DELTASYNC_TIMELINE=1``); the publish start and every process's exit are this script's own. Also the CPU seconds
each server spent. Times in ms after the publish command's start; ``--runs N`` repeats on fresh clusters and
prints each run's total.

    python benchmarks/keyframe_timeline.py [--size-mib 512] [--runs 1] [--keep] [--perf FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shardcast import MODEL, _Child, _cli, _idle, make_state  # noqa: E402
from relay_procs import cpu_seconds  # noqa: E402
from step_timeline import stamps, work_folder  # noqa: E402

from deltasync.cli.cluster import LocalCluster  # noqa: E402

MiB = 1 << 20


class _Timed(_Child):
    """A ``_Child`` that also keeps the CPU seconds (user, system) from ``wait4``'s rusage."""

    cpu: tuple[float, float] = (0.0, 0.0)

    def _reap(self) -> None:
        _, status, ru = os.wait4(self.proc.pid, 0)
        self.cpu = (ru.ru_utime, ru.ru_stime)
        self.ended = time.perf_counter()
        self.ended_mono = time.monotonic()
        self.code = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.code
        self.rss_mb = self.hwm_mb or ru.ru_maxrss / 1024


def run(state: Path, work: Path, perf: str | None = None, perf_of: str = "sub0") -> tuple[list[tuple[str, str, float]], dict[str, float]]:
    """Publish ``state`` as v0 into 4 waiting subscribers; the timeline rows and each server's CPU seconds."""
    cluster = LocalCluster(work / "servers", key=os.urandom(32))
    env = {**os.environ, "DELTASYNC_TIMELINE": "1"}
    try:
        cluster.start_tree({"r1": ["origin"], "r2": ["origin"]})
        common = ["--model", MODEL, "--key-file", str(cluster.key_file)]
        pub = ["--origin", cluster.origin, "--token-file", str(cluster.token_file), *common, "--quiet"]
        subs = [_Timed(_cli("subscribe", "--from", cluster.url(f"r{1 + i % 2}"), *common, "--out",
                            str(work / f"sub{i}.safetensors"), "--until", "0", "--timeout", "600", "--quiet"),
                       work / f"sub{i}.log", env=env) for i in range(4)]
        _idle(subs)
        names = ("origin", "r1", "r2")
        cpu0 = {n: cpu_seconds(cluster.servers[n].proc.pid) for n in names}
        sub0 = [cpu_seconds(s.proc.pid, split=True) for s in subs]
        spy = None
        if perf:  # one process's profile (a subscriber's, to its exit; a server's, to the end)
            import subprocess
            pid = subs[int(perf_of[3:])].proc.pid if perf_of.startswith("sub") else cluster.servers[perf_of].proc.pid
            spy = subprocess.Popen(["perf", "record", "-F", "1999", "-g", "-p", str(pid), "-o", perf],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        t0 = time.monotonic()
        p = _Timed(_cli("publish", *pub, str(state)), work / "publish.log")
        p.wait(600)
        for s in subs:
            s.wait(600)
        if spy is not None:
            if spy.poll() is None:
                spy.send_signal(2)
            spy.wait(30)
        cpu = {n: cpu_seconds(cluster.servers[n].proc.pid) - cpu0[n] for n in names}
        cpu["publish"] = sum(p.cpu)
        for i, (s, (u0, k0)) in enumerate(zip(subs, sub0)):
            cpu[f"sub{i} user"], cpu[f"sub{i} sys"] = s.cpu[0] - u0, s.cpu[1] - k0
        rows: list[tuple[str, str, float]] = [("publish", "exit", p.ended_mono - t0)]
        ids: dict[str, str] = {}
        for name in names:
            for t, what, rest in stamps(cluster.servers[name].log_path, t0):
                bid = rest.split()[0] if rest else ""
                if len(bid) >= 32:
                    rest = "blob" + ids.setdefault(bid, str(len(ids))) + rest[len(bid):]
                rows.append((name, f"{what} {rest}".strip(), t - t0))
        for i, s in enumerate(subs):
            for t, what, rest in stamps(s.log_path, t0):
                bid = rest.split()[0] if rest else ""
                if len(bid) >= 32:
                    rest = "blob" + ids.setdefault(bid, str(len(ids))) + rest[len(bid):]
                rows.append((f"sub{i}", f"{what} {rest}".strip(), t - t0))
            rows.append((f"sub{i}", "exit", s.ended_mono - t0))
        return rows, cpu
    finally:
        cluster.close()


def report(rows: list[tuple[str, str, float]], cpu: dict[str, float], size: int) -> str:
    load = os.getloadavg()
    out = [f"keyframe timeline: {size / MiB:.0f} MiB state, load average {load[0]:.1f}/{load[1]:.1f}; "
           "ms after the cold `publish STATE` started", ""]
    for proc, what, t in sorted(rows, key=lambda r: r[2]):
        out.append(f"{t * 1000:9.1f}  {proc:7s} {what}")
    last = max(t for p, w, t in rows if w == "exit" and p.startswith("sub"))
    pub = next(t for p, w, t in rows if p == "publish")
    out.append(f"\npublish exited {pub * 1000:.0f} ms; last subscriber exited {last * 1000:.0f} ms; CPU s: "
               + ", ".join(f"{n} {c:.2f}" for n, c in cpu.items()))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs) and print its path")
    ap.add_argument("--perf", metavar="FILE", help="record one process with `perf record -g` into FILE")
    ap.add_argument("--perf-of", default="sub0", help="the process --perf records: sub0..sub3, origin, r1, r2")
    a = ap.parse_args()
    with work_folder("deltasync-kf-timeline-", a.keep) as work:
        state = work / "state.safetensors"
        make_state(state, a.size_mib * MiB)
        totals = []
        for r in range(a.runs):
            w = work / f"run{r}"
            w.mkdir()
            rows, cpu = run(state, w, a.perf, a.perf_of)
            totals.append(max(t for p, x, t in rows if x == "exit" and p.startswith("sub")))
            if r == a.runs - 1:
                print(report(rows, cpu, a.size_mib * MiB))
            if not a.keep:
                shutil.rmtree(w, ignore_errors=True)
        if a.runs > 1:
            print("runs (s to all 4): " + ", ".join(f"{t:.2f}" for t in totals))


if __name__ == "__main__":
    main()
