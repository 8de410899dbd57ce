"""Issue 22's tensor-count row: the same bytes as 8 tensors, ~70k tensors (Kimi-K2 naming) and ~140k (FP8-served).

States come from ``benchmarks/seedscale_states.py``: ``kimi_layout()`` (69,975 tensors, 288.8 MB of bf16 with
Kimi-K2's Hugging Face names), ``fp8_layout()`` of it (139,522 tensors: a ``weight_scale_inv`` per projection,
float32 here) and ``few_layout`` (the Kimi layout's elements in 8 tensors); ``make_state`` / ``step_state`` give
a base and a ~1%-changed AdamW-like step (one ULP each). Each state is a safetensors file on tmpfs (/dev/shm when
it has room, else the default temp directory; the section says which).

Per layout, through the CLI (each command its own process, as a user runs it): an origin and one relay (parent:
the origin; ``deltasync.cli.cluster``, ``--no-fsync``, HMAC-signed manifests, the origin's write token), then

- *keyframe publish*: ``deltasync publish BASE`` (the stream's first version, v0: a keyframe), start to exit;
- *first subscribe*: ``deltasync subscribe --from RELAY --out F --once``, start to exit (F holds v0), FIRSTS times
  after WARM_FIRSTS not measured (F removed before each);
- an already-running ``deltasync subscribe --out F`` (follow mode, resuming F at v0), and every layout's
  servers and followers idle before each step's clock starts;
- WARM_STEPS steps not measured (a layout's first step reads its step file first and keeps its state lines beside
  its header, as a trainer's second checkpoint does once), then STEPS steps, each: *publish --base*: ``deltasync publish --base OLD NEW`` (base -> step, then step -> base, ...),
  start to exit; *step delivery*: from the publish command's start until the follower's F holds the version (its
  header's ``deltasync.version`` and no undo journal left: the commit point); CPU seconds (user + sys) during
  the step: the publish process (``wait4``), the follower, the relay and the origin (``/proc/PID/stat`` before
  the publish starts and when F holds the version);
- the first step's manifest bytes (``GET /v1/models/M/versions/1`` from the origin) and blob bytes.

Every layout's servers, files and follower are up together, and the repeated rows are measured interleaved:
each repetition runs every layout once, the order reversed from one repetition to the next, and a row is the
median of its repetitions. This machine's speed moved 2-3x within minutes while this was built; one run per
layout, minutes apart, gave ratios that moved as much.

Each layout has a header cache of its own (``deltasync/headercache.py``), empty when it starts: the keyframe publish
parses the checkpoint's header and keeps its columns, the step's publish reads them back, as a trainer's second and
later checkpoints do.

Then the in-process path on the same states and servers (another stream name, the follower stopped):
``Publisher`` publishes the base (v0) then the step (v1) to the origin; a ``ThreadedSubscriber`` (auto mode) with
a dict of tensors follows the relay. Timed: the step's ``publish()`` call (the trainer's blocking time), publish
to committed at the origin, and publish to the subscriber's apply of v1 (verified); also the keyframe's.

Every wait has a timeout (``STEP_TIMEOUT`` s): a layout that runs past it is recorded as such in the table and
the failure said below it (the command-line entry exits 1); every server and client is stopped by pid at the end,
on errors too.

``run(quick)`` returns a Markdown section (quick: 8 tensors and the Kimi layout only);
``python benchmarks/bench_seedscale.py [--quick] [--layouts few,kimi,fp8]`` prints it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deltasync.cli.cluster import LocalCluster
from deltasync.client.filetarget import journal_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import seedscale_states as states  # noqa: E402
from relay_procs import cpu_seconds  # noqa: E402

MODEL = "seedscale"
INPROC_MODEL = "seedscale-inproc"
KEY = bytes(range(32))
STEP_TIMEOUT = 600.0  # seconds any one command or wait may take
CHANGED = 0.01
STEPS = 11  # steps per layout, interleaved with the other layouts' (each row: their median)
WARM_STEPS = 1  # steps per layout before those, not measured (a layout's first step reads its step file first and
# keeps its state lines beside its header: what a trainer's second checkpoint does once)
FIRSTS = 5  # first subscribes per layout, likewise (5: their fresh-page noise is the largest of the section)
WARM_FIRSTS = 1  # first subscribes per layout before those, not measured: the first right after the round's keyframe
# publishes was the slowest of every layout in every run (8 tensors 1.50 s against 1.30-1.36, Kimi-K2 3.58 against
# 1.94-2.49, FP8-served 3.03 against 1.87-2.30: the VM's memory just after ~1.2 GB of stores were written), and
# with 3 repetitions it moved a median
LAYOUTS = ("few", "kimi", "fp8")
TITLES = {"few": "8 tensors", "kimi": "Kimi-K2 layout", "fp8": "FP8-served layout"}
_VERSION = re.compile(rb'"deltasync\.version"\s*:\s*"(\d+)"')


class BenchTimeout(RuntimeError):
    """A command or wait ran past STEP_TIMEOUT; ``key``: the row it leaves unmeasured, shown as timed out."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# -- states -----------------------------------------------------------------------------------------

