"""Fetching missing blobs from parents: one fetch per blob however many readers (coalescing).

``BlobFetcher.get(id)`` returns the blob's ``InflightBlob``, starting its fetch if
none is running. The fetch writes into a temp file that readers follow (cut-through,
see inflight.py), resumes with ``Range`` on the next parent when one dies mid-blob,
checks the hash when the last byte is in, and only then lets readers finish and
moves the file into the store. A blob whose bytes fail the hash is discarded and
fetched again (starting with another parent); after ``attempts`` bad copies or
rounds of dead parents the fetch gives up and readers get the error.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import aiohttp

from deltasync.blob import check_blob_id
from deltasync.errors import DeltaSyncError, IntegrityError, NotFoundError

from .config import Timeouts
from .errors import UpstreamError, UpstreamTimeout, UnavailableError
from .inflight import InflightBlob
from .metrics import Metrics
from .store import DiskStore
from .upstream import Upstream, _describe

log = logging.getLogger("deltasync.server.fetcher")

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
ATTEMPTS = 3
BACKOFF = (0.2, 1.0, 3.0)


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

    def inflight(self, blob_id: str) -> InflightBlob | None:
        return self._inflight.get(blob_id)

    @property
    def count(self) -> int:
        return len(self._inflight)

    def get(self, blob_id: str) -> tuple[InflightBlob, bool]:
        """The blob's fetch, started if needed; the flag says whether this call started it."""
        blob = self._inflight.get(blob_id)
        if blob is not None:
            return blob, False
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

    # -- the fetch -----------------------------------------------------------------------
    async def _run(self, blob: InflightBlob) -> None:
        started = time.monotonic()
        reserved = 0
        try:
            blob.part = await self.store.open_partial(blob.id)
            rotate = 0
            for attempt in range(self.attempts):
                try:
                    parent, reserved = await self._download(blob, rotate, reserved)
                except (UpstreamError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    if attempt + 1 == self.attempts:
                        raise
                    log.warning("blob %s: every parent failed (%s); retrying in %.1f s", blob.id, _describe(e),
                                BACKOFF[attempt])
                    await asyncio.sleep(BACKOFF[attempt])
                    continue
                try:
                    blob.part.verify()
                except IntegrityError as e:
                    self.metrics.inc("hash_failures")
                    log.error("blob %s from %s failed its hash check (%s); discarded, refetching", blob.id,
                              parent, e)
                    self.upstream.mark_failed(parent, "sent bytes that fail their hash")
                    blob.reset()
                    rotate += 1
                    if attempt + 1 == self.attempts:
                        raise
                    continue
                blob.verified = True
                blob.progress()
                await blob.part.commit()
                log.info("blob %s: %d bytes from %s in %.2f s", blob.id, blob.part.written, parent,
                         time.monotonic() - started)
                return
        except asyncio.CancelledError:
            blob.fail(UnavailableError(f"fetch of blob {blob.id} cancelled (shutting down)"))
            raise
        except DeltaSyncError as e:
            blob.fail(e)
            if not isinstance(e, NotFoundError):
                log.error("blob %s: giving up: %s", blob.id, e)
        except asyncio.TimeoutError:
            blob.fail(UpstreamTimeout(f"every parent timed out sending blob {blob.id}"))
            log.error("blob %s: giving up: every parent timed out", blob.id)
        except (aiohttp.ClientError, OSError) as e:
            blob.fail(UpstreamError(f"could not fetch blob {blob.id}: {_describe(e)}"))
            log.error("blob %s: giving up: %s", blob.id, _describe(e))
        finally:
            self.store.release(reserved)
            if self._inflight.get(blob.id) is blob:
                del self._inflight[blob.id]
            blob.finish()

    async def _download(self, blob: InflightBlob, rotate: int, reserved: int) -> tuple[str, int]:
        """Fill the blob's temp file from the first parent that works, resuming on the next after a failure.

        Returns the parent that delivered the last byte and the bytes reserved in the store.
        """
        not_found = 0
        tried = self.upstream.candidates(rotate=rotate)
        last: BaseException | None = None
        for parent in tried:
            offset = blob.part.written
            if blob.size is not None and offset >= blob.size:
                return parent, reserved
            self.metrics.inc("upstream_requests")
            if offset:
                self.metrics.inc("upstream_resumes")
            try:
                async with self.upstream.blob_request(parent, blob.id, offset) as resp:
                    if resp.status == 404:
                        not_found += 1
                        continue
                    start, total = _body_range(resp, offset)
                    if blob.size is None:
                        self.store.reserve(total)
                        reserved = total
                        blob.set_size(total)
                    elif total != blob.size:
                        raise UpstreamError(f"{parent} says blob {blob.id} has {total} bytes, another parent said "
                                            f"{blob.size}")
                    skip = offset - start  # a parent that ignored our Range sends from 0
                    content = resp.content
                    while True:
                        # readchunk hands over each buffered piece as received; readany would join
                        # everything buffered into one new (large, page-faulting) bytes object.
                        chunk, boundary = await content.readchunk()
                        if not chunk:
                            if boundary:
                                continue  # a chunked-encoding boundary
                            break
                        if skip:
                            if len(chunk) <= skip:
                                skip -= len(chunk)
                                continue
                            chunk = chunk[skip:]
                            skip = 0
                        if blob.part.written + len(chunk) > total:
                            raise UpstreamError(f"{parent} sent more than the {total} bytes of blob {blob.id}")
                        blob.part.write(chunk)
                        self.metrics.inc("bytes_in", len(chunk))
                        blob.progress()
                    if blob.part.written < total:
                        raise UpstreamError(f"{parent} ended blob {blob.id} at byte {blob.part.written} of {total}")
                self.upstream.mark_ok(parent)
                return parent, reserved
            except (UpstreamError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = e
                self.metrics.inc("upstream_failovers")
                self.upstream.mark_failed(parent, _describe(e))
        if not_found == len(tried):
            raise NotFoundError(f"blob {blob.id} is not on this relay nor on any of its parents")
        if isinstance(last, asyncio.TimeoutError):
            raise UpstreamTimeout(f"every parent timed out sending blob {blob.id}")
        raise UpstreamError(f"no parent could send blob {blob.id}: {_describe(last)}")


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
