"""The fault campaign's scenarios (issue 9). Each one sets up real servers once, then runs repetitions.

A scenario is a class with ``setup(env)`` (servers, proxies; once) and ``rep(env, i)`` (one
repetition on a fresh model ``m<i>``; returns the harness's :class:`Verdict`). ``cleared``,
the moment convergence is timed from, is when the fault ends (the killed server is back, the
proxy is faithful again, the disk was corrupted and nothing more will be), or — for faults that
stay (a stalled or lying parent next to a good one, a full disk) — when the last version was
acknowledged. Scenarios needing root (tmpfs) raise :class:`Skip` from ``setup``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from deltasync.testing.trace import RLTrace, shape_for_params

from .harness import Env, Verdict, raise_nofile
from .proxy import FaultProxy


class Skip(Exception):
    """The scenario cannot run here (the reason is the message)."""


def wait_until(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_file(path: Path, timeout: float = 60.0) -> None:
    wait_until(path.exists, timeout, f"{path.name} to be written")


def blob_path(cache: Path, blob_id: str) -> Path:
    return cache / "blobs" / blob_id[:2] / blob_id


def manifest_path(cache: Path, model: str, version: int) -> Path:
    return cache / "models" / model / f"{version:020d}.json"


def relay_has(env: Env, relay_url: str, model: str, version: int, timeout: float = 30.0) -> None:
    from .harness import http_get

    def ok():
        status, headers, _ = http_get(f"{relay_url}/v1/models/{model}/head", timeout=5)
        return status == 200 and int(headers.get("X-Deltasync-Version", -1)) >= version
    wait_until(ok, timeout, f"{relay_url} to announce {model} v{version}", 0.1)


def ready(env: Env, *followers) -> None:
    """Setup waits until every follower holds the first version (process start is not a fault)."""
    for f in followers:
        env.expect(f, 0)
    vd = env.verdict(origin=None, bound=180.0)  # includes the processes' start (torch import)
    env.setup_verdicts.append(vd)  # counted in the scenario's row (a follower that never syncs is a finding)


class Scenario:
    name = ""
    what = ""
    needs_root = False
    known: str | None = None  # a finding other branches fix: xfail(strict=False) in the short form

    def setup(self, env: Env) -> None:
        raise NotImplementedError

    def rep(self, env: Env, i: int) -> Verdict:
        raise NotImplementedError

    def teardown(self, env: Env) -> None:
        env.close()


def _states(env: Env, i: int, n: int, trace: RLTrace | None = None) -> list[dict]:
    trace = trace or env.trace(seed=1000 + i)
    return [trace.step() for _ in range(n)]


def _mount_tmpfs(path: Path, size: str = "8m") -> None:
    if os.geteuid() != 0:
        raise Skip("needs root to mount a tmpfs (mount -t tmpfs -o size=8m)")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        raise Skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


class Stream(Scenario):
    """One model per scenario: a publisher and a trace that live across repetitions."""

    model = "m"

    def open_stream(self, env: Env, origin: str, *, seed: int = 0) -> None:
        self.pub = env.publisher(origin, self.model)
        self.trace = env.trace(seed=seed)
        self.v = 0

    def push(self, env: Env, n: int = 1, *, gap: float = 0.0) -> int:
        """Publish ``n`` more versions through the library; the last version number."""
        for _ in range(n):
            env.publish(self.pub, self.v, self.trace.step())
            self.v += 1
            if gap:
                time.sleep(gap)
        return self.v - 1

    def teardown(self, env):
        try:
            self.pub.close(30)
        finally:
            env.close()


# -- 1. a relay SIGKILLed mid-stream, then restarted ----------------------------------------------------------

class RelayKilled(Stream):
    name = "relay-sigkill-restart"
    what = "relay SIGKILLed while a version streams through it, restarted on the same port and cache"

    def setup(self, env):
        self.o = env.origin()
        self.r = env.relay("relay", [self.o.url])
        self.open_stream(env, self.o.url)
        self.push(env)
        self.f = env.follow(self.model, [self.r.url])
        ready(env, self.f)

    def rep(self, env, i):
        self.push(env)
        time.sleep(random.Random(i).uniform(0.0, 0.5))
        self.push(env)
        time.sleep(random.Random(i + 99).uniform(0.0, 0.05))
        self.r.kill()  # mid-stream: the relay is prefetching / serving the version just published
        self.push(env)
        self.r = env.restart(self.r)
        cleared = time.monotonic()
        env.expect(self.f, self.push(env))
        return env.verdict(origin=self.o.url, fault_cleared=cleared)


# -- 2-4. a parent that stalls, truncates bodies or lies about Content-Length, beside a good one ---------------

class BadParent(Stream):
    mode = "stall"

    def setup(self, env):
        self.o = env.origin()
        self.p = FaultProxy(self.o.port, mode=self.mode, seed=env.seed)
        self.r = env.relay("relay", [self.p.url, self.o.url])
        self.open_stream(env, self.o.url)
        self.push(env)
        self.f = env.follow(self.model, [self.r.url])
        ready(env, self.f)

    def rep(self, env, i):
        if self.mode == "length":
            self.p.delta = 9 if i % 2 else -9
        self.push(env, gap=0.2)
        last = self.push(env)
        cleared = time.monotonic()
        env.expect(self.f, last)
        return env.verdict(origin=self.o.url, fault_cleared=cleared)

    def teardown(self, env):
        super().teardown(env)
        self.p.close()


class ParentStalled(BadParent):
    name = "parent-stalled"
    what = "first parent accepts TCP and never answers; the second is good"
    mode = "stall"


class ParentTruncated(BadParent):
    name = "parent-truncated-body"
    what = "first parent cuts every connection after 1,500 bytes; the second is good"
    mode = "truncate"


class ParentWrongLength(BadParent):
    name = "parent-wrong-content-length"
    what = "first parent announces Content-Length ±9 of the body (alternating per rep); the second is good"
    mode = "length"


# -- 5. bit flips in transit between tiers ---------------------------------------------------------------------

class BitFlips(Stream):
    name = "bit-flips-in-transit"
    what = ("a proxy flips one bit in 30% of the chunks origin→relay (the relay's only parent) and "
            "relay→subscriber (that subscriber also lists the origin); faithful again after 2 s")

    def setup(self, env):
        self.o = env.origin()
        self.up = FaultProxy(self.o.port, mode="pass", seed=env.seed)
        self.r = env.relay("relay", [self.up.url])
        self.down = FaultProxy(self.r.port, mode="pass", seed=env.seed + 1)
        self.open_stream(env, self.o.url)
        self.push(env)
        self.f1 = env.follow(self.model, [self.r.url])
        self.f2 = env.follow(self.model, [self.down.url, self.o.url])
        ready(env, self.f1, self.f2)

    def rep(self, env, i):
        self.up.rng.seed(i)
        self.down.rng.seed(i + 7)
        self.up.set_mode("flip")
        self.down.set_mode("flip")
        self.push(env, 3, gap=0.3)
        time.sleep(2.0)
        self.up.set_mode("pass")
        self.down.set_mode("pass")
        cleared = time.monotonic()
        last = self.push(env)
        env.expect(self.f1, last)
        env.expect(self.f2, last)
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        vd.notes.append(f"flipped {self.up.flipped}+{self.down.flipped} chunks so far")
        return vd

    def teardown(self, env):
        super().teardown(env)
        self.up.close()
        self.down.close()


# -- 6-8. a relay's disk: corrupted blob, corrupted manifests, a head with a bad signature -----------------------

class RelayDisk(Stream):
    """Even repetitions: a fresh ``subscribe --once`` (relay first, then origin) after the corruption.
    Odd ones: a follower stopped before the versions are published and resumed after the corruption."""

    def setup(self, env):
        self.o = env.origin()
        self.r = env.relay("relay", [self.o.url])
        self.cache = env.root / "relay"
        self.open_stream(env, self.o.url)
        self.push(env)
        self.f = env.follow(self.model, [self.r.url, self.o.url])
        ready(env, self.f)

    def corrupt(self, env, versions: list[int]) -> None:
        raise NotImplementedError

    def rep(self, env, i):
        first = self.v
        if i % 2:
            env.expect(self.f, first - 1)
            _merge_into = env.verdict(origin=None)
            self.f.proc.stop()
        else:
            _merge_into = None
        last = self.push(env, 3)
        relay_has(env, self.r.url, self.model, last)
        self.corrupt(env, list(range(first, last + 1)))
        cleared = time.monotonic()
        if i % 2:
            env.restart_follower(self.f)
            env.expect(self.f, last)
        else:
            env.subscribe(self.model, [self.r.url, self.o.url], once=True, timeout=60)
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        if _merge_into is not None:
            _merge(vd, _merge_into)
        return vd


class RelayBlobCorrupt(RelayDisk):
    name = "relay-disk-blob-corrupt"
    what = "one bit flipped in every cached blob of three new versions on the relay's disk"

    def corrupt(self, env, versions):
        from .harness import http_get
        for v in versions:
            _, _, body = http_get(f"{self.o.url}/v1/models/{self.model}/versions/{v}")
            for ref in json.loads(body)["blobs"]:
                f = blob_path(self.cache, ref["id"])
                wait_until(lambda: f.exists() and f.stat().st_size == ref["size"], 30, f"relay to cache {ref['id']}")
                data = bytearray(f.read_bytes())
                data[len(data) // 2] ^= 0x10
                f.write_bytes(bytes(data))


class RelayManifestCorrupt(RelayDisk):
    name = "relay-disk-manifest-corrupt"
    what = "the relay's cached manifests of three new versions overwritten with garbage on its disk"

    def corrupt(self, env, versions):
        for v in versions:
            f = manifest_path(self.cache, self.model, v)
            wait_until(f.exists, 30, f"relay to store {self.model} v{v}")
            f.write_bytes(b"<html>garbage{" + f.read_bytes()[:40])


class RelayHeadBadSignature(RelayDisk):
    name = "relay-head-bad-signature"
    what = "the head manifest in the relay's cache keeps its JSON but gets a wrong signature"

    def corrupt(self, env, versions):
        f = manifest_path(self.cache, self.model, versions[-1])
        wait_until(f.exists, 30, f"relay to store {self.model} v{versions[-1]}")
        obj = json.loads(f.read_bytes())
        sig = obj["signature"]
        obj["signature"] = sig[:-2] + ("00" if sig[-2:] != "00" else "11")
        f.write_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


# -- 9-10. the origin killed between blob uploads and commit, and mid-write --------------------------------------

class OriginKilled(Scenario):
    """``deltasync publish`` through a proxy that SIGKILLs the origin when it sees a given request;
    the origin is restarted on its store and the version published again (``publish`` exit 0 = acknowledged)."""

    model = "m"

    def setup(self, env):
        self.o = env.origin()
        self.armed: tuple[bytes, float] | None = None
        self.killed = threading.Event()
        self.p = FaultProxy(self.o.port, on_request=self._seen)
        self.trace = env.trace(seed=2000)
        self.states: dict[int, dict] = {}
        with env.publisher(self.o.url, self.model) as pub:
            self.states[0] = self.trace.step()
            env.publish(pub, 0, self.states[0])
        self.v = 1
        self.f = env.follow(self.model, [self.o.url])
        ready(env, self.f)

    def _seen(self, method: bytes, path: bytes) -> None:
        armed = self.armed
        if armed is None or method != b"PUT" or armed[0] not in path:
            return
        self.armed = None
        delay = armed[1]

        def kill():
            self.o.kill()
            self.killed.set()
        if delay <= 0:
            kill()
        else:
            threading.Timer(delay, kill).start()

    def _publish(self, env, v: int, origin: str, notes: list[str], *, must: bool,
                 acked: list[int] | None = None) -> bool:
        """``acked``: record an exit 0 there (the origin may be being killed: its fingerprint is read after the restart)."""
        env.ledger.offer(self.model, v, self.states[v])
        p = env.publish_cli(self.model, self.states[v], step=v, origin=origin, timeout=30)
        rc = p.wait()
        if p.hung:
            env.publish_hangs += 1
        if rc == 0:
            if acked is not None:
                acked.append(v)
            else:
                env.ledger.ack(self.model, v, _fp_of(env, self.o.url, self.model, v))
            return True
        log = p.log()
        if "Traceback" in log or "error" not in log.lower():
            notes.append(f"publish v{v} failed without a clear error:\n{log[-1500:]}")
        elif must:
            notes.append(f"publish v{v} failed on a healthy origin: {_last_line(log)}")
        return False

    def rep(self, env, i):
        from .harness import http_get
        notes: list[str] = []
        v = self.v
        self.states[v] = self.trace.step()
        self.killed.clear()
        self.armed = (self.pattern(), self.delay(i))
        acked: list[int] = []
        self._publish(env, v, self.p.url, notes, must=False, acked=acked)
        if not self.killed.wait(5):
            notes.append("the origin was not killed (the publish ended first)")
        self.armed = None
        self.o = env.restart(self.o)
        self.p.retarget(self.o.port)
        cleared = time.monotonic()
        for w in acked:  # exit 0 before the kill landed (mid-write timer): the restarted origin must serve it
            env.ledger.ack(self.model, w, _fp_of(env, self.o.url, self.model, w))
        status, headers, _ = http_get(f"{self.o.url}/v1/models/{self.model}/head")
        head = int(headers.get("X-Deltasync-Version", -1)) if status == 200 else -1
        for w in range(head + 1, v + 1):  # what is not live yet is published again, and must succeed now
            self._publish(env, w, self.o.url, notes, must=True)
        self.v = v + 1
        env.expect(self.f, v)
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        vd.unclear += sum(1 for n in notes if "failed" in n)
        vd.notes += notes
        return vd

    def pattern(self) -> bytes:
        return f"/v1/models/{self.model}/versions/".encode()

    def delay(self, i: int) -> float:
        return 0.0

    def teardown(self, env):
        env.close()
        self.p.close()


def _fp_of(env: Env, origin: str, model: str, version: int) -> str:
    from .harness import http_get
    status, _, body = http_get(f"{origin}/v1/models/{model}/versions/{version}")
    return json.loads(body)["state_fp"] if status == 200 else "?"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


class OriginKilledBeforeCommit(OriginKilled):
    name = "origin-killed-before-commit"
    what = "origin SIGKILLed after the blob uploads, as the manifest PUT arrives; restarted; publish again"


class OriginKilledMidWrite(OriginKilled):
    name = "origin-killed-mid-write"
    what = "origin SIGKILLed 0–150 ms into the first blob upload of a publish (mid-write); restarted"

    def pattern(self):
        return b"/v1/blobs/"

    def delay(self, i):
        return random.Random(i).uniform(0.0, 0.15)


# -- 11. a subscriber killed mid-apply --------------------------------------------------------------------------

class SubscriberKilled(Stream):
    name = "subscriber-killed-mid-apply"
    what = "a follower SIGKILLed at a random moment while versions arrive; its file is checked, then it resumes"

    def setup(self, env):
        self.o = env.origin()
        self.r = env.relay("relay", [self.o.url])
        self.open_stream(env, self.o.url)
        self.push(env)
        self.f = env.follow(self.model, [self.r.url, self.o.url])
        ready(env, self.f)

    def rep(self, env, i):
        rng = random.Random(i)
        self.push(env, 3, gap=rng.uniform(0.0, 0.2))
        time.sleep(rng.uniform(0.0, 0.3))
        self.f.proc.kill()
        v_file, ok = env.check_file(self.model, self.f.out)
        env.restart_follower(self.f)
        cleared = time.monotonic()
        env.expect(self.f, self.push(env))
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        if not ok:
            vd.wrong += 1
            vd.notes.append(f"after the kill the file held v{v_file}, not a published state")
        leftovers = list(self.f.out.parent.glob(f".{self.f.out.name}.*.tmp"))
        if leftovers:
            vd.notes.append(f"temp files left after resume: {leftovers}")
        return vd


# -- 12. a subscriber 50 versions behind ------------------------------------------------------------------------

class FiftyBehind(Stream):
    name = "subscriber-50-behind"
    what = "a follower stopped (SIGTERM) while 50 versions are published, then resumed from its file (through a relay)"

    def setup(self, env):
        self.o = env.origin()
        self.r = env.relay("relay", [self.o.url])
        self.open_stream(env, self.o.url)
        self.push(env)
        self.f = env.follow(self.model, [self.r.url, self.o.url])
        ready(env, self.f)

    def rep(self, env, i):
        held = self.v - 1
        env.expect(self.f, held)
        vd0 = env.verdict(origin=None)
        if self.f.proc.stop() is None or self.f.proc.hung:
            vd0.hangs += 1
        last = self.push(env, 50)
        env.restart_follower(self.f)
        cleared = time.monotonic()
        env.expect(self.f, last)
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        _merge(vd, vd0)
        return vd


def _merge(vd: Verdict, other: Verdict) -> None:
    vd.lost += other.lost
    vd.wrong += other.wrong
    vd.hangs += other.hangs
    vd.unclear += other.unclear
    vd.stopped += other.stopped
    vd.notes += other.notes


# -- 13-14. a full disk on a relay, and on the origin -----------------------------------------------------------

BIG = shape_for_params(1_000_000)  # ~2 MB of bf16 per state: four fill an 8 MB tmpfs (size is not the fault)


def big_state(seed: int) -> dict:
    """Unrelated states: every delta between two of them rewrites everything (~2 MB)."""
    return RLTrace(BIG, lr=3e-4, seed=seed).state()


class RelayDiskFull(Scenario):
    name = "relay-disk-full"
    what = "the relay's cache is an 8 MB tmpfs, filled by 2 MB versions; the follower lists relay then origin"
    needs_root = True
    model = "m"

    def setup(self, env):
        self.mnt = env.root / "relay-tmpfs"
        _mount_tmpfs(self.mnt)
        self.o = env.origin()
        self.r = env.relay("relay", [self.o.url], cache=self.mnt / "cache")
        self.pub = env.publisher(self.o.url, self.model)
        env.publish(self.pub, 0, big_state(4000))
        self.v = 1
        self.f = env.follow(self.model, [self.r.url, self.o.url])
        ready(env, self.f)

    def rep(self, env, i):
        for _ in range(2 if i else 4):
            env.publish(self.pub, self.v, big_state(4000 + self.v), bound=90)
            self.v += 1
        cleared = time.monotonic()
        env.expect(self.f, self.v - 1)
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        used = shutil.disk_usage(self.mnt)
        vd.notes.append(f"relay tmpfs {used.used / 2**20:.1f} of {used.total / 2**20:.0f} MiB used")
        return vd

    def teardown(self, env):
        try:
            self.pub.close(30)
        finally:
            env.close()
            _umount(self.mnt)


class OriginDiskFull(Scenario):
    name = "origin-disk-full"
    what = ("the origin's store is a 6 MB tmpfs; 2 MB versions until a publish is refused (a clear error, "
            "not acknowledged); a subscriber then syncs the last acknowledged version through a relay")
    needs_root = True

    def setup(self, env):
        self.mnt = env.root / "origin-tmpfs"
        _mount_tmpfs(self.mnt, "6m")  # a keyframe and a full-rewrite delta fit (about 5.7 MB), the next is refused
        self.o = env.origin(store=self.mnt / "store")
        self.r = env.relay("relay", [self.o.url])

    def rep(self, env, i):
        import concurrent.futures

        from deltasync.errors import DeltaSyncError

        model = f"m{i}"
        refused, notes = None, []
        pub = env.publisher(self.o.url, model)
        try:
            for v in range(8):
                state = big_state(5000 + 10 * i + v)
                env.ledger.offer(model, v, state)
                try:
                    res = pub.publish(v, state).result(90)
                    pub.flush(90)
                except DeltaSyncError as e:
                    refused = (v, e)
                    break
                except concurrent.futures.TimeoutError:
                    env.publish_hangs += 1
                    break
                env.ledger.ack(model, v, res.manifest.state_fp)
        finally:
            try:
                pub.close(30)
            except DeltaSyncError as e:
                refused = refused or (v, e)
        if refused is None:
            notes.append("the disk never filled")
        else:
            notes.append(f"publish v{refused[0]} refused: {type(refused[1]).__name__}: {str(refused[1])[:200]}")
        cleared = time.monotonic()
        acked = env.ledger.acked.get(model, {})
        if acked:
            env.subscribe(model, [self.r.url, self.o.url], until=max(acked), timeout=90)
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        vd.notes += notes
        # free the disk for the next repetition: the origin restarted on a fresh store
        self.o.stop()
        shutil.rmtree(self.mnt / "store", ignore_errors=True)
        self.o = env.restart(self.o)
        return vd

    def teardown(self, env):
        env.close()
        _umount(self.mnt)


# -- 15. duplicate and out-of-order publishes -------------------------------------------------------------------

class DuplicatePublishes(Stream):
    name = "duplicate-and-out-of-order-publishes"
    what = ("the head manifest PUT again (same bytes), an existing and an older version re-signed with other "
            "content, and (every 4th rep) `publish --step HEAD`: each refused with a clear error or "
            "idempotent, nothing changes")

    def setup(self, env):
        self.o = env.origin()
        self.r = env.relay("relay", [self.o.url])
        self.open_stream(env, self.o.url)
        self.push(env)
        self.f = env.follow(self.model, [self.r.url, self.o.url])
        ready(env, self.f)

    def rep(self, env, i):
        import dataclasses
        import urllib.request

        from deltasync.manifest import parse_manifest

        from .harness import KEY, TOKEN, http_get
        notes = []
        head = self.push(env, 2)
        _, _, body = http_get(f"{self.o.url}/v1/models/{self.model}/versions/{head}")
        m = parse_manifest(body)
        _, _, older = http_get(f"{self.o.url}/v1/models/{self.model}/versions/{head - 1}")
        mo = parse_manifest(older)

        def put(man_bytes: bytes, version: int, want_ok: bool, what: str) -> None:
            req = urllib.request.Request(f"{self.o.url}/v1/models/{self.model}/versions/{version}", data=man_bytes,
                                         method="PUT", headers={"Authorization": f"Bearer {TOKEN}"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    status, text = r.status, r.read().decode(errors="replace")
            except urllib.error.HTTPError as e:
                status, text = e.code, e.read().decode(errors="replace")
            ok = 200 <= status < 300
            if ok != want_ok:
                notes.append(f"{what}: HTTP {status}, expected {'success' if want_ok else 'a refusal'}: {text[:300]}")
            elif not ok and '"error"' not in text:
                notes.append(f"{what}: refused without the JSON error body: HTTP {status} {text[:200]}")

        put(body, head, True, "the head manifest again (same bytes)")
        other = dataclasses.replace(m, state_fp=f"{(int(m.state_fp, 16) ^ 1):016x}").sign(KEY)
        put(other.to_json(), head, False, "the head version with other content")
        other_old = dataclasses.replace(mo, state_fp=f"{(int(mo.state_fp, 16) ^ 1):016x}").sign(KEY)
        put(other_old.to_json(), head - 1, False, "an older version with other content")
        if i % 4 == 0:
            state = self.trace.step()
            env.ledger.offer(self.model, head, state)
            p = env.publish_cli(self.model, state, step=head, origin=self.o.url, timeout=60)
            rc = p.wait()
            if p.hung:
                env.publish_hangs += 1
            log = p.log()
            if rc == 0:
                notes.append(f"publish --step {head} (the head) succeeded")
            elif "Traceback" in log or "error" not in log.lower():
                notes.append(f"publish --step {head} refused without a clear error:\n{log[-800:]}")
        cleared = time.monotonic()
        env.expect(self.f, self.push(env))
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        vd.unclear += len(notes)
        vd.notes += notes
        return vd


# -- 16. 1,000 idle connections against a relay ----------------------------------------------------------------

class IdleConnections(Stream):
    name = "1000-idle-connections"
    what = "1,000 idle TCP connections (half with half-sent headers) held on a relay while 2 followers use only it"

    def setup(self, env):
        raise_nofile(8192)
        self.o = env.origin()
        self.r = env.relay("relay", [self.o.url])
        self.open_stream(env, self.o.url)
        self.push(env)
        self.f1 = env.follow(self.model, [self.r.url])
        self.f2 = env.follow(self.model, [self.r.url])
        ready(env, self.f1, self.f2)

    def rep(self, env, i):
        socks = []
        try:
            for k in range(1000):
                c = socket.create_connection(("127.0.0.1", self.r.port), timeout=10)
                if k % 2:
                    c.sendall(b"GET /v1/models/x/head HTTP/1.1\r\nHost: relay\r\n")
                socks.append(c)
            last = self.push(env, 3, gap=0.3)
            cleared = time.monotonic()
            env.expect(self.f1, last)
            env.expect(self.f2, last)
            vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        finally:
            open_ = 0
            for c in socks:
                try:
                    c.setblocking(False)
                    open_ += c.recv(1, socket.MSG_PEEK) != b""
                except BlockingIOError:
                    open_ += 1
                except OSError:
                    pass
                c.close()
        vd.notes.append(f"{open_} of {len(socks)} idle connections still open at the end")
        return vd


ALL: list[type[Scenario]] = [
    RelayKilled, ParentStalled, ParentTruncated, ParentWrongLength, BitFlips, RelayBlobCorrupt,
    RelayManifestCorrupt, RelayHeadBadSignature, OriginKilledBeforeCommit, OriginKilledMidWrite,
    SubscriberKilled, FiftyBehind, RelayDiskFull, OriginDiskFull, DuplicatePublishes, IdleConnections,
]
from .hostile import HOSTILE  # noqa: E402  (issue 27: TUF's attack list and the hostile peers it found)

ALL += HOSTILE
BY_NAME = {s.name: s for s in ALL}
# the short form inside `make test`: one repetition of each, chosen to cover a kill, a lying wire,
# a corrupt disk, a cut-short publish and a killed subscriber, and two hostile mirrors (a forged future head,
# a 1-byte/s first source: ~10 s together)
SHORT = ["relay-sigkill-restart", "bit-flips-in-transit", "relay-disk-blob-corrupt", "subscriber-killed-mid-apply",
         "hostile-fast-forward", "hostile-slow-first-source"]
