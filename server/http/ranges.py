"""HTTP Range and conditional headers for blobs (RFC 9110 sections 13 and 14), single ranges only.

A multi-range or syntactically invalid ``Range`` is ignored (the whole blob is sent,
as RFC 9110 allows); a valid range that starts past the end raises ``RangeError`` (416).
"""

from __future__ import annotations

import re

from deltasync.errors import RangeError

_RANGE = re.compile(r"^bytes=(\d{0,19})-(\d{0,19})$")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` (end exclusive) for a satisfiable single range, None for "send everything"."""
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if not m:
        return None
    first, last = m.groups()
    if not first and not last:
        return None
    if not first:  # suffix: the last N bytes
        n = int(last)
        if n == 0:
            raise RangeError(f"empty suffix range {header!r}", size=size)
        return (max(0, size - n), size) if size else _unsatisfiable(header, size)
    start = int(first)
    end = size if not last else min(int(last) + 1, size)
    if last and int(last) < start:
        return None  # invalid: ignore
    if start >= size:
        _unsatisfiable(header, size)
    return start, end


def _unsatisfiable(header: str, size: int):
    raise RangeError(f"range {header!r} lies outside the {size}-byte blob", size=size)


def etag_matches(header: str | None, etag: str) -> bool:
    """True if an If-None-Match header names ``etag`` (weak comparison) or is ``*``."""
    if not header:
        return False
    if header.strip() == "*":
        return True
    for tag in header.split(","):
        tag = tag.strip()
        if tag.startswith("W/"):
            tag = tag[2:]
        if tag == etag:
            return True
    return False


def if_range_allows(header: str | None, etag: str) -> bool:
    """A Range is honoured unless If-Range names another validator (dates never match: blobs have none)."""
    return header is None or header.strip() == etag
