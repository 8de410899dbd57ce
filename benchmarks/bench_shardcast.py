"""Shardcast's own scenario, side by side: shardcast 0.3.2 itself against deltasync's CLI.

One state (512 MiB of bf16 tensors, a safetensors file; 64 MiB in quick mode) on tmpfs
(/dev/shm), origin → 2 relays → 4 clients, each client on one relay, every node its own
process on this machine.

- shardcast: installed from the registry into its own venv (``.venv-shardcast``, built here if
  missing: ``make venv-shardcast``), driven by benchmarks/shardcast_nodes.py inside a private
  network namespace (``unshare -n``, ``lo`` brought up: shardcast binds 0.0.0.0). Timed from
  ``broadcast()`` until all 4 clients reassembled and checksummed the file.
- deltasync: ``deltasync.cli.cluster`` starts the origin and 2 relays (``--no-fsync``, stores on
  tmpfs); 4 ``deltasync subscribe --out F --until V`` processes are started and idle before the
  clock starts; then ``deltasync publish`` (with ``--base PREV`` when this build's CLI has it).
  Timed from the publish command's start until every subscriber exited holding the version
  (verified). Full copy (v0, a keyframe), then a step with ~1% of the bf16 elements changed.
- ``ROUNDS`` rounds (shardcast and the two CLI rows, fresh servers and outputs each round; shardcast first
  in odd rounds, deltasync first in even ones: the second system runs on memory the first just freed); the
  table gives the medians and every round's ratios; the sidecar rows run in the last round. Each system runs
  with only the state files on tmpfs: each one's files are removed before the other starts. Left in place, the other system's files slowed whichever ran
  second on this VM: deltasync's CLI full copy took 3.4-3.6 s alone and 5.1-6.7 s beside
  shardcast's ~3.5 GiB of shards and copies; shardcast took 7.0-7.7 s alone and 7.4-10.5 s beside
  deltasync's stores and outputs (the servers' CPU seconds were the same either way).

Peak RSS of every process comes from ``wait4`` (subscribers, publish, shardcast clients) or
VmHWM (servers).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from deltasync.cli.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relay_procs import cpu_seconds, max_rss_mb  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = ROOT / ".venv-shardcast"
SHARDCAST = "shardcast==0.3.2"
MODEL = "sc"
MiB = 1 << 20
CHANGED = 0.01
SIDECAR_MODEL = "sc-sidecar"
SIDECAR_POLL = 0.1  # the sidecar's folder scan interval: at most this much of each sidecar row is waiting
# shardcast and the CLI rows run in turn this many times (a round each): one run of each moved by 2x between
# make bench runs on this shared VM (fresh memory after a large free costs about twice as much to write here),
# so the table gives medians and every round's ratios
ROUNDS = 6  # even: each system runs first in half of them (6: shardcast's own full copy moved 7.5-14 s from round to round)
# then one more run of each on cold memory: this VM (a Firecracker guest with free page reporting) hands memory
# that stayed free a few seconds back to the host, and writing it again costs a host fault a page (20-28 us
# against 1.3 warm); each system starts after this long idle, as on a machine that was not just running the other
COLD_IDLE_S = 12.0


def _shardcast_python() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists() or subprocess.run([str(py), "-c", "import shardcast"], capture_output=True).returncode:
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", SHARDCAST], check=True)
    return py


def _netns_ok() -> str | None:
    """None if ``unshare -n`` with a working loopback is allowed here, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is not installed"
    if shutil.which("wget") is None:
        return "wget (which shardcast's downloader runs) is not installed"
    r = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare -n failed: {r.stderr.strip()[:200]}"


def make_state(path: Path, size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 tensors of trained-looking magnitudes, ``size`` bytes in all, in 8 tensors."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    n = size // 2 // 8
    state = {f"layer{i}.weight": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16) for i in range(8)}
    save_file(state, str(path))
    return state


