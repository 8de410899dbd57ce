"""The one exception tree of deltasync, and its wire form (docs/PROTOCOL.md §1.1).

::

    DeltaSyncError                      500 internal              root; catch this to catch everything we raise
    ├── FormatError                     400 format                bytes, JSON or a request that do not follow the spec
    │   └── UnsupportedError            400 unsupported           well-formed, but a version/dtype/feature we do not handle
    ├── IntegrityError                  422 integrity             content does not hash/fingerprint to what was promised
    │   ├── BaseMismatchError           409 base_mismatch         a delta offered to a state it was not made from
    │   └── SignatureError              403 signature             a manifest whose signature does not verify
    ├── ChainError                      409 chain                 versions that do not link (gap, wrong parent, reorder)
    ├── MissingBlobsError               409 missing_blobs         a manifest naming blobs the origin has not received
    ├── NotFoundError                   404 not_found             a blob, version or tensor that is not there
    ├── AuthError                       401 unauthorized          a write without the right bearer token (401 or 403)
    ├── ReadOnlyError                   405 read_only             a write sent to a relay
    ├── RequestTimeoutError             408 request_timeout       an upload whose body stalled
    ├── TooLargeError                   413 too_large             a body over the server's limit
    ├── RangeError                      416 range_not_satisfiable a Range that lies outside the blob
    ├── ApplyError                      500 apply                 patching live tensors failed; the state was rolled back
    │   └── ApplyInterrupted            503 apply_interrupted     a signal or a deadline stopped an apply; rolled back
    ├── PublishError                    500 publish               a background encode/upload/commit failed
    ├── UpstreamError                   502 upstream              no server upstream answered usefully (refused,
    │   │                                                         5xx, bad bytes on every source)
    │   └── UpstreamTimeout             504 upstream_timeout      waited past a deadline for upstream: every source
    │                                                             too slow, or a version not reached in time
    ├── UnavailableError                503 unavailable           shutting down, or cannot take the request now
    └── StorageError                    507 insufficient_storage  a write failed (disk full, quota, I/O); nothing partial kept

Every error says what was expected, what was found and what to do.

Each class carries its wire ``code`` and ``http_status`` as class attributes; the
mapping is written only here. A server turns an error into its answer with
:func:`to_wire` (only the route layer does that); a client turns an answer back into
an error with :func:`from_wire`; every code round-trips to the class it came from.
A subclass defined elsewhere without its own ``code`` travels as its parent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

_BY_CODE: dict[str, type[DeltaSyncError]] = {}


class DeltaSyncError(Exception):
    """Root of every error deltasync raises on purpose."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    #: the HTTP status of the answer this error was parsed from (``from_wire``); None when raised here
    status: int | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("code")
        if own is not None:
            if own in _BY_CODE:
                raise TypeError(f"error code {own!r} of {cls.__qualname__} is already {_BY_CODE[own].__qualname__}'s")
            _BY_CODE[own] = cls

    # -- wire form (see to_wire / from_wire) ------------------------------------------------
    def wire_extra(self) -> dict[str, Any]:
        """Members of the JSON error object besides status, code and message."""
        return {}

    def wire_headers(self) -> dict[str, str]:
        """Response headers the answer carries."""
        return {}

    @classmethod
    def from_wire(cls, message: str, *, extra: Mapping[str, Any], headers: Mapping[str, str]) -> DeltaSyncError:
        """The error a parsed answer stands for (subclasses with more fields override this)."""
        return cls(message)


_BY_CODE[DeltaSyncError.code] = DeltaSyncError


class FormatError(DeltaSyncError):
    """Input bytes or JSON do not follow the format spec (docs/FORMAT.md)."""

    code = "format"
    http_status = 400


class UnsupportedError(FormatError):
    """Well-formed input that uses a format version, dtype or feature we do not support."""

    code = "unsupported"


class IntegrityError(DeltaSyncError):
    """Content does not match the hash or fingerprint it was promised to have."""

    code = "integrity"
    http_status = 422


class BaseMismatchError(IntegrityError):
    """A delta was offered to a state other than the one it was encoded against."""

    code = "base_mismatch"
    http_status = 409


class SignatureError(IntegrityError):
    """A manifest's signature is missing or does not verify with the given key."""

    code = "signature"
    http_status = 403


class ChainError(DeltaSyncError):
    """Versions that do not form a chain: a gap, a wrong parent, a wrong order."""

    code = "chain"
    http_status = 409


