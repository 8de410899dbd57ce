"""Compiled kernels of the ``--out`` undo journal's columnar groups (jrnl03, :mod:`deltasync.client.filetarget`).

One call gathers a whole word size's undo record: for every chunk row, its changes' uint32 offsets from the
chunk's first word and their old words, read through one view of the whole mapped file (each tensor's first
word given per row), in one prefetching pass. Loaded only with the compiled kernels (``kernels.cpu_kernels()``);
``kernels.journal_columns`` holds the numpy reference.
"""

from __future__ import annotations

import numpy as np

from .cache import load_cached_directly
from .cpu import _AHEAD, _jit, _prefetch


@_jit
def journal_columns(words, flat, at, counts, starts, stops, first, rel, old):
    """For chunk row ``j`` in order, its changes ``flat[at[j] : at[j] + counts[j]]`` (word positions in its
    tensor): ``rel[o + k] = p - starts[j]`` and ``old[o + k] = words[first[j] + p]`` (``o``: the changes of the
    rows before). Returns (-1, 0), or (j, k) at the first change outside ``[starts[j], stops[j])`` (the record is
    then unfinished: the caller raises). The caller's: ``first[j] + stops[j] <= words.size``, every ``at[j] +
    counts[j] <= flat.size``, ``rel``/``old`` of the total count."""
    o = 0
    for j in range(at.size):
        a = at[j]
        c = counts[j]
        s = starts[j]
        e = stops[j]
        f = first[j]
        for k in range(c):
            p = flat[a + k]
            if p < s or p >= e:
                return j, k
            if k + _AHEAD < c:
                _prefetch(words, f + flat[a + k + _AHEAD])  # a hint: an out-of-range one never faults
            rel[o + k] = p - s
            old[o + k] = words[f + p]
        o += c
    return -1, 0


load_cached_directly(globals())  # the kernel above loads its cached code directly
