"""ShardedApplier: one engine rank's side of the Applier seam, all or nothing across its group.

Public names (stable): :class:`ShardedApplier`, :class:`GroupComm`, :class:`ShardedStaged`,
:func:`prepare_needed`.

An engine rank holds boxes of the stream's tensors inside its own (fused, sharded, padded) parameters,
as a :class:`deltasync.layout.RankLayout` says. ``ShardedApplier(layout, params, group=...)``:

- ``needed_blobs(manifest)``: the blobs holding changes inside this rank's boxes (from the chunk spans
  the encoder records in the manifest, docs/FORMAT.md "chunk spans"); ``None`` (all) when the manifest
  has no spans (a squashed delta, an old publisher). :func:`prepare_needed` decodes only those.
- ``stage_delta(prepared, fps, verify=...)``: every change is translated into the rank's parameter
  coordinates (positions outside its boxes dropped; no full trainer tensor is ever built: memory is
  O(changed)); the old words are kept for undo; the words read back after writing give each counted
  box's fingerprint change (``fingerprint_delta`` over the stream tensor's own positions, so the ranks'
  changes add up to the whole tensor's). Then one vote (all_reduce MIN/MAX: every rank staged without
  error, at the same (parent, version) from the same fingerprints), one sum (all_reduce of the changes,
  16-bit limbs so nothing overflows), and every rank checks the combined fingerprints against the
  manifest's ``fp_after`` and the SIGNED ``state_fp``. The decision is computed from identical numbers on
  every rank, so every rank raises (after rolling back) or every rank returns a :class:`ShardedStaged`.
- A replicated box (norms, replicated KV heads, a router) is written on every rank holding it and
  counted by one (``Region.counted``).
- ``stage_keyframe(state, fps)``: copies each box from the host tensors; same vote.
- ``scan()``: full fingerprints of every stream tensor (partial sums of counted boxes, one all_reduce).

Collectives go through ``torch.distributed`` on the engine's process group (gloo in tests, the
engine's own group in vLLM/SGLang; with NCCL the small vectors live on the current CUDA device). With
no group and no initialised process group the applier is single-rank (a Hugging Face module).
Every rank must call ``stage_*``/``scan`` together (the engine glue drives them, e.g. vLLM
``collective_rpc``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import xxhash

from deltasync.apply import PreparedDelta, prepare_delta
from deltasync.codec import chunk_spans
from deltasync.dtypes import dtype_info, word_view
from deltasync.errors import ApplyError, BaseMismatchError, DeltaSyncError, FormatError, IntegrityError
from deltasync.fingerprint import (
    _lanes, fingerprint_delta, fingerprint_from_lane_sums, fp_hex, lanes_sum, state_fingerprint,
)
from deltasync.layout import RankLayout, Region, region_rows
from deltasync.manifest import Manifest
from deltasync.rankmap import RankMap, restore

_MASK64 = (1 << 64) - 1
_BLOCK_WORDS = 1 << 20  # scan: words per sub-box (bounds the temporary memory)


# -- the group ------------------------------------------------------------------------------------------------

class GroupComm:
    """The few collectives the applier needs, over a torch.distributed group (or none: one rank)."""

    def __init__(self, group=None, *, local: bool = False) -> None:
        """``local=True``: one rank, no collectives, even inside an initialised process group."""
        import torch.distributed as dist

        self.group = group
        self.active = not local and dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        self.device = torch.device("cpu")
        if self.active and dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def min_max(self, values: list[int]) -> tuple[list[int], list[int]]:
        """Element-wise (min, max) over the group of int64 values (one all_reduce)."""
        if self.size == 1:
            return list(values), list(values)
        import torch.distributed as dist

        t = torch.tensor(list(values) + [-v for v in values], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        out = t.cpu().tolist()
        n = len(values)
        return out[:n], [-v for v in out[n:]]

    def sum_u64(self, values: list[int]) -> list[int]:
        """Element-wise sum mod 2**64 over the group (16-bit limbs: exact whatever the backend does on overflow)."""
        if self.size == 1:
            return [v & _MASK64 for v in values]
        import torch.distributed as dist

        limbs = [(v >> (16 * k)) & 0xFFFF for v in values for k in range(4)]
        t = torch.tensor(limbs, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        s = t.cpu().tolist()
        return [sum(s[4 * i + k] << (16 * k) for k in range(4)) & _MASK64 for i in range(len(values))]


# -- staged change --------------------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class ShardedStaged:
    """A change written into this rank's parameters, verified over the group, not final yet."""

    fps: dict[str, int]  # stream-level fingerprints (combined over the group: the same on every rank)
    touched: frozenset[str]  # engine parameters written on this rank (e.g. to repack on a CPU backend)
    _undo: list = field(default_factory=list)

    def commit(self) -> None:
        self._undo.clear()

    def rollback(self) -> None:
        _restore(self._undo)