class MissingBlobsError(DeltaSyncError):
    """A manifest names blobs the origin has not received: upload them (``missing``), then the manifest."""

    code = "missing_blobs"
    http_status = 409

    def __init__(self, message: str, *, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing

    def wire_extra(self) -> dict[str, Any]:
        return {"missing": list(self.missing)}

    @classmethod
    def from_wire(cls, message: str, *, extra: Mapping[str, Any], headers: Mapping[str, str]) -> DeltaSyncError:
        missing = extra.get("missing")
        return cls(message, missing=[str(m) for m in missing] if isinstance(missing, list) else [])


class NotFoundError(DeltaSyncError):
    """A blob, version or tensor that was asked for does not exist."""

    code = "not_found"
    http_status = 404


class AuthError(DeltaSyncError):
    """The server refused our credentials (401, or 403 from a proxy): check the token file."""

    code = "unauthorized"
    http_status = 401

    def wire_headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="deltasync"'}


class ReadOnlyError(DeltaSyncError):
    """A write sent to a relay; relays are read-only, send writes to the origin."""

    code = "read_only"
    http_status = 405

    def wire_headers(self) -> dict[str, str]:
        return {"Allow": "GET, HEAD"}


class RequestTimeoutError(DeltaSyncError):
    """An upload whose body stalled longer than the server's read timeout."""

    code = "request_timeout"
    http_status = 408


class TooLargeError(DeltaSyncError):
    """A body over the server's size limit."""

    code = "too_large"
    http_status = 413


_UNSATISFIED_RANGE = re.compile(r"^bytes \*/(\d+)$")


class RangeError(DeltaSyncError):
    """A ``Range`` that lies outside the blob; ``size`` is the blob's length."""

    code = "range_not_satisfiable"
    http_status = 416

    def __init__(self, message: str, *, size: int) -> None:
        super().__init__(message)
        self.size = size

    def wire_headers(self) -> dict[str, str]:
        return {"Content-Range": f"bytes */{self.size}"}

    @classmethod
    def from_wire(cls, message: str, *, extra: Mapping[str, Any], headers: Mapping[str, str]) -> DeltaSyncError:
        m = _UNSATISFIED_RANGE.match(headers.get("Content-Range", ""))
        return cls(message, size=int(m.group(1)) if m else -1)


class ApplyError(DeltaSyncError):
    """Patching live tensors failed; every tensor touched was restored."""

    code = "apply"
    http_status = 500


class ApplyInterrupted(ApplyError):
    """An apply stopped between two pieces of its work because the process was told to end (SIGTERM/SIGINT) or
    its deadline (``--timeout``) passed: every word written was restored, the target is the version before.
    Raised by the ``check`` callable an apply is given (``deltasync.apply.stage_prepared(check=)``); a caller
    that sees it stops applying (it is not the delta's fault: nothing is refetched)."""

    code = "apply_interrupted"
    http_status = 503


class PublishError(DeltaSyncError):
    """A version failed in the background (encoding, upload or commit). The versions queued after it
    were dropped; the next publish() sends a keyframe so the stream stays consistent."""

    code = "publish"
    http_status = 500


class UpstreamError(DeltaSyncError):
    """No server upstream answered usefully (connection refused, 5xx, bad bytes, on every source).
    Retry later or list more servers."""

    code = "upstream"
    http_status = 502


class UpstreamTimeout(UpstreamError):
    """Waited past a deadline for something from upstream: every source was too slow, or a
    subscriber did not reach the version asked for in time."""

    code = "upstream_timeout"
    http_status = 504


class UnavailableError(DeltaSyncError):
    """The server is shutting down, or cannot take the request now (or lacks the feature)."""

    code = "unavailable"
    http_status = 503


class StorageError(DeltaSyncError):
    """Writing to disk failed (full disk, quota, I/O error); no partial file was left in place."""

    code = "insufficient_storage"
    http_status = 507


# -- wire form ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class WireError:
    """An error as a server answers it: status, headers and the JSON body ``{"error": {...}}``."""

    status: int
    code: str
    message: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)

    def body(self) -> bytes:
        return json.dumps({"error": {"status": self.status, "code": self.code, "message": self.message,
                                     **self.extra}}).encode()


def error_code(err: BaseException) -> str:
    """The wire code of an error (``internal`` for anything outside the tree)."""
    return err.code if isinstance(err, DeltaSyncError) else DeltaSyncError.code


def error_class(code: str) -> type[DeltaSyncError] | None:
    """The class a wire code names, or None for a code this tree does not have."""
    return _BY_CODE.get(code)


def error_classes() -> tuple[type[DeltaSyncError], ...]:
    """Every class that owns a wire code, the root first."""
    return tuple(_BY_CODE.values())


def to_wire(err: DeltaSyncError) -> WireError:
    """How a server answers ``err``."""
    return WireError(status=err.http_status, code=err.code, message=str(err), extra=err.wire_extra(),
                     headers=err.wire_headers())


def _class_for_status(status: int) -> type[DeltaSyncError]:
    """For an answer without a code we know (a proxy, another server): judge by the status alone."""
    if status in (401, 403):
        return AuthError
    if status == 404:
        return NotFoundError
    if status == 504:
        return UpstreamTimeout
    if status >= 500 or status == 429:
        return UpstreamError
    return FormatError  # any other 4xx: the server judged the request itself wrong


def from_wire(status: int, body: bytes | str, headers: Mapping[str, str] | None = None, *,
              where: str = "") -> DeltaSyncError:
    """The error a server's answer stands for: by its JSON error code, else by its status.

    ``where`` (the URL asked) prefixes the message."""
    headers = headers or {}
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    code, message, extra = None, text.strip()[:300], {}
    try:
        obj = json.loads(text)["error"]
        code, message = obj["code"], str(obj["message"])
        extra = {k: v for k, v in obj.items() if k not in ("status", "code", "message")}
    except (ValueError, KeyError, TypeError, RecursionError):  # not our JSON error body (or crafted nesting)
        pass
    cls = error_class(code) if isinstance(code, str) else None
    if cls is None:
        cls = _class_for_status(status)
        message = f"HTTP {status} ({message or 'no body'})"
    err = cls.from_wire(f"{where}: {message}" if where else message, extra=extra, headers=headers)
    err.status = status
    return err
