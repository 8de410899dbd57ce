"""Hostile peers for the tests of issue 27: a real asyncio TCP server on 127.0.0.1 (ephemeral port, its own
thread and loop) in front of a real server. Each connection carries one request; ``plan(method, target)``
says how it is answered:

* ``PROXY``: passed through both ways as the bytes come (event streams and long-polls included);
* ``DripBody(interval)``: the upstream's whole answer is fetched, its head sent at once, then its body one
  byte per ``interval`` seconds (TUF's slow retrieval);
* ``DripHead(interval)``: the same answer, head included, one byte per ``interval``;
* ``Fixed(status, headers, body)``: this answer at once, the upstream never asked (a replayed head);
* ``Swap(target)``: the upstream's answer to another target (mix-and-match: another blob under this id);
* ``Tamper()``: the upstream's answer with one body byte flipped (arbitrary installation);
* ``Endless(status, headers, chunk, after_upstream)``: a head, then ``chunk`` again and again until the client
  hangs up (endless data); ``after_upstream``: the upstream's whole answer first (a body longer than declared).

``requests`` records (monotonic time, method, target) of every request, for rate checks. The same peer serves
the tests of issue 27 and the fault campaign's hostile-mirror scenarios (tests/faults/hostile.py); byte-level
faults on a kept-alive stream (bit flips, cuts, stalls) are tests/faults/proxy.py's ``FaultProxy``, on the same
:class:`LoopServer`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit


class _Proxy:
    pass


PROXY = _Proxy()


@dataclass(frozen=True)
class DripBody:
    interval: float = 1.0


@dataclass(frozen=True)
class DripHead:
    interval: float = 1.0


@dataclass(frozen=True)
class Fixed:
    status: int
    headers: dict
    body: bytes


@dataclass(frozen=True)
class Swap:
    target: str


@dataclass(frozen=True)
class Tamper:
    at: float = 0.5  # where in the body, as a fraction of its length


@dataclass(frozen=True)
class Endless:
    status: int = 200
    headers: tuple = (("Content-Type", "application/octet-stream"),)
    chunk: bytes = b"\0" * 65536
    after_upstream: bool = False
    pause: float = 0.005  # between chunks: ~12 MB/s at the default chunk, not a CPU burner


class LoopServer:
    """An asyncio TCP server on 127.0.0.1 (an ephemeral port) with its own event loop on a daemon thread, so it
    outlives any test's loop: what both hostile peers stand on (:class:`HostilePeer`, and the fault campaign's
    byte-level ``faults.proxy.FaultProxy``). A subclass answers each connection in ``handle``; ``close`` cancels
    every connection still open."""

    def __init__(self, name: str) -> None:
        self.url = ""
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self):
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0, backlog=2048)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    async def _stop(self) -> None:
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self.handle(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()


class HostilePeer(LoopServer):
    def __init__(self, upstream: str, plan: Callable[[str, str], object]) -> None:
        super().__init__("hostile-peer")
        u = urlsplit(upstream)
        self.up_host, self.up_port = u.hostname, u.port
        self.plan = plan
        self.requests: list[tuple[float, str, str]] = []

    def __enter__(self) -> HostilePeer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def count(self, pred: Callable[[str, str], bool] = lambda m, t: True, since: float = 0.0) -> int:
        return sum(1 for at, m, t in list(self.requests) if at >= since and pred(m, t))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        self.requests.append((time.monotonic(), method, target))
        headers = [ln for ln in lines[1:] if ln and not ln.lower().startswith(("connection:", "keep-alive:"))]
        length = next((int(ln.split(":", 1)[1]) for ln in headers if ln.lower().startswith("content-length:")), 0)
        body = await reader.readexactly(length) if length else b""
        plan = self.plan(method, target)
        if isinstance(plan, Fixed):
            hs = {"Content-Length": str(len(plan.body)), "Connection": "close", **plan.headers}
            writer.write((f"HTTP/1.1 {plan.status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hs.items())
                          + "\r\n").encode("latin-1") + plan.body)
            await writer.drain()
            return
        if isinstance(plan, Endless) and not plan.after_upstream:
            await self._endless(writer, plan)
            return
        first = f"{method} {plan.target} HTTP/1.1" if isinstance(plan, Swap) else lines[0]
        up_r, up_w = await asyncio.open_connection(self.up_host, self.up_port)
        try:
            up_w.write(("\r\n".join([first, *headers, "Connection: close"]) + "\r\n\r\n").encode("latin-1") + body)
            await up_w.drain()
            if plan is PROXY or isinstance(plan, Swap):
                while piece := await up_r.read(1 << 16):
                    writer.write(piece)
                    await writer.drain()
                return
            answer = await up_r.read(-1)
        finally:
            up_w.close()
        split = answer.find(b"\r\n\r\n") + 4
        if isinstance(plan, Tamper):
            if len(answer) > split:
                i = split + min(int((len(answer) - split) * plan.at), len(answer) - split - 1)
                answer = answer[:i] + bytes([answer[i] ^ 0x01]) + answer[i + 1:]
            writer.write(answer)
            await writer.drain()
            return
        if isinstance(plan, Endless):
            writer.write(answer)
            await self._endless(writer, plan, head=False)
            return
        if isinstance(plan, DripBody):
            writer.write(answer[:split])
            await writer.drain()
            rest = answer[split:]
        else:
            rest = answer
        for i in range(len(rest)):
            writer.write(rest[i:i + 1])
            await writer.drain()
            await asyncio.sleep(plan.interval)


    @staticmethod
    async def _endless(writer: asyncio.StreamWriter, plan: Endless, *, head: bool = True) -> None:
        if head:
            writer.write((f"HTTP/1.1 {plan.status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in plan.headers)
                          + "Connection: close\r\n\r\n").encode("latin-1"))
        while not writer.is_closing():
            writer.write(plan.chunk)
            await writer.drain()
            await asyncio.sleep(plan.pause)


def drip_blobs(kind: type = DripBody, interval: float = 1.0) -> Callable[[str, str], object]:
    """A plan: blob GETs dripped, everything else passed through."""
    def plan(method: str, target: str) -> object:
        return kind(interval) if method == "GET" and target.startswith("/v1/blobs/") else PROXY
    return plan
