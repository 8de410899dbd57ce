"""Re-exports of the servers' errors, all defined in the one tree (deltasync.errors).

Kept only so existing imports keep working; import from ``deltasync.errors``.
``UnauthorizedError`` is ``AuthError`` (401).
"""

from __future__ import annotations

from deltasync.errors import (
    AuthError,
    MissingBlobsError,
    RangeError,
    ReadOnlyError,
    RequestTimeoutError,
    TooLargeError,
    UnavailableError,
    UpstreamError,
    UpstreamTimeout,
    error_code,
)

UnauthorizedError = AuthError

__all__ = [
    "MissingBlobsError", "RangeError", "ReadOnlyError", "RequestTimeoutError", "TooLargeError", "UnauthorizedError",
    "UnavailableError", "UpstreamError", "UpstreamTimeout", "error_code",
]
