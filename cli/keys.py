"""``--key-file``: the one place a command turns a key file into a Signer or a Verifier.

A key file holds a shared HMAC-SHA256 secret as hex (at least 16 bytes,
:func:`deltasync.signing.load_key`). Publishing commands sign with it, reading ones
verify. Imports only the core, so the standalone server and client entry points use it
without loading each other.
"""

from __future__ import annotations

import os
from pathlib import Path

from deltasync.signing import HmacSigner, HmacVerifier, Signer, Verifier, load_key

__all__ = ["read_key_file", "signer_from_file", "verifier_from_file"]


def read_key_file(path: str | os.PathLike | None) -> bytes | None:
    """The raw key in ``path`` (None for no path). A malformed file raises FormatError."""
    return None if not path else load_key(Path(path).read_text())


def signer_from_file(path: str | os.PathLike | None) -> Signer | None:
    key = read_key_file(path)
    return None if key is None else HmacSigner(key)


def verifier_from_file(path: str | os.PathLike | None) -> Verifier | None:
    key = read_key_file(path)
    return None if key is None else HmacVerifier(key)