def _restore(undo: list) -> None:
    with torch.no_grad():
        restore(undo)  # the map's records and this applier's box copies (keyframes: (None, view, old))
    undo.clear()


# -- blob selection ----------------------------------------------------------------------------------------------

def chunk_on_rows(layout: RankLayout, name: str, start: int, stop: int, by_source=None) -> bool:
    """Does words [start, stop) of stream tensor ``name`` cross rows a region of ``layout`` reads? (``by_source``:
    ``layout.by_source()``, made once by a caller that asks for many chunks.)"""
    if name in layout.aliases or name not in layout.stream:
        return False
    regions = (by_source if by_source is not None else layout.by_source()).get(name)
    if not regions:
        return False
    shape = layout.stream[name][1]
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    r0, r1 = start // row, (stop - 1) // row + 1
    return any(a < r1 and r0 < b for a, b in (region_rows(r) for r in regions))


def needed_blobs_for(layout: RankLayout, manifest: Manifest) -> set[str] | None:
    """Blob ids holding changes inside this rank's boxes (None: the manifest cannot tell, fetch all)."""
    if manifest.kind != "delta":
        return None
    spans = chunk_spans(manifest)
    by_source = layout.by_source()
    need: set[str] = set()
    for rec in manifest.tensors:
        if not rec.chunks or rec.name in layout.aliases:
            continue
        regions = by_source.get(rec.name)
        if not regions:
            continue
        sp = spans.get(rec.name)
        if sp is None:
            need.update(c.blob for c in rec.chunks)
            continue
        row = math.prod(rec.shape[1:]) if len(rec.shape) > 1 else 1
        rows = [region_rows(r) for r in regions]
        for ref, (s, e) in zip(rec.chunks, sp):
            r0, r1 = s // row, (e - 1) // row + 1
            if any(a < r1 and r0 < b for a, b in rows):
                need.add(ref.blob)
    return need


def prepare_needed(manifest: Manifest, blobs, needed: set[str] | None) -> PreparedDelta:
    """A PreparedDelta from only the ``needed`` blobs (all of them when None): ``prepare_delta(only=...)``,
    which checks every decoded chunk against the span the manifest records for it."""
    return prepare_delta(manifest, blobs, only=needed)


# -- the applier --------------------------------------------------------------------------------------------------

