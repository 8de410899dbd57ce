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

Tied weights: tensors of an ``nn.Module`` (or dict) that share memory (``lm_head.weight`` is
``model.embed_tokens.weight``) are recognised by ``TensorApplier``. A stream published from the
whole ``state_dict()`` carries every name (aliases are patched once, their changes must agree);
one published without the tied copy (as ``save_pretrained`` writes checkpoints) leaves a name out:
the first manifest applied (or the signed one of a trusted ``version=``) tells which, and the
left-out name is patched through the name it shares memory with. A name left out that shares
memory with nothing the stream carries is refused before anything is written, naming the fix.

Keyframe rollback: a keyframe copy overwrites every tensor and keeping the old state
would double the target's memory, so ``TensorApplier``'s keyframe ``rollback()`` cannot
restore (it marks nothing; ``LiveState`` treats a failed keyframe as "state unknown"
and resyncs, as the subscriber always has). Delta rollbacks restore every word.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter, methodcaller
from typing import Protocol, runtime_checkable

import torch

from deltasync.apply import (LayoutColumns, PreparedDelta, check_base, find_aliases, host_addresses, layout_lines,
                             live_tensors, stage_prepared)
from deltasync.dtypes import dtype_info
from deltasync.errors import BaseMismatchError
from deltasync.fingerprint import NameIndex, StateLines, tensor_fingerprint
from deltasync.gcpause import gc_paused
from deltasync.keyframe import copy_state
from deltasync.manifest import Manifest, record_names

__all__ = ["Applier", "Staged", "TensorApplier", "as_applier"]


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


#: the tensors' facts a :class:`_Layout` is kept for: identity, address, dtype, shape, strides, on the CPU or not
_FACTS = (id, methodcaller("data_ptr"), attrgetter("dtype"), attrgetter("shape"), methodcaller("stride"),
          attrgetter("is_cpu"))


@dataclass(eq=False)
class _Layout:
    """What a step's checks read of a dict or module target's layout, made once per layout (:meth:`TensorApplier.
    _layout`): ~0.45 s a step at 70,000 tensors when made every step, against ~0.05 s to check it still holds."""

    key: tuple  # the names, then each of _FACTS of every tensor, as lists
    layout: dict[str, tuple[str, tuple[int, ...]]]
    lines: tuple[list[str], StateLines]  # the names sorted and their state fingerprint lines
    columns: LayoutColumns
    disjoint: bool  # no two tensors share memory
    words: tuple | None  # host_addresses in the sorted names' order (None: not every tensor contiguous on the CPU)

    def addresses(self, names: list[str]) -> tuple | None:
        """``stage_prepared(addresses=)``: the named tensors' word addresses, word counts and word sizes."""
        rows = self.columns.names.rows(names) if self.words is not None else None
        return None if rows is None else tuple(a[rows] for a in self.words)


