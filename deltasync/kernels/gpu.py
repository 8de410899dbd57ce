"""Triton kernels for the same hot loops on CUDA tensors: compare + compaction, patch, fingerprint.

Used by the core only for tensors on a CUDA device and only when triton imports
(:func:`enabled`); everything else keeps the torch code, which stays the reference. Results are
bit-identical to the torch/numpy reference: integer arithmetic modulo 2**64 only, compaction in
index order (per-block counts, an exclusive prefix sum, an in-block ``tl.cumsum``), so no atomics
and no ordering that depends on scheduling.

* :func:`changed_positions` (o, n): sorted int64 indices where two flat word views differ.
* :func:`patch_words` (words, positions, raw, values): old words gathered, new ones written
  (raw: the value; else old + step, wrapping) in one pass; returns the old words.
* :func:`lane_block_sums` (lanes): per 2**16-lane block, ``sum lane_j * T[j]`` (the inner sum of
  FORMAT §2's fingerprint; the caller multiplies by the block keys).

:func:`self_check` compares each kernel with the torch reference on random data; ``make
gpu-check`` runs it on a GPU, and ``tests/core/test_core_kernels.py`` runs it on CPU tensors under
``TRITON_INTERPRET=1`` (Triton's interpreter) where triton is installed (``make venv`` installs it).
``tests/core/test_triton_kernels.py`` runs every core path that reaches these kernels (diff, encode, the
publisher's reference, apply and rollback, fingerprints) the same way, through
``kernels.triton_on_cpu()``, against the CPU reference bit for bit.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU suite runs without triton
    triton = None
    tl = None

LANE_BLOCK = 1 << 16
_TILE = 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def enabled(t: torch.Tensor) -> bool:
    """True when ``t`` lives on CUDA and the Triton kernels can run there."""
    return triton is not None and t.device.type == "cuda"


if triton is not None:

    @triton.jit
    def _count_kernel(o_ptr, n_ptr, counts_ptr, length, TILE: tl.constexpr):
        pid = tl.program_id(0)
        idx = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = idx < length
        a = tl.load(o_ptr + idx, mask=inside, other=0)
        b = tl.load(n_ptr + idx, mask=inside, other=0)
        diff = (a != b) & inside
        tl.store(counts_ptr + pid, tl.sum(diff.to(tl.int32), axis=0))

    @triton.jit
    def _scatter_kernel(o_ptr, n_ptr, starts_ptr, pos_ptr, length, TILE: tl.constexpr):
        pid = tl.program_id(0)
        idx = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = idx < length
        a = tl.load(o_ptr + idx, mask=inside, other=0)
        b = tl.load(n_ptr + idx, mask=inside, other=0)
        diff = (a != b) & inside
        rank = tl.cumsum(diff.to(tl.int32), axis=0) - 1
        base = tl.load(starts_ptr + pid)
        tl.store(pos_ptr + base + rank.to(tl.int64), idx, mask=diff)

    @triton.jit
    def _patch_kernel(words_ptr, pos_ptr, raw_ptr, vals_ptr, old_ptr, count, TILE: tl.constexpr):
        pid = tl.program_id(0)
        k = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = k < count
        p = tl.load(pos_ptr + k, mask=inside, other=0)
        a = tl.load(words_ptr + p, mask=inside, other=0)
        v = tl.load(vals_ptr + k, mask=inside, other=0)
        r = tl.load(raw_ptr + k, mask=inside, other=0)
        tl.store(old_ptr + k, a, mask=inside)
        tl.store(words_ptr + p, tl.where(r != 0, v, a + v), mask=inside)

    @triton.jit
    def _lane_sums_kernel(lanes_ptr, table_ptr, out_ptr, length, LANE_MASK: tl.constexpr, BLOCK: tl.constexpr,
                          TILE: tl.constexpr):
        pid = tl.program_id(0)
        first = pid.to(tl.int64) * BLOCK
        acc = tl.zeros((TILE,), dtype=tl.int64)
        for j0 in range(0, tl.minimum(length - first, BLOCK), TILE):  # a short tensor's last block: its lanes only
            j = j0 + tl.arange(0, TILE)
            idx = first + j
            inside = idx < length
            lane = tl.load(lanes_ptr + idx, mask=inside, other=0).to(tl.int64) & LANE_MASK
            key = tl.load(table_ptr + j)
            acc += lane * key  # wraps modulo 2**64: the fingerprint is a sum modulo 2**64
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("the Triton kernels need triton (pip install triton) and a CUDA device")


def changed_positions(o: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Sorted int64 indices where the flat word views ``o`` and ``n`` differ (on their device)."""
    _need_triton()
    length = o.numel()
    if length == 0:
        return torch.empty(0, dtype=torch.int64, device=o.device)
    tiles = triton.cdiv(length, _TILE)
    counts = torch.empty(tiles, dtype=torch.int32, device=o.device)
    _count_kernel[(tiles,)](o, n, counts, length, TILE=_TILE)
    ends = torch.cumsum(counts.to(torch.int64), 0)
    total = int(ends[-1].item())
    pos = torch.empty(total, dtype=torch.int64, device=o.device)
    if total:
        _scatter_kernel[(tiles,)](o, n, ends - counts, pos, length, TILE=_TILE)
    return pos


