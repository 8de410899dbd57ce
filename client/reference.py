"""The publisher's reference copy of the last published state.

``deltasync.codec.encode_delta`` diffs and encodes in one call. A trainer cannot wait
for the encoding, so the publisher splits it with the core's two halves:

1. :meth:`Reference.diff_and_update` (on the trainer's thread): ``diff_states(...,
   update_old=True)`` compares the new state with the reference chunk by chunk **on the
   tensors' own device** (GPU compare + nonzero; only the sparse positions and their
   old/new words reach the host), takes the fingerprint change of each chunk, and writes
   the changed words into the reference in place. No allocation proportional to the
   model per step: the reference is allocated once (first publish, or a layout change)
   and patched.
2. ``deltasync.codec.encode_diff`` (any thread, later): the host-side ``StateDiff`` to
   the same manifest and blobs ``encode_delta`` would have produced, byte for byte.

A budgeted stream (:mod:`deltasync.budget`) keeps the *served view* here instead of the
last trainer state: :meth:`Reference.diff` takes the whole residual without touching the
reference, and :meth:`Reference.patch` writes only the part a delta shipped.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from deltasync.codec import StateDiff, diff_states, encode_diff, state_layout
from deltasync.dtypes import word_view
from deltasync.fingerprint import tensor_fingerprint

__all__ = ["Reference", "StateDiff", "encode_diff", "state_layout"]


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
        """``state`` has the reference's names, dtypes, shapes and devices (one pass, no layout built: a
        70k-tensor state is checked at every publish). The answer is kept for the very ``state`` mapping until
        :meth:`diff_and_update` / :meth:`diff` take it (the publisher asks, then diffs)."""
        if len(state) != len(self.tensors):
            return False
        try:
            ok = all([(u := state[n]).dtype == t.dtype and u.shape == t.shape and u.device == t.device
                      for n, t in self.tensors.items()])
        except KeyError:
            return False
        self._checked = state if ok else None
        return ok

    def _layout_ok(self, state: Mapping[str, torch.Tensor]) -> bool:
        checked, self._checked = getattr(self, "_checked", None), None
        return checked is state or self.same_layout(state)

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
        if not self._layout_ok(state):
            raise ValueError("layout changed; reset() the reference and publish a keyframe")
        diff = diff_states(self.tensors, state, base_fps=self.fps, chunk_words=chunk_words, update_old=True)
        self.fps = dict(diff.fps_after)
        return diff

    def diff(self, state: Mapping[str, torch.Tensor], *, chunk_words: int) -> StateDiff:
        """Diff ``state`` against the reference and leave the reference as it is (budgeted streams)."""
        if not self._layout_ok(state):
            raise ValueError("layout changed; reset() the reference and publish a keyframe")
        return diff_states(self.tensors, state, base_fps=self.fps, chunk_words=chunk_words, update_old=False)

    def patch(self, sent: StateDiff) -> None:
        """Write the new words of ``sent`` (a diff taken from this reference) into it, on its device;
        its fingerprints become ``sent.fps_after``."""
        with torch.no_grad():
            for name, chunks in sent.chunks.items():
                words = word_view(self.tensors[name])
                for c in chunks:
                    pos = torch.from_numpy(c.positions).to(words.device)
                    new = np.ascontiguousarray(c.new).view(np.dtype(f"i{c.new.dtype.itemsize}"))
                    words.index_copy_(0, pos, torch.from_numpy(new).to(words.device))
        self.fps = dict(sent.fps_after)
