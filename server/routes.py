"""The HTTP API (docs/PROTOCOL.md): the one place where errors become responses.

Every route is the same on an origin and a relay, except the writes (origin only;
a relay answers them 405) and what a miss means (an origin answers 404, a relay
asks its parents).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import re
from collections.abc import AsyncIterator

import aiohttp
import xxhash
from aiohttp import web

from deltasync.blob import check_blob_id
from deltasync.errors import (
    AuthError,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    NotFoundError,
    ReadOnlyError,
    StorageError,
    TooLargeError,
    UnavailableError,
    to_wire,
)
from deltasync.manifest import MAX_VERSION, MODEL_RE, parse_manifest

from .compat import timeout as timeout_after
from .http.connections import UploadPace
from .events import INLINE_MANIFEST_MAX, Hint, event_payload, format_event
from .http.inflight import InflightBlob
from .http.ranges import etag_matches, if_range_allows, parse_range
from .http.sendfile import send_blob_range
from .http.tokens import bearer
from .http import uploadrecv
from .services import Services

log = logging.getLogger("deltasync.server.routes")
timeline = logging.getLogger("deltasync.timeline")  # time.monotonic() stamps: benchmarks/step_timeline.py

SERVICES = web.AppKey("services", Services)
IMMUTABLE = "public, max-age=31536000, immutable"
JSON = "application/json"
_VERSION_RE = re.compile(r"^[0-9]{1,19}$")
REPLAY_LIMIT = 1024
MODEL_HEADER = "X-Deltasync-Model"  # a blob PUT's model: hinted only if the token may publish it (_may_hint)


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/healthz", healthz)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/blobs/{id}", get_blob)  # add_get also routes HEAD here
    r.add_put("/v1/blobs/{id}", put_blob)
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/events", all_events)
    r.add_get("/v1/models/{model}/head", get_head)
    r.add_get("/v1/models/{model}/versions/{version}", get_version)
    r.add_put("/v1/models/{model}/versions/{version}", put_version)
    r.add_get("/v1/models/{model}/events", model_events)
    r.add_get("/v1/models/{model}/delta", get_delta)


# -- errors -------------------------------------------------------------------------------

def error_response(status: int, code: str, message: str, **extra) -> web.Response:
    body = {"error": {"status": status, "code": code, "message": message, **extra}}
    return web.Response(status=status, body=json.dumps(body).encode(), content_type=JSON)


_HTTP_CODES = {400: "format", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


#: set on a request whose body ``uploadrecv`` took past aiohttp's parser: its connection closes after the answer
_BODY_TAKEN = web.RequestKey("deltasync.body_taken", bool) if hasattr(web, "RequestKey") else "deltasync.body_taken"


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    resp = await _handle(request, handler)
    if resp.status >= 400 and (request.get(_BODY_TAKEN) or (request.body_exists and not request.content.is_eof())):
        resp.force_close()  # a refused upload's unread (or taken) body: drop the connection, and say so
    return resp


async def _handle(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except DeltaSyncError as e:
        wire = to_wire(e)  # code, status, extra members and headers all come from the error tree
        resp = error_response(wire.status, wire.code, wire.message, **wire.extra)
        resp.headers.update(wire.headers)
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = error_response(e.status, _HTTP_CODES.get(e.status, "http"), e.reason or "error")
        for h in ("Allow",):
            if h in e.headers:
                resp.headers[h] = e.headers[h]
        return resp
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal", f"internal error: {type(e).__name__}")


# -- helpers --------------------------------------------------------------------------------

def _svc(request: web.Request) -> Services:
    return request.app[SERVICES]


def _model(request: web.Request) -> str:
    model = request.match_info["model"]
    if not MODEL_RE.match(model):
        raise FormatError(f"model name {model!r} must match {MODEL_RE.pattern}")
    return model


def _version(text: str, what: str = "version") -> int:
    if not _VERSION_RE.match(text) or int(text) > MAX_VERSION:
        raise FormatError(f"{what} must be a non-negative integer, found {text!r}")
    return int(text)


def _query_int(request: web.Request, name: str) -> int | None:
    text = request.query.get(name)
    return None if text is None else _version(text, name)


def _check_token(svc: Services, request: web.Request) -> None:
    if not svc.config.is_origin:
        raise ReadOnlyError("relays are read-only; send writes to the origin")
    token = bearer(request.headers.get("Authorization"))
    if token is None:
        raise AuthError("writes need 'Authorization: Bearer <token>'")
    table = svc.config.token_table
    model = request.match_info.get("model")  # blob PUTs: any publish token (blobs are shared content)
    if table is None or not table.allows(token, "publish", model):
        raise AuthError("the bearer token may not publish " + (f"model {model!r}" if model else "to this origin"))


def _may_hint(svc: Services, request: web.Request) -> bool:
    """Whether a blob PUT may be hinted to relays: it names its model (``X-Deltasync-Model``) and its token may
    publish that model (a PUT without the header, or naming another model, is stored but not hinted)."""
    model = request.headers.get(MODEL_HEADER)
    table = svc.config.token_table
    if model is None or not MODEL_RE.match(model) or table is None:
        return False
    return table.allows(bearer(request.headers.get("Authorization")), "publish", model)


def _manifest_response(data: bytes, *, version: int, etag: str, cache: str) -> web.Response:
    return web.Response(body=data, content_type=JSON, headers={
        "ETag": etag, "Cache-Control": cache, "X-Deltasync-Version": str(version)})


# -- health and metrics -----------------------------------------------------------------------

def _storage_error(svc: Services) -> str | None:
    """Why this server's disk cannot hold what it was given (blob fetch or manifest write), or None."""
    return (svc.fetcher.storage_error if svc.fetcher is not None else None) or getattr(svc.store, "storage_error", None)


