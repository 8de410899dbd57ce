"""Signing and verifying manifests: the ``Signer`` / ``Verifier`` seam.

A signature is the text ``ALG:HEX`` (docs/FORMAT.md, "manifest": ``signature``)
over :meth:`deltasync.manifest.Manifest.canonical_bytes`. A publisher holds a
:class:`Signer`; subscribers, relays and offline tools hold a :class:`Verifier`.
Two algorithms sit behind the same two protocols:

* :class:`Ed25519Signer` / :class:`Ed25519Verifier` (the default, via the
  ``cryptography`` package): the publisher alone holds the private key; origin,
  relays and subscribers hold only the public key (``ed25519:<128 hex digits>``).
  Whoever can verify can NOT sign. Key id: ``ed25519:`` + the first 8 bytes of
  SHA-256 of the raw 32-byte public key, hex.
* :class:`HmacSigner` / :class:`HmacVerifier`: HMAC-SHA256 with a shared secret
  (``hmac-sha256:<64 hex digits>``), kept only for closed deployments where every
  key holder is trusted: whoever can verify can also sign.

:class:`KeySet` is a verifier over several accepted keys (rotation: old + new
accepted; a key removed from the set is refused). ``key_id`` names a key without
revealing anything secret; manifests carry it (docs/FORMAT.md §5) so a verifier
picks the right key and says which one it lacks. PEM files: :func:`load_signing_key`,
:func:`load_verify_key`, :func:`generate_ed25519_pem`.

Callers that hold a raw ``bytes`` key keep working: :func:`as_signer` and
:func:`as_verifier` wrap one into the HMAC pair. Pure: no files, no environment.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Protocol, runtime_checkable

from .errors import FormatError, SignatureError

__all__ = [
    "ED25519_ALG", "Ed25519Signer", "Ed25519Verifier", "HMAC_ALG", "HmacSigner", "HmacVerifier", "KeySet", "Signer",
    "Verifier", "as_signer", "as_verifier", "generate_ed25519_pem", "is_public_key", "load_key", "load_signing_key",
    "load_verify_key", "signature_alg",
]

HMAC_ALG = "hmac-sha256"
ED25519_ALG = "ed25519"
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
    if isinstance(key, (HmacSigner, Ed25519Signer)):
        return key.verifier()
    raise TypeError(f"expected a Verifier or bytes, found {type(key).__name__}")


def load_key(text: str | bytes) -> bytes:
    """A shared HMAC key from a key file's contents: hex (whitespace ignored), at least 16 bytes."""
    try:
        s = text.decode() if isinstance(text, bytes) else text
    except UnicodeDecodeError:  # found by tests/system/test_fuzz_wire.py
        raise FormatError("key file must hold the signing key as hex digits (found bytes that are not text)") from None
    s = "".join(s.split())
    try:
        key = bytes.fromhex(s)
    except ValueError:
        raise FormatError("key file must hold the signing key as hex digits") from None
    if len(key) < MIN_KEY_BYTES:
        raise FormatError(f"signing key is {len(key)} bytes; use at least {MIN_KEY_BYTES} (32 recommended)")
    return key


# -- Ed25519 (public keys) ------------------------------------------------------------------------------

def _ed25519_key_id(raw_public: bytes) -> str:
    return f"{ED25519_ALG}:" + hashlib.sha256(raw_public).hexdigest()[:16]


def _raw_public(public_key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class Ed25519Signer:
    """Signs with an Ed25519 private key (only the publisher holds it). Thread-safe (immutable)."""

    __slots__ = ("_key", "key_id")

    def __init__(self, private_key) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        if not isinstance(private_key, Ed25519PrivateKey):
            raise TypeError(f"expected an Ed25519PrivateKey, found {type(private_key).__name__}")
        self._key = private_key
        self.key_id = _ed25519_key_id(_raw_public(private_key.public_key()))

    @classmethod
    def generate(cls) -> Ed25519Signer:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> str:
        return f"{ED25519_ALG}:" + self._key.sign(data).hex()

    def verifier(self) -> Ed25519Verifier:
        """The verifier for this key's public half."""
        return Ed25519Verifier(self._key.public_key())

    def public_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization
        return self._key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)

    def __repr__(self) -> str:
        return f"Ed25519Signer(key_id={self.key_id!r})"


