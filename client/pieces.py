"""A request body made of pieces, for aiohttp (``upload.PiecesPayload``, re-exported there)."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import payload


class PiecesPayload(payload.Payload):
    """A request body that is the concatenation of ``pieces`` (e.g. a keyframe shard's header and
    memoryviews of a mapped file), sent with its Content-Length and never joined into one buffer.
    Reusable: a retried PUT sends the same pieces again. ``len()`` is its size."""

    WRITE_BYTES = 4 << 20  # handed to the transport at a time, so its send buffer never holds a whole piece
    _autoclose = True  # views of memory the caller owns: nothing to close

    def __init__(self, pieces: Sequence[bytes | bytearray | memoryview]) -> None:
        views = tuple(memoryview(p).cast("B") if memoryview(p).format != "B" else memoryview(p) for p in pieces)
        super().__init__(views, content_type="application/octet-stream")
        self._size = sum(len(v) for v in views)

    def __len__(self) -> int:
        return self._size

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._value)

    async def write(self, writer) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer, content_length: int | None) -> None:
        left = self._size if content_length is None else min(content_length, self._size)
        for view in self._value:
            for at in range(0, len(view), self.WRITE_BYTES):
                if left <= 0:
                    return
                part = view[at : at + min(self.WRITE_BYTES, left)]
                await writer.write(part)
                left -= len(part)
