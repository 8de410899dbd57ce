"""Engine adapters: put an inference engine's live parameters under the trainer's names.

**Start here for engines:** :mod:`deltasync.layout` (layout maps from engine facts: vLLM and SGLang
naming of dense and MoE models, TP/EP shards, padded vocab, replicated KV heads, tied weights) and
:class:`deltasync.client.sharded.ShardedApplier` (the Applier seam for one rank of a TP/EP group:
blob selection, O(changed) patching, one vote, all-or-nothing over the group). This module adds
:func:`check_engine_params`, which checks an engine's live parameters against a map before anything
is patched (fails closed on FP8 weights fed a non-FP8 stream and on weights the map does not know);
:mod:`deltasync.client.sglang` and :mod:`deltasync.client.hf` wire them into SGLang and Hugging Face
models. The helpers below are the earlier single-purpose ones, kept for their callers.

Trainers and engines lay weights out differently. Two cases are handled here:

**Fused and renamed parameters** (vLLM/SGLang-style ``qkv_proj`` = q, k, v stacked on
dim 0; ``gate_up_proj`` = gate, up). A dim-0 slice of a contiguous tensor is itself
contiguous and shares its memory, so :func:`fused_target` returns a dict that maps each
trainer name to a *view* of the engine's tensor. The subscriber patches those views:
the engine's fused memory changes in place, and every fingerprint check of the core
applies unchanged (the view holds exactly the trainer tensor's bytes). Rules are
:class:`Fuse` (regex over engine names) and :class:`Rename`; :func:`llama_fused_rules`
gives the usual set.

**Tensor-parallel shards**: a rank holds rows (column-parallel, ``dim=0``) or columns
(row-parallel, ``dim=1``) of a trainer tensor. :class:`TPShardApplier` patches one
rank's shards from a prepared delta (positions remapped to the shard) and keeps its
*partial fingerprint*: the tensor fingerprint is a sum over lanes
(:mod:`deltasync.fingerprint`), so the ranks' partial sums add up to the full
tensor's fingerprint. After patching, the engine all-reduces the partials (one
int64 vector, its own collective, e.g. ``torch.distributed.all_reduce``) and calls
``commit`` or ``rollback`` on every rank depending on :func:`combine_partials` ==
the manifest's ``fp_after``. Nothing here imports an engine.

:func:`vllm_module` finds the ``nn.Module`` inside a vLLM ``LLM`` object; it imports
nothing from vLLM itself and the test for it uses a clearly labelled stand-in (vLLM
cannot run on this machine).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.apply import PreparedDelta, live_tensors
from deltasync.dtypes import dtype_info, signed_word_dtype, word_view
from deltasync.errors import BaseMismatchError, IntegrityError
from deltasync.fingerprint import fingerprint_delta, fingerprint_from_lane_sums, fp_hex

_MASK64 = (1 << 64) - 1


# -- fused and renamed parameters --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Fuse:
    """Engine parameter ``engine`` (a regex) holds trainer parameters ``parts`` (templates using the
    regex's groups, e.g. ``r"\\1.q_proj.weight"``) stacked along ``dim`` 0, in order."""

    engine: str
    parts: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Rename:
    """Engine parameter matching ``engine`` (a regex) is trainer parameter ``trainer`` (a template)."""

    engine: str
    trainer: str


def llama_fused_rules(prefix: str = "") -> tuple[Fuse | Rename, ...]:
    """vLLM's Llama/Qwen layout: ``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up (dim 0)."""
    p = re.escape(prefix)
    return (
        Fuse(engine=rf"^{p}(.*)\.qkv_proj\.(weight|bias)$", parts=(r"\1.q_proj.\2", r"\1.k_proj.\2", r"\1.v_proj.\2")),
        Fuse(engine=rf"^{p}(.*)\.gate_up_proj\.(weight|bias)$", parts=(r"\1.gate_proj.\2", r"\1.up_proj.\2")),
    )


def fused_target(engine, rules: Sequence[Fuse | Rename], *, trainer_shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """Trainer name -> view of the engine's memory, for every engine parameter (dict or nn.Module).

    ``trainer_shapes`` gives each trainer tensor's shape (from a manifest: ``{t.name: t.shape for t in
    m.tensors}``), which fixes where each part sits in a fused tensor. Engine parameters no rule matches
    keep their names. Raises BaseMismatchError when shapes do not add up."""
    out: dict[str, torch.Tensor] = {}
    for name, t in live_tensors(engine).items():
        for rule in rules:
            m = re.match(rule.engine, name)
            if m is None:
                continue
            if isinstance(rule, Rename):
                out[m.expand(rule.trainer)] = t
                break
            if not t.is_contiguous():
                raise BaseMismatchError(f"{name}: a fused engine tensor must be contiguous to be patched through views")
            parts = [m.expand(p) for p in rule.parts]
            at = 0
            for part in parts:
                shape = trainer_shapes.get(part)
                if shape is None:
                    raise BaseMismatchError(f"{name}: the stream has no tensor {part!r} to fuse into it")
                rows = shape[0] if shape else 1
                view = t.narrow(0, at, rows)
                if tuple(view.shape) != tuple(shape):
                    raise BaseMismatchError(f"{name}: part {part} is {tuple(shape)}, the engine slice is {tuple(view.shape)}")
                out[part] = view
                at += rows
            if at != t.shape[0]:
                raise BaseMismatchError(f"{name}: parts cover {at} of {t.shape[0]} rows")
            break
        else:
            out[name] = t
    return out


def vllm_module(llm) -> torch.nn.Module:
    """The live ``nn.Module`` of a vLLM ``LLM`` (single process, TP=1). Tries the attribute paths of
    recent vLLM versions; never imports vllm."""
    paths = (
        ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),
        ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),
        ("llm_engine", "engine_core", "model_executor", "driver_worker", "worker", "model_runner", "model"),
    )
    for path in paths:
        obj = llm
        for attr in path:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.Module):
            return obj
    raise TypeError(f"cannot find the model inside {type(llm).__name__}: unknown vLLM version or not in-process "
                    "(with multiprocess executors, run the subscriber inside the worker instead)")


