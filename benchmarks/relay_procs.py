"""Processes and readers for the relay benchmark: servers, shaping links, plain FileResponse
servers, CPU accounting from /proc, and a low-overhead HTTP reader that verifies what it got."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

HERE = Path(__file__).resolve().parent
_LISTEN = re.compile(r"listening on (http://127\.0\.0\.1:(\d+))")
_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int, *, split: bool = False):
    """User + system CPU time of a process so far; ``split``: the pair (user, system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    user, system = int(fields[11]) / _TICK, int(fields[12]) / _TICK
    return (user, system) if split else user + system


def max_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Proc:
    """A child process with a log file; stopped with SIGTERM (SIGKILL after a timeout)."""

    def __init__(self, name: str, cmd: list[str], log: Path, *, ready: re.Pattern | str) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log
        self._ready = re.compile(ready) if isinstance(ready, str) else ready
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self._ready.search(self.log_path.read_text(errors="replace"))
            if m:
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class Server(Proc):
    def __init__(self, work: Path, role: str, name: str, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "deltasync.server.cli", role, "--listen", f"127.0.0.1:{self.port}", *args]
        super().__init__(name, cmd, work / f"{name}.log", ready=_LISTEN)


def origin(work: Path, token: str) -> Server:
    (work / "token").write_text(token)
    return Server(work, "origin", "origin", ["--store", str(work / "origin"), "--token-file", str(work / "token")])


def relay(work: Path, name: str, parents: list[str], *extra: str) -> Server:
    args = ["--cache", str(work / name), *extra]
    for p in parents:
        args += ["--parent", p]
    return Server(work, "relay", name, args)


class Shaper(Proc):
    """One shaping process per link (each link gets its own core time)."""

    def __init__(self, work: Path, name: str, target_port: int, *, rate: float, delay: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(HERE / "relay_shaper.py"), "--rate", repr(rate), "--delay", repr(delay),
               f"{self.port}:{target_port}"]
        super().__init__(name, cmd, work / f"{name}.log", ready="ready")


class FileServer(Proc):
    """A plain aiohttp app answering GET /v1/blobs/{id} with ``web.FileResponse`` (the baseline)."""

    def __init__(self, work: Path, name: str, root: Path, *, uvloop: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(HERE / "relay_fileserver.py"), "--root", str(root), "--port", str(self.port)]
        if uvloop:
            cmd.append("--uvloop")
        super().__init__(name, cmd, work / f"{name}.log", ready="ready")


def start(*procs: Proc) -> None:
    for p in procs:
        p.wait_ready()


def stop(*procs: Proc) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()


# -- reading ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Got:
    status: int
    nbytes: int
    digest: str | None
    first_byte: float  # seconds from the request until the first body byte
    seconds: float  # seconds from the request until the last byte
    headers: dict[str, str]


_BUF = 4 << 20


async def http_get(url: str, path: str, *, verify: bool = True, timeout: float = 120.0) -> Got:
    """GET with a raw socket and one reused 4 MiB buffer; hashes the body (xxh3-128) when asked."""
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    t0 = time.perf_counter()
    async with asyncio.timeout(timeout):
        try:
            await loop.sock_connect(sock, (host, int(port)))
            await loop.sock_sendall(sock, f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            buf = bytearray(_BUF)
            view = memoryview(buf)
            head = b""
            while b"\r\n\r\n" not in head:
                n = await loop.sock_recv_into(sock, view)
                if not n:
                    raise ConnectionError("closed before the headers")
                head += bytes(view[:n])
            head, _, rest = head.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            length = int(headers.get("content-length", "0"))
            hasher = xxhash.xxh3_128() if verify else None
            got = len(rest)
            first = time.perf_counter() - t0 if got else None
            if hasher is not None:
                hasher.update(rest)
            while got < length:
                n = await loop.sock_recv_into(sock, view)
                if not n:
                    break
                if first is None:
                    first = time.perf_counter() - t0
                if hasher is not None:
                    hasher.update(view[:n])
                got += n
        finally:
            sock.close()
    return Got(status=status, nbytes=got, digest=hasher.hexdigest() if hasher else None,
               first_byte=first if first is not None else time.perf_counter() - t0,
               seconds=time.perf_counter() - t0, headers=headers)