def _check_can_hold(svc: Services, model: str) -> None:
    """A relay whose disk cannot hold a version its parent has: 507 (its own fault, not the parent's), so a
    child moves on to its next source instead of waiting here for a version this relay will never hold."""
    if svc.prefetcher is None:
        return
    storage = _storage_error(svc)
    if storage is None or svc.prefetcher.lag(model) <= 0:
        return
    raise StorageError(f"this relay is behind its parent on {model!r} (head {svc.store.head(model)}, parent "
                       f"v{svc.prefetcher.parent_heads.get(model)}) and its disk cannot hold more ({storage}); "
                       "ask another source")


async def healthz(request: web.Request) -> web.Response:
    svc = _svc(request)
    storage = _storage_error(svc)
    status = "shutting_down" if svc.hub.closed else "degraded" if storage else "ok"
    writer_status = getattr(svc.store, "writer_status", None)  # a bucket store without conditional writes
    writer = writer_status() if writer_status is not None else None
    if status == "ok" and writer is not None and writer["lease"] == "standby":
        status = "standby"  # reads served; writes wait for the writer lease (503 until it is taken)
    body = {"status": status, "role": svc.config.role,
            "models": {name: svc.store.head(name) for name in sorted(svc.store.models)}}
    if writer is not None:
        body["writer"] = writer
    if storage:
        body["storage"] = storage  # the disk cannot hold what the parents send: misses answer 507
    if svc.prefetcher is not None:
        body["following"] = svc.prefetcher.following
        body["parents"] = list(svc.config.parents)
    return web.json_response(body, status=200 if status in ("ok", "standby") else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=_svc(request).metrics.render().encode(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8", "Cache-Control": "no-cache"})


# -- blobs --------------------------------------------------------------------------------------

def _blob_headers(blob_id: str) -> dict[str, str]:
    return {"ETag": f'"{blob_id}"', "Cache-Control": IMMUTABLE, "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream"}


async def get_blob(request: web.Request) -> web.StreamResponse:
    svc = _svc(request)
    blob_id = check_blob_id(request.match_info["id"])
    svc.metrics.inc("blob_requests")
    etag = f'"{blob_id}"'
    if etag_matches(request.headers.get("If-None-Match"), etag):
        return web.Response(status=304, headers={"ETag": etag, "Cache-Control": IMMUTABLE})
    store = svc.store
    reader = None
    if store.has_blob(blob_id):
        if store.needs_verify(blob_id) and not await store.verify_cached(blob_id):
            svc.metrics.inc("corrupt_dropped")  # dropped: a relay refetches it below; an origin has lost it
        else:
            reader = await store.open_blob(blob_id)  # None: evicted a moment ago
    if reader is not None:
        svc.metrics.inc("cache_hits")
        try:
            async def body(resp: web.StreamResponse, start: int, end: int) -> None:
                sent = await send_blob_range(request, resp, reader, start, end - start,
                                             timeout=svc.config.timeouts.write)
                svc.metrics.inc("bytes_out", sent)
            return await _send_blob(request, svc, blob_id, reader.size, body, cache="hit")
        finally:
            reader.close()
    if svc.intake is not None and (up := svc.intake.inflight(blob_id)) is not None:
        svc.metrics.inc("upload_reads")  # an upload arriving now: cut-through, the last byte once it is verified
        return await _send_inflight(request, svc, up, cache="upload")
    if svc.fetcher is None:
        raise NotFoundError(f"blob {blob_id} is not on this origin")
    svc.metrics.inc("cache_misses")
    if request.method == "HEAD" and svc.fetcher.inflight(blob_id) is None:
        if svc.fetcher.known_missing(blob_id):
            svc.metrics.inc("negative_hits")
            raise NotFoundError(f"blob {blob_id} is not on this relay nor on any of its parents")
        size = await svc.upstream.head_blob(blob_id)
        if size is None:
            svc.fetcher.remember_missing(blob_id)
            raise NotFoundError(f"blob {blob_id} is not on this relay nor on any of its parents")
        resp = web.StreamResponse(headers={**_blob_headers(blob_id), "X-Deltasync-Cache": "miss"})
        resp.content_length = size
        await resp.prepare(request)
        return resp
    blob, started = svc.fetcher.get(blob_id)
    if not started:
        svc.metrics.inc("coalesced")
    return await _send_inflight(request, svc, blob, cache="miss")


async def _send_inflight(request: web.Request, svc: Services, blob: InflightBlob, *, cache: str) -> web.StreamResponse:
    """A blob still arriving (a relay's fetch, an origin's upload), sent as its bytes come."""
    blob.attach()
    try:
        size = await blob.wait_size(svc.config.timeouts.first_byte)
        return await _send_blob(request, svc, blob.id, size, _inflight_body(request, svc, blob, size), cache=cache)
    finally:
        blob.detach()


def _inflight_body(request: web.Request, svc: Services, blob: InflightBlob, size: int):
    t = svc.config.timeouts

    def sent(n: int) -> None:
        svc.metrics.inc("bytes_out", n)

    async def body(resp: web.StreamResponse, start: int, end: int) -> None:
        await blob.send_range(request, resp, start, end, stall_timeout=t.first_byte, write_timeout=t.write,
                              on_sent=sent, promised=size)
    return body


async def _send_blob(request: web.Request, svc: Services, blob_id: str, size: int, body, *, cache: str
                     ) -> web.StreamResponse:
    etag = f'"{blob_id}"'
    rng = None
    if if_range_allows(request.headers.get("If-Range"), etag):
        rng = parse_range(request.headers.get("Range"), size)
    headers = {**_blob_headers(blob_id), "X-Deltasync-Cache": cache}
    start, end = rng if rng is not None else (0, size)
    if rng is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    resp = web.StreamResponse(status=206 if rng is not None else 200, headers=headers)
    resp.content_length = end - start
    await resp.prepare(request)
    if request.method == "HEAD" or end == start:
        await resp.write_eof()
        return resp
    svc.streams.blobs += 1
    try:
        await body(resp, start, end)
    except (DeltaSyncError, ConnectionError, EOFError, OSError, asyncio.TimeoutError) as e:
        # The status line is out; the only honest signal left is a truncated body.
        svc.metrics.inc("send_aborts")
        log.info("blob %s: response to %s cut off: %s", blob_id, request.remote, e)
        if request.transport is not None:
            request.transport.abort()
        return resp
    finally:
        svc.streams.blobs -= 1
    await resp.write_eof()
    return resp


async def put_blob(request: web.Request) -> web.Response:
    svc = _svc(request)
    try:
        _check_token(svc, request)
        blob_id = check_blob_id(request.match_info["id"])
        assert svc.intake is not None
        try:
            hint = _may_hint(svc, request)
            if uploadrecv.usable(request):  # a large body: received straight into one buffer (uploadrecv.py)
                size, created = await _put_blob_direct(svc.intake, blob_id, request, hint=hint)
            else:
                size, created = await svc.intake.put_blob(blob_id, _pieces(request.content,
                                                                           UploadPace(svc.config.limits)),
                                                          declared=request.content_length, hint=hint)
        except (aiohttp.ClientPayloadError, ConnectionError, asyncio.IncompleteReadError) as e:
            raise FormatError(f"upload of blob {blob_id} was cut short: {e}") from None
    except DeltaSyncError:
        svc.metrics.inc("upload_rejections")
        raise
    resp = web.json_response({"id": blob_id, "size": size, "created": created}, status=201 if created else 200,
                             headers={"ETag": f'"{blob_id}"', "Location": f"/v1/blobs/{blob_id}"})
    if request.get(_BODY_TAKEN):
        resp.force_close()  # says "Connection: close", so a client does not send its next request on it
    return resp


async def _put_blob_direct(intake, blob_id: str, request: web.Request, *, hint: bool) -> tuple[int, bool]:
    size = intake.stored_size(blob_id, declared=request.content_length)
    if size is not None:
        return size, False  # its body is not read (aiohttp drains it, as for any upload of a stored blob)
    up = await intake.open_upload(blob_id, declared=request.content_length, hint=hint)
    intake.metrics.inc("uploads_direct")
    try:
        request[_BODY_TAKEN] = True  # from here on the connection closes after the answer, whatever it is
        await uploadrecv.receive(request, up.feed, UploadPace(_svc(request).config.limits))
        return await up.finish()
    finally:
        up.close()


async def _pieces(content, pace: UploadPace) -> AsyncIterator[bytes]:
    """A request body piece by piece as received (no joining of buffered pieces into new objects);
    RequestTimeoutError if the sender stalls or falls under the minimum upload rate (``pace``)."""
    while True:
        try:
            async with timeout_after(pace.wait_limit()):
                chunk, boundary = await content.readchunk()
        except asyncio.TimeoutError:
            raise pace.silent() from None
        if chunk:
            pace.got(len(chunk))
            yield chunk
        elif not boundary:
            return


# -- manifests ------------------------------------------------------------------------------------

async def served_manifest(svc: Services, model: str, version: int) -> bytes:
    """A stored manifest's bytes, checked before they are served: they must hash to the etag indexed when the
    manifest was verified, and the first time this process serves it they must parse (and verify, with the
    key). A copy that fails is a relay's own damage: dropped and fetched again from a parent, like a bad blob
    (an origin answers 507: it has nothing to refetch from)."""
    info = svc.store.info(model, version)
    data = await svc.catalog.manifest_bytes(model, version)
    info = info or svc.store.info(model, version)
    mark = (model, version, info.etag if info is not None else None)
    try:
        if info is None or f'"{xxhash.xxh3_64_hexdigest(data)}"' != info.etag:
            raise IntegrityError(f"{model} v{version}: the stored bytes do not hash to their etag")
        if mark not in svc.catalog.checked:
            m = parse_manifest(data, verifier=svc.config.verifier, records=False)
            if m.model != model or m.version != version:
                raise IntegrityError(f"the file of {model} v{version} holds {m.model} v{m.version}")
            svc.catalog.checked.add(mark)
        return data
    except (FormatError, IntegrityError) as e:  # SignatureError is an IntegrityError
        svc.metrics.inc("corrupt_dropped")
        if svc.upstream is None:
            log.error("%s v%d on disk is damaged (%s); it cannot be served", model, version, e)
            raise StorageError(f"{model} v{version} is damaged in this origin's store: {e}") from None
        log.error("%s v%d on disk is damaged (%s); fetching it again from a parent", model, version, e)
    m = await svc.upstream.get_manifest(model, version)  # verified with the key, when we hold one
    await svc.store.put_manifest(m, announce=False)
    data = m.to_json()
    info = svc.store.info(model, version)
    if info is not None:
        svc.catalog.checked.add((model, version, info.etag))
    return data


async def list_models(request: web.Request) -> web.Response:
    store = _svc(request).store
    models = [{"model": name, "head": idx.head, "versions": len(idx.order)} for name, idx in sorted(store.models.items())
              if idx.head is not None]
    return web.json_response({"models": models}, headers={"Cache-Control": "no-cache"})


async def get_version(request: web.Request) -> web.Response:
    svc = _svc(request)
    model = _model(request)
    version = _version(request.match_info["version"])
    data = await served_manifest(svc, model, version)
    info = svc.store.info(model, version)
    if etag_matches(request.headers.get("If-None-Match"), info.etag):
        return web.Response(status=304, headers={"ETag": info.etag, "Cache-Control": IMMUTABLE})
    return _manifest_response(data, version=version, etag=info.etag, cache=IMMUTABLE)


async def get_head(request: web.Request) -> web.Response:
    svc = _svc(request)
    model = _model(request)
    # after=-1: wait for the first version (a subscriber started before anything was published)
    after = -1 if request.query.get("after") == "-1" else _query_int(request, "after")
    wait_text = request.query.get("wait")
    if wait_text is not None and after is None:
        raise FormatError("wait= needs after=")
    if after is not None or svc.store.head(model) is not None:  # (a relay with nothing of it answers 404)
        _check_can_hold(svc, model)
    if after is not None:
        try:
            wait = float(wait_text) if wait_text is not None else 0.0
        except ValueError:
            raise FormatError(f"wait must be a number of seconds, found {wait_text!r}") from None
        if not 0 <= wait < float("inf"):
            raise FormatError(f"wait must be a non-negative number of seconds, found {wait_text!r}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait, svc.config.timeouts.max_wait)
        while True:
            head = svc.store.head(model)
            if head is not None and head > after:
                break
            left = deadline - loop.time()
            if left <= 0 or svc.hub.closed:
                headers = {"Cache-Control": "no-cache"}
                if head is not None:
                    headers["X-Deltasync-Head"] = str(head)
                return web.Response(status=204, headers=headers)
            # on a relay, in slices: a disk that fills meanwhile answers 507 rather than hold the child to the end
            piece = left if svc.prefetcher is None else min(left, 1.0 if _storage_error(svc) else 5.0)
            await svc.hub.wait_change(model, piece)
            _check_can_hold(svc, model)
    head = svc.store.head(model)
    if head is None:
        raise NotFoundError(f"model {model!r} has no versions here")
    info = svc.store.info(model, head)
    data = await served_manifest(svc, model, head)
    return _manifest_response(data, version=head, etag=info.etag, cache="no-cache")


async def put_version(request: web.Request) -> web.Response:
    svc = _svc(request)
    try:
        _check_token(svc, request)
        model = _model(request)
        version = _version(request.match_info["version"])
        limit = svc.config.max_manifest_size
        if request.content_length is not None and request.content_length > limit:
            raise TooLargeError(f"manifest of {request.content_length} bytes exceeds the {limit}-byte limit")
        parts: list[bytes] = []
        got = 0
        try:
            async for piece in _pieces(request.content, UploadPace(svc.config.limits)):
                got += len(piece)
                if got > limit:
                    raise TooLargeError(f"manifest exceeds the {limit}-byte limit")
                parts.append(piece)
        except (aiohttp.ClientPayloadError, ConnectionError) as e:
            raise FormatError(f"manifest upload was cut short: {e}") from None
        body = b"".join(parts)
        assert svc.intake is not None
        info, created = await svc.intake.commit(model, version, body)
        svc.catalog.checked.add((model, version, info.etag))  # parsed and verified by the commit
        timeline.info("mono=%.6f committed %s v%d", time.monotonic(), model, version)
    except DeltaSyncError:
        svc.metrics.inc("upload_rejections")
        raise
    return web.json_response({"model": model, "version": version, "created": created, "etag": info.etag},
                             status=201 if created else 200,
                             headers={"Location": f"/v1/models/{model}/versions/{version}"})


async def get_delta(request: web.Request) -> web.Response:
    svc = _svc(request)
    model = _model(request)
    start = _query_int(request, "from")
    if start is None:
        raise FormatError("from= is required")
    end = _query_int(request, "to")
    if end is None:
        end = svc.store.head(model)
        if end is None:
            raise NotFoundError(f"model {model!r} has no versions here")
    data = await svc.catchup.delta(model, start, end)
    return web.Response(body=data, content_type=JSON, headers={
        "Cache-Control": "no-cache", "X-Deltasync-Version": str(end), "X-Deltasync-Squashed": f"{start}-{end}"})


# -- events ---------------------------------------------------------------------------------------

async def all_events(request: web.Request) -> web.StreamResponse:
    return await _stream_events(request, None, None)


async def model_events(request: web.Request) -> web.StreamResponse:
    model = _model(request)
    after = _query_int(request, "after")
    last_id = request.headers.get("Last-Event-ID")
    if after is None and last_id:
        after = _version(last_id.strip(), "Last-Event-ID")
    return await _stream_events(request, model, after)


async def _stream_events(request: web.Request, model: str | None, after: int | None) -> web.StreamResponse:
    svc = _svc(request)
    if svc.hub.closed:
        raise UnavailableError("shutting down")
    t = svc.config.timeouts
    sub = svc.hub.subscribe(model)  # before the snapshot, so nothing committed in between is missed
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    svc.streams.events += 1
    try:
        await resp.prepare(request)
        sent: dict[str, int] = {}
        out = [b"retry: 2000\n\n"]
        names = [model] if model is not None else sorted(svc.store.models)
        for name in names:
            idx = svc.store.index(name)
            if idx is None or idx.head is None:
                continue
            if model is not None and after is not None:
                for info in idx.after(after, limit=REPLAY_LIMIT):
                    out.append(format_event("version", await _payload(svc, info), id=str(info.version)))
            else:
                info = idx.infos[idx.head]
                out.append(format_event("head", await _payload(svc, info), id=str(info.version) if model else None))
            sent[name] = idx.head
        await _write(resp, b"".join(out), t.write)
        while True:
            try:
                async with timeout_after(t.heartbeat):
                    ann = await sub.queue.get()
            except asyncio.TimeoutError:
                await _write(resp, b": keepalive\n\n", t.write)
                continue
            if ann is None:
                break
            if isinstance(ann, Hint):
                await _write(resp, format_event("blob", ann.payload), t.write)
                continue
            info = ann.info
            if info.version <= sent.get(info.model, -1):
                continue
            sent[info.model] = info.version
            await _write(resp, format_event("version", ann.payload, id=str(info.version) if model else None),
                         t.write)
    except (ConnectionError, asyncio.TimeoutError):
        pass  # the client left or stopped reading
    finally:
        svc.hub.unsubscribe(sub)
        svc.streams.events -= 1
    return resp


async def _payload(svc: Services, info) -> bytes:
    small = info.manifest_size <= INLINE_MANIFEST_MAX
    return event_payload(info, await served_manifest(svc, info.model, info.version) if small else None)


async def _write(resp: web.StreamResponse, data: bytes, timeout: float) -> None:
    async with timeout_after(timeout):
        await resp.write(data)