# -- tensor-parallel shards ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """This rank's equal share of a 2-D trainer tensor: rows (``dim=0``) or columns (``dim=1``)."""

    dim: int
    rank: int
    world: int
    full_shape: tuple[int, ...]

    def bounds(self) -> tuple[int, int]:
        n = self.full_shape[self.dim]
        if n % self.world:
            raise BaseMismatchError(f"dimension {n} does not split evenly over {self.world} ranks")
        size = n // self.world
        return self.rank * size, (self.rank + 1) * size


def _global_words(shard: Shard, local_numel: int, device) -> torch.Tensor:
    """Global word index of each local word (row-major), int64."""
    lo, hi = shard.bounds()
    if shard.dim == 0:
        cols = int(np.prod(shard.full_shape[1:])) if len(shard.full_shape) > 1 else 1
        return torch.arange(lo * cols, lo * cols + local_numel, device=device, dtype=torch.int64)
    rows, cols = shard.full_shape[0], shard.full_shape[1]
    r = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1) * cols
    c = torch.arange(lo, hi, device=device, dtype=torch.int64).unsqueeze(0)
    return (r + c).reshape(-1)


def _local_positions(shard: Shard, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept mask, local positions) of global word positions."""
    lo, hi = shard.bounds()
    if shard.dim == 0:
        cols = int(np.prod(shard.full_shape[1:])) if len(shard.full_shape) > 1 else 1
        keep = (positions >= lo * cols) & (positions < hi * cols)
        return keep, positions[keep] - lo * cols
    cols = shard.full_shape[1]
    row, col = np.divmod(positions, cols)
    keep = (col >= lo) & (col < hi)
    return keep, row[keep] * (hi - lo) + (col[keep] - lo)


def partial_fingerprint(local: torch.Tensor, shard: Shard) -> int:
    """This rank's share of the full tensor's fingerprint sum (without the length term)."""
    info = dtype_info(local.dtype)
    if info.words_per_element != 1:
        raise BaseMismatchError(f"{info.name}: sharded apply supports one word per element")
    words = word_view(local.contiguous())
    gw = _global_words(shard, words.numel(), words.device)
    # fingerprint_delta(p, 0, w) = sum over the lanes of w of lane * K(global lane)
    total = 0
    step = 1 << 20
    for s in range(0, words.numel(), step):
        w = words[s:s + step]
        total += fingerprint_delta(gw[s:s + step], torch.zeros_like(w), w, info.word_size)
    return total & _MASK64


def combine_partials(partials: Sequence[int], full_shape: Sequence[int], dtype) -> int:
    """The full tensor fingerprint from every rank's partial sum (what an all-reduce computes)."""
    info = dtype_info(dtype)
    n_lanes = int(np.prod(full_shape)) * info.element_size // (1 if info.word_size == 1 else 2)
    return fingerprint_from_lane_sums(partials, n_lanes)


