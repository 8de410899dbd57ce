"""Safetensors checkpoints in a watched folder: which ones are complete, and zero-copy views of them.

A checkpoint is a ``*.safetensors`` file whose name carries its step (the last number
in the name: ``step-000120.safetensors``, ``ckpt_120.safetensors``). It counts only
once complete:

* written under a temporary name and renamed (files whose names start with ``.`` or
  contain ``.tmp``/``.part``/``.partial``/``~`` are ignored), or
* with ``marker=".done"``: once ``NAME.safetensors.done`` exists.

:func:`map_checkpoint` opens a file through ``mmap`` and returns tensors that are views
of the file's pages (nothing is read until compared), after checking the header
against the file's size: a truncated, garbled or unreadable file raises
:class:`CheckpointError` and is never published.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from deltasync.dtypes import dtype_info
from deltasync.errors import FormatError
from deltasync.keyframe import DTYPE_META_PREFIX as _META_PREFIX  # exotic dtypes, as save_shard writes them

_STEP_RE = re.compile(r"(\d+)(?!.*\d)")
_TEMP_MARKS = (".tmp", ".part", ".partial", "~", ".incomplete")
MAX_HEADER = 100 << 20

_ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


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


class MappedCheckpoint:
    """Tensors of a safetensors file as views of its mmap. ``close()`` when done (after the last use)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: {size} bytes, too short for a safetensors header (truncated?)")
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if size else None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot map ({e.strerror})") from None
        finally:
            os.close(fd)
        self.size = size
        try:
            self.tensors, self.metadata = self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        mm = self._mm
        (n,) = struct.unpack_from("<Q", mm, 0)
        if n > MAX_HEADER or 8 + n > self.size:
            raise CheckpointError(f"{self.path}: header of {n} bytes runs past the end of the {self.size}-byte file (truncated?)")
        try:
            header = json.loads(bytes(mm[8 : 8 + n]))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{self.path}: header is not JSON (corrupt or not safetensors)") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise CheckpointError(f"{self.path}: __metadata__ is not an object")
        base = 8 + n
        data_len = self.size - base
        spans = []
        whole = torch.frombuffer(mm, dtype=torch.uint8) if data_len > 0 or n else None
        tensors: dict[str, torch.Tensor] = {}
        for name, e in header.items():
            if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
                raise CheckpointError(f"{self.path}: entry {name!r} is malformed")
            dt = _ST_DTYPES.get(e["dtype"])
            if dt is None:
                raise CheckpointError(f"{self.path}: {name}: dtype {e['dtype']!r} is not supported")
            shape, (b, end) = e["shape"], e["data_offsets"]
            if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
                raise CheckpointError(f"{self.path}: {name}: bad shape {shape!r}")
            numel = 1
            for s in shape:
                numel *= s
            itemsize = torch.empty(0, dtype=dt).element_size()
            if not (isinstance(b, int) and isinstance(end, int) and 0 <= b <= end) or end - b != numel * itemsize:
                raise CheckpointError(f"{self.path}: {name}: data offsets {e['data_offsets']} do not fit {shape} {e['dtype']}")
            if end > data_len:
                raise CheckpointError(f"{self.path}: {name} ends at byte {base + end} but the file has {self.size} (truncated?)")
            spans.append((b, end))
            t = whole[base + b : base + end].view(dt).reshape(shape) if end > b else torch.empty(shape, dtype=dt)
            real = meta.get(_META_PREFIX + name)
            if real is not None:
                info = dtype_info(real)
                if dt != torch.uint8 or not shape or shape[-1] != info.element_size:
                    raise CheckpointError(f"{self.path}: {name} stored as {e['dtype']} {shape}, cannot be {real}")
                t = t.view(info.torch_dtype).reshape(shape[:-1]) if t.numel() else torch.empty(shape[:-1], dtype=info.torch_dtype)
            tensors[name] = t
        spans.sort()
        at = 0
        for b, end in spans:
            if b != at:
                raise CheckpointError(f"{self.path}: tensor data has a hole or overlap at byte {base + b}")
            at = end
        if at != data_len:
            raise CheckpointError(f"{self.path}: {data_len - at} bytes after the last tensor (a torn write?)")
        return tensors, {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, str)}

    def close(self) -> None:
        self.tensors = {}
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view still exists somewhere; the map goes with it
                pass

    def __enter__(self) -> MappedCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def map_checkpoint(path: str | os.PathLike) -> MappedCheckpoint:
    return MappedCheckpoint(path)
