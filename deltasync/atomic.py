"""Atomic file writes: readers see the old file or the new one, never a torn one.

``write_atomic`` writes a temp file (named ``.NAME.<random>.tmp``, beside the target
or in a caller's directory on the same filesystem), fsyncs it, renames it over the
target and fsyncs the directory. Any failure (a full disk, say) removes the temp file
and raises :class:`~deltasync.errors.StorageError`; the previous file is untouched.
A writer killed mid-write leaves its temp file behind; ``remove_temp_files`` clears
those (they are recognised by the name pattern above, and by nothing else).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import StorageError

__all__ = ["fsync_dir", "remove_temp_files", "temp_files", "write_atomic"]

_SUFFIX = ".tmp"


def write_atomic(path: str | os.PathLike, data: bytes | memoryview, *, tmp_dir: str | os.PathLike | None = None,
                 fsync: bool = True) -> None:
    """Write ``data`` to ``path`` all or nothing (see the module docstring). With ``fsync=False`` the
    rename is still atomic, but not durable across a power loss."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_SUFFIX, dir=tmp_dir or path.parent or ".")
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


def temp_files(path: str | os.PathLike) -> list[Path]:
    """Temp files that ``write_atomic(path, ...)`` calls left beside ``path`` (a killed writer's)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}.*{_SUFFIX}"))


def remove_temp_files(path: str | os.PathLike) -> int:
    """Remove what :func:`temp_files` finds; returns how many were removed. Only call this when no
    other process is writing ``path`` (its temp file would vanish under it)."""
    n = 0
    for p in temp_files(path):
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n
