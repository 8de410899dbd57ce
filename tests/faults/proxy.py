"""A small asyncio TCP proxy that misbehaves on purpose, between two tiers of the tree.

It runs its own event loop on a daemon thread (so it outlives any test's loop) and
forwards 127.0.0.1:<port> to a target port. ``mode`` can be switched at any time:

- ``pass``      forward faithfully
- ``flip``      flip one random bit in a fraction ``rate`` of the chunks sent downstream
                (after the first ``skip`` bytes of each connection, so most flips land in bodies)
- ``truncate``  forward the first ``cut_after`` bytes of each downstream answer, then close
- ``length``    rewrite ``Content-Length: N`` in answers to N+delta (delta<0: the body is longer
                than announced; delta>0: the client waits for bytes that never come)
- ``stall``     accept connections, read requests, never answer (until mode changes or close)

``on_request(first_line)`` (optional) runs on the proxy's thread for each request line seen
upstream before it is forwarded; a fault scenario uses it to kill a server at the exact
moment a publisher starts a given request.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable

from hostile_peers import LoopServer  # the loop thread and server both hostile peers stand on

_CL = re.compile(rb"(?i)content-length:\s*(\d+)")
_REQ = re.compile(rb"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.[01]\r\n")
MODES = ("pass", "flip", "truncate", "length", "stall")


class FaultProxy(LoopServer):
    def __init__(self, target_port: int, *, mode: str = "pass", seed: int = 0, rate: float = 0.3,
                 skip: int = 400, cut_after: int = 1500, delta: int = 7,
                 on_request: Callable[[bytes, bytes], None] | None = None) -> None:
        self.target_port = target_port
        self.mode = mode
        self.rate, self.skip, self.cut_after, self.delta = rate, skip, cut_after, delta
        self.on_request = on_request
        self.rng = random.Random(seed)
        self.flipped = 0
        self.cut = 0
        self.connections = 0
        super().__init__("fault-proxy")
        self._writers: set[asyncio.StreamWriter] = set()
        self.start()

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, found {mode!r}")
        self.mode = mode
        if mode == "pass":
            self.drop_connections()  # stalled or poisoned keep-alive connections start over

    def retarget(self, port: int) -> None:
        self.target_port = port

    def drop_connections(self) -> None:
        def drop():
            for w in list(self._writers):
                w.transport.abort()
        self._loop.call_soon_threadsafe(drop)

    # -- internals ---------------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        up_w = None
        try:
            if self.mode == "stall":
                while self.mode == "stall" and not reader.at_eof():
                    try:
                        await asyncio.wait_for(reader.read(65536), 0.2)
                    except asyncio.TimeoutError:
                        pass
                return  # the client gave up, or the stall ended: start over on a new connection
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._writers.add(up_w)
            await asyncio.gather(self._up(reader, up_w), self._down(up_r, writer), return_exceptions=True)
        except OSError:
            pass
        finally:
            for w in (writer, up_w):
                if w is not None:
                    self._writers.discard(w)
                    w.transport.abort()

    async def _up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.on_request is not None:
                    for m in _REQ.finditer(data):
                        self.on_request(m.group(1), m.group(2))
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()

    async def _down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sent = 0
        try:
            while data := await reader.read(16384):
                mode = self.mode
                if mode == "stall":
                    await asyncio.sleep(3600)
                if mode == "flip" and sent + len(data) > self.skip and self.rng.random() < self.rate:
                    lo = max(0, self.skip - sent)
                    i = self.rng.randrange(lo, len(data))
                    b = bytearray(data)
                    b[i] ^= 1 << self.rng.randrange(8)
                    data = bytes(b)
                    self.flipped += 1
                elif mode == "length":
                    data = _CL.sub(lambda m: b"Content-Length: %d" % max(0, int(m.group(1)) + self.delta), data)
                elif mode == "truncate" and sent + len(data) > self.cut_after:
                    data = data[:max(0, self.cut_after - sent)]
                    writer.write(data)
                    await writer.drain()
                    self.cut += 1
                    return
                sent += len(data)
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()
