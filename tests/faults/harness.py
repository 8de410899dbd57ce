"""The fault campaign's harness: real ``deltasync`` programs on loopback, and the checks after each fault.

Every server and subscriber is a ``deltasync`` subcommand in its own process, started through
the standalone entry points the ``deltasync`` console script dispatches to
(``python -m deltasync.server.cli origin|relay``, ``python -m deltasync.client.cli subscribe|publish``:
the same argument parsers and code; the server's entry does not load torch, which keeps a
restart at about a second of CPU on this 2-core machine). Publishes go through the in-process
``Publisher`` (the library a trainer embeds) or the ``publish`` command where the scenario is
about a publish being cut short. Subscribers are either *followers* (``subscribe`` in follow
mode, started once per scenario and checked after every repetition by watching their file
reach the goal) or bounded runs (``--until``/``--once``, waited for). A :class:`Ledger` records every state offered
for each version and which versions were acknowledged (``Publisher`` result returned, or
``publish`` exited 0). After a scenario, :meth:`Env.verdict` checks:

- **wrong**: a subscriber's file holds a version whose tensors are not bit-exactly a state
  offered for that version (compared through integer views);
- **lost**: an acknowledged version the origin no longer serves (its newest ``RETENTION``
  acknowledged versions must be there, with the acknowledged state fingerprint), or a head
  older than the newest acknowledged version;
- **hangs**: a process that outlived its bound (its own ``--timeout`` plus a grace for start and
  exit) or a publish that did not answer in its bound;
- a subscriber that did not reach its goal must have exited non-zero with a one-line error
  (no traceback): "stopped with a clear error".
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import resource
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltasync.testing.trace import ModelShape, RLTrace

KEY = bytes(range(7, 39))  # the stream's signing key (today: HMAC; see signing_args)
TOKEN = "fault-campaign-token-0123456789"
SHAPE = ModelShape(vocab=128, hidden=32, layers=1, ffn=64)  # ~20k parameters: faults, not bandwidth
RETENTION = 16
FOLLOW_BOUND = 60.0  # seconds a follower may take to reach a repetition's last version
GRACE = 15.0  # seconds a process may take beyond its own --timeout to start and exit
# Failover limits (the programs' own flags): a client asks its next --from after 0.5 s without an
# answer (default 2), a relay drops a parent that sends no status line within 5 s (default 10) and
# hedges manifest reads after 0.5 s. The clients keep the default 10 s time-to-first-byte: on the
# shared cores a healthy, CPU-starved origin can take over 3 s to answer (a 3 s limit made every
# source "time out" and added the 5-10 s cool-downs to a converge time: relay-disk-full, one run).
CLIENT_LIMITS = ["--hedge-after", "0.5"]
RELAY_LIMITS = ["--ttfb-timeout", "5", "--hedge-after", "0.5"]
_LISTEN = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
SERVER = [sys.executable, "-m", "deltasync.server.cli"]
CLIENT = [sys.executable, "-m", "deltasync.client.cli"]
# Client commands (subscribe, publish) are forked from a fork server that has imported
# deltasync.client.cli (torch: ~3 CPU-s and 5-10 s wall per start on the shared cores) once; each
# child is still its own process running the command's own main() with its own argv, descriptors,
# signals and exit status. FAULTS_FORK=0 starts them with ``python -m`` instead.
FORK = os.environ.get("FAULTS_FORK", "1") != "0"
_FORK_CTX: multiprocessing.context.BaseContext | None = None


def _fork_ctx():
    global _FORK_CTX
    if _FORK_CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        # the CLI module imports each command's modules lazily: preload what subscribe and publish run
        ctx.set_forkserver_preload(["deltasync.client.cli", "deltasync.client.subscriber", "deltasync.client.filetarget",
                                    "deltasync.client.publisher", "deltasync.client.filepublish", "safetensors.torch"])
        _FORK_CTX = ctx
    return _FORK_CTX


def _run_client_cli(argv: list[str], log_path: str) -> None:
    """In the forked child: stdout and stderr to the log, stdin from /dev/null, then the command."""
    import signal as _signal

    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    for sig in (_signal.SIGTERM, _signal.SIGINT):
        _signal.signal(sig, _signal.SIG_DFL)
    from deltasync.client.cli import main

    sys.argv = ["deltasync", *argv]
    try:
        rc = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(rc)


class _Forked:
    """The few ``subprocess.Popen`` methods :class:`Proc` uses, over a forked ``multiprocessing.Process``."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self._p = _fork_ctx().Process(target=_run_client_cli, args=(argv, str(log_path)), daemon=False)
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(["deltasync"], timeout)
        return self._p.exitcode


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc), children first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def reap_orphans(name: str, pids: list[int], how: str) -> int:
    """Kill what a server left running after it ended (e.g. a relay's squash worker after a SIGKILL)."""
    left = 0
    for k in pids:
        try:
            os.kill(k, signal.SIGKILL)
            left += 1
        except OSError:
            pass
    if left:
        print(f"harness: {name} left {left} child process(es) running after {how}; killed them", file=sys.stderr,
              flush=True)
    return left


