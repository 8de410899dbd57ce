"""One writer at a time on a bucket that cannot refuse a second create: the writer lease.

Where the S3 server honours ``If-None-Match: *`` (AWS S3, R2, MinIO, moto...), any
number of origins may share a bucket: two commits of one version race on the
manifest's conditional create and exactly one wins (s3store.py). Where it does not
(``rclone serve s3``, some gateways), a second origin would silently overwrite a
committed manifest, so origins take turns through ``lease.json``::

    {"holder": "<host>/<pid>/<random>", "expires": <unix seconds>, "ttl": <seconds>}

* At start an origin reads the lease. Free (absent or expired) or already its own:
  it writes its own, waits ``settle`` seconds and reads it back; if another origin's
  write landed instead, it tries again. Held by another: the origin starts in
  **standby** (it never blocks start-up: ``/healthz`` answers at once, with
  ``"status": "standby"`` and the holder): it serves reads of the bucket and follows
  its commits, refuses uploads and commits with 503 ``unavailable`` (naming the
  holder; publishers retry), and re-reads the lease about once a second. When the
  lease expires (its holder was SIGKILLed: at most one ``ttl``) or is released (its
  holder stopped), the standby takes it as above and accepts writes from then on.
  While the holder keeps renewing, the standby stays a read replica and says so in
  its log every ``ttl``.
* The holder renews every ``ttl / 3``. Before every commit it checks that the lease
  is still its own and unexpired (one GET); if not (it was paused longer than a
  ``ttl`` and another origin took over) the commit is refused with ``ChainError``.

This is write-then-verify on a store without compare-and-swap: it assumes clocks
agree to well within ``ttl`` and that a write becomes visible within ``settle``
(true of a single S3 server). For several origins behind a load balancer, use a
server with conditional writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from deltasync.errors import ChainError, DeltaSyncError, UnavailableError

from .bucketlayout import LEASE
from .s3objects import Bucket

log = logging.getLogger("deltasync.server.bucketlease")


class LeaseHeldError(UnavailableError):
    """Another live origin holds the writer lease of a bucket without conditional writes: this origin is on
    standby (503 ``unavailable`` on the wire: a publisher retries, and reaches the holder or this origin
    once it has taken over)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    holder: str
    expires: float
    ttl: float

    def to_json(self) -> bytes:
        return json.dumps({"holder": self.holder, "expires": self.expires, "ttl": self.ttl},
                          separators=(",", ":"), sort_keys=True).encode()

    @staticmethod
    def parse(data: bytes) -> Lease | None:
        try:
            d = json.loads(data)
            return Lease(holder=str(d["holder"]), expires=float(d["expires"]), ttl=float(d["ttl"]))
        except (ValueError, KeyError, TypeError):
            return None


def new_holder() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


