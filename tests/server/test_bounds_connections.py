"""Issue 9: the servers bound what a client can hold open. Raw sockets against real server processes (loopback):
idle and half-sent-header connections are closed, a 1 B/s upload is cut with a JSON 408, aiohttp's own 400s
(huge headers) carry the JSON error body, 300 idle connections under a 256-descriptor limit do not lock out a
normal GET, a client over its connection limit loses its oldest idle connection, and SIGTERM finishes within the
shutdown budget while a blob reader has stopped reading."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time

import pytest

from server_fixtures import TOKEN, ServerProc, make_blob, origin, put_blob, session, start_all, stop_all

from deltasync.server.http.connections import ConnectionGuard, ServerLimits, UploadPace
from deltasync.errors import RequestTimeoutError

FAST = ("--idle-timeout", "1", "--body-timeout", "3", "--min-upload-rate", "1K", "--no-fsync")


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``s`` (reading and discarding what it sent), None if still open."""
    t0 = time.monotonic()
    s.settimeout(0.2)
    while time.monotonic() - t0 < seconds:
        try:
            if s.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0
    return None


def _response(s: socket.socket, timeout: float) -> tuple[int, bytes]:
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = s.recv(65536)
        if not piece:
            break
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
                  None)
    while length is not None and len(body) < length:
        piece = s.recv(65536)
        if not piece:
            break
        body += piece
    return int(head.split()[1]), body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("conns")
    (work / "token").write_text(TOKEN)
    o = origin(work, "o", *FAST, "--max-connections-per-client", "8")
    start_all(o)
    yield o
    assert stop_all(o) == [0], o.log()


def test_idle_and_half_sent_header_connections_are_closed(server):
    idle = _connect(server.url)
    half = _connect(server.url)
    half.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    cut = False
    for _ in range(20):  # trickling header bytes does not keep it open
        try:
            half.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            cut = True
            break
        time.sleep(0.25)
    assert cut or _closed_within(half, 5) is not None
    assert time.monotonic() - t0 < 5.5
    assert _closed_within(idle, 5) is not None


def test_a_one_byte_per_second_upload_is_cut_with_a_json_408(server):
    bid, data = make_blob(4000, 3)
    s = _connect(server.url)
    s.sendall(f"PUT /v1/blobs/{bid} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
              f"Content-Type: application/octet-stream\r\nContent-Length: {len(data)}\r\n\r\n".encode())
    t0 = time.monotonic()
    s.settimeout(0.05)
    status = body = None
    for i in range(len(data)):
        try:
            s.sendall(data[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            if s.recv(1, socket.MSG_PEEK):
                break
        except TimeoutError:
            pass
        time.sleep(1.0)
        if time.monotonic() - t0 > 30:
            break
    status, body = _response(s, 5)
    took = time.monotonic() - t0
    assert status == 408, body
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "too slow" in err["message"]
    assert took < 12, took  # 5 s grace, then under 1 KiB/s


def test_aiohttps_own_400s_are_json(server):
    s = _connect(server.url)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
    status, body = _response(s, 10)
    assert status in (400, 431), body
    err = json.loads(body)["error"]
    assert err["status"] == status and err["code"] in ("format", "too_large") and err["message"]
    s = _connect(server.url)
    s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    status, body = _response(s, 10)
    assert status == 400 and json.loads(body)["error"]["code"] == "format"


async def test_a_client_over_its_limit_loses_its_oldest_idle_connection(server):
    held = [_connect(server.url) for _ in range(8)]
    time.sleep(0.3)
    async with session() as s:  # a ninth connection from the same address: the oldest idle one makes room
        async with s.get(f"{server.url}/healthz") as r:
            assert r.status == 200
    assert _closed_within(held[0], 2) is not None
    for h in held:
        h.close()


class LimitedServer(ServerProc):
    """A server process started under RLIMIT_NOFILE = 256."""

    def start(self) -> ServerProc:
        cmd = [sys.executable, "-m", "deltasync.server.cli", self.role, "--listen", f"127.0.0.1:{self.port}", *self.args]
        self._term_sent = False
        self._log = open(self.log_path, "ab")
        self._log_start = self.log_path.stat().st_size
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
        return self


async def test_300_idle_connections_under_256_descriptors_do_not_lock_out_a_get(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    o = LimitedServer("origin", tmp_path, "lim", ["--store", str(tmp_path / "lim"), "--token-file",
                                                  str(tmp_path / "token"), "--no-fsync", "--idle-timeout", "60",
                                                  "--max-connections-per-client", "0"])
    start_all(o)
    held = []
    try:
        for _ in range(300):
            held.append(_connect(o.url))
        time.sleep(0.5)
        async with session() as s:
            for _ in range(3):
                async with s.get(f"{o.url}/healthz") as r:
                    assert r.status == 200
                    assert (await r.json())["status"] == "ok"
            bid, data = make_blob(1 << 16, 5)
            assert await put_blob(s, o.url, bid, data) in (200, 201)
    finally:
        for h in held:
            h.close()
        assert stop_all(o) == [0], o.log()


async def test_sigterm_finishes_within_the_budget_while_a_reader_stalls(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    o = origin(tmp_path, "st", "--no-fsync", "--shutdown-timeout", "3")
    start_all(o)
    bid, data = make_blob(48 << 20, 9)
    async with session() as s:
        assert await put_blob(s, o.url, bid, data) in (200, 201)
    r = _connect(o.url)
    r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    r.sendall(f"GET /v1/blobs/{bid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    time.sleep(1.0)  # the response is going out, and the reader reads nothing
    t0 = time.monotonic()
    o.terminate()
    code = o.proc.wait(30)
    took = time.monotonic() - t0
    r.close()
    assert code == 0, o.log()
    assert took < 5.5, took  # the budget (3 s) plus interpreter exit on a loaded machine


def test_upload_pace_is_pure_arithmetic():
    lim = ServerLimits(min_upload_rate=1000, upload_grace=5, body_timeout=10)
    pace = UploadPace(lim, clock=lambda: 100.0)
    pace.got(10, now=104.0)  # within the grace
    assert pace.wait_limit(now=104.0) == pytest.approx(1.06, abs=0.01)  # 10 bytes cover 5.01 s
    with pytest.raises(RequestTimeoutError, match="too slow"):
        pace.got(1, now=107.0)
    fast = UploadPace(lim, clock=lambda: 0.0)
    fast.got(1 << 20, now=1.0)
    assert fast.wait_limit(now=1.0) == 10  # the body timeout bounds silence
    assert UploadPace(ServerLimits(min_upload_rate=0), clock=lambda: 0.0).wait_limit(now=1e6) == 10
    with pytest.raises(ValueError):
        ServerLimits(idle_timeout=0)
    assert ConnectionGuard(ServerLimits(max_connections=7)).max_total == 7
