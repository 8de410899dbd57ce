"""The one reader of HTTP/1.1 answer heads (status line and header fields) that come from the network.

Pure, as h11's ``_readers.py`` (the model): bytes in, a :class:`ResponseHead` or "need more" out, no
socket, no clock. :func:`read_head` is the whole interface: it is handed the bytes received so far
(``scanned``: how many of them an earlier call already searched, so a head dripped a byte at a time
costs O(head) in all) and answers ``None`` (the head is not complete yet) or the head and how many
bytes it took (the body's first byte follows). Every malformed or hostile head is :class:`HeadError`,
an ``UpstreamError``: the source's fault, so the caller's failover asks the next source.

Its callers: the relay's blob GET (``server/http/blobget.py``), the client's blob GET into a mapped file
(``client/blobrecv.py``) and ``publish``'s plain-HTTP origin client (``client/plainhttp.py``). They
receive into their own buffers (``recv_into``) and keep their own timeouts; they share these rules:

- the status line is ``HTTP/1.1`` or ``HTTP/1.0``, one space, a status 100-599, and an optional
  reason of visible characters, spaces and tabs;
- the head ends with an empty line (CRLF CRLF) within ``max_bytes`` (default 64 KiB); every line
  ends with CRLF (a bare CR or LF, or a NUL, anywhere is refused); at most ``max_fields`` fields;
- a field name is a token (no space before the colon), a value has no control character but a tab;
  a line folded onto the next (obs-fold, RFC 9112 §5.2) is refused;
- ``Content-Length`` is digits only, given once (a repeated one is refused even when the copies
  agree: two parsers that disagree about it is how responses are smuggled);
- ``Transfer-Encoding`` is ``chunked`` only, given once, never with ``Content-Length``; a 200 or 206
  must carry ``Content-Length`` (chunked or read-to-the-close refused) unless the caller reads such
  bodies (``framed=False``: plainhttp's small JSON answers);
- a 206 carries ``Content-Range: bytes first-last/total`` with ``first <= last < total`` and
  ``Content-Length`` equal to ``last - first + 1``; :func:`check_range` then checks it against the
  request (``Range: bytes=start-``).

Why not h11 itself: it is not a dependency of ours (only a test tool pulls it in), it wants a whole
client connection state machine (a request sent through it) before it reads an answer, and its rules
differ from ours where it matters (it merges repeated equal ``Content-Length``, unfolds obs-fold, and
knows nothing of ``Content-Range``); the part we need is this module's ~150 lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UpstreamError

__all__ = ["ContentRange", "HeadError", "Headers", "MAX_FIELDS", "MAX_HEAD", "ResponseHead", "check_range",
           "parse_head", "read_head"]

#: the most bytes an answer's status line and header fields may take (the empty line included)
MAX_HEAD = 64 << 10
#: the most header fields an answer may carry
MAX_FIELDS = 128
#: ``Content-Length`` longer than this many digits (beyond 2**63) is refused
_MAX_DIGITS = 18

_END = b"\r\n\r\n"
_STATUS = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9][0-9])(?: ([\t\x20-\x7e\x80-\xff]*))?")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEAD = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9][0-9])(?: ([\t\x20-\x7e\x80-\xff]*))?\r\n"
                   rb"((?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*)")
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters but the tab (CR, LF and NUL among them)
_RANGE = re.compile(r"bytes ([0-9]{1,18})-([0-9]{1,18})/([0-9]{1,18})")


class HeadError(UpstreamError):
    """An answer head that breaks HTTP/1.1 or our rules for it (module docstring): the source's fault.
    Travels as ``upstream`` (no wire code of its own)."""


class Headers(dict):
    """An answer's header fields: names lower-cased, looked up in any case; a name given more than once
    maps to its values joined with ``", "`` (RFC 9110 §5.3); ``fields`` keeps every (name, value) in order."""

    fields: tuple[tuple[str, str], ...] = ()

    def get(self, key, default=None):
        return super().get(key.lower(), default)

    def __getitem__(self, key):
        return super().__getitem__(key.lower())

    def __contains__(self, key) -> bool:
        return super().__contains__(key.lower())

    def getall(self, key: str) -> list[str]:
        """Every value of ``key``, in order (empty when absent)."""
        key = key.lower()
        return [v for k, v in self.fields if k == key]


@dataclass(frozen=True, slots=True)
class ContentRange:
    """``Content-Range: bytes first-last/total`` of a 206: bytes ``[first, last]`` of ``total``."""

    first: int
    last: int
    total: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseHead:
    """One answer's head. ``content_length``: None when absent (chunked, or read to the close);
    ``content_range``: a 206's (None for any other status: a 416's ``bytes */n`` is left in ``headers``);
    ``keep_alive``: whether the connection may carry another request after this answer's body."""

    version: str
    status: int
    reason: str
    headers: Headers
    content_length: int | None
    chunked: bool
    content_range: ContentRange | None
    keep_alive: bool


def read_head(buf: bytes | bytearray, *, filled: int | None = None, scanned: int = 0, max_bytes: int = MAX_HEAD,
              max_fields: int = MAX_FIELDS, framed: bool = True, where: str = "") -> tuple[ResponseHead, int] | None:
    """The head at the start of ``buf`` and the number of bytes it takes (the body starts there), or None
    when the head is not complete yet. ``filled``: how many bytes of ``buf`` were received (default: all; a
    receive buffer is searched in place, never copied); ``scanned``: how many of them an earlier call found
    incomplete (the search for the empty line goes on from there). ``framed``: a 200 or 206 must carry
    ``Content-Length``. ``where`` (the source, e.g. its URL) prefixes every message. HeadError when the head
    breaks a rule or has no end within ``max_bytes``."""
    filled = len(buf) if filled is None else filled
    end = buf.find(_END, max(0, scanned - 3), min(filled, max_bytes))
    if end < 0:
        if filled >= max_bytes:
            raise _error(where, f"the answer's head is longer than {max_bytes} bytes")
        return None
    return parse_head(bytes(buf[:end + 2]), max_fields=max_fields, framed=framed, where=where), end + 4