class TPShardApplier:
    """Patches one tensor-parallel rank's shards in place from prepared deltas.

    ``tensors``: trainer name -> this rank's local tensor (a full tensor for replicated
    parameters: give no Shard for them). ``shards``: trainer name -> :class:`Shard`.
    Usage per version, on every rank::

        partials = applier.begin(prepared)            # patch local shards, keep undo
        totals = all_reduce(vector(partials))         # the engine's collective (sum, int64 wrapping)
        ok = applier.check(prepared, totals)          # compare with the manifest's fp_after
        applier.commit() if ok else applier.rollback()

    ``check`` must agree on every rank (it sees the same totals). Replicated tensors are
    verified locally (their partial is the whole fingerprint on every rank; all-reduce
    ``partials`` of sharded tensors only)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], shards: Mapping[str, Shard]) -> None:
        self.tensors = dict(tensors)
        self.shards = dict(shards)
        self.partials: dict[str, int] = {n: partial_fingerprint(t, self.shards[n]) for n, t in self.tensors.items()
                                         if n in self.shards}
        self._undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending: dict[str, int] = {}

    def begin(self, prepared: PreparedDelta) -> dict[str, int]:
        """Patch every local shard the delta touches; returns the new partial sums of sharded tensors."""
        if self._undo:
            raise RuntimeError("commit() or rollback() the previous version first")
        new = dict(self.partials)
        try:
            with torch.no_grad():
                for name, chunks in prepared.patches.items():
                    live = self.tensors.get(name)
                    if live is None:
                        raise BaseMismatchError(f"{name}: in the delta but not on this rank")
                    info = dtype_info(live.dtype)
                    words = word_view(live)
                    sdt = signed_word_dtype(info.word_size)
                    shard = self.shards.get(name)
                    for c in chunks:
                        ch = c.as_changes()
                        pos = ch.positions
                        raw, vals = ch.raw, ch.values
                        if shard is not None:
                            keep, local = _local_positions(shard, pos)
                            pos_g, pos, raw, vals = pos[keep], local, raw[keep], vals[keep]
                        else:
                            pos_g = pos
                        if pos.size == 0:
                            continue
                        idx = torch.from_numpy(np.ascontiguousarray(pos)).to(words.device)
                        old = words.index_select(0, idx)
                        v = torch.from_numpy(np.ascontiguousarray(vals).view(np.dtype(f"i{info.word_size}"))).to(words.device)
                        r = torch.from_numpy(np.ascontiguousarray(raw)).to(words.device)
                        nw = torch.where(r, v, old + v).to(sdt)
                        self._undo.append((words, idx, old))
                        words.index_copy_(0, idx, nw)
                        if shard is not None:
                            d = fingerprint_delta(torch.from_numpy(np.ascontiguousarray(pos_g)).to(words.device), old,
                                                  words.index_select(0, idx), info.word_size)
                            new[name] = (new[name] + d) & _MASK64
        except BaseException:
            self.rollback()
            raise
        self._pending = new
        return {n: new[n] for n in new}

    def check(self, prepared: PreparedDelta, totals: Mapping[str, int]) -> bool:
        """True when every tensor matches the manifest: sharded ones by the all-reduced ``totals``
        (name -> sum of partials), replicated ones by a local scrub."""
        from deltasync.fingerprint import tensor_fingerprint

        for rec in prepared.manifest.tensors:
            if rec.name not in self.tensors:
                continue
            shard = self.shards.get(rec.name)
            if shard is None:
                got = tensor_fingerprint(self.tensors[rec.name]) if rec.name in prepared.patches else None
                if got is not None and fp_hex(got) != rec.fp_after:
                    return False
                continue
            full = combine_partials([totals[rec.name]], shard.full_shape, self.tensors[rec.name].dtype)
            if fp_hex(full) != rec.fp_after:
                return False
        return True

    def commit(self) -> None:
        self.partials = self._pending
        self._pending = {}
        self._undo.clear()

    def rollback(self) -> None:
        with torch.no_grad():
            for words, idx, old in reversed(self._undo):
                words.index_copy_(0, idx, old)
        self._undo.clear()
        self._pending = {}


def shard_tensor(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """This rank's shard of a full tensor, as a contiguous copy (how an engine would load it)."""
    lo, hi = shard.bounds()
    return full.narrow(shard.dim, lo, hi - lo).contiguous()


