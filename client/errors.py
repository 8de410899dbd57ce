"""Re-exports of the client's errors, all defined in the one tree (deltasync.errors).

Kept only so existing imports keep working; import from ``deltasync.errors``.
``TransportError`` is ``UpstreamError`` (502) and ``SyncTimeout`` is ``UpstreamTimeout`` (504).
"""

from __future__ import annotations

from deltasync.errors import AuthError, PublishError, UpstreamError, UpstreamTimeout

TransportError = UpstreamError
SyncTimeout = UpstreamTimeout

__all__ = ["AuthError", "PublishError", "SyncTimeout", "TransportError"]