def step_state(state: dict[str, torch.Tensor], path: Path, frac: float, seed: int = 1) -> None:
    """The next step: ``frac`` of the elements moved by one or two ULPs."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        w = t.view(torch.int16).clone()
        idx = torch.randint(0, w.numel(), (int(w.numel() * frac),), generator=g)
        w[idx] += torch.randint(1, 3, (idx.numel(),), generator=g, dtype=torch.int16)
        out[name] = w.view(torch.bfloat16)
    save_file(out, str(path))


class _Child:
    """A CLI process reaped with wait4: exit time and peak RSS."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)
        self.ended: float | None = None  # perf_counter() at exit
        self.ended_mono: float | None = None  # time.monotonic() at exit: the clock of deltasync.timeline stamps
        self.rss_mb = 0.0
        self.code: int | None = None
        self.anon_mb = 0.0  # peak anonymous RSS (RssAnon, sampled every 20 ms: the kernel keeps no peak of it)
        # peak RSS of the program itself: VmHWM, sampled. wait4's ru_maxrss is no use here: a child forked from
        # this (big) benchmark process carries the parent's RSS as its high-water mark until it execs
        self.hwm_mb = 0.0
        self.idle_anon_mb = 0.0  # RssAnon when _idle() saw it quiet (imports done): the process's baseline
        self._t = threading.Thread(target=self._reap, daemon=True)
        self._t.start()
        threading.Thread(target=self._sample, daemon=True).start()

    def anon_now(self) -> float:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
        except (OSError, ValueError, IndexError):
            pass
        return 0.0

    def _status(self) -> dict[str, float]:
        got = {}
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "VmHWM:")):
                    got[line.split(":")[0]] = int(line.split()[1]) / 1024
        except (OSError, ValueError, IndexError):
            pass
        return got

    def _sample(self) -> None:
        while self.ended is None:
            st = self._status()
            self.anon_mb = max(self.anon_mb, st.get("RssAnon", 0.0))
            self.hwm_mb = max(self.hwm_mb, st.get("VmHWM", 0.0))
            time.sleep(0.02)

    def reset_peaks(self) -> None:
        """Start a new peak window (a long-running child measured run by run); VmHWM cannot be reset, so the
        program's peak RSS stays the whole-life figure."""
        self.anon_mb = self.anon_now()

    def _reap(self) -> None:
        _, status, ru = os.wait4(self.proc.pid, 0)
        self.ended = time.perf_counter()
        self.ended_mono = time.monotonic()
        self.code = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.code
        self.rss_mb = self.hwm_mb or ru.ru_maxrss / 1024

    def wait(self, timeout: float) -> None:
        self._t.join(timeout)
        if self.code is None:
            self.proc.kill()
            self._t.join(5)
            raise TimeoutError(f"{self.proc.args[:4]} did not finish within {timeout:.0f} s")
        if self.code != 0:
            raise RuntimeError(f"{' '.join(map(str, self.proc.args[:6]))} exited {self.code}: "
                               f"{Path(self.log.name).read_text(errors='replace')[-1500:]}")


def _idle(children: list[_Child], timeout: float = 120.0) -> None:
    """Wait until every child is up and idle (its CPU time stops growing: imports done, long-polling)."""
    deadline = time.monotonic() + timeout
    last = {c: -1.0 for c in children}
    while time.monotonic() < deadline:
        time.sleep(0.5)
        quiet = True
        for c in children:
            now = cpu_seconds(c.proc.pid)
            if now - last[c] > 0.02:
                quiet = False
            last[c] = now
        if quiet:
            for c in children:
                c.idle_anon_mb = c.anon_now()
            return


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "deltasync.cli.main", *args]


def _has_base() -> bool:
    r = subprocess.run(_cli("publish", "--help"), capture_output=True, text=True)
    return "--base" in r.stdout


