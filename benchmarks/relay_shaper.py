"""A delay-and-bandwidth-shaping TCP proxy for the relay benchmarks (the kernel here has no netem).

Each link listens on a port and forwards to a target port. Both directions are
shaped like a wire shared by all connections of the link: a chunk of L bytes that
arrives at t starts serializing when the wire is free, takes L / rate seconds, and
is delivered ``delay`` seconds after its last byte went on the wire. Up to rate x delay (plus 4 MiB) bytes may be in flight
per direction, so the proxy behaves like a long fat pipe whose TCP window is never
the limit (TCP's slow start across the delay is *not* modelled: each side of the
proxy is a loopback connection).

Run as a process: ``python benchmarks/relay_shaper.py --rate BYTES_PER_S --delay S
LISTEN:TARGET ...``; it prints ``ready`` once every link listens. uvloop, protocols,
no copies beyond the kernel's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys


class _Wire:
    """One direction of a link, shared by its connections: when it is next free to send."""

    def __init__(self, rate: float, delay: float) -> None:
        self.rate, self.delay = rate, delay
        self.next_free = 0.0


class _Direction:
    """One direction of one connection: paces ``src`` bytes over its wire into ``dst``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wire: _Wire) -> None:
        self.loop, self.wire = loop, wire
        self.delay = wire.delay
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self.pending: list[bytes] = []  # due before ``dst`` connected
        self.due: collections.deque[tuple[float, bytes | None]] = collections.deque()  # None: EOF
        self.timer: asyncio.TimerHandle | None = None
        self.eof_pending = False
        self.next_free = 0.0
        self.queued = 0
        self.high = int(wire.rate * wire.delay) + (4 << 20)
        self.src_paused = False
        self.dst_blocked = False
        self.gone = False  # dst closed: drop what is still due

    def feed(self, data: bytes) -> None:
        now = self.loop.time()
        start = max(now, self.wire.next_free)
        self.wire.next_free = self.next_free = start + len(data) / self.wire.rate
        self.queued += len(data)
        self._push(self.next_free + self.delay, data)
        self._flow()

    def feed_eof(self) -> None:
        self._push(max(self.loop.time(), self.next_free) + self.delay, None)

    def _push(self, when: float, data: bytes | None) -> None:
        # One FIFO and one timer per direction: timers of the loop round to milliseconds and
        # could reorder chunks due within the same millisecond.
        self.due.append((when, data))
        if self.timer is None:
            self.timer = self.loop.call_at(when, self._pump)

    def _pump(self) -> None:
        self.timer = None
        now = self.loop.time() + 0.0005
        while self.due and self.due[0][0] <= now:
            _, data = self.due.popleft()
            if data is None:
                self._emit_eof()
            else:
                self._emit(data)
        if self.due:
            self.timer = self.loop.call_at(self.due[0][0], self._pump)

    def attach(self, dst: asyncio.Transport) -> None:
        self.dst = dst
        for data in self.pending:
            dst.write(data)
        self.pending.clear()
        if self.eof_pending:
            self._emit_eof()

    def _emit(self, data: bytes) -> None:
        self.queued -= len(data)
        if self.gone:
            return
        if self.dst is None:
            self.pending.append(data)
        elif not self.dst.is_closing():
            self.dst.write(data)
        self._flow()

    def _emit_eof(self) -> None:
        if self.dst is None:
            self.eof_pending = True
        elif not self.dst.is_closing():
            if self.dst.can_write_eof():
                self.dst.write_eof()
            else:
                self.dst.close()

    def _flow(self) -> None:
        should_pause = self.queued > self.high or self.dst_blocked
        if self.src is None or self.src.is_closing():
            return
        if should_pause and not self.src_paused:
            self.src.pause_reading()
            self.src_paused = True
        elif not should_pause and self.src_paused:
            self.src.resume_reading()
            self.src_paused = False


class _Side(asyncio.Protocol):
    """Either end of a proxied connection: feeds what it reads into ``out``; ``inn`` writes to it."""

    def __init__(self, out: _Direction, inn: _Direction) -> None:
        self.out, self.inn = out, inn
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.out.src = transport
        transport.set_write_buffer_limits(high=4 << 20)
        self.inn.attach(transport)

    def data_received(self, data: bytes) -> None:
        self.out.feed(data)

    def eof_received(self):
        self.out.feed_eof()
        return True

    def pause_writing(self) -> None:
        self.inn.dst_blocked = True
        self.inn._flow()

    def resume_writing(self) -> None:
        self.inn.dst_blocked = False
        self.inn._flow()

    def connection_lost(self, exc) -> None:
        self.out.src = None
        self.inn.dst = None
        self.inn.gone = True
        if self.peer is not None and self.peer.transport is not None:
            loop = asyncio.get_running_loop()
            # let what is queued toward the peer drain first (it is due within next_free + delay)
            due = max(self.out.next_free - loop.time(), 0) + self.out.delay + 0.05
            loop.call_later(due, self.peer.transport.close)


async def start_link(listen_port: int, target_port: int, *, rate: float, delay: float,
                     host: str = "127.0.0.1") -> asyncio.AbstractServer:
    loop = asyncio.get_running_loop()
    up_wire, down_wire = _Wire(rate, delay), _Wire(rate, delay)

    def client_side() -> _Side:
        up = _Direction(loop, up_wire)  # client -> target
        down = _Direction(loop, down_wire)  # target -> client
        side = _Side(up, down)

        async def connect() -> None:
            try:
                _, target = await loop.create_connection(lambda: _Side(down, up), host, target_port)
            except OSError:
                if side.transport is not None:
                    side.transport.close()
                return
            target.peer, side.peer = side, target

        loop.create_task(connect())
        return side

    return await loop.create_server(client_side, host, listen_port, backlog=1024)


async def _main(args) -> None:
    servers = []
    for spec in args.links:
        listen, _, target = spec.partition(":")
        servers.append(await start_link(int(listen), int(target), rate=args.rate, delay=args.delay))
    print("ready", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, required=True, help="bytes per second, each direction of each connection")
    p.add_argument("--delay", type=float, default=0.0, help="one-way delay in seconds")
    p.add_argument("links", nargs="+", metavar="LISTEN:TARGET")
    args = p.parse_args()
    try:
        import uvloop
        uvloop.run(_main(args))
    except ImportError:
        asyncio.run(_main(args))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
