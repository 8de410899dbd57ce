"""The one exception tree of deltasync.

::

    DeltaSyncError                      root; catch this to catch everything we raise
    ├── FormatError           (400)     bytes or JSON that do not follow docs/FORMAT.md
    │   └── UnsupportedError  (400)     well-formed, but a version/dtype/feature we do not handle
    ├── IntegrityError        (422)     content does not hash/fingerprint to what was promised
    │   ├── BaseMismatchError (409)     a delta offered to a state it was not made from
    │   └── SignatureError    (403)     a manifest whose signature does not verify
    ├── ChainError            (409)     versions that do not link (gap, wrong parent, reorder)
    ├── NotFoundError         (404)     a blob, version or tensor that is not there
    ├── ApplyError            (500)     patching live tensors failed; the state was rolled back
    └── StorageError          (507)     a write failed (disk full, quota, I/O); nothing partial was kept

Every error says what was expected, what was found and what to do. ``http_status``
is the status a server should answer with; only the route layer turns errors into
responses.
"""

from __future__ import annotations


class DeltaSyncError(Exception):
    """Root of every error deltasync raises on purpose."""

    http_status: int = 500


class FormatError(DeltaSyncError):
    """Input bytes or JSON do not follow the format spec (docs/FORMAT.md)."""

    http_status = 400


class UnsupportedError(FormatError):
    """Well-formed input that uses a format version, dtype or feature we do not support."""


class IntegrityError(DeltaSyncError):
    """Content does not match the hash or fingerprint it was promised to have."""

    http_status = 422


class BaseMismatchError(IntegrityError):
    """A delta was offered to a state other than the one it was encoded against."""

    http_status = 409


class SignatureError(IntegrityError):
    """A manifest's signature is missing or does not verify with the given key."""

    http_status = 403


class ChainError(DeltaSyncError):
    """Versions that do not form a chain: a gap, a wrong parent, a wrong order."""

    http_status = 409


class NotFoundError(DeltaSyncError):
    """A blob, version or tensor that was asked for does not exist."""

    http_status = 404


class ApplyError(DeltaSyncError):
    """Patching live tensors failed; every tensor touched was restored."""

    http_status = 500


class StorageError(DeltaSyncError):
    """Writing to disk failed (full disk, quota, I/O error); no partial file was left in place."""

    http_status = 507