class Ed25519Verifier:
    """Verifies Ed25519 signatures with a public key (it cannot sign). Thread-safe (immutable)."""

    __slots__ = ("_key", "key_id")

    def __init__(self, public_key) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        if isinstance(public_key, (bytes, bytearray)):
            if len(public_key) != 32:
                raise FormatError(f"a raw Ed25519 public key is 32 bytes, found {len(public_key)}")
            public_key = Ed25519PublicKey.from_public_bytes(bytes(public_key))
        if not isinstance(public_key, Ed25519PublicKey):
            raise TypeError(f"expected an Ed25519PublicKey, found {type(public_key).__name__}")
        self._key = public_key
        self.key_id = _ed25519_key_id(_raw_public(public_key))

    @property
    def key_ids(self) -> frozenset[str]:
        return frozenset((self.key_id,))

    def verify(self, data: bytes, signature: str) -> None:
        from cryptography.exceptions import InvalidSignature
        alg, _, hexsig = signature.partition(":")
        if alg != ED25519_ALG:
            raise SignatureError(f"signature uses {alg or 'no algorithm'!r}, this verifier checks {ED25519_ALG} "
                                 "(configure the publisher's public key: --verify-key)")
        try:
            raw = bytes.fromhex(hexsig)
        except ValueError:
            raise SignatureError("ed25519 signature is not hex") from None
        if len(raw) != 64:
            raise SignatureError(f"an ed25519 signature is 64 bytes, found {len(raw)}")
        try:
            self._key.verify(raw, data)
        except InvalidSignature:
            raise SignatureError(f"signature does not verify with key {self.key_id} "
                                 "(forged, altered in transit, or signed with another key)") from None

    def __repr__(self) -> str:
        return f"Ed25519Verifier(key_id={self.key_id!r})"


class KeySet:
    """A verifier over several accepted keys (rotation). ``verify`` accepts a signature any member accepts;
    ``verify_as(key_id, ...)`` checks with the member of that id only (manifests name their key)."""

    __slots__ = ("_members",)

    def __init__(self, verifiers) -> None:
        members: dict[str, Verifier] = {}
        for v in verifiers:
            v = as_verifier(v)
            kid = getattr(v, "key_id", None)
            if not isinstance(kid, str):
                raise TypeError(f"a KeySet member needs a key_id, {type(v).__name__} has none")
            members.setdefault(kid, v)
        if not members:
            raise FormatError("a key set needs at least one key")
        self._members = members

    @property
    def key_ids(self) -> frozenset[str]:
        return frozenset(self._members)

    @property
    def key_id(self) -> str:
        return ",".join(sorted(self._members))

    def verify_as(self, key_id: str, data: bytes, signature: str) -> None:
        v = self._members.get(key_id)
        if v is None:
            raise SignatureError(f"signed with key {key_id}, which is not among the accepted keys "
                                 f"{sorted(self._members)} (a removed key, or another publisher)")
        v.verify(data, signature)

    def verify(self, data: bytes, signature: str) -> None:
        errors = []
        for v in self._members.values():
            try:
                v.verify(data, signature)
                return
            except SignatureError as e:
                errors.append(str(e))
        raise SignatureError(f"signature does not verify with any accepted key {sorted(self._members)}")

    def __repr__(self) -> str:
        return f"KeySet({sorted(self._members)!r})"


def is_public_key(verifier: object) -> bool:
    """Whether ``verifier`` checks only public-key signatures (its holders cannot sign)."""
    if isinstance(verifier, Ed25519Verifier):
        return True
    if isinstance(verifier, KeySet):
        return all(is_public_key(v) for v in verifier._members.values())
    return False


def load_signing_key(pem: bytes | str) -> Ed25519Signer:
    """An Ed25519 signer from a PEM private key (PKCS#8, unencrypted); anything else raises FormatError."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    data = pem.encode() if isinstance(pem, str) else bytes(pem)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise FormatError(f"signing key is not an unencrypted PEM private key ({e}); "
                          "make one with `deltasync keygen`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise FormatError(f"signing key is a {type(key).__name__}, expected Ed25519 (`deltasync keygen`)")
    return Ed25519Signer(key)


def load_verify_key(pem: bytes | str) -> Ed25519Verifier:
    """An Ed25519 verifier from a PEM public key; a private key file is refused (hand out the public half)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    data = pem.encode() if isinstance(pem, str) else bytes(pem)
    if b"PRIVATE KEY" in data:
        raise FormatError("verify key file holds a PRIVATE key; give verifiers the public key file "
                          "(`deltasync keygen` writes NAME.pub)")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise FormatError(f"verify key is not a PEM public key ({e}); make one with `deltasync keygen`") from None
    if not isinstance(key, Ed25519PublicKey):
        raise FormatError(f"verify key is a {type(key).__name__}, expected Ed25519 (`deltasync keygen`)")
    return Ed25519Verifier(key)


def generate_ed25519_pem() -> tuple[bytes, bytes]:
    """A fresh Ed25519 pair as (private PEM, public PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public
