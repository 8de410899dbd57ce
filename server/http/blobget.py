"""A relay's GET of one blob body from a parent, received straight into a reused buffer.

The cold path of a relay is receive, hash, write, forward. Through aiohttp's client
every piece of a body is copied twice in user space (the event loop's read buffer into
a ``bytes``, the HTTP parser's body slice into another) and handed over through a
``StreamReader`` at a few Python calls per piece. Here an ``asyncio.BufferedProtocol``
lets the event loop ``recv_into`` one 1 MiB buffer shared by every connection (it stays in a
core's L2 cache while the piece is hashed and written), and each filled piece goes to the
caller's ``on_body(memoryview)`` at once (the fetcher hashes it and writes it to its temp
file) before the buffer is reused: the socket copy is the only copy before the page
cache. Connections are kept alive per parent (HTTP/1.1), so a delta's small blobs
do not pay a new handshake each, as with aiohttp's pool.

The head is read by the core's one HTTP head reader (``deltasync.httphead``: ``Content-Length``
required, chunked bodies refused, a 206's ``Content-Range`` checked against the Range asked; a
malformed head is its ``HeadError``, an ``UpstreamError``: the parent is failed over). HTTPS
parents, and anything this client does not speak, go through aiohttp (``supports``). Every wait
has a timeout: the connect, the whole head (however slowly it is dripped), silence on the socket (``read``), and the
body's minimum rate (``deltasync.retry.Pace``: a parent that drips is failed over, the fetch resumed
from the next parent with ``Range``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

from deltasync.errors import UpstreamError, UpstreamTimeout
from deltasync.httphead import MAX_HEAD, HeadError, Headers, check_range, read_head
from deltasync.retry import DEFAULT_MIN_RATE, DEFAULT_RATE_GRACE, Pace

#: Each piece handed to ``on_body`` is at most this long (what one ``recv_into`` may fill).
BUFFER = 1 << 20
IDLE_PER_PARENT = 8

#: the body pieces of every connection are received into this one buffer (the event loop's thread takes each in,
#: and ``on_body`` hashes and writes it, before it reads the next: one buffer stays in the core's L2, where one
#: per connection, a blob's shards side by side, did not); a connection's own buffer holds only its answer's head
#: and what came with it
RECEIVE_BUFFER = memoryview(bytearray(BUFFER))  # also the origin's upload intake's (server/http/uploadrecv.py)


class BlobResponse:
    """The head of a parent's answer: the status and the headers (case-insensitive names)."""

    __slots__ = ("status", "headers")

    def __init__(self, status: int, headers: Headers) -> None:
        self.status = status
        self.headers = headers

    @property
    def content_length(self) -> int | None:
        v = self.headers.get("content-length")
        return int(v) if v is not None and v.isdigit() else None