def raise_nofile(want: int = 8192) -> int:
    """Raise this process's descriptor limit (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = min(max(soft, want), hard) if hard != resource.RLIM_INFINITY else max(soft, want)
    if new > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return new


@dataclass(slots=True, kw_only=True)
class Proc:
    """One ``deltasync`` process with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    bound: float | None = None  # seconds it may run (None: a server, stopped by the scenario)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ended: float | None = None
    url: str = ""
    hung: bool = False
    orphans: int = 0  # child processes it left running when it ended (killed by the harness)
    _log_start: int = 0

    def start(self) -> Proc:
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            if FORK and self.argv[:len(CLIENT)] == CLIENT:
                self.proc = _Forked(self.argv[len(CLIENT):], self.log_path)
            else:
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.started = time.monotonic()
        self.ended = None
        return self

    def log(self, *, this_run: bool = True) -> str:
        with open(self.log_path, "rb") as f:
            if this_run:
                f.seek(self._log_start)
            return f.read().decode(errors="replace")

    def wait_listening(self, timeout: float = 60.0) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTEN.search(self.log())
            if m:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before listening:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{self.name} did not listen within {timeout}s:\n{self.log()[-3000:]}")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = time.monotonic()
        return rc

    def wait(self) -> int:
        """Wait up to the bound; past it the process counts as hung and is killed."""
        left = None if self.bound is None else self.bound - (time.monotonic() - self.started)
        try:
            rc = self.proc.wait(None if left is None else max(0.0, left))
        except subprocess.TimeoutExpired:
            self.hung = True
            self.kill()
            rc = self.proc.returncode
        self.poll()
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kids = descendants(self.proc.pid)
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.orphans += reap_orphans(self.name, kids, "SIGKILL")
        if self.proc is not None:
            self.poll()

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            kids = descendants(self.proc.pid)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.hung = True  # SIGTERM must finish in bounded time
                self.kill()
            time.sleep(0.2)
            self.orphans += reap_orphans(self.name, [k for k in kids if os.path.exists(f"/proc/{k}")], "SIGTERM")
        self.poll()
        return self.proc.returncode


@dataclass(slots=True, kw_only=True)
class Follower:
    """A long-running ``subscribe`` in follow mode and the file it keeps."""

    name: str
    model: str
    out: Path
    proc: Proc


@dataclass(slots=True)
class Ledger:
    """What was offered and what was acknowledged, per model."""

    offered: dict[str, dict[int, list[dict[str, torch.Tensor]]]] = field(default_factory=dict)
    acked: dict[str, dict[int, str]] = field(default_factory=dict)  # model -> version -> state_fp
    touched: set[str] = field(default_factory=set)  # models acknowledged since the last verdict

    def offer(self, model: str, version: int, state: dict[str, torch.Tensor]) -> None:
        self.offered.setdefault(model, {}).setdefault(version, []).append({n: t.clone() for n, t in state.items()})

    def ack(self, model: str, version: int, state_fp: str) -> None:
        self.acked.setdefault(model, {})[version] = state_fp
        self.touched.add(model)