def _layout(which: str, kimi_kwargs: dict) -> dict[str, tuple[int, ...]]:
    kimi = states.kimi_layout(**kimi_kwargs)
    if which == "kimi":
        return kimi
    if which == "fp8":
        return states.fp8_layout(kimi)
    if which == "few":
        return states.few_layout(states.elements_of(kimi))
    raise ValueError(f"unknown layout {which!r}; expected one of {', '.join(LAYOUTS)}")


def _write_states(layout: dict[str, tuple[int, ...]], base_path: Path, step_path: Path) -> dict:
    """Base and ~1%-changed step as safetensors files; scale tensors float32 (their bf16 values widened after the
    step, so they change where the bf16 words did). Returns facts about the states."""
    base = states.make_state(layout, seed=0)
    step = states.step_state(base, changed=CHANGED, seed=1)  # a new buffer: base is left as it was
    scales = [n for n in layout if n.endswith("weight_scale_inv")]
    for n in scales:
        base[n] = base[n].float()
        step[n] = step[n].float()
    # make_state's tensors are views of one buffer: safetensors refuses shared storage, so each is cloned
    save_file({n: t.clone() for n, t in base.items()}, str(base_path))
    save_file({n: t.clone() for n, t in step.items()}, str(step_path))
    data_bytes = sum(t.numel() * t.element_size() for t in base.values())
    changed = sum(int((base[n].view(torch.int16) != step[n].view(torch.int16)).sum()) if base[n].element_size() == 2
                  else int((base[n].view(torch.int32) != step[n].view(torch.int32)).sum()) for n in base)
    return {"tensors": len(layout), "bytes": data_bytes, "scales": len(scales), "changed_words": changed,
            "elements": states.elements_of(layout), "base": base, "step": step}


# -- processes ----------------------------------------------------------------------------------------

def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "deltasync.cli.main", *args]


class _Child:
    """A CLI process reaped by ``wait4`` on a thread: exit time, status and its own CPU seconds."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = open(log, "wb")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)
        self.ended: float | None = None
        self.code: int | None = None
        self.cpu_s: float | None = None
        self._t = threading.Thread(target=self._reap, daemon=True)
        self._t.start()

    def _reap(self) -> None:
        _, status, ru = os.wait4(self.proc.pid, 0)
        self.ended = time.perf_counter()
        self.cpu_s = ru.ru_utime + ru.ru_stime
        self.code = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.code
        self._log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float, what: str, key: str | None = None) -> float:
        """Wait for exit 0; returns the seconds since start. Kills it and raises after ``timeout``."""
        self._t.join(timeout)
        if self.code is None:
            self.stop()
            raise BenchTimeout(f"{what}: still running after {timeout:.0f} s (killed); log tail:\n{self.log()[-1500:]}",
                               key=key)
        if self.code != 0:
            raise RuntimeError(f"{what}: exited {self.code}; log tail:\n{self.log()[-1500:]}")
        return self.ended - self.started

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM by pid, SIGKILL after ``timeout``."""
        if self.code is None:
            try:
                self.proc.terminate()
            except ProcessLookupError:
                pass
            self._t.join(timeout)
            if self.code is None:
                try:
                    self.proc.kill()
                except ProcessLookupError:
                    pass
                self._t.join(5)


def _idle(pids: dict[str, int], timeout: float, what: str) -> None:
    """Wait until none of ``pids`` gains more than 20 ms of CPU in 0.5 s (imports done, long-polling)."""
    deadline = time.monotonic() + timeout
    last = {n: -1.0 for n in pids}
    while time.monotonic() < deadline:
        time.sleep(0.5)
        quiet = True
        for n, pid in pids.items():
            now = cpu_seconds(pid)
            quiet &= now - last[n] <= 0.02
            last[n] = now
        if quiet:
            return
    raise BenchTimeout(f"{what}: {', '.join(pids)} still busy after {timeout:.0f} s")


def _file_version(path: Path) -> int | None:
    """The version a ``subscribe --out`` file holds (its header's first bytes), None while none or mid-commit."""
    if journal_path(path).exists():
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(8 + 1024)
    except FileNotFoundError:
        return None
    m = _VERSION.search(head[8:])
    return int(m.group(1)) if m else None


