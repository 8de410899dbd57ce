"""The ``ans`` chunk mode of blob format 2: changed positions and steps under one rANS message per chunk.

Per change, the gap to the previous change (bucket under model G, then its low bits) and the value
symbol (model V; :func:`deltasync.values.step_symbols`) go into the chunk's message
(:mod:`deltasync.kernels.rans`); raw words go to the ``raw{w}`` stream as in format 1. Models G and V are
static per blob: the encoder counts every chunk of the blob, normalizes (``rans.normalize``) and
sends the frequencies in the ``ansm`` stream (docs/FORMAT.md §4.3), then codes each chunk. Chunks
decode independently (the decoder needs only the blob's tables), so an executor decodes them in
parallel. Nothing here needs the base state: relays decode, compose and re-encode chains without the
model (:mod:`deltasync.squash`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernels import rans
from .errors import FormatError
from .parts import map_parts, split_counts
from .dtypes import numpy_word_dtype, word_sizes_in
from .kernels import cpu_kernels
from .values import Changes, _raw_limit, changes_from_symbols, step_symbols
from .varint import decode_varints, encode_varints

_ERRORS = {
    rans.E_SHORT: "the message ends before its last change (truncated or corrupt)",
    rans.E_SYMBOL: "a BIG step's bucket is out of range",
    rans.E_END: "the message has words or state left after its last change (corrupt)",
    rans.E_GAP: "a gap leaves the chunk",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class AnsTables:
    """A blob's models: (freq, cumulative start, slot lookup) for G and for V."""

    g: tuple[np.ndarray, np.ndarray, np.ndarray]
    v: tuple[np.ndarray, np.ndarray, np.ndarray]

    @classmethod
    def from_freqs(cls, gfreq: np.ndarray, vfreq: np.ndarray) -> "AnsTables":
        return cls(g=rans.tables(gfreq), v=rans.tables(vfreq))

    def to_bytes(self) -> np.ndarray:
        """The ``ansm`` stream: N_GAP then N_VAL frequencies as LEB128 varints."""
        return encode_varints(np.concatenate([self.g[0], self.v[0]]).astype(np.uint64))

    @classmethod
    def parse(cls, data: np.ndarray) -> "AnsTables":
        n = rans.N_GAP + rans.N_VAL
        try:
            f = decode_varints(data, n)
        except FormatError as e:
            raise FormatError(f"ansm stream: {e}") from None
        g, v = f[: rans.N_GAP], f[rans.N_GAP :]
        for name, part in (("G", g), ("V", v)):
            if int(part.max()) > rans.M or int(part.sum()) != rans.M:
                raise FormatError(f"ansm stream: model {name}'s frequencies sum to {int(part.sum())}, expected {rans.M}")
        return cls.from_freqs(g.astype(np.int64), v.astype(np.int64))


def _buckets(gaps: np.ndarray) -> np.ndarray:
    """Bit length of each non-negative gap (0 for 0)."""
    b = np.zeros(gaps.size, dtype=np.int64)
    nz = gaps > 0
    if nz.any():
        _, e = np.frexp(gaps[nz].astype(np.float64))  # exact for gaps < 2**53
        b[nz] = e
    return b


