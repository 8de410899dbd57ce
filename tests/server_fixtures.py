"""Helpers for the server tests: real server processes on 127.0.0.1, a controllable TCP proxy,
hand-made blobs and manifests (the server treats blobs as opaque bytes)."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import threading
import sys
import time
from pathlib import Path

import aiohttp

from deltasync.blob import blob_id
from deltasync.manifest import BlobRef, Manifest
from deltasync.server.metrics import parse_metrics

TOKEN = "test-token-0123456789"
KEY_HEX = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
KEY = bytes.fromhex(KEY_HEX)
_LISTEN = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


class ServerProc:
    """One ``python -m deltasync.server.cli`` process; its log goes to a file."""

    def __init__(self, role: str, workdir: Path, name: str, args: list[str], *, port: int | None = None) -> None:
        self.role, self.name, self.args = role, name, list(args)
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self.port = free_port() if port is None else port
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProc:
        cmd = [sys.executable, "-m", "deltasync.server.cli", self.role, "--listen", f"127.0.0.1:{self.port}",
               *self.args]
        self._term_sent = False
        self._log = open(self.log_path, "ab")
        self._log_start = self.log_path.stat().st_size
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout: float = 30.0) -> ServerProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                m = _LISTEN.search(f.read().decode(errors="replace"))
            if m:
                self.url = m.group(1)
                self.port = int(self.url.rsplit(":", 1)[1])
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not start within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        if not self._term_sent:
            self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(5)
        finally:
            self._log.close()

    def terminate(self) -> None:
        """Send SIGTERM once (a second one would kill a server that is already shutting down)."""
        self._term_sent = True
        os.kill(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
            self._log.close()

    def restart(self) -> ServerProc:
        """Stop and start again on the same port with the same store."""
        self.stop()
        return self.start().wait_ready()


def free_port() -> int:
    """A port nobody listens on right now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_all(*servers: ServerProc) -> list[int]:
    """SIGTERM every server at once, then collect exit codes (SIGKILL after a timeout)."""
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            s.terminate()
    return [s.stop() for s in servers]


def start_all(*servers: ServerProc) -> None:
    """Start processes in parallel (each import takes a second or so) and wait until all listen."""
    for s in servers:
        if s.proc is None or s.proc.poll() is not None:
            s.start()
    for s in servers:
        s.wait_ready()


def origin(workdir: Path, name: str = "origin", *extra: str, key: bool = False) -> ServerProc:
    (workdir / "token").write_text(TOKEN + "\n")
    args = ["--store", str(workdir / name), "--token-file", str(workdir / "token"), *extra]
    if key:
        (workdir / "key").write_text(KEY_HEX + "\n")
        args += ["--key-file", str(workdir / "key")]
    return ServerProc("origin", workdir, name, args)


def relay(workdir: Path, name: str, parents: list[str], *extra: str, key: bool = False,
          hints: bool = False) -> ServerProc:
    """A relay process. ``hints``: act on the parent's upload hints (the production default); off here so that
    a test's blob uploaded to the origin is fetched only when the test asks for it or a version names it."""
    args = ["--cache", str(workdir / name), "--heartbeat", "1", "--read-timeout", "5", *extra]
    if not hints:
        args.append("--no-hinted-fetch")
    for p in parents:
        args += ["--parent", p]
    if key:
        (workdir / "key").write_text(KEY_HEX + "\n")
        args += ["--key-file", str(workdir / "key")]
    return ServerProc("relay", workdir, name, args)


# -- data -----------------------------------------------------------------------------------

def make_blob(size: int, seed: int) -> tuple[str, bytes]:
    data = random.Random(seed).randbytes(size)
    return blob_id(data), data


def fp(n: int) -> str:
    return f"{n:016x}"


def keyframe(model: str, version: int, blobs: list[tuple[str, bytes]], *, key: bytes | None = KEY) -> Manifest:
    m = Manifest(model=model, version=version, parent=None, kind="keyframe", tensors=(),
                 blobs=tuple(BlobRef(id=b, size=len(d)) for b, d in blobs), state_fp=fp(version))
    return m.sign(key) if key else m


def delta(model: str, version: int, parent: int, blobs: list[tuple[str, bytes]], *, key: bytes | None = KEY,
          base_fp: str | None = None) -> Manifest:
    m = Manifest(model=model, version=version, parent=parent, kind="delta", tensors=(),
                 blobs=tuple(BlobRef(id=b, size=len(d)) for b, d in blobs), state_fp=fp(version),
                 state_fp_before=base_fp or fp(parent))
    return m.sign(key) if key else m


# -- HTTP ------------------------------------------------------------------------------------

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def session(**kw) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60, sock_read=20), auto_decompress=False, **kw)


async def put_blob(s: aiohttp.ClientSession, url: str, bid: str, data: bytes, *, token: str = TOKEN) -> int:
    async with s.put(f"{url}/v1/blobs/{bid}", data=data, headers={"Authorization": f"Bearer {token}"}) as r:
        await r.read()
        return r.status