class ShardedApplier:
    """Applier for one rank of a TP/EP group (or a single-process model) described by a RankLayout."""

    def __init__(self, layout: RankLayout, params: Mapping[str, torch.Tensor], *, group=None,
                 comm: GroupComm | None = None) -> None:
        layout.check()
        self.map = layout
        self.comm = comm or GroupComm(group)
        self.params: dict[str, torch.Tensor] = {}
        for name, (dt, shape) in layout.params.items():
            t = params.get(name)
            if t is None:
                raise BaseMismatchError(f"engine parameter {name!r} is in the layout map but not on this rank")
            t = t.detach()
            if dtype_info(t.dtype).name != dt or tuple(t.shape) != tuple(shape):
                raise BaseMismatchError(f"{name}: the engine holds {dtype_info(t.dtype).name} {tuple(t.shape)}, "
                                        f"the layout map expects {dt} {tuple(shape)} (wrong facts: TP size, heads, vocab?)")
            if not t.is_contiguous():
                raise BaseMismatchError(f"{name}: not contiguous; cannot patch it in place")
            if dtype_info(t.dtype).words_per_element != 1:
                raise BaseMismatchError(f"{name}: {dtype_info(t.dtype).name} has several words per element; "
                                        "sharded apply needs one")
            self.params[name] = t
        extra = sorted(set(params) - set(layout.params) - set(layout.tied_params))
        if extra:
            raise BaseMismatchError(f"engine parameter {extra[0]!r} is not in the layout map (and {len(extra) - 1} more)")
        self._words = {n: word_view(t) for n, t in self.params.items()}
        self._by_source = layout.by_source()
        self._rankmap = RankMap.compile(layout, skip=layout.aliases)  # offset tables: a step patched vectorized
        self.last_needed_bytes = 0

    # -- Applier seam --

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return dict(self.map.stream)

    def needed_blobs(self, manifest: Manifest) -> set[str] | None:
        need = needed_blobs_for(self.map, manifest)
        sizes = {b.id: b.size for b in manifest.blobs}
        self.last_needed_bytes = sum(sizes.values()) if need is None else sum(sizes[b] for b in need)
        return need

    def wants_chunk(self, name: str, start: int, stop: int) -> bool:
        """Does words [start, stop) of stream tensor ``name`` cross this rank's rows? The chunks a history-coded
        delta is decoded for (the same spans every step: their history is whole), as ``needed_blobs`` picks blobs."""
        return chunk_on_rows(self.map, name, start, stop, self._by_source)

    def scan(self) -> dict[str, int]:
        names = sorted(n for n in self.map.stream if n not in self.map.aliases)
        sums = self.comm.sum_u64([self._partial(n) for n in names])
        fps = {n: fingerprint_from_lane_sums([s], self._lanes(n)) for n, s in zip(names, sums)}
        for a, p in self.map.aliases.items():
            fps[a] = fps[p]
        return fps

    def stage_delta(self, prepared: PreparedDelta, fps: Mapping[str, int], *, verify: str = "incremental") -> ShardedStaged:
        if verify not in ("incremental", "full"):
            raise ValueError(f"verify must be 'incremental' or 'full', got {verify!r}")
        m = prepared.manifest
        undo: list = []
        touched: set[str] = set()
        names = sorted(r.name for r in m.tensors if r.name not in self.map.aliases)
        deltas = dict.fromkeys(names, 0)
        err: BaseException | None = None
        try:
            self._check_base(m, fps)
            with torch.no_grad():
                deltas.update(self._rankmap.patch(prepared.patches, self._words, undo, touched, layout=self.map))
        except Exception as e:  # noqa: BLE001 - every failure is voted on, then raised
            err = e
        self._vote(m, fps, undo, err)
        if verify == "full":
            changed = [r.name for r in m.tensors if r.chunks and r.name not in self.map.aliases]
            sums = self.comm.sum_u64([self._partial(n) for n in changed])
            new = dict(fps)
            new.update({n: fingerprint_from_lane_sums([s], self._lanes(n)) for n, s in zip(changed, sums)})
        else:
            sums = self.comm.sum_u64([deltas[n] for n in names])
            new = dict(fps)
            new.update({n: (fps[n] + s) & _MASK64 for n, s in zip(names, sums)})
        for a, p in self.map.aliases.items():
            if p in new:
                new[a] = new[p]
        self._check_result(m.version, {r.name: r.fp_after for r in m.tensors}, m.state_fp, new, undo)
        return ShardedStaged(fps=new, touched=frozenset(touched), _undo=undo)

    def stage_keyframe(self, state: Mapping[str, torch.Tensor], fps: Mapping[str, int]) -> ShardedStaged:
        undo: list = []
        touched: set[str] = set()
        err: BaseException | None = None
        try:
            for name, (dt, shape) in self.map.stream.items():
                if name in self.map.aliases:
                    continue
                t = state.get(name)
                if t is None:
                    raise BaseMismatchError(f"the keyframe lacks {name!r}")
                if dtype_info(t.dtype).name != dt or tuple(t.shape) != tuple(shape):
                    raise BaseMismatchError(f"{name}: keyframe has {dtype_info(t.dtype).name} {tuple(t.shape)}, "
                                            f"the engine serves {dt} {tuple(shape)}")
            with torch.no_grad():
                for r in self.map.regions:
                    dst = self._dst_view(r)
                    src = state[r.source]
                    for d, (s, n) in enumerate(r.src):
                        src = src.narrow(d, s, n)
                    undo.append((None, dst, dst.clone()))
                    dst.copy_(src.to(dst.device))
                    touched.add(r.param)
        except Exception as e:  # noqa: BLE001
            err = e
        version = -1
        self._vote(None, fps, undo, err, pair=(version, version))
        names = sorted(n for n in self.map.stream if n not in self.map.aliases)
        sums = self.comm.sum_u64([self._partial(n) for n in names])
        new = {n: fingerprint_from_lane_sums([s], self._lanes(n)) for n, s in zip(names, sums)}
        for a, p in self.map.aliases.items():
            new[a] = new[p]
        want = {n: fp_hex(fps[n]) for n in new if n in fps}
        self._check_result(None, want, None, new, undo)
        return ShardedStaged(fps=new, touched=frozenset(touched), _undo=undo)

    # -- internals --

    def _lanes(self, name: str) -> int:
        dt, shape = self.map.stream[name]
        info = dtype_info(dt)
        return math.prod(shape) * info.element_size // (1 if info.word_size == 1 else 2)

    def _check_base(self, m: Manifest, fps: Mapping[str, int]) -> None:
        if m.kind != "delta":
            raise FormatError(f"v{m.version} is a {m.kind}, not a delta")
        recs = {r.name: r for r in m.tensors}
        # format 3 lists only the tensors a delta changes (the others' fingerprints are covered by the signed
        # state fingerprints, which LiveState checks); format 2 lists them all
        if not set(recs) <= set(self.map.stream) or (m.format < 3 and set(recs) != set(self.map.stream)):
            missing, extra = sorted(set(self.map.stream) - set(recs)), sorted(set(recs) - set(self.map.stream))
            raise BaseMismatchError(f"v{m.version}: the stream's tensors differ from the engine's map "
                                    f"(engine only: {missing[:5]}, stream only: {extra[:5]})")
        for name, rec in recs.items():
            dt, shape = self.map.stream[name]
            if (rec.dtype, tuple(rec.shape)) != (dt, tuple(shape)):
                raise BaseMismatchError(f"{name}: delta is {rec.dtype} {rec.shape}, the engine serves {dt} {shape}")
            if name not in fps or (rec.fp_before is not None and fp_hex(fps[name]) != rec.fp_before):
                raise BaseMismatchError(f"{name}: tracked fingerprint {fp_hex(fps.get(name, 0))} is not the delta's "
                                        f"base {rec.fp_before} (not at v{m.parent}; resync from a keyframe)")
        for a, p in self.map.aliases.items():
            ra, rp = recs.get(a), recs.get(p)
            if (ra is None) != (rp is None) or (ra is not None and (ra.fp_before, ra.fp_after) != (rp.fp_before, rp.fp_after)):
                raise BaseMismatchError(f"{a} is tied to {p} in the engine but the delta changes them differently")

    def _vote(self, m: Manifest | None, fps: Mapping[str, int], undo: list, err: BaseException | None,
              pair: tuple[int, int] | None = None) -> None:
        """Every rank staged cleanly, from the same fingerprints, at the same step; else all roll back and raise."""
        h = xxhash.xxh3_64()
        for n in sorted(fps):
            h.update(f"{n}\x00{fp_hex(fps[n])}\n".encode())
        if pair is None:
            pair = (-1 if m.parent is None else m.parent, m.version)
        mine = [0 if err is not None else 1, pair[0], pair[1], h.intdigest() >> 1]
        lo, hi = self.comm.min_max(mine)
        if err is None and lo[0] == 1 and lo[1:] == hi[1:]:
            return
        _restore(undo)
        what = "the keyframe" if m is None else f"v{m.version}"
        if err is not None:
            if isinstance(err, DeltaSyncError):
                raise err
            raise ApplyError(f"rank {self.comm.rank}: staging {what} failed ({type(err).__name__}: {err}); "
                             "rolled back on every rank") from err
        if lo[0] != 1:
            raise ApplyError(f"rank {self.comm.rank}: another rank of the group failed to stage {what}; "
                             "rolled back on every rank (see that rank's error)")
        raise BaseMismatchError(f"rank {self.comm.rank}: the ranks disagree on the step or the base fingerprints "
                                f"(here ({pair[0]} -> {pair[1]})); every rank must apply the same steps "
                                "(use_squash=False, same ready versions); rolled back on every rank")

    def _check_result(self, version, want: Mapping[str, str], state_fp: str | None, new: Mapping[str, int],
                      undo: list) -> None:
        for name, fp in sorted(want.items()):
            if fp_hex(new[name]) != fp:
                _restore(undo)
                raise IntegrityError(f"{name}: fingerprint over the group after patching is {fp_hex(new[name])}, "
                                     f"expected {fp}; rolled back on every rank")
        if state_fp is not None:
            have = state_fingerprint((n, dt, shape, new[n]) for n, (dt, shape) in self.map.stream.items())
            if have != state_fp:
                _restore(undo)
                raise IntegrityError(f"v{version}: state fingerprint over the group is {have}, the signed manifest "
                                     f"says {state_fp}; rolled back on every rank")

    def _dst_view(self, r: Region) -> torch.Tensor:
        t = self.params[r.param]
        for i in r.dst_index:
            t = t[i]
        for d, (s, n) in enumerate(r.dst):
            t = t.narrow(d, s, n)
        return t

    def _partial(self, name: str) -> int:
        """This rank's share of a stream tensor's lane sum: its counted boxes (no length term)."""
        total = 0
        src_shape = self.map.stream[name][1]
        for r in self._by_source.get(name, ()):
            if r.counted:
                total += _box_sum(self._dst_view(r), r.src, src_shape)
        return total & _MASK64


