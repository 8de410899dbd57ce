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
    # per stream tensor, when it has exactly one region and that one is a run of whole rows (a change at stream word
    # p lands at parameter word p + run_dst - run_src, for run_src <= p < run_src + run_len): (run_src, its end,
    # parameter, region row) as Python ints (what :meth:`patch` reads per tensor); else None
    runs: tuple[tuple[int, int, int, int] | None, ...]

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
        run_src, run_dst = src_row0 * src_cols, dst_row0 * dst_cols
        p_words = np.asarray([math.prod(layout.params[p][1]) for p in params], dtype=np.int64)
        lone = first_np[:-1][np.diff(first_np) == 1]
        inside = (run_len[lone] > 0) & (run_dst[lone] + run_len[lone] <= p_words[a(0)[lone]])
        direct = np.full(len(names), -1, dtype=np.int64)
        direct[np.flatnonzero(np.diff(first_np) == 1)[inside]] = lone[inside]
        pid_rows = a(0).tolist()
        runs = tuple(None if r < 0 else (s, s + n, pid_rows[r], r)
                     for r, s, n in zip(direct.tolist(), run_src[np.maximum(direct, 0)].tolist(),
                                        run_len[np.maximum(direct, 0)].tolist()))
        return cls(names=names, ids={n: i for i, n in enumerate(names)},
                   keys={n: i * 16 + w for i, (n, w) in enumerate(zip(names, ws))}, params=params,
                   word_sizes=np.asarray(ws, dtype=np.int64),
                   first=first_np, width=int(np.diff(first_np).max(initial=0)), param=a(0, np.int32),
                   counted=np.asarray(counted, dtype=bool), src_cols=src_cols, src_row0=src_row0, rows=rows,
                   src_col0=src_col0, cols=ncols, dst_cols=dst_cols, dst_row0=dst_row0, dst_col0=dst_col0,
                   run_src=run_src, run_len=run_len, run_dst=run_dst, general=tuple(general), runs=runs)

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
        from the counted boxes (mod 2**64). Appends its undo records to ``undo`` (``(words, index, old words)``
        per parameter written, a :class:`JobsUndo` per compiled call; :func:`restore` undoes them, newest first)
        and the names written to ``touched``. Tensors the map lacks are ignored (nothing of them lives on this
        rank)."""
        import torch

        # per word size: (tensor id per chunk, changes per chunk) to translate, and the chunks of direct tensors
        # that lie inside their run (no translation: an offset per chunk); the only Python per tensor is this lookup
        by_ws: dict[int, tuple[list, list]] = {}
        direct: dict[int, tuple[list, list, list, list]] = {}  # per word size: parameters, tensors, rows, changes
        keys, runs = self.keys, self.runs
        seen: list[int] = []  # every tensor of the map the step patches (a fingerprint change each, 0 if elsewhere)
        last_ws = 0
        for name, chunks in patches.items():
            key = keys.get(name)
            if key is None:
                continue
            ws, t = key & 15, key >> 4
            if ws != last_ws:
                g_t, g_c = by_ws.setdefault(ws, ([], []))
                d_p, d_t, d_r, d_c = direct.setdefault(ws, ([], [], [], []))
                last_ws = ws
            seen.append(t)
            run = runs[t]
            if run is None:
                for c in chunks:
                    g_t.append(t)
                    g_c.append(c.as_changes())
                continue
            lo, hi, p, r = run
            for c in chunks:
                if lo <= c.start and c.stop <= hi:
                    d_p.append(p)
                    d_t.append(t)
                    d_r.append(r)
                    d_c.append(c.as_changes())
                elif c.stop <= lo or c.start >= hi:
                    continue  # its words live on other ranks (a change that is not where its chunk says fails the vote)
                else:
                    g_t.append(t)
                    g_c.append(c.as_changes())
        hit = np.zeros(len(self.names), dtype=bool)
        hit[seen] = True
        acc = np.zeros(len(self.names), dtype=np.uint64)
        for ws, (ps, ts, rs, cs) in direct.items():
            if ps:
                self._patch_direct(int(ws), ps, ts, rs, cs, words, undo, touched, acc)
        for ws, (tl, cl) in by_ws.items():
            ws = int(ws)
            if not tl:
                continue
            counts = np.fromiter((ch.positions.size for ch in cl), dtype=np.int64, count=len(cl))
            tids = np.repeat(np.asarray(tl, dtype=np.int64), counts)
            pos = np.concatenate([ch.positions for ch in cl]).astype(np.int64, copy=False)
            raw = np.concatenate([ch.raw for ch in cl])
            vals = np.concatenate([ch.values for ch in cl]).view(np.dtype(f"i{ws}"))
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
                    _fingerprint_sums(torch.from_numpy(np.concatenate(pl)).to(dev),
                                      torch.from_numpy(np.concatenate(tl2)).to(dev), torch.cat(ol), torch.cat(nl),
                                      ws, len(self.names), acc)
        return {self.names[t]: int(v) for t, v in zip(np.flatnonzero(hit).tolist(), acc[hit].tolist())}


    def _patch_direct(self, ws: int, ps: list, ts: list, rs: list, cs: list, words: Mapping[str, "torch.Tensor"],
                      undo: list, touched: set[str], acc: np.ndarray) -> None:
        """:meth:`patch` of the chunks that lie inside their tensor's one run (per chunk: parameter, tensor id,
        region row, changes): no translation, no per-change tables. Host parameters: one compiled ``patch_jobs``
        call for all of them (a job per chunk, built by numpy: old words, write, read back, fingerprint change in
        one pass; each job may write its run's words only). A device's parameters: torch there, its changes
        uploaded once, their positions checked against their runs and their fingerprint changes summed there."""
        pids = np.asarray(ps, dtype=np.int64)
        tids, rows = np.asarray(ts, dtype=np.int64), np.asarray(rs, dtype=np.int64)
        host = cpu_kernels() is not None
        uniq = np.unique(pids).tolist()
        ws_of = {i: words[self.params[i]] for i in uniq}
        touched.update(self.params[i] for i in uniq)
        if host and all(w.is_cpu and w.is_contiguous() for w in ws_of.values()):
            # every parameter on the host (the usual case): the jobs in stream order, each with its parameter's address
            addr = np.zeros(len(self.params), dtype=np.int64)
            addr[uniq] = [w.data_ptr() for w in ws_of.values()]
            self._patch_jobs(ws, tids, rows, cs, addr[pids], list(ws_of.values()), undo, acc)
            return
        if pids.size > 1 and (pids[1:] < pids[:-1]).any():  # by parameter, stable: each tensor's chunks in order
            order = np.argsort(pids, kind="stable")
            pids, tids, rows, cs = pids[order], tids[order], rows[order], [cs[i] for i in order.tolist()]
        n = pids.size
        cuts = [0, *(np.flatnonzero(np.diff(pids)) + 1).tolist(), n]
        on_host, on_device = [], {}  # (first chunk, end, parameter words) of whole parameters, per place
        for a, b in zip(cuts[:-1], cuts[1:]):
            w = ws_of[int(pids[a])]
            if host and w.is_cpu and w.is_contiguous():
                on_host.append((a, b, w))
            else:
                on_device.setdefault(w.device, []).append((a, b, w))
        for place, segs in ([(None, on_host)] if on_host else []) + list(on_device.items()):
            idx = np.concatenate([np.arange(a, b) for a, b, _ in segs])
            sel_t, sel_r, sel_c = tids[idx], rows[idx], [cs[i] for i in idx.tolist()]
            if place is None:
                base = np.repeat(np.asarray([w.data_ptr() for _, _, w in segs], dtype=np.int64),
                                 [b - a for a, b, _ in segs])
                self._patch_jobs(ws, sel_t, sel_r, sel_c, base, [w for _, _, w in segs], undo, acc)
            else:
                rebased, at = [], 0
                for a, b, w in segs:
                    rebased.append((at, at + b - a, w))
                    at += b - a
                self._patch_torch(ws, sel_t, sel_r, sel_c, rebased, place, undo, acc)

    def _patch_jobs(self, ws: int, tids: np.ndarray, rows: np.ndarray, chs: list, base: np.ndarray, tensors: list,
                    undo: list, acc: np.ndarray) -> None:
        """The compiled jobs of ``chs`` (``base``: the address of each one's parameter words; ``tensors``: those
        parameters' words, for their version counters and the undo record)."""
        from . import kernels
        from .dtypes import numpy_word_dtype

        m = len(chs)
        wdt = numpy_word_dtype(ws)
        counts = np.fromiter((ch.positions.size for ch in chs), np.int64, m)
        offsets = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        lo = self.run_src[rows]
        jobs = np.empty((m, 7), dtype=np.int64)  # stream word p of a chunk lands at parameter word p + run_dst - lo
        jobs[:, 0] = base + (self.run_dst[rows] - lo) * ws
        jobs[:, 1] = lo + self.run_len[rows]
        jobs[:, 5] = counts
        jobs[:, 6] = lo
        if offsets[-1] < JOIN_CHANGES * m:
            # many small chunks (an MoE's experts): their arrays joined, every job's addresses by numpy (a call
            # per chunk for its three addresses costs more than the copy)
            pos = np.concatenate([ch.positions for ch in chs]).astype(np.int64, copy=False)
            raw = np.concatenate([ch.raw for ch in chs]).view(np.uint8)
            vals = np.concatenate([ch.values for ch in chs]).astype(wdt, copy=False)
            arrays = [(pos, raw, vals)]
            jobs[:, 2] = pos.ctypes.data + offsets[:-1] * 8
            jobs[:, 3] = raw.ctypes.data + offsets[:-1]
            jobs[:, 4] = vals.ctypes.data + offsets[:-1] * ws
        else:  # large chunks: addressed where they are (joining a step's 30M changes would write ~350 MB of fresh pages)
            addresses = cpu_kernels().array_addresses
            arrays = []  # each chunk's arrays as the jobs address them (kept alive by the undo record)
            for ch in chs:
                pos, raw, vals = ch.positions, ch.raw, ch.values
                if not (vals.dtype == wdt and pos.dtype == np.int64 and pos.flags.c_contiguous
                        and raw.flags.c_contiguous and vals.flags.c_contiguous):
                    pos, raw = np.ascontiguousarray(pos, dtype=np.int64), np.ascontiguousarray(raw)
                    vals = np.ascontiguousarray(vals, dtype=wdt)
                arrays.append((pos, raw, vals))
            jobs[:, 2:5] = np.array([addresses(*a) for a in arrays], dtype=np.int64).reshape(m, 3)
        fpds = np.zeros(m, np.uint64)
        like = np.empty(0, wdt)
        # in parts of at most PART_BYTES of old words: numpy takes a larger array's memory from fresh pages every
        # step (glibc's mmap threshold stops at 32 MiB), and the first write to each page then faults in the kernel
        step = max(PART_BYTES // ws, 1)
        cuts = np.unique(np.searchsorted(offsets, np.arange(step, int(offsets[-1]), step), side="right") - 1)
        j, k, done = -1, 0, 0
        for a, b in zip([0, *cuts[cuts > 0].tolist()], [*cuts[cuts > 0].tolist(), m]):
            old = np.empty(int(offsets[b] - offsets[a]), wdt)
            j, k = kernels.patch_jobs(jobs[a:b], like, old, fpds[a:b], ws)
            done = b if j < 0 else a + j
            if done > a:  # the jobs that ran, undone by running them again with their old words (no index arrays)
                undo.append(JobsUndo(jobs[a:done], old[:offsets[done] - offsets[a]], offsets[a:done + 1] - offsets[a],
                                     ws, arrays, tensors))
            if j >= 0:
                j += a
                break
        # written through addresses: torch's version counters say so, as an in-place op's would (vLLM's CPU
        # extension packs a layer again when its weights' version moved: client/vllm.py)
        changed_versions(tensors)
        counted = self.counted[rows[:done]]
        np.add.at(acc, tids[:done][counted], fpds[:done][counted])
        if j >= 0:
            raise IndexError(f"{self.names[int(tids[j])]}: change position {int(chs[j].positions[k])} is outside its "
                             f"run of words [{int(lo[j])}, {int(jobs[j, 1])}) on this rank")

    def _patch_torch(self, ws: int, tids: np.ndarray, rows: np.ndarray, chs: list, params: list, dev, undo: list,
                     acc: np.ndarray) -> None:
        import torch

        n = len(chs)
        counts = np.fromiter((ch.positions.size for ch in chs), np.int64, n)
        if not counts.any():
            return
        up = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        pos = up(np.concatenate([ch.positions for ch in chs]).astype(np.int64, copy=False))
        raw = up(np.concatenate([ch.raw for ch in chs]))
        vals = up(np.concatenate([ch.values for ch in chs]).view(np.dtype(f"i{ws}")))
        chunk = torch.repeat_interleave(torch.arange(n, device=dev), up(counts))
        lo = up(self.run_src[rows])[chunk]
        end = lo + up(self.run_len[rows])[chunk]
        if not bool(((pos >= lo) & (pos < end)).all()):  # one synchronisation, before any write
            bad = int(torch.nonzero((pos < lo) | (pos >= end))[0, 0])
            raise IndexError(f"{self.names[int(tids[int(chunk[bad])])]}: change position {int(pos[bad])} is outside "
                             "its run on this rank")
        offs = self.run_dst[rows] - self.run_src[rows]
        dst = pos + up(offs)[chunk] if offs.any() else pos
        sdt = signed_word_dtype(ws)
        ends = np.cumsum(counts)
        olds, backs = [], []
        for a, b, w in params:
            s, e = int(ends[a - 1]) if a else 0, int(ends[b - 1])
            idx = dst[s:e]
            old = w.index_select(0, idx)
            v = vals[s:e]
            undo.append((w, idx, old))
            w.index_copy_(0, idx, torch.where(raw[s:e], v, old + v).to(sdt))
            olds.append(old)
            backs.append(w.index_select(0, idx))  # read back: verify what landed
        counted = self.counted[rows]
        keep = None if counted.all() else up(counted)[chunk]
        tid = up(tids)[chunk]
        old, back = torch.cat(olds), torch.cat(backs)
        if keep is not None:
            pos, tid, old, back = pos[keep], tid[keep], old[keep], back[keep]
        _fingerprint_sums(pos, tid, old, back, ws, len(self.names), acc)


#: below this many changes a chunk on average, :meth:`RankMap.patch` joins the chunks' arrays for its compiled call
JOIN_CHANGES = 4096
#: old words per compiled call of :meth:`RankMap.patch` (and undo record)
PART_BYTES = 16 << 20


class JobsUndo:
    """An undo record of :meth:`RankMap.patch`'s compiled jobs: :meth:`restore` runs them again, last first, with
    their old words as raw values (``kernels.unpatch_jobs``). Holds the arrays the jobs address."""

    __slots__ = ("jobs", "old", "offsets", "word_size", "keep", "tensors")

    def __init__(self, jobs: np.ndarray, old: np.ndarray, offsets: np.ndarray, word_size: int, keep,
                 tensors: list) -> None:
        self.jobs, self.old, self.offsets, self.word_size, self.keep = jobs, old, offsets, word_size, keep
        self.tensors = tensors  # the parameters' words the jobs write

    def restore(self) -> None:
        from . import kernels

        kernels.unpatch_jobs(self.jobs, self.old, self.offsets, self.word_size)
        changed_versions(self.tensors)


def changed_versions(tensors) -> None:
    """Move the version counters of tensors written through their addresses (by a compiled kernel), as torch's own
    in-place ops do: what watches them for changes sees these too."""
    from torch.autograd.graph import increment_version

    for t in tensors:
        increment_version(t)


def restore(undo: list) -> None:
    """Undo :meth:`RankMap.patch` (and a sharded applier's own box copies), newest record first: a
    :class:`JobsUndo` runs its jobs back; ``(words, index, old)`` writes the old words at the index
    (``words`` None: ``index`` is a view, ``old`` copied into it)."""
    for entry in reversed(undo):
        if type(entry) is JobsUndo:
            entry.restore()
        elif entry[0] is None:
            entry[1].copy_(entry[2])
        else:
            entry[0].index_copy_(0, entry[1], entry[2])


def _fingerprint_sums(pos, tid, old, new, ws: int, n_tensors: int, acc: np.ndarray) -> None:
    """acc[tensor] += sum (new - old) * K(lane) over the lanes of the words at stream positions ``pos`` of
    tensors ``tid`` (mod 2**64), summed on the words' device: one small copy back."""
    import torch

    from .kernels.fpkeys import lane_keys, word_lanes as _word_lanes

    if pos.numel() == 0:
        return
    lane_idx, o = _word_lanes(pos, old, ws)
    _, nw = _word_lanes(pos, new, ws)
    per = 1 if ws <= 2 else ws // 2
    sums = torch.zeros(n_tensors, dtype=torch.int64, device=pos.device)
    sums.index_add_(0, tid if per == 1 else tid.repeat_interleave(per), (nw - o) * lane_keys(lane_idx))
    acc += sums.cpu().numpy().view(np.uint64)


__all__ = ["JobsUndo", "RankMap", "restore"]