async def put_manifest(s: aiohttp.ClientSession, url: str, m: Manifest, *, body: bytes | None = None) -> tuple[int, dict]:
    async with s.put(f"{url}/v1/models/{m.model}/versions/{m.version}", data=body if body is not None else m.to_json(),
                     headers=AUTH) as r:
        return r.status, await r.json(content_type=None)


async def publish(s: aiohttp.ClientSession, url: str, m: Manifest, blobs: list[tuple[str, bytes]]) -> None:
    for bid, data in blobs:
        assert await put_blob(s, url, bid, data) in (200, 201)
    status, body = await put_manifest(s, url, m)
    assert status in (200, 201), body


async def get_bytes(s: aiohttp.ClientSession, url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    async with s.get(url, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.read()


async def metrics(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(f"{url}/metrics") as r:
        return parse_metrics(await r.text())


async def wait_for(pred, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = await pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)


async def wait_head(s: aiohttp.ClientSession, url: str, model: str, version: int, timeout: float = 20.0) -> None:
    async def ok():
        async with s.get(f"{url}/v1/models/{model}/head", params={"after": str(version - 1), "wait": "2"}) as r:
            if r.status == 200:
                return int(r.headers["X-Deltasync-Version"]) >= version
            return False
    await wait_for(ok, timeout, what=f"{url} to announce {model} v{version}")


# -- a TCP proxy the test controls ----------------------------------------------------------

class GateProxy:
    """Forwards TCP to ``target_port`` on its own threads (so it outlives any one test's event loop).

    The downstream direction (target → client) can be held after a byte budget shared by all
    connections (``hold_after``), let go (``release``), or every connection cut (``cut``);
    ``hold_blob_answers`` holds only the answers on connections whose first request is a blob GET
    (a relay's blob fetches), while its event stream and manifest reads flow.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._cond = threading.Condition()
        self._budget: int | None = None
        self._hold_blobs = False
        self._socks: set[socket.socket] = set()
        self.forwarded = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_after(self, nbytes: int) -> None:
        with self._cond:
            self._budget = nbytes

    def hold_blob_answers(self) -> None:
        with self._cond:
            self._hold_blobs = True

    def release(self) -> None:
        with self._cond:
            self._budget = None
            self._hold_blobs = False
            self._cond.notify_all()

    def cut(self) -> None:
        with self._cond:
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        self.release()
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._cond:
                self._socks.update((client, upstream))
            conn = {"blob": False}  # the first request on it was a blob GET
            threading.Thread(target=self._pump, args=(client, upstream, False, conn), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True, conn), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gated: bool, conn: dict) -> None:
        first = True
        try:
            while True:
                n = 1 << 16
                if gated:
                    with self._cond:
                        while self._budget is not None and self._budget <= 0 and not self._closed:
                            self._cond.wait(0.1)
                        if self._budget is not None:
                            n = max(1, min(n, self._budget))
                data = src.recv(n)
                if not data:
                    break
                if not gated and first:
                    conn["blob"] = data.startswith(b"GET /v1/blobs/")
                first = False
                if gated:
                    with self._cond:
                        while self._hold_blobs and conn["blob"] and not self._closed:
                            self._cond.wait(0.1)
                        if self._budget is not None:
                            self._budget -= len(data)
                        self.forwarded += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._cond:
                self._socks.discard(src)
                self._socks.discard(dst)
            src.close()


class FakeParent:
    """A minimal HTTP parent on its own threads that serves the blob bytes it is given (right or
    wrong), an event stream that only ever sends keepalives, and 404 for anything else; it shows
    how a relay treats a parent that lies."""

    def __init__(self) -> None:
        import http.server

        blobs = self.blobs = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                m = re.match(r"^/v1/blobs/([0-9a-f]{32})$", self.path)
                data = blobs.get(m.group(1)) if m else None
                self.send_response(404 if data is None else 200)
                self.send_header("Content-Length", str(0 if data is None else len(data)))
                self.end_headers()

            def do_GET(self):
                if self.path == "/v1/events":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    try:
                        while True:
                            self.wfile.write(b": keepalive\n\n")
                            self.wfile.flush()
                            time.sleep(0.5)
                    except OSError:
                        return
                m = re.match(r"^/v1/blobs/([0-9a-f]{32})$", self.path)
                data = blobs.get(m.group(1)) if m else None
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def fetch_squash(url: str, model: str, start: int, end: int, timeout: float = 150) -> bytes:
    """The server's squashed delta ``start``→``end`` (asked again every 0.5 s until it answers 200: a squash is
    built on the first request); fails the test with the last status and body after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(f"{url}/v1/models/{model}/delta?from={start}&to={end}",
                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                body = await r.read()
                if r.status == 200:
                    return body
            assert time.monotonic() < deadline, (r.status, body[:300])
            await asyncio.sleep(0.5)
