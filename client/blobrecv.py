"""One blob GET whose body the event loop receives straight into its final place (``recv_into``).

Through aiohttp every piece of a body is copied twice in user space (the loop's read into a
``bytes``, the HTTP parser's body slice into another) before the caller can copy it to where it
belongs. A keyframe shard of ``subscribe --out`` belongs in the new file's map, so here an
``asyncio.BufferedProtocol`` asks the caller's :class:`BlobSink` where the next body bytes go
(``buffer(offset)``: a writable view of the map, at most ``MAX_PIECE`` bytes) and the kernel's
socket copy writes them there; ``received(offset, n)`` follows each read while the bytes are in
the core's cache (the caller hashes and fingerprints them). The socket copy is the only copy.

The same relay-side idea is ``server/http/blobget.py`` (server/ and client/ never import each other).
The head is read by the core's one HTTP head reader (``deltasync.httphead``: ``Content-Length`` required
on a 200/206, chunked blob bodies refused, a 206's ``Content-Range`` checked against the Range asked);
an error answer's body (at most ``MAX_ERROR`` bytes) is read into memory and returned for the caller
to raise. One request per connection (a keyframe has
a few large shards; there is nothing to gain from keeping connections alive). Plain ``http://``
URLs only (``supports``); anything else goes through aiohttp.

Every wait is bounded: the connect, the whole head (``ttfb``, however slowly it is dripped), silence on
the socket (``read``), the body's minimum rate (``min_rate`` after a ``grace``) and the whole request
(``total``).
"""

from __future__ import annotations

import asyncio
from typing import Protocol
from urllib.parse import urlsplit

from deltasync.errors import IntegrityError, UpstreamError, UpstreamTimeout
from deltasync.httphead import MAX_HEAD, Headers, check_range, read_head
from deltasync.retry import DEFAULT_MIN_RATE, DEFAULT_RATE_GRACE, Pace

MAX_ERROR = 64 << 10
#: the most bytes one ``recv_into`` writes before ``received`` runs (they stay in a core's L2 cache)
MAX_PIECE = 1 << 20


class BlobSink(Protocol):
    """Where a blob's bytes go as they arrive, in order from byte 0."""

    def buffer(self, offset: int) -> memoryview:
        """Writable room for the blob's bytes from ``offset`` on (at least one byte while ``offset`` is below
        the blob's size)."""
        ...

    def received(self, offset: int, n: int) -> None:
        """Bytes ``[offset, offset + n)`` are now in the room the last ``buffer(offset)`` gave."""
        ...

    def restart(self) -> None:
        """The bytes so far are discarded: the blob starts again from byte 0."""
        ...


class Answer:
    """A blob answer's head: status, headers, the first body byte's offset in the blob and the blob's size
    (both from ``Content-Range`` on a 206, 0 and ``Content-Length`` on a 200); ``error_body`` for others."""

    __slots__ = ("status", "headers", "start", "total", "error_body")

    def __init__(self, status: int, headers: Headers) -> None:
        self.status = status
        self.headers = headers
        self.start = 0
        self.total: int | None = None
        self.error_body = b""


