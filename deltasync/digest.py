"""Cryptographic blob digests: what a signed manifest says each blob's bytes hash to.

A blob's id is its xxh3-128 (deltasync.blob): fast, the content address and the
transport check, but not built to resist a party that crafts bytes. A manifest of
format 2 also carries, per blob, ``ALG:HEX`` (docs/FORMAT.md §5.2), covered by the
signature: ``blake3`` (what publishers write: ~3.7× SHA-256 on this project's
machine, see FORMAT.md) or ``sha256`` (read for interoperability). Every party that
holds a verify key checks it before it trusts the bytes: origin on commit, relay
before announcing, subscriber before decoding.

:class:`DigestHasher` is incremental (``update`` / ``hexdigest``) for streamed
uploads; :func:`blob_digest` and :func:`check_digest` are the one-shot forms.
Pure: no files, no threads.
"""

from __future__ import annotations

import hashlib
import re

from .errors import FormatError, IntegrityError

__all__ = ["DEFAULT_DIGEST", "DIGEST_ALGS", "DigestHasher", "blob_digest", "check_digest", "parse_digest"]

DEFAULT_DIGEST = "blake3"
DIGEST_ALGS = ("blake3", "sha256")
_DIGEST_RE = re.compile(r"^(blake3|sha256):([0-9a-f]{64})$")


def _new(alg: str):
    if alg == "sha256":
        return hashlib.sha256()
    if alg == "blake3":
        import blake3  # a dependency; imported on first use so manifest-only code stays light
        return blake3.blake3()
    raise FormatError(f"digest algorithm {alg!r} is not one of {DIGEST_ALGS}")


def parse_digest(text: object) -> tuple[str, str]:
    """(algorithm, hex) of an ``ALG:HEX`` digest; anything else raises FormatError."""
    m = _DIGEST_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise FormatError(f"blob digest must be 'blake3:<64 hex>' or 'sha256:<64 hex>', found {str(text)[:80]!r}")
    return m.group(1), m.group(2)


class DigestHasher:
    """Incremental digest of one algorithm; ``digest()`` gives the ``ALG:HEX`` text. Not thread-safe."""

    __slots__ = ("alg", "_h")

    def __init__(self, alg: str = DEFAULT_DIGEST) -> None:
        self.alg = alg
        self._h = _new(alg)

    def update(self, data) -> None:
        self._h.update(data)

    def digest(self) -> str:
        return f"{self.alg}:{self._h.hexdigest()}"


def blob_digest(data, alg: str = DEFAULT_DIGEST) -> str:
    """The ``ALG:HEX`` digest of a blob's bytes."""
    h = DigestHasher(alg)
    h.update(data)
    return h.digest()


def check_digest(blob_id: str, data, expected: str) -> None:
    """Raise IntegrityError unless ``data`` hashes to ``expected`` (an ``ALG:HEX`` digest from a signed manifest)."""
    alg, _ = parse_digest(expected)
    found = blob_digest(data, alg)
    if found != expected:
        raise IntegrityError(f"blob {blob_id}: bytes hash to {found} but the signed manifest says {expected} "
                             "(crafted or corrupted bytes; fetch it from another source)")
