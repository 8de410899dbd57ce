"""nginx (Debian's nginx-light) as a caching tier between an origin and subscribers (issue 9).

A real origin (LocalCluster, a subprocess) and a real nginx on a loopback ephemeral port, its
configuration rendered from deploy/nginx/deltasync-cache.conf into a temporary directory, stopped
by pid. Blobs are cached by nginx (a second read is a cache HIT, the origin serves each blob once),
manifests, heads and event streams pass through unbuffered, and subscribers — the library and the
``subscribe`` command — converge bit-exactly through it. Skipped, with the reason, when there is
no nginx binary (.ci/run installs nginx-light when it runs as root).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from deltasync.cli.cluster import LocalCluster, start_server
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.tensorfile import read_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="no nginx binary (apt-get install nginx-light)")
TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "deltasync-cache.conf"
KEY = bytes(range(50, 82))
SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)

MAIN = """daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 1024; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    include {d}/deltasync-cache.conf;
}}
"""


class _Cluster(LocalCluster):
    """LocalCluster whose origin may take up to 120 s to start (a loaded 2-core machine)."""

    def start_origin(self, name: str = "origin", *, port: int = 0):
        args = [*self._common(f"127.0.0.1:{port}"), "--store", str(self.root / name), "--token-file", str(self.token_file)]
        self.servers[name] = start_server("origin", name, self.root, args, timeout=120)
        return self.servers[name]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    def __init__(self, root: Path, upstream: str) -> None:
        self.dir = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        conf = (TEMPLATE.read_text().replace("@LISTEN@", f"127.0.0.1:{self.port}").replace("@UPSTREAM@", upstream)
                .replace("@CACHE_DIR@", str(root / "cache")).replace("@MAX_SIZE@", "256m"))
        (root / "deltasync-cache.conf").write_text(conf)
        (root / "nginx.conf").write_text(MAIN.format(d=root))
        check = subprocess.run([NGINX, "-t", "-p", str(root), "-c", str(root / "nginx.conf")], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen([NGINX, "-p", str(root), "-c", str(root / "nginx.conf")],
                                     stdout=subprocess.DEVNULL, stderr=open(root / "stderr.log", "wb"))
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.proc.poll() is None, (root / "error.log").read_text()
                assert time.monotonic() < deadline, "nginx did not listen"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    root = tmp_path_factory.mktemp("nginx-tier")
    c = _Cluster(root / "tree", key=KEY)
    try:
        c.start_tree({})
        ngx = Nginx(root / "nginx", c.origin.removeprefix("http://"))
        try:
            yield c, ngx
        finally:
            ngx.stop()
    finally:
        c.close()


def _get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, dict(r.headers), r.read()


def test_subscribers_converge_bit_exact_through_nginx_and_blobs_are_cached(tier, tmp_path):
    cluster, ngx = tier
    trace = RLTrace(SHAPE, lr=3e-4, seed=5)
    states = [trace.step() for _ in range(6)]
    targets = [{n: torch.zeros_like(t) for n, t in states[0].items()} for _ in range(3)]
    subs = [ThreadedSubscriber([ngx.url], "ngx", t, verifier=KEY) for t in targets]
    with Publisher(cluster.origin, "ngx", cluster.token, KEY, keyframe_every=0) as pub:
        res = pub.publish(0, states[0]).result(60)
        for s in subs:
            s.start()
        try:
            for v in range(1, 6):
                res = pub.publish(v, states[v]).result(60)
                for s in subs:  # heads and events pass through nginx as they happen
                    assert s.wait_version(v, 60) == v
            for t in targets:
                assert _same(t, states[5])
        finally:
            for s in subs:
                s.close()
    # blobs: a cache MISS once, then HITs; nginx answers ranges from its cache; the bytes are the origin's
    bid = res.manifest.blobs[0].id
    _, h1, b1 = _get(f"{ngx.url}/v1/blobs/{bid}")
    _, h2, b2 = _get(f"{ngx.url}/v1/blobs/{bid}")
    assert h2.get("X-Cache-Status") == "HIT", h2
    _, _, direct = _get(f"{cluster.origin}/v1/blobs/{bid}")
    assert b1 == b2 == direct
    status, h3, part = _get(f"{ngx.url}/v1/blobs/{bid}", {"Range": "bytes=3-9"})
    assert status == 206 and part == direct[3:10] and h3.get("X-Cache-Status") == "HIT"
    # manifests and heads are never cached: the head moves with the origin
    _, hh, _ = _get(f"{ngx.url}/v1/models/ngx/head")
    assert hh.get("X-Deltasync-Version") == "5" and "X-Cache-Status" not in hh
    # the subscribe command through nginx, from scratch
    key_file = tmp_path / "key"
    key_file.write_text(KEY.hex())
    out = tmp_path / "out.safetensors"
    r = subprocess.run([sys.executable, "-m", "deltasync.client.cli", "subscribe", "--from", ngx.url, "--model", "ngx",
                        "--key-file", str(key_file), "--out", str(out), "--once", "--timeout", "60"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _same(read_state_file(out), states[5])


def test_nginx_refuses_writes_and_passes_event_streams_unbuffered(tier):
    cluster, ngx = tier
    req = urllib.request.Request(f"{ngx.url}/v1/blobs/{'0' * 32}", data=b"x", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 403
    # an event stream through nginx delivers a new version's event while the stream stays open
    trace = RLTrace(SHAPE, lr=3e-4, seed=6)
    with socket.create_connection(("127.0.0.1", ngx.port), timeout=30) as s:
        s.sendall(b"GET /v1/models/ngx-ev/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
        time.sleep(0.5)
        with Publisher(cluster.origin, "ngx-ev", cluster.token, KEY, keyframe_every=0) as pub:
            pub.publish(0, trace.step()).result(60)
            t0 = time.monotonic()
            got = b""
            while b"ngx-ev" not in got.split(b"\r\n\r\n", 1)[-1] and time.monotonic() - t0 < 20:
                got += s.recv(65536)
        assert b"200" in got.split(b"\r\n", 1)[0], got[:300]
        assert b"ngx-ev" in got.split(b"\r\n\r\n", 1)[-1], got[:600]
        assert time.monotonic() - t0 < 10, "the event reached the client late: buffered?"