def _wait_file_version(path: Path, version: int, timeout: float, follower: _Child,
                       publisher: _Child | None = None) -> float:
    """Poll F every 5 ms until it holds ``version``; returns perf_counter() then. Fails at once where the follower
    exits, or the ``publisher`` of that version fails (nothing will arrive)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = _file_version(path)
        if v is not None and v >= version:
            return time.perf_counter()
        if follower.code is not None:
            raise RuntimeError(f"the follower exited {follower.code} before F held v{version}:\n{follower.log()[-1500:]}")
        if publisher is not None and publisher.code not in (None, 0):
            raise RuntimeError(f"the publish of v{version} exited {publisher.code}:\n{publisher.log()[-1500:]}")
        time.sleep(0.005)
    held = "mid-apply: its undo journal is there" if journal_path(path).exists() else f"it holds v{_file_version(path)}"
    raise BenchTimeout(f"step delivery: {path.name} did not hold v{version} within {timeout:.0f} s "
                       f"({held}); follower log tail:\n{follower.log()[-1500:]}", key="step_delivery_s")


def _wait_head(url: str, model: str, version: int, timeout: float) -> None:
    """Poll a server's ``GET /v1/models/M/head`` every 20 ms until its head is ``version`` or newer."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/models/{model}/head", timeout=30) as r:
                body = r.read()
                seen = int(r.headers.get("X-Deltasync-Version") or json.loads(body)["version"])
                if seen >= version:
                    return
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
        time.sleep(0.02)
    raise BenchTimeout(f"{url} did not hold {model} v{version} within {timeout:.0f} s (its head: {seen})")


