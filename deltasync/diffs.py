"""A state diff's types and how tensors are cut into chunks: what :mod:`deltasync.codec` (the per-chunk path) and
:mod:`deltasync.columnar` (the columnar fast path) share, below both (neither imports the other's internals).

``ChunkDiff`` / ``StateDiff`` (a diff in host memory, O(changed)), ``Encoded`` (an unsigned manifest and its blobs),
``tensor_chunk_ranges`` (the chunks, row cells first, a tensor is cut into), the host words of a tensor for the
compare kernels (``_span_words``) and the layout check of two states.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import kernels
from .dtypes import DtypeInfo, HostTensor, host_words, numpy_word_dtype
from .errors import ChainError
from .manifest import Manifest

if TYPE_CHECKING:
    import torch

SHARD_CELLS = 8  # row cells per big tensor: chunk (and blob) boundaries fall on its 1/2, 1/4 and 1/8 row splits
MIN_CELL_WORDS = 1 << 16  # tensors with fewer than SHARD_CELLS * this many words are not split into cells


@dataclass(frozen=True, slots=True, kw_only=True)
class Encoded:
    manifest: Manifest  # unsigned; call .sign(key)
    blobs: dict[str, bytes]
    fps: dict[str, int] = field(default_factory=dict)  # fingerprints of the target state


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkDiff:
    """Changed words of one chunk [start, stop) of a tensor, on the host."""

    start: int
    stop: int
    positions: np.ndarray  # int64, absolute word positions, sorted
    old: np.ndarray  # unsigned words before
    new: np.ndarray  # unsigned words after


@dataclass(frozen=True, slots=True, kw_only=True)
class StateDiff:
    """Everything :func:`encode_diff` needs, in host memory O(changed words)."""

    layout: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype name, shape)
    chunks: Mapping[str, list[ChunkDiff]]  # a dict, or built on first use from ``flat``
    fps_before: dict[str, int]
    fps_after: dict[str, int]
    flat: object | None = None  # the same changes as columns (a deltasync.columnar.FlatDiff), where diff_states made them

    @property
    def changed(self) -> int:
        return sum(c.positions.size for cs in self.chunks.values() for c in cs)

    @property
    def host_bytes(self) -> int:
        return sum(c.positions.nbytes + c.old.nbytes + c.new.nbytes for cs in self.chunks.values() for c in cs)


_WORD_VIEWS: dict = {}  # torch dtype -> (torch integer dtype of its width, numpy unsigned word dtype), one-word dtypes


def _span_words(t, info: DtypeInfo) -> np.ndarray:
    """Host words for :func:`kernels.diff_span`: :func:`host_words`, without ``word_view``'s per-call checks for
    a contiguous CPU tensor of 2+ elements (the Python cost per tensor counts on states of many tensors): a
    one-word dtype is viewed as the integer of its width and handed to numpy as is (two torch calls)."""
    if isinstance(t, HostTensor):
        return t.words
    if t.numel() > 1 and t.is_contiguous():
        if t.requires_grad:
            t = t.detach()
        views = _WORD_VIEWS.get(t.dtype)
        if views is None:
            import torch

            ndt = numpy_word_dtype(info.word_size)
            views = _WORD_VIEWS[t.dtype] = (getattr(torch, f"int{8 * info.word_size}") if info.word_size
                                             == info.element_size and t.dtype != torch.bool else None, ndt)
        if views[0] is not None:
            return t.view(views[0]).numpy().reshape(-1).view(views[1])
        import torch

        return t.reshape(-1).view(torch.uint8).numpy().view(views[1])
    return host_words(t)


def _on_host(t) -> bool:
    return isinstance(t, HostTensor) or kernels.on_host(t.device)


def chunk_ranges(words: int, chunk_words: int) -> Iterator[tuple[int, int]]:
    for s in range(0, words, chunk_words):
        yield s, min(s + chunk_words, words)


def tensor_chunk_ranges(shape: tuple[int, ...], words: int, chunk_words: int) -> list[tuple[int, int]]:
    """The chunks :func:`diff_states` cuts a tensor into.

    A tensor of 2+ dims and at least ``SHARD_CELLS * MIN_CELL_WORDS`` words is first cut into
    ``SHARD_CELLS`` row cells (rows ``[R*k//8, R*(k+1)//8)``): the row splits tensor-parallel engines
    shard on at TP 2, 4 and 8. Each cell is cut into chunks of whole rows (at most ``chunk_words``
    words; plain word chunks when one row is longer). Smaller tensors: plain ``chunk_words`` chunks."""
    rows = shape[0] if shape else 1
    if len(shape) < 2 or rows < 2 or words < SHARD_CELLS * MIN_CELL_WORDS:
        return list(chunk_ranges(words, chunk_words))
    row = words // rows
    cells = min(SHARD_CELLS, rows)
    per = chunk_words // row
    out: list[tuple[int, int]] = []
    for k in range(cells):
        r0, r1 = rows * k // cells, rows * (k + 1) // cells
        if per == 0:
            out.extend((s, min(s + chunk_words, r1 * row)) for s in range(r0 * row, r1 * row, chunk_words))
        else:
            out.extend((a * row, min(a + per, r1) * row) for a in range(r0, r1, per))
    return out


def _cell(shape: tuple[int, ...], words: int, start: int) -> int:
    """Row cell of a chunk starting at word ``start`` (0 for tensors not cut into cells)."""
    rows = shape[0] if shape else 1
    if len(shape) < 2 or rows < 2 or words < SHARD_CELLS * MIN_CELL_WORDS:
        return 0
    cells = min(SHARD_CELLS, rows)
    r = start // (words // rows)
    return max(k for k in range(cells) if rows * k // cells <= r)


def _check_layout(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    if set(old) != set(new):
        added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        raise ChainError(f"tensor set changed (added {added[:5]}, removed {removed[:5]}); publish a keyframe")
    for name, t in new.items():
        o = old[name]
        if o.dtype != t.dtype or tuple(o.shape) != tuple(t.shape):
            raise ChainError(
                f"{name}: layout changed from {o.dtype} {tuple(o.shape)} to {t.dtype} {tuple(t.shape)}; publish a keyframe"
            )
