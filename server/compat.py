"""``timeout(seconds)``: asyncio.timeout on Python 3.11+, async_timeout (an aiohttp dependency) before.

Raises ``asyncio.TimeoutError`` (the builtin ``TimeoutError`` from 3.11 on) when the time is up.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - exercised on 3.10 only
    from async_timeout import timeout

__all__ = ["timeout"]