def _box_sum(view: torch.Tensor, box, src_shape) -> int:
    """sum lane * K(global lane) over a box of a stream tensor whose values are ``view``."""
    if view.numel() == 0:
        return 0
    info = dtype_info(view.dtype)
    per = 1 if info.word_size == 1 else info.word_size // 2
    if not src_shape:
        return lanes_sum(_lanes(view.contiguous().reshape(1)), 0)
    # split along the first dimension longer than 1 into blocks of bounded size
    d = next((i for i, (_, n) in enumerate(box) if n > 1), len(box) - 1)
    inner = math.prod(n for _, n in box[d + 1:]) if d + 1 < len(box) else 1
    step = max(1, _BLOCK_WORDS // max(inner, 1))
    total = 0
    strides = [math.prod(src_shape[i + 1:]) for i in range(len(src_shape))]
    contiguous_tail = all(box[i] == (0, src_shape[i]) for i in range(d + 1, len(box)))
    s_d, n_d = box[d]
    for at in range(0, n_d, step):
        k = min(step, n_d - at)
        sub = view.narrow(d, at, k).contiguous()
        start = [s for s, _ in box]
        start[d] = s_d + at
        if contiguous_tail:  # one contiguous run of the stream tensor
            first = sum(a * st for a, st in zip(start, strides))
            total += lanes_sum(_lanes(sub), first * per)
            continue
        pos = torch.zeros((), dtype=torch.int64)
        for i, (s, n) in enumerate(box):
            s0, n0 = (s_d + at, k) if i == d else (s, n)
            shape = [1] * len(box)
            shape[i] = n0
            pos = pos + (torch.arange(s0, s0 + n0, dtype=torch.int64) * strides[i]).reshape(shape)
        words = word_view(sub)
        total += fingerprint_delta(pos.reshape(-1).to(words.device), torch.zeros_like(words), words, info.word_size)
    return total & _MASK64
