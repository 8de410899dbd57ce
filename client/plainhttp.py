"""The ``publish`` command's requests to a plain-HTTP origin, without aiohttp.

A ``publish --base`` delta makes three kinds of request to one origin: the head (GET), the blobs (PUT)
and the manifest (PUT). aiohttp, which the subscriber and the sidecar need for everything else, costs a
cold command ~0.25 CPU-s to import (yarl, multidict, its HTTP parser, its TLS contexts), in the middle of
the compare pass on a 2-core machine. :class:`PlainOrigin` speaks just that HTTP/1.1 on asyncio's
streams: ``Content-Length`` request bodies, answers with ``Content-Length``, chunked or read to the close,
keep-alive connections reused one request at a time (a few side by side for parallel blob PUTs); an
answer's head is read by the core's one HTTP head reader (``deltasync.httphead``).

Nothing of the policy is its own: the head read goes through ``deltasync.retry.first_source`` under a
``deltasync.failover.Failover`` of its one URL, the writes through ``deltasync.retry.retry`` with ``RETRY_BACKOFF`` and the
client's ``write_retries``, the outage rule is ``httpbase.is_outage`` and a server's error answer becomes
the class of the one error tree it names (``deltasync.errors.from_wire``), as in ``client/http.py``; a
body that does not parse is ``HeadInfo.from_body``'s ``UpstreamError``. Every wait is bounded by the same
:class:`~deltasync.client.httpbase.Timeouts`: connect, status line (``ttfb``, or ``read`` when it is
longer: there is one origin), silence while a body moves (``read``), and the whole request (``request``).

Only ``http://`` URLs (:func:`supports`); an https origin, and keyframes (whose pieces of a mapped file
go as aiohttp payloads), take ``client/http.py``'s :class:`~deltasync.client.http.HttpClient`.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote, urlsplit

from deltasync.blob import check_blob_id
from deltasync.errors import AuthError, NotFoundError, UpstreamError, UpstreamTimeout, from_wire
from deltasync.failover import Backoff, Failover
from deltasync.httphead import MAX_HEAD, Headers, ResponseHead, read_head
from deltasync.retry import RETRY_BACKOFF, Pace, describe, first_source, retry

from .httpbase import MODEL_HEADER, HeadInfo, Timeouts, is_outage

__all__ = ["PlainOrigin", "supports"]

log = logging.getLogger("deltasync.client.plainhttp")

MAX_BODY = 256 << 20  # a head answer (a manifest); longer is that server's fault
MAX_ERROR = 64 << 10  # what is kept of an error answer's body
WRITE_PIECE = 4 << 20  # a request body handed to the transport at a time


def supports(url: str) -> bool:
    """Whether :class:`PlainOrigin` can talk to ``url`` (plain ``http://``)."""
    return urlsplit(url).scheme.lower() == "http"


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class PlainOrigin:
    """The origin at ``url`` (``http://`` only) for ``publish``: :meth:`get_head`, :meth:`put_blob`,
    :meth:`put_manifest`, the same calls and answers as :class:`~deltasync.client.http.HttpClient`'s."""

    def __init__(self, url: str, *, token: str | None = None, read_token: str | None = None,
                 timeouts: Timeouts | None = None, write_retries: int = 3) -> None:
        if not supports(url):
            raise ValueError(f"PlainOrigin speaks plain http:// only, not {url}")
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self._host = parts.hostname or "localhost"
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc
        self.token = token
        self.read_token = read_token
        self.timeouts = timeouts or Timeouts()
        self.write_retries = write_retries
        t = self.timeouts
        self.failover = Failover([self.url], backoff=Backoff(base=t.cooldown, cap=max(60.0, t.cooldown)))
        self._idle: list[_Conn] = []
        self.bytes_out = 0
        self.requests = 0

    async def __aenter__(self) -> PlainOrigin:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    # -- one request -----------------------------------------------------------------------------
    async def _connect(self) -> _Conn:
        if self._idle:
            return self._idle.pop()
        try:
            async with asyncio.timeout(self.timeouts.connect):
                reader, writer = await asyncio.open_connection(self._host, self._port, limit=MAX_HEAD)
        except TimeoutError:
            raise UpstreamTimeout(f"{self.url}: no connection within {self.timeouts.connect:g} s") from None
        return _Conn(reader, writer)

    async def _request(self, method: str, path: str, *, body: bytes | bytearray | memoryview | tuple = b"",
                       headers: dict[str, str] | None = None, limit: int = MAX_BODY) -> tuple[int, Headers, bytes]:
        """(status, headers, body) of one request; network failures and cut answers are UpstreamError /
        UpstreamTimeout (an outage), with the method and URL in the message."""
        where = f"{method} {self.url}{path}"
        self.requests += 1
        t = self.timeouts
        try:
            async with asyncio.timeout(t.request):
                conn = await self._connect()
                try:
                    status, head, data, keep = await self._exchange(conn, method, path, body, headers or {}, limit,
                                                                    where)
                except BaseException:
                    conn.close()
                    raise
                if keep:
                    self._idle.append(conn)
                else:
                    conn.close()
                return status, head, data
        except TimeoutError:
            raise UpstreamTimeout(f"{where}: no complete answer within {t.request:g} s") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            raise UpstreamError(f"{where}: {describe(e)}") from e

    async def _exchange(self, conn: _Conn, method: str, path: str, body, headers: dict[str, str], limit: int,
                        where: str) -> tuple[int, Headers, bytes, bool]:
        t = self.timeouts
        views = _views(body)
        lines = [f"{method} {self._prefix}{path} HTTP/1.1", f"Host: {self._host_header}",
                 f"Content-Length: {sum(len(v) for v in views)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        conn.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        for view in views:
            for at in range(0, len(view), WRITE_PIECE):
                conn.writer.write(view[at : at + WRITE_PIECE])
                async with asyncio.timeout(t.read):  # the origin takes nothing for that long: a stalled upload
                    await conn.writer.drain()
        async with asyncio.timeout(t.read):
            await conn.writer.drain()
        ttfb = max(t.ttfb, t.read)  # one origin: nowhere else to go, so a slow one is waited for
        try:
            async with asyncio.timeout(ttfb):
                raw = await conn.reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            raise UpstreamTimeout(f"{where}: no answer within {ttfb:g} s (time-to-first-byte limit)") from None
        except asyncio.IncompleteReadError as e:
            if not e.partial:  # a kept-alive connection the server had closed
                raise UpstreamError(f"{where}: the connection was closed before an answer") from None
            raise
        # chunked or read-to-the-close bodies are read here (framed=False): small JSON answers, not blobs
        head, _ = read_head(raw, max_bytes=MAX_HEAD, framed=False, where=where)
        status, keep = head.status, head.keep_alive
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return status, head.headers, b"", keep
        data = await self._body(conn, head, limit if status < 300 else MAX_ERROR, where)
        if data is None:  # read to the close
            keep = False
            data = await self._to_close(conn, limit if status < 300 else MAX_ERROR, where)
        return status, head.headers, data, keep

    async def _read(self, coro, where: str, pace: Pace | None = None, have: int = 0):
        """``await coro`` (a read of the answer's body): at most ``Timeouts.read``, and with a ``pace`` (``have``
        body bytes in so far) no later than its minimum rate allows (``FellBehind``)."""
        limit = self.timeouts.read
        behind = False
        if pace is not None and (left := pace.left(have, asyncio.get_running_loop().time())) < limit:
            limit, behind = max(left, 0.0), True
        try:
            async with asyncio.timeout(limit):
                return await coro
        except TimeoutError:
            if behind:
                pace.check(have, asyncio.get_running_loop().time() + 1e-3)
            raise UpstreamTimeout(f"{where}: the body stalled (nothing for {self.timeouts.read:g} s)") from None

    async def _body(self, conn: _Conn, head: ResponseHead, limit: int, where: str) -> bytes | None:
        r = conn.reader
        pace = self.timeouts.pace(asyncio.get_running_loop().time(), what=where)
        if head.chunked:
            parts: list[bytes] = []
            n = 0
            while True:
                line = await self._read(r.readuntil(b"\r\n"), where, pace, n)
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise UpstreamError(f"{where}: a bad chunk-size line {line[:40]!r}") from None
                if size == 0:
                    while (await self._read(r.readuntil(b"\r\n"), where, pace, n)) != b"\r\n":
                        pass  # trailers
                    return b"".join(parts)
                if n + size > limit:
                    raise UpstreamError(f"{where}: a body of more than {limit:,} bytes")
                parts.append(await self._read(r.readexactly(size), where, pace, n))
                n += size
                await self._read(r.readexactly(2), where, pace, n)
        size = head.content_length
        if size is None:
            return None
        if size > limit:
            raise UpstreamError(f"{where}: a body of more than {limit:,} bytes")
        # one read of the whole body: it has the pace's time for all of it (grace + size / min_rate)
        return await self._read(r.readexactly(size), where, pace, size)

    async def _to_close(self, conn: _Conn, limit: int, where: str) -> bytes:
        parts: list[bytes] = []
        n = 0
        pace = self.timeouts.pace(asyncio.get_running_loop().time(), what=where)
        while piece := await self._read(conn.reader.read(1 << 16), where, pace, n):
            parts.append(piece)
            n += len(piece)
            if n > limit:
                raise UpstreamError(f"{where}: a body of more than {limit:,} bytes")
        return b"".join(parts)

    # -- reads ---------------------------------------------------------------------------------------
    async def get_head(self, model: str) -> HeadInfo | None:
        """The newest version, or None when the model has none yet (as ``HttpClient.get_head``)."""
        path = f"/v1/models/{quote(model)}/head"
        headers = {"Authorization": f"Bearer {self.read_token}"} if self.read_token else {}

        async def attempt(url: str) -> HeadInfo | None:
            status, head, body = await self._request("GET", path, headers=headers)
            if status == 200:
                return HeadInfo.from_body(body, model=model, url=url)
            if status in (204, 304):
                return None
            raise from_wire(status, body[:500], head, where=url + path)

        try:
            return await first_source(self.failover, attempt, what=f"GET {path}", outage=is_outage,
                                      on_failure=self._failed)
        except NotFoundError:
            return None

    def _failed(self, url: str, e: BaseException, cooldown: float | None) -> None:
        if cooldown is not None:
            log.warning("%s: %s", url, describe(e))

    # -- writes --------------------------------------------------------------------------------------
    async def _write(self, method: str, path: str, data, *, content_type: str,
                     extra: dict[str, str] | None = None) -> int:
        headers = {"Content-Type": content_type, **(extra or {})}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"

        async def once() -> int:
            status, head, body = await self._request(method, path, body=data, headers=headers, limit=MAX_ERROR)
            if status in (200, 201, 204):
                self.bytes_out += sum(len(v) for v in _views(data))
                return status
            raise from_wire(status, body[:500], head, where=f"{method} {self.url}{path}")

        def again(e: BaseException) -> bool:  # a refused token is an answer here, not an outage
            return is_outage(e) and not isinstance(e, AuthError)

        def on_retry(n: int, e: BaseException, delay: float) -> None:
            log.warning("%s %s%s: %s; retrying in %.1f s", method, self.url, path, describe(e), delay)

        return await retry(once, backoff=RETRY_BACKOFF, attempts=self.write_retries, again=again, on_retry=on_retry)

    async def put_blob(self, bid: str, data: bytes | bytearray | memoryview | tuple[memoryview, ...], *,
                       model: str | None = None) -> None:
        """PUT a blob's bytes: one buffer, or a tuple of pieces that concatenate to it (a keyframe shard's header
        and views of a mapped file, written as they are, never joined). ``model``: as ``HttpClient.put_blob``."""
        await self._write("PUT", f"/v1/blobs/{check_blob_id(bid)}", data, content_type="application/octet-stream",
                          extra={MODEL_HEADER: model} if model else None)

    async def put_manifest(self, model: str, version: int, data: bytes) -> None:
        await self._write("PUT", f"/v1/models/{quote(model)}/versions/{version}", data, content_type="application/json")


def _views(body) -> tuple[memoryview, ...]:
    """A request body as byte views: one buffer, or a tuple of pieces sent one after the other."""
    pieces = body if isinstance(body, tuple) else (body,)
    return tuple(v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in map(memoryview, pieces))
