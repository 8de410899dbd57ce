"""Bounds on what clients can hold open: connections, idle time, slow uploads, shutdown.

A server accepts anyone on its port, so nothing a client does may hold a resource
without a bound (docs/PROTOCOL.md §Limits):

* **Idle and half-sent requests**: a connection with no request in progress (just
  opened, between keep-alive requests, or with its headers only partly sent) is
  closed after ``ServerLimits.idle_timeout`` (aiohttp's keep-alive timer, which also
  runs from the moment a connection opens).
* **Connections**: at most ``max_connections`` in all and ``max_connections_per_client``
  per client address. A new connection over either limit closes the oldest *idle*
  connection (of that address, or of anyone) to make room; only when every
  connection is busy is the new one refused. The default total is the process's
  descriptor limit (``RLIMIT_NOFILE``) less a reserve for files, so accepting never
  runs out of descriptors and a normal request gets in however many idle
  connections are held.
* **Uploads** keep at least ``min_upload_rate`` bytes/s on average (after a grace of
  ``upload_grace`` s) and never go silent for ``body_timeout`` s (``UploadPace``, used
  by the routes' body reader): a 1 byte/s upload is cut with a 408.
* **Errors aiohttp answers itself** (a malformed request line, headers over the size
  limits) carry the protocol's JSON error body like every other error.
* **Shutdown**: ``ConnectionGuard.abort_all`` cuts whatever is still open when the
  shutdown budget runs out (a reader that stopped reading cannot hold SIGTERM up).

``GuardedRunner`` is ``web.AppRunner`` with the guard wired into aiohttp's ``Server``
(which aiohttp builds itself in ``Application._make_handler``: its class is swapped
for ``GuardedServer``, which adds the connection accounting and the JSON errors).
"""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from deltasync.errors import RequestTimeoutError

log = logging.getLogger("deltasync.server.connections")

JSON = "application/json"
FD_RESERVE = 64  # descriptors kept for files (blobs being sent, temp files, the parent's sockets)


