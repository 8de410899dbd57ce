"""Every torch dtype deltasync moves, and how its bytes are viewed.

The codec works on *words*: unsigned integers of the width the values are
stored in (1, 2, 4 or 8 bytes). Most dtypes have one word per element;
complex dtypes have two (real, imaginary). Wire names are torch's own
(``"bfloat16"``, ``"float8_e4m3fn"``), stable across torch versions.

The table itself needs no torch, so code that only reads manifests (the servers)
does not import it; the torch views below import it when first used.

:class:`HostTensor` is a tensor as host words without torch (numpy over a mapped file:
``MappedTensorFile.host``): the codec and the fingerprints take it wherever they take a CPU
tensor, so ``deltasync publish`` from files never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import UnsupportedError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class DtypeInfo:
    name: str
    element_size: int  # bytes per element
    word_size: int  # bytes per word (1, 2, 4, 8)
    is_float: bool  # IEEE-like sign-magnitude layout (complex components included)

    @property
    def words_per_element(self) -> int:
        return self.element_size // self.word_size

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dt = getattr(torch, self.name, None)
        if not isinstance(dt, torch.dtype):
            raise UnsupportedError(f"dtype {self.name!r} is not available in torch {torch.__version__}")
        return dt


# name: (element size, word size, float-like)
_SPECS: dict[str, tuple[int, int, bool]] = {
    "bool": (1, 1, False), "uint8": (1, 1, False), "int8": (1, 1, False),
    "int16": (2, 2, False), "uint16": (2, 2, False), "int32": (4, 4, False), "uint32": (4, 4, False),
    "int64": (8, 8, False), "uint64": (8, 8, False),
    "float16": (2, 2, True), "bfloat16": (2, 2, True), "float32": (4, 4, True), "float64": (8, 8, True),
    "float8_e4m3fn": (1, 1, True), "float8_e4m3fnuz": (1, 1, True), "float8_e5m2": (1, 1, True),
    "float8_e5m2fnuz": (1, 1, True), "float8_e8m0fnu": (1, 1, True), "float4_e2m1fn_x2": (1, 1, True),
    "complex32": (4, 2, True), "complex64": (8, 4, True), "complex128": (16, 8, True),
}

DTYPES: dict[str, DtypeInfo] = {
    name: DtypeInfo(name=name, element_size=size, word_size=word, is_float=is_float)
    for name, (size, word, is_float) in _SPECS.items()
}
_SIGNED_NAMES = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
_NUMPY_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


_LOOKUPS: dict[Any, DtypeInfo] = {}  # torch dtype or name -> info, as asked (a state of 70k tensors asks ~1M times)


def dtype_info(dtype: Any) -> DtypeInfo:
    """Look a dtype up by torch dtype or wire name; unknown ones raise UnsupportedError."""
    try:
        return _LOOKUPS[dtype]
    except (KeyError, TypeError):
        pass
    info = _dtype_info(dtype)
    try:
        _LOOKUPS[dtype] = info
    except TypeError:
        pass
    return info


def _dtype_info(dtype: Any) -> DtypeInfo:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    info = DTYPES.get(name)
    if info is None:
        raise UnsupportedError(
            f"dtype {dtype!r} is not supported; supported: {', '.join(sorted(DTYPES))}"
        )
    return info


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class HostTensor:
    """A tensor as flat unsigned host words (``numpy_word_dtype(word_size)``), row-major, little-endian:
    what the codec reads of a CPU tensor, without torch. ``dtype`` is the deltasync dtype name; the few
    tensor-like methods (``numel``, ``element_size``, ``is_contiguous``) are what shared code asks of one."""

    dtype: str
    shape: tuple[int, ...]
    words: np.ndarray

    def __post_init__(self) -> None:
        info = dtype_info(self.dtype)
        want = word_count(self.shape, info)
        if self.words.ndim != 1 or self.words.size != want or self.words.dtype != numpy_word_dtype(info.word_size):
            raise ValueError(f"HostTensor {self.dtype} {self.shape}: needs {want} words of "
                             f"{numpy_word_dtype(info.word_size)}, found {self.words.size} of {self.words.dtype}")

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def element_size(self) -> int:
        return dtype_info(self.dtype).element_size

    @property
    def nbytes(self) -> int:
        return self.words.nbytes

    def is_contiguous(self) -> bool:
        return True


def host_words(t: Any) -> np.ndarray:
    """The flat unsigned host words of a :class:`HostTensor` or a CPU torch tensor (shared memory for
    a contiguous tensor; a torch tensor elsewhere is copied to the host)."""
    if isinstance(t, HostTensor):
        return t.words
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    words = word_view(t if t.is_contiguous() else t.contiguous())
    return words.numpy().view(numpy_word_dtype(dtype_info(t.dtype).word_size))


def signed_word_dtype(word_size: int) -> torch.dtype:
    """The signed torch integer type of a word width (torch has full op support for these)."""
    import torch

    return getattr(torch, _SIGNED_NAMES[word_size])


_WORD_DTYPES = {w: np.dtype(t) for w, t in _NUMPY_UNSIGNED.items()}


def word_sizes_in(sizes: np.ndarray) -> list[int]:
    """The distinct word sizes of an array of them, ascending: ``np.unique(sizes).tolist()`` for the 1/2/4/8 of
    every dtype by four compares (numpy's hashed unique costs ~7 ms at its first call in a process: in every
    ``publish --base``'s critical path)."""
    got = [w for w in (1, 2, 4, 8) if (sizes == w).any()]
    if sum(int((sizes == w).sum()) for w in got) != sizes.size:
        return np.unique(sizes).tolist()  # (another size: as numpy says)
    return got


def numpy_word_dtype(word_size: int) -> np.dtype:
    return _WORD_DTYPES[word_size]


def word_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat signed-integer view of a contiguous tensor's words, sharing its memory."""
    import torch

    info = dtype_info(tensor.dtype)
    signed = signed_word_dtype(info.word_size)
    flat = tensor.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # a one-element view of a strided tensor
        flat = flat.as_strided((1,), (1,))
    if tensor.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.numel() == 0:
        return torch.empty(0, dtype=signed, device=tensor.device)
    return flat.view(torch.uint8).view(signed)


def word_count(shape: tuple[int, ...] | list[int], info: DtypeInfo) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * info.words_per_element
