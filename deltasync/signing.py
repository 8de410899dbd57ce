"""Signing and verifying manifests: the ``Signer`` / ``Verifier`` seam.

A signature is the text ``ALG:HEX`` (docs/FORMAT.md, "manifest": ``signature``)
over :meth:`deltasync.manifest.Manifest.canonical_bytes`. A publisher holds a
:class:`Signer`; subscribers, relays and offline tools hold a :class:`Verifier`.
They are separate roles even while the only algorithm is symmetric:

* :class:`HmacSigner` / :class:`HmacVerifier`: HMAC-SHA256 with a shared secret
  (``hmac-sha256:<64 hex digits>``). Whoever can verify can also sign.

An asymmetric scheme (a later issue: Ed25519, with key ids in manifests) plugs in
behind the same two protocols; nothing that takes a ``Signer`` or ``Verifier``
changes. ``key_id`` names a key without revealing it, so logs and (later) manifests
can say which key signed.

Callers that hold a raw ``bytes`` key keep working: :func:`as_signer` and
:func:`as_verifier` wrap one into the HMAC pair. Pure: no files, no environment.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Protocol, runtime_checkable

from .errors import FormatError, SignatureError

__all__ = [
    "HMAC_ALG", "HmacSigner", "HmacVerifier", "Signer", "Verifier", "as_signer", "as_verifier", "load_key",
    "signature_alg",
]

HMAC_ALG = "hmac-sha256"
MIN_KEY_BYTES = 16


@runtime_checkable
class Signer(Protocol):
    """Signs bytes; ``sign`` returns the ``ALG:HEX`` text a manifest stores."""

    @property
    def key_id(self) -> str: ...

    def sign(self, data: bytes) -> str: ...


@runtime_checkable
class Verifier(Protocol):
    """Checks a signature over bytes; ``verify`` returns nothing or raises SignatureError."""

    def verify(self, data: bytes, signature: str) -> None: ...


def signature_alg(signature: str) -> str:
    """The algorithm part of an ``ALG:HEX`` signature (``""`` if it has none)."""
    alg, sep, _ = signature.partition(":")
    return alg if sep else ""


def _check_key(key: bytes) -> bytes:
    # any non-empty key is accepted here, as raw keys always were; key files need 16 bytes (load_key)
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"an HMAC key is bytes, not {type(key).__name__}")
    if not key:
        raise FormatError("the HMAC key is empty; use at least 16 random bytes (32 recommended)")
    return bytes(key)


def _key_id(key: bytes) -> str:
    # a domain-separated hash: names the key, reveals nothing usable about it
    return f"{HMAC_ALG}:" + hashlib.sha256(b"deltasync key id\0" + key).hexdigest()[:16]


def _hmac(key: bytes, data: bytes) -> str:
    return f"{HMAC_ALG}:" + hmac.new(key, data, hashlib.sha256).hexdigest()


class HmacSigner:
    """HMAC-SHA256 signer over a shared secret (16 bytes or more; 32 recommended). Thread-safe (immutable)."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes) -> None:
        self._key = _check_key(key)
        self.key_id = _key_id(self._key)

    def sign(self, data: bytes) -> str:
        return _hmac(self._key, data)

    def verifier(self) -> HmacVerifier:
        """The verifier for this key (symmetric: the same secret)."""
        return HmacVerifier(self._key)

    def __repr__(self) -> str:
        return f"HmacSigner(key_id={self.key_id!r})"


class HmacVerifier:
    """Verifies HMAC-SHA256 signatures made with the same shared secret. Thread-safe (immutable)."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes) -> None:
        self._key = _check_key(key)
        self.key_id = _key_id(self._key)

    def verify(self, data: bytes, signature: str) -> None:
        alg = signature_alg(signature)
        if alg != HMAC_ALG:
            raise SignatureError(f"signature uses {alg or 'no algorithm'!r}, this verifier checks {HMAC_ALG} "
                                 "(configure the verifier for the publisher's key)")
        expected = _hmac(self._key, data)
        if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
            raise SignatureError(f"signature does not verify with key {self.key_id} "
                                 "(forged, altered in transit, or signed with another key)")

    def __repr__(self) -> str:
        return f"HmacVerifier(key_id={self.key_id!r})"


def as_signer(key: Signer | bytes | None) -> Signer | None:
    """A Signer from a Signer, a raw HMAC key (bytes), or None."""
    if key is None or isinstance(key, Signer):
        return key
    return HmacSigner(key)


def as_verifier(key: Verifier | bytes | None) -> Verifier | None:
    """A Verifier from a Verifier, a raw HMAC key (bytes), or None. An ``HmacSigner`` passed here
    verifies with its own key (the symmetric case)."""
    if key is None or isinstance(key, (bytes, bytearray)):
        return None if key is None else HmacVerifier(key)
    if isinstance(key, Verifier):
        return key
    if isinstance(key, HmacSigner):
        return key.verifier()
    raise TypeError(f"expected a Verifier or bytes, found {type(key).__name__}")


def load_key(text: str | bytes) -> bytes:
    """A shared HMAC key from a key file's contents: hex (whitespace ignored), at least 16 bytes."""
    try:
        s = text.decode() if isinstance(text, bytes) else text
    except UnicodeDecodeError:  # found by tests/test_fuzz_wire.py
        raise FormatError("key file must hold the signing key as hex digits (found bytes that are not text)") from None
    s = "".join(s.split())
    try:
        key = bytes.fromhex(s)
    except ValueError:
        raise FormatError("key file must hold the signing key as hex digits") from None
    if len(key) < MIN_KEY_BYTES:
        raise FormatError(f"signing key is {len(key)} bytes; use at least {MIN_KEY_BYTES} (32 recommended)")
    return key
