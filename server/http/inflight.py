"""A blob on its way in from a parent, served to any number of readers while it arrives.

One ``InflightBlob`` per missing blob (coalescing): the fetch task appends to a
growing blob (``GrowingBlob``) and calls ``progress()``; every reader sends from it
at its own offset (``os.sendfile`` from the temp file on the disk store), as far as
the bytes have arrived, and then waits for more. Memory per reader is constant (no bytes pass through Python);
a slow reader only falls behind in the file, it never slows the fetch or the
other readers.

A reader never receives the last byte of a blob before the whole blob hashed to
its id (and, on a relay holding a verify key, to its signed digest): until then it is
held back. If the check fails, or a parent turns out to have announced a wrong size,
the fetch starts over (a new ``generation``; ``restart`` also forgets a size no
manifest vouched for); readers that already sent bytes of the bad copy, or promised
their child a size the new copy does not have, abort their response (the child sees
a truncated transfer and never a complete bad blob), the others carry on with the
new copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from deltasync.errors import DeltaSyncError, UpstreamError, UpstreamTimeout

from ..storage.blobstore import GrowingBlob
from ..compat import timeout as timeout_after
from .sendfile import send_blob_range


class BlobResetError(UpstreamError):
    """The copy a reader was streaming failed its hash check and was discarded."""


class InflightBlob:
    def __init__(self, blob_id: str) -> None:
        self.id = blob_id
        self.part: GrowingBlob | None = None  # the fetch opens it (off the event loop) before any byte
        self.size: int | None = None  # known once a parent answered
        self.verified = False  # every byte is in and hashed to the id
        self.error: DeltaSyncError | None = None  # the fetch gave up
        self.generation = 0
        self.finished = False  # the fetch task ended (either way)
        self._event = asyncio.Event()
        self._readers = 0
        self._closed = False

    # -- writer side (the fetch task) -------------------------------------------------
    def progress(self) -> None:
        """Wake every reader; call after any change of state."""
        ev, self._event = self._event, asyncio.Event()
        ev.set()

    def set_size(self, size: int) -> None:
        self.size = size
        self.progress()

    def reset(self) -> None:
        """Discard the bytes (a bad copy); the size stays (it came from the manifest or is re-checked)."""
        self.part.reset()
        self.generation += 1
        self.progress()

    def restart(self) -> None:
        """Discard the bytes and the size: the parent that announced it lied (or may have); the next
        parent's answer sets it again. Readers that promised the old size to their child abort."""
        self.part.reset()
        self.size = None
        self.generation += 1
        self.progress()

    def fail(self, err: DeltaSyncError) -> None:
        self.error = err
        self.progress()

    def finish(self) -> None:
        self.finished = True
        self.progress()
        self._maybe_close()

    # -- reader side -----------------------------------------------------------------
    @property
    def servable_to(self) -> int:
        """Bytes a reader may send now: all once verified, else all but the last."""
        if self.part is None or self.size is None:
            return 0
        written = self.part.written
        if self.verified:
            return written
        return min(written, self.size - 1)

    async def wait_size(self, timeout: float) -> int:
        """Wait until a parent has told us the size; raises the fetch's error or UpstreamTimeout."""
        try:
            async with timeout_after(timeout):
                while self.size is None:
                    if self.error is not None:
                        raise self.error
                    await self._event.wait()
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"no parent started sending blob {self.id} within {timeout:.0f} s") from None
        return self.size

    async def wait_done(self, stall_timeout: float) -> None:
        """Wait until the blob is verified (complete); raises the fetch's error, or UpstreamTimeout
        after ``stall_timeout`` seconds without any progress."""
        while not self.verified:
            if self.error is not None:
                raise self.error
            ev = self._event
            try:
                async with timeout_after(stall_timeout):
                    await ev.wait()
            except asyncio.TimeoutError:
                raise UpstreamTimeout(f"blob {self.id}: no progress for {stall_timeout:.0f} s") from None

    async def send_range(self, request: web.BaseRequest, resp: web.StreamResponse, start: int, end: int, *,
                         stall_timeout: float, write_timeout: float,
                         on_sent: Callable[[int], None], promised: int | None = None) -> None:
        """Send bytes [start, end) to ``resp`` as they arrive. Raises if the copy is lost or the reader is stuck.

        The caller must hold ``attach()`` around the whole response (the descriptor stays open until
        every attached reader detached). ``promised``: the blob size the child was told (default: the
        size known now); a copy of another size aborts the response.
        """
        assert self._readers > 0, "attach() before sending"
        gen = self.generation
        promised = self.size if promised is None else promised  # what the child was told
        pos = start
        while pos < end:
            if self.generation != gen:
                if pos > start:
                    raise BlobResetError(f"blob {self.id} failed its check mid-transfer (a bad copy or a parent "
                                         "that announced a wrong size); retry")
                gen = self.generation
            if self.size is not None and self.size != promised:
                raise BlobResetError(f"blob {self.id} has {self.size} bytes, not the {promised} a parent announced; "
                                     "retry")
            if self.error is not None:
                raise self.error
            avail = min(self.servable_to, end)
            if avail > pos:
                n = avail - pos
                await send_blob_range(request, resp, self.part, pos, n, timeout=write_timeout)
                pos += n
                on_sent(n)
                continue
            ev = self._event
            try:
                async with timeout_after(stall_timeout):
                    await ev.wait()
            except asyncio.TimeoutError:
                raise UpstreamTimeout(f"blob {self.id}: no new bytes from any parent for {stall_timeout:.0f} s"
                                      ) from None

    def attach(self) -> InflightBlob:
        """Register a reader; the temp file's descriptor stays open until it calls ``detach``."""
        self._readers += 1
        return self

    def detach(self) -> None:
        self._readers -= 1
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self.finished and self._readers == 0 and not self._closed:
            self._closed = True
            if self.part is not None:
                self.part.close()