def _manifest(origin: str, model: str, version: int) -> tuple[int, int]:
    """(manifest bytes as served, blob bytes it names) of one version at the origin."""
    req = urllib.request.Request(f"{origin}/v1/models/{model}/versions/{version}", headers={"Accept-Encoding": "identity"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
    return len(body), sum(int(b["size"]) for b in json.loads(body).get("blobs", ()))


# -- one layout ---------------------------------------------------------------------------------------

class _Stand:
    """One layout's servers, files and follower, kept up for the whole run: its rows are measured interleaved
    with the other layouts' (see :func:`run`)."""

    def __init__(self, which: str, work: Path, timeout: float, kimi_kwargs: dict) -> None:
        self.which, self.work, self.timeout = which, work, timeout
        t0 = time.perf_counter()
        self.facts = _write_states(_layout(which, kimi_kwargs), work / "base.safetensors", work / "step.safetensors")
        self.facts["write_s"] = time.perf_counter() - t0
        # the states' tensors are not kept while the CLI rows run, nor the memory that held them: on the VMs this was
        # built on, memory this process holds idle slowed the layouts whose steps touch more fresh pages (a 70k-tensor
        # step ~1.3x slower with 3 GB held, the 8 tensors' not at all); the in-process rows read the files back
        del self.facts["base"], self.facts["step"]
        _give_back_freed_memory()
        # a header cache of this layout's own (deltasync/headercache.py), empty at its start: the keyframe publish
        # parses the checkpoint's header and keeps it, the step's publish reads it back, as a trainer's second
        # and later checkpoints do; no layout reads another's
        self.env = {**os.environ, "DELTASYNC_HEADER_CACHE": str(work / "header-cache")}
        self.r: dict = {"facts": self.facts, "dir": str(work.parent.parent), "error": None, "load": os.getloadavg()[0]}
        self.errors: list[str] = []
        self.cli_ok = True  # no CLI part failed yet
        self.started = False
        self.cluster = LocalCluster(work / "servers", key=KEY)
        self.sub: list[str] = []  # the commands' arguments, once the servers are up
        self.pub: list[str] = []
        self.out = work / "sub.safetensors"
        self.follower: _Child | None = None
        self.version = 0  # the newest version published
        self.samples: dict[str, list[float]] = {}

    def start(self) -> None:
        """An origin and one relay (parent: the origin)."""
        self.started = True  # (close() stops what did start)
        self.cluster.start_tree({"relay": ["origin"]})
        common = ["--model", MODEL, "--key-file", str(self.cluster.key_file)]
        self.sub = ["subscribe", "--from", self.cluster.url("relay"), *common]
        self.pub = ["publish", "--origin", self.cluster.origin, "--token-file", str(self.cluster.token_file), *common,
                    "--quiet", "--timeout", str(int(self.timeout))]

    def child(self, args: list[str], log: str) -> _Child:
        return _Child(_cli(*args), self.work / log, env=self.env)

    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def keyframe(self) -> None:
        """v0: ``publish BASE``, the relay's head at v0."""
        p = self.child([*self.pub, str(self.work / "base.safetensors")], "publish-keyframe.log")
        self.r["keyframe_publish_s"] = p.wait(self.timeout, "keyframe publish", "keyframe_publish_s")
        self.r["keyframe_manifest_b"], self.r["keyframe_blob_b"] = _manifest(self.cluster.origin, MODEL, 0)
        # the relay learns v0 from the origin's event: a `subscribe --once` started before that finds no version there
        t0 = time.perf_counter()
        _wait_head(self.cluster.url("relay"), MODEL, 0, self.timeout)
        self.r["relay_has_keyframe_s"] = time.perf_counter() - t0

    def first_subscribe(self, rep: int, measure: bool = True) -> None:
        """``subscribe --out F --once`` from the relay into a new F (the one of the rep before removed first)."""
        self.out.unlink(missing_ok=True)
        s = self.child([*self.sub, "--out", str(self.out), "--once", "--quiet", "--timeout", str(int(self.timeout))],
                       f"subscribe-once-{rep if measure else f'warm-{rep}'}.log")
        took = s.wait(self.timeout, "first subscribe --once", "first_subscribe_s")
        if measure:
            self.add("first_subscribe_s", took)
        if _file_version(self.out) != 0:
            raise RuntimeError(f"first subscribe: {self.out} holds v{_file_version(self.out)}, not v0")

    def start_follower(self) -> None:
        """``subscribe --out F`` in follow mode, resuming F at v0 (waited for: idle, in ``run``)."""
        self.follower = self.child([*self.sub, "--out", str(self.out)], "follower.log")

    def check_follower(self) -> None:
        if "resuming" not in self.follower.log() or self.follower.code is not None:
            raise RuntimeError(f"the follower did not resume {self.out.name} at v0:\n{self.follower.log()[-1500:]}")

    def pids(self) -> dict[str, int]:
        """The layout's running processes: origin, relay and (once started) the follower."""
        follower = {"follower": self.follower.pid} if self.follower is not None else {}
        return {**follower, **{n: self.cluster.servers[n].proc.pid for n in ("origin", "relay")}}

    def step(self, measure: bool = True) -> None:
        """One ~1%-changed step: ``publish --base`` of the state the stream does not hold against the one it does
        (base -> step, then step -> base, ...), timed to the follower's commit of it (``measure=False``: waited
        for, not recorded)."""
        v = self.version + 1
        files = [self.work / "base.safetensors", self.work / "step.safetensors"]
        old, new = files[(v - 1) % 2], files[v % 2]
        pids = self.pids()
        cpu0 = {n: cpu_seconds(pid) for n, pid in pids.items()}
        ps = self.child([*self.pub, "--base", str(old), str(new)], f"publish-step-{v}.log")
        try:
            t_delivered = _wait_file_version(self.out, v, self.timeout, self.follower, ps)
            cpu1 = {n: cpu_seconds(pid) for n, pid in pids.items()}
            if not measure:
                ps.wait(max(1.0, self.timeout - (time.perf_counter() - ps.started)), "publish --base (warm-up)")
                return
            self.add("step_delivery_s", t_delivered - ps.started)
            self.add("publish_base_s", ps.wait(max(1.0, self.timeout - (time.perf_counter() - ps.started)),
                                               "publish --base", "publish_base_s"))
            self.add("cpu_publish_s", ps.cpu_s)
            for n in pids:
                self.add(f"cpu_{n}_s", cpu1[n] - cpu0[n])
        finally:
            if ps.code is None:  # the delivery failed first: the publish gets the rest of its time, then is stopped
                ps._t.join(max(0.0, self.timeout - (time.perf_counter() - ps.started)))
                ps.stop()
            if ps.code == 0:
                self.version = v
                if v == 1:
                    self.r["step_manifest_b"], self.r["step_blob_b"] = _manifest(self.cluster.origin, MODEL, 1)
                if measure and len(self.samples.get("publish_base_s", ())) < len(self.samples.get("step_delivery_s", ())):
                    self.add("publish_base_s", ps.ended - ps.started)  # published; its wait is what failed

    def stop_follower(self) -> None:
        if self.follower is not None:
            self.follower.stop()

    def close(self) -> None:
        self.stop_follower()
        self.cluster.close()
        self.r["load_end"] = os.getloadavg()[0]
        for key, xs in self.samples.items():  # each row: the median of its interleaved repetitions
            self.r[key] = statistics.median(xs)
            self.r.setdefault("samples", {})[key] = xs
        self.r["error"] = "\n".join(self.errors) or None


def _give_back_freed_memory() -> None:
    """Return this process's freed heap to the system (glibc's ``malloc_trim``; nothing elsewhere): a state's 70k
    small tensors, freed, otherwise stay ~0.9 GB of this process's resident memory."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _read_states(work: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A layout's base and step states, read back from their files (for the in-process rows)."""
    return load_file(str(work / "base.safetensors")), load_file(str(work / "step.safetensors"))


def _inproc_rows(r: dict, cluster: LocalCluster, base: dict[str, torch.Tensor], step: dict[str, torch.Tensor],
                 timeout: float) -> None:
    """The in-process rows into ``r``."""
    from deltasync.client.publisher import Publisher
    from deltasync.client.subscriber import ThreadedSubscriber

    applied: dict[int, float] = {}
    got = threading.Condition()

    def on_applied(v: int) -> None:
        with got:
            applied.setdefault(v, time.perf_counter())
            got.notify_all()

    def wait_applied(v: int, t0: float, what: str) -> float:
        deadline = time.monotonic() + timeout - (time.perf_counter() - t0)
        with got:
            while v not in applied:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchTimeout(f"in-process {what}: the subscriber had not applied v{v} after {timeout:.0f} s "
                                       f"(status: {sub.status})", key="ip_delivery_s" if v == 1 else "ip_first_sync_s")
                got.wait(min(left, 1.0))
        return applied[v] - t0

    pub = Publisher(cluster.origin, INPROC_MODEL, cluster.token, KEY, keyframe_every=0)
    sub = None
    try:
        t0 = time.perf_counter()
        pending = pub.publish(0, base)
        r["ip_keyframe_blocking_s"] = pending.blocking_s
        pending.result(timeout)
        r["ip_keyframe_commit_s"] = time.perf_counter() - t0
        target = {n: torch.zeros_like(t) for n, t in base.items()}
        sub = ThreadedSubscriber([cluster.url("relay")], INPROC_MODEL, target, verifier=KEY, auto=True,
                                 on_applied=on_applied)
        t1 = time.perf_counter()
        sub.start(timeout)
        r["ip_first_sync_s"] = wait_applied(0, t1, "first sync")
        time.sleep(1.0)  # let the subscriber settle into its long-poll
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        pending = pub.publish(1, step)
        r["ip_publish_call_s"] = time.perf_counter() - t0
        res = pending.result(timeout)
        r["ip_commit_s"] = time.perf_counter() - t0
        r["ip_delivery_s"] = wait_applied(1, t0, "step")
        r["ip_cpu_s"] = time.process_time() - cpu0
        r["ip_blob_b"] = res.blob_bytes
        for n, t in step.items():  # the subscriber's tensors are the step's, bit for bit
            if not torch.equal(target[n].view(torch.uint8), t.contiguous().view(torch.uint8)):
                raise RuntimeError(f"in-process: the subscriber's {n} differs from the published step")
    finally:
        if sub is not None:
            sub.close()
        pub.close(timeout)


def _part(st: _Stand, part: str, fn) -> bool:
    """Run one part of a layout's measurement; its failure is recorded (in the table and below it) and the
    layout's later CLI parts are skipped (its in-process part still runs). True if it ran and passed."""
    if not st.cli_ok:
        return False
    st.cli_ok = _recorded(st, part, fn)
    return st.cli_ok


def _recorded(st: _Stand, part: str, fn) -> bool:
    """``fn()``; an error it raises recorded in ``st`` (a timeout also marks its row). True if it passed."""
    try:
        fn()
        return True
    except BenchTimeout as e:
        st.errors.append(f"{part}: timed out: {e}")
        if e.key:
            st.r.setdefault("timed_out", set()).add(e.key)
    except Exception as e:
        st.errors.append(f"{part}: {type(e).__name__}: {e}")
    return False


def _measure(layouts: list[str], timeout: float, kimi_kwargs: dict, steps: int, firsts: int,
             say=lambda text: None) -> dict[str, dict]:
    """Every layout's rows. The layouts' servers, files and followers are all up together, and each repeated row
    is measured interleaved, layout after layout (the order reversed every repetition), so that a change of
    this machine's speed during the run (2-3x within minutes on the VMs it was built on) falls on every layout
    alike: ``firsts`` first subscribes, then ``steps`` steps; each row is the median of its repetitions."""
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-seedscale-", dir=_tmp_root(len(layouts))) as tmp:
        stands: dict[str, _Stand] = {}
        try:
            for w in layouts:
                say(f"{w}: states, servers, keyframe")
                work = Path(tmp) / w
                work.mkdir()
                st = stands[w] = _Stand(w, work, timeout, kimi_kwargs)
                _part(st, "servers", st.start) and _part(st, "CLI keyframe", st.keyframe)

            def every_pid() -> dict[str, int]:
                return {f"{w} {n}": pid for w, st in stands.items() if st.started and st.cli_ok
                        for n, pid in st.pids().items()}

            def interleaved(what: str, reps: int, fn) -> None:
                for rep in range(reps):
                    say(f"{what} {rep + 1}/{reps}")
                    for w in (layouts if rep % 2 == 0 else layouts[::-1]):
                        st = stands[w]
                        if st.cli_ok:  # every layout's servers and followers quiet first (idle when the clock starts)
                            _part(st, f"CLI {what} {rep + 1}", lambda: (_idle(every_pid(), timeout, what), fn(st, rep)))

            interleaved("warm-up first subscribe", WARM_FIRSTS, lambda st, rep: st.first_subscribe(rep, measure=False))
            interleaved("first subscribe", firsts, lambda st, rep: st.first_subscribe(rep))
            for st in stands.values():
                _part(st, "CLI follower", st.start_follower)
            for st in stands.values():
                _part(st, "CLI follower", lambda: (_idle(st.pids(), timeout, "follower start"), st.check_follower()))
            interleaved("warm-up step", WARM_STEPS, lambda st, rep: st.step(measure=False))
            interleaved("step", steps, lambda st, rep: st.step())
            for st in stands.values():
                st.stop_follower()
            for w, st in stands.items():
                say(f"{w}: in-process")
                if st.started:
                    _recorded(st, "in-process", lambda: _inproc_rows(st.r, st.cluster, *_read_states(st.work), timeout))
        finally:
            for st in stands.values():
                st.close()
        return {w: st.r for w, st in stands.items()}


def _tmp_root(layouts: int = 1) -> str | None:
    """/dev/shm when it has room for these layouts' files (~10 states' worth each), else the default temp dir."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize > layouts * (4 << 30) else None


# -- report -------------------------------------------------------------------------------------------

ROWS = [  # (key, label, kind)
    ("step_delivery_s", "CLI: 1%-step delivered (publish start to the follower's file at its version)", "s"),
    ("publish_base_s", "CLI: `publish --base` of the step", "s"),
    ("keyframe_publish_s", "CLI: keyframe publish", "s"),
    ("relay_has_keyframe_s", "CLI: keyframe publish's exit to the relay's head at v0", "s"),
    ("first_subscribe_s", "CLI: first `subscribe --out --once` (from the relay, once it holds v0)", "s"),
    ("step_manifest_b", "the step's manifest (GET from the origin)", "B"),
    ("step_blob_b", "the step's blobs", "B"),
    ("keyframe_manifest_b", "the keyframe's manifest", "B"),
    ("cpu_publish_s", "CPU s, `publish --base` process (user+sys)", "s"),
    ("cpu_follower_s", "CPU s, follower `subscribe --out`, during the step", "s"),
    ("cpu_relay_s", "CPU s, relay, during the step", "s"),
    ("cpu_origin_s", "CPU s, origin, during the step", "s"),
    ("ip_publish_call_s", "in-process: step `publish()` call (trainer blocked)", "s"),
    ("ip_commit_s", "in-process: step publish to committed at the origin", "s"),
    ("ip_delivery_s", "in-process: step publish to the ThreadedSubscriber's apply", "s"),
    ("ip_cpu_s", "in-process: CPU s of the one process (publisher + subscriber) for the step", "s"),
    ("ip_keyframe_commit_s", "in-process: keyframe publish to committed", "s"),
    ("ip_first_sync_s", "in-process: subscriber start to keyframe applied", "s"),
]


def _fmt(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "B":
        return f"{v / 1e6:,.2f} MB" if v >= 1e6 else f"{v / 1e3:,.1f} KB"
    return f"{v:,.2f}"


PAIRED = (("step_delivery_s", "1%-step delivered"), ("publish_base_s", "`publish --base`"),
          ("first_subscribe_s", "first subscribe"))


def _baseline(results: dict[str, dict], w: str) -> dict | None:
    """The 8 tensors' results layout ``w`` is compared with: those of its own round (``few@w``), else ``few``."""
    return results.get(f"few@{w}", results.get("few"))


def _title(w: str) -> str:
    """A results key's title: a layout's, or the 8 tensors' of a round (``few@kimi``)."""
    few, _, of = w.partition("@")
    return f"{TITLES[few]}, {TITLES[of].split()[0]}'s round" if of else TITLES[w]


def _paired_median(results: dict[str, dict], w: str, key: str) -> float | None:
    """The median of layout ``w``'s per-repetition ratios against the 8 tensors' of the same repetition (measured
    adjacent in time: a change of the machine's speed between repetitions cancels), for a row of ``PAIRED``."""
    base = _baseline(results, w)
    if key not in dict(PAIRED) or base is None:
        return None
    xs, ys = results[w].get("samples", {}).get(key, []), base.get("samples", {}).get(key, [])
    got = [x / y for x, y in zip(xs, ys) if y]
    return statistics.median(got) if got else None


def report(results: dict[str, dict], quick: bool, timeout: float, steps: int = STEPS, firsts: int = FIRSTS) -> str:
    cols = [w for w in results if w.partition("@")[0] in LAYOUTS]  # (in the order measured)
    head = [f"{_title(w)} ({results[w]['facts']['tensors']:,})" for w in cols]
    ratio_cols = [w for w in cols if w in LAYOUTS and w != "few" and _baseline(results, w) is not None]
    rounds = any("@" in w for w in cols)
    lines = [
        "## Seed-scale tensor counts: the same bytes as 8, ~70k and ~140k tensors (issue 22)",
        "",
        "One state of the Kimi-K2 layout's elements (bf16, narrow dims: hidden 64, expert intermediate 32; real HF "
        "names) in three layouts, a ~1%-changed AdamW-like step (one ULP each), through the CLI: `publish` -> origin "
        "-> one relay -> an already-running `subscribe --out` (follow mode), every command its own process, HMAC-signed "
        "manifests, `--no-fsync` stores; then the in-process `Publisher` and a `ThreadedSubscriber` (dict of tensors, "
        "auto apply) on the same states and servers. Each layout has a header cache of its own, empty at its start "
        "(`deltasync/headercache.py`: the keyframe publish parses the checkpoint's header and keeps it, the step's "
        "publish reads it back, as a trainer's later checkpoints do). "
        + ("Each large layout is measured in a round of its own beside the 8 tensors (only those two layouts' servers, "
           "files and followers on this machine, the round's before removed: on the VMs this was built on, memory "
           "another layout holds slowed the steps that touch more fresh pages), and each is compared with its round's "
           "8 tensors. " if rounds else "Every layout's servers, files and follower are up together. ")
        + f"The repeated rows are measured interleaved, layout after layout (the order reversed each "
        f"time): {WARM_FIRSTS} unmeasured and {firsts} measured first subscribes, then {WARM_STEPS} unmeasured and "
        f"{steps} measured steps (base -> step, "
        "step -> base, ...) per layout, each "
        "with every process of the round idle before its clock starts; those rows (marked *) are the medians of "
        "their repetitions, so that a change of this machine's speed during the run falls on every layout alike; "
        "their ratios are the medians' ratio and, *paired*, the median of each repetition's ratio (a layout's "
        "repetition against the 8 tensors' of the same repetition, adjacent in time). "
        "The keyframe and in-process rows are one run each"
        + (" (quick mode: 8 tensors and the Kimi layout only)" if quick else "") + ". Seconds unless marked; "
        f"ratios are layout / 8 tensors. Timeout per command or wait: {timeout:.0f} s.",
        "",
        "| metric | " + " | ".join(head) + "".join(f" | {TITLES[w].split()[0]} / 8" for w in ratio_cols) + " |",
        "|---|" + "---|" * (len(cols) + len(ratio_cols)),
    ]
    for key, label, kind in ROWS:
        vals = [results[w].get(key) for w in cols]
        if all(v is None for v in vals) and not any(key in results[w].get("timed_out", ()) for w in cols):
            continue
        cells = [f"> {timeout:.0f} (timed out)" if key in results[w].get("timed_out", ())
                 else _fmt(v, kind) if v is not None or not results[w]["error"] else "failed" for v, w in zip(vals, cols)]
        for w in ratio_cols:
            v, few = results[w].get(key), _baseline(results, w).get(key)
            paired = _paired_median(results, w, key)
            cells.append((f"{v / few:,.1f}x" if v is not None and few else "-")
                         + (f" (paired {paired:.2f}x)" if paired is not None else ""))
        star = "*" if any(key in results[w].get("samples", {}) for w in cols) else ""
        lines.append(f"| {label}{star} | " + " | ".join(cells) + " |")
    lines.append("")
    for w in ratio_cols:  # each repetition's ratio against the 8 tensors' of the same repetition (adjacent in time)
        got = []
        for key, label in PAIRED:
            xs, ys = results[w].get("samples", {}).get(key, []), _baseline(results, w).get("samples", {}).get(key, [])
            if xs and ys:
                got.append(f"{label} " + " ".join(f"{x / y:.2f}x" for x, y in zip(xs, ys)))
        if got:
            lines.append(f"- {_title(w)} / 8 tensors, repetition by repetition: " + "; ".join(got))
    for w in cols:
        sm = results[w].get("samples", {})
        if "step_delivery_s" in sm:
            lines.append(f"- {_title(w)}, every repetition (s): step delivered "
                         + " ".join(f"{x:.2f}" for x in sm["step_delivery_s"]) + "; `publish --base` "
                         + " ".join(f"{x:.2f}" for x in sm.get("publish_base_s", ())) + "; first subscribe "
                         + " ".join(f"{x:.2f}" for x in sm.get("first_subscribe_s", ())))
    for w in cols:
        f = results[w]["facts"]
        scales = (f"; {f['scales']:,} `weight_scale_inv` tensors as float32 (their bf16 values widened)"
                  if f["scales"] else "")
        lines.append(f"- {_title(w)}: {f['tensors']:,} tensors, {f['bytes'] / 1e6:,.1f} MB{scales}; "
                     f"{f['changed_words']:,} words changed in the step ({100 * f['changed_words'] / f['elements']:.2f}%); "
                     f"files on {results[w]['dir']} (states written in {f['write_s']:.1f} s); 1-min load average "
                     f"{results[w]['load']:.1f} at the start, {results[w].get('load_end', float('nan')):.1f} at the end "
                     f"({os.cpu_count()} cores)")
    if any(not str(results[w]["dir"]).startswith("/dev/shm") for w in cols):
        lines.append("- **Not on tmpfs** (/dev/shm lacked the room): a `subscribe --out` commit's `msync` writes back every "
                     "page the step dirtied (nearly all 288 MB) before it moves the header, 0.3-1 s in every layout, "
                     "which the step-delivery rows carry and their ratios understate")
    for w in cols:
        if results[w]["error"]:
            lines.append(f"- **{_title(w)} FAILED**: " + results[w]["error"].splitlines()[0])
            lines += ["", "```", results[w]["error"][-2500:], "```"]
    lines.append("")
    return "\n".join(lines)


def run(quick: bool = False, layouts: list[str] | None = None, *, timeout: float = STEP_TIMEOUT,
        kimi_kwargs: dict | None = None, steps: int = STEPS, firsts: int = FIRSTS, rounds: bool = True) -> str:
    layouts = layouts or (["few", "kimi"] if quick else list(LAYOUTS))

    def say(text: str) -> None:
        print(f"  seedscale: {text}", file=sys.stderr, flush=True)

    # warm-up, not reported: the first processes pay cold page cache (imports, numba's cache) and the first layout
    # measured would carry it (8 tensors' first subscribe took 5.4 s cold, 1.6-2.4 s after)
    say("warm-up (a small Kimi layout)")
    warm = _measure(["kimi"], max(timeout, 120.0), {"layers": 2, "experts": 2}, steps=1, firsts=1)
    if warm["kimi"]["error"]:
        raise RuntimeError(f"seedscale warm-up failed: {warm['kimi']['error']}")
    t0 = time.perf_counter()
    big = [w for w in layouts if w != "few"]
    if rounds and "few" in layouts and len(big) > 1:  # a round per large layout, beside the 8 tensors
        results = {}
        for w in big:
            say(f"round: 8 tensors and {TITLES[w]}")
            got = _measure(["few", w], timeout, kimi_kwargs or {}, steps, firsts, say)
            results[f"few@{w}"], results[w] = got["few"], got[w]
    else:
        results = _measure(layouts, timeout, kimi_kwargs or {}, steps, firsts, say)
    say(f"done in {time.perf_counter() - t0:.0f} s")
    run.last_failed = [w for w in results if results[w]["error"]]
    return report(results, quick, timeout, steps, firsts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="8 tensors and the Kimi layout only")
    ap.add_argument("--layouts", help=f"comma-separated, of {','.join(LAYOUTS)} (default: all; --quick: few,kimi)")
    ap.add_argument("--timeout", type=float, default=STEP_TIMEOUT, help="seconds per command or wait")
    ap.add_argument("--experts", type=int, help=argparse.SUPPRESS)  # a smaller Kimi layout, for a smoke run
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=STEPS, help="steps per layout, interleaved (default %(default)s)")
    ap.add_argument("--firsts", type=int, default=FIRSTS,
                    help="first subscribes per layout, interleaved (default %(default)s)")
    ap.add_argument("--together", action="store_true",
                    help="every layout up at once, one baseline (default: a round per large layout beside the 8 tensors)")
    ap.add_argument("--out", help="also write the section to this file")
    args = ap.parse_args()
    if args.steps < 1 or args.firsts < 1:
        ap.error("--steps and --firsts must be at least 1")
    layouts = args.layouts.split(",") if args.layouts else None
    for w in layouts or ():
        if w not in LAYOUTS:
            ap.error(f"unknown layout {w!r}; expected some of {','.join(LAYOUTS)}")
    kw = {k: v for k, v in (("experts", args.experts), ("layers", args.layers)) if v is not None}
    text = run(args.quick, layouts, timeout=args.timeout, kimi_kwargs=kw, steps=args.steps, firsts=args.firsts,
               rounds=not args.together)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if run.last_failed else 0


if __name__ == "__main__":
    sys.exit(main())
