"""The HTTP side of the client: one aiohttp session, timeouts on every wait, failover, Range resume.

:class:`HttpClient` speaks the wire protocol (docs/PROTOCOL.md) to a list of base
URLs in order of preference (for a subscriber: its nearest relay first, then
fallbacks, the origin last; for a publisher: the origin). Reads fail over under the
one failover policy (``deltasync.failover``): a URL that refuses the connection,
times out, answers 5xx, or serves a blob whose bytes do not hash to its id is put in
a cool-down (``Timeouts.cooldown``, doubling with each failure in a row, up to a
minute) and the next URL is tried; a cooling URL is still tried, last, rather than
giving up, and a URL that answers well is healthy again at once. A blob body cut
off mid-transfer is resumed with ``Range`` from the same URL before moving on.
A head or manifest body is checked inside the same loop: one that is not JSON, does
not parse (FormatError) or does not verify (SignatureError, or a manifest for
another model/version) is that URL's fault like a bad blob, and the next URL is
tried. The check is the ``parse`` a caller passes, else ``check_manifest`` (the
subscriber's driver sets it to parse-and-verify with its key).
``receive_blob`` lands a blob in a caller's sink instead of memory (a keyframe shard into ``subscribe
--out``'s file: ``client/blobrecv.py`` receives plain-HTTP bodies straight into it), checking its length,
id and digest over the same bytes as they arrive; it is not hedged (one sink, one transfer at a time).
Body reads are bounded per piece by ``Timeouts.read`` of our own: aiohttp 3.14.5 drops its read timer
without waking the reader when its parser fails on a mangled chunk-size line (and a later read raises
a bare RuntimeError, translated here into the source's UpstreamError).
Writes (``put_*``) go to the first URL only, with the bearer token, and are retried
a few times on transport errors and 5xx (blob and manifest PUTs are idempotent).
Both loops are the core's (``deltasync.retry``); a server's error answer becomes the
class of the one error tree it names (``deltasync.errors.from_wire``).

Every wait is bounded: ``Timeouts.connect`` for TCP connect, ``Timeouts.ttfb`` for the
status line of a request (a source that accepts TCP and never answers costs that
long, not ``read``), ``Timeouts.read`` for silence on a connection once it answered,
``Timeouts.request`` for a whole request (with a single URL the status line gets
``read`` if that is longer: there is nowhere else to go); a long-poll asks the server for at most
``Timeouts.poll`` seconds and waits that plus ``ttfb`` for its answer.

Reads are hedged (``Timeouts.hedge_after``): when a URL has not begun to answer within
that many seconds, the next URL is asked in parallel and the first to deliver wins
(long-polls and squash builds, which are slow by design, are not hedged; they ask
first the URLs that have not failed since they last answered well). The
failover policy, with its cool-downs, is shared by every client of the process
that lists the same URLs (``shared_failover``): a URL that stalled one request is
skipped by the others too, and its cool-down grows with each failure in a row.

Not thread-safe: use one client per event loop (the shared policy is thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
import ssl as ssl_module
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar
from urllib.parse import quote

import aiohttp
import xxhash

from deltasync.blob import blob_id, check_blob_id
from deltasync.digest import DigestHasher, check_digest, parse_digest
from deltasync.errors import (
    AuthError,
    FormatError,
    IntegrityError,
    NotFoundError,
    UpstreamError,
    UpstreamTimeout,
    from_wire,
)
from deltasync.failover import Backoff, Failover
from deltasync.retry import RESUME_NOW, RETRY_BACKOFF, FellBehind, Pace, answering, describe, first_source, retry

from . import blobrecv
from .blobrecv import BlobSink
from .httpbase import MODEL_HEADER, HeadInfo, Timeouts, is_outage as _is_outage

__all__ = ["HeadInfo", "HttpClient", "Timeouts", "TransferStats", "is_bad_body", "is_outage", "shared_failover"]

log = logging.getLogger("deltasync.client.http")
T = TypeVar("T")

# a manifest (a head answer included) is read up to this, then its source is at fault: the servers' own limit
# (ServerConfig.max_manifest_size: an origin takes no larger commit, a relay no larger parent answer), so a longer
# answer is never a manifest deltasync serves (an endless head costs at most 64 MiB before the next source)
MAX_MANIFEST = 64 << 20
MAX_COOLDOWN = 60.0
NETWORK_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
# a body cut off mid-transfer: resumed with Range when some bytes are in hand
_CUT = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, asyncio.TimeoutError, aiohttp.ClientOSError)
#: what a body read of aiohttp 3.14 raises (a bare RuntimeError) after its parser failed on a mangled chunk-size
#: line and closed the connection under the reader: a cut answer, the server's fault. A reader already waiting
#: then is never woken: every body read here has a bound of its own per piece (``HttpClient._piece``)
_CLOSED_MID_BODY = "Connection closed."


def is_outage(e: BaseException) -> bool:
    """A server's failure (try the next URL / try again), as opposed to an answer such as a 4xx:
    the network (aiohttp's errors too), 5xx or 429, refused credentials, bytes that fail our check
    (``httpbase.is_outage``, the one rule)."""
    return _is_outage(e, NETWORK_ERRORS)


def is_bad_body(e: BaseException) -> bool:
    """A body a source sent that failed our own parse or verification (not a server's error answer)."""
    return isinstance(e, (FormatError, IntegrityError)) and e.status is None


def _outage_or_bad_body(e: BaseException) -> bool:
    return is_outage(e) or is_bad_body(e)


_SHARED: OrderedDict[tuple, Failover] = OrderedDict()
_SHARED_LOCK = threading.Lock()
_SHARED_MAX = 256


def shared_failover(urls: Sequence[str], *, cooldown: float) -> Failover:
    """The process's one failover policy for this list of URLs (and cool-down base): every client made
    for them shares its health and cool-downs. The newest 256 lists are kept."""
    key = (tuple(urls), cooldown)
    with _SHARED_LOCK:
        policy = _SHARED.get(key)
        if policy is None:
            policy = _SHARED[key] = Failover(list(urls), backoff=Backoff(base=cooldown,
                                                                         cap=max(MAX_COOLDOWN, cooldown)))
            while len(_SHARED) > _SHARED_MAX:
                _SHARED.popitem(last=False)
        else:
            _SHARED.move_to_end(key)
        return policy


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferStats:
    """Bytes this client moved; counters only grow."""

    bytes_in: int = 0
    bytes_out: int = 0
    requests: int = 0
    failovers: int = 0
    corrupt_blobs: int = 0
    resumes: int = 0


class HttpClient:
    """Async HTTP client for one or more deltasync servers (origin or relays), most preferred first."""

    def __init__(self, urls: str | Sequence[str], *, token: str | None = None, timeouts: Timeouts | None = None,
                 write_retries: int = 3, check_manifest: Callable[[bytes], object] | None = None,
                 failover: Failover | None = None,
                 ssl: ssl_module.SSLContext | None = None, read_token: str | None = None,
                 direct_receive: bool = True) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.urls = list(dict.fromkeys(u.rstrip("/") for u in urls))  # a URL listed twice is one source
        self.token = token
        #: sent on reads (a scoped read token, docs/PROTOCOL.md "Tokens"); never logged
        self.read_token = read_token
        #: TLS for https:// URLs (``client_ssl_context(ca_file)``); None: the system's trust store
        self.ssl = ssl
        self.timeouts = timeouts or Timeouts()
        self.write_retries = write_retries
        #: run on every head/manifest body before it is accepted from a source (raise FormatError or
        #: IntegrityError/SignatureError to reject it: that source is failed over); None: JSON check only
        self.check_manifest = check_manifest
        self._session: aiohttp.ClientSession | None = None
        #: the process's shared policy for these URLs unless one is given (its sources must be ``urls``)
        self.failover = failover or shared_failover(self.urls, cooldown=self.timeouts.cooldown)
        if self.failover.sources != tuple(self.urls):
            raise ValueError(f"the failover policy's sources {list(self.failover.sources)} are not the URLs {self.urls}")
        self._bytes_in = self._bytes_out = self._requests = self._failovers = self._corrupt = self._resumes = 0
        self.last_url: str | None = None  # the URL that answered the last read
        #: ``receive_blob`` from plain-HTTP URLs straight into the sink (``blobrecv``); False: through aiohttp
        self.direct_receive = direct_receive

    # -- lifecycle ---------------------------------------------------------------------
    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            t = self.timeouts
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=t.request, connect=t.connect, sock_connect=t.connect, sock_read=t.read),
                connector=aiohttp.TCPConnector(limit=64, enable_cleanup_closed=True,
                                               **({} if self.ssl is None else {"ssl": self.ssl})),
                auto_decompress=False,
                headers={"Authorization": f"Bearer {self.read_token}"} if self.read_token else None,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def stats(self) -> TransferStats:
        return TransferStats(bytes_in=self._bytes_in, bytes_out=self._bytes_out, requests=self._requests,
                             failovers=self._failovers, corrupt_blobs=self._corrupt, resumes=self._resumes)

    # -- failover ------------------------------------------------------------------------
    def _failed(self, url: str, e: BaseException, cooldown: float | None) -> None:
        self._failovers += 1
        if isinstance(e, IntegrityError):
            self._corrupt += 1
        if cooldown is not None:
            log.warning("%s: %s; trying the next server for %.0fs", url, describe(e), cooldown)

    async def _open(self, method: str, url: str, *, ttfb: float | None = None, **kw) -> aiohttp.ClientResponse:
        """Send a request and wait at most ``ttfb`` (default ``Timeouts.ttfb``) for its status line;
        tells a hedged loop the URL answered. Use the response as ``async with``."""
        if ttfb is None:  # with nowhere else to go, failing a slow but live server early gains nothing
            ttfb = self.timeouts.ttfb if len(self.urls) > 1 else max(self.timeouts.ttfb, self.timeouts.read)
        self._requests += 1
        try:
            async with asyncio.timeout(ttfb):
                r = await self._sess().request(method, url, **kw)
        except TimeoutError:
            raise UpstreamTimeout(f"{method} {url}: no answer within {ttfb:g} s (time-to-first-byte limit)") from None
        answering()
        return r

    async def _piece(self, r: aiohttp.ClientResponse, where: str, pace: Pace | None = None, have: int = 0) -> bytes:
        """The next piece of a body (b"" at its end), as received: at most ``Timeouts.read`` of silence, and
        with a ``pace`` (``have`` bytes of the body in so far) no later than it says (``FellBehind``: a source
        that drips a byte now and then is put down all the same). The silence bound is our own, because aiohttp
        (3.14) drops its read timer without waking the reader when its parser fails on a mangled chunk-size
        line; a read after that raises a bare RuntimeError, which is translated here: either way a cut answer,
        the server's fault (UpstreamError/UpstreamTimeout)."""
        limit = self.timeouts.read
        behind = False
        if pace is not None:
            left = pace.left(have, asyncio.get_running_loop().time())
            if left < limit:
                limit, behind = max(left, 0.0), True
        try:
            async with asyncio.timeout(limit):
                return await r.content.readany()
        except TimeoutError:
            if behind:
                pace.check(have, asyncio.get_running_loop().time() + 1e-3)  # raises FellBehind
            raise UpstreamTimeout(f"{where}: the body stalled (nothing for {self.timeouts.read:g} s)") from None
        except RuntimeError as e:
            if str(e) != _CLOSED_MID_BODY:
                raise
            raise UpstreamError(f"{where}: the connection was closed mid-answer") from None

    def _pace(self, where: str) -> Pace:
        return self.timeouts.pace(asyncio.get_running_loop().time(), what=where)

    async def _body(self, r: aiohttp.ClientResponse, where: str, *, limit: int | None = None,
                    keep: int | None = None) -> bytes:
        """A whole body, each piece read with :meth:`_piece`'s bounds (the minimum rate included).
        ``limit``: a longer body is that server's fault (UpstreamError); ``keep``: only the first ``keep``
        bytes are wanted (an error answer's text), the rest is not read."""
        parts: list[bytes] = []
        n = 0
        pace = self._pace(where)
        while piece := await self._piece(r, where, pace, n):
            parts.append(piece)
            n += len(piece)
            if keep is not None and n >= keep:
                break
            if limit is not None and n > limit:
                raise UpstreamError(f"{where}: a body of more than {limit:,} bytes")
        return b"".join(parts)[:keep]

    async def _each_url(self, attempt: Callable[[str], Awaitable[T]], *, what: str, checked: bool = False,
                        hedge: bool = True) -> T:
        """``attempt(url)`` on each URL in failover order until one delivers; that URL is ``last_url``.
        ``checked``: a body failing our parse/verification (``is_bad_body``) also fails that URL over;
        when it was the last source's failure, that error itself is raised. ``hedge``: ask the next URL
        in parallel when one is slow to answer (``Timeouts.hedge_after``)."""
        async def tracked(url: str) -> T:
            result = await attempt(url)
            self.last_url = url
            return result

        hedge_after = self.timeouts.hedge_after if hedge and len(self.urls) > 1 else None
        if checked:
            return await first_source(self.failover, tracked, what=what, outage=_outage_or_bad_body,
                                      on_failure=self._failed, keep=(FormatError, IntegrityError),
                                      hedge_after=hedge_after, proven_first=not hedge)
        return await first_source(self.failover, tracked, what=what, outage=is_outage, on_failure=self._failed,
                                  hedge_after=hedge_after, proven_first=not hedge)

    async def _read(self, path: str, *, timeout: aiohttp.ClientTimeout | None = None, ttfb: float | None = None,
                    check: Callable[[bytes], object] | None = None) -> tuple[bytes, str, int, dict, object]:
        """GET ``path`` from the first URL that answers 200 (or 204/304) and whose 200 body passes ``check``;
        returns (body, url, status, headers, what check returned). A ``ttfb`` of its own (a long-poll, a
        squash build) also means the read is not hedged."""
        async def attempt(url: str) -> tuple[bytes, str, int, dict, object]:
            # (aiohttp reads timeout=None as "no timeout at all": pass it only when set)
            r = await self._open("GET", url + path, ttfb=ttfb, **({} if timeout is None else {"timeout": timeout}))
            async with r:
                if r.status == 200:
                    body = await self._body(r, url + path, limit=MAX_MANIFEST)
                    self._bytes_in += len(body)
                    headers = dict(r.headers)
                elif r.status in (204, 304):
                    return b"", url, r.status, dict(r.headers), None
                else:
                    raise from_wire(r.status, await self._body(r, url + path, keep=500), r.headers, where=url + path)
            return body, url, 200, headers, (check(body) if check is not None else None)

        return await self._each_url(attempt, what=f"GET {path}", checked=check is not None, hedge=ttfb is None)

    # -- reads ---------------------------------------------------------------------------
    async def get_head(self, model: str, *, after: int | None = None, wait: float | None = None,
                       parse: Callable[[bytes, int], object] | None = None) -> HeadInfo | None:
        """The newest version, or None when the model has none yet. With ``after``/``wait``, the server
        holds the request until a version newer than ``after`` commits or ``wait`` seconds pass (then the
        current head, possibly still ``after``, is returned).

        A body that is not a head answer, or that ``parse(body, version)`` (default: ``check_manifest``)
        rejects, fails that URL over; what ``parse`` returned is the answer's ``checked``."""
        path = f"/v1/models/{quote(model)}/head"
        timeout = ttfb = None
        if after is not None:
            wait = self.timeouts.poll if wait is None else wait
            path += f"?after={after}&wait={wait:g}"
            t = self.timeouts
            ttfb = wait + t.ttfb
            timeout = aiohttp.ClientTimeout(total=wait + t.read + t.connect, connect=t.connect,
                                            sock_connect=t.connect, sock_read=wait + t.read)
        def check(body: bytes) -> object:
            info = HeadInfo.from_body(body, model=model)
            if parse is not None:
                return parse(body, info.version)
            return self.check_manifest(body) if self.check_manifest is not None else None

        try:
            body, url, status, headers, checked = await self._read(path, timeout=timeout, ttfb=ttfb, check=check)
        except NotFoundError:
            return None
        if status != 200:  # long-poll ran out: nothing newer than ``after``
            shown = headers.get("X-Deltasync-Head")
            if shown is None or not shown.isdigit():
                return None
            return HeadInfo(model=model, version=int(shown), url=url)
        return replace(HeadInfo.from_body(body, model=model, url=url), checked=checked)

    async def highest_head(self, model: str, *, parse: Callable[[bytes, int], object] | None = None) -> HeadInfo | None:
        """The newest head any listed URL can prove: every URL asked at once (a plain head read each, bounded
        by the client's timeouts and minimum rate), each answer checked as ``get_head`` checks it (``parse``,
        default ``check_manifest``: a signed head); None when no URL has a version. A URL replaying an old
        signed head cannot hold a caller back while another has a newer one (TUF's freeze and rollback).
        Raises what ``get_head`` raises when no URL answered at all."""
        if len(self.urls) == 1:
            return await self.get_head(model, parse=parse)
        path = f"/v1/models/{quote(model)}/head"

        def check(body: bytes) -> object:
            info = HeadInfo.from_body(body, model=model)
            if parse is not None:
                return parse(body, info.version)
            return self.check_manifest(body) if self.check_manifest is not None else None

        async def one(url: str) -> HeadInfo | None:
            async with await self._open("GET", url + path) as r:
                if r.status == 404:
                    return None
                if r.status != 200:
                    raise from_wire(r.status, await self._body(r, url + path, keep=500), r.headers, where=url + path)
                body = await self._body(r, url + path, limit=MAX_MANIFEST)
            self._bytes_in += len(body)
            return replace(HeadInfo.from_body(body, model=model, url=url), checked=check(body))

        # every URL at once; once one has answered, the others get a grace (0.5 s, or the hedge delay if shorter) and
        # are then given up: a stalled source must not hold the answer back for its whole time-out
        tasks = [asyncio.ensure_future(one(u)) for u in self.urls]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(not t.cancelled() and t.exception() is None for t in done):
                    break
            if pending:
                grace = min(0.5, self.timeouts.hedge_after or 0.5)
                await asyncio.wait(pending, timeout=grace)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        got = []
        for t, u in zip(tasks, self.urls):
            if t.cancelled():
                got.append(asyncio.TimeoutError(f"{u}: no head within the grace after another answered"))
            elif t.exception() is not None:
                got.append(t.exception())
            else:
                got.append(t.result())
        heads = [h for h in got if isinstance(h, HeadInfo)]
        for url, h in zip(self.urls, got):
            if isinstance(h, BaseException):
                if not isinstance(h, Exception):
                    raise h
                log.info("%s: no head (%s)", url, describe(h))
        if heads:
            return max(heads, key=lambda h: h.version)
        if any(h is None for h in got):
            return None
        return await self.get_head(model, parse=parse)  # nobody answered: the usual loop, its errors

    async def get_manifest(self, model: str, version: int) -> bytes:
        """A version's manifest JSON (parse and verify it with deltasync.manifest.parse_manifest); a body
        ``check_manifest`` rejects fails that URL over."""
        body, _, _, _, _ = await self._read(f"/v1/models/{quote(model)}/versions/{version}", check=self.check_manifest)
        return body

    async def fetch_manifest(self, model: str, version: int, parse: Callable[[bytes], T]) -> T:
        """``parse(body)`` of a version's manifest from the first URL whose body it accepts: a body it
        rejects (FormatError, IntegrityError, SignatureError) is that URL's fault and the next is asked."""
        _, _, _, _, out = await self._read(f"/v1/models/{quote(model)}/versions/{version}", check=parse)
        return out  # type: ignore[return-value]

    async def get_squashed(self, model: str, start: int, end: int, *, timeout: float | None = None) -> bytes:
        """The server's squashed catch-up delta ``start → end``: a manifest whose blobs are fetched as usual.
        A server builds it on demand, so ``timeout`` bounds the wait (the chain is the fallback)."""
        t = self.timeouts
        ct = None
        if timeout is not None:
            ct = aiohttp.ClientTimeout(total=timeout, connect=t.connect, sock_connect=t.connect, sock_read=timeout)
        body, _, _, _, _ = await self._read(f"/v1/models/{quote(model)}/delta?from={start}&to={end}", timeout=ct,
                                            ttfb=timeout)
        return body

    async def get_blob(self, bid: str, size: int | None = None, digest: str | None = None) -> bytes:
        """A blob, its hash checked (and its cryptographic ``digest`` from a signed manifest, when given); fails
        over on bad bytes and resumes cut transfers with Range: from the same URL, or from the next one when a
        URL fell behind the minimum rate (the bytes in hand are kept: a copy from two sources that fails its
        check is fetched again whole from the last before that URL is blamed)."""
        check_blob_id(bid)
        carry = _Partial()
        return await self._each_url(lambda url: self._get_blob_from(url, bid, size, digest=digest, carry=carry),
                                    what=f"blob {bid}")

    async def _get_blob_from(self, url: str, bid: str, size: int | None, attempts: int = 3, *,
                             digest: str | None = None, carry: _Partial | None = None) -> bytes:
        full = f"{url}/v1/blobs/{bid}"
        # the bytes a slower source left (one attempt at a time owns them: a hedged attempt runs with its own)
        own = carry is not None and not carry.busy
        buf = carry.data if own else bytearray()
        if own:
            carry.busy = True
            if buf and carry.sources - {url}:
                log.info("%s: resuming at byte %d after %s fell behind", full, len(buf), ", ".join(carry.sources))
        mixed = own and bool(carry.sources - {url}) and bool(buf)

        async def transfer() -> None:
            headers = {"Range": f"bytes={len(buf)}-"} if buf else {}
            async with await self._open("GET", full, headers=headers) as r:
                if r.status not in (200, 206):
                    raise from_wire(r.status, await self._body(r, full, keep=300), r.headers, where=full)
                if buf and r.status == 200:
                    buf.clear()  # the server ignored Range: start over
                if own:
                    carry.sources.add(url)
                pace = self._pace(full)
                got = 0
                while piece := await self._piece(r, full, pace, got):
                    got += len(piece)
                    buf.extend(piece)
                    self._bytes_in += len(piece)
                    if size is not None and len(buf) > size:
                        raise IntegrityError(f"blob {bid} is longer than the {size} bytes the manifest says")

        def resumed(n: int, e: BaseException, delay: float) -> None:
            self._resumes += 1
            log.info("%s: transfer cut at %d bytes (%s); resuming with Range", full, len(buf), type(e).__name__)

        try:
            while True:
                await retry(transfer, backoff=RESUME_NOW, attempts=attempts,
                            again=lambda e: bool(buf) and isinstance(e, _CUT), on_retry=resumed)
                try:
                    data = bytes(buf)
                    if size is not None and len(data) != size:
                        raise IntegrityError(f"blob {bid}: {len(data)} bytes, the manifest says {size}")
                    found = blob_id(data)
                    if found != bid:
                        raise IntegrityError(f"blob {bid}: content hashes to {found}")
                    if digest is not None:
                        check_digest(bid, data, digest)  # crafted bytes that match the xxh3 id: this URL's fault
                except IntegrityError:
                    buf.clear()
                    if not mixed:
                        raise
                    mixed = False  # another source's bytes in the copy: once more, all from this one
                    log.info("%s: a copy resumed from two sources fails its check; fetching it whole", full)
                    if own:
                        carry.sources = {url}
                    continue
                return data
        except IntegrityError:
            buf.clear()  # bytes no longer than the blob's, or none: nothing in hand is worth resuming
            raise
        finally:
            if own:
                carry.busy = False

    async def receive_blob(self, bid: str, size: int, sink: BlobSink, *, digest: str | None = None) -> None:
        """A blob of ``size`` bytes (its manifest's) received into ``sink`` in order, its hash (and its signed
        ``digest``, when given) checked over the same bytes as they land; fails over to the next URL (the sink
        restarts from byte 0) on bad bytes or an outage, resumes cut transfers with Range. Plain-HTTP URLs
        are received by the kernel straight into the sink's room (``blobrecv``); others through aiohttp with
        one copy. Not hedged: a sink takes one transfer at a time. When this returns, the sink holds
        exactly the blob's bytes; on an error it holds garbage (the caller discards it)."""
        check_blob_id(bid)
        checked = _CheckedSink(sink, bid, size, digest)
        await self._each_url(lambda url: self._receive_from(url, checked), what=f"blob {bid}", hedge=False)

    async def _receive_from(self, url: str, c: _CheckedSink, attempts: int = 3) -> None:
        full = f"{url}/v1/blobs/{c.bid}"
        mixed = False
        if c.started and c.behind and c.have:  # the last source fell behind mid-body: the rest from this one
            mixed = True
            log.info("%s: resuming at byte %d after the last source fell behind", full, c.have)
        elif c.started:
            c.restart()  # another source: from byte 0 (its bytes may be another copy)
        c.behind = False
        direct = self.direct_receive and blobrecv.supports(url)

        async def transfer() -> None:
            self._requests += 1
            before = c.have
            try:
                if direct:
                    await self._transfer_direct(url, full, c)
                else:
                    await self._transfer_aiohttp(full, c)
            finally:
                self._bytes_in += max(0, c.have - before)

        def resumed(n: int, e: BaseException, delay: float) -> None:
            self._resumes += 1
            log.info("%s: transfer cut at %d bytes (%s); resuming with Range", full, c.have, type(e).__name__)

        def again(e: BaseException) -> bool:
            return c.have > 0 and (isinstance(e, _CUT) or type(e) in (UpstreamError, UpstreamTimeout))

        try:
            await retry(transfer, backoff=RESUME_NOW, attempts=attempts, again=again, on_retry=resumed)
        except FellBehind:
            c.behind = True
            raise
        try:
            c.check()
        except IntegrityError:
            if not mixed:
                raise
            log.info("%s: a copy resumed from two sources fails its check; fetching it whole", full)
            c.restart()
            await retry(transfer, backoff=RESUME_NOW, attempts=attempts, again=again, on_retry=resumed)
            c.check()

    async def _transfer_direct(self, url: str, full: str, c: _CheckedSink) -> None:
        t = self.timeouts
        ttfb = t.ttfb if len(self.urls) > 1 else max(t.ttfb, t.read)
        headers = {"Authorization": f"Bearer {self.read_token}"} if self.read_token else {}

        try:
            a = await blobrecv.receive(url, f"/v1/blobs/{c.bid}", c, c.have, size=c.size, headers=headers,
                                       connect=t.connect, ttfb=ttfb, read=t.read, total=t.request,
                                       on_head=lambda _: answering(), min_rate=t.min_rate, grace=t.rate_grace)
        except OSError as e:  # refused, reset: the source's outage
            raise UpstreamError(f"GET {full}: {describe(e)}") from e
        if a.status not in (200, 206):
            raise from_wire(a.status, a.error_body[:300], a.headers, where=full)

    async def _transfer_aiohttp(self, full: str, c: _CheckedSink) -> None:
        headers = {"Range": f"bytes={c.have}-"} if c.have else {}
        async with await self._open("GET", full, headers=headers) as r:
            if r.status not in (200, 206):
                raise from_wire(r.status, await self._body(r, full, keep=300), r.headers, where=full)
            if r.status == 200:
                if c.have:
                    c.restart()  # the server ignored Range: start over
                if r.content_length is not None and r.content_length != c.size:
                    raise IntegrityError(f"blob {c.bid}: {full} says {r.content_length} bytes, the manifest "
                                         f"says {c.size}")
            pace, got = self._pace(full), 0
            while piece := await self._piece(r, full, pace, got):
                got += len(piece)
                c.feed(piece)

    # -- writes (origin only) -----------------------------------------------------------------
    async def _write(self, method: str, path: str, data: bytes, *, content_type: str,
                     extra: dict[str, str] | None = None) -> int:
        url = self.urls[0]
        headers = {"Content-Type": content_type, **(extra or {})}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"

        async def once() -> int:
            self._requests += 1
            async with self._sess().request(method, url + path, data=data, headers=headers) as r:
                body = await self._body(r, url + path, keep=500)
                if r.status in (200, 201, 204):
                    self._bytes_out += len(data)
                    return r.status
                raise from_wire(r.status, body, r.headers, where=f"{method} {url}{path}")

        def again(e: BaseException) -> bool:  # a refused token is an answer here, not an outage
            return is_outage(e) and not isinstance(e, AuthError)

        def on_retry(n: int, e: BaseException, delay: float) -> None:
            log.warning("%s %s%s: %s; retrying in %.1f s", method, url, path, describe(e), delay)

        try:
            return await retry(once, backoff=RETRY_BACKOFF, attempts=self.write_retries, again=again,
                               on_retry=on_retry)
        except NETWORK_ERRORS as e:
            raise UpstreamError(f"{method} {url}{path}: {describe(e)}") from e

    async def put_blob(self, bid: str, data: bytes | bytearray | memoryview | tuple[memoryview, ...], *,
                       model: str | None = None) -> None:
        """PUT a blob's bytes: one buffer, or a tuple of pieces that concatenate to it (a keyframe shard's header
        and views of a mapped file, sent as they are: ``pieces.PiecesPayload``). ``model``: the model it is for
        (``X-Deltasync-Model``): the origin hints a large upload to relays only for a model the token may publish."""
        if isinstance(data, tuple):
            from .pieces import PiecesPayload

            data = PiecesPayload(data)
        await self._write("PUT", f"/v1/blobs/{check_blob_id(bid)}", data, content_type="application/octet-stream",
                          extra={MODEL_HEADER: model} if model else None)

    async def put_manifest(self, model: str, version: int, data: bytes) -> None:
        await self._write("PUT", f"/v1/models/{quote(model)}/versions/{version}", data, content_type="application/json")


class _Partial:
    """The bytes of one blob in hand across the URLs of one ``get_blob`` (a source that fell behind mid-body
    leaves them to the next, which is asked for the rest with Range)."""

    __slots__ = ("data", "sources", "busy")

    def __init__(self) -> None:
        self.data = bytearray()
        self.sources: set[str] = set()
        self.busy = False


class _CheckedSink:
    """A caller's sink with the blob's checks on the same bytes: its length, and its signed digest when the
    manifest gives one, else its xxh3 id. (With a digest the id adds nothing: the digest is a cryptographic
    hash of the same bytes, named by a manifest that named the id too; one hash pass less per received byte.)"""

    __slots__ = ("sink", "bid", "size", "have", "started", "behind", "_digest", "_alg", "_xxh", "_dig", "_room")

    def __init__(self, sink: BlobSink, bid: str, size: int, digest: str | None) -> None:
        self.sink, self.bid, self.size = sink, bid, size
        self._digest = digest
        self._alg = parse_digest(digest)[0] if digest is not None else None
        self._dig = DigestHasher(self._alg) if self._alg is not None else None
        self._xxh = xxhash.xxh3_128() if self._dig is None else None
        self.have = 0
        self.started = False
        self.behind = False  # the last source fell behind the minimum rate: the next resumes from ``have``
        self._room: memoryview | None = None

    def buffer(self, offset: int) -> memoryview:
        if offset != self.have:
            raise IntegrityError(f"blob {self.bid}: bytes from {offset} offered, {self.have} are in")
        if offset >= self.size:
            raise IntegrityError(f"blob {self.bid} is longer than the {self.size} bytes the manifest says")
        self._room = room = self.sink.buffer(offset)
        return room

    def received(self, offset: int, n: int) -> None:
        piece = self._room[:n]
        if self._dig is not None:
            self._dig.update(piece)
        else:
            self._xxh.update(piece)
        self.started = True
        self.have = offset + n
        self.sink.received(offset, n)

    def feed(self, data) -> None:
        """Bytes that arrived elsewhere (aiohttp's pieces), copied into the sink's room."""
        view = memoryview(data)
        while view:
            room = self.buffer(self.have)
            k = min(len(room), len(view))
            room[:k] = view[:k]
            self.received(self.have, k)
            view = view[k:]

    def restart(self) -> None:
        if self._xxh is not None:
            self._xxh.reset()
        self._dig = DigestHasher(self._alg) if self._alg is not None else None
        self.have = 0
        self.started = False
        self.sink.restart()

    def check(self) -> None:
        if self.have != self.size:
            raise IntegrityError(f"blob {self.bid}: {self.have} bytes, the manifest says {self.size}")
        if self._xxh is not None and (found := self._xxh.hexdigest()) != self.bid:
            raise IntegrityError(f"blob {self.bid}: content hashes to {found}")
        if self._dig is not None and (got := self._dig.digest()) != self._digest:
            raise IntegrityError(f"blob {self.bid}: bytes hash to {got} but the signed manifest says {self._digest} "
                                 "(crafted or corrupted bytes; fetch it from another source)")
