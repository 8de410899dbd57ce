"""A rank's layout map compiled once into offset tables, and a step patched through them vectorized.

:class:`deltasync.layout.RankLayout` says, region by region, where each stream tensor lives in one
engine rank's parameters. Walking those regions per tensor per step costs Python per tensor: at a
seed-scale MoE (a layer's 384 experts in per-expert names, ``...experts.{e}.gate_proj.weight``,
feeding the rows of one stacked ``w13_weight`` [E, 2I/tp, H]) that is ~70,000 tensors a step.
:meth:`RankMap.compile` turns the regions into flat arrays once, at start; :meth:`RankMap.patch`
then translates every change of a step in ``width`` (the most regions any tensor has: 2 for a
stacked gate_up source, else 1) vectorized passes and patches each touched parameter with one
gather / scatter, whatever the number of stream tensors feeding it.

Every region of the engine layouts is a 2-D box once each side is viewed as (rows, last dim):
a per-expert [I, H] source is rows ``[r*I/tp, (r+1)*I/tp)`` of itself, and its place in
``w13_weight`` [E, 2I/tp, H] is rows ``[e*2I/tp + off, ...)`` of the [E*2I/tp, H] view: the expert
is a row offset in the table, not a Python object. For a stream position ``p`` of tensor ``t`` and a
region row ``k`` of ``t``::

    row, col = divmod(p, src_cols[k])
    kept when src_row0[k] <= row < src_row0[k] + rows[k] and src_col0[k] <= col < src_col0[k] + cols[k]
    param word = (dst_row0[k] + row - src_row0[k]) * dst_cols[k] + dst_col0[k] + col - src_col0[k]

A region that is not such a box (none of the builders make one) keeps its box and goes through
:func:`deltasync.layout.translate` (its changes only).

Fingerprints: each counted region's words read back after writing give the stream tensor's
fingerprint change (FORMAT §2: ``sum (new - old) * K(lane)`` over the stream tensor's own lane
indices), summed per tensor in one vectorized pass per parameter.

Pure: arrays and tensors in, tensors patched in place; no I/O, no threads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .dtypes import dtype_info, signed_word_dtype
from .errors import BaseMismatchError
from .kernels import cpu_kernels
from .layout import RankLayout, Region, _contiguous_run, _flat, translate

_MASK64 = (1 << 64) - 1


def _rows_cols(box, shape: Sequence[int]) -> tuple[int, int, int, int, int] | None:
    """(total cols, first row, rows, first col, cols) of a box on the (rows, last dim) view of ``shape``;
    None when the box's rows are not one run of that view."""
    if not shape:
        return 1, 0, 1, 0, 1
    if len(shape) == 1:
        (s, n), = box
        return shape[0], 0, 1, s, n
    lead_box, lead_shape = box[:-1], shape[:-1]
    if not _contiguous_run(lead_box, lead_shape):
        return None
    s, n = box[-1]
    return shape[-1], _flat([b for b, _ in lead_box], lead_shape), math.prod(m for _, m in lead_box), s, n


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMap:
    """A RankLayout as offset tables (build with :meth:`compile`). Region rows are grouped by stream tensor:
    tensor ``i`` (``names[i]``) owns rows ``first[i]:first[i + 1]``."""

    names: tuple[str, ...]
    ids: dict[str, int]
    keys: dict[str, int]  # name -> id * 16 + word size (one lookup per tensor per step)
    params: tuple[str, ...]
    word_sizes: np.ndarray  # per stream tensor
    first: np.ndarray  # int64 [T + 1]
    width: int  # most region rows of one tensor
    param: np.ndarray  # int32, per region row: index into ``params``
    counted: np.ndarray  # bool
    src_cols: np.ndarray
    src_row0: np.ndarray
    rows: np.ndarray
    src_col0: np.ndarray
    cols: np.ndarray
    dst_cols: np.ndarray
    dst_row0: np.ndarray
    dst_col0: np.ndarray
    run_src: np.ndarray  # whole-row regions: first source word, words, first parameter word
    run_len: np.ndarray  # -1: a column split (divmod path); 0: a general region
    run_dst: np.ndarray
    general: tuple[Region | None, ...]  # per region row: the region when it is not a 2-D box (translate() serves it)

    @classmethod
    def compile(cls, layout: RankLayout, *, skip: Iterable[str] = ()) -> "RankMap":
        """Offset tables for every region of ``layout`` (stream tensors in ``skip``, e.g. aliases, left out)."""
        skip = set(skip)
        by_source = layout.by_source()
        names = tuple(n for n in layout.stream if n in by_source and n not in skip)
        params = tuple(layout.params)
        pid = {p: i for i, p in enumerate(params)}
        cols: list[list[int]] = [[] for _ in range(10)]
        first = [0]
        general: list[Region | None] = []
        counted: list[bool] = []
        for name in names:
            s_shape = layout.stream[name][1]
            for r in by_source[name]:
                p_shape = layout.params[r.param][1]
                src = _rows_cols(r.src, s_shape)
                dst = _rows_cols(tuple((i, 1) for i in r.dst_index) + r.dst, p_shape)
                box = src is not None and dst is not None and (src[2], src[4]) == (dst[2], dst[4])
                general.append(None if box else r)
                if not box:
                    src = dst = (1, 0, 0, 0, 0)
                vals = (pid[r.param], src[0], src[1], src[2], src[3], src[4], dst[0], dst[1], dst[3])
                for col, v in zip(cols, vals):
                    col.append(v)
                counted.append(r.counted)
            first.append(len(general))
        a = lambda i, dt=np.int64: np.asarray(cols[i], dtype=dt)  # noqa: E731
        first_np = np.asarray(first, dtype=np.int64)
        src_cols, src_row0, rows, src_col0, ncols, dst_cols, dst_row0, dst_col0 = (a(i) for i in range(1, 9))
        whole = (ncols == src_cols) & (src_col0 == 0) & (dst_cols == ncols) & (dst_col0 == 0)
        is_box = np.asarray([g is None for g in general], dtype=bool)
        run_len = np.where(whole, rows * ncols, -1) * is_box
        ws = [dtype_info(layout.stream[n][0]).word_size for n in names]
        return cls(names=names, ids={n: i for i, n in enumerate(names)},
                   keys={n: i * 16 + w for i, (n, w) in enumerate(zip(names, ws))}, params=params,
                   word_sizes=np.asarray(ws, dtype=np.int64),
                   first=first_np, width=int(np.diff(first_np).max(initial=0)), param=a(0, np.int32),
                   counted=np.asarray(counted, dtype=bool), src_cols=src_cols, src_row0=src_row0, rows=rows,
                   src_col0=src_col0, cols=ncols, dst_cols=dst_cols, dst_row0=dst_row0, dst_col0=dst_col0,
                   run_src=src_row0 * src_cols, run_len=run_len, run_dst=dst_row0 * dst_cols, general=tuple(general))

    # -- translation --

    def translate(self, tids: np.ndarray, positions: np.ndarray,
                  layout: RankLayout | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For changes (stream tensor id, flat word position): (change index, region row, parameter word
        position) of every place a change lands on this rank. ``layout`` is needed only for general regions."""
        lo = self.first[tids]
        count = self.first[tids + 1] - lo
        out_i, out_r, out_d = [], [], []
        for j in range(self.width):
            sel = np.flatnonzero(count > j) if j else None  # every tensor of the map has a region
            r = lo + j if sel is None else lo[sel] + j
            p = positions if sel is None else positions[sel]
            # whole rows on both sides (most regions): one run of words, an offset
            d = p - self.run_src[r]
            keep = (d >= 0) & (d < self.run_len[r])
            k = np.flatnonzero(keep)
            rk = r[k]
            out_i.append(k if sel is None else sel[k])
            out_r.append(rk)
            out_d.append(d[k] + self.run_dst[rk])
            # part of each row (a column split: o_proj, an expert's down_proj at TP > 1): divmod
            o = np.flatnonzero(self.run_len[r] < 0)
            if o.size:
                ro, po = r[o], p[o]
                row, col = np.divmod(po, self.src_cols[ro])
                row -= self.src_row0[ro]
                col -= self.src_col0[ro]
                keep = (row >= 0) & (row < self.rows[ro]) & (col >= 0) & (col < self.cols[ro])
                k = np.flatnonzero(keep)
                rk = ro[k]
                out_i.append(o[k] if sel is None else sel[o[k]])
                out_r.append(rk)
                out_d.append((self.dst_row0[rk] + row[k]) * self.dst_cols[rk] + self.dst_col0[rk] + col[k])
        gen = [i for i, g in enumerate(self.general) if g is not None]
        if gen:
            if layout is None:
                raise BaseMismatchError("this map has general regions; translate() needs the layout")
            flat_r = np.concatenate([lo + j for j in range(self.width)])
            flat_i = np.tile(np.arange(len(tids)), self.width)
            ok = np.concatenate([count > j for j in range(self.width)])
            for g in gen:
                idx = flat_i[ok & (flat_r == g)]
                if idx.size == 0:
                    continue
                reg = self.general[g]
                keep, local = translate(reg, layout.stream[reg.source][1], layout.params[reg.param][1], positions[idx])
                out_i.append(idx[keep])
                out_r.append(np.full(int(keep.sum()), g, dtype=np.int64))
                out_d.append(local)
        if not out_i:
            e = np.zeros(0, dtype=np.int64)
            return e, e, e
        return np.concatenate(out_i), np.concatenate(out_r), np.concatenate(out_d)

    def _placements(self, tids: np.ndarray, pos: np.ndarray, layout: RankLayout | None):
        """:meth:`translate`, grouped by parameter (ascending): the compiled kernel when selected (one pass,
        a counting sort by parameter) and the map has no general region, else the reference and a stable sort."""
        k = cpu_kernels()
        if k is not None and all(g is None for g in self.general):
            n = tids.size * max(self.width, 1)
            out = [np.empty(n, np.int64) for _ in range(3)]
            m = k.rank_translate(self.first, self.width, self.run_src, self.run_len, self.run_dst, self.src_cols,
                                 self.src_row0, self.rows, self.src_col0, self.cols, self.dst_cols, self.dst_row0,
                                 self.dst_col0, self.param, len(self.params), tids, pos, *out)
            return out[0][:m], out[1][:m], out[2][:m]
        ci, rr, dst = self.translate(tids, pos, layout)
        pid = self.param[rr]
        order = np.argsort(pid.astype(np.int16) if len(self.params) < (1 << 15) else pid, kind="stable")
        return ci[order], rr[order], dst[order]

    # -- patching --

    def patch(self, patches: Mapping[str, Sequence], words: Mapping[str, "torch.Tensor"], undo: list,
              touched: set[str], *, layout: RankLayout | None = None) -> dict[str, int]:
        """Write a step's decoded chunks (``PreparedDelta.patches``: stream name -> ChunkPatch list) into the
        parameters' flat signed word views ``words``; returns each patched stream tensor's fingerprint change
        from the counted boxes (mod 2**64). Appends ``(words, index, old words)`` to ``undo`` per parameter
        written (restore in reverse order) and the names written to ``touched``. Tensors the map lacks are
        ignored (nothing of them lives on this rank)."""
        import torch

        # per word size: (tensor id per chunk, changes per chunk); the only Python per tensor is this lookup
        by_ws: dict[int, tuple[list, list]] = {}
        keys = self.keys
        last_ws, g = 0, None
        for name, chunks in patches.items():
            key = keys.get(name)
            if key is None:
                continue
            ws, t = key & 15, key >> 4
            if ws != last_ws:
                g = by_ws.get(ws)
                if g is None:
                    g = by_ws[ws] = ([], [])
                last_ws = ws
            for c in chunks:
                g[0].append(t)
                g[1].append(c.as_changes())
        acc = np.zeros(len(self.names), dtype=np.uint64)
        hit = np.zeros(len(self.names), dtype=bool)
        for ws, (tl, cl) in by_ws.items():
            ws = int(ws)
            counts = np.fromiter((ch.positions.size for ch in cl), dtype=np.int64, count=len(cl))
            tids = np.repeat(np.asarray(tl, dtype=np.int64), counts)
            pos = np.concatenate([ch.positions for ch in cl]).astype(np.int64, copy=False)
            raw = np.concatenate([ch.raw for ch in cl])
            vals = np.concatenate([ch.values for ch in cl]).view(np.dtype(f"i{ws}"))
            hit[tl] = True
            ci, rr, dst = self._placements(tids, pos, layout)
            if ci.size == 0:
                continue
            pid = self.param[rr]
            cuts = np.flatnonzero(np.diff(pid)) + 1
            counted = self.counted[rr]
            read: dict = {}  # device -> (stream positions, tensor ids, old words, words read back) of counted boxes
            with torch.no_grad():
                for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), pid.size]):
                    name = self.params[int(pid[a])]
                    w = words[name]
                    dev = w.device
                    idx = torch.from_numpy(dst[a:b]).to(dev)
                    c = ci[a:b]
                    old = w.index_select(0, idx)
                    v = torch.from_numpy(vals[c]).to(dev)
                    new = torch.where(torch.from_numpy(raw[c]).to(dev), v, old + v).to(signed_word_dtype(ws))
                    undo.append((w, idx, old))
                    w.index_copy_(0, idx, new)
                    touched.add(name)
                    cm = counted[a:b]
                    if not cm.any():
                        continue
                    if not cm.all():
                        k = np.flatnonzero(cm)
                        kt = torch.from_numpy(k).to(dev)
                        idx, old, c = idx.index_select(0, kt), old.index_select(0, kt), c[k]
                    r = read.setdefault(dev, ([], [], [], []))
                    r[0].append(pos[c])
                    r[1].append(tids[c])
                    r[2].append(old)
                    r[3].append(w.index_select(0, idx))  # read back: verify what landed
                for dev, (pl, tl2, ol, nl) in read.items():
                    _fingerprint_changes(np.concatenate(pl), np.concatenate(tl2), torch.cat(ol), torch.cat(nl),
                                         ws, dev, acc)
        return {self.names[t]: int(v) for t, v in zip(np.flatnonzero(hit).tolist(), acc[hit].tolist())}


def _fingerprint_changes(pos: np.ndarray, tids: np.ndarray, old, new, ws: int, dev, acc: np.ndarray) -> None:
    """acc[tensor] += sum (new - old) * K(lane) over the words' lanes at stream positions ``pos`` (mod 2**64)."""
    import torch

    from .kernels.fpkeys import lane_keys, word_lanes as _word_lanes

    p = torch.from_numpy(pos).to(dev)
    lane_idx, o = _word_lanes(p, old, ws)
    _, n = _word_lanes(p, new, ws)
    d = ((n - o) * lane_keys(lane_idx)).cpu().numpy().view(np.uint64)
    per = 1 if ws <= 2 else ws // 2
    np.add.at(acc, np.repeat(tids, per) if per > 1 else tids, d)


__all__ = ["RankMap"]
