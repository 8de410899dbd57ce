"""A relay's parents: one HTTP client session, failover order, manifest and blob requests.

Parents are tried in the order given. A parent that fails (refused connection,
timeout, 5xx, a body cut short, bytes that fail their hash) is put in a cool-down
(doubling with each consecutive failure, up to a minute) and tried after the
healthy ones until it answers well again. Every request has a
connect timeout and a read timeout (silence on the socket), so a dead or stalled
parent costs at most that long before the next one is tried.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from deltasync.errors import DeltaSyncError, FormatError, NotFoundError, SignatureError
from deltasync.manifest import Manifest, parse_manifest

from .config import Timeouts
from .errors import UpstreamError, UpstreamTimeout
from .metrics import Metrics

log = logging.getLogger("deltasync.server.upstream")

USER_AGENT = "deltasync-relay/0.1"
READ_BUFSIZE = 4 << 20
MAX_COOLDOWN = 60.0


class Upstream:
    def __init__(self, parents: tuple[str, ...], *, timeouts: Timeouts, metrics: Metrics,
                 key: bytes | None = None, max_manifest_size: int = 64 << 20) -> None:
        if not parents:
            raise ValueError("a relay needs at least one parent")
        self.parents = tuple(p.rstrip("/") for p in parents)
        self.timeouts = timeouts
        self.metrics = metrics
        self.key = key
        self.max_manifest_size = max_manifest_size
        self._cooldown_until: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        t = self.timeouts
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=t.connect, sock_connect=t.connect, sock_read=t.read),
            connector=aiohttp.TCPConnector(limit=512, limit_per_host=0, keepalive_timeout=30),
            auto_decompress=False, read_bufsize=READ_BUFSIZE, headers={"User-Agent": USER_AGENT},
        )

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
        """Parents to try, in order: healthy ones by preference, then cooling-down ones soonest first.

        ``rotate`` starts the healthy list further down (used to avoid a parent whose bytes just
        failed their hash check).
        """
        now = time.monotonic()
        healthy = [p for p in self.parents if self._cooldown_until.get(p, 0.0) <= now]
        if healthy and rotate:
            k = rotate % len(healthy)
            healthy = healthy[k:] + healthy[:k]
        cooling = sorted((p for p in self.parents if p not in healthy), key=lambda p: self._cooldown_until[p])
        return healthy + cooling

    def mark_failed(self, parent: str, why: object) -> None:
        now = time.monotonic()
        if self._cooldown_until.get(parent, 0.0) > now:
            return  # already cooling down (several requests failed at once)
        n = self._failures[parent] = self._failures.get(parent, 0) + 1
        self._cooldown_until[parent] = now + min(self.timeouts.parent_cooldown * 2 ** (n - 1), MAX_COOLDOWN)
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th... failure in a row
            log.warning("parent %s failed (%s; %d in a row); trying the next parent", parent, why, n)

    def mark_ok(self, parent: str) -> None:
        self._cooldown_until.pop(parent, None)
        if self._failures.pop(parent, None) is not None:
            log.info("parent %s is answering again", parent)

    # -- requests ------------------------------------------------------------------------
    def blob_request(self, parent: str, blob_id: str, offset: int = 0, *, method: str = "GET"):
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        return self.session.request(method, f"{parent}/v1/blobs/{blob_id}", headers=headers)

    def events_request(self, parent: str, *, read_timeout: float):
        t = self.timeouts
        return self.session.get(
            f"{parent}/v1/events", headers={"Accept": "text/event-stream"},
            timeout=aiohttp.ClientTimeout(total=None, connect=t.connect, sock_connect=t.connect, sock_read=read_timeout),
        )

    async def get_manifest(self, model: str, version: int) -> Manifest:
        """A version's manifest from the first parent that has it (signature checked when we hold a key)."""
        return await self._get_manifest_path(f"/v1/models/{model}/versions/{version}", f"{model} v{version}",
                                             model=model, version=version)

    async def _get_manifest_path(self, path: str, what: str, *, model: str, version: int | None) -> Manifest:
        not_found = 0
        last: BaseException | None = None
        tried = self.candidates()
        for parent in tried:
            try:
                async with self.session.get(parent + path) as resp:
                    if resp.status == 404:
                        not_found += 1
                        continue
                    if resp.status != 200:
                        raise UpstreamError(f"{parent} answered {resp.status} for {what}")
                    if (resp.content_length or 0) > self.max_manifest_size:
                        raise UpstreamError(f"{parent} sent a {resp.content_length}-byte manifest for {what}")
                    body = await resp.read()
                m = parse_manifest(body, key=self.key)
                if m.model != model or (version is not None and m.version != version):
                    raise FormatError(f"{parent} answered {m.model} v{m.version} when asked for {what}")
                self.metrics.inc("manifest_fetches")
                self.mark_ok(parent)
                return m
            except SignatureError as e:
                log.error("parent %s sent %s with a bad signature: %s", parent, what, e)
                last = e
                self.mark_failed(parent, "bad manifest signature")
            except (DeltaSyncError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = e
                self.mark_failed(parent, _describe(e))
        if not_found == len(tried):
            raise NotFoundError(f"{what} is not on this relay nor on any of its parents")
        if isinstance(last, (SignatureError, FormatError)):
            raise last
        if isinstance(last, asyncio.TimeoutError):
            raise UpstreamTimeout(f"every parent timed out fetching {what}")
        raise UpstreamError(f"no parent could serve {what}: {_describe(last)}")

    async def head_blob(self, blob_id: str) -> int | None:
        """The size of a blob according to the first parent that has it; None if none has it."""
        not_found = 0
        tried = self.candidates()
        for parent in tried:
            try:
                async with self.blob_request(parent, blob_id, method="HEAD") as resp:
                    if resp.status == 404:
                        not_found += 1
                        continue
                    if resp.status == 200 and resp.content_length is not None:
                        return resp.content_length
                    raise UpstreamError(f"{parent} answered {resp.status} to HEAD of blob {blob_id}")
            except (DeltaSyncError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self.mark_failed(parent, _describe(e))
        if not_found == len(tried):
            return None
        raise UpstreamError(f"no parent answered for blob {blob_id}")


def _describe(e: BaseException | None) -> str:
    if e is None:
        return "no parent answered"
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
