"""The publisher's reference copy of the last published state, and the diff against it.

``deltasync.codec.encode_delta`` diffs and encodes in one call. A trainer cannot wait
for the encoding, so the publisher splits it:

1. :meth:`Reference.diff_and_update` (on the trainer's thread): compare the new state
   with the reference chunk by chunk **on the tensors' own device** (GPU compare +
   nonzero; only the sparse positions and their old/new words reach the host), take
   the fingerprint change of each chunk, and write the changed words into the
   reference in place. No allocation proportional to the model per step: the
   reference is allocated once (first publish, or a layout change) and patched.
2. :func:`encode_diff` (any thread, later): turn the host-side :class:`StateDiff` into
   the same manifest and blobs ``encode_delta`` would have produced, byte for byte
   (tests check this).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.codec import ChunkPacker, EncodeOptions, Encoded, chunk_ranges
from deltasync.dtypes import dtype_info, numpy_word_dtype, word_view
from deltasync.fingerprint import fingerprint_delta, fp_hex, state_fingerprint, tensor_fingerprint, update_fingerprint
from deltasync.manifest import BlobRef, Manifest, TensorRecord
from deltasync.values import changes_from_words


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkDiff:
    """Changed words of one chunk [start, stop) of a tensor, on the host."""

    start: int
    stop: int
    positions: np.ndarray  # int64, absolute word positions
    old: np.ndarray  # unsigned words before
    new: np.ndarray  # unsigned words after


@dataclass(frozen=True, slots=True, kw_only=True)
class StateDiff:
    """Everything ``encode_diff`` needs; host memory O(changed words)."""

    layout: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype name, shape)
    chunks: dict[str, list[ChunkDiff]]
    fps_before: dict[str, int]
    fps_after: dict[str, int]

    @property
    def changed(self) -> int:
        return sum(c.positions.size for cs in self.chunks.values() for c in cs)

    @property
    def host_bytes(self) -> int:
        return sum(c.positions.nbytes + c.old.nbytes + c.new.nbytes for cs in self.chunks.values() for c in cs)


def state_layout(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in state.items()}


class Reference:
    """A copy of the last published state on the tensors' own device, patched in place per step.

    Not thread-safe: the publisher calls it from the trainer's thread only, and holds
    its encode workers off the tensors while it patches them.
    """

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.tensors: dict[str, torch.Tensor] = {n: t.detach().clone(memory_format=torch.contiguous_format)
                                                     for n, t in sorted(state.items())}
        self.layout = state_layout(self.tensors)
        self.fps: dict[str, int] = {n: tensor_fingerprint(t) for n, t in self.tensors.items()}

    @classmethod
    def adopt(cls, state: Mapping[str, torch.Tensor], fps: Mapping[str, int] | None = None) -> Reference:
        """Take ``state`` as the reference without copying it (the caller hands it over)."""
        self = cls.__new__(cls)
        self.tensors = {n: (t.detach() if t.is_contiguous() else t.detach().contiguous()) for n, t in sorted(state.items())}
        self.layout = state_layout(self.tensors)
        self.fps = dict(fps) if fps is not None else {n: tensor_fingerprint(t) for n, t in self.tensors.items()}
        return self

    def same_layout(self, state: Mapping[str, torch.Tensor]) -> bool:
        return state_layout(state) == self.layout and all(
            state[n].device == t.device for n, t in self.tensors.items())

    def reset(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` into the reference (reusing its memory when the layout is the same)."""
        if not self.same_layout(state):
            self.__init__(state)
            return
        with torch.no_grad():
            for n, t in self.tensors.items():
                t.copy_(state[n])
        self.fps = {n: tensor_fingerprint(t) for n, t in self.tensors.items()}

    def diff_and_update(self, state: Mapping[str, torch.Tensor], *, chunk_words: int) -> StateDiff:
        """Diff ``state`` against the reference, then make the reference equal to ``state``."""
        if not self.same_layout(state):
            raise ValueError("layout changed; reset() the reference and publish a keyframe")
        chunks: dict[str, list[ChunkDiff]] = {}
        before = dict(self.fps)
        with torch.no_grad():
            for name, ref in self.tensors.items():
                new = state[name].detach()
                if not new.is_contiguous():
                    new = new.contiguous()
                info = dtype_info(ref.dtype)
                rw, nw = word_view(ref), word_view(new)
                fp = self.fps[name]
                out = []
                for s, e in chunk_ranges(rw.numel(), chunk_words):
                    cd, fpd = _diff_chunk(rw, nw, s, e, info.word_size)
                    if cd is not None:
                        fp = update_fingerprint(fp, fpd)
                        out.append(cd)
                self.fps[name] = fp
                if out:
                    chunks[name] = out
        return StateDiff(layout=dict(self.layout), chunks=chunks, fps_before=before, fps_after=dict(self.fps))