class WriterLease:
    def __init__(self, bucket: Bucket, *, ttl: float = 30.0, settle: float = 0.5, holder: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl < 3 * settle:
            raise ValueError(f"the lease ttl ({ttl} s) must be at least 3x the settle time ({settle} s)")
        self.bucket = bucket
        self.ttl = ttl
        self.settle = settle
        self.holder = holder or new_holder()
        self.clock = clock
        self.expires = 0.0
        self.held_by: Lease | None = None  # another origin's live lease, last seen (standby)
        self._renewer: asyncio.Task | None = None

    async def read(self) -> Lease | None:
        data = await self.bucket.get(LEASE)
        return None if data is None else Lease.parse(data)

    @property
    def standby(self) -> bool:
        """True until this origin holds the lease (another origin's lease was live at start)."""
        return self.expires == 0.0 and self._renewer is None

    async def try_acquire(self) -> Lease | None:
        """Take the lease if it is free (absent, expired, or already ours): None once held. Another origin's
        unexpired lease is returned instead (and kept in ``held_by``); nothing waits for it."""
        while True:
            cur = await self.read()
            if cur is not None and cur.holder != self.holder and cur.expires > self.clock():
                self.held_by = cur
                return cur
            mine = Lease(holder=self.holder, expires=self.clock() + self.ttl, ttl=self.ttl)
            await self.bucket.put(LEASE, mine.to_json())
            await asyncio.sleep(self.settle)
            back = await self.read()
            if back is not None and back.holder == self.holder:
                self.expires = mine.expires
                self.held_by = None
                log.info("holding the writer lease of %s as %s (ttl %.0f s): accepting writes", self.bucket.where,
                         self.holder, self.ttl)
                self._renewer = asyncio.get_running_loop().create_task(self._renew_forever(), name="lease-renew")
                return None
            log.info("another origin took the lease of %s at the same moment; checking again", self.bucket.where)

    async def acquire(self) -> None:
        """Take the lease, waiting on standby as long as another origin holds it (see the module docstring).
        Reads the lease about once a second; a failed read is logged and retried."""
        said = 0.0
        while True:
            try:
                cur = await self.try_acquire()
            except DeltaSyncError as e:
                log.warning("standby: reading the writer lease of %s failed (%s); retrying", self.bucket.where, e)
                cur = None
                await asyncio.sleep(max(self.settle, 1.0))
                continue
            if cur is None:
                return
            if self.clock() - said >= self.ttl:
                said = self.clock()
                log.warning("standby: %s", self.held_message(cur))
            await asyncio.sleep(min(1.0, max(0.05, cur.expires - self.clock() + 0.01)))

    def held_message(self, cur: Lease) -> str:
        left = max(0.0, cur.expires - self.clock())
        return (f"origin {cur.holder} holds the writer lease of {self.bucket.where} for {left:.0f} more s "
                f"(ttl {cur.ttl:.0f} s); this bucket's server does not honour conditional writes (If-None-Match), "
                "so only one origin may write to it: this origin serves reads and takes over writes when that "
                "lease ends (its holder stopped, or stopped renewing it); to run several writers, use a server "
                "with conditional writes")

    def refuse_writes(self) -> None:
        """On standby: LeaseHeldError (503) naming the holder; holding the lease: nothing."""
        if self.standby:
            cur = self.held_by
            who = "another origin" if cur is None else cur.holder
            left = 0.0 if cur is None else max(0.0, cur.expires - self.clock())
            raise LeaseHeldError(
                f"this origin is on standby: {who} holds the writer lease of {self.bucket.where} (for {left:.0f} "
                f"more s unless renewed); publish through that origin, or retry: this origin takes over writes "
                "once the lease ends")

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self.renew()
            except ChainError as e:
                log.error("%s", e)
                return
            except DeltaSyncError as e:
                log.warning("renewing the writer lease of %s failed: %s", self.bucket.where, e)

    async def renew(self) -> None:
        cur = await self.read()
        if cur is not None and cur.holder != self.holder and cur.expires > self.clock():
            self.expires = 0.0
            raise ChainError(f"this origin lost the writer lease of {self.bucket.where} to {cur.holder}")
        mine = Lease(holder=self.holder, expires=self.clock() + self.ttl, ttl=self.ttl)
        await self.bucket.put(LEASE, mine.to_json())
        self.expires = mine.expires

    async def check(self) -> None:
        """Before a commit: ChainError unless the lease is still this origin's and unexpired."""
        cur = await self.read()
        now = self.clock()
        if cur is None or cur.holder != self.holder or cur.expires <= now or self.expires <= now:
            who = "nobody" if cur is None else cur.holder
            raise ChainError(f"this origin no longer holds the writer lease of {self.bucket.where} (held by {who}); "
                             "the commit was refused: publish through the origin that holds it")

    async def release(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        try:
            cur = await self.read()
            if cur is not None and cur.holder == self.holder:
                await self.bucket.delete(LEASE)
        except DeltaSyncError as e:
            log.warning("could not release the writer lease of %s: %s", self.bucket.where, e)
