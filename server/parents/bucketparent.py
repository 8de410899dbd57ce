"""A bucket as a relay's parent: ``--parent s3://BUCKET/PREFIX`` (or ``bucket+https://HOST/PREFIX``).

The relay's parent code (upstream.py, fetcher.py, prefetch.py) speaks the deltasync
parent protocol (docs/PROTOCOL.md). Rather than teach it a second protocol, each
bucket parent is a ``BucketGateway``: a small read-only server on a loopback port
*inside the relay process* that answers the parent subset of that protocol from the
bucket, and whose URL takes the bucket's place in the relay's parent list. So a
bucket parent gets exactly what an origin parent gets, by the same code: manifest
signatures checked, every blob hashed before it is stored and before its last byte
reaches a child, one fetch per blob however many children ask (coalescing), bytes
forwarded as they arrive (cut-through), ``Range`` resume, failover between parents
in order (say ``--parent http://origin:7070 --parent s3://weights/fleet``: the bucket
is used while the origin is down). The cost is one loopback copy of each blob.

What the gateway serves, from the bucket layout (docs/FORMAT.md "Bucket layout"):

* ``GET|HEAD /v1/blobs/{id}`` with ``Range: bytes=N-`` (a ranged GET; on a server that
  ignores ranges, the whole object read and skipped: see s3objects.py);
* ``GET /v1/models/{model}/versions/{version}`` and ``.../head``: manifest bytes as stored;
* ``GET /v1/events``: a server-sent event stream made by polling ``heads.json`` every
  ``poll_interval`` seconds (bucketwatch.py): a ``head`` event per model on connect,
  a ``version`` event whenever a model's newest version moves, a keepalive comment
  every ``heartbeat``. The relay walks back from a head through parent links, so
  versions between two polls are not lost.

Bucket failures answer 503 (the relay fails over to its next parent and retries).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator

from aiohttp import web

from deltasync.blob import check_blob_id
from deltasync.errors import DeltaSyncError, FormatError, NotFoundError
from deltasync.manifest import MAX_VERSION, MODEL_RE

from ..storage.bucketlayout import blob_key, manifest_key
from ..storage.bucketwatch import HeadsWatcher
from ..compat import timeout as timeout_after
from deltasync.errors import UnavailableError
from ..events import format_event
from ..storage.bucketlayout import BucketLocation
from ..storage.s3objects import Bucket

log = logging.getLogger("deltasync.server.bucketparent")

_RANGE = re.compile(r"^bytes=(\d+)-$")
GATEWAY = web.AppKey("gateway", object)


class BucketGateway:
    """The parent protocol's read side, answered from one bucket, on 127.0.0.1."""

    def __init__(self, location: BucketLocation, *, poll_interval: float = 1.0, heartbeat: float = 10.0,
                 read_timeout: float = 30.0, write_timeout: float = 60.0) -> None:
        self.bucket = Bucket(location, read_timeout=read_timeout)
        self.watcher = HeadsWatcher(self.bucket)
        self.poll_interval = poll_interval
        self.heartbeat = heartbeat
        self.write_timeout = write_timeout
        self.url: str | None = None
        self._subs: set[asyncio.Queue] = set()
        self._changed = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._poller: asyncio.Task | None = None
        self.polls = 0
        self.poll_failures = 0

    # -- lifetime --------------------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application(middlewares=[_errors])
        app[GATEWAY] = self
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/v1/blobs/{id}", self._blob)
        app.router.add_get("/v1/models/{model}/versions/{version}", self._version)
        app.router.add_get("/v1/models/{model}/head", self._head)
        app.router.add_get("/v1/events", self._events)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever(), name="bucket-poll")
        log.info("bucket parent %s served to this relay at %s (polling every %.1f s)", self.bucket.where, self.url,
                 self.poll_interval)
        return self.url

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for q in list(self._subs):
            q.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- polling -----------------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        failures = 0
        while True:
            try:
                moved = await self.watcher.poll()
                self.polls += 1
                if failures:
                    log.info("bucket %s answers again", self.bucket.where)
                failures = 0
            except DeltaSyncError as e:
                failures += 1
                self.poll_failures += 1
                if failures & (failures - 1) == 0:
                    log.warning("polling bucket %s failed (%s; %d in a row)", self.bucket.where, e, failures)
                moved = {}
            for model, version in sorted(moved.items()):
                log.debug("bucket %s: %s is at v%d", self.bucket.where, model, version)
                for q in list(self._subs):
                    try:
                        q.put_nowait((model, version))
                    except asyncio.QueueFull:  # a stalled follower: end its stream, it reconnects
                        self._subs.discard(q)
                        q.put_nowait(None)
            if self.polls == 1 or moved:
                self._changed.set()
            await asyncio.sleep(self.poll_interval * (1 if not failures else min(2 ** failures, 10)))

    async def _first_poll(self, timeout: float) -> None:
        if self.polls:
            return
        try:
            async with timeout_after(timeout):
                await self._changed.wait()
        except asyncio.TimeoutError:
            raise UnavailableError(f"the bucket {self.bucket.where} has not answered a poll yet") from None

    # -- routes ------------------------------------------------------------------------------
    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": "bucket", "bucket": self.bucket.where,
                                  "models": dict(sorted(self.watcher.heads.items()))})

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        blob_id = check_blob_id(request.match_info["id"])
        key = blob_key(blob_id)
        headers = {"ETag": f'"{blob_id}"', "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if request.method == "HEAD":
            size = await self.bucket.head(key)
            if size is None:
                raise NotFoundError(f"blob {blob_id} is not in the bucket {self.bucket.where}")
            resp = web.StreamResponse(headers=headers)
            resp.content_length = size
            await resp.prepare(request)
            return resp
        offset = 0
        rng = request.headers.get("Range")
        if rng:
            m = _RANGE.match(rng.strip())
            if not m:
                raise FormatError(f"the bucket parent serves only 'Range: bytes=N-', found {rng!r}")
            offset = int(m.group(1))
        opened = await self.bucket.open_stream(key, offset)
        if opened is None:
            raise NotFoundError(f"blob {blob_id} is not in the bucket {self.bucket.where}")
        size, pieces = opened
        if offset > size or (offset and offset == size):
            await pieces.aclose()
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        if offset:
            headers["Content-Range"] = f"bytes {offset}-{size - 1}/{size}"
        resp = web.StreamResponse(status=206 if offset else 200, headers=headers)
        resp.content_length = size - offset
        await resp.prepare(request)
        try:
            async for piece in pieces:
                async with timeout_after(self.write_timeout):
                    await resp.write(piece)
        except (DeltaSyncError, ConnectionError, asyncio.TimeoutError) as e:
            log.info("blob %s from the bucket cut off: %s", blob_id, e)
            if request.transport is not None:
                request.transport.abort()  # a truncated body is the only honest signal now
            return resp
        finally:
            await pieces.aclose()
        await resp.write_eof()
        return resp

    async def _version(self, request: web.Request) -> web.Response:
        model, version = _model(request), _version(request.match_info["version"])
        return await self._manifest(model, version)

    async def _head(self, request: web.Request) -> web.Response:
        model = _model(request)
        await self._first_poll(self.heartbeat)
        version = self.watcher.heads.get(model)
        if version is None:
            raise NotFoundError(f"model {model!r} has no versions in the bucket {self.bucket.where}")
        return await self._manifest(model, version, cache="no-cache")

    async def _manifest(self, model: str, version: int, *, cache: str = "public, max-age=31536000, immutable"
                        ) -> web.Response:
        data = await self.bucket.get(manifest_key(model, version))
        if data is None:
            raise NotFoundError(f"{model} v{version} is not in the bucket {self.bucket.where}")
        return web.Response(body=data, content_type="application/json",
                            headers={"Cache-Control": cache, "X-Deltasync-Version": str(version)})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        await self._first_poll(self.heartbeat)
        queue: asyncio.Queue = asyncio.Queue(maxsize=1024)
        self._subs.add(queue)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            out = [b"retry: 2000\n\n"]
            for model, version in sorted(self.watcher.heads.items()):
                out.append(format_event("head", {"model": model, "version": version}))
            await self._write(resp, b"".join(out))
            while True:
                try:
                    async with timeout_after(self.heartbeat):
                        item = await queue.get()
                except asyncio.TimeoutError:
                    await self._write(resp, b": keepalive\n\n")
                    continue
                if item is None:
                    break
                model, version = item
                await self._write(resp, format_event("version", {"model": model, "version": version}))
        except (ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            self._subs.discard(queue)
        return resp

    async def _write(self, resp: web.StreamResponse, data: bytes) -> None:
        async with timeout_after(self.write_timeout):
            await resp.write(data)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except DeltaSyncError as e:
        body = {"error": {"status": e.http_status, "code": type(e).__name__, "message": str(e)}}
        return web.Response(status=e.http_status, body=json.dumps(body).encode(), content_type="application/json")


def _model(request: web.Request) -> str:
    model = request.match_info["model"]
    if not MODEL_RE.match(model):
        raise FormatError(f"model name {model!r} must match {MODEL_RE.pattern}")
    return model


def _version(text: str) -> int:
    if not text.isdigit() or int(text) > MAX_VERSION:
        raise FormatError(f"version must be a non-negative integer, found {text!r}")
    return int(text)


@asynccontextmanager
async def bucket_parents(parents: tuple[str, ...], *, endpoint: str | None, poll_interval: float,
                         heartbeat: float, read_timeout: float, write_timeout: float
                         ) -> AsyncIterator[tuple[str, ...]]:
    """Start a gateway for every bucket among ``parents``; yields the parent list with each bucket
    replaced by its gateway's URL (other parents unchanged, order kept)."""
    from ..storage.bucketlayout import is_bucket_url, parse_bucket_url

    gateways: list[BucketGateway] = []
    out: list[str] = []
    try:
        for p in parents:
            if not is_bucket_url(p):
                out.append(p)
                continue
            gw = BucketGateway(parse_bucket_url(p, endpoint=endpoint), poll_interval=poll_interval,
                               heartbeat=heartbeat, read_timeout=read_timeout, write_timeout=write_timeout)
            gateways.append(gw)
            out.append(await gw.start())
        yield tuple(out)
    finally:
        for gw in gateways:
            await gw.close()
