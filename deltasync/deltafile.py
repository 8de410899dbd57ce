"""Self-contained delta files (manifest + blobs in one file) and atomic file writes.

Layout (docs/FORMAT.md, "delta file")::

    magic    8 bytes  b"DSYNCDLT"
    version  u32 LE   1
    reserved u32 LE   0
    mlen     u64 LE   length of the manifest JSON
    manifest mlen bytes (canonical manifest JSON, signature included if any)
    blobs    each blob of manifest.blobs, in order, back to back (sizes from the manifest)

Readers verify every blob's hash and that nothing trails the last blob.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .blob import verify_blob
from .errors import FormatError, IntegrityError, StorageError
from .manifest import Manifest, parse_manifest

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


def unpack_delta_file(data: bytes | memoryview, *, key: bytes | None = None) -> DeltaFile:
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
    manifest = parse_manifest(bytes(view[_PREFIX.size : _PREFIX.size + mlen]), key=key)
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


def read_delta_file(path: str | os.PathLike, *, key: bytes | None = None) -> DeltaFile:
    return unpack_delta_file(Path(path).read_bytes(), key=key)


def write_atomic(path: str | os.PathLike, data: bytes | memoryview, *, tmp_dir: str | os.PathLike | None = None,
                 fsync: bool = True) -> None:
    """Write to a temp file (beside ``path``, or in ``tmp_dir`` on the same filesystem), fsync, rename:
    readers see all or nothing. Any failure (a full disk, say) removes the temp file and raises
    StorageError; the previous file, if any, is untouched."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=tmp_dir or path.parent or ".")
    except OSError as e:
        raise StorageError(f"cannot write {path}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise StorageError(f"writing {path} failed ({e.strerror or e}); the previous file, if any, is untouched") from e
        raise
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable (best effort where directories cannot be opened)."""
    try:
        dfd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def write_delta_file(path: str | os.PathLike, manifest: Manifest, blobs: Mapping[str, bytes]) -> int:
    data = pack_delta_file(manifest, blobs)
    write_atomic(path, data)
    return len(data)