def parse_head(head: bytes, *, max_fields: int = MAX_FIELDS, framed: bool = True, where: str = "") -> ResponseHead:
    """A complete head: its lines each ending with CRLF, without the final empty line."""
    m = _HEAD.fullmatch(head)
    if m is None:
        raise _diagnose(head, where)
    block = m.group(4).decode("latin-1")
    lines = block.split("\r\n")
    lines.pop()  # the empty piece after the last CRLF
    if len(lines) > max_fields:
        raise _error(where, f"the answer has {len(lines)} header fields, more than {max_fields}")
    found: dict[str, str] = {}
    fields = []
    repeated = set()
    for line in lines:
        name, _, value = line.partition(":")
        key, value = name.lower(), value.strip(" \t")
        fields.append((key, value))
        if key in found:
            repeated.add(key)
            value = f"{found[key]}, {value}"
        found[key] = value
    status = int(m.group(2))
    version = "1.1" if m.group(1) == b"1" else "1.0"
    length = _content_length(found, repeated, where) if "content-length" in found else None
    chunked = _chunked(found, repeated, where) if "transfer-encoding" in found else False
    if chunked and length is not None:
        raise _error(where, "the answer has both Content-Length and Transfer-Encoding: chunked")
    if framed and status in (200, 206) and length is None:
        if chunked:
            raise _error(where, f"a chunked {status} body; this answer must carry Content-Length")
        raise _error(where, f"the {status} answer has no Content-Length")
    crange = _content_range(found, repeated, length, where) if status == 206 else None
    conn = found.get("connection")
    if conn is None:
        keep = version == "1.1"
    else:
        tokens = {t.strip().lower() for t in conn.split(",")}
        keep = "close" not in tokens if version == "1.1" else "keep-alive" in tokens
    headers = Headers(found)
    headers.fields = tuple(fields)
    return ResponseHead(version=version, status=status, reason=(m.group(3) or b"").decode("latin-1"),
                        headers=headers, content_length=length, chunked=chunked, content_range=crange, keep_alive=keep)


def _diagnose(head: bytes, where: str) -> HeadError:
    """What is wrong with a head that does not match ``_HEAD`` (the slow path, for the message)."""
    lines = head.split(b"\r\n")
    if _STATUS.fullmatch(lines[0]) is None:
        return _error(where, f"not an HTTP/1.x status line: {_show(lines[0])}")
    for line in lines[1:-1]:
        name, sep, value = line.partition(b":")
        if line[:1] in (b" ", b"\t"):
            return _error(where, f"a folded header line (obs-fold) in the answer: {_show(line)}")
        if not sep or _TOKEN.fullmatch(name) is None:
            return _error(where, f"a malformed header line in the answer: {_show(line)}")
        if _CTL.search(value) is not None:
            return _error(where, f"a control character in the answer's {name.decode()} field: {_show(line)}")
    return _error(where, f"a malformed answer head: {_show(head)}")  # a bare CR or LF somewhere


def check_range(head: ResponseHead, start: int, *, where: str = "") -> tuple[int, int]:
    """(first body byte's offset, the whole size) of a 200 or 206 answer to ``Range: bytes=start-``
    (or to no Range, ``start`` 0): a 206 must run from ``start`` to the end; a 200 is the whole from 0
    (the server ignored the Range). HeadError otherwise."""
    if head.status == 206:
        r = head.content_range
        if r.first != start or r.last != r.total - 1:
            raise _error(where, f"asked for bytes {start}-, got {r.first}-{r.last}/{r.total}")
        return r.first, r.total
    if head.status == 200 and head.content_length is not None:
        return 0, head.content_length
    raise _error(where, f"a {head.status} answer has no body range")


def _content_length(found: dict[str, str], repeated: set[str], where: str) -> int:
    v = found["content-length"]
    if "content-length" in repeated:
        raise _error(where, f"the answer has more than one Content-Length field ({v[:80]})")
    if not (v.isascii() and v.isdigit()) or len(v) > _MAX_DIGITS:
        raise _error(where, f"the answer has a Content-Length that is not a byte count: {v[:40]!r}")
    return int(v)


def _chunked(found: dict[str, str], repeated: set[str], where: str) -> bool:
    v = found["transfer-encoding"]
    if "transfer-encoding" in repeated or v.lower() != "chunked":
        raise _error(where, f"the answer's Transfer-Encoding is {v[:80]!r}, not chunked")
    return True


def _content_range(found: dict[str, str], repeated: set[str], length: int | None, where: str) -> ContentRange:
    v = found.get("content-range", "")
    m = _RANGE.fullmatch(v) if "content-range" not in repeated else None
    if m is None:
        raise _error(where, f"206 without a usable Content-Range: {v[:80]!r}")
    first, last, total = map(int, m.groups())
    if not first <= last < total:
        raise _error(where, f"206 with an impossible Content-Range: {v!r}")
    if length is not None and length != last - first + 1:
        raise _error(where, f"206 for bytes {first}-{last} ({last - first + 1} bytes) with Content-Length {length}")
    return ContentRange(first, last, total)


def _show(line: bytes) -> str:
    return repr(line[:80].decode("latin-1"))


def _error(where: str, message: str) -> HeadError:
    return HeadError(f"{where}: {message}" if where else message)
