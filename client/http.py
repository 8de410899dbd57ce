"""The HTTP side of the client: one aiohttp session, timeouts on every wait, failover, Range resume.

:class:`HttpClient` speaks the wire protocol (docs/PROTOCOL.md) to a list of base
URLs in order of preference (for a subscriber: its nearest relay first, then
fallbacks, the origin last; for a publisher: the origin). Reads fail over: a URL
that refuses the connection, times out, answers 5xx, or serves a blob whose bytes do
not hash to its id is put in a cooldown and the next URL is tried. A blob body cut
off mid-transfer is resumed with ``Range`` from the same URL before moving on.
Writes (``put_*``) go to the first URL only, with the bearer token, and are retried
a few times on transport errors (blob and manifest PUTs are idempotent).

Every wait is bounded: ``Timeouts.connect`` for TCP connect, ``Timeouts.read`` for
silence on a connection, ``Timeouts.request`` for a whole request; a long-poll asks
the server for at most ``Timeouts.poll`` seconds and waits that plus ``read``.

Not thread-safe: use one client per event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp

from deltasync.blob import blob_id, check_blob_id
from deltasync.errors import ChainError, DeltaSyncError, FormatError, IntegrityError, NotFoundError, SignatureError

from .errors import AuthError, TransportError

log = logging.getLogger("deltasync.client.http")

MAX_MANIFEST = 256 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Every wait the client makes, in seconds; none is unbounded."""

    connect: float = 5.0  # TCP connect
    read: float = 30.0  # silence on an open connection (headers or body)
    request: float = 300.0  # one whole request, body included
    poll: float = 20.0  # long-poll duration asked of the server (?wait=)
    cooldown: float = 5.0  # a URL that failed is skipped this long while others are tried


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadInfo:
    """What ``GET /v1/models/{m}/head`` says. The server answers with the head version's manifest
    itself (``body``; parse and verify it with ``deltasync.manifest.parse_manifest``); after a
    long-poll that timed out (204) only ``version`` is known and ``body`` is None."""

    model: str
    version: int
    kind: str | None = None
    bytes: int | None = None
    body: bytes | None = None
    url: str = ""

    @staticmethod
    def from_body(body: bytes, *, model: str, url: str = "") -> HeadInfo:
        try:
            obj = json.loads(body)
        except ValueError:
            raise TransportError(f"{url}: head answer is not JSON: {body[:200]!r}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("version"), int):
            raise TransportError(f"{url}: head answer {body[:200]!r} has no integer 'version'")
        blobs = obj.get("blobs")
        size = sum(b.get("size", 0) for b in blobs if isinstance(b, dict)) if isinstance(blobs, list) else None
        kind = obj.get("kind") if isinstance(obj.get("kind"), str) else None
        return HeadInfo(model=model, version=obj["version"], kind=kind, bytes=size, body=body, url=url)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferStats:
    """Bytes this client moved; counters only grow."""

    bytes_in: int = 0
    bytes_out: int = 0
    requests: int = 0
    failovers: int = 0
    corrupt_blobs: int = 0
    resumes: int = 0


_CODES: dict[str, type[DeltaSyncError]] = {
    "format": FormatError, "unsupported": FormatError, "chain": ChainError, "integrity": IntegrityError,
    "base_mismatch": IntegrityError, "signature": SignatureError, "not_found": NotFoundError,
    "unauthorized": AuthError,
}


def _status_error(status: int, url: str, body: str) -> DeltaSyncError:
    """The error a server's answer stands for: by its JSON error code, else by its status."""
    code, message = None, body.strip()[:300]
    try:
        obj = json.loads(body)
        code, message = obj["error"]["code"], obj["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    if status == 404:
        return NotFoundError(f"{url}: not found ({message or 'no body'})")
    if status == 401 or code == "unauthorized":
        return AuthError(f"{url}: refused with {status} ({message}); check the token file")
    cls = _CODES.get(code) if isinstance(code, str) and status < 500 else None
    if cls is not None:
        return cls(f"{url}: {message}")
    err = TransportError(f"{url}: HTTP {status} ({message})")
    err.status = status
    return err


class HttpClient:
    """Async HTTP client for one or more deltasync servers (origin or relays), most preferred first."""

    def __init__(self, urls: str | Sequence[str], *, token: str | None = None, timeouts: Timeouts | None = None,
                 write_retries: int = 3) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.token = token
        self.timeouts = timeouts or Timeouts()
        self.write_retries = write_retries
        self._session: aiohttp.ClientSession | None = None
        self._down_until: dict[str, float] = {}
        self._bytes_in = self._bytes_out = self._requests = self._failovers = self._corrupt = self._resumes = 0
        self.last_url: str | None = None  # the URL that answered the last read

    # -- lifecycle ---------------------------------------------------------------------
    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            t = self.timeouts
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=t.request, connect=t.connect, sock_connect=t.connect, sock_read=t.read),
                connector=aiohttp.TCPConnector(limit=64, enable_cleanup_closed=True),
                auto_decompress=False,
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
    def _order(self) -> list[str]:
        now = time.monotonic()
        up = [u for u in self.urls if self._down_until.get(u, 0) <= now]
        down = sorted((u for u in self.urls if u not in up), key=lambda u: self._down_until[u])
        return up + down  # cooling URLs are still tried, last, rather than giving up

    def _mark_down(self, url: str, why: str) -> None:
        self._down_until[url] = time.monotonic() + self.timeouts.cooldown
        self._failovers += 1
        log.warning("%s: %s; trying the next server for %.0fs", url, why, self.timeouts.cooldown)

    async def _read(self, path: str, *, accept_404_from_all: bool = True, timeout: aiohttp.ClientTimeout | None = None,
                    check=None) -> tuple[bytes, str, int, dict]:
        """GET ``path`` from the first URL that answers 200; returns (body, url, status, headers).

        ``check(body)`` may raise IntegrityError to reject a body (the URL is put in cooldown)."""
        errors: list[str] = []
        not_found = 0
        for url in self._order():
            full = url + path
            try:
                self._requests += 1
                # (aiohttp reads timeout=None as "no timeout at all": pass it only when set)
                async with self._sess().get(full, **({} if timeout is None else {"timeout": timeout})) as r:
                    if r.status == 200:
                        body = await r.read()
                        self._bytes_in += len(body)
                        if check is not None:
                            check(body)
                        self.last_url = url
                        return body, url, 200, dict(r.headers)
                    if r.status in (204, 304):
                        self.last_url = url
                        return b"", url, r.status, dict(r.headers)
                    text = (await r.read())[:500].decode(errors="replace")
                    err = _status_error(r.status, full, text)
                    if isinstance(err, NotFoundError):
                        not_found += 1
                        errors.append(str(err))
                        continue  # a relay behind its parent may not have it yet: ask the next one
                    if r.status < 500 and not isinstance(err, AuthError) and r.status != 429:
                        raise err  # a 4xx other than 404 is an answer, not an outage
                    self._mark_down(url, f"HTTP {r.status}")
                    errors.append(str(err))
            except IntegrityError as e:
                self._corrupt += 1
                self._mark_down(url, f"served corrupt data ({e})")
                errors.append(f"{full}: {e}")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._mark_down(url, f"{type(e).__name__}: {e}")
                errors.append(f"{full}: {type(e).__name__}: {e}")
        if not_found and accept_404_from_all:  # every server that answered said 404; the rest were down
            raise NotFoundError(f"{path}: not found on the servers that answered: " + "; ".join(errors))
        raise TransportError(f"GET {path} failed on every server: " + "; ".join(errors))

    # -- reads ---------------------------------------------------------------------------
    async def get_head(self, model: str, *, after: int | None = None, wait: float | None = None) -> HeadInfo | None:
        """The newest version, or None when the model has none yet. With ``after``/``wait``, the server
        holds the request until a version newer than ``after`` commits or ``wait`` seconds pass (then the
        current head, possibly still ``after``, is returned)."""
        path = f"/v1/models/{quote(model)}/head"
        timeout = None
        if after is not None:
            wait = self.timeouts.poll if wait is None else wait
            path += f"?after={after}&wait={wait:g}"
            t = self.timeouts
            timeout = aiohttp.ClientTimeout(total=wait + t.read + t.connect, connect=t.connect,
                                            sock_connect=t.connect, sock_read=wait + t.read)
        try:
            body, url, status, headers = await self._read(path, timeout=timeout)
        except NotFoundError:
            return None
        if status != 200:  # long-poll ran out: nothing newer than ``after``
            shown = headers.get("X-Deltasync-Head")
            if shown is None or not shown.isdigit():
                return None
            return HeadInfo(model=model, version=int(shown), url=url)
        return HeadInfo.from_body(body, model=model, url=url)

    async def get_manifest(self, model: str, version: int) -> bytes:
        """A version's manifest JSON (parse and verify it with deltasync.manifest.parse_manifest)."""
        body, _, _, _ = await self._read(f"/v1/models/{quote(model)}/versions/{version}")
        return body

    async def get_squashed(self, model: str, start: int, end: int, *, timeout: float | None = None) -> bytes:
        """The server's squashed catch-up delta ``start → end``: a manifest whose blobs are fetched as usual.
        A server builds it on demand, so ``timeout`` bounds the wait (the chain is the fallback)."""
        t = self.timeouts
        ct = None
        if timeout is not None:
            ct = aiohttp.ClientTimeout(total=timeout, connect=t.connect, sock_connect=t.connect, sock_read=timeout)
        body, _, _, _ = await self._read(f"/v1/models/{quote(model)}/delta?from={start}&to={end}", timeout=ct)
        return body

    async def get_blob(self, bid: str, size: int | None = None) -> bytes:
        """A blob, its hash checked; fails over on bad bytes and resumes cut transfers with Range."""
        check_blob_id(bid)
        errors: list[str] = []
        not_found = 0
        for url in self._order():
            try:
                data = await self._get_blob_from(url, bid, size)
            except NotFoundError as e:
                not_found += 1
                errors.append(str(e))
                continue
            except IntegrityError as e:
                self._corrupt += 1
                self._mark_down(url, f"served a corrupt blob ({e})")
                errors.append(f"{url}: {e}")
                continue
            except (TransportError, AuthError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._mark_down(url, f"{type(e).__name__}: {e}")
                errors.append(f"{url}: {type(e).__name__}: {e}")
                continue
            self.last_url = url
            return data
        if not_found and not any("hashes to" in e or "manifest says" in e for e in errors):
            raise NotFoundError(f"blob {bid}: not found on the servers that answered: " + "; ".join(errors))
        raise TransportError(f"blob {bid}: every server failed: " + "; ".join(errors))

    async def _get_blob_from(self, url: str, bid: str, size: int | None, attempts: int = 3) -> bytes:
        full = f"{url}/v1/blobs/{bid}"
        buf = bytearray()
        for attempt in range(attempts):
            headers = {"Range": f"bytes={len(buf)}-"} if buf else {}
            try:
                self._requests += 1
                async with self._sess().get(full, headers=headers) as r:
                    if r.status not in (200, 206):
                        text = (await r.read())[:300].decode(errors="replace")
                        raise _status_error(r.status, full, text)
                    if buf and r.status == 200:
                        buf.clear()  # the server ignored Range: start over
                    async for piece in r.content.iter_chunked(1 << 20):
                        buf += piece
                        self._bytes_in += len(piece)
                        if size is not None and len(buf) > size:
                            raise IntegrityError(f"blob {bid} is longer than the {size} bytes the manifest says")
                break
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, asyncio.TimeoutError,
                    aiohttp.ClientOSError) as e:
                if attempt == attempts - 1 or not buf:
                    raise
                self._resumes += 1
                log.info("%s: transfer cut at %d bytes (%s); resuming with Range", full, len(buf), type(e).__name__)
        data = bytes(buf)
        if size is not None and len(data) != size:
            raise IntegrityError(f"blob {bid}: {len(data)} bytes, the manifest says {size}")
        found = blob_id(data)
        if found != bid:
            raise IntegrityError(f"blob {bid}: content hashes to {found}")
        return data

    async def events(self, model: str, *, after: int | None = None) -> AsyncIterator[dict]:
        """Server-sent events of one server (the first that answers); yields each event's JSON data.
        Ends (returns) when the stream closes or goes silent longer than ``Timeouts.read``."""
        path = f"/v1/models/{quote(model)}/events" + (f"?after={after}" if after is not None else "")
        t = self.timeouts
        timeout = aiohttp.ClientTimeout(total=None, connect=t.connect, sock_connect=t.connect, sock_read=t.read)
        for url in self._order():
            try:
                async with self._sess().get(url + path, timeout=timeout, headers={"Accept": "text/event-stream"}) as r:
                    if r.status != 200:
                        self._mark_down(url, f"events: HTTP {r.status}")
                        continue
                    data: list[str] = []
                    async for raw in r.content:
                        line = raw.decode(errors="replace").rstrip("\r\n")
                        if line.startswith("data:"):
                            data.append(line[5:].lstrip())
                        elif not line and data:
                            try:
                                yield json.loads("\n".join(data))
                            except ValueError:
                                log.warning("%s: event that is not JSON: %r", url, data[:1])
                            data = []
                    return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._mark_down(url, f"events: {type(e).__name__}: {e}")
        raise TransportError(f"GET {path}: no server answered")

    # -- writes (origin only) -----------------------------------------------------------------
    async def _write(self, method: str, path: str, data: bytes, *, content_type: str) -> int:
        url = self.urls[0]
        headers = {"Content-Type": content_type}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last: Exception | None = None
        for attempt in range(self.write_retries):
            try:
                self._requests += 1
                async with self._sess().request(method, url + path, data=data, headers=headers) as r:
                    text = (await r.read())[:500].decode(errors="replace")
                    if r.status in (200, 201, 204):
                        self._bytes_out += len(data)
                        return r.status
                    err = _status_error(r.status, url + path, text)
                    if r.status < 500 and r.status != 429:
                        raise err
                    last = err
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = TransportError(f"{method} {url}{path}: {type(e).__name__}: {e}")
            await asyncio.sleep(min(0.2 * 2 ** attempt, 2.0))
        assert last is not None
        raise last

    async def put_blob(self, bid: str, data: bytes) -> None:
        await self._write("PUT", f"/v1/blobs/{check_blob_id(bid)}", data, content_type="application/octet-stream")

    async def put_manifest(self, model: str, version: int, data: bytes) -> None:
        await self._write("PUT", f"/v1/models/{quote(model)}/versions/{version}", data, content_type="application/json")

    async def has_blob(self, bid: str) -> bool:
        """HEAD on the first URL: does it hold the blob?"""
        url = f"{self.urls[0]}/v1/blobs/{check_blob_id(bid)}"
        try:
            async with self._sess().head(url) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise TransportError(f"HEAD {url}: {type(e).__name__}: {e}") from None