class AnsBlobCoder:
    """Collects the ans chunks of the open blob; :meth:`finish` counts, writes the tables and codes them.

    With the compiled kernels selected (:mod:`deltasync.kernels`), each chunk costs one symbol pass
    (:func:`rans.chunk_symbols` / :func:`rans.word_symbols`) and one coding pass
    (:func:`rans.encode_chunk_pos`); the reference path is numpy's, the bytes are the same.
    Not thread-safe (one per :class:`~deltasync.codec.ChunkPacker`)."""

    def __init__(self, executor=None) -> None:
        self._executor = executor  # codes a closing blob's chunks on its threads (same bytes)
        self._chunks: list[tuple[dict, np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]] = []
        self._gcount = np.zeros(rans.N_GAP, dtype=np.int64)
        self._vcount = np.zeros(rans.N_VAL, dtype=np.int64)
        self._gls: list[np.ndarray] = []  # add_words' per-chunk gap-bucket counts, summed in finish
        self._vls: list[np.ndarray] = []  # ... and symbol counts

    def add(self, record: dict, rel: np.ndarray, changes: Changes) -> np.ndarray:
        """Queue one chunk (``rel``: positions relative to the chunk start); sets ``record``'s mode and
        ``nr`` now and its ``na`` when the blob closes. Returns the raw words for the ``raw{w}`` stream."""
        if cpu_kernels() is not None:
            sym, bigneg, bigmag, raw, zero = rans.chunk_symbols(
                np.ascontiguousarray(rel, np.int64), 0, np.ascontiguousarray(changes.raw),
                np.ascontiguousarray(changes.values), self._gcount, self._vcount)
            if zero:
                raise ValueError("a zero step is not a change")
            return self._queue(record, rel, 0, sym, bigneg, bigmag, raw)
        gaps = np.diff(rel, prepend=-1) - 1
        sym, bigneg, bigmag, raw = step_symbols(changes, rans.SMALL, rans.BIG, rans.RAW)
        self._gcount += np.bincount(_buckets(gaps), minlength=rans.N_GAP)
        self._vcount += np.bincount(sym, minlength=rans.N_VAL)
        return self._queue(record, rel, 0, sym, bigneg, bigmag, raw)

    def add_words(self, record: dict, positions: np.ndarray, start: int, old: np.ndarray, new: np.ndarray,
                  *, is_float: bool, symbols=None) -> np.ndarray:
        """:meth:`add` straight from a chunk's changed words (sorted absolute ``positions``, the chunk
        starting at ``start``, old and new unsigned words that all differ): step or raw is chosen as
        ``values.changes_from_words`` does. ``symbols``: :func:`word_symbols` of the chunk, computed
        ahead (e.g. on another thread). Compiled kernels only."""
        sym, bigneg, bigmag, raw, gl, vl = symbols if symbols is not None else word_symbols(positions, start, old, new,
                                                                                            is_float=is_float)
        self._gls.append(gl)
        self._vls.append(vl)
        record["mode"] = "ans"
        record["na"] = 0
        record["nr"] = raw.size
        self._chunks.append((record, positions, start, sym, bigneg, bigmag))
        return raw

    def _queue(self, record, positions, start, sym, bigneg, bigmag, raw) -> np.ndarray:
        record.update(mode="ans", na=0, nr=int(raw.size))
        self._chunks.append((record, positions, start, sym, bigneg, bigmag))
        return raw

    def finish(self, writer) -> None:
        """Append ``ansm`` and each queued chunk's message (in chunk order) to ``writer``; reset."""
        if not self._chunks:
            return
        if self._gls:
            self._gcount += np.add.reduce(self._gls)
            self._vcount += np.add.reduce(self._vls)
        tables = AnsTables.from_freqs(rans.normalize(self._gcount), rans.normalize(self._vcount))
        writer.append("ansm", tables.to_bytes())
        (gf, gc, _), (vf, vc, _) = tables.g, tables.v
        fast = cpu_kernels() is not None

        encode = rans.encode_chunk_pos

        def code(item):
            _, positions, start, sym, bigneg, bigmag = item
            if fast:
                if positions.dtype != np.int64 or not positions.flags.c_contiguous:
                    positions = np.ascontiguousarray(positions, np.int64)
                return encode(positions, start, sym, bigneg, bigmag, gf, gc, vf, vc)
            gaps = (np.diff(positions, prepend=start - 1) - 1).astype(np.int64)
            return rans.encode_chunk(gaps, sym, bigneg, bigmag, gf, gc, vf, vc)

        messages = map_parts(code, self._chunks, self._executor if fast else None, weight=lambda item: item[3].size)
        append = writer.append
        for (record, *_), words in zip(self._chunks, messages):
            record["na"] = words.size
            append("ans", words.astype("<u2", copy=False).view(np.uint8))
        self.__init__(self._executor)


_RAW_LIMIT = {w: _raw_limit(w * 8) for w in (1, 2, 4, 8)}


def word_symbols(positions: np.ndarray, start: int, old: np.ndarray, new: np.ndarray, *, is_float: bool):
    """One chunk's symbols straight from its changed words (:func:`rans.word_symbols`, any thread):
    (value symbols, BIG signs, BIG magnitudes, raw words, gap-bucket counts, symbol counts)."""
    gl = np.zeros(rans.N_GAP, dtype=np.int64)
    vl = np.zeros(rans.N_VAL, dtype=np.int64)
    if positions.dtype != np.int64 or not positions.flags.c_contiguous:
        positions = np.ascontiguousarray(positions, np.int64)
    sym, bigneg, bigmag, raw, zero = rans.word_symbols(positions, start, old, new, _RAW_LIMIT[old.dtype.itemsize],
                                                       bool(is_float), gl, vl)
    if zero:
        raise ValueError("a zero step is not a change")
    return sym, bigneg, bigmag, raw, gl, vl