def patch_words(words: torch.Tensor, positions: torch.Tensor, raw: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """In place: ``words[p] = raw ? v : words[p] + v`` (signed word views, wrapping); the old words back.
    Positions must be inside ``words`` (the caller validated them)."""
    _need_triton()
    count = positions.numel()
    old = torch.empty(count, dtype=words.dtype, device=words.device)
    if count:
        _patch_kernel[(triton.cdiv(count, _TILE),)](words, positions, raw.to(torch.uint8), values, old, count,
                                                    TILE=_TILE)
    return old


def lane_block_sums(lanes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """int64 per 2**16-lane block: sum_j (lane_j as unsigned) * T[j] modulo 2**64 (int8/int16 lanes)."""
    _need_triton()
    length = lanes.numel()
    blocks = triton.cdiv(length, LANE_BLOCK)
    out = torch.empty(blocks, dtype=torch.int64, device=lanes.device)
    if length:
        mask = 0xFF if lanes.dtype == torch.int8 else 0xFFFF
        _lane_sums_kernel[(blocks,)](lanes, table, out, length, LANE_MASK=mask, BLOCK=LANE_BLOCK, TILE=_TILE)
    return out


def self_check(device: str | torch.device = "cuda", n: int = 300_007) -> None:
    """Each kernel against the torch reference on random words; raises AssertionError on a mismatch."""
    from .fpkeys import block_keys, lanes_sum_torch, table_on

    g = torch.Generator().manual_seed(1)
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64):
        info = torch.iinfo(dt)
        o = torch.randint(info.min, info.max, (n,), dtype=dt, generator=g)
        nw = o.clone()
        sel = torch.rand(n, generator=g) < 0.03
        nw[sel] = torch.randint(info.min, info.max, (int(sel.sum()),), dtype=dt, generator=g)
        nw[-1] = ~nw[-1]
        o, nw = o.to(device), nw.to(device)
        ref = torch.nonzero(o != nw).squeeze(1)
        got = changed_positions(o, nw)
        assert torch.equal(ref, got), f"changed_positions differs for {dt}"
        raw = (torch.arange(ref.numel(), device=device) % 3) == 0
        vals = nw.index_select(0, ref) - torch.where(raw, torch.zeros_like(ref, dtype=dt),
                                                     o.index_select(0, ref))
        live = o.clone()
        old = patch_words(live, ref, raw, vals)
        assert torch.equal(old, o.index_select(0, ref)) and torch.equal(live, nw), f"patch_words differs for {dt}"
    for lane_dt in (torch.int8, torch.int16):
        lanes = torch.randint(-128 if lane_dt == torch.int8 else -32768, 127 if lane_dt == torch.int8 else 32767,
                              (3 * LANE_BLOCK + 5,), dtype=lane_dt, generator=g).to(device)
        sums = lane_block_sums(lanes, table_on(lanes.device))
        keys = block_keys(torch.arange(sums.numel(), dtype=torch.int64, device=lanes.device))
        mine = int((sums * keys).sum().item()) & ((1 << 64) - 1)
        assert mine == lanes_sum_torch(lanes.cpu(), 0), f"lane_block_sums differs for {lane_dt}"
