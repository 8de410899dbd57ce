"""Self-contained delta files: a manifest and its blobs in one file.

Layout (docs/FORMAT.md, "delta file")::

    magic    8 bytes  b"DSYNCDLT"
    version  u32 LE   1
    reserved u32 LE   0
    mlen     u64 LE   length of the manifest JSON
    manifest mlen bytes (canonical manifest JSON, signature included if any)
    blobs    each blob of manifest.blobs, in order, back to back (sizes from the manifest)

Readers verify every blob's hash and that nothing trails the last blob; with a
verifier (or a raw HMAC key) also the manifest's signature. Writes are atomic
(:mod:`deltasync.atomic`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .atomic import fsync_dir, write_atomic  # re-exported: their old import path (server/storage/store.py uses it)
from .blob import verify_blob
from .errors import FormatError, IntegrityError
from .manifest import Manifest, parse_manifest
from .signing import Verifier

__all__ = ["DeltaFile", "MAGIC", "VERSION", "fsync_dir", "pack_delta_file", "read_delta_file", "unpack_delta_file",
           "write_atomic", "write_delta_file"]

MAGIC = b"DSYNCDLT"
VERSION = 1
_PREFIX = struct.Struct("<8sIIQ")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaFile:
    manifest: Manifest
    blobs: dict[str, bytes]


def pack_delta_file(manifest: Manifest, blobs: Mapping[str, bytes]) -> bytes:
    mj = manifest.to_json()
    parts = [_PREFIX.pack(MAGIC, VERSION, 0, len(mj)), mj]
    for ref in manifest.blobs:
        data = blobs[ref.id]
        if len(data) != ref.size:
            raise IntegrityError(f"blob {ref.id} is {len(data)} bytes, manifest says {ref.size}")
        parts.append(data)
    return b"".join(parts)


def unpack_delta_file(data: bytes | memoryview, *, verifier: Verifier | bytes | None = None) -> DeltaFile:
    """A delta file's manifest and blobs, everything checked (the signature too, with ``verifier``)."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise FormatError(f"file of {len(view)} bytes is too short to be a delta file")
    magic, version, reserved, mlen = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise FormatError(f"not a deltasync delta file (magic {bytes(magic)!r})")
    if version != VERSION:
        raise FormatError(f"delta file version {version} is not supported (this build reads {VERSION})")
    if reserved != 0:
        raise FormatError(f"delta file: reserved field is {reserved}, must be 0")
    if _PREFIX.size + mlen > len(view):
        raise FormatError("delta file is truncated inside its manifest")
    manifest = parse_manifest(bytes(view[_PREFIX.size : _PREFIX.size + mlen]), verifier=verifier)
    at = _PREFIX.size + mlen
    blobs = {}
    for ref in manifest.blobs:
        if at + ref.size > len(view):
            raise FormatError(f"delta file is truncated inside blob {ref.id}")
        chunk = bytes(view[at : at + ref.size])
        try:
            verify_blob(ref.id, chunk)
        except IntegrityError as e:
            raise FormatError(f"delta file is corrupt: {e}") from None
        blobs[ref.id] = chunk
        at += ref.size
    if at != len(view):
        raise FormatError(f"delta file has {len(view) - at} trailing bytes")
    return DeltaFile(manifest=manifest, blobs=blobs)


def read_delta_file(path: str | os.PathLike, *, verifier: Verifier | bytes | None = None) -> DeltaFile:
    return unpack_delta_file(Path(path).read_bytes(), verifier=verifier)


def write_delta_file(path: str | os.PathLike, manifest: Manifest, blobs: Mapping[str, bytes]) -> int:
    data = pack_delta_file(manifest, blobs)
    write_atomic(path, data)
    return len(data)
