"""Key files turned into a Signer or a Verifier: the one place every command, server and engine extension does it.

* ``--signing-key FILE``: an Ed25519 private key, PEM (PKCS#8). Only the publisher
  (``publish``, ``sidecar``) holds it.
* ``--verify-key FILE`` (repeatable): an Ed25519 public key, PEM. Origin, relays and
  subscribers hold it; several files form a key set (rotation: old + new accepted).
* ``--key-file FILE``: a shared HMAC-SHA256 secret as hex (at least 16 bytes,
  :func:`deltasync.signing.load_key`), only for closed deployments: whoever holds it can
  both verify and sign. It cannot be combined with the public-key options.

Files only (no network); ``deltasync keygen`` (:mod:`deltasync.cli.keys`) writes them with :func:`write_keypair`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .errors import FormatError
from .signing import (HmacSigner, HmacVerifier, KeySet, Signer, Verifier, generate_ed25519_pem, load_key,
                      load_signing_key, load_verify_key)

__all__ = ["read_key_file", "signer_from_file", "signer_from_options", "verifier_from_file", "verifier_from_options",
           "write_keypair"]


def read_key_file(path: str | os.PathLike | None) -> bytes | None:
    """The raw HMAC key in ``path`` (None for no path). A malformed file raises FormatError."""
    return None if not path else load_key(Path(path).read_text())


def signer_from_file(path: str | os.PathLike | None) -> Signer | None:
    key = read_key_file(path)
    return None if key is None else HmacSigner(key)


def verifier_from_file(path: str | os.PathLike | None) -> Verifier | None:
    key = read_key_file(path)
    return None if key is None else HmacVerifier(key)


def _read(path: str | os.PathLike, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise FormatError(f"cannot read the {what} {path}: {e.strerror or e}") from None


def signer_from_options(signing_key: str | os.PathLike | None = None,
                        key_file: str | os.PathLike | None = None) -> Signer | None:
    """The publisher's Signer: Ed25519 from ``--signing-key``, else HMAC from ``--key-file``, else None."""
    if signing_key and key_file:
        raise FormatError("give --signing-key (Ed25519) or --key-file (shared HMAC secret), not both")
    if signing_key:
        try:
            return load_signing_key(_read(signing_key, "signing key"))
        except FormatError as e:
            raise FormatError(f"{signing_key}: {e}") from None
    return signer_from_file(key_file)


def verifier_from_options(verify_keys: Sequence[str | os.PathLike] | None = (),
                          key_file: str | os.PathLike | None = None) -> Verifier | None:
    """A reader's Verifier: the ``--verify-key`` public keys (one: that key; several: a KeySet), else HMAC
    from ``--key-file``, else None (nothing is verified)."""
    verify_keys = list(verify_keys or ())
    if verify_keys and key_file:
        raise FormatError("give --verify-key (Ed25519 public keys) or --key-file (shared HMAC secret), not both: "
                          "an HMAC key next to public keys would let its holders sign")
    if verify_keys:
        vs = []
        for p in verify_keys:
            try:
                vs.append(load_verify_key(_read(p, "verify key")))
            except FormatError as e:
                raise FormatError(f"{p}: {e}") from None
        return vs[0] if len(vs) == 1 else KeySet(vs)
    return verifier_from_file(key_file)


def write_keypair(path: str | os.PathLike, *, force: bool = False) -> tuple[Path, Path, str]:
    """Write a fresh Ed25519 pair: ``path`` (private PEM, 0600) and ``path.pub``; returns (private, public, key id)."""
    private_path = Path(path)
    public_path = private_path.with_name(private_path.name + ".pub")
    for p in (private_path, public_path):
        if p.exists() and not force:
            raise FormatError(f"{p} exists; remove it or pass --force")
    private, public = generate_ed25519_pem()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(private_path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, private)
    finally:
        os.close(fd)
    public_path.write_bytes(public)
    return private_path, public_path, load_verify_key(public).key_id
