"""A relay's parents: one HTTP client session, failover order, manifest and blob requests.

Parents are tried in the order given, under the one failover policy
(``deltasync.failover``): a parent that fails (refused connection, timeout, 5xx, a
body cut short, bytes that fail their hash) is put in a cool-down (doubling with
each consecutive failure, from ``Timeouts.parent_cooldown`` up to a minute) and tried
after the healthy ones until it answers well again. Every request has a connect
timeout and a read timeout (silence on the socket), so a dead or stalled parent
costs at most that long before the next one is tried; a parent that accepts the
connection and sends no status line costs ``Timeouts.ttfb`` (time to first byte; the
event stream, which answers at once, gets it too). Manifest and HEAD reads are hedged
(``Timeouts.hedge_after``: the next parent is asked in parallel while the first is
silent); blob fetches are not (one temp file per blob), the TTFB limit bounds them.
``each_parent`` is the one per-parent loop (``deltasync.retry.first_source``) every
upstream request goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import aiohttp

from deltasync.errors import (
    DeltaSyncError,
    FormatError,
    IntegrityError,
    NotFoundError,
    SignatureError,
    UpstreamError,
    UpstreamTimeout,
)
from deltasync.failover import Backoff, Failover
from deltasync.signing import Verifier
from deltasync.manifest import Manifest, parse_manifest
from deltasync.retry import answering, describe, first_source

from ..config import Timeouts
from ..metrics import Metrics

log = logging.getLogger("deltasync.server.upstream")

USER_AGENT = "deltasync-relay/0.1"
READ_BUFSIZE = 4 << 20
MAX_COOLDOWN = 60.0
#: What a request to a parent may fail with and still be a parent's fault (try the next one).
NETWORK_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)

T = TypeVar("T")


def is_outage(e: BaseException) -> bool:
    """A parent's fault (try the next parent): the network, a bad answer, bytes or a signature that
    do not check. Anything else (our disk full, shutting down, a cancellation) is not."""
    return isinstance(e, (UpstreamError, FormatError, IntegrityError, *NETWORK_ERRORS))


class Upstream:
    def __init__(self, parents: tuple[str, ...], *, timeouts: Timeouts, metrics: Metrics,
                 verifier: Verifier | bytes | None = None, max_manifest_size: int = 64 << 20, ssl=None,
                 read_token: str | None = None) -> None:
        if not parents:
            raise ValueError("a relay needs at least one parent")
        self.parents = tuple(dict.fromkeys(p.rstrip("/") for p in parents))  # one source per parent
        self.timeouts = timeouts
        self.metrics = metrics
        self.verifier = verifier  # what manifests must verify with (ServerConfig.verifier); None: nothing
        self.max_manifest_size = max_manifest_size
        self.ssl = ssl  # an ssl.SSLContext for https parents (--ca-file); None: the system's trust store
        self.read_token = read_token  # sent to parents that require read tokens; never logged
        self.failover = Failover(self.parents, backoff=Backoff(base=timeouts.parent_cooldown, cap=MAX_COOLDOWN))
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        t = self.timeouts
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=t.connect, sock_connect=t.connect, sock_read=t.read),
            connector=aiohttp.TCPConnector(limit=512, limit_per_host=0, keepalive_timeout=30,
                                           **({} if self.ssl is None else {"ssl": self.ssl})),
            auto_decompress=False, read_bufsize=READ_BUFSIZE,
            headers={"User-Agent": USER_AGENT,
                     **({"Authorization": f"Bearer {self.read_token}"} if self.read_token else {})},
        )

    @property
    def table_check(self) -> bool | None:
        """How a parent's manifests are parsed (``parse_manifest(records=...)``). With a key: their fields and
        signature only (``None``), the table neither decoded nor checked (~0.02-0.04 s a step of a 70,000-tensor
        state, on the delivery path): the signed bytes are the publisher's, which the origin checked whole when it
        committed them and every subscriber checks before it uses any; this relay never reads a table on its serve
        path, and the squash and catch-up workers, which do, parse their manifests whole. Without a key, nothing
        vouches for them: the table is checked here (``False``)."""
        return None if self.verifier is not None else False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited")
        return self._session

    # -- failover order ----------------------------------------------------------------
    def candidates(self, *, rotate: int = 0) -> list[str]:
        """Parents to try, in order: healthy ones by preference, then cooling-down ones soonest first."""
        return self.failover.order(time.monotonic(), rotate=rotate)

    def mark_failed(self, parent: str, why: object) -> None:
        self._failed(parent, why, self.failover.failed(parent, time.monotonic(), str(why)))

    def _failed(self, parent: str, why: object, cooldown: float | None) -> None:
        n = self.failover.failures(parent)
        if cooldown is not None and n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th... failure in a row
            log.warning("parent %s failed (%s; %d in a row); trying the next parent for %.0f s", parent, why, n,
                        cooldown)

    def mark_ok(self, parent: str) -> None:
        if self.failover.succeeded(parent):
            log.info("parent %s is answering again", parent)

    async def each_parent(self, attempt: Callable[[str], Awaitable[T]], *, what: str, rotate: int = 0,
                          keep: tuple[type[DeltaSyncError], ...] = (),
                          on_failure: Callable[[str, BaseException], None] | None = None, hedge: bool = False) -> T:
        """``attempt(parent)`` on each parent in failover order until one delivers (``first_source``);
        ``hedge``: ask the next parent in parallel while one is silent (only for reads with no shared state)."""
        def failed(parent: str, e: BaseException, cooldown: float | None) -> None:
            if on_failure is not None:
                on_failure(parent, e)
            self._failed(parent, describe(e), cooldown)

        hedge_after = self.timeouts.hedge_after if hedge and len(self.parents) > 1 else None
        return await first_source(self.failover, attempt, what=what, outage=is_outage, on_failure=failed,
                                  keep=keep, rotate=rotate, hedge_after=hedge_after)

    # -- requests ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def request(self, method: str, url: str, **kw) -> AsyncIterator[aiohttp.ClientResponse]:
        """A request whose status line must come within ``Timeouts.ttfb`` (else UpstreamTimeout)."""
        t = self.timeouts
        ttfb = t.ttfb if len(self.parents) > 1 else max(t.ttfb, t.read)  # one parent: nowhere else to go
        try:
            async with asyncio.timeout(ttfb):
                resp = await self.session.request(method, url, **kw)
        except TimeoutError:
            raise UpstreamTimeout(f"{method} {url}: no answer within {ttfb:g} s (time-to-first-byte limit)") from None
        answering()
        async with resp:
            try:
                yield resp
            except RuntimeError as e:
                # aiohttp (3.14) after its parser failed on a mangled chunk-size line: the connection is
                # closed under the body's reader, which then raises this (or, already waiting, waits
                # for ever: every body read here has a bound of its own). A cut answer: the parent's fault.
                if str(e) != "Connection closed.":
                    raise
                raise UpstreamError(f"{method} {url}: the connection was closed mid-answer") from None

    async def read_body(self, resp: aiohttp.ClientResponse, what: str, *, limit: int) -> bytes:
        """A whole (small) body: at most ``4 * Timeouts.read`` in all, and at the minimum rate
        (``Timeouts.min_rate`` after ``rate_grace``: ``FellBehind``), however often the parent sends a byte;
        more than ``limit`` bytes is the parent's fault."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        pace = self.timeouts.pace(start, what)
        end = start + 4 * self.timeouts.read
        parts: list[bytes] = []
        n = 0
        while True:
            left = min(end, pace.due(n)) - loop.time()
            try:
                async with asyncio.timeout(max(left, 0.0) + 1e-3):
                    piece = await resp.content.readany()
            except TimeoutError:
                pace.check(n, loop.time())
                raise UpstreamTimeout(f"{what}: not all sent within {4 * self.timeouts.read:g} s") from None
            if not piece:
                return b"".join(parts)
            parts.append(piece)
            n += len(piece)
            if n > limit:
                raise UpstreamError(f"{what}: a body of more than {limit:,} bytes")

    def blob_request(self, parent: str, blob_id: str, offset: int = 0, *, method: str = "GET"):
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        return self.request(method, f"{parent}/v1/blobs/{blob_id}", headers=headers)

    def events_request(self, parent: str, *, read_timeout: float):
        t = self.timeouts
        return self.request(
            "GET", f"{parent}/v1/events", headers={"Accept": "text/event-stream"},
            timeout=aiohttp.ClientTimeout(total=None, connect=t.connect, sock_connect=t.connect, sock_read=read_timeout),
        )

    async def get_manifest(self, model: str, version: int) -> Manifest:
        """A version's manifest from the first parent that has it (signature checked when we hold a key)."""
        return await self._get_manifest_path(f"/v1/models/{model}/versions/{version}", f"{model} v{version}",
                                             model=model, version=version)

    async def _get_manifest_path(self, path: str, what: str, *, model: str, version: int | None) -> Manifest:
        async def attempt(parent: str) -> Manifest:
            async with self.request("GET", parent + path) as resp:
                if resp.status == 404:
                    raise NotFoundError(f"{parent} has no {what}")
                if resp.status != 200:
                    raise UpstreamError(f"{parent} answered {resp.status} for {what}")
                if (resp.content_length or 0) > self.max_manifest_size:
                    raise UpstreamError(f"{parent} sent a {resp.content_length}-byte manifest for {what}")
                body = await self.read_body(resp, f"{parent}: {what}", limit=self.max_manifest_size)
            try:
                m = parse_manifest(body, verifier=self.verifier, records=self.table_check)
            except SignatureError as e:
                log.error("parent %s sent %s with a bad signature: %s", parent, what, e)
                raise
            if m.model != model or (version is not None and m.version != version):
                raise FormatError(f"{parent} answered {m.model} v{m.version} when asked for {what}")
            self.metrics.inc("manifest_fetches")
            return m

        try:
            return await self.each_parent(attempt, what=what, keep=(SignatureError, FormatError), hedge=True)
        except NotFoundError:
            raise NotFoundError(f"{what} is not on this relay nor on any of its parents") from None

    async def head_blob(self, blob_id: str) -> int | None:
        """The size of a blob according to the first parent that has it; None if none has it."""
        async def attempt(parent: str) -> int:
            async with self.blob_request(parent, blob_id, method="HEAD") as resp:
                if resp.status == 404:
                    raise NotFoundError(f"{parent} has no blob {blob_id}")
                if resp.status == 200 and resp.content_length is not None:
                    return resp.content_length
                raise UpstreamError(f"{parent} answered {resp.status} to HEAD of blob {blob_id}")

        try:
            return await self.each_parent(attempt, what=f"HEAD of blob {blob_id}", hedge=True)
        except NotFoundError:
            return None
