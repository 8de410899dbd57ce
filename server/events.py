"""Announcing committed versions: to SSE streams, long-polls, and back from a parent's stream.

``EventHub`` fans a commit out to every subscriber's bounded queue; a subscriber
whose queue is full (it stopped reading) is dropped rather than allowed to hold
anyone up, and reconnects to catch up. Server-sent events are written and parsed
by the core (``deltasync.sse``: ``format_event``, ``SSEDecoder``).

An event's data is the version summary (``VersionInfo.event()``) and, when the
manifest is at most ``INLINE_MANIFEST_MAX`` bytes, the manifest itself under
``"manifest"``: a follower then starts fetching blobs without another round trip.

A *hint* (``EventHub.hint``) goes only to streams of every model (``/v1/events``, what relays
follow): a ``blob`` event, ``{"id": ..., "size": ...}``, when the origin starts receiving a large
upload (or a relay starts fetching one it was hinted). It names no version and promises nothing; a
relay may start fetching the blob at once (the origin serves an upload while it arrives, see
intake.py), so that when the version naming it is committed its bytes are already on the way.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from deltasync.sse import format_event  # noqa: F401  (routes take it from here)

from .compat import timeout as timeout_after
from .storage.store import VersionInfo


INLINE_MANIFEST_MAX = 64 << 10


@dataclass(frozen=True, slots=True, kw_only=True)
class Announcement:
    """A committed version as the event streams send it: its summary and the event's JSON data."""

    info: VersionInfo
    payload: bytes


def event_payload(info: VersionInfo, manifest: bytes | None) -> bytes:
    """The JSON data of a version event; the manifest is inlined when small."""
    base = json.dumps(info.event(), separators=(",", ":"), sort_keys=True).encode()
    if manifest is None or len(manifest) > INLINE_MANIFEST_MAX:
        return base
    return base[:-1] + b',"manifest":' + manifest + b"}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Hint:
    """A blob on its way in (an upload or a hinted fetch): the ``blob`` event's JSON data."""

    blob_id: str
    payload: bytes


class Subscription:
    def __init__(self, model: str | None, size: int) -> None:
        self.model = model  # None: every model
        self.queue: asyncio.Queue[Announcement | Hint | None] = asyncio.Queue(maxsize=size)
        self.dropped = False


class EventHub:
    def __init__(self, *, queue_size: int = 1024) -> None:
        self._queue_size = queue_size
        self._subs: set[Subscription] = set()
        self._changed: dict[str, asyncio.Event] = {}
        self.closed = False

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def subscribe(self, model: str | None) -> Subscription:
        sub = Subscription(model, self._queue_size)
        if self.closed:
            sub.queue.put_nowait(None)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def publish(self, info: VersionInfo, manifest: bytes | None = None) -> None:
        """Announce a committed version (``manifest``: its JSON, inlined in events when small)."""
        ann = Announcement(info=info, payload=event_payload(info, manifest))
        for sub in list(self._subs):
            if sub.model is not None and sub.model != info.model:
                continue
            try:
                sub.queue.put_nowait(ann)
            except asyncio.QueueFull:
                self._drop(sub)
        ev = self._changed.pop(info.model, None)
        if ev is not None:
            ev.set()

    def hint(self, blob_id: str, size: int) -> None:
        """Tell the streams of every model (relays) that blob ``blob_id`` of ``size`` bytes is arriving."""
        hint = Hint(blob_id=blob_id, payload=json.dumps({"id": blob_id, "size": size}, separators=(",", ":")).encode())
        for sub in list(self._subs):
            if sub.model is not None:
                continue
            try:
                sub.queue.put_nowait(hint)
            except asyncio.QueueFull:
                self._drop(sub)

    def _drop(self, sub: Subscription) -> None:
        """Cut off a subscriber that stopped reading: empty its queue and leave only the end marker."""
        sub.dropped = True
        self._subs.discard(sub)
        while not sub.queue.empty():
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)

    async def wait_change(self, model: str, timeout: float) -> bool:
        """Wait for the next commit of ``model``; False on timeout or shutdown."""
        if self.closed:
            return False
        ev = self._changed.get(model)
        if ev is None:
            ev = self._changed[model] = asyncio.Event()
        try:
            async with timeout_after(timeout):
                await ev.wait()
        except asyncio.TimeoutError:
            return False
        return not self.closed

    def close(self) -> None:
        """Shutdown: end every stream and wake every long-poll."""
        self.closed = True
        for sub in list(self._subs):
            self._drop(sub)
        for ev in self._changed.values():
            ev.set()
        self._changed.clear()
