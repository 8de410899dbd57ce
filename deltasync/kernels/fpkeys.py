"""The fingerprint's keys (docs/FORMAT.md §2): ``K(i) = T[i mod 2**16] * O(i div 2**16)``, the table ``T``, the
block keys ``O``, and the fingerprint's sums written in torch, the specification the compiled kernels
(:mod:`deltasync.kernels.cpu`, :mod:`deltasync.kernels.gpu`) are tested against.

The bottom of the fingerprint: it imports nothing of deltasync (torch only when called). The API that picks a
kernel is :mod:`deltasync.fingerprint`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
_CHUNK_BLOCKS = 4  # lanes per full-recompute step: 4 blocks = 256 Ki lanes = 2 MiB of int64
MASK64 = (1 << 64) - 1
C0 = 0x2545F4914F6CDD1D
_SEED_T = 0x6A09E667F3BCC908
_SEED_B = 0xBB67AE8584CAA73B


def _to_signed(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


T_NP = _splitmix64_np(np.arange(BLOCK, dtype=np.uint64) + np.uint64(_SEED_T)) | np.uint64(1)
_T_BY_DEVICE: dict = {}  # torch.device -> the table as int64 on it (torch imported on first use)


def table_on(device: torch.device) -> torch.Tensor:
    t = _T_BY_DEVICE.get(device.type if device.type == "cpu" else device)
    if t is None:
        import torch

        cpu = _T_BY_DEVICE.get("cpu")
        if cpu is None:
            cpu = _T_BY_DEVICE["cpu"] = torch.from_numpy(T_NP.view(np.int64).copy())
        t = _T_BY_DEVICE[device] = cpu if device.type == "cpu" else cpu.to(device)
    return t


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def block_keys(blocks: torch.Tensor) -> torch.Tensor:
    """O(b) for a tensor of int64 block numbers, on their device (splitmix64, wrapping int64)."""
    z = (blocks ^ _to_signed(_SEED_B)) + _to_signed(0x9E3779B97F4A7C15)
    z = (z ^ _lsr(z, 30)) * _to_signed(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _to_signed(0x94D049BB133111EB)
    return (z ^ _lsr(z, 31)) | 1


def lane_keys(index: torch.Tensor) -> torch.Tensor:
    """K(i) for int64 lane indices, on their device."""
    import torch

    table = table_on(index.device)
    blocks = index >> BLOCK_BITS
    if index.numel() > 256:
        b0, b1 = int(blocks.min()), int(blocks.max())
        if b1 - b0 < index.numel():  # few distinct blocks: key each block once, then gather
            keys = block_keys(torch.arange(b0, b1 + 1, dtype=torch.int64, device=index.device))
            return table[index & (BLOCK - 1)] * keys[blocks - b0]
    return table[index & (BLOCK - 1)] * block_keys(blocks)


def word_lanes(positions: torch.Tensor, words: torch.Tensor, word_size: int):
    """Split words at word positions into (lane indices, lane values as int64)."""
    import torch

    w = words.to(torch.int64)
    if word_size == 1:
        return positions, w & 0xFF
    per = word_size // 2
    if per == 1:
        return positions, w & 0xFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=w.device) * 16
    values = _lsr_any(w.unsqueeze(1), shifts) & 0xFFFF
    index = positions.unsqueeze(1) * per + torch.arange(per, device=w.device)
    return index.reshape(-1), values.reshape(-1)


def _lsr_any(z: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    # Logical shifts by a tensor of amounts; only used with shifts < 64 and a 0xFFFF mask after.
    return z >> shifts


def lanes_sum_torch(lanes: torch.Tensor, offset: int, *, gpu=None) -> int:
    """sum_i lane_i * K(offset + i) mod 2**64 over a flat int8/int16 lane view, in torch on the lanes' device
    (the specification the compiled kernels are tested against). ``gpu``: the Triton kernel module for
    CUDA lanes (:func:`deltasync.kernels.gpu_kernels`), used from the first block boundary on."""
    n = lanes.numel()
    if n == 0:
        return 0
    import torch

    mask = 0xFF if lanes.dtype == torch.int8 else 0xFFFF
    device = lanes.device
    total = 0
    head = min((-offset) % BLOCK, n)
    if head:  # up to the first block boundary: per-lane keys
        idx = torch.arange(offset, offset + head, dtype=torch.int64, device=device)
        total += int(((lanes[:head].to(torch.int64) & mask) * lane_keys(idx)).sum().item())
        lanes, offset, n = lanes[head:], offset + head, n - head
        if n == 0:
            return total & MASK64
    table = table_on(device)
    g = gpu if offset % BLOCK == 0 else None
    if g is not None:  # Triton: one pass, per-block sums on the device
        sums = g.lane_block_sums(lanes.contiguous(), table)
        keys = block_keys(torch.arange(offset >> BLOCK_BITS, (offset >> BLOCK_BITS) + sums.numel(), dtype=torch.int64,
                                        device=device))
        return (total + int((sums * keys).sum().item())) & MASK64
    if device.type == "cpu":  # unsigned views widen without a mask pass on CPU
        lanes, mask = lanes.view(torch.uint8 if mask == 0xFF else torch.uint16), 0
    step = BLOCK * _CHUNK_BLOCKS
    nblocks = (n + BLOCK - 1) // BLOCK
    buf = torch.empty(min(step, nblocks * BLOCK), dtype=torch.int64, device=device)
    sums = torch.empty(nblocks, dtype=torch.int64, device=device)
    for start in range(0, n, step):
        m = min(step, n - start)
        rows = (m + BLOCK - 1) // BLOCK
        if m < rows * BLOCK:
            buf.zero_()
        view = buf[:m]
        view.copy_(lanes[start : start + m])
        if mask:
            view.bitwise_and_(mask)
        mat = buf[: rows * BLOCK].view(rows, BLOCK)
        mat.mul_(table)
        first = start >> BLOCK_BITS
        torch.sum(mat, dim=1, out=sums[first : first + rows])
    first_block = offset >> BLOCK_BITS
    keys = block_keys(torch.arange(first_block, first_block + nblocks, dtype=torch.int64, device=device))
    total += int((sums * keys).sum().item())
    return total & MASK64


def fingerprint_delta_torch(positions: torch.Tensor, old_words: torch.Tensor, new_words: torch.Tensor,
                            word_size: int) -> int:
    """The fingerprint change when words at ``positions`` go from old to new, in torch on their device (the
    specification of the compiled kernel)."""
    idx, old = word_lanes(positions, old_words, word_size)
    _, new = word_lanes(positions, new_words, word_size)
    d = ((new - old) * lane_keys(idx)).sum()
    return int(d.item()) & MASK64