def _deltasync(work: Path, state: Path, step: Path, *, sidecar: bool = True) -> dict:
    key = os.urandom(32)
    cluster = LocalCluster(work / "servers", key=key)
    base_flag = _has_base()
    try:
        cluster.start_tree({"r1": ["origin"], "r2": ["origin"]})
        outs = [work / f"sub{i}.safetensors" for i in range(4)]
        common = ["--model", MODEL, "--key-file", str(cluster.key_file)]
        pub_common = ["--origin", cluster.origin, "--token-file", str(cluster.token_file), *common, "--quiet"]
        rows = {}
        # the publish command's own baseline: the same command publishing a 64 KiB state (another stream), whose
        # peak anonymous memory is the interpreter and its imports, not the state
        tiny = work / "tiny.safetensors"
        make_state(tiny, 64 << 10, seed=5)
        idle_pub = _Child(_cli("publish", "--origin", cluster.origin, "--token-file", str(cluster.token_file),
                               "--model", f"{MODEL}-tiny", "--key-file", str(cluster.key_file), "--quiet", str(tiny)),
                          work / "publish-tiny.log")
        idle_pub.wait(300)
        rows["publish_idle_anon"] = idle_pub.anon_mb
        for label, version, path, extra in (("full", 0, state, []),
                                            ("step", 1, step, ["--base", str(state)] if base_flag else [])):
            subs = [_Child(_cli("subscribe", "--from", cluster.url(f"r{1 + i % 2}"), *common, "--out", str(out),
                                "--until", str(version), "--timeout", "600", "--quiet"), work / f"sub{i}-{label}.log")
                    for i, out in enumerate(outs)]
            _idle(subs)
            cpu0 = {n: cpu_seconds(cluster.servers[n].proc.pid) for n in ("origin", "r1", "r2")}
            t0 = time.perf_counter()
            pub = _Child(_cli("publish", *pub_common, *extra, str(path)), work / f"publish-{label}.log")
            pub.wait(600)
            for s in subs:
                s.wait(600)
            rows[label] = {"seconds": max(s.ended for s in subs) - t0, "publish_s": pub.ended - t0,
                           "publish_rss": pub.rss_mb, "sub_rss": [s.rss_mb for s in subs],
                           "publish_anon": pub.anon_mb, "sub_anon": [s.anon_mb for s in subs],
                           "sub_idle_anon": [s.idle_anon_mb for s in subs],
                           "server_cpu_s": {n: cpu_seconds(cluster.servers[n].proc.pid) - c for n, c in cpu0.items()}}
        if sidecar:
            rows["sidecar"] = _sidecar_rows(cluster, work, state, step, outs)
        rows["servers_rss"] = {n: max_rss_mb(p.pid) for n, p in
                               ((n, cluster.servers[n].proc) for n in ("origin", "r1", "r2"))}
        rows["base"] = base_flag
        return rows
    finally:
        cluster.close()


def _drop(src: Path, folder: Path, step: int) -> None:
    """A trainer's checkpoint appearing atomically in the watched folder (a hard link renamed into place: no copy)."""
    tmp = folder / f".step-{step}.safetensors.tmp"
    os.link(src, tmp)
    os.rename(tmp, folder / f"step-{step}.safetensors")