def check_shard_layout(tensors: Mapping[str, torch.Tensor], shards: Mapping[str, Shard]) -> None:
    for name, s in shards.items():
        t = tensors[name]
        lo, hi = s.bounds()
        want = list(s.full_shape)
        want[s.dim] = hi - lo
        if list(t.shape) != want:
            raise IntegrityError(f"{name}: rank {s.rank} holds {tuple(t.shape)}, a {s.dim}-split of {s.full_shape} is {tuple(want)}")


# -- engine parameters against a layout map (deltasync.layout) -------------------------------------------------

def check_engine_params(layout, params: Mapping[str, torch.Tensor]) -> None:
    """Fail closed before anything is patched: every engine parameter is one the layout map feeds, in the
    dtype and shape the map expects. Raises UnsupportedError naming the first FP8 parameter of an
    FP8-serving engine fed a non-FP8 stream, or the first parameter the map does not know (a quantization
    scale, a packed or transposed weight); BaseMismatchError for a shape the facts do not explain."""
    from deltasync.errors import UnsupportedError

    for name, t in params.items():
        want = layout.params.get(name)
        have = dtype_info(t.dtype).name
        if have.startswith("float8") and (want is None or not want[0].startswith("float8")):
            stream = want[0] if want else next(iter(layout.stream.values()))[0]
            raise UnsupportedError(
                f"engine parameter {name!r} is {have}: this engine serves FP8 weights and the stream is {stream}; "
                "an in-place update needs the stream in the engine's serving format (FP8 with its scales: "
                "Publisher(serve=['fp8-block']) publishes one, which vLLM's worker extension follows; this engine's "
                "glue maps bf16 streams only), or serve the model unquantized")
    for name, t in params.items():
        if name in layout.tied_params:
            continue
        want = layout.params.get(name)
        if want is None:
            raise UnsupportedError(f"engine parameter {name!r} is not in the layout map (a quantization scale, a "
                                   "packed or transposed weight, or a layer the map does not cover); refusing to "
                                   "patch an engine some of whose weights would stay stale")
        if tuple(t.shape) != tuple(want[1]) or dtype_info(t.dtype).name != want[0]:
            raise BaseMismatchError(f"{name}: the engine holds {dtype_info(t.dtype).name} {tuple(t.shape)}, the map "
                                    f"expects {want[0]} {tuple(want[1])} (check TP size, heads, kv heads, vocab)")
    missing = [n for n in layout.params if n not in params]
    if missing:
        raise BaseMismatchError(f"the layout map expects engine parameter {missing[0]!r}, which the engine lacks")