def default_max_connections(reserve: int = FD_RESERVE) -> int:
    """The descriptor limit less ``reserve`` (at least 16, at most 65536)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, min(soft - reserve, 1 << 16))


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLimits:
    """What a server bounds for its clients (see the module docstring). 0 disables a rate or a count."""

    idle_timeout: float = 15.0  # a connection with no request in progress (or half-sent headers) is closed
    body_timeout: float = 10.0  # an upload silent this long is cut (408)
    min_upload_rate: int = 64 << 10  # bytes/s an upload must average once past the grace
    upload_grace: float = 5.0  # seconds before the rate counts
    max_connections: int | None = None  # None: the descriptor limit less a reserve
    max_connections_per_client: int = 512

    def __post_init__(self) -> None:
        if not self.idle_timeout > 0 or not self.body_timeout > 0 or self.upload_grace < 0:
            raise ValueError(f"idle and body timeouts must be positive, found {self.idle_timeout}, {self.body_timeout}")
        if self.min_upload_rate < 0 or self.max_connections_per_client < 0:
            raise ValueError("the upload rate and the per-client connection limit must be >= 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, found {self.max_connections}")

    @property
    def connection_limit(self) -> int:
        return self.max_connections if self.max_connections is not None else default_max_connections()


class UploadPace:
    """The minimum pace of one upload: call ``got(n)`` per piece; ``wait_limit()`` is how long to wait for the next.

    Raises RequestTimeoutError when the average rate since the start (after the grace) is under the minimum."""

    __slots__ = ("limits", "start", "received")

    def __init__(self, limits: ServerLimits, *, clock=time.monotonic) -> None:
        self.limits = limits
        self.start = clock()
        self.received = 0

    def _owed(self, now: float) -> float:
        """Bytes the upload should have sent by ``now``."""
        lim = self.limits
        return max(0.0, now - self.start - lim.upload_grace) * lim.min_upload_rate

    def wait_limit(self, now: float | None = None) -> float:
        """Seconds to wait for the next piece: the body timeout, or less when the rate would fall short sooner."""
        lim = self.limits
        if not lim.min_upload_rate:
            return lim.body_timeout
        now = time.monotonic() if now is None else now
        # the moment the bytes already in stop covering the minimum rate
        short_at = self.start + lim.upload_grace + self.received / lim.min_upload_rate
        return max(0.05, min(lim.body_timeout, short_at - now + 0.05))

    def got(self, n: int, now: float | None = None) -> None:
        self.received += n
        self.check(now)

    def check(self, now: float | None = None) -> None:
        lim = self.limits
        now = time.monotonic() if now is None else now
        if lim.min_upload_rate and self.received < self._owed(now):
            secs = now - self.start
            raise RequestTimeoutError(f"upload too slow: {self.received} bytes in {secs:.1f} s, under the minimum "
                                      f"of {lim.min_upload_rate} bytes/s (--min-upload-rate)")

    def silent(self) -> RequestTimeoutError:
        """The error for a piece that did not come within ``wait_limit``."""
        try:
            self.check()
        except RequestTimeoutError as e:
            return e
        return RequestTimeoutError(f"the request body stalled for {self.limits.body_timeout:.0f} s")


class ConnectionGuard:
    """Every open connection of one server, by arrival; which are busy; per-address counts."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.max_total = limits.connection_limit
        self._open: dict[RequestHandler, tuple[object, str]] = {}  # handler -> (transport, address); arrival order
        self._busy: dict[RequestHandler, int] = {}
        self._per_addr: dict[str, int] = {}
        self.evicted = 0
        self.refused = 0

    @property
    def count(self) -> int:
        return len(self._open)

    def opened(self, handler: RequestHandler, transport) -> None:
        peer = transport.get_extra_info("peername")
        addr = peer[0] if isinstance(peer, tuple) and peer else str(peer)
        per = self.limits.max_connections_per_client
        if per and self._per_addr.get(addr, 0) >= per and not self._evict(addr):
            self._refuse(transport, f"{addr} holds {per} connections (--max-connections-per-client)")
            return
        if len(self._open) >= self.max_total and not self._evict(None):
            self._refuse(transport, f"{len(self._open)} connections open (--max-connections)")
            return
        self._open[handler] = (transport, addr)
        self._per_addr[addr] = self._per_addr.get(addr, 0) + 1

    def closed(self, handler: RequestHandler) -> None:
        entry = self._open.pop(handler, None)
        self._busy.pop(handler, None)
        if entry is not None:
            addr = entry[1]
            left = self._per_addr.get(addr, 1) - 1
            if left > 0:
                self._per_addr[addr] = left
            else:
                self._per_addr.pop(addr, None)

    def _evict(self, addr: str | None) -> bool:
        """Close the oldest idle connection (of ``addr``, or of anyone); False if none is idle."""
        for handler, (transport, a) in self._open.items():
            if handler in self._busy or (addr is not None and a != addr):
                continue
            self.closed(handler)
            transport.close()
            self.evicted += 1
            return True
        return False

    def _refuse(self, transport, why: str) -> None:
        self.refused += 1
        log.warning("connection refused: %s and none of them is idle", why)
        transport.abort()

    def enter(self, handler: RequestHandler | None) -> None:
        if handler is not None and handler in self._open:
            self._busy[handler] = self._busy.get(handler, 0) + 1

    def leave(self, handler: RequestHandler | None) -> None:
        n = self._busy.get(handler, 0) - 1
        if n > 0:
            self._busy[handler] = n
        else:
            self._busy.pop(handler, None)

    def abort_all(self) -> int:
        """Cut every connection still open and cancel its handler (the end of the shutdown budget: a handler
        blocked on a reader that stopped reading would otherwise run to its write timeout); returns how many."""
        n = 0
        for handler, (transport, _) in list(self._open.items()):
            self.closed(handler)
            transport.abort()
            task = getattr(handler, "_task_handler", None)  # aiohttp's task serving this connection
            if task is not None and not task.done():
                task.cancel()
            n += 1
        return n


GUARD = web.AppKey("connection_guard", ConnectionGuard)


@web.middleware
async def busy_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Marks the request's connection busy while its handler runs (an idle one may be evicted)."""
    guard = request.app.get(GUARD)
    if guard is None:
        return await handler(request)
    proto = request.protocol
    guard.enter(proto)
    try:
        return await handler(request)
    finally:
        guard.leave(proto)


_AIOHTTP_CODES = {400: "format", 413: "too_large", 414: "too_large", 431: "too_large", 408: "request_timeout",
                  501: "unsupported"}


class JsonErrorHandler(RequestHandler):
    """aiohttp's request handler with the errors it answers itself (bad requests) as the protocol's JSON."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        text = (message or (str(exc) if exc is not None else "") or "bad request").splitlines()[0][:300]
        log.debug("bad request from %s: %s", request.remote, text)
        body = {"error": {"status": status, "code": _AIOHTTP_CODES.get(status, "http"), "message": text}}
        resp = web.Response(status=status, body=json.dumps(body).encode(), content_type=JSON)
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """aiohttp's Server with the connection guard and the JSON error handler."""

    guard: ConnectionGuard

    def __call__(self) -> RequestHandler:
        return JsonErrorHandler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport) -> None:
        super().connection_made(handler, transport)
        self.guard.opened(handler, transport)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.guard.closed(handler)


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` whose server applies ``guard`` (its app's ``GUARD``) and the idle timeout."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs) -> None:
        kwargs.setdefault("keepalive_timeout", guard.limits.idle_timeout)
        super().__init__(app, **kwargs)
        self.guard = guard
        app[GUARD] = guard

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GuardedServer  # aiohttp builds it (Application._make_handler); same state, more methods
        server.guard = self.guard
        return server
