"""Helpers shared by the core tests: exact byte/word views of tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltasync import kernels
from deltasync.dtypes import dtype_info

#: unsigned numpy word type per word size
WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@pytest.fixture(autouse=True)
def restore_kernels():
    """Import into a test module that switches ``kernels.select``: the selection is "auto" again after each test."""
    yield
    kernels.select("auto")


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.numel() == 0:
        return b""
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8).numpy().tobytes()


def words_of(t: torch.Tensor) -> np.ndarray:
    return np.frombuffer(tensor_bytes(t), dtype=f"<u{dtype_info(t.dtype).word_size}").copy()


def from_words(words: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    raw = np.ascontiguousarray(words).view(np.uint8)
    if raw.size == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(tuple(shape))


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same tensor names, and every tensor bit for bit equal (2-byte dtypes: bf16/fp16 states)."""
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)
