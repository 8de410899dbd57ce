"""Safetensors checkpoints in a watched folder: which ones are complete, and zero-copy views of them.

A checkpoint is a ``*.safetensors`` file whose name carries its step (the last number
in the name: ``step-000120.safetensors``, ``ckpt_120.safetensors``). It counts only
once complete:

* written under a temporary name and renamed (files whose names start with ``.`` or
  contain ``.tmp``/``.part``/``.partial``/``~`` are ignored), or
* with ``marker=".done"``: once ``NAME.safetensors.done`` exists.

:class:`MappedCheckpoint` opens a file through ``mmap`` (:mod:`deltasync.tensorfile`):
its tensors are views of the file's pages (nothing is read until compared), and the
header is checked against the file's size first: a truncated, garbled or unreadable
file raises :class:`CheckpointError` and is never published.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from deltasync.errors import FormatError
from deltasync.tensorfile import MappedTensorFile

__all__ = ["Checkpoint", "CheckpointError", "MappedCheckpoint", "checkpoint_step", "find_checkpoints"]

_STEP_RE = re.compile(r"(\d+)(?!.*\d)")
_TEMP_MARKS = (".tmp", ".part", ".partial", "~", ".incomplete")


class CheckpointError(FormatError):
    """A checkpoint file that cannot be published: truncated, malformed or unreadable. It is skipped."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    step: int
    path: Path
    size: int
    mtime_ns: int

    @property
    def stamp(self) -> tuple[int, int]:
        return self.size, self.mtime_ns


def checkpoint_step(name: str) -> int | None:
    """The step in a checkpoint file name (its last number), or None."""
    if not name.endswith(".safetensors"):
        return None
    m = _STEP_RE.search(name[: -len(".safetensors")])
    return int(m.group(1)) if m else None


def find_checkpoints(folder: str | os.PathLike, *, marker: str | None = None) -> list[Checkpoint]:
    """Complete checkpoints in ``folder``, by step (for equal steps the newest file wins)."""
    out: dict[int, Checkpoint] = {}
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    names = {e.name for e in entries}
    for e in entries:
        name = e.name
        if name.startswith(".") or any(m in name for m in _TEMP_MARKS):
            continue
        step = checkpoint_step(name)
        if step is None:
            continue
        if marker is not None and name + marker not in names:
            continue
        try:
            st = e.stat()
        except FileNotFoundError:
            continue
        if not e.is_file():
            continue
        ck = Checkpoint(step=step, path=Path(e.path), size=st.st_size, mtime_ns=st.st_mtime_ns)
        if step not in out or ck.mtime_ns > out[step].mtime_ns:
            out[step] = ck
    return [out[s] for s in sorted(out)]


class MappedCheckpoint(MappedTensorFile):
    """A checkpoint's tensors as views of its mmap (:class:`deltasync.tensorfile.MappedTensorFile`);
    any problem opening or parsing it is a CheckpointError. ``close()`` when done (after the last use)."""

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            super().__init__(path)
        except FormatError as e:
            raise CheckpointError(str(e)) from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open ({e.strerror or e})") from None

    def __enter__(self) -> MappedCheckpoint:
        return self
