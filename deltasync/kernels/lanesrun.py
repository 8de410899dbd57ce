"""Compiled kernel of a keyframe shard's receive (``subscribe --out``'s first version, :mod:`deltasync.client.filetarget`).

A shard's bytes arrive in receives of up to 1 MiB that cover runs of tensors lying back to back (a 70k-tensor
state: ~200 tensors a receive); one call sums every whole lane of every tensor the receive holds into that
tensor's fingerprint (``lanes_sum``, each tensor from its own lane offset). Loaded only with the compiled
kernels (``kernels.cpu_kernels()``); :func:`deltasync.fingerprint.run_lane_sums` holds the reference.
"""

from __future__ import annotations

import numpy as np

from .cache import load_cached_directly
from .cpu import _jit, lanes_sum


@_jit
def run_lane_sums(buf, base, end, starts, stops, lbs, done, sums, j, table, scratch):
    """The bytes ``buf[0 : end - base]`` are those of the shard's offsets ``[base, end)``, ``base`` at or before
    tensor ``j``'s first lane not yet summed. For tensor ``j`` on, while they start before ``end``: each
    one's whole lanes received (from ``done[t]`` up to those before ``min(stops[t], end)``) summed into
    ``sums[t]`` (mod 2**64) and ``done[t]`` moved on. Returns the tensor ``end`` falls in (or ends at).
    ``scratch``: uint16 room (any size but 0) through which a 2-byte-lane tensor at an odd byte of ``buf`` is copied."""
    while True:
        lb = lbs[j]
        s0 = starts[j]
        d = done[j]
        upto = (min(stops[j], end) - s0) // lb
        if upto > d:
            p = s0 + d * lb - base
            k = upto - d
            if lb == 1:
                sums[j] += lanes_sum(buf[p : p + k], d, table)
            elif p % 2 == 0:
                sums[j] += lanes_sum(buf[p : p + 2 * k].view(np.uint16), d, table)
            else:  # copied to aligned room, a scratch's worth at a time
                if scratch.size == 0:
                    raise ValueError("run_lane_sums: a 2-byte-lane tensor at an odd byte and no scratch room")
                i0 = 0
                while i0 < k:
                    m = min(k - i0, scratch.size)
                    for i in range(m):
                        q = p + 2 * (i0 + i)
                        scratch[i] = np.uint16(buf[q]) | (np.uint16(buf[q + 1]) << np.uint16(8))
                    sums[j] += lanes_sum(scratch[:m], d + i0, table)
                    i0 += m
            done[j] = upto
        if stops[j] >= end:
            return j
        j += 1


load_cached_directly(globals())  # the kernel above loads its cached code directly
