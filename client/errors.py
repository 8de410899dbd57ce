"""The client's branch of the error tree (rooted at deltasync.errors.DeltaSyncError).

::

    DeltaSyncError
    ├── TransportError   (502)  no server answered usefully: refused, timed out, 5xx on every URL
    ├── AuthError        (403)  the origin refused the bearer token
    ├── PublishError     (500)  a background encode/upload/commit failed; raised by the next
    │                           publish()/flush()/close(); the next version is sent as a keyframe
    └── SyncTimeout      (504)  a subscriber did not reach the version asked for in time

Errors the core raises (IntegrityError, SignatureError, BaseMismatchError, ...) pass
through unchanged.
"""

from __future__ import annotations

from deltasync.errors import DeltaSyncError


class TransportError(DeltaSyncError):
    """No server answered usefully (connection refused, timeout, or 5xx on every URL). Retry later or
    list more servers."""

    http_status = 502
    status: int | None = None


class AuthError(DeltaSyncError):
    """The server refused our credentials (401/403): check --token-file."""

    http_status = 403


class PublishError(DeltaSyncError):
    """A version failed in the background (encoding, upload or commit). The versions queued after it
    were dropped; the next publish() sends a keyframe so the stream stays consistent."""

    http_status = 500


class SyncTimeout(DeltaSyncError):
    """A subscriber did not reach the asked-for version within its timeout."""

    http_status = 504
