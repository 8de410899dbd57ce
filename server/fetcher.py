"""Fetching missing blobs from parents: one fetch per blob however many readers (coalescing).

``BlobFetcher.get(id)`` returns the blob's ``InflightBlob``, starting its fetch if
none is running. The fetch writes into a temp file that readers follow (cut-through,
see inflight.py), resumes with ``Range`` on the next parent when one dies mid-blob,
checks the hash when the last byte is in, and only then lets readers finish and
moves the file into the store. Plain-HTTP parents are read with ``BlobGetter`` (blobget.py:
the body received into one reused buffer, hashed and written from there); others
through the upstream's aiohttp session. A blob whose bytes fail the hash is discarded and
fetched again (starting with another parent); after ``attempts`` bad copies or
rounds of dead parents the fetch gives up and readers get the error. The rounds go
through the one retry helper (``deltasync.retry.retry``, its back-off table), each
round through the one per-parent loop (``Upstream.each_parent``).

A blob no parent has is remembered for ``NEGATIVE_TTL`` seconds (the newest
``NEGATIVE_MAX`` ids): asking for it again in that time is answered 404 at once, not
forwarded upstream. A fetch our own disk cannot hold (StorageError, a full disk)
fails its readers with 507 and does not mark the parent down; ``storage_error`` says
so until a blob is stored again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict

import aiohttp

from deltasync.blob import check_blob_id
from deltasync.errors import (
    DeltaSyncError,
    IntegrityError,
    NotFoundError,
    StorageError,
    UnavailableError,
    UpstreamError,
    UpstreamTimeout,
)
from deltasync.retry import RETRY_BACKOFF, describe, retry

from .blobget import BlobGetter
from .config import Timeouts
from .inflight import InflightBlob
from .metrics import Metrics
from .store import DiskStore
from .upstream import USER_AGENT, Upstream

log = logging.getLogger("deltasync.server.fetcher")

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
ATTEMPTS = 3
NEGATIVE_TTL = 2.0  # seconds a blob no parent had is answered 404 without asking again
NEGATIVE_MAX = 4096


class BlobFetcher:
    def __init__(self, *, store: DiskStore, upstream: Upstream, metrics: Metrics, timeouts: Timeouts,
                 attempts: int = ATTEMPTS) -> None:
        self.store = store
        self.upstream = upstream
        self.metrics = metrics
        self.timeouts = timeouts
        self.attempts = attempts
        self._inflight: dict[str, InflightBlob] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._missing: OrderedDict[str, float] = OrderedDict()  # blob id -> when the negative entry expires
        #: why the last fetch could not be stored (our disk full), until a blob is stored again; /healthz shows it
        self.storage_error: str | None = None
        t = timeouts
        ttfb = t.ttfb if len(upstream.parents) > 1 else max(t.ttfb, t.read)  # as Upstream.request: one parent, no hurry
        self._getter = BlobGetter(connect_timeout=t.connect, read_timeout=t.read, user_agent=USER_AGENT,
                                  head_timeout=ttfb, read_token=upstream.read_token)

    def inflight(self, blob_id: str) -> InflightBlob | None:
        return self._inflight.get(blob_id)

    @property
    def count(self) -> int:
        return len(self._inflight)

    def known_missing(self, blob_id: str) -> bool:
        """No parent had this blob less than ``NEGATIVE_TTL`` seconds ago."""
        until = self._missing.get(blob_id)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self._missing[blob_id]
        return False

    def remember_missing(self, blob_id: str) -> None:
        self._missing[blob_id] = time.monotonic() + NEGATIVE_TTL
        self._missing.move_to_end(blob_id)
        while len(self._missing) > NEGATIVE_MAX:
            self._missing.popitem(last=False)

    def get(self, blob_id: str) -> tuple[InflightBlob, bool]:
        """The blob's fetch, started if needed; the flag says whether this call started it. NotFoundError at
        once for a blob no parent had moments ago (the negative cache)."""
        blob = self._inflight.get(blob_id)
        if blob is not None:
            return blob, False
        if self.known_missing(blob_id):
            self.metrics.inc("negative_hits")
            raise NotFoundError(f"blob {blob_id} is not on this relay nor on any of its parents (asked "
                                f"{NEGATIVE_TTL:g} s ago at most)")
        if self._closed:
            raise UnavailableError("the relay is shutting down")
        blob = InflightBlob(check_blob_id(blob_id))
        self._inflight[blob_id] = blob
        self.metrics.inc("upstream_fetches")
        task = asyncio.get_running_loop().create_task(self._run(blob), name=f"fetch-{blob_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return blob, True

    async def ensure(self, blob_id: str, *, timeout: float) -> None:
        """Return once the blob is complete in the store (fetching it if needed)."""
        while not self.store.has_blob(blob_id):
            blob, _ = self.get(blob_id)
            blob.attach()
            try:
                await blob.wait_done(timeout)
            finally:
                blob.detach()
            await asyncio.sleep(0)  # let the fetch move the file into the store

    async def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._getter.close()

    # -- the fetch -----------------------------------------------------------------------
    async def _run(self, blob: InflightBlob) -> None:
        started = time.monotonic()
        fetch = _Fetch(blob)
        try:
            blob.part = await self.store.open_partial(blob.id)

            def again(e: BaseException) -> bool:
                return isinstance(e, (UpstreamError, IntegrityError))

            def on_retry(n: int, e: BaseException, delay: float) -> None:
                log.warning("blob %s: %s; retrying in %.1f s", blob.id, describe(e), delay)

            parent = await retry(lambda: self._round(fetch), backoff=RETRY_BACKOFF, attempts=self.attempts,
                                 again=again, on_retry=on_retry)
            blob.verified = True
            blob.progress()
            await blob.part.commit()
            self.storage_error = None
            log.info("blob %s: %d bytes from %s in %.2f s", blob.id, blob.part.written, parent,
                     time.monotonic() - started)
        except asyncio.CancelledError:
            blob.fail(UnavailableError(f"fetch of blob {blob.id} cancelled (shutting down)"))
            raise
        except DeltaSyncError as e:
            blob.fail(e)
            if isinstance(e, StorageError):  # our own disk, not the parent's fault (it is not marked down)
                self.storage_error = str(e)
                self.metrics.inc("storage_errors")
            if isinstance(e, NotFoundError):
                self.remember_missing(blob.id)
            else:
                log.error("blob %s: giving up: %s", blob.id, e)
        except asyncio.TimeoutError:
            blob.fail(UpstreamTimeout(f"every parent timed out sending blob {blob.id}"))
            log.error("blob %s: giving up: every parent timed out", blob.id)
        except (aiohttp.ClientError, OSError) as e:
            blob.fail(UpstreamError(f"could not fetch blob {blob.id}: {describe(e)}"))
            log.error("blob %s: giving up: %s", blob.id, describe(e))
        finally:
            self.store.release(fetch.reserved)
            if self._inflight.get(blob.id) is blob:
                del self._inflight[blob.id]
            blob.finish()

    async def _round(self, fetch: _Fetch) -> str:
        """One round: every byte from the parents (resuming on the next), then the hash check.
        Returns the parent that sent the last byte; a copy that fails its hash is discarded."""
        blob = fetch.blob
        parent = await self.upstream.each_parent(lambda p: self._download(fetch, p), what=f"blob {blob.id}",
                                                 rotate=fetch.rotate, on_failure=self._failed_over)
        try:
            blob.part.verify()
        except IntegrityError as e:
            self.metrics.inc("hash_failures")
            log.error("blob %s from %s failed its hash check (%s); discarded, refetching", blob.id, parent, e)
            self.upstream.mark_failed(parent, "sent bytes that fail their hash")
            blob.reset()
            fetch.rotate += 1
            raise
        return parent

    def _failed_over(self, parent: str, e: BaseException) -> None:
        self.metrics.inc("upstream_failovers")

    async def _download(self, fetch: _Fetch, parent: str) -> str:
        """Fill the blob's temp file from ``parent``, from the byte it has (Range resume)."""
        blob = fetch.blob
        offset = blob.part.written
        if blob.size is not None and offset >= blob.size:
            return parent
        self.metrics.inc("upstream_requests")
        if offset:
            self.metrics.inc("upstream_resumes")
        if self._getter.supports(parent):
            return await self._download_direct(fetch, parent, offset)
        async with self.upstream.blob_request(parent, blob.id, offset) as resp:
            sink = self._sink(fetch, parent, resp, offset)
            content = resp.content
            while True:
                # readchunk hands over each buffered piece as received; readany would join
                # everything buffered into one new (large, page-faulting) bytes object.
                chunk, boundary = await content.readchunk()
                if not chunk:
                    if boundary:
                        continue  # a chunked-encoding boundary
                    break
                sink(chunk)
            self._check_complete(blob, parent)
        return parent

    async def _download_direct(self, fetch: _Fetch, parent: str, offset: int) -> str:
        """The same through ``BlobGetter``: body pieces go from its receive buffer to the file (no copies)."""
        blob = fetch.blob
        sink = None

        def on_head(resp) -> bool:
            nonlocal sink
            sink = self._sink(fetch, parent, resp, offset)
            return True

        await self._getter.get(parent, blob.id, offset, on_head=on_head, on_body=lambda piece: sink(piece))
        self._check_complete(blob, parent)
        return parent

    def _sink(self, fetch: _Fetch, parent: str, resp, offset: int):
        """Check an answer's head (status, size, range); returns the function that takes its body pieces."""
        blob = fetch.blob
        if resp.status == 404:
            raise NotFoundError(f"{parent} has no blob {blob.id}")
        start, total = _body_range(resp, offset)
        if blob.size is None:
            self.store.reserve(total)
            fetch.reserved = total
            if hasattr(blob.part, "preallocate"):  # our disk must hold it before any reader hears a size
                blob.part.preallocate(total)  # posix_fallocate: quick, and the size is not announced before it
            blob.set_size(total)
        elif total != blob.size:
            raise UpstreamError(f"{parent} says blob {blob.id} has {total} bytes, another parent said "
                                f"{blob.size}")
        skip = offset - start  # a parent that ignored our Range sends from 0
        part, metrics = blob.part, self.metrics

        def take(chunk) -> None:
            nonlocal skip
            if skip:
                if len(chunk) <= skip:
                    skip -= len(chunk)
                    return
                chunk = chunk[skip:]
                skip = 0
            if part.written + len(chunk) > total:
                raise UpstreamError(f"{parent} sent more than the {total} bytes of blob {blob.id}")
            part.write(chunk)
            metrics.inc("bytes_in", len(chunk))
            blob.progress()
        return take

    @staticmethod
    def _check_complete(blob: InflightBlob, parent: str) -> None:
        if blob.part.written < blob.size:
            raise UpstreamError(f"{parent} ended blob {blob.id} at byte {blob.part.written} of {blob.size}")


class _Fetch:
    """What one blob's fetch carries from round to round."""

    __slots__ = ("blob", "reserved", "rotate")

    def __init__(self, blob: InflightBlob) -> None:
        self.blob = blob
        self.reserved = 0  # bytes reserved in the store (released when the fetch ends)
        self.rotate = 0  # start further down the parents after a copy failed its hash


def _body_range(resp: aiohttp.ClientResponse, offset: int) -> tuple[int, int]:
    """(first byte offset of the body, total blob size) from a 200 or 206 answer."""
    if resp.status == 206:
        m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
        if not m:
            raise UpstreamError(f"206 without a usable Content-Range: {resp.headers.get('Content-Range')!r}")
        start, last, total = (int(x) for x in m.groups())
        if start != offset or last != total - 1:
            raise UpstreamError(f"asked for bytes {offset}-, got {start}-{last}/{total}")
        return start, total
    if resp.status == 200:
        if resp.content_length is None:
            raise UpstreamError("blob answer without Content-Length")
        return 0, resp.content_length
    raise UpstreamError(f"answered {resp.status}")
