"""The Applier seam: the one place that knows a target's layout (which tensors, where, how to patch them).

::

    Subscriber(urls, model, target)              # a dict of tensors / nn.Module: wrapped in TensorApplier
    Subscriber(urls, model, ShardedApplier(...)) # anything with ``stage_delta`` is used as it is

``LiveState`` (``deltasync.client.livestate``) owns the version and fingerprints and
calls an applier's ``stage_*``; it checks the state fingerprint of
``(layout(), staged.fps)`` against the *signed* manifest's ``state_fp``, then calls
``commit()`` or ``rollback()``.

Subsets of blobs: the driver asks ``needed_blobs(manifest)`` before downloading a
delta's blobs and decodes with ``prepare_delta(manifest, blobs, only=ids)``, so a
target that holds part of the model fetches and decodes only its part (tensors with no
chunk in those blobs are left out, listed in ``PreparedDelta.skipped``). Keyframes are
always fetched whole (``load_keyframe`` checks every tensor); a sharded applier's
``stage_keyframe`` copies its own slices out of the host state.

Keyframe rollback: a keyframe copy overwrites every tensor and keeping the old state
would double the target's memory, so ``TensorApplier``'s keyframe ``rollback()`` cannot
restore (it marks nothing; ``LiveState`` treats a failed keyframe as "state unknown"
and resyncs, as the subscriber always has). Delta rollbacks restore every word.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from deltasync.apply import PreparedDelta, live_tensors, stage_prepared
from deltasync.dtypes import dtype_info
from deltasync.fingerprint import tensor_fingerprint
from deltasync.keyframe import copy_state
from deltasync.manifest import Manifest


@runtime_checkable
class Staged(Protocol):
    """A change already written into the live tensors, verified locally, not yet final."""

    fps: dict[str, int]  # stream-level fingerprints after the change, by stream (trainer) names

    def commit(self) -> None: ...  # drop the undo log

    def rollback(self) -> None: ...  # restore every word written; idempotent


@runtime_checkable
class Applier(Protocol):
    """The one place that knows a target's layout."""

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]: ...

    def scan(self) -> dict[str, int]: ...

    def needed_blobs(self, manifest: Manifest) -> set[str] | None: ...

    def stage_delta(self, prepared: PreparedDelta, fps: Mapping[str, int], *, verify: str) -> Staged: ...

    def stage_keyframe(self, state: Mapping[str, torch.Tensor], fps: Mapping[str, int]) -> Staged: ...


class _CopiedKeyframe:
    """A keyframe copied in; there is no undo log (see the module docstring)."""

    __slots__ = ("fps",)

    def __init__(self, fps: dict[str, int]) -> None:
        self.fps = fps

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass  # cannot restore a whole-state copy; the caller resyncs


class TensorApplier:
    """A dict of tensors or an ``nn.Module`` (names equal to the stream's), on CPU or GPU:
    ``stage_prepared`` / ``copy_state`` exactly as the subscriber always applied them."""

    def __init__(self, target) -> None:
        live_tensors(target)  # raises TypeError for anything else
        self.target = target

    def tensors(self) -> dict[str, torch.Tensor]:
        return live_tensors(self.target)

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in self.tensors().items()}

    def scan(self) -> dict[str, int]:
        return {n: tensor_fingerprint(t) for n, t in self.tensors().items()}

    def needed_blobs(self, manifest: Manifest) -> set[str] | None:
        return None

    def stage_delta(self, prepared: PreparedDelta, fps: Mapping[str, int], *, verify: str) -> Staged:
        return stage_prepared(self.target, prepared, fps, verify=verify)

    def stage_keyframe(self, state: Mapping[str, torch.Tensor], fps: Mapping[str, int], *,
                       version: int | None = None) -> Staged:
        """``version``: named in error messages only (an optional extra over the protocol)."""
        return _CopiedKeyframe(copy_state(self.tensors(), dict(state), dict(fps),
                                          version="?" if version is None else version))


def as_applier(target) -> Applier:
    """``target`` itself when it implements the Applier protocol (duck-typed: has ``stage_delta``),
    else a ``TensorApplier`` over it (a dict of tensors or an nn.Module)."""
    if callable(getattr(target, "stage_delta", None)):
        return target
    return TensorApplier(target)