def _sidecar_rows(cluster: LocalCluster, work: Path, state: Path, step: Path, outs: list[Path]) -> dict:
    """The same two versions through ``deltasync sidecar`` (already running, as shardcast's origin is before its
    broadcast()): timed from the checkpoint's rename into the watched folder until all 4 subscribers exited."""
    watch = work / "watch"
    watch.mkdir()
    common = ["--model", SIDECAR_MODEL, "--key-file", str(cluster.key_file)]
    car = _Child(_cli("sidecar", "--watch", str(watch), "--origin", cluster.origin, "--token-file",
                      str(cluster.token_file), *common, "--keyframe-every", "0", "--poll", str(SIDECAR_POLL),
                      "--quiet"), work / "sidecar.log")
    rows: dict = {}
    try:
        for label, version, path in (("full", 0, state), ("step", 1, step)):
            if label == "full":
                for out in outs:
                    out.unlink(missing_ok=True)  # the CLI rows' files are another stream's; the step patches v0's
            subs = [_Child(_cli("subscribe", "--from", cluster.url(f"r{1 + i % 2}"), *common, "--out", str(out),
                                "--until", str(version), "--timeout", "600", "--quiet"),
                           work / f"car-sub{i}-{label}.log") for i, out in enumerate(outs)]
            _idle([car, *subs])
            car.reset_peaks()
            cpu_car = cpu_seconds(car.proc.pid)
            t0 = time.perf_counter()
            _drop(path, watch, version)
            for sub in subs:
                sub.wait(600)
            rows[label] = {"seconds": max(x.ended for x in subs) - t0, "sidecar_cpu_s": cpu_seconds(car.proc.pid) - cpu_car,
                           "sidecar_anon": car.anon_mb, "sidecar_idle_anon": car.idle_anon_mb,
                           "sub_anon": [x.anon_mb for x in subs], "sub_idle_anon": [x.idle_anon_mb for x in subs]}
        rows["sidecar_rss"] = car.hwm_mb
        return rows
    finally:
        car.proc.terminate()
        try:
            car.wait(30)
        except (TimeoutError, RuntimeError):
            pass


def _shardcast(work: Path, state: Path) -> dict | str:
    why = _netns_ok()
    if why is not None:
        return why
    py = _shardcast_python()
    d = work / "shardcast"
    d.mkdir()
    r = subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', str(py),
                        str(HERE / "shardcast_nodes.py"), str(state), str(d)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"shardcast run failed: {r.stderr[-2000:]}")
    import json
    return json.loads(r.stdout.strip().splitlines()[-1])


WORK_PREFIX = "deltasync-bench-shardcast-"


def _sweep_stale(base: str | None) -> None:
    """Remove work folders of earlier runs that were killed (their owner pid is gone, or they never got a pid
    file and are older than a minute: a run writes it right after creating the folder): on tmpfs they are RAM,
    and a few GiB of them slow every process of the next run (see the module docstring)."""
    for d in Path(base or tempfile.gettempdir()).glob(WORK_PREFIX + "*"):
        try:
            pid = int((d / "owner.pid").read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except FileNotFoundError:
            try:
                if time.time() - d.stat().st_mtime > 60:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass
        except (OSError, ValueError):
            pass  # not ours to judge (another user's)


def run(quick: bool = False) -> str:
    size = (64 if quick else 512) * MiB
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    _sweep_stale(base)
    work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=base))
    (work / "owner.pid").write_text(str(os.getpid()))
    try:
        state, step = work / "state.safetensors", work / "step.safetensors"
        tensors = make_state(state, size)
        step_state(tensors, step, CHANGED)
        del tensors
        load0 = os.getloadavg()[0]
        rounds = []
        n = 1 if quick else ROUNDS
        keep = os.environ.get("DELTASYNC_BENCH_KEEP") is not None
        for i in range(n):  # shardcast and the CLI rows (the sidecar's in the last round only), in turn
            folder = work / f"round{i}"
            (folder / "deltasync").mkdir(parents=True)
            # each system runs with only the state files on tmpfs: the other's leftovers (shardcast's ~3.5 GiB of
            # shards and copies) slowed the next run by up to 2 s on this VM, whichever system ran second. Which
            # runs first alternates (shardcast in odd rounds): the second runs on memory the first just freed.
            first_sc = i % 2 == 0
            if first_sc:
                sc = _shardcast(folder, state)
                if not keep:
                    shutil.rmtree(folder / "shardcast", ignore_errors=True)
            ds = _deltasync(folder / "deltasync", state, step, sidecar=i == n - 1)
            if not keep:
                shutil.rmtree(folder / "deltasync", ignore_errors=True)  # tmpfs: ~3.5 GiB of stores and outputs
            if not first_sc:
                sc = _shardcast(folder, state)
            rounds.append((sc, ds))
            if not keep:
                shutil.rmtree(folder, ignore_errors=True)
        cold = None
        if not quick and COLD_IDLE_S:
            folder = work / "cold"
            (folder / "deltasync").mkdir(parents=True)
            sc_cold, failures = None, []
            while sc_cold is None:  # the baseline's clients give up now and then on cold memory: one more try, cold too
                time.sleep(COLD_IDLE_S)
                try:
                    sc_cold = _shardcast(folder, state)
                except RuntimeError as e:
                    failures.append(str(e).strip().splitlines()[-1])
                    if len(failures) == 2:
                        sc_cold = "it failed twice: " + "; ".join(failures)
                shutil.rmtree(folder / "shardcast", ignore_errors=True)
            time.sleep(COLD_IDLE_S)
            ds_cold = _deltasync(folder / "deltasync", state, step, sidecar=False)
            shutil.rmtree(folder, ignore_errors=True)
            cold = (sc_cold, ds_cold, failures)
        sc, ds = _medians(rounds)
        return _report(sc, ds, size, quick, (load0, os.getloadavg()[0]), work, rounds, cold)
    finally:
        if os.environ.get("DELTASYNC_BENCH_KEEP") is None:
            shutil.rmtree(work, ignore_errors=True)


