"""The fault campaign's hostile-peer scenarios (issue 27): TUF's attack list and the five cases the issue found.

Each is a :class:`~faults.scenarios.Scenario` like the others (set the tree up once, repeat the attack
``--reps`` times, check lost / wrong / hangs / converge). The hostile mirror or parent is
``tests/hostile_peers.py``'s ``HostilePeer`` (a real TCP server in front of the real origin, one answer plan per
request); a scenario with several variants of one attack rotates through them, one per repetition. The fault
stays for the whole scenario, so converge is timed from the last acknowledged publish. ``hangs`` also counts a
bound the scenario itself checks and saw broken (a request storm, a command that outlived its deadline or a
signal by more than its grace), each with a note.

Every mirror is listed *first* (before the origin, or as a relay's first parent): the attack is on the path the
client tries first.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import xxhash

from hostile_peers import PROXY, DripBody, DripHead, Endless, Fixed, HostilePeer, Swap, Tamper

from .harness import KEY, TOKEN, Env, Verdict, http_get
from .scenarios import Stream, _last_line, _merge, ready, relay_has, wait_until

# lowered slow-retrieval limits (the programs' own flags), so a 1-byte/s peer costs ~1 s a repetition, not the
# default 10 s grace (tests/system/test_hostile_slow.py keeps the defaults once: ends within 75 s)
FAST_CLIENT = ["--min-rate", "4000", "--rate-grace", "1", "--ttfb-timeout", "2"]
FAST_RELAY = ["--min-rate", "4000", "--rate-grace", "1", "--ttfb-timeout", "2"]
JSON = {"Content-Type": "application/json"}


def _get(url: str) -> bytes:
    status, _, body = http_get(url)
    if status != 200:
        raise RuntimeError(f"GET {url}: HTTP {status}")
    return body


def _manifest(origin: str, model: str, v: int) -> bytes:
    return _get(f"{origin}/v1/models/{model}/versions/{v}")


def _resign(body: bytes, key: bytes | None = None, **changes) -> bytes:
    """The manifest with ``changes``; signed with ``key`` (a key that is not the stream's: a forgery), or with its
    old signature kept (None: the signature no longer covers the fields)."""
    import dataclasses

    from deltasync.manifest import parse_manifest

    m = parse_manifest(body)
    m2 = dataclasses.replace(m, **changes)
    if key is not None:
        return m2.sign(key).to_json()
    obj = json.loads(m2.to_json())
    obj["signature"] = json.loads(body).get("signature", "")
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _unsigned(body: bytes) -> bytes:
    obj = json.loads(body)
    obj.pop("signature", None)
    obj.pop("key_id", None)
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _head(body: bytes, version: int) -> Fixed:
    return Fixed(200, {**JSON, "X-Deltasync-Version": str(version)}, body)


class Lazy:
    """A value fetched on first use (the plan is installed before the versions it fakes are published), cached once
    it could be fetched; None until then (the plan passes the request through)."""

    def __init__(self, fn) -> None:
        self.fn, self.value = fn, None

    def __call__(self):
        if self.value is None:
            try:
                self.value = self.fn()
            except Exception:
                return None
        return self.value


WRONG_KEY = bytes(range(100, 132))


class Mirror(Stream):
    """Origin; a hostile mirror in front of it; a relay listing the mirror then the origin, a follower behind
    the relay; a follower listing the mirror then the origin; each repetition a fresh ``subscribe --once``
    (mirror, origin) that must end bit-exactly at the origin's head. ``variants``: names, one a repetition; the
    repetition's plan is made and installed before its versions are published (so the followers meet it too),
    fakes of those versions fetched lazily (:class:`Lazy`)."""

    variants: list[str] = []
    relay_extra: list[str] = []
    client_extra: list[str] = []
    publishes = 2

    def setup(self, env):
        self.o = env.origin()
        self.plan = lambda m, t: PROXY
        self.mirror = HostilePeer(self.o.url, lambda m, t: self.plan(m, t)).__enter__()
        self.r = env.relay("relay", [self.mirror.url, self.o.url], extra=self.relay_extra)
        self.open_stream(env, self.o.url)
        self.prepare(env)
        self.push(env)
        self.f1 = env.follow(self.model, [self.r.url], extra=self.client_extra)
        self.f2 = env.follow(self.model, [self.mirror.url, self.o.url], extra=self.client_extra)
        ready(env, self.f1, self.f2)

    def prepare(self, env: Env) -> None:
        """Extra setup (another model's chain, ...)."""

    def make_plan(self, env: Env, variant: str, last: int):
        raise NotImplementedError

    def rep(self, env, i):
        variant = self.variants[i % len(self.variants)]
        last = self.v + self.publishes - 1
        before = len(self.mirror.requests)
        self.plan = self.make_plan(env, variant, last)
        assert self.push(env, self.publishes, gap=0.2) == last
        cleared = time.monotonic()
        env.subscribe(self.model, [self.mirror.url, self.o.url], once=True, goal=last, timeout=60,
                      extra=self.client_extra)
        env.expect(self.f1, last)
        env.expect(self.f2, last)
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        vd.notes.append(f"{variant}: the mirror answered {len(self.mirror.requests) - before} requests")
        return vd

    def teardown(self, env):
        try:
            super().teardown(env)
        finally:
            self.mirror.__exit__(None, None, None)


def _is_head(model: str, target: str) -> bool:
    return target.startswith(f"/v1/models/{model}/head")


def _is_version(model: str, target: str, v: int | None = None) -> bool:
    p = f"/v1/models/{model}/versions/"
    return target.startswith(p) and (v is None or target.split("?")[0] == f"{p}{v}")


def _is_blob(method: str, target: str) -> bool:
    return method == "GET" and target.startswith("/v1/blobs/")


# -- slow retrieval -------------------------------------------------------------------------------------------

class SlowRetrieval(Mirror):
    name = "hostile-slow-first-source"
    what = ("TUF slow retrieval: the first-listed source (a subscriber's and a relay's first parent) drips at 1 "
            "byte/s, rotating: blob bodies, blob answer heads (header drip), manifests; `--min-rate 4000 "
            "--rate-grace 1` (the defaults are held once in tests/system/test_hostile_slow.py)")
    variants = ["blob-body-drip", "blob-header-drip", "manifest-drip"]
    relay_extra = FAST_RELAY
    client_extra = FAST_CLIENT

    def make_plan(self, env, variant, last):
        kind = DripHead if variant == "blob-header-drip" else DripBody

        def plan(method, target):
            if variant == "manifest-drip":
                return DripBody(1.0) if method == "GET" and _is_version(self.model, target) else PROXY
            return kind(1.0) if _is_blob(method, target) else PROXY
        return plan


# -- arbitrary installation -----------------------------------------------------------------------------------

class ArbitraryInstallation(Mirror):
    name = "hostile-arbitrary-installation"
    what = ("TUF arbitrary installation: the first-listed mirror serves, rotating, the head manifest with other "
            "content signed by a wrong key, the head manifest unsigned, or every blob with one byte flipped")
    variants = ["forged-manifest", "unsigned-manifest", "tampered-blobs"]

    def make_plan(self, env, variant, last):
        if variant == "tampered-blobs":
            return lambda m, t: Tamper(random.random()) if _is_blob(m, t) else PROXY

        def forge():
            from deltasync.manifest import parse_manifest
            real = _manifest(self.o.url, self.model, last)
            if variant == "unsigned-manifest":
                return _unsigned(real)
            fp = parse_manifest(real).state_fp
            return _resign(real, WRONG_KEY, state_fp=f"{int(fp, 16) ^ 1:016x}")
        return _faking(self.model, last, Lazy(forge))


def _faking(model: str, last: int, fake: Lazy, *, claimed: int | None = None, above: bool = False):
    """A plan: head reads and long-polls answered with ``fake()`` (claiming ``claimed``, default ``last``), and the
    manifest of ``last`` (``above``: of every version past ``last``) too; the rest passed through."""
    def plan(method, target):
        body = fake()
        if body is None:
            return PROXY
        if _is_head(model, target):
            return _head(body, last if claimed is None else claimed)
        if _is_version(model, target, None if above else last):
            if not above or int(target.split("?")[0].rsplit("/", 1)[1]) > last:
                return Fixed(200, JSON, body)
        return PROXY
    return plan


# -- endless data ---------------------------------------------------------------------------------------------

class EndlessData(Mirror):
    name = "hostile-endless-data"
    what = ("TUF endless data: the first-listed mirror answers, rotating, blobs with an endless body (no length), "
            "blobs with bytes past their Content-Length, the head with an endless JSON body, the event streams "
            "with one endless event line")
    variants = ["endless-blob", "blob-longer-than-declared", "endless-head", "endless-events"]

    def make_plan(self, env, variant, last):
        def plan(method, target):
            if variant == "endless-blob" and _is_blob(method, target):
                return Endless()
            if variant == "blob-longer-than-declared" and _is_blob(method, target):
                return Endless(after_upstream=True)
            if variant == "endless-head" and _is_head(self.model, target):
                return Endless(headers=(("Content-Type", "application/json"), ("X-Deltasync-Version", str(last))),
                               chunk=b"[" * 65536)
            if variant == "endless-events" and "/events" in target:
                return Endless(headers=(("Content-Type", "text/event-stream"),), chunk=b"data: " + b"x" * 65530)
            return PROXY
        return plan


# -- mix-and-match, wrong installation ---------------------------------------------------------------------------

class OtherChain(Mirror):
    """A second model, ``other``, published by the same publisher key, whose signed manifests the mirror serves."""

    other = "other"

    def prepare(self, env):
        self.opub = env.publisher(self.o.url, self.other)
        self.otrace = env.trace(seed=77)
        self.ov = 0

    def push_other(self, env, version: int) -> int:
        env.publish(self.opub, version, self.otrace.step())
        return version

    def teardown(self, env):
        try:
            self.opub.close(30)
        finally:
            super().teardown(env)


class MixAndMatch(OtherChain):
    name = "hostile-mix-and-match"
    what = ("TUF mix-and-match: the first-listed mirror serves, rotating, every blob of the new versions as the "
            "bytes of an older version's blob under the asked id, the head as the previous version's signed "
            "manifest under the new number, the head version as the other model's signed manifest of that number")
    variants = ["blob-of-another-version", "manifest-of-another-version", "manifest-of-another-model"]

    def make_plan(self, env, variant, last):
        if variant == "blob-of-another-version":
            old_ids = [b["id"] for b in json.loads(_manifest(self.o.url, self.model, 0))["blobs"]]

            def plan(method, target):  # every blob but the first keyframe's is answered with one of those
                bid = target.split("/")[3].split("?")[0] if _is_blob(method, target) else None
                if bid is not None and bid not in old_ids:
                    return Swap(f"/v1/blobs/{old_ids[sum(bid.encode()) % len(old_ids)]}")
                return PROXY
            return plan
        if variant == "manifest-of-another-version":
            return _faking(self.model, last, Lazy(lambda: _manifest(self.o.url, self.model, last - 1)))
        self.ov = max(self.ov, last)
        fake = _manifest(self.o.url, self.other, self.push_other(env, self.ov))
        self.ov += 1
        return _faking(self.model, last, Lazy(lambda: fake))


class WrongInstallation(OtherChain):
    name = "hostile-wrong-installation"
    what = ("TUF wrong installation: the first-listed mirror serves another model's validly signed manifests "
            "(same key) for this model, rotating: at the head, and for every version of the chain")
    variants = ["other-model-head", "other-model-everywhere"]

    def make_plan(self, env, variant, last):
        self.ov = max(self.ov, last + 1)
        fake_v = self.push_other(env, self.ov)
        self.ov += 1
        fake = _manifest(self.o.url, self.other, fake_v)

        def plan(method, target):
            if _is_head(self.model, target):
                return _head(fake, fake_v)
            if variant == "other-model-everywhere" and _is_version(self.model, target):
                return Swap(f"/v1/models/{self.other}/versions/{fake_v}")
            return PROXY
        return plan


# -- rollback, fast-forward -----------------------------------------------------------------------------------

class Rollback(Mirror):
    name = "hostile-rollback"
    what = ("TUF rollback: the first-listed mirror offers an older signed version as the newest (its head and "
            "long-polls answer at once with v(last-2) and, rotating, an honest or a claimed-new version header)")
    variants = ["old-head", "old-head-claimed-new"]
    publishes = 3

    def make_plan(self, env, variant, last):
        old = Lazy(lambda: _manifest(self.o.url, self.model, last - 2))
        claimed = last if variant == "old-head-claimed-new" else last - 2

        def plan(method, target):
            body = old()
            return _head(body, claimed) if body is not None and _is_head(self.model, target) else PROXY
        return plan


class FastForward(OtherChain):
    name = "hostile-fast-forward"
    what = ("TUF fast-forward: the first-listed mirror claims a head 10 versions past the real one, rotating: the "
            "real head's manifest renumbered (its signature kept), renumbered and signed by a wrong key, or another "
            "chain's validly signed manifest of that number")
    variants = ["renumbered", "renumbered-wrong-key", "other-chain-signed"]

    def make_plan(self, env, variant, last):
        ahead = last + 10
        if variant == "other-chain-signed":
            self.ov = max(self.ov, ahead)
            fake = Lazy(lambda b=_manifest(self.o.url, self.other, self.push_other(env, self.ov)): b)
            self.ov += 1
        else:
            key = WRONG_KEY if variant == "renumbered-wrong-key" else None
            fake = Lazy(lambda: _resign(_manifest(self.o.url, self.model, last), key, version=ahead, parent=ahead - 1))
        return _faking(self.model, last, fake, claimed=ahead, above=True)


# -- indefinite freeze: a replayed head ----------------------------------------------------------------------

class ReplayedHead(Stream):
    name = "hostile-replayed-head"
    what = ("TUF indefinite freeze: a mirror answers head reads and long-polls at once with the signed manifest "
            "of v(last-2); `subscribe --once` (mirror, origin) must end at the origin's head; a follower of that "
            "mirror alone holds v(last-2) and asks it under 2 times a second")
    RATE = 2.0
    WINDOW = 5.0

    def setup(self, env):
        self.o = env.origin()
        self.open_stream(env, self.o.url)
        self.push(env)
        self.old = (0, _manifest(self.o.url, self.model, 0))
        plan = lambda m, t: _head(self.old[1], self.old[0]) if _is_head(self.model, t) else PROXY  # noqa: E731
        self.m_once = HostilePeer(self.o.url, plan).__enter__()
        self.m_alone = HostilePeer(self.o.url, plan).__enter__()
        self.f = env.follow(self.model, [self.m_alone.url], poll=5)
        ready(env, self.f)

    def rep(self, env, i):
        t0 = time.monotonic()
        last = self.push(env, 3, gap=0.1)
        self.old = (last - 2, _manifest(self.o.url, self.model, last - 2))
        cleared = time.monotonic()
        env.subscribe(self.model, [self.m_once.url, self.o.url], once=True, goal=last, timeout=60)
        env.expect(self.f, last - 2)
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        time.sleep(max(0.0, t0 + self.WINDOW - time.monotonic()))
        t1 = time.monotonic()
        n = self.m_alone.count(lambda m, t: _is_head(self.model, t), since=t0)
        rate = n / (t1 - t0)
        v, _ = env.check_file(self.model, self.f.out)
        if rate >= self.RATE:
            vd.hangs += 1
            vd.notes.append(f"the lone follower asked the replaying mirror {n} times in {t1 - t0:.1f}s ({rate:.1f}/s)")
        if v is not None and v > last - 2:
            vd.wrong += 1
            vd.notes.append(f"the lone follower holds v{v}, past what its only source can prove (v{last - 2})")
        vd.notes.append(f"lone follower: {rate:.2f} head requests/s")
        return vd

    def teardown(self, env):
        try:
            super().teardown(env)
        finally:
            self.m_once.__exit__(None, None, None)
            self.m_alone.__exit__(None, None, None)


# -- hint flood by a foreign-model publish token ----------------------------------------------------------------

EVIL_TOKEN = "stolen-publish-token-of-model-evil"


class Trickle:
    """A blob PUT declaring ``declared`` bytes and sending ``rate`` bytes/s of them, on a thread, until stopped."""

    def __init__(self, port: int, model: str, declared: int, rate: int, token: str = EVIL_TOKEN) -> None:
        self.stop_ev = threading.Event()
        bid = os.urandom(16).hex()  # the id of bytes never sent: the upload never completes
        head = (f"PUT /v1/blobs/{bid} HTTP/1.1\r\nHost: origin\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {declared}\r\n"
                f"X-Deltasync-Model: {model}\r\n\r\n").encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(head)
        self.sent = 0

        def run():
            try:
                while not self.stop_ev.wait(0.1) and self.sent < declared:
                    self.sock.sendall(b"\0" * (rate // 10))
                    self.sent += rate // 10
            except OSError:
                pass
        self.thread = threading.Thread(target=run, name="trickle", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_ev.set()
        self.thread.join(5)
        self.sock.close()


class HintFlood(Stream):
    name = "hostile-hint-flood"
    what = ("hint flood: a publish token for another model uploads a blob at 80 KB/s, rotating: declared at 3x a "
            "relay's 8 MiB cache naming its own model (over the hint share), 1.5 MiB naming its own model (a "
            "hinted fetch that trickles), 3x the cache naming this model (its token may not: no hint); the next "
            "signed version and its keyframe land on the relay (a follower of the relay alone gets it), the relay "
            "stays healthy and within twice its budget")

    CACHE = 8 << 20

    def setup(self, env):
        env.token_file.write_text(f"publish * {TOKEN}\npublish evil {EVIL_TOKEN}\n")
        self.o = env.origin()
        self.r = env.relay("relay", [self.o.url], extra=["--cache-size", str(self.CACHE)])
        self.pub = env.publisher(self.o.url, self.model, keyframe_every=1)
        self.trace = env.trace(seed=0)
        self.v = 0
        self.push(env)
        self.f = env.follow(self.model, [self.r.url])
        ready(env, self.f)

    def rep(self, env, i):
        named, declared = [("evil", 3 * self.CACHE), ("evil", 3 << 19), (self.model, 3 * self.CACHE)][i % 3]
        flood = Trickle(self.o.port, named, declared, 80 << 10)
        try:
            time.sleep(1.5)
            last = self.push(env)
            cleared = time.monotonic()
            env.expect(self.f, last)
            vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
            try:
                relay_has(env, self.r.url, f"{self.model}.kf", last, timeout=30)
            except TimeoutError as e:
                vd.hangs += 1
                vd.notes.append(f"the signed keyframe did not land on the relay: {e}")
            status, _, body = http_get(f"{self.r.url}/healthz")
            health = json.loads(body).get("status") if status == 200 else f"HTTP {status}"
            if health != "ok":
                vd.hangs += 1
                vd.notes.append(f"relay health {health!r} during the flood: {body[:300]!r}")
            used = sum(f.stat().st_size for f in (env.root / "relay").rglob("*") if f.is_file())
            vd.notes.append(f"flood naming {named!r}, {declared:,} bytes declared: {flood.sent:,} sent; relay cache "
                            f"{used / 2**20:.2f} MiB; relay {_metric(self.r.url, 'hint')}")
            if used > 2 * self.CACHE:
                vd.hangs += 1
                vd.notes.append(f"relay cache {used:,} bytes, over twice its {self.CACHE:,}-byte budget")
        finally:
            flood.stop()
        return vd


def _metric(url: str, word: str) -> str:
    """The relay's /metrics lines naming ``word``, one string."""
    status, _, body = http_get(f"{url}/metrics")
    lines = [ln for ln in body.decode(errors="replace").splitlines() if word in ln and not ln.startswith("#")]
    return "; ".join(lines[:6]) if status == 200 else f"metrics: HTTP {status}"


# -- stolen tokens ----------------------------------------------------------------------------------------------

READ_TOKEN = "read-token-of-model-m-only-000"
OTHER_PUBLISH = "publish-token-of-model-other-00"


class StolenTokens(Stream):
    name = "hostile-stolen-tokens"
    what = ("what a stolen token can do: a publish token for another model PUTs a manifest of this one (signed "
            "with the stream's key); this model's publish token PUTs it unsigned and signed by a wrong key; a read "
            "token PUTs a blob and a manifest and reads another model's head; no token reads; all refused, the "
            "next real version lands")

    def setup(self, env):
        env.token_file.write_text(f"publish m {TOKEN}\npublish other {OTHER_PUBLISH}\nread m {READ_TOKEN}\n")
        self.read_file = env.root / "read-token"
        self.read_file.write_text(READ_TOKEN + "\n")
        env.read_token = READ_TOKEN  # the harness's own checks read with it
        self.o = env.origin()
        self.r = env.relay("relay", [self.o.url], extra=["--read-token-file", str(self.read_file)])
        self.open_stream(env, self.o.url)
        self.push(env)
        from deltasync.client.publisher import Publisher
        with Publisher(self.o.url, "other", OTHER_PUBLISH, KEY, keyframe_every=0) as opub:
            env.publish(opub, 0, env.trace(seed=5).step())
        rt = ["--read-token-file", str(self.read_file)]
        self.f1 = env.follow(self.model, [self.r.url], extra=rt)
        self.f2 = env.follow(self.model, [self.o.url], extra=rt)
        ready(env, self.f1, self.f2)

    def _req(self, method: str, path: str, token: str | None, data: bytes | None = None) -> int:
        headers = {"Content-Type": "application/octet-stream"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"{self.o.url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
                return r.status
        except urllib.error.HTTPError as e:
            e.read()
            return e.code

    def rep(self, env, i):
        head = self.push(env)
        status, _, real = http_get(f"{self.o.url}/v1/models/{self.model}/versions/{head}", token=READ_TOKEN)
        assert status == 200, status
        nxt = head + 1
        fake = _resign(real, KEY, version=nxt, parent=head)
        blob = os.urandom(64)
        bid = xxhash.xxh3_128(blob).hexdigest()
        attempts = [
            ("another model's publish token PUTs a signed manifest", "PUT",
             f"/v1/models/{self.model}/versions/{nxt}", OTHER_PUBLISH, fake),
            ("this model's publish token PUTs it unsigned", "PUT",
             f"/v1/models/{self.model}/versions/{nxt}", TOKEN, _unsigned(fake)),
            ("this model's publish token PUTs it signed by a wrong key", "PUT",
             f"/v1/models/{self.model}/versions/{nxt}", TOKEN, _resign(real, WRONG_KEY, version=nxt, parent=head)),
            ("a read token PUTs a blob", "PUT", f"/v1/blobs/{bid}", READ_TOKEN, blob),
            ("a read token PUTs a manifest", "PUT", f"/v1/models/{self.model}/versions/{nxt}", READ_TOKEN, fake),
            ("a read token for m reads other's head", "GET", "/v1/models/other/head", READ_TOKEN, None),
            ("no token reads m's head", "GET", f"/v1/models/{self.model}/head", None, None),
        ]
        notes, accepted = [], 0
        for what, method, path, token, data in attempts:
            status = self._req(method, path, token, data)
            if status < 400:
                accepted += 1
                notes.append(f"ACCEPTED: {what} (HTTP {status})")
        if self._req("GET", f"/v1/models/{self.model}/head", READ_TOKEN) != 200:
            notes.append("the read token could not read its own model")
            accepted += 1
        last = self.push(env)
        cleared = time.monotonic()
        env.expect(self.f1, last)
        env.expect(self.f2, last)
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        vd.wrong += accepted
        vd.notes += notes or [f"{len(attempts)} attempts, all refused"]
        return vd


# -- runaway work interrupted; torn --out files ------------------------------------------------------------------

def _patching(path: Path) -> bool:
    """The file's header says a delta is being written into it (docs/CLIENT.md, "No torn reads")."""
    try:
        with open(path, "rb") as f:
            return b'"patching"' in f.read(8192)
    except OSError:
        return False


def _many_tensors(n: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return {f"layer{k // 100:04d}.t{k % 100:02d}": torch.randn(8, generator=g).to(torch.bfloat16) for k in range(n)}


def _step(state, k: int):
    import torch
    return {n: (t.float() + 0.01 * (k + 1)).to(torch.bfloat16) for n, t in state.items()}


class ManyTensors(Stream):
    """One model of ``TENSORS`` tiny tensors (the seed-scale shape of issue 27's runaway apply, scaled to the
    campaign), every version changing all of them; a subscriber file kept at the previous version."""

    TENSORS = 20_000

    def setup(self, env):
        self.outcomes: list[str] = []
        self.o = env.origin()
        self.pub = env.publisher(self.o.url, self.model, keyframe_every=0)
        self.state = _many_tensors(self.TENSORS, env.seed)
        self.v = 0
        env.publish(self.pub, 0, self.state, bound=120)
        self.v = 1
        self.out = env.root / "sub.safetensors"
        env.subscribe(self.model, [self.o.url], once=True, goal=0, out=self.out, timeout=120)
        env.setup_verdicts.append(env.verdict(origin=self.o.url))

    def next_version(self, env) -> int:
        self.state = _step(self.state, self.v)
        env.publish(self.pub, self.v, self.state, bound=120)
        self.v += 1
        return self.v - 1

    def interrupted(self, env, i, how: str, last: int) -> Verdict:
        """Start ``subscribe --until last`` on the file, interrupt it ``how``; check the file and the bounds."""
        rng = random.Random(i)
        vd = Verdict()
        delay = rng.uniform(0.0, 0.2) if how != "timeout" else rng.uniform(1.0, 4.0)
        timeout = delay if how == "timeout" else 120.0
        p = env.subscribe(self.model, [self.o.url], until=last, out=self.out, timeout=timeout, watch=False,
                          name=f"interrupted{i}")
        if how != "timeout":  # the signal lands 0-0.2 s after the file's header says "patching": mid-apply
            wait_until(lambda: _patching(self.out) or p.poll() is not None, 60, "the apply to start", 0.002)
        if how == "timeout":
            try:
                rc = p.proc.wait(timeout + 5)
            except subprocess.TimeoutExpired:
                vd.hangs += 1
                vd.notes.append(f"--timeout {timeout:.2f}: still running 5 s past it")
                p.kill()
                rc = p.proc.returncode
            took = time.monotonic() - p.started
        else:
            time.sleep(delay)
            sig = signal.SIGTERM if how == "sigterm" else signal.SIGKILL
            t_sig = time.monotonic()
            if p.poll() is None:
                os.kill(p.pid, sig)
            try:
                rc = p.proc.wait(5)
            except subprocess.TimeoutExpired:
                vd.hangs += 1
                vd.notes.append(f"{how}: still running 5 s after the signal")
                p.kill()
                rc = p.proc.returncode
            took = time.monotonic() - t_sig
        log = p.log()
        v, ok = env.check_file(self.model, self.out)
        if not ok:
            vd.wrong += 1
            vd.notes.append(f"{how}: after it the file holds v{v}, not a published state")
        said = any(w in log.lower() for w in ("error", "stopping", "stopped", "rolled back"))
        if how != "sigkill" and rc != 0 and ("Traceback" in log or not said):
            vd.unclear += 1
            vd.notes.append(f"{how}: rc {rc} without a clear message:\n{log[-1500:]}")
        self.outcomes.append("refused" if v is None and self.out.exists() else
                             "rolled back" if "rolled back" in log else f"rc {rc}")
        vd.notes.append(f"{how} {delay:.2f}s after 'patching'" if how != "timeout" else f"--timeout {delay:.2f}s")
        held = "refused (patching)" if v is None and self.out.exists() else f"v{v}"
        vd.notes.append(f"{how}: rc {rc}, exit {took:.2f}s after, file {held}: {_last_line(log)}")
        return vd

    def rep(self, env, i):
        last = self.next_version(env)
        vd0 = self.interrupted(env, i, self.how(i), last)
        cleared = time.monotonic()
        env.subscribe(self.model, [self.o.url], until=last, out=self.out, timeout=120, name=f"resume{i}")
        vd = env.verdict(origin=self.o.url, fault_cleared=cleared)
        _merge(vd, vd0)
        from collections import Counter
        vd.notes.append("outcomes so far: " + ", ".join(f"{k} {n}" for k, n in sorted(Counter(self.outcomes).items())))
        return vd

    def how(self, i: int) -> str:
        raise NotImplementedError

    def teardown(self, env):
        try:
            self.pub.close(30)
        finally:
            env.close()


class ApplyInterrupted(ManyTensors):
    name = "hostile-runaway-apply-interrupted"
    what = ("runaway work: `subscribe --until` applying a 20,000-tensor delta to its file, rotating: SIGTERM "
            "0–0.2 s after the file's header says 'patching' (must exit within 5 s, rolled back or finished), "
            "`--timeout` 1–4 s (must exit within 5 s of it); the file is a published version after, and a restart "
            "converges")

    def how(self, i):
        return "sigterm" if i % 2 == 0 else "timeout"


class TornOut(ManyTensors):
    name = "hostile-torn-out-readers"
    what = ("torn `--out`: `subscribe --until` SIGKILLed 0–0.2 s after its 20,000-tensor delta apply marked the "
            "file 'patching'; before any restart the documented reader (`read_state_file`: `deltasync verify`, `diff`, `publish`) must read a "
            "bit-exact published version or refuse the file ('patching'); a restart converges")

    def how(self, i):
        return "sigkill"

    def rep(self, env, i):
        refused = env.refused
        vd = super().rep(env, i)
        vd.notes.append(f"torn file refused by read_state_file this rep: {env.refused - refused}")
        return vd


HOSTILE = [SlowRetrieval, ReplayedHead, HintFlood, ApplyInterrupted, TornOut, ArbitraryInstallation, EndlessData,
           MixAndMatch, Rollback, FastForward, WrongInstallation, StolenTokens]
