"""The version index: which versions of which models a server holds, and each model's head.

Pure bookkeeping in memory (no I/O): the store fills it from what it finds at start
and from every manifest it stores, and answers ``head``/``info``/``after`` from it
without touching its files. The manifests themselves stay in the store.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import xxhash

from deltasync.manifest import Manifest

from .retention import retention_window


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionInfo:
    """What the index keeps in memory about a stored version (the manifest itself stays in the store)."""

    model: str
    version: int
    parent: int | None
    kind: str
    state_fp: str
    state_fp_before: str | None
    blob_bytes: int
    blob_count: int
    manifest_size: int
    etag: str

    def event(self) -> dict:
        return {"model": self.model, "version": self.version, "parent": self.parent, "kind": self.kind,
                "bytes": self.blob_bytes, "blobs": self.blob_count, "state_fp": self.state_fp}


def version_info(m: Manifest, data: bytes) -> VersionInfo:
    """The index entry of manifest ``m`` whose canonical bytes are ``data``."""
    return VersionInfo(model=m.model, version=m.version, parent=m.parent, kind=m.kind, state_fp=m.state_fp,
                       state_fp_before=m.state_fp_before, blob_bytes=m.total_bytes, blob_count=len(m.blobs),
                       manifest_size=len(data), etag=f'"{xxhash.xxh3_64_hexdigest(data)}"')


class ModelIndex:
    """The stored versions of one model, in order, and the head (newest announced version)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.infos: dict[int, VersionInfo] = {}
        self.order: list[int] = []
        self.head: int | None = None
        self.newest_keyframe: int | None = None

    def add(self, info: VersionInfo) -> None:
        if info.version not in self.infos:
            bisect.insort(self.order, info.version)
        self.infos[info.version] = info

    def after(self, version: int, *, limit: int) -> list[VersionInfo]:
        """Announced versions newer than ``version``, oldest first (at most ``limit``, the newest ones)."""
        if self.head is None:
            return []
        lo = bisect.bisect_right(self.order, version)
        hi = bisect.bisect_right(self.order, self.head)
        return [self.infos[v] for v in self.order[max(lo, hi - limit):hi]]

    def window(self, retention: int, *, side_keyframe: int | None = None) -> list[int]:
        """The versions whose blobs are pinned: the newest ``retention`` up to head, and the newest keyframe
        (``side_keyframe``: the newest keyframe of the model's side stream ``M.kf``, if newer)."""
        return retention_window(self.order, head=self.head, newest_keyframe=self.keyframe(side_keyframe),
                                retention=retention)

    def keyframe(self, side_keyframe: int | None = None) -> int | None:
        """The newest version a subscriber can start from: this stream's keyframe or its side stream's."""
        own = self.newest_keyframe
        return own if side_keyframe is None else side_keyframe if own is None else max(own, side_keyframe)

    def remove(self, version: int) -> VersionInfo | None:
        """Forget a version below the head (its manifest was pruned); returns its entry."""
        info = self.infos.pop(version, None)
        if info is not None:
            del self.order[bisect.bisect_left(self.order, version)]
        return info

    def announce(self, version: int) -> bool:
        """Advance the head to a stored version; False if it would not move forward."""
        if self.head is not None and version <= self.head:
            return False
        self.head = version
        if self.infos[version].kind == "keyframe":
            self.newest_keyframe = version
        return True

    def set_head(self, head: int | None) -> None:
        """Set the head at start (the newest version, or the newest complete one) and find its keyframe."""
        self.head = head
        self.newest_keyframe = None
        if head is None:
            return
        for v in reversed(self.order[: bisect.bisect_right(self.order, head)]):
            if self.infos[v].kind == "keyframe":
                self.newest_keyframe = v
                return
