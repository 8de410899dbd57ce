"""Whole states as safetensors files on disk: mmap reads, atomic writes.

Exotic dtypes are stored as in keyframe shards (see :mod:`deltasync.keyframe`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import safetensors
import torch

from .deltafile import write_atomic
from .errors import FormatError
from .keyframe import restore_dtype, save_shard


def read_state_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file (read through mmap). Bad files raise FormatError."""
    path = Path(path)
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            out = {}
            for name in f.keys():
                out[name] = restore_dtype(name, f.get_tensor(name), meta, where=f"{path}: ")
            return out
    except FormatError:
        raise
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors' SafetensorError, OSError on unreadable data, ...
        raise FormatError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def write_state_file(path: str | os.PathLike, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write a state atomically (temp file, fsync, rename); returns the file size."""
    data = save_shard(state, metadata)
    write_atomic(path, data)
    return len(data)