def _medians(rounds: list[tuple]) -> tuple:
    """One (shardcast, deltasync) pair for the table: the last round's details (memory, CPU, the sidecar rows)
    with the seconds of shardcast and of the two CLI rows replaced by their medians over the rounds."""
    import statistics

    sc, ds = rounds[-1]
    ds = dict(ds)
    for label in ("full", "step"):
        ds[label] = dict(ds[label], seconds=statistics.median(d[label]["seconds"] for _, d in rounds),
                         publish_s=statistics.median(d[label]["publish_s"] for _, d in rounds))
    if not isinstance(sc, str):
        sc = dict(sc, seconds=statistics.median(s["seconds"] for s, _ in rounds))
    return sc, ds


def _report(sc, ds: dict, size: int, quick: bool, load: tuple[float, float], work: Path,
            rounds: list[tuple] = (), cold: tuple | None = None) -> str:
    out = ["## Shardcast's scenario, side by side (bench_shardcast)", ""]
    out.append(
        f"A {size / MiB:.0f} MiB bf16 state (safetensors, 8 tensors) on tmpfs, origin → 2 relays → 4 clients, each "
        "client on one relay, every node its own process on this machine. shardcast 0.3.2 from the registry in its "
        "own venv, run by benchmarks/shardcast_nodes.py in a private network namespace (middle nodes polling their "
        "upstream every 1 s, its minimum; 50 MB shards, its default; clients fetch with wget as it ships), timed from "
        "broadcast() until every client has reassembled and checksummed the file. deltasync: the CLI (`publish`"
        + (" --base PREV" if ds["base"] else "; this build has no `publish --base`, so the step's publish rebuilt "
           "the head from the origin") + "; 4 `subscribe --out F --until V` processes already running and idle), "
        "servers with --no-fsync, timed from the publish command's start until all 4 subscribers exited with the "
        f"version verified and written. Load average {load[0]:.1f} before and {load[1]:.1f} after: absolute times "
        "are noisy, the ratios are from this one run." + (" **Quick mode: small state.**" if quick else ""))
    out.append("")
    out += ["| run | seconds to all 4 | shardcast full copy time / this time | publisher peak RSS MiB | client peak RSS MiB (max of 4) |",
            "|---|---:|---:|---:|---:|"]
    if isinstance(sc, str):
        out.append(f"| shardcast full copy | not run: {sc} | | | |")
        t_sc = None
    else:
        t_sc = sc["seconds"]
        out.append(f"| shardcast: full copy | {t_sc:.2f} | 1.00 | {sc['origin_rss_mb']:.0f} (origin) | "
                   f"{max(sc['client_rss_mb']):.0f} (python; wget not counted) |")
    for label, name, target in (("full", "deltasync: full copy (keyframe)", 2.0),
                                ("step", f"deltasync: ~{CHANGED:.0%}-changed step", 6.0)):
        r = ds[label]
        ratio = ""
        if t_sc:
            x = t_sc / r["seconds"]
            ratio = f"{x:.2f}x (target {target:.0f}x: {'met' if x >= target else 'not met'})"
        out.append(f"| {name} | {r['seconds']:.2f} | {ratio} | {r['publish_rss']:.0f} | {max(r['sub_rss']):.0f} |")
    car = ds.get("sidecar")
    for label, name in (("full", "deltasync sidecar: full copy (keyframe)"),
                        ("step", f"deltasync sidecar: ~{CHANGED:.0%}-changed step")):
        if not car:
            break
        r = car[label]
        ratio = f"{t_sc / r['seconds']:.2f}x" if t_sc else ""
        out.append(f"| {name} | {r['seconds']:.2f} | {ratio} | {car['sidecar_rss']:.0f} (sidecar, whole life) | "
                   f"{max(ds[label]['sub_rss']):.0f} (CLI row) |")
    out.append("")
    if len(rounds) > 1:
        out.append(f"Seconds are medians over {len(rounds)} rounds, each round shardcast's full copy and the two CLI "
                   "rows (shardcast first in odd rounds, deltasync first in even ones); the ratios are of those medians. Each round (shardcast / CLI full / CLI step, seconds; "
                   "ratios): " + "; ".join(
                       f"{s['seconds']:.2f} / {d['full']['seconds']:.2f} / {d['step']['seconds']:.2f} "
                       f"({s['seconds'] / d['full']['seconds']:.2f}x, {s['seconds'] / d['step']['seconds']:.2f}x)"
                       if not isinstance(s, str) else f"{d['full']['seconds']:.2f} / {d['step']['seconds']:.2f}"
                       for s, d in rounds) + ". The sidecar rows, memory and CPU figures are the last round's. Each system's "
                   "files are removed before the other runs (each runs with only the state files on tmpfs; the other's "
                   "leftovers slowed whichever ran second by up to 2 s here).")
        out.append("")
    if cold is not None:
        sc_c, ds_c, failures = cold
        full, stp = ds_c["full"]["seconds"], ds_c["step"]["seconds"]
        if isinstance(sc_c, str):
            what = f"shardcast not measured ({sc_c}); deltasync full copy {full:.2f} s, step {stp:.2f} s"
        else:
            what = (f"shardcast {sc_c['seconds']:.2f} s, deltasync full copy {full:.2f} s "
                    f"(**{sc_c['seconds'] / full:.2f}x**), step {stp:.2f} s (**{sc_c['seconds'] / stp:.2f}x**)")
            if failures:
                what += (f" (shardcast's first cold run failed: {failures[0]}; this is its second, after another "
                         f"{COLD_IDLE_S:.0f} s idle)")
        out.append(f"**On cold memory** (each system started after {COLD_IDLE_S:.0f} s idle, one run each): {what}. "
                   "This VM returns memory that stayed free a few seconds to its host (free page reporting); writing "
                   "it again costs a host fault per 4 KiB page (20-28 us here, against 1.3 us for memory just freed). "
                   "Both systems write ~3.5 GiB of fresh pages (stores, relay copies, 4 outputs); deltasync's copy is "
                   "CPU-bound on 2 cores, so the faults add to its time, while shardcast's 1-s polls absorb most of "
                   "them. The rounds above run each system on memory the other just freed (warm).")
        out.append("")
    if car:
        out.append(
            f"The sidecar rows: `deltasync sidecar --watch DIR --poll {SIDECAR_POLL}` already running (as shardcast's "
            "origin is before broadcast()), timed from the checkpoint's rename into DIR until all 4 subscribers "
            "exited; it holds the previous checkpoint mapped and its fingerprints, so nothing is re-read but the two "
            "files' pages. The targets are the CLI rows'; these show what the ends cost without a command's start-up. "
            + "Sidecar CPU seconds: " + ", ".join(f"{lb} {car[lb]['sidecar_cpu_s']:.2f}" for lb in ("full", "step"))
            + "; its peak anonymous MiB above idle: " + ", ".join(
                f"{lb} {car[lb]['sidecar_anon'] - car[lb]['sidecar_idle_anon']:+.0f}" for lb in ("full", "step"))
            + "; subscribers' (max of 4): " + ", ".join(
                f"{lb} {max(a - i for a, i in zip(car[lb]['sub_anon'], car[lb]['sub_idle_anon'])):+.0f}"
                for lb in ("full", "step")) + ".")
        out.append("")
    # Memory target: anonymous memory (not the mapped files, not tmpfs pages) above what the same CLI process
    # holds idle (its imports: the idle subscribers' RssAnon, sampled before the clock) stays a small fraction
    # of the state; here "small" is at most a quarter of it.
    base = min(x for r in (ds["full"], ds["step"]) for x in r["sub_idle_anon"] if x > 0) if any(
        x > 0 for r in (ds["full"], ds["step"]) for x in r["sub_idle_anon"]) else 0.0
    limit = size / MiB / 4
    out += ["| run | publisher peak anonymous MiB (above the same command on a 64 KiB state) | subscriber peak anonymous MiB, max of 4 (above its idle) "
            "| target: ≤ 1/4 of the state above idle |", "|---|---:|---:|---|"]
    for label in ("full", "step"):
        r = ds[label]
        pub_over = r["publish_anon"] - ds.get("publish_idle_anon", base)
        sub_over = max(a - i for a, i in zip(r["sub_anon"], r["sub_idle_anon"]))
        ok = max(pub_over, sub_over) <= limit
        out.append(f"| {label} | {r['publish_anon']:.0f} ({pub_over:+.0f}) | {max(r['sub_anon']):.0f} ({sub_over:+.0f}) | "
                   f"{'met' if ok else 'not met'} ({max(pub_over, sub_over) / (size / MiB):.1%} of the state) |")
    for label in ("full", "step"):
        c = ds[label].get("server_cpu_s")
        if c:
            out.append(f"Server CPU seconds during the {label} run ({ds[label]['seconds']:.2f} s wall): origin "
                       f"{c['origin']:.2f}, relays {c['r1']:.2f} / {c['r2']:.2f} (a relay near the wall time would be the "
                       "bottleneck).")
    out.append(f"\nBaselines: an idle subscriber's anonymous memory after its imports {base:.0f} MiB; the publish command "
               f"on a 64 KiB state {ds.get('publish_idle_anon', 0.0):.0f} MiB (it imports no torch).")
    out.append("")
    srv = ds["servers_rss"]
    out.append(f"deltasync publish command alone: {ds['full']['publish_s']:.2f} s (full), {ds['step']['publish_s']:.2f} s "
               f"(step). Server peak RSS: origin {srv['origin']:.0f}, relays {srv['r1']:.0f} / {srv['r2']:.0f} MiB"
               + ("" if isinstance(sc, str) else
                  f"; shardcast middle nodes {', '.join(f'{x:.0f}' for x in sc['middle_rss_mb'])} MiB, its sharding "
                  f"step {sc['shard_s']:.2f} s") + ". Targets (issues 10 and 22): full copy ≥ 2x faster than shardcast, "
               "the 1% step ≥ 6x faster than shardcast's full copy.")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
