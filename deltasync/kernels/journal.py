"""Compiled kernels of the ``--out`` undo journal's columnar groups (jrnl03, :mod:`deltasync.client.filetarget`).

One call gathers a whole word size's undo record: for every chunk row, its changes' uint32 offsets from the
chunk's first word and their old words, read through one view of the whole mapped file (each tensor's first
word given per row), in one prefetching pass. Loaded only with the compiled kernels (``kernels.cpu_kernels()``);
``kernels.journal_columns`` holds the numpy reference.
"""

from __future__ import annotations

import numpy as np

from .cache import load_cached_directly
from .cpu import _AHEAD, _jit, _next_change, _prefetch


@_jit
def journal_columns(words, flat, at, counts, starts, stops, first, rel, old):
    """For chunk row ``j`` in order, its changes ``flat[at[j] : at[j] + counts[j]]`` (word positions in its
    tensor): ``rel[o + k] = p - starts[j]`` and ``old[o + k] = words[first[j] + p]`` (``o``: the changes of the
    rows before). Returns (-1, 0), or (j, k) at the first change outside ``[starts[j], stops[j])`` (the record is
    then unfinished: the caller raises). The caller's: ``first[j] + stops[j] <= words.size``, every ``at[j] +
    counts[j] <= flat.size``, ``rel``/``old`` of the total count."""
    # the prefetch cursor (row, change) runs _AHEAD changes ahead across rows: many small tensors' rows hold a
    # few changes each, too few to prefetch inside one
    ja, ka = _next_change(counts, 0, -1)
    for _ in range(_AHEAD):
        if ja >= at.size:
            break
        _prefetch(words, first[ja] + flat[at[ja] + ka])  # a hint: an out-of-range one never faults
        ja, ka = _next_change(counts, ja, ka)
    o = 0
    for j in range(at.size):
        a = at[j]
        c = counts[j]
        s = starts[j]
        e = stops[j]
        f = first[j]
        own = c - _AHEAD  # changes whose look-ahead lies in this row: prefetched from its own positions
        if own > 0:
            ja, ka = _next_change(counts, j + 1, -1)
        for k in range(c):
            p = flat[a + k]
            if p < s or p >= e:
                return j, k
            if k < own:
                _prefetch(words, f + flat[a + k + _AHEAD])  # a hint: an out-of-range one never faults
            elif ja < at.size:
                _prefetch(words, first[ja] + flat[at[ja] + ka])
                ja, ka = _next_change(counts, ja, ka)
            rel[o + k] = p - s
            old[o + k] = words[f + p]
        o += c
    return -1, 0


load_cached_directly(globals())  # the kernel above loads its cached code directly
