"""One step's critical path, stamp by stamp: from the ``publish --base`` command's start to the last subscriber's exit.

Shardcast's scenario (benchmarks/bench_shardcast.py, its helpers): origin -> 2 relays -> 4 ``deltasync subscribe
--out F --until V`` processes already running and idle, 2 per relay, servers ``--no-fsync``, everything on tmpfs.
v0 (a keyframe) is published and written into the 4 files first, untimed; then the ~1%-changed step is published
with ``publish --base`` and every process's stamps are lined up.

Every stamp is ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine) from a
``deltasync.timeline`` log line: the origin's commit (server/routes.py), each relay's event from its parent and
its announce (server/parents/prefetch.py), each subscriber's wake-up, blobs, decode (client/driver.py), apply and close
(client/cli.py, ``DELTASYNC_TIMELINE=1``); the publish start and every process's exit are this script's own
(reaped with wait4). Times are printed in ms after the publish command's start.

    python benchmarks/step_timeline.py [--size-mib 64] [--changed 0.01]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shardcast import MODEL, _Child, _cli, _idle, make_state, step_state  # noqa: E402

from deltasync.cli.cluster import LocalCluster  # noqa: E402

MiB = 1 << 20
STAMP = re.compile(r"mono=(\d+\.\d+) (\S+)(.*)$")
CPU = re.compile(r"cpu=(\d+\.\d+)")


def stamps(path: Path, since: float) -> list[tuple[float, str, str]]:
    """The ``mono=`` stamps of a log at or after ``since``: (time, what, the rest of the line)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = STAMP.search(line)
        if m and float(m.group(1)) >= since:
            out.append((float(m.group(1)), m.group(2), m.group(3).strip()))
    return out


def run(size: int, changed: float, work: Path,
        cpus: list[tuple[str, str, float, float]] | None = None) -> list[tuple[str, str, float]]:
    """Publish v0 and the step; returns the step's timeline rows (process, event, seconds after publish start).
    ``cpus`` gets each subscriber stamp's ``cpu=`` (its process's CPU seconds so far): (process, event, t, cpu)."""
    cpus = [] if cpus is None else cpus
    state, step = work / "state.safetensors", work / "step.safetensors"
    tensors = make_state(state, size)
    step_state(tensors, step, changed)
    del tensors
    cluster = LocalCluster(work / "servers", key=os.urandom(32))
    env = {**os.environ, "DELTASYNC_TIMELINE": "1"}
    try:
        cluster.start_tree({"r1": ["origin"], "r2": ["origin"]})
        common = ["--model", MODEL, "--key-file", str(cluster.key_file)]
        pub = ["--origin", cluster.origin, "--token-file", str(cluster.token_file), *common, "--quiet"]
        outs = [work / f"sub{i}.safetensors" for i in range(4)]
        rows: list[tuple[str, str, float]] = []
        for version, path, extra in ((0, state, []), (1, step, ["--base", str(state)])):
            subs = [_Child(_cli("subscribe", "--from", cluster.url(f"r{1 + i % 2}"), *common, "--out", str(out),
                               "--until", str(version), "--timeout", "600", "--quiet"), work / f"sub{i}-v{version}.log",
                          env=env) for i, out in enumerate(outs)]
            _idle(subs)
            t0 = time.monotonic()
            p = _Child(_cli("publish", *pub, *extra, str(path)), work / f"publish-v{version}.log", env=env)
            p.wait(600)
            for s in subs:
                s.wait(600)
            if version == 0:
                continue
            rows.append(("publish", "exit", p.ended_mono - t0))
            rows += [("publish", what.removeprefix("publish-"), t - t0) for t, what, _ in stamps(p.log_path, t0)]
            for name in ("origin", "r1", "r2"):
                for t, what, rest in stamps(cluster.servers[name].log_path, t0):
                    if rest.endswith(f" v{version}") or f" v{version} " in rest:
                        rows.append((name, what, t - t0))
            for i, s in enumerate(subs):
                for t, what, rest in stamps(s.log_path, t0):
                    rows.append((f"sub{i}", what, t - t0))
                    if (m := CPU.search(rest)) is not None:
                        cpus.append((f"sub{i}", what, t - t0, float(m.group(1))))
                rows.append((f"sub{i}", "exit", s.ended_mono - t0))
        return rows
    finally:
        cluster.close()


def report(rows: list[tuple[str, str, float]], size: int, changed: float,
           cpus: list[tuple[str, str, float, float]] = ()) -> str:
    load = os.getloadavg()
    out = [f"step timeline: {size / MiB:.0f} MiB state, ~{changed:.0%} changed, load average "
           f"{load[0]:.1f}/{load[1]:.1f}; ms after `publish --base` started", ""]
    for proc, what, t in sorted(rows, key=lambda r: r[2]):
        out.append(f"{t * 1000:9.1f}  {proc:7s} {what}")
    subs = sorted({p for p, _, _ in rows if p.startswith("sub")})
    def at(p: str, w: str) -> float | None:
        got = [t for q, x, t in rows if q == p and x == w]
        return min(got) if got else None
    commit = at("origin", "committed")
    out += ["", "per subscriber (ms): woke, blobs received, decoded, applied, closed, exited"]
    for s in subs:
        cells = [at(s, w) for w in ("woke", "blobs-end", "prepare-end", "applied", "closed", "exit")]
        out.append(f"  {s}: " + "  ".join("-" if c is None else f"{c * 1000:.0f}" for c in cells))
    phases = ("woke", "blobs-end", "prepare-end", "applied", "subscriber-closed", "closed")
    out += ["", "per subscriber, CPU-s (user + system, all threads: time.process_time() in its stamps), from woke: "
            "to blobs received, decoded, applied, subscriber closed, file closed; total"]
    for s in subs:
        cpu = {w: c for q, w, _, c in cpus if q == s}
        marks = [cpu.get(w) for w in phases]
        if None in marks:
            out.append(f"  {s}: -")
            continue
        steps = [b - a for a, b in zip(marks, marks[1:])]
        out.append(f"  {s}: " + "  ".join(f"{x:.3f}" for x in steps) + f";  {marks[-1] - marks[0]:.3f}")
    last = max((t for p, w, t in rows if w == "exit" and p.startswith("sub")), default=None)
    if commit is not None and last is not None:
        out.append(f"\ncommit at the origin {commit * 1000:.0f} ms; last subscriber exited {last * 1000:.0f} ms "
                   f"(after the commit: {(last - commit) * 1000:.0f} ms)")
    return "\n".join(out)


@contextlib.contextmanager
def work_folder(prefix: str, keep: bool = False):
    """A fresh work folder on tmpfs (/dev/shm where there is one), removed afterwards unless ``keep`` (then its
    path is printed): the timeline scripts' state, stores and logs."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield work
    finally:
        if keep:
            print(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs) and print its path")
    a = ap.parse_args()
    with work_folder("deltasync-step-timeline-", a.keep) as work:
        cpus: list[tuple[str, str, float, float]] = []
        rows = run(a.size_mib * MiB, a.changed, work, cpus)
        print(report(rows, a.size_mib * MiB, a.changed, cpus))


if __name__ == "__main__":
    main()