class TensorApplier:
    """A dict of tensors or an ``nn.Module`` (names equal to the stream's), on CPU or GPU:
    ``stage_prepared`` / ``copy_state`` exactly as the subscriber always applied them.

    Tied weights (see the module docstring): ``tied`` maps each name to the other names sharing its
    memory; ``left_out`` holds the tied names the stream does not carry (known once a manifest is seen)."""

    tied: dict[str, frozenset[str]] = {}  # class defaults: subclasses that skip __init__ (FileTarget) have none
    left_out: frozenset[str] = frozenset()
    _kept: _Layout | None = None  # the layout of the last step (see _layout)
    _staged: _Layout | None = None  # the layout stage_delta just checked, for state_lines' next call
    #: called between pieces of a delta's apply (``stage_prepared(check=)``): raising ``ApplyInterrupted`` there
    #: (a signal, a deadline: ``client/interrupt.py``) rolls the apply back; None: never interrupted
    check: Callable[[], None] | None = None

    def __init__(self, target) -> None:
        tensors = live_tensors(target)  # raises TypeError for anything else
        self.target = target
        groups: dict[str, set[str]] = {}
        for alias, primary in find_aliases(tensors).items():
            groups.setdefault(primary, {primary}).add(alias)
        self.tied = {n: frozenset(g - {n}) for g in groups.values() for n in g}
        self.left_out = frozenset()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors the stream carries (a tied name it leaves out is reached through its primary)."""
        tensors = live_tensors(self.target)
        for name in self.left_out:
            tensors.pop(name, None)
        return tensors

    def fit_stream(self, names, *, version: int | str = "?") -> None:
        """Match the stream's tensor names (a manifest's) before anything is written: tied names it leaves
        out are left out here too; anything else that differs raises BaseMismatchError naming the fix."""
        names = set(names)
        have = set(self._names())
        extra = sorted(names - have)
        missing = sorted(have - names)
        untied = [n for n in missing if not (self.tied.get(n, frozenset()) & names)]
        if extra:
            raise BaseMismatchError(
                f"v{version} of the stream has tensors {extra[:5]} the target lacks"
                + (f" (and lacks {untied[:5]})" if untied else "")
                + "; is the target the same model? A target named or shaped unlike the trainer's state_dict() "
                "needs an engine applier (deltasync.client.hf.hf_applier, the vLLM worker extension, "
                "SGLang's loader: docs/ENGINES.md)")
        if untied:
            raise BaseMismatchError(
                f"v{version} of the stream lacks the target's {untied[:5]}, which share memory with no tensor the "
                "stream carries; publish the full state_dict() (tied copies included), or tie them in the target "
                "(e.g. Hugging Face's model.tie_weights()) so they share memory with a tensor the stream carries")
        self.left_out = frozenset(missing)

    def _names(self):
        """The target's tensor names (what :meth:`fit_stream` matches the stream's against)."""
        return live_tensors(self.target)

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in self.tensors().items()}

    def scan(self) -> dict[str, int]:
        return {n: tensor_fingerprint(t) for n, t in self.tensors().items()}

    def needed_blobs(self, manifest: Manifest) -> set[str] | None:
        return None

    def fit_state(self, state_fp: str) -> dict[str, int] | None:
        """Which tied names the stream leaves out, told by a signed state fingerprint (a format-3 delta lists
        only the tensors it changes, so its names cannot tell): each way of keeping all or one name of every
        tied group (at most 64 ways) is tried against one scan. Returns the fingerprints of the names kept
        (``left_out`` set), or None when no way gives ``state_fp``."""
        from itertools import product

        from deltasync.fingerprint import state_fingerprint

        if not self.tied:  # nothing to choose (and a FileTarget's tensors are its file's)
            fps = self.scan()
            layout = self.layout()
            return fps if state_fingerprint((n, *layout[n], fps[n]) for n in layout) == state_fp else None
        have = live_tensors(self.target)
        fps = {n: tensor_fingerprint(t) for n, t in have.items()}
        layout = {n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in have.items()}
        groups = sorted({frozenset({n} | g) for n, g in self.tied.items()}, key=sorted)
        ways = [[frozenset()] + [grp - {keep} for keep in sorted(grp)] for grp in groups]
        for k, choice in enumerate(product(*ways)):
            if k >= 64:
                break
            out = frozenset().union(*choice) if choice else frozenset()
            if state_fingerprint((n, *layout[n], fps[n]) for n in layout if n not in out) == state_fp:
                self.left_out = out
                return {n: v for n, v in fps.items() if n not in out}
        return None

    def _layout(self, tensors: Mapping[str, torch.Tensor]) -> _Layout | None:
        """The layout of ``tensors`` (what :meth:`tensors` gives), kept from the last step while every tensor is the
        same object at the same address with the same dtype, shape and strides (a target whose tensors are replaced
        or reshaped between steps gets its layout made again). None for anything but torch tensors."""
        try:
            vals = list(tensors.values())
            with gc_paused():  # 70k tuples and lists: the collector's passes over them cost more than making them
                key = (list(tensors), *(list(map(f, vals)) for f in _FACTS))
        except (AttributeError, TypeError):
            return None
        kept = self._kept
        if kept is not None and kept.key == key:
            return kept
        infos = {d: dtype_info(d).name for d in set(key[3])}
        layout = dict(zip(key[0], zip(map(infos.__getitem__, key[3]), map(tuple, key[4]))))
        lines = layout_lines(layout)
        words = host_addresses(tensors, lines[0]) if all(key[6]) else None
        columns = LayoutColumns(layout, NameIndex(lines[0]))
        self._kept = made = _Layout(key=key, layout=layout, lines=lines, columns=columns,
                                    disjoint=not find_aliases(tensors), words=words)
        return made

    def state_lines(self) -> tuple[list[str], StateLines] | None:
        """The target's names sorted and their :class:`StateLines` (``LiveState.state_fp`` digests a step's
        fingerprints with them): those of the layout :meth:`stage_delta` just checked, else of the tensors now."""
        made, self._staged = self._staged, None
        if made is None:
            made = self._layout(self.tensors())
        return None if made is None else made.lines

    def stage_delta(self, prepared: PreparedDelta, fps: Mapping[str, int], *, verify: str) -> Staged:
        m = prepared.manifest
        self._staged = None
        if m.format < 3:  # every tensor listed: the stream's names
            self.fit_stream((r.name for r in m.tensors), version=m.version)
        tensors = self.tensors()
        if m.format >= 3:  # only the changed ones: each must be one the stream carries (the state fp checks the rest)
            extra = sorted(n for n in record_names(m) if n not in tensors)  # (a parsed table's names: no record made)
            if extra:
                raise BaseMismatchError(
                    f"v{m.version} of the stream changes {extra[:5]}, which the target lacks (or holds as a tied "
                    "copy the stream left out before); is the target the same model? (docs/ENGINES.md)")
        made = self._layout(tensors)
        if made is None:
            return stage_prepared(tensors, prepared, fps, verify=verify, check=self.check)
        # the checks and addresses of a layout kept from the last step: no torch call per tensor beyond its key
        check_base(m, tensors, fps, layout=made.layout, state_lines=made.lines, layout_columns=made.columns)
        staged = stage_prepared(tensors, prepared, fps, verify=verify, check=self.check, base_checked=True,
                                disjoint=made.disjoint, addresses=made.addresses)
        self._staged = made
        return staged

    def stage_keyframe(self, state: Mapping[str, torch.Tensor], fps: Mapping[str, int], *,
                       version: int | None = None) -> Staged:
        """``version``: named in error messages only (an optional extra over the protocol)."""
        v = "?" if version is None else version
        self.fit_stream(state, version=v)
        return _CopiedKeyframe(copy_state(self.tensors(), dict(state), dict(fps), version=v))


def as_applier(target) -> Applier:
    """``target`` itself when it implements the Applier protocol (duck-typed: has ``stage_delta``),
    else a ``TensorApplier`` over it (a dict of tensors or an nn.Module)."""
    if callable(getattr(target, "stage_delta", None)):
        return target
    return TensorApplier(target)
