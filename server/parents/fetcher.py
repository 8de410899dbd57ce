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

Every bad answer is that parent's fault, and a bad copy never reaches a child as a
good one. The size of a blob is the one its manifest gives when the relay holds one
(``expect``: the prefetcher registers every manifest's blobs before fetching them),
so a parent announcing another ``Content-Length`` is put down before a byte is taken.
Without a manifest the first parent's size is provisional: a body longer than
announced, a body whose bytes already hash to the id before the announced end (a
parent that announced too much and went quiet), or a second parent announcing
another size makes the fetch start over (``InflightBlob.restart``: children told
the old size are cut off) with the liar put down. On a relay holding a verify key,
the BLAKE3/SHA-256 digest of the signed manifest is checked with the xxh3 before
the last byte goes to any child or the blob into the cache; a relay without a key
relays on xxh3 alone. A blob fetched before any manifest in hand names it (a child asked for it by
id, or the parent hinted it: ``get(hinted=True)``) is hashed with the default digest as well, and the
result is kept (``UNCHECKED_MAX`` newest): when a signed manifest names the blob, ``check_stored``
compares, and a blob that is not the signed one is dropped and fetched again.

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
from deltasync.digest import DEFAULT_DIGEST, DigestHasher, blob_digest, parse_digest
from deltasync.errors import (
    DeltaSyncError,
    IntegrityError,
    NotFoundError,
    StorageError,
    UnavailableError,
    UpstreamError,
    UpstreamTimeout,
)
from deltasync.manifest import BlobRef
from deltasync.retry import RETRY_BACKOFF, describe, retry

from ..http.blobget import BlobGetter
from ..config import Timeouts
from ..http.inflight import InflightBlob
from ..metrics import Metrics
from ..storage.store import DiskStore
from .upstream import USER_AGENT, Upstream

#: a hinted fetch (an upload the parent says is arriving) must average at least this many bytes/s after the grace
HINTED_MIN_RATE = 1 << 20

log = logging.getLogger("deltasync.server.fetcher")
timeline = logging.getLogger("deltasync.timeline")  # time.monotonic() stamps: benchmarks/keyframe_timeline.py

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
ATTEMPTS = 3
NEGATIVE_TTL = 2.0  # seconds a blob no parent had is answered 404 without asking again
NEGATIVE_MAX = 4096
#: a received piece is written and hashed in slices of this size (they stay in the core's L2 cache)
SLICE = 256 << 10
EXPECTED_MAX = 1 << 16  # blob refs of manifests in hand kept for fetches (newest)
UNCHECKED_MAX = 4096  # digests kept of blobs fetched before a signed manifest named them (newest)


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
        self._expected: OrderedDict[str, BlobRef] = OrderedDict()  # blob id -> its ref in a manifest in hand
        #: blob id -> the digest of the copy stored, for blobs no signed manifest had named when they were fetched
        self._unchecked: OrderedDict[str, str] = OrderedDict()
        #: digests are checked only when manifests were verified (the relay holds a key)
        self.check_digests = upstream.verifier is not None
        #: why the last fetch could not be stored (our disk full), until a blob is stored again; /healthz shows it
        self.storage_error: str | None = None
        #: the hinted fetches running (blob id -> its fetch and task): unsigned, so a signed version's blob that
        #: finds no room cancels them (``_hold``)
        self._hinted: dict[str, tuple[_Fetch, asyncio.Task]] = {}
        t = timeouts
        ttfb = t.ttfb if len(upstream.parents) > 1 else max(t.ttfb, t.read)  # as Upstream.request: one parent, no hurry
        self._getter = BlobGetter(connect_timeout=t.connect, read_timeout=t.read, user_agent=USER_AGENT,
                                  head_timeout=ttfb, read_token=upstream.read_token, min_rate=t.min_rate,
                                  rate_grace=t.rate_grace)

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

    def expect(self, refs) -> None:
        """Blob refs (id, size, digest) of a manifest this relay holds (verified when it holds a key): a
        fetch of one of them takes its size from here, and checks its digest when ``check_digests``."""
        for ref in refs:
            self._expected[ref.id] = ref
            self._expected.move_to_end(ref.id)
        while len(self._expected) > EXPECTED_MAX:
            self._expected.popitem(last=False)

    async def check_stored(self, ref: BlobRef) -> bool:
        """Whether the stored copy of ``ref``'s blob is the one its (verified) manifest signs, when this relay
        fetched it before any manifest named it; one that is not is dropped (the caller fetches it again)."""
        found = self._unchecked.pop(ref.id, None)
        if found is None or not self.check_digests or ref.digest is None:
            return True
        alg = parse_digest(ref.digest)[0]
        if parse_digest(found)[0] != alg:  # signed with another algorithm than the one computed: reread
            try:
                found = await asyncio.to_thread(blob_digest, await self.store.get_blob(ref.id), alg)
            except (OSError, DeltaSyncError):
                return not self.store.has_blob(ref.id)  # gone meanwhile: the caller fetches it
        if found == ref.digest:
            return True
        self.metrics.inc("hash_failures")
        log.error("blob %s: the stored copy hashes to %s but a signed manifest says %s (crafted bytes that share "
                  "its id); dropped, refetching", ref.id, found, ref.digest)
        self.store.drop_blob(ref.id)
        return False

    def get(self, blob_id: str, *, hinted: bool = False) -> tuple[InflightBlob, bool]:
        """The blob's fetch, started if needed; the flag says whether this call started it. NotFoundError at
        once for a blob no parent had moments ago (the negative cache). ``hinted``: a fetch the parent's
        ``blob`` hint started (no reader waits on it): a parent that has no such blob is not remembered."""
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
        task = asyncio.get_running_loop().create_task(self._run(blob, hinted), name=f"fetch-{blob_id}")
        if hinted:
            task.add_done_callback(lambda _t, b=blob_id: self._hinted.pop(b, None))
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
    async def _run(self, blob: InflightBlob, hinted: bool = False) -> None:
        started = time.monotonic()
        timeline.info("mono=%.6f fetch-start %s", started, blob.id)
        fetch = _Fetch(blob, self._expected.get(blob.id), digests=self.check_digests)
        if hinted:
            # only a parent's word that an upload is arriving: it must keep a publisher's pace (a hint that slows
            # to a trickle is dropped, its room released; a version naming the blob fetches it again)
            fetch.min_rate = max(self.timeouts.min_rate, HINTED_MIN_RATE)
            self._hinted[blob.id] = (fetch, asyncio.current_task())
        try:
            blob.part = await self.store.open_partial(blob.id)
            if fetch.expected is not None:  # the manifest in hand gives the size: no parent's answer awaited
                self._hold(fetch, fetch.expected.size)

            def again(e: BaseException) -> bool:
                return isinstance(e, (UpstreamError, IntegrityError))

            def on_retry(n: int, e: BaseException, delay: float) -> None:
                log.warning("blob %s: %s; retrying in %.1f s", blob.id, describe(e), delay)

            parent = await retry(lambda: self._round(fetch), backoff=RETRY_BACKOFF,
                                 attempts=1 if hinted else self.attempts, again=again, on_retry=on_retry)
            blob.verified = True
            blob.progress()
            if fetch.digest is not None and not fetch.digest_checked:  # no signed manifest named it yet
                self._unchecked[blob.id] = fetch.digest.digest()  # before the commit makes it stored
                self._unchecked.move_to_end(blob.id)
                while len(self._unchecked) > UNCHECKED_MAX:
                    self._unchecked.popitem(last=False)
            await blob.part.commit()
            ref = self._expected.get(blob.id)
            if ref is not None and blob.id in self._unchecked:  # a manifest naming it came while it was stored
                await self.check_stored(ref)
            self.storage_error = None
            timeline.info("mono=%.6f fetch-stored %s", time.monotonic(), blob.id)
            log.info("blob %s: %d bytes from %s in %.2f s", blob.id, blob.part.written, parent,
                     time.monotonic() - started)
        except asyncio.CancelledError:
            blob.fail(UnavailableError(f"fetch of blob {blob.id} cancelled (shutting down)"))
            raise
        except DeltaSyncError as e:
            blob.fail(e)
            if hinted:  # only a parent's hint wanted it (a version naming it fetches it again)
                log.info("hinted blob %s: not fetched: %s", blob.id, e)
            elif isinstance(e, NotFoundError):
                self.remember_missing(blob.id)
            else:
                log.error("blob %s: giving up: %s", blob.id, e)
            if isinstance(e, StorageError) and not hinted:  # our own disk, not the parent's fault
                self.storage_error = str(e)
                self.metrics.inc("storage_errors")
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

    def _hold(self, fetch: _Fetch, size: int) -> None:
        """Make room for the blob, reserve and preallocate it, then tell readers its size (in that order: our disk
        must hold it before any reader hears a size). A blob of a manifest in hand is held when its fetch starts,
        so the version can be announced and a child's request joins the fetch before any parent answers (a
        parent's answer of another size is then refused in ``_sink``); any other blob on its first answer."""
        blob = fetch.blob
        if self._hinted and fetch.min_rate is None:
            self._make_room_from_hints(size)
        self.store.reserve(size)
        fetch.reserved = size
        if hasattr(blob.part, "preallocate"):
            blob.part.preallocate(size)  # posix_fallocate: quick
        blob.set_size(size)

    def _make_room_from_hints(self, size: int) -> None:
        """A blob a manifest or a reader wants needs ``size`` bytes: when the cache's budget cannot hold it beside
        what is stored and reserved, hinted fetches (unsigned: a parent's word) are cancelled, their room released
        at once, until it can. A signed version's blobs always find room before any hint."""
        budget = self.store.budget
        if budget is None:
            return
        for bid, (hf, task) in list(self._hinted.items()):
            if self.store.stored_bytes + size <= budget:
                return
            log.warning("hinted blob %s: cancelled, its %d bytes released: a wanted blob needs %d bytes", bid,
                        hf.reserved, size)
            self.store.release(hf.reserved)
            hf.reserved = 0
            self._hinted.pop(bid, None)
            self.metrics.inc("hinted_cancelled")
            task.cancel()

    async def _round(self, fetch: _Fetch) -> str:
        """One round: every byte from the parents (resuming on the next), then the hash check (and the
        digest check). Returns the parent that sent the last byte; a copy that fails is discarded and the
        parents that sent it are put down."""
        blob = fetch.blob
        parent = await self.upstream.each_parent(lambda p: self._download(fetch, p), what=f"blob {blob.id}",
                                                 rotate=fetch.rotate, on_failure=lambda p, e: self._failed(fetch, p))
        try:
            blob.part.verify()
            fetch.check_digest(self._expected.get(blob.id))
        except IntegrityError as e:
            self.metrics.inc("hash_failures")
            senders = fetch.senders or [parent]
            log.error("blob %s from %s failed its check (%s); discarded, refetching", blob.id, ", ".join(senders), e)
            for p in senders:
                self.upstream.mark_failed(p, "sent bytes that fail their hash")
            self._start_over(fetch)
            fetch.rotate += 1
            raise
        return parent

    def _failed(self, fetch: _Fetch, parent: str) -> None:
        """``parent`` failed mid-fetch (it is put down by the per-parent loop). If it had sent every byte it
        announced and the size was only its word, that word is suspect: start over."""
        self.metrics.inc("upstream_failovers")
        blob = fetch.blob
        if fetch.provisional and blob.size is not None and (fetch.size_suspect or blob.part.written >= blob.size):
            log.warning("blob %s: %s announced %d bytes and then failed (%d in); starting over", blob.id,
                        parent, blob.size, blob.part.written)
            self._start_over(fetch)

    def _start_over(self, fetch: _Fetch) -> None:
        """Discard the copy; also its size when that was only a parent's word (no manifest in hand)."""
        blob = fetch.blob
        fetch.senders.clear()
        fetch.size_suspect = False
        fetch.new_digest()
        if fetch.provisional:
            self.store.release(fetch.reserved)
            fetch.reserved = 0
            blob.restart()
        else:
            blob.reset()

    async def _download(self, fetch: _Fetch, parent: str) -> str:
        """Fill the blob's temp file from ``parent``, from the byte it has (Range resume). A parent whose size
        contradicts a provisional one (another parent's word) makes the fetch start over from its answer."""
        try:
            return await self._download_from(fetch, parent)
        except _SizeConflict as e:
            log.warning("blob %s: %s; starting over from that parent", fetch.blob.id, e)
            self._start_over(fetch)
            return await self._download_from(fetch, parent)

    async def _download_from(self, fetch: _Fetch, parent: str) -> str:
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
            loop = asyncio.get_running_loop()
            pace = self.timeouts.pace(loop.time(), f"{parent}: blob {blob.id}'s body")
            if fetch.min_rate is not None:
                pace.min_rate = fetch.min_rate
            got = 0
            while True:
                # readchunk hands over each buffered piece as received; readany would join
                # everything buffered into one new (large, page-faulting) bytes object.
                # (silence is aiohttp's sock_read; the minimum rate is ours: a parent dripping bytes is put down)
                try:
                    async with asyncio.timeout(max(pace.left(got, loop.time()), 0.0) + 1e-3):
                        chunk, boundary = await content.readchunk()
                except TimeoutError:
                    pace.check(got, loop.time())
                    raise
                if not chunk:
                    if boundary:
                        continue  # a chunked-encoding boundary
                    break
                got += len(chunk)
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

        await self._getter.get(parent, blob.id, offset, on_head=on_head, on_body=lambda piece: sink(piece),
                               min_rate=fetch.min_rate)
        self._check_complete(blob, parent)
        return parent

    def _sink(self, fetch: _Fetch, parent: str, resp, offset: int):
        """Check an answer's head (status, size, range); returns the function that takes its body pieces."""
        blob = fetch.blob
        if resp.status == 404:
            raise NotFoundError(f"{parent} has no blob {blob.id}")
        if resp.status == 416 and offset and fetch.provisional:  # we asked past its end: the size we hold is wrong
            raise _SizeConflict(f"{parent} has less than the {offset} bytes of blob {blob.id} in hand")
        start, total = _body_range(resp, offset)
        timeline.info("mono=%.6f fetch-answer %s %s", time.monotonic(), blob.id, parent)
        expected = fetch.expected
        if expected is not None and total != expected.size:
            raise UpstreamError(f"{parent} says blob {blob.id} has {total} bytes; its manifest says {expected.size}")
        if blob.size is None:
            self._hold(fetch, total)
        elif total != blob.size:
            if fetch.provisional:
                raise _SizeConflict(f"{parent} says blob {blob.id} has {total} bytes, another parent said "
                                    f"{blob.size}")
            raise UpstreamError(f"{parent} says blob {blob.id} has {total} bytes, not {blob.size}")
        skip = offset - start  # a parent that ignored our Range sends from 0
        part, metrics, digest = blob.part, self.metrics, fetch.digest
        early = fetch.provisional  # a provisional size: watch for bytes that hash to the id before its end
        if parent not in fetch.senders:
            fetch.senders.append(parent)

        def take(chunk) -> None:
            nonlocal skip
            if skip:
                if len(chunk) <= skip:
                    skip -= len(chunk)
                    return
                chunk = chunk[skip:]
                skip = 0
            n = len(chunk)
            if part.written + n > total:
                raise UpstreamError(f"{parent} sent more than the {total} bytes of blob {blob.id}")
            if n <= SLICE:
                part.write(chunk)
                if digest is not None:
                    digest.update(chunk)
            else:  # cache-sized slices: the write's copy and the hashes read each slice from L2, not memory
                view = memoryview(chunk)
                for i in range(0, n, SLICE):
                    piece = view[i:i + SLICE]
                    part.write(piece)
                    if digest is not None:
                        digest.update(piece)
            metrics.inc("bytes_in", n)
            if early and part.written < total and part.digest() == blob.id:
                fetch.size_suspect = True
                raise UpstreamError(f"{parent} announced {total} bytes for blob {blob.id}, but its first "
                                    f"{part.written} already hash to the id")
            blob.progress()
        return take

    @staticmethod
    def _check_complete(blob: InflightBlob, parent: str) -> None:
        if blob.part.written < blob.size:
            raise UpstreamError(f"{parent} ended blob {blob.id} at byte {blob.part.written} of {blob.size}")


class _SizeConflict(UpstreamError):
    """A parent's size contradicts the provisional size another parent announced (fetcher-internal)."""


class _Fetch:
    """What one blob's fetch carries from round to round."""

    __slots__ = ("blob", "reserved", "rotate", "expected", "senders", "digest", "_alg",
                 "size_suspect", "digest_checked", "min_rate")

    def __init__(self, blob: InflightBlob, expected: BlobRef | None, *, digests: bool) -> None:
        self.blob = blob
        self.reserved = 0  # bytes reserved in the store (released when the fetch ends)
        self.min_rate: float | None = None  # a hinted fetch's own minimum rate (None: the relay's)
        self.rotate = 0  # start further down the parents after a copy failed its hash
        self.expected = expected  # the blob's ref in a manifest in hand: its size is the size
        self.senders: list[str] = []  # parents that sent bytes of the current copy
        self.size_suspect = False  # the copy hashed to the id before the announced end
        # a relay holding a key hashes every fetch: with the manifest's algorithm, or (no manifest names the
        # blob yet) the default one, compared when a manifest does (``BlobFetcher.check_stored``)
        self._alg: str | None = None
        if digests and expected is None:
            self._alg = DEFAULT_DIGEST
        elif digests and expected.digest:  # a manifest without digests (HMAC, format 1): xxh3 only, as before
            self._alg = parse_digest(expected.digest)[0]
        self.digest: DigestHasher | None = None
        self.digest_checked = False
        self.new_digest()

    @property
    def provisional(self) -> bool:
        """The size is only a parent's word (no manifest in hand)."""
        return self.expected is None

    def new_digest(self) -> None:
        self.digest = DigestHasher(self._alg) if self._alg is not None else None

    def check_digest(self, ref: BlobRef | None) -> None:
        """IntegrityError unless the copy hashes to the signed manifest's digest (when it is checked):
        the manifest in hand when the fetch started, else ``ref`` (one that came meanwhile), when its
        algorithm is the one computed; ``digest_checked`` says whether a comparison was made."""
        self.digest_checked = False
        if self.digest is None:
            return
        ref = self.expected or ref
        if ref is None or ref.digest is None or parse_digest(ref.digest)[0] != self._alg:
            return
        found = self.digest.digest()
        if found != ref.digest:
            raise IntegrityError(f"blob {self.blob.id}: bytes hash to {found} but the signed manifest says "
                                 f"{ref.digest} (crafted or corrupted bytes)")
        self.digest_checked = True


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
