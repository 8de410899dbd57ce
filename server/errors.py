"""Errors only the servers raise. They extend deltasync's one tree (deltasync.errors)::

    DeltaSyncError
    ├── ...                       (deltasync.errors: FormatError 400, IntegrityError 422, ...)
    ├── UnauthorizedError   (401) a write without the right bearer token
    ├── ReadOnlyError       (405) a write sent to a relay
    ├── RequestTimeoutError (408) an upload whose body stalled
    ├── TooLargeError       (413) a body over the server's limit
    ├── RangeError          (416) a Range that lies outside the blob
    ├── MissingBlobsError   (409) a manifest naming blobs the origin has not received
    ├── UpstreamError       (502) every parent failed or answered garbage
    │   └── UpstreamTimeout (504) every parent was too slow
    └── UnavailableError    (503) the server is shutting down or cannot take the request now

Only the route layer (server/routes.py) turns errors into responses.
"""

from __future__ import annotations

from deltasync.errors import (
    ApplyError,
    BaseMismatchError,
    ChainError,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    NotFoundError,
    SignatureError,
    StorageError,
    UnsupportedError,
)


class UnauthorizedError(DeltaSyncError):
    http_status = 401


class ReadOnlyError(DeltaSyncError):
    http_status = 405


class RequestTimeoutError(DeltaSyncError):
    http_status = 408


class TooLargeError(DeltaSyncError):
    http_status = 413


class RangeError(DeltaSyncError):
    http_status = 416

    def __init__(self, message: str, *, size: int) -> None:
        super().__init__(message)
        self.size = size


class MissingBlobsError(DeltaSyncError):
    http_status = 409

    def __init__(self, message: str, *, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


class UpstreamError(DeltaSyncError):
    http_status = 502


class UpstreamTimeout(UpstreamError):
    http_status = 504


class UnavailableError(DeltaSyncError):
    http_status = 503


# Most specific first: the code names the first class an error is an instance of.
_CODES: tuple[tuple[type[DeltaSyncError], str], ...] = (
    (UnsupportedError, "unsupported"),
    (FormatError, "format"),
    (BaseMismatchError, "base_mismatch"),
    (SignatureError, "signature"),
    (IntegrityError, "integrity"),
    (ChainError, "chain"),
    (NotFoundError, "not_found"),
    (ApplyError, "apply"),
    (UnauthorizedError, "unauthorized"),
    (ReadOnlyError, "read_only"),
    (RequestTimeoutError, "request_timeout"),
    (TooLargeError, "too_large"),
    (RangeError, "range_not_satisfiable"),
    (MissingBlobsError, "missing_blobs"),
    (UpstreamTimeout, "upstream_timeout"),
    (UpstreamError, "upstream"),
    (UnavailableError, "unavailable"),
    (StorageError, "insufficient_storage"),
)


def error_code(err: DeltaSyncError) -> str:
    for cls, code in _CODES:
        if isinstance(err, cls):
            return code
    return "internal"
