"""Learning about new versions in a bucket by polling: the bucket's stand-in for an event stream.

``HeadsWatcher.poll()`` GETs ``heads.json`` with ``If-None-Match`` (a 304 costs one small
request), and, when it changed or every ``list_every`` polls, lists each model's
manifests after the newest version it knows: a version whose heads update was lost
(its origin died between the manifest and the heads write, or two origins raced)
is still found. A plain-URL bucket (no LIST) relies on ``heads.json`` alone.

``poll()`` returns the models whose newest version moved, with that version; the
caller (a relay's bucket parent, a stateless origin) fetches the manifests.
"""

from __future__ import annotations

import logging

from deltasync.errors import FormatError

from .bucketlayout import HEADS, MODELS, decode_heads, manifest_key, model_prefix, parse_manifest_key
from .s3objects import Bucket

log = logging.getLogger("deltasync.server.bucketwatch")


class HeadsWatcher:
    def __init__(self, bucket: Bucket, *, list_every: int = 10) -> None:
        self.bucket = bucket
        self.list_every = list_every
        self.heads: dict[str, int] = {}  # model -> newest version seen
        self._etag: str | None = None
        self._polls = 0

    async def poll(self) -> dict[str, int]:
        """One round: the models whose newest version moved forward, with that version."""
        self._polls += 1
        moved: dict[str, int] = {}
        data, etag, changed = await self.bucket.get_with_etag(HEADS, if_none_match=self._etag)
        if changed and data is not None:
            self._etag = etag
            try:
                entries = decode_heads(data)
            except FormatError as e:
                log.error("ignoring a damaged %s in %s: %s", HEADS, self.bucket.where, e)
                entries = {}
            for model, e in entries.items():
                self._see(model, e.version, moved)
        can_list = not self.bucket.read_only
        if can_list and (changed or self._polls == 1 or self._polls % self.list_every == 0):
            for model, version in (await self.list_newest(self.heads if self._polls > 1 else None)).items():
                self._see(model, version, moved)
        return moved

    async def list_newest(self, known: dict[str, int] | None) -> dict[str, int]:
        """The newest manifest of each model by LIST (only models in ``known`` and only after the
        known version, when given; every model otherwise)."""
        out: dict[str, int] = {}
        if known is None:
            objs = await self.bucket.list(MODELS)
            for o in objs:
                mv = parse_manifest_key(o.key)
                if mv is not None and mv[1] > out.get(mv[0], -1):
                    out[mv[0]] = mv[1]
            return out
        for model, version in known.items():
            objs = await self.bucket.list(model_prefix(model), after=manifest_key(model, version))
            for o in objs:
                mv = parse_manifest_key(o.key)
                if mv is not None and mv[0] == model and mv[1] > out.get(model, version):
                    out[model] = mv[1]
        return out

    def _see(self, model: str, version: int, moved: dict[str, int]) -> None:
        if version > self.heads.get(model, -1):
            self.heads[model] = version
            moved[model] = version