def decode_ans_chunk(tables: AnsTables, words: np.ndarray, raw: np.ndarray, count: int, length: int,
                     start: int, word_size: int) -> Changes:
    """One chunk's message (uint16 words) and raw words -> Changes (absolute positions)."""
    (gf, gc, gl), (vf, vc, vl) = tables.g, tables.v
    pos, sym, bneg, bmag, nbig, err = rans.decode_chunk(words, count, length, gf, gc, gl, vf, vc, vl)
    if err != rans.OK:
        raise FormatError(f"ans chunk: {_ERRORS.get(err, f'error {err}')}")
    return changes_from_symbols(pos + start, sym, bneg[:nbig], bmag[:nbig], raw, word_size,
                                rans.SMALL, rans.BIG, rans.RAW)


# -- A: a blob's ans chunks decoded in a few compiled calls ---------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class AnsChunk:
    """Where one ans chunk's message and raw words lie in its blob's streams (byte offset ``at`` and word
    count ``na`` in ``ans``; word offset ``r0`` and count ``nr`` in ``raw{word_size}``)."""

    count: int
    length: int
    start: int
    at: int
    na: int
    r0: int
    nr: int
    word_size: int


_PARTS = 4  # an executor's share of a blob's ans chunks: this many parts of about equal change counts
_PART_MIN = 1 << 15  # fewer changes than this in all: one part


def _packed_tables(tables):
    (gf, gc, gl), (vf, vc, vl) = tables.g, tables.v
    return cpu_kernels().ans_slot_table(gf, gc, gl), cpu_kernels().ans_slot_table(vf, vc, vl)


def _ans_error(code: int, detail: int, nr: int, word_size: int) -> FormatError:
    if code == cpu_kernels().E_ANS_NRAW:
        return FormatError(f"values: {detail} raw symbols but {nr} raw words")
    if code == cpu_kernels().E_ANS_STEPBIG:
        return FormatError(f"values: a step larger than half a {word_size * 8}-bit word")
    return FormatError(f"ans chunk: {_ERRORS.get(code, f'error {code}')}")


def decode_ans_chunks(tables: AnsTables, ans: np.ndarray, raws: dict[int, np.ndarray], chunks: list[AnsChunk],
                      *, executor=None) -> list[Changes]:
    """Every chunk of ``chunks`` decoded (:func:`decode_ans_chunk` each, same results and errors: the first
    failing chunk in list order raises). With the compiled kernels, chunks of one word size are decoded in
    one call into shared arrays (each chunk's Changes are views of them); ``executor``: in a few parts on
    its threads."""
    for c in chunks:
        if c.at < 0 or c.at + 2 * c.na > ans.size or c.r0 < 0 or c.r0 + c.nr > raws[c.word_size].size:
            raise FormatError("blob stream 'ans' or its raw words are shorter than its chunks need (truncated or corrupt)")
    if cpu_kernels() is None:
        out = []
        for c in chunks:
            words = np.array(ans[c.at : c.at + 2 * c.na]).view("<u2")
            out.append(decode_ans_chunk(tables, words, raws[c.word_size][c.r0 : c.r0 + c.nr], c.count, c.length,
                                        c.start, c.word_size))
        return out
    return decode_ans_rows(tables, ans, raws, [(c.at, c.na, c.count, c.length, c.start, c.r0, c.nr, c.word_size)
                                               for c in chunks], executor=executor)


_object_new = object.__new__
_setattr = object.__setattr__