@dataclass(slots=True, kw_only=True)
class Verdict:
    lost: int = 0
    wrong: int = 0
    hangs: int = 0
    unclear: int = 0  # subscribers that stopped short of their goal without a clear error
    stopped: int = 0  # subscribers that stopped short with a clear error (allowed)
    converge_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == self.wrong == self.hangs == self.unclear == 0


def exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    def words(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(-1).view(torch.uint8)
    return set(a) == set(b) and all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
                                    and torch.equal(words(a[n]), words(b[n])) for n in a)


def http_get(url: str, timeout: float = 10.0, token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class Env:
    """One scenario's world: a directory, the key and token files, the processes it started."""

    def __init__(self, root: Path, *, seed: int = 0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.seed = seed
        self.key_file = self.root / "key"
        self.key_file.write_text(KEY.hex() + "\n")
        self.token_file = self.root / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.procs: list[Proc] = []
        self.subs: list[tuple[Proc, str, Path, int]] = []
        self.expected: list[tuple[Follower, int]] = []
        self.ledger = Ledger()
        self.publish_hangs = 0
        self.notes: list[str] = []
        self.setup_verdicts: list[Verdict] = []
        self.read_token: str | None = None  # what the harness's own reads send (a scenario whose servers want one)
        self.refused = 0  # reads of a file caught mid-apply, refused by read_state_file (check_file)
        self._n = 0

    # -- processes ---------------------------------------------------------------------------------

    def _proc(self, name: str, args: list[str], bound: float | None = None) -> Proc:
        self._n += 1
        entry = SERVER if args[0] in ("origin", "relay") else CLIENT
        p = Proc(name=name, argv=[*entry, *args], log_path=self.root / f"{name}.log", bound=bound)
        self.procs.append(p)
        return p

    def signing_args(self) -> list[str]:
        return ["--key-file", str(self.key_file)]

    def server_args(self, port: int, extra: list[str]) -> list[str]:
        return ["--listen", f"127.0.0.1:{port}", "--retention", str(RETENTION), "--heartbeat", "1",
                "--read-timeout", "5", "--log-level", "INFO", *self.signing_args(), *extra]

    def origin(self, name: str = "origin", *, port: int = 0, store: Path | None = None,
               extra: list[str] | None = None) -> Proc:
        store = store or self.root / name
        args = ["origin", *self.server_args(port, extra or []), "--store", str(store), "--token-file", str(self.token_file)]
        return self._proc(name, args).start().wait_listening()

    def relay(self, name: str, parents: list[str], *, port: int = 0, cache: Path | None = None,
              extra: list[str] | None = None) -> Proc:
        args = ["relay", *self.server_args(port, [*RELAY_LIMITS, *(extra or []), "--no-fsync"]), "--cache", str(cache or self.root / name)]
        for p in parents:
            args += ["--parent", p]
        return self._proc(name, args).start().wait_listening()

    def restart(self, server: Proc) -> Proc:
        """The same command again on the same port and store (after a kill or a stop)."""
        if server.proc.poll() is None:
            server.stop()
        argv = list(server.argv)
        i = argv.index("--listen")
        argv[i + 1] = f"127.0.0.1:{server.port}"
        p = Proc(name=server.name, argv=argv, log_path=server.log_path)
        self.procs.append(p)
        deadline = time.monotonic() + 30
        while True:  # the old socket may linger a moment
            p.start()
            try:
                return p.wait_listening()
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def subscribe(self, model: str, sources: list[str], *, until: int | None = None, once: bool = False,
                  timeout: float = 60.0, name: str | None = None, out: Path | None = None,
                  poll: float = 2.0, goal: int | None = None, extra: list[str] | None = None,
                  watch: bool = True) -> Proc:
        """``deltasync subscribe`` (started, not waited for); checked by :meth:`verdict` (``watch=False``: by the
        scenario itself). ``goal``: the version a ``--once`` run must end at or past (default: ``until``, else any)."""
        name = name or f"sub{len(self.subs)}-{model}"
        out = out or self.root / f"{name}.safetensors"
        args = ["subscribe", "--model", model, "--out", str(out), "--timeout", str(timeout), "--poll", str(poll),
                *CLIENT_LIMITS, *self.signing_args(), *(extra or [])]
        for s in sources:
            args += ["--from", s]
        if once:
            args.append("--once")
        elif until is not None:
            args += ["--until", str(until)]
        p = self._proc(name, args, bound=timeout + GRACE).start()
        goal = goal if goal is not None else until
        if watch:
            self.subs.append((p, model, out, -1 if goal is None else goal))
        return p

    def follow(self, model: str, sources: list[str], *, name: str | None = None, out: Path | None = None,
               poll: float = 2.0, extra: list[str] | None = None) -> Follower:
        """``deltasync subscribe`` in follow mode (no goal): started now, checked by :meth:`expect`."""
        name = name or f"follower{len(self.procs)}-{model}"
        out = out or self.root / f"{name}.safetensors"
        args = ["subscribe", "--model", model, "--out", str(out), "--timeout", "3600", "--poll", str(poll),
                *CLIENT_LIMITS, *self.signing_args(), *(extra or [])]
        for s in sources:
            args += ["--from", s]
        f = Follower(name=name, model=model, out=out, proc=self._proc(name, args).start())
        return f

    def expect(self, follower: Follower, goal: int) -> None:
        """At the next verdict, ``follower``'s file must reach ``goal`` within FOLLOW_BOUND seconds."""
        self.expected.append((follower, goal))

    def restart_follower(self, f: Follower) -> None:
        f.proc.kill()
        argv = f.proc.argv
        f.proc = Proc(name=f.name, argv=argv, log_path=f.proc.log_path)
        self.procs.append(f.proc)
        f.proc.start()

    def publish_cli(self, model: str, state: dict[str, torch.Tensor], *, step: int | None = None,
                    origin: str, timeout: float = 60.0) -> Proc:
        """``deltasync publish`` of one state file (started, not waited for)."""
        from deltasync.tensorfile import write_state_file

        self._n += 1
        path = self.root / f"state-{model}-{self._n}.safetensors"
        write_state_file(path, state, {})
        args = ["publish", "--origin", origin, "--model", model, "--token-file", str(self.token_file),
                "--timeout", str(timeout), *self.signing_args(), str(path)]
        if step is not None:
            args += ["--step", str(step)]
        return self._proc(f"publish-{model}-{self._n}", args, bound=timeout + GRACE).start()

    def publisher(self, origin: str, model: str, **kw):
        from deltasync.client.publisher import Publisher
        return Publisher(origin, model, TOKEN, KEY, keyframe_every=kw.pop("keyframe_every", 0), **kw)

    def publish(self, pub, step: int, state: dict[str, torch.Tensor], *, bound: float = 60.0):
        """Publish through the library; acknowledged when the result comes back within ``bound``."""
        import concurrent.futures

        self.ledger.offer(pub.model, step, state)
        t0 = time.monotonic()
        try:
            res = pub.publish(step, state).result(bound)
        except concurrent.futures.TimeoutError:
            self.publish_hangs += 1
            self.notes.append(f"publish {pub.model} v{step} did not answer in {bound}s")
            return None
        self.ledger.ack(pub.model, step, res.manifest.state_fp)
        assert time.monotonic() - t0 <= bound + 1
        return res

    def trace(self, seed: int) -> RLTrace:
        return RLTrace(SHAPE, lr=3e-4, seed=seed)

    def close(self) -> None:
        for p in reversed(self.procs):
            try:
                p.stop(10) if p.bound is None else p.kill()
            except Exception:  # keep stopping the others
                p.kill()

    # -- checks ------------------------------------------------------------------------------------

    def check_origin(self, origin: str, model: str) -> int:
        """Acknowledged versions the origin lost (its newest RETENTION acknowledged ones must be served)."""
        acked = self.ledger.acked.get(model, {})
        if not acked:
            return 0
        lost = 0
        status, headers, _ = http_get(f"{origin}/v1/models/{model}/head", token=self.read_token)
        head = int(headers.get("X-Deltasync-Version", -1)) if status == 200 else -1
        if head < max(acked):
            self.notes.append(f"{model}: origin head v{head} is older than acknowledged v{max(acked)}")
            lost += 1
        for v in sorted(acked)[-RETENTION:]:
            status, _, body = http_get(f"{origin}/v1/models/{model}/versions/{v}", token=self.read_token)
            if status != 200 or json.loads(body).get("state_fp") != acked[v]:
                self.notes.append(f"{model}: acknowledged v{v} not served by the origin (HTTP {status})")
                lost += 1
        return lost

    def check_file(self, model: str, out: Path) -> tuple[int | None, bool]:
        """(version in the file, whether it is bit-exactly a state offered for that version). Read as deltasync's
        documented readers read it (``read_state_file``): a file whose header says a delta is being written into
        it (a subscriber caught or killed mid-apply) is refused, which counts as no version (None) and not wrong
        (``refused`` counts them)."""
        import safetensors

        from deltasync.errors import IntegrityError
        from deltasync.tensorfile import read_state_file

        if not out.exists():
            return None, True
        with safetensors.safe_open(str(out), framework="pt") as f:
            meta = f.metadata() or {}
        v = int(meta.get("deltasync.version", -1))
        try:
            got = read_state_file(out)
        except IntegrityError as e:
            if "patching" not in str(e):
                raise
            self.refused += 1
            return None, True
        return v, any(exact(got, s) for s in self.ledger.offered.get(model, {}).get(v, []))

    def verdict(self, *, origin: str | None, fault_cleared: float | None = None,
                bound: float = FOLLOW_BOUND) -> Verdict:
        """Wait for every subscriber (up to its bound) and check everything the module docstring lists."""
        vd = Verdict(hangs=self.publish_hangs, notes=list(self.notes))
        ends = []
        for p, model, out, goal in self.subs:
            rc = p.wait()
            v, ok = self.check_file(model, out)
            if p.hung:
                vd.hangs += 1
                vd.notes.append(f"{p.name} outlived its bound of {p.bound:.0f}s (at v{v})")
            if not ok:
                vd.wrong += 1
                vd.notes.append(f"{p.name}: file holds v{v} that is not a published state")
            reached = rc == 0 and v is not None and (goal < 0 or v >= goal)
            if reached:
                ends.append(p.ended)
            elif not p.hung:
                log = p.log()
                clear = rc != 0 and "Traceback" not in log and "error" in log.lower()
                if clear:
                    vd.stopped += 1
                    vd.notes.append(f"{p.name} stopped with rc {rc} at v{v}: {_last_line(log)}")
                else:
                    vd.unclear += 1
                    vd.notes.append(f"{p.name} stopped (rc {rc}, v{v}) without a clear error:\n{log[-2000:]}")
        deadline = time.monotonic() + bound
        for f, goal in self.expected:
            reached, v, ok = None, None, True
            while True:
                try:
                    v, ok = self.check_file(f.model, f.out)
                except Exception:  # replaced while we read it: look again
                    v, ok = None, True
                if v is not None and v >= goal:
                    reached = time.monotonic()
                    break
                if f.proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if not ok:
                vd.wrong += 1
                vd.notes.append(f"{f.name}: file holds v{v} that is not a published state")
            if reached is not None:
                ends.append(reached)
                continue
            rc = f.proc.poll()
            log = f.proc.log()
            if rc is None:
                vd.hangs += 1
                vd.notes.append(f"{f.name} still at v{v} after {bound:.0f}s (wanted v{goal}): "
                                f"{_last_line(log)}")
            elif "Traceback" not in log and "error" in log.lower():
                vd.stopped += 1
                vd.notes.append(f"{f.name} stopped with rc {rc} at v{v}: {_last_line(log)}")
            else:
                vd.unclear += 1
                vd.notes.append(f"{f.name} stopped (rc {rc}, v{v}) without a clear error:\n{log[-2000:]}")
            self.restart_follower(f)  # the next repetition starts from a running follower again
        self.expected.clear()
        if origin is not None:
            for model in sorted(self.ledger.touched):
                vd.lost += self.check_origin(origin, model)
        self.ledger.touched.clear()
        if ends and fault_cleared is not None:
            vd.converge_s = max(0.0, max(ends) - fault_cleared)
        self.subs.clear()
        self.notes.clear()
        self.publish_hangs = 0
        return vd


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""