def _diff_chunk(ref: torch.Tensor, new: torch.Tensor, s: int, e: int, word_size: int) -> tuple[ChunkDiff | None, int]:
    ndt = numpy_word_dtype(word_size)
    if ref.device.type == "cpu":
        o = ref[s:e].numpy()
        n = new[s:e].numpy()
        rel = np.flatnonzero(o != n)
        if rel.size == 0:
            return None, 0
        ow, nw = o[rel], n[rel]  # fancy indexing copies
        pos = rel + s
        fpd = fingerprint_delta(torch.from_numpy(pos), torch.from_numpy(ow), torch.from_numpy(nw), word_size)
        o[rel] = nw  # the reference now holds the new words
        return ChunkDiff(start=s, stop=e, positions=pos, old=ow.view(ndt), new=nw.view(ndt)), fpd
    o = ref[s:e]
    n = new[s:e]
    rel = torch.nonzero(o != n).squeeze(1)
    if rel.numel() == 0:
        return None, 0
    ow, nw = o[rel], n[rel]
    pos = rel + s
    fpd = fingerprint_delta(pos, ow, nw, word_size)
    o.index_copy_(0, rel, nw)
    return ChunkDiff(start=s, stop=e, positions=pos.cpu().numpy(), old=ow.cpu().numpy().view(ndt),
                     new=nw.cpu().numpy().view(ndt)), fpd


def encode_diff(diff: StateDiff, *, model: str, version: int, parent: int, options: EncodeOptions | None = None,
                meta: Mapping[str, str] | None = None) -> Encoded:
    """The delta ``parent → version`` from a :class:`StateDiff`; unsigned. Same bytes as
    ``encode_delta(old, new, ...)`` with the same options."""
    options = options or EncodeOptions()
    packer = ChunkPacker(options)
    names = sorted(diff.layout)
    for name in names:
        dtype, _ = diff.layout[name]
        info = dtype_info(dtype)
        for c in diff.chunks.get(name, ()):
            ch = changes_from_words(c.positions, c.old, c.new, is_float=info.is_float)
            if c.positions.size == c.stop - c.start and ch.raw.mean() > 0.5:  # a rewritten chunk: ship it whole
                packer.add_dense(name, info, c.start, c.stop, c.new)
            else:
                packer.add(name, info, c.start, c.stop, ch)
    packer.close_blob()
    tensors = []
    for name in names:
        dtype, shape = diff.layout[name]
        tensors.append(TensorRecord(
            name=name, dtype=dtype, shape=shape, fp_before=fp_hex(diff.fps_before[name]),
            fp_after=fp_hex(diff.fps_after[name]), changed=sum(c.positions.size for c in diff.chunks.get(name, ())),
            chunks=tuple(packer.refs.get(name, ()))))
    manifest = Manifest(
        model=model, version=version, parent=parent, kind="delta", tensors=tuple(tensors),
        blobs=tuple(BlobRef(id=b, size=len(packer.blobs[b])) for b in packer.order),
        state_fp=state_fingerprint((t.name, t.dtype, t.shape, int(t.fp_after, 16)) for t in tensors),
        state_fp_before=state_fingerprint((t.name, t.dtype, t.shape, int(t.fp_before, 16)) for t in tensors),
        meta=dict(meta or {}),
    )
    return Encoded(manifest=manifest, blobs=packer.blobs, fps=dict(diff.fps_after))
