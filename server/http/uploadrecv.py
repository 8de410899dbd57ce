"""An upload's body received by the event loop straight into one reused buffer (the origin's intake).

Through aiohttp, every piece of a request body is copied twice in user space before the handler sees
it (the loop's read buffer into a ``bytes``, the HTTP parser's body slice into another), in pieces of
at most the loop's read size, each handed over through a ``StreamReader`` and an ``async for``: for a
keyframe that was most of the origin's intake CPU that was not the unavoidable socket copy, hashing
and page-cache write. For a large body (``DIRECT_MIN`` bytes or more, plain TCP, a ``Content-Length``)
the route hands the connection's body to :func:`receive`: the transport's protocol is switched
(``set_protocol``) to an ``asyncio.BufferedProtocol`` whose ``recv_into`` fills one 1 MiB buffer, and
each filled piece goes to ``feed`` (hash and write, ``intake.Upload.feed``) while it is in the core's
cache. Whatever aiohttp had already taken in of the body is fed first, so the bytes keep their order.

The HTTP parser never sees the rest of the body, so the connection cannot carry another request: it is
closed once the answer is sent (``RequestHandler.close``); a publisher opens a new one per large blob
(a keyframe has a few). aiohttp's handler stays the connection's owner for everything else (writing the
answer, flow control, ``connection_lost``), which this protocol forwards to it. The minimum upload pace
(``UploadPace``) bounds every wait as it does for pieces through aiohttp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from .blobget import BUFFER, RECEIVE_BUFFER
from .connections import UploadPace

#: bodies at least this long are received directly (smaller ones through aiohttp: the connection stays alive)
DIRECT_MIN = 4 << 20
#: every upload's pieces are received into the process's one receive buffer (``BUFFER`` bytes, shared with the relay
#: fetch in server/http/blobget.py): each is fed (hashed and written) before the event loop reads the next, whatever the
#: connection, so one buffer stays in the core's L2 where one per upload did not


def usable(request: web.BaseRequest) -> bool:
    """Whether :func:`receive` can take this request's body: plain TCP, a large ``Content-Length``, no
    ``Expect`` or chunked transfer coding, and a transport that can switch protocols."""
    t = request.transport
    n = request.content_length
    return (t is not None and not t.is_closing() and n is not None and n >= DIRECT_MIN
            and hasattr(t, "set_protocol") and t.get_extra_info("sslcontext") is None
            and t.get_extra_info("socket") is not None and "Expect" not in request.headers
            and "chunked" not in request.headers.get("Transfer-Encoding", "").lower())


class _Body(asyncio.BufferedProtocol):
    """The connection's protocol while (and after) its body is received here; the rest goes to aiohttp's."""

    def __init__(self, handler, transport, left: int, feed: Callable[[memoryview], None], pace: UploadPace) -> None:
        self._handler = handler  # aiohttp's RequestHandler: writes the answer, owns the connection
        self._transport = transport
        self._left = left
        self._feed = feed
        self._pace = pace
        self._view = RECEIVE_BUFFER
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()
        self.last = self._loop.time()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view[: max(1, min(BUFFER, self._left))]

    def buffer_updated(self, n: int) -> None:
        if self.done.done():
            return  # bytes after the body (reading is paused once it is in): not ours to take
        self.last = self._loop.time()
        try:
            if n > self._left:
                raise ConnectionResetError("the client sent more than its Content-Length")
            self._feed(self._view[:n])
            self._left -= n
            self._pace.got(n)
        except BaseException as e:
            self._fail(e)
            return
        if self._left == 0:
            self._transport.pause_reading()
            self.done.set_result(None)

    def _fail(self, e: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(e)
            self.done.exception()  # retrieved: the waiter may be gone
        if not self._transport.is_closing():
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        self._fail(ConnectionResetError("the client closed the connection mid-body"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionResetError(f"connection lost mid-body ({exc or 'closed'})"))
        self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()


async def receive(request: web.BaseRequest, feed: Callable[[memoryview], None], pace: UploadPace) -> None:
    """Feed the whole body of ``request`` (``usable``) to ``feed``, in order, in pieces of at most ``BUFFER``
    bytes received straight into one buffer. Raises ConnectionResetError for a body cut short, the pace's
    RequestTimeoutError for a slow or silent one, or what ``feed`` raised. The connection closes after the
    answer whatever happens."""
    handler, transport, content = request.protocol, request.transport, request.content
    handler.close()  # the parser will not see the rest of this body: no other request on this connection
    try:
        # what aiohttp has already taken in (its first read usually holds the head and the body's first bytes)
        first = content.read_nowait(-1)
        left = request.content_length - len(first)
        body = _Body(handler, transport, left, feed, pace)
        if left > 0:
            transport.set_protocol(body)  # no await since read_nowait: no byte can have gone to aiohttp meanwhile
        if first:
            feed(memoryview(first))
            pace.got(len(first))
        if left > 0:
            transport.resume_reading()
            loop = asyncio.get_running_loop()
            while not body.done.done():
                limit = pace.wait_limit()
                await asyncio.wait((body.done,), timeout=limit)
                if not body.done.done() and loop.time() - body.last >= limit:
                    body._fail(pace.silent())
            body.done.result()
    finally:
        content.feed_eof()  # aiohttp neither lingers for the rest of the body nor waits on it; the connection closes
