"""Server-sent events (text/event-stream), both ways, without I/O.

:class:`SSEDecoder` is incremental, h11-style: ``feed(bytes)`` in, the events
completed so far out, any chunking. It follows the WHATWG parsing rules we need:
lines end in LF, CRLF or a lone CR; ``event``, ``data`` (several lines join with
LF) and ``id`` fields (the id carries over to later events, one containing NUL is
ignored); ``retry`` and unknown fields and ``:`` comments are ignored; a blank line
dispatches an event that has data; a leading BOM is skipped; an event cut off by the
end of the stream is dropped. A line longer than ``max_line`` bytes raises
``FormatError``.

:func:`format_event` writes one event (what the servers send).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import FormatError

MAX_LINE = 1 << 20
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True, kw_only=True)
class SSEEvent:
    """One dispatched event: its type (``message`` when none was named), data and last event id."""

    event: str
    data: str
    id: str | None = None

    def json(self) -> dict:
        """The data as a JSON object; FormatError when it is not one."""
        try:
            obj = json.loads(self.data)
        except (ValueError, RecursionError) as e:  # RecursionError: crafted deep nesting
            raise FormatError(f"{self.event!r} event: data is not JSON ({type(e).__name__}: {str(e)[:100]}): "
                              f"{self.data[:200]!r}") from None
        if not isinstance(obj, dict):
            raise FormatError(f"{self.event!r} event: data is JSON but not an object: {self.data[:200]!r}")
        return obj


def format_event(event: str, data: dict | bytes, *, id: str | None = None) -> bytes:
    """One server-sent event; ``data`` is a JSON object or its encoding (one line)."""
    head = f"event: {event}\n" + (f"id: {id}\n" if id is not None else "")
    body = data if isinstance(data, bytes) else json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    if b"\n" in body or b"\r" in body:
        raise ValueError("an event's data must be one line")
    return head.encode() + b"data: " + body + b"\n\n"


class SSEDecoder:
    """Incremental text/event-stream parser: ``feed(chunk) -> list[SSEEvent]``. One per stream."""

    def __init__(self, *, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._buf = bytearray()
        self._started = False  # the BOM check is done
        self._cr = False  # the last chunk ended in CR: a LF starting the next one belongs to it
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, data: bytes) -> list[SSEEvent]:
        if self._cr and data[:1] == b"\n":
            data = data[1:]
        self._cr = False
        self._buf += data
        if not self._started:
            if len(self._buf) < len(_BOM) and _BOM.startswith(bytes(self._buf)):
                return []
            if self._buf.startswith(_BOM):
                del self._buf[: len(_BOM)]
            self._started = True
        out: list[SSEEvent] = []
        pos = 0
        buf = self._buf
        while True:
            lf, cr = buf.find(b"\n", pos), buf.find(b"\r", pos)
            if lf < 0 and cr < 0:
                break
            if cr < 0 or 0 <= lf < cr:
                end, nxt = lf, lf + 1
            elif cr + 1 < len(buf):
                end, nxt = cr, cr + 2 if buf[cr + 1] == 0x0A else cr + 1
            else:  # CR last in the buffer: a line ends here; a LF may follow in the next chunk
                end, nxt = cr, cr + 1
                self._cr = True
            if end - pos > self.max_line:
                raise FormatError(f"event-stream line of {end - pos} bytes, over the {self.max_line}-byte limit")
            self._line(bytes(buf[pos:end]).decode("utf-8", "replace"), out)
            pos = nxt
        del buf[:pos]
        if len(buf) > self.max_line:
            raise FormatError(f"event-stream line over the {self.max_line}-byte limit")
        return out

    def _line(self, line: str, out: list[SSEEvent]) -> None:
        if not line:
            if self._data:
                out.append(SSEEvent(event=self._event or "message", data="\n".join(self._data), id=self._id))
            self._event, self._data = "", []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self._id = value