class _Conn(asyncio.BufferedProtocol):
    def __init__(self, sink: BlobSink, offset: int, total: int | None, where: str = "") -> None:
        self._loop = asyncio.get_running_loop()
        self._where = where  # the URL asked, named in the errors
        self._sink = sink
        self._total = total  # the blob's size the caller knows (its manifest's); None: the server's word
        self._offset = offset  # the blob byte the next body byte is
        self._scratch = bytearray(MAX_HEAD)
        self._fill = 0
        self._scanned = 0  # bytes of the head searched for its end so far
        self._answer: Answer | None = None
        self._left = 0  # body bytes still expected
        self._in_sink = False  # the last get_buffer handed out the sink's room
        self._failed: BaseException | None = None  # the sink's buffer() raised (reported at buffer_updated)
        self.head: asyncio.Future[Answer] = self._loop.create_future()
        self.done: asyncio.Future[None] = self._loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.last_activity = self._loop.time()
        self.body_bytes = 0  # body bytes that went into the sink

    # -- protocol callbacks ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        a = self._answer
        if a is not None and a.status in (200, 206) and self._left and not self.done.done() and self._failed is None:
            try:
                room = self._sink.buffer(self._offset)
            except BaseException as e:  # never into the transport: it would only say "fatal error"
                self._failed = e
            else:
                self._in_sink = True
                return room[:min(len(room), self._left, MAX_PIECE)]
        self._in_sink = False
        if self._fill >= len(self._scratch):  # cannot happen (heads and error bodies are bounded first)
            return memoryview(bytearray(1))
        return memoryview(self._scratch)[self._fill:]

    def buffer_updated(self, n: int) -> None:
        self.last_activity = self._loop.time()
        try:
            if self._failed is not None:
                raise self._failed
            if self._in_sink:
                self._sink.received(self._offset, n)
                self._offset += n
                self._left -= n
                self.body_bytes += n
                if self._left == 0:
                    self._finish()
                return
            self._fill += n
            if self._answer is None:
                self._parse_head()
            elif self._answer.status not in (200, 206):
                self._error_body()
            else:
                raise UpstreamError("the server sent bytes beyond its answer")
        except BaseException as e:  # the sink failed (its checks), or a malformed answer
            self._abort(e)

    def eof_received(self) -> bool:
        self._abort(UpstreamError("the server closed the connection mid-answer"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._abort(UpstreamError(f"connection lost mid-answer ({exc or 'closed'})"))

    # -- parsing ---------------------------------------------------------------------------------
    def _parse_head(self) -> None:
        got = read_head(self._scratch, filled=self._fill, scanned=self._scanned, max_bytes=MAX_HEAD, where=self._where)
        if got is None:
            self._scanned = self._fill
            return
        head, end = got
        a = Answer(head.status, head.headers)
        if a.status in (200, 206):  # Content-Length is there (read_head's rule), a 206's range runs from our offset
            a.start, a.total = check_range(head, self._offset, where=self._where)
            self._left = head.content_length
        elif head.content_length is not None:
            self._left = head.content_length
        else:
            self._left = MAX_ERROR  # an error answer's body, chunked or to the close: read until the connection closes
        if a.status in (200, 206) and self._total is not None and a.total != self._total:
            raise IntegrityError(f"the server says the blob has {a.total} bytes, its manifest says {self._total}")
        self._answer = a
        rest = memoryview(self._scratch)[end:self._fill]
        self._fill = 0
        if a.status not in (200, 206):
            self._scratch[:len(rest)] = bytes(rest)
            self._fill = len(rest)
            self.head.set_result(a)
            self._error_body()
            return
        if a.status == 200 and self._offset:  # the server ignored Range: from byte 0 again
            self._sink.restart()
            self._offset = 0
        self.head.set_result(a)
        # body bytes that came with the head: one copy, once per answer
        if len(rest) > self._left:
            raise UpstreamError("the server sent more bytes than its Content-Length")
        view = memoryview(rest.tobytes())
        while view:
            room = self._sink.buffer(self._offset)
            k = min(len(room), len(view))
            room[:k] = view[:k]
            self._sink.received(self._offset, k)
            self._offset += k
            self._left -= k
            self.body_bytes += k
            view = view[k:]
        if self._left == 0:
            self._finish()

    def _error_body(self) -> None:
        if self._fill >= self._left or self._fill >= MAX_ERROR:
            self._answer.error_body = bytes(self._scratch[:min(self._fill, MAX_ERROR)])
            self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def _abort(self, e: BaseException) -> None:
        if self._answer is not None and self._answer.status not in (200, 206) and not self.done.done():
            self._answer.error_body = bytes(self._scratch[:min(self._fill, MAX_ERROR)])  # the server closed: its body
            self.done.set_result(None)
        for fut in (self.head, self.done):
            if not fut.done():
                fut.set_exception(e)
                fut.exception()  # retrieved: the waiter may be gone (timed out)
                break
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def supports(url: str) -> bool:
    """Plain HTTP to a host (no TLS, no path prefix): what :func:`receive` speaks."""
    u = urlsplit(url)
    return u.scheme == "http" and bool(u.hostname) and u.path in ("", "/") and not u.query and u.username is None


async def receive(url: str, path: str, sink: BlobSink, offset: int, *, size: int | None, headers: dict[str, str],
                  connect: float, ttfb: float, read: float, total: float, on_head=None,
                  min_rate: float = DEFAULT_MIN_RATE, grace: float = DEFAULT_RATE_GRACE) -> Answer:
    """GET ``url + path`` from blob byte ``offset`` (a Range request when it is not 0); the body goes into
    ``sink``; ``size``: the blob's size as the caller knows it (an answer saying otherwise: IntegrityError,
    before a byte goes to the sink). Returns the answer (its ``error_body`` filled for a status other than 200/206, whose body is not
    the blob's). UpstreamTimeout/UpstreamError for a server that is slow, silent, cuts the body or breaks
    the protocol: the whole head (status line and headers) within ``ttfb`` of the request, however it is
    dripped; the body at ``min_rate`` bytes/s after a ``grace`` (``deltasync.retry.Pace``: ``FellBehind``);
    ``on_head(answer)`` runs when the head is in (it may raise to refuse the answer)."""
    u = urlsplit(url)
    host, port = u.hostname, u.port or 80
    lines = [f"GET {path} HTTP/1.1", f"Host: {u.netloc}", "Accept-Encoding: identity", "Connection: close"]
    if offset:
        lines.append(f"Range: bytes={offset}-")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total
    try:
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: _Conn(sink, offset, size, url + path), host, port), connect)
    except asyncio.TimeoutError:
        raise UpstreamTimeout(f"could not connect to {url} within {connect:g} s") from None
    try:
        conn.transport.write(request)
        conn.last_activity = loop.time()
        answer = await _wait(conn, conn.head, ttfb, min(deadline, loop.time() + ttfb), url, "the answer's head")
        if on_head is not None:
            on_head(answer)
        pace = Pace(min_rate=min_rate, grace=grace, start=loop.time(), what=f"{url}{path}: the body")
        await _wait(conn, conn.done, read, deadline, url, "more of the body", pace)
        return answer
    finally:
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.close()


async def _wait(conn: _Conn, fut: asyncio.Future, silence: float, deadline: float, url: str, what: str,
                pace: Pace | None = None):
    """``fut``'s result; UpstreamTimeout after ``silence`` seconds with no byte, or at ``deadline``; FellBehind
    when the body's bytes fall behind ``pace``."""
    loop = asyncio.get_running_loop()
    while True:
        now = loop.time()
        left = min(conn.last_activity + silence, deadline) - now
        if pace is not None:
            pace.check(conn.body_bytes, now)
            left = min(left, pace.left(conn.body_bytes, now) + 1e-3)
        if left <= 0:
            why = f"nothing for {silence:g} s" if now < deadline else "not the whole answer within the limit"
            raise UpstreamTimeout(f"{url}: waited for {what}, got {why}")
        done, _ = await asyncio.wait((fut,), timeout=left)
        if done:
            return fut.result()
