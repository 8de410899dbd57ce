"""Every torch dtype deltasync moves, and how its bytes are viewed.

The codec works on *words*: unsigned integers of the width the values are
stored in (1, 2, 4 or 8 bytes). Most dtypes have one word per element;
complex dtypes have two (real, imaginary). Wire names are torch's own
(``"bfloat16"``, ``"float8_e4m3fn"``), stable across torch versions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import UnsupportedError


@dataclass(frozen=True, slots=True, kw_only=True)
class DtypeInfo:
    name: str
    torch_dtype: torch.dtype
    element_size: int  # bytes per element
    word_size: int  # bytes per word (1, 2, 4, 8)
    is_float: bool  # IEEE-like sign-magnitude layout (complex components included)

    @property
    def words_per_element(self) -> int:
        return self.element_size // self.word_size


_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _build() -> dict[str, DtypeInfo]:
    table: dict[str, DtypeInfo] = {}
    candidates = [
        ("bool", False), ("uint8", False), ("int8", False), ("int16", False),
        ("uint16", False), ("int32", False), ("uint32", False), ("int64", False),
        ("uint64", False), ("float16", True), ("bfloat16", True), ("float32", True),
        ("float64", True), ("float8_e4m3fn", True), ("float8_e4m3fnuz", True),
        ("float8_e5m2", True), ("float8_e5m2fnuz", True), ("float8_e8m0fnu", True),
        ("float4_e2m1fn_x2", True), ("complex32", True), ("complex64", True),
        ("complex128", True),
    ]
    for name, is_float in candidates:
        dt = getattr(torch, name, None)
        if dt is None:  # older torch
            continue
        size = dt.itemsize
        word = size // 2 if dt.is_complex else size
        table[name] = DtypeInfo(
            name=name, torch_dtype=dt, element_size=size, word_size=word, is_float=is_float
        )
    return table


DTYPES: dict[str, DtypeInfo] = _build()
_BY_TORCH = {info.torch_dtype: info for info in DTYPES.values()}


def dtype_info(dtype: torch.dtype | str) -> DtypeInfo:
    """Look a dtype up by torch dtype or wire name; unknown ones raise UnsupportedError."""
    info = DTYPES.get(dtype) if isinstance(dtype, str) else _BY_TORCH.get(dtype)
    if info is None:
        raise UnsupportedError(
            f"dtype {dtype!r} is not supported; supported: {', '.join(sorted(DTYPES))}"
        )
    return info


def signed_word_dtype(word_size: int) -> torch.dtype:
    """The signed torch integer type of a word width (torch has full op support for these)."""
    return _SIGNED[word_size]


def numpy_word_dtype(word_size: int) -> np.dtype:
    return np.dtype(_NUMPY_UNSIGNED[word_size])


def word_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat signed-integer view of a contiguous tensor's words, sharing its memory."""
    info = dtype_info(tensor.dtype)
    flat = tensor.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # a one-element view of a strided tensor
        flat = flat.as_strided((1,), (1,))
    if tensor.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.numel() == 0:
        return torch.empty(0, dtype=_SIGNED[info.word_size], device=tensor.device)
    return flat.view(torch.uint8).view(_SIGNED[info.word_size])


def word_count(shape: tuple[int, ...] | list[int], info: DtypeInfo) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * info.words_per_element