def decode_ans_rows(tables, ans: np.ndarray, raws: dict, rows: list, *, executor=None) -> list:
    """:func:`decode_ans_chunks` of chunks given as tuples ``(at, na, count, length, start, r0, nr, word_size)``
    (an :class:`AnsChunk`'s fields, as ``codec.decode_blob`` gathers them: no object per chunk); the same
    Changes and the same errors."""
    k = cpu_kernels()
    if k is None:
        return decode_ans_chunks(tables, ans, raws, [
            AnsChunk(at=r[0], na=r[1], count=r[2], length=r[3], start=r[4], r0=r[5], nr=r[6], word_size=r[7])
            for r in rows], executor=executor)
    if not rows:
        return []
    result: list = [None] * len(rows)
    new, put = _object_new, _setattr
    for w, (idx, offsets, pos, rawf, vals) in decode_ans_columns(
            tables, ans, raws, np.array(rows, dtype=np.int64).reshape(-1, 8), executor=executor).items():
        bounds = offsets.tolist()
        for row, i in enumerate(idx.tolist()):
            a, b = bounds[row], bounds[row + 1]
            ch = new(Changes)  # Changes(positions=..., raw=..., values=...) without the frozen keyword __init__
            put(ch, "positions", pos[a:b])
            put(ch, "raw", rawf[a:b])
            put(ch, "values", vals[a:b])
            result[i] = ch
    return result


def decode_ans_columns(tables, ans: np.ndarray, raws: dict, table: np.ndarray, *, executor=None) -> dict:
    """The chunks of ``table`` (int64 rows ``(at, na, count, length, start, r0, nr, word_size)``) decoded by the
    compiled kernels (selected: the caller's check) into flat arrays, one set per word size: ``{word size: (row
    indices, offsets, positions, raw flags, values)}``, the changes of row ``indices[j]`` at
    ``[offsets[j], offsets[j + 1])`` (absolute positions, strictly increasing in each chunk). The same errors as
    :func:`decode_ans_chunks`: the first failing chunk in row order raises FormatError."""
    k = cpu_kernels()
    out: dict = {}
    if not table.shape[0]:
        return out
    rows = table
    at, na, r0, nr, ws = table[:, 0], table[:, 1], table[:, 5], table[:, 6], table[:, 7]
    wsizes = word_sizes_in(ws)
    multi = len(wsizes) > 1
    sizes = np.array([raws[w].size for w in ws.tolist()], np.int64) if multi else raws[wsizes[0]].size
    if ((at < 0) | (at + 2 * na > ans.size) | (r0 < 0) | (r0 + nr > sizes)).any():
        raise FormatError("blob stream 'ans' or its raw words are shorter than its chunks need (truncated or corrupt)")
    if ans.size % 2:
        raise FormatError(f"blob stream 'ans' has {ans.size} bytes, not a whole number of 16-bit words")
    words16 = ans.view("<u2") if ans.size else np.zeros(0, np.uint16)
    gtab, vtab = _packed_tables(tables)
    failures: list[tuple[int, int, int]] = []  # (chunk index, code, detail)
    for w in wsizes:
        if multi:
            idx = np.flatnonzero(ws == w)
            sub = table[idx]
        else:
            idx = np.arange(rows.shape[0])
            sub = table
        counts = sub[:, 2]
        offsets = np.zeros(sub.shape[0] + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        jobs = np.empty((sub.shape[0], 8), dtype=np.int64)
        jobs[:, 0] = sub[:, 0] // 2
        jobs[:, 1:7] = sub[:, 1:7]
        jobs[:, 7] = offsets[:-1]
        o = int(offsets[-1])
        wdt = numpy_word_dtype(w)
        pos = np.empty(o, np.int64)
        rawf = np.empty(o, np.bool_)
        vals = np.empty(o, wdt)
        raw_words = np.ascontiguousarray(raws.get(w, np.zeros(0, wdt)), wdt)
        ranges = [(0, sub.shape[0])]
        if executor is not None and o >= _PART_MIN and sub.shape[0] > 1:
            ranges = split_counts(counts, _PARTS)

        def run(r, jobs=jobs, pos=pos, rawf=rawf, vals=vals, raw_words=raw_words, w=w):
            return k.ans_decode_chunks(words16, jobs[r[0] : r[1]], gtab, vtab, raw_words, pos, rawf, vals, w * 8)

        got = list(executor.map(run, ranges)) if len(ranges) > 1 else [run(ranges[0])]
        for (a, _), (code, j, detail) in zip(ranges, got):
            if code != 0:
                failures.append((int(idx[a + j]), int(code), int(detail)))
        out[w] = (idx, offsets, pos, rawf, vals)
    if failures:
        i, code, detail = min(failures)
        raise _ans_error(code, detail, int(rows[i, 6]), int(rows[i, 7]))
    return out