class _Conn(asyncio.BufferedProtocol):
    """One keep-alive connection to a parent; one request at a time."""

    def __init__(self) -> None:
        self._buf = bytearray(BUFFER)
        self._view = memoryview(self._buf)
        self._fill = 0
        self._scanned = 0  # bytes of the current head searched for its end so far
        self._offset = 0  # the blob byte the current request asked from
        self._where = ""  # the current request's URL, named in the errors
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.received = 0  # bytes of the current answer (head included)
        self.last_activity = 0.0
        self._loop = asyncio.get_running_loop()
        self._head: asyncio.Future[BlobResponse] | None = None
        self._done: asyncio.Future[None] | None = None
        self._left = 0  # body bytes still expected
        self.length = 0  # the current answer's Content-Length
        self._on_body: Callable[[memoryview], None] | None = None
        self._error: BaseException | None = None
        self._paused = False
        self._overflow = False
        self._shared = False  # the last get_buffer handed out the shared buffer (the body, delivered at once)
        self.reusable = False

    # -- protocol callbacks ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._fill == 0 and self._done is not None and not self._done.done() and self._left > 0:
            self._shared = True  # the body, asked for: straight to on_body from the shared buffer
            return RECEIVE_BUFFER
        self._shared = False
        if self._fill >= len(self._buf):  # cannot happen (reading pauses first); never overwrite held bytes
            self._overflow = True
            return memoryview(bytearray(1))
        return self._view[self._fill:]

    def buffer_updated(self, n: int) -> None:
        self.last_activity = self._loop.time()
        self.received += n
        if self._overflow:
            self._abort(UpstreamError("receive buffer overflow"))
            return
        if self._shared:
            self._shared = False
            try:
                if n > self._left:
                    raise UpstreamError("the parent sent more bytes than its Content-Length")
                self._on_body(RECEIVE_BUFFER[:n])
                self._left -= n
                if self._left == 0:
                    self._done.set_result(None)
            except BaseException as e:  # on_body failed (the disk, say): end this answer with it
                self._abort(e)
            return
        self._fill += n
        try:
            if self._head is not None and not self._head.done():
                self._parse_head()
            elif self._done is not None and not self._done.done():
                self._deliver()
            elif self._head is not None and self._done is None:
                # the head is parsed and its waiter has not asked for the body yet: keep the bytes
                if self._fill >= len(self._buf) // 2 and not self._paused:
                    self._paused = True
                    self.transport.pause_reading()
            else:  # bytes nobody asked for: the connection is out of step
                self._abort(UpstreamError("the parent sent bytes outside an answer"))
        except BaseException as e:  # on_body failed (the disk, say): end this answer with it
            self._abort(e)

    def eof_received(self) -> bool:
        self._abort(UpstreamError("the parent closed the connection mid-answer"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._abort(UpstreamError(f"connection to the parent lost mid-answer ({exc or 'closed'})"))

    # -- one request ---------------------------------------------------------------------------
    def start(self, request: bytes, *, offset: int = 0, where: str = "") -> asyncio.Future[BlobResponse]:
        """Send ``request`` (a GET from blob byte ``offset``, ``where`` its URL for the errors); the future ends
        with the answer's head."""
        self._head = self._loop.create_future()
        self._offset, self._where = offset, where
        self._scanned = 0
        self._done = None
        self._error = None
        self._fill = 0
        self.received = 0
        self.reusable = False
        self.last_activity = self._loop.time()
        self.transport.write(request)
        return self._head

    def read_body(self, on_body: Callable[[memoryview], None]) -> asyncio.Future[None]:
        """Deliver the body (``Content-Length`` bytes) to ``on_body``; the future ends with it."""
        self._on_body = on_body
        self._done = self._loop.create_future()
        try:
            if self._fill or self._left == 0:
                self._deliver()
            if not self._done.done() and self._error is not None:
                raise self._error  # the connection ended before the body was asked for
        except BaseException as e:
            self._abort(e)
            if not self._done.done():
                self._done.set_exception(e)
                self._done.exception()
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return self._done

    def _parse_head(self) -> None:
        got = read_head(self._buf, filled=self._fill, scanned=self._scanned, max_bytes=MAX_HEAD, where=self._where)
        if got is None:
            self._scanned = self._fill
            return
        head, end = got
        if head.content_length is None:  # a chunked error answer, or one read to the close: its body is not read
            raise HeadError(f"{self._where}: the parent's {head.status} answer has no Content-Length")
        if head.status in (200, 206):
            check_range(head, self._offset, where=self._where)
        resp = BlobResponse(head.status, head.headers)
        self._left = self.length = head.content_length
        self.reusable = head.keep_alive
        rest = self._fill - end
        if rest:
            self._buf[:rest] = self._buf[end:self._fill]  # at most one read's worth, once per answer
        self._fill = rest
        self._head.set_result(resp)

    def _deliver(self) -> None:
        n = min(self._fill, self._left)
        if n:
            self._on_body(self._view[:n])
            self._left -= n
        if self._fill > n:
            raise UpstreamError("the parent sent more bytes than its Content-Length")
        self._fill = 0
        if self._left == 0:
            self._done.set_result(None)

    def _abort(self, e: BaseException) -> None:
        self.reusable = False
        if self._error is None:
            self._error = e
        for fut in (self._head, self._done):
            if fut is not None and not fut.done():
                fut.set_exception(e)
                fut.exception()  # retrieved here: the waiter may be gone (timed out)
                break
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class BlobGetter:
    """GETs blob bodies from plain-HTTP parents into ``on_body`` callbacks; a few idle connections kept per parent."""

    def __init__(self, *, connect_timeout: float, read_timeout: float, user_agent: str,
                 head_timeout: float | None = None, read_token: str | None = None,
                 min_rate: float = DEFAULT_MIN_RATE, rate_grace: float = DEFAULT_RATE_GRACE) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        #: a body must average ``min_rate`` bytes/s once ``rate_grace`` seconds have passed (``FellBehind``)
        self.min_rate, self.rate_grace = min_rate, rate_grace
        #: the status line and headers must all come within this of the request, however they are dripped (the
        #: time-to-first-byte limit); None: read_timeout
        self.head_timeout = read_timeout if head_timeout is None else head_timeout
        self.user_agent = user_agent
        self._read_token = read_token  # sent to parents that require read tokens; never logged
        self._idle: dict[str, list[_Conn]] = {}

    @staticmethod
    def supports(parent: str) -> bool:
        u = urlsplit(parent)
        return u.scheme == "http" and bool(u.hostname) and u.path in ("", "/") and not u.query

    async def get(self, parent: str, blob_id: str, offset: int, *,
                  on_head: Callable[[BlobResponse], bool], on_body: Callable[[memoryview], None],
                  min_rate: float | None = None) -> None:
        """Ask ``parent`` for the blob from ``offset``; ``on_head`` sees the answer's head and returns whether
        to read its body (else the connection is dropped); then every body piece goes to ``on_body``.
        A reused connection the parent had closed meanwhile is retried once on a new one."""
        u = urlsplit(parent)
        host, port = u.hostname, u.port or 80
        hostport = f"{host}:{port}" if u.port else host
        lines = [f"GET /v1/blobs/{blob_id} HTTP/1.1", f"Host: {hostport}", f"User-Agent: {self.user_agent}",
                 "Accept-Encoding: identity"]
        if offset:
            lines.append(f"Range: bytes={offset}-")
        if self._read_token:
            lines.append(f"Authorization: Bearer {self._read_token}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        while True:
            conn, reused = await self._connection(parent, host, port)
            try:
                head = conn.start(request, offset=offset, where=f"{parent.rstrip('/')}/v1/blobs/{blob_id}")
                resp = await self._wait(conn, head, self.head_timeout,
                                        deadline=asyncio.get_running_loop().time() + self.head_timeout)
            except UpstreamError:
                conn.close()
                if reused and conn.received == 0:
                    continue  # a stale keep-alive connection: once more on a fresh one
                raise
            except BaseException:
                conn.close()
                raise
            break
        try:
            if not on_head(resp):
                conn.close()
                return
            pace = Pace(min_rate=min_rate or self.min_rate, grace=self.rate_grace, start=asyncio.get_running_loop().time(),
                        what=f"{parent}: blob {blob_id}'s body")
            await self._wait(conn, conn.read_body(on_body), pace=pace)
        except BaseException:
            conn.close()
            raise
        if conn.reusable and not conn.closed:
            idle = self._idle.setdefault(parent, [])
            if len(idle) < IDLE_PER_PARENT:
                idle.append(conn)
                return
        conn.close()

    async def _connection(self, parent: str, host: str, port: int) -> tuple[_Conn, bool]:
        idle = self._idle.get(parent)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, host, port), self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"could not connect to {parent} within {self.connect_timeout:.0f} s") from None
        except OSError as e:
            raise UpstreamError(f"could not connect to {parent}: {e}") from None
        return conn, False

    async def _wait(self, conn: _Conn, fut: asyncio.Future, limit: float | None = None, *,
                    deadline: float | None = None, pace: Pace | None = None):
        """Wait for ``fut``; UpstreamTimeout after ``limit`` (default ``read_timeout``) seconds in which no byte
        arrived, or at ``deadline`` (loop time) whatever arrived; FellBehind when the body falls behind
        ``pace``."""
        loop = asyncio.get_running_loop()
        limit = self.read_timeout if limit is None else limit
        while True:
            now = loop.time()
            left = conn.last_activity + limit - now
            if deadline is not None and deadline - now < left:
                left = deadline - now
                if left <= 0:
                    raise UpstreamTimeout(f"the parent did not send a whole answer head within {limit:.0f} s")
            if pace is not None:
                got = conn.length - conn._left
                pace.check(got, now)
                left = min(left, pace.left(got, now) + 1e-3)
            if left <= 0:
                raise UpstreamTimeout(f"the parent sent nothing for {limit:.0f} s")
            done, _ = await asyncio.wait((fut,), timeout=left)
            if done:
                return fut.result()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
