"""Tensor and state fingerprints: 64-bit, device-independent, incrementally updatable.

A tensor's bytes are read as *lanes*: little-endian uint16 (uint8 for 1-byte
dtypes), in row-major element order. Lane ``i`` gets a key

    K(i) = T[i mod 2**16] * O(i div 2**16)  (mod 2**64)

where ``T`` is a fixed table of 65536 odd 64-bit constants and ``O(b)`` is an odd
64-bit value drawn from splitmix64 for block ``b``. The fingerprint is

    fp = n_lanes * C0 + sum_i lane_i * K(i)  (mod 2**64)

Integer arithmetic only, so the reduction order (threads, GPU blocks) does not
matter and CPU and GPU agree bit for bit. Every key is odd, so changing any one
lane always changes ``fp``; moving or changing several lanes collides with
probability about 2**-48 for unstructured errors (this is an integrity check
against bugs and corruption, not against an adversary: manifests are signed).

Because ``fp`` is a sum, patching lanes ``P`` from old to new values updates it
in O(|P|): ``fp' = fp + sum_{i in P} (new_i - old_i) * K(i)``.

The *state fingerprint* is xxh3-64 over the sorted ``(name, dtype, shape, fp)``
records of every tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import islice
from operator import add, itemgetter, le
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from .dtypes import HostTensor, dtype_info, word_view
from .kernels import cpu_kernels, gpu_kernels
from .kernels.fpkeys import C0, MASK64, T_NP, fingerprint_delta_torch, lanes_sum_torch

if TYPE_CHECKING:
    import torch

def _lanes(tensor: torch.Tensor) -> torch.Tensor:
    """Flat signed view of a contiguous tensor's lanes (int8 or int16)."""
    import torch

    info = dtype_info(tensor.dtype)
    words = word_view(tensor)
    if info.word_size == 1 or words.numel() == 0:
        return words.view(torch.int8) if info.word_size == 1 else words.view(torch.int16)
    return words.view(torch.int16)


def lane_bits(dtype: torch.dtype | str) -> int:
    return 8 if dtype_info(dtype).word_size == 1 else 16


FP_SPLIT_LANES = 1 << 22  # with an executor, a full recompute runs in pieces of this many lanes


def tensor_fingerprint(tensor: torch.Tensor, *, executor=None) -> int:
    """Full recompute ("scrub") of a tensor's fingerprint on its own device.

    Extra memory is bounded (a few MiB on the tensor's device); the tensor is
    never copied to the host. Non-contiguous tensors are made contiguous first.
    ``executor``: sum pieces of ``FP_SPLIT_LANES`` lanes on its threads (the compiled CPU
    kernel releases the GIL; the sum is order-free, so the result is the same).
    ``tensor`` may be a :class:`~deltasync.dtypes.HostTensor` (numpy words, no torch: :func:`host_lanes`).
    """
    if isinstance(tensor, HostTensor):
        return _host_fingerprint(tensor, executor)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    lanes = _lanes(tensor)
    n = lanes.numel()
    if executor is not None and n > FP_SPLIT_LANES:
        parts = executor.map(lambda s: lanes_sum(lanes[s : s + FP_SPLIT_LANES], s), range(0, n, FP_SPLIT_LANES))
        return (sum(parts) + n * C0) & MASK64
    return (lanes_sum(lanes, 0) + n * C0) & MASK64


def host_lanes(t: HostTensor) -> np.ndarray:
    """A HostTensor's words as unsigned fingerprint lanes (uint8 for 1-byte words, else uint16), shared."""
    return t.words.view(np.uint8 if t.words.itemsize == 1 else np.uint16)


def host_lanes_sum(lanes: np.ndarray, offset: int) -> int:
    """:func:`lanes_sum` of unsigned uint8/uint16 host lanes: the compiled kernel, else the reference
    (which imports torch)."""
    if lanes.size == 0:
        return 0
    k = cpu_kernels()
    if k is not None:
        return int(k.lanes_sum(lanes, offset, T_NP)) & MASK64
    import torch

    signed = lanes.view(np.int8 if lanes.dtype == np.uint8 else np.int16)
    return lanes_sum(torch.from_numpy(np.require(signed, requirements="W")), offset)


def run_lane_sums(buf: np.ndarray, base: int, end: int, starts: np.ndarray, stops: np.ndarray, lbs: np.ndarray,
                  done: np.ndarray, sums: np.ndarray, j: int, scratch: np.ndarray) -> int:
    """A keyframe shard's receive summed into its tensors' fingerprints: ``buf`` (uint8) holds the shard's bytes
    ``[base, end)``, ``base`` being where tensor ``j``'s first lane not yet summed (``done[j]``) begins; tensors
    ``j``, ``j+1``, ... (``[starts, stops)`` of the shard, ``lbs`` bytes a lane) have every whole lane received
    summed into ``sums`` (uint64, mod 2**64) and ``done`` moved on. Returns the tensor ``end`` falls in (or ends
    at). One compiled call when selected (:mod:`deltasync.kernels.lanesrun`); ``scratch``: uint16 room (not
    empty) a 2-byte-lane tensor at an odd byte of ``buf`` is copied through."""
    if scratch.size == 0:
        raise ValueError("run_lane_sums: scratch room is empty")
    if cpu_kernels() is not None:
        from .kernels import lanesrun

        return int(lanesrun.run_lane_sums(buf, base, end, starts, stops, lbs, done, sums, j, T_NP, scratch))
    while True:
        lb, s0, d = int(lbs[j]), int(starts[j]), int(done[j])
        upto = (min(int(stops[j]), end) - s0) // lb
        if upto > d:
            p = s0 + d * lb - base
            k = upto - d
            seg = buf[p : p + k * lb].copy().view(np.uint8 if lb == 1 else "<u2")
            sums[j] = np.uint64((int(sums[j]) + int(host_lanes_sum(seg, d))) & 0xFFFFFFFFFFFFFFFF)  # mod 2**64
            done[j] = upto
        if int(stops[j]) >= end:
            return j
        j += 1


def _host_fingerprint(t: HostTensor, executor) -> int:
    lanes = host_lanes(t)
    n = lanes.size
    if executor is not None and n > FP_SPLIT_LANES:
        parts = executor.map(lambda s: host_lanes_sum(lanes[s : s + FP_SPLIT_LANES], s), range(0, n, FP_SPLIT_LANES))
        return (sum(parts) + n * C0) & MASK64
    return (host_lanes_sum(lanes, 0) + n * C0) & MASK64


def copy_fingerprint(dst: torch.Tensor, src: torch.Tensor | np.ndarray, *, executor=None) -> int:
    """``dst`` := ``src``, and the fingerprint of what ``dst`` now holds: :func:`tensor_fingerprint` after a
    copy, in one pass over the bytes where the compiled CPU kernels run (a keyframe lands in a mapped
    file, or a shard is built, without a second read of either side).

    ``dst``: a contiguous tensor. ``src``: a tensor of ``dst``'s dtype and shape, or a numpy ``uint8``
    array of exactly its bytes (little-endian, e.g. a view of a safetensors shard). ``executor``: copy
    pieces of ``FP_SPLIT_LANES`` lanes on its threads (same result)."""
    nbytes = dst.numel() * dst.element_size()
    if isinstance(src, np.ndarray):
        if src.dtype != np.uint8 or src.size != nbytes:
            raise ValueError(f"copy_fingerprint: {src.size} source bytes ({src.dtype}) for a tensor of {nbytes} bytes")
    elif src.dtype != dst.dtype or tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_fingerprint: source {src.dtype} {tuple(src.shape)}, target {dst.dtype} {tuple(dst.shape)}")
    k = cpu_kernels()
    if k is None or dst.device.type != "cpu" or not dst.is_contiguous() or nbytes == 0 or \
            (not isinstance(src, np.ndarray) and src.device.type != "cpu"):
        import torch

        with torch.no_grad():
            if isinstance(src, np.ndarray):
                _lanes(dst).view(torch.uint8).copy_(torch.from_numpy(np.require(src, requirements="W")))
            else:
                dst.copy_(src)
        return tensor_fingerprint(dst, executor=executor)
    from .kernels import copy_lanes_sum_np

    dl = _lanes(dst.detach()).numpy()
    dl = dl.view(np.uint8 if dl.dtype == np.int8 else np.uint16)
    if isinstance(src, np.ndarray):
        sl = src.view(dl.dtype)
    else:
        sl = _lanes(src.detach().contiguous()).numpy().view(dl.dtype)
    n = dl.size
    if executor is not None and n > FP_SPLIT_LANES:
        parts = executor.map(lambda s: copy_lanes_sum_np(dl[s : s + FP_SPLIT_LANES], sl[s : s + FP_SPLIT_LANES], s),
                             range(0, n, FP_SPLIT_LANES))
        return (sum(parts) + n * C0) & MASK64
    return (copy_lanes_sum_np(dl, sl, 0) + n * C0) & MASK64


def words_range_delta(old_words: torch.Tensor, new_words: torch.Tensor, start: int, word_size: int) -> int:
    """Fingerprint change when words [start, start+len) go from ``old_words`` to ``new_words``
    (both flat signed word views of that range). Two streaming passes: cheaper than
    :func:`fingerprint_delta` once more than a few percent of the words change."""
    import torch

    per = max(word_size // 2, 1)
    lane_dt = torch.int8 if word_size == 1 else torch.int16
    lo = start * per
    return (lanes_sum(new_words.view(lane_dt), lo) - lanes_sum(old_words.view(lane_dt), lo)) & MASK64


def fingerprint_from_lane_sums(partial_sums, n_lanes: int) -> int:
    """A tensor's fingerprint from partial ``lanes_sum`` results that together cover all its
    ``n_lanes`` lanes (e.g. tensor-parallel shards, summed by an all-reduce)."""
    return (sum(partial_sums) + n_lanes * C0) & MASK64


def lanes_sum(lanes: torch.Tensor, offset: int) -> int:
    """sum_i lane_i * K(offset + i) mod 2**64 over a flat int8/int16 lane view: the compiled kernel on CPU, the
    Triton kernels on CUDA, else torch (:func:`deltasync.kernels.fpkeys.lanes_sum_torch`)."""
    if lanes.numel() == 0:
        return 0
    if lanes.device.type == "cpu" and (k := cpu_kernels()) is not None:  # compiled: one pass, no buffers
        import torch

        lanes = lanes.contiguous().view(torch.uint8 if lanes.dtype == torch.int8 else torch.uint16)
        return int(k.lanes_sum(lanes.numpy(), offset, T_NP)) & MASK64
    return lanes_sum_torch(lanes, offset, gpu=gpu_kernels(lanes))


def fingerprint_delta(
    positions: torch.Tensor, old_words: torch.Tensor, new_words: torch.Tensor, word_size: int
) -> int:
    """The change to a tensor's fingerprint when words at ``positions`` go from old to new.

    O(len(positions)); all three tensors live on one device (the tensor's own).
    """
    if positions.numel() == 0:
        return 0
    if positions.device.type == "cpu" and (k := cpu_kernels()) is not None:
        import torch

        udt = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[word_size]
        return int(k.fingerprint_delta(positions.contiguous().numpy(), old_words.contiguous().view(udt).numpy(),
                                       new_words.contiguous().view(udt).numpy(), 0 if word_size == 1 else word_size // 2,
                                       T_NP)) & MASK64
    return fingerprint_delta_torch(positions, old_words, new_words, word_size)


def update_fingerprint(fp: int, delta: int) -> int:
    return (fp + delta) & MASK64


def fp_hex(fp: int) -> str:
    return f"{fp & MASK64:016x}"


def parse_fp(text: str) -> int:
    return int(text, 16)


def state_fingerprint(records: Iterable[tuple[str, str, tuple[int, ...] | list[int], int]]) -> str:
    """xxh3-64 over sorted (name, dtype name, shape, tensor fp) records, as 16 hex digits."""
    recs = records if isinstance(records, list) else list(records)
    if len(recs) < max(LINES_MIN, 1):
        # one hash over the records' lines (the same digest as feeding them one by one: ~3x less Python per tensor)
        text = "".join([f"{name}{_tail(dtype, shape)}{fp & MASK64:016x}\n"
                        for name, dtype, shape, fp in sorted(recs, key=_first)])
        return xxhash.xxh3_64_hexdigest(text.encode())
    names, dtypes, shapes, fps = zip(*recs)
    try:
        values = np.fromiter(fps, np.uint64, len(fps))
    except (OverflowError, TypeError, ValueError):  # negative or wider than 64 bits: as the lines spell them
        values = np.fromiter((int(f) & MASK64 for f in fps), np.uint64, len(fps))
    return state_fingerprint_columns(names, dtypes, shapes, values)


#: records from which :func:`state_fingerprint` hashes through :class:`StateLines` (fewer: one line at a time)
LINES_MIN = 2048


class StateLines:
    """The text :func:`state_fingerprint` hashes for a layout (records' names, dtype names and shapes), every
    line but its fingerprint written once, in one buffer: the digest of the layout under a set of fingerprints
    is then a few array operations and one hash (~5 ms at 70,000 tensors, where making the lines took ~60)."""

    def __init__(self, names, dtypes, shapes) -> None:
        n = len(names)
        order = list(range(n)) if _ascending(names) else sorted(range(n), key=names.__getitem__)
        self.order = np.array(order, np.int64)
        shapes = [s if type(s) is tuple else tuple(s) for s in shapes]
        tails = {k: _tail(*k) for k in set(zip(dtypes, shapes))}
        get = itemgetter(*order) if n > 1 else (lambda seq: (seq[0],) if n else ())
        prefixes = list(map(add, get(names), map(tails.__getitem__, zip(get(dtypes), get(shapes)))))
        text = _PAD.join(prefixes) + _PAD if n else ""  # every line with 16 placeholder digits
        data = text.encode()
        if len(data) == len(text):
            lengths = np.fromiter(map(len, prefixes), np.int64, n)
        else:  # non-ASCII names: their UTF-8 lengths
            lengths = np.fromiter((len(p.encode()) for p in prefixes), np.int64, n)
        ends = np.cumsum(lengths + len(_PAD))
        self.hex_at = ends - len(_PAD)  # where each line's 16 digits start
        self.template = np.frombuffer(data, np.uint8)

    @classmethod
    def of_parts(cls, order: np.ndarray, hex_at: np.ndarray, template: np.ndarray) -> StateLines:
        """Lines made before (:attr:`order`, :attr:`hex_at`, :attr:`template`: a cache's), unchecked."""
        lines = cls.__new__(cls)
        lines.order, lines.hex_at, lines.template = order, hex_at, template
        return lines

    def describes(self, names, dtypes, shapes, samples: int = 256) -> bool:
        """Whether these lines are those of ``names``/``dtypes``/``shapes`` (their number, and ``samples`` lines
        spread over them compared byte for byte, the first and the last among them): a check for lines read back
        from a cache, not a proof."""
        n = len(names)
        if self.order.size != n or self.hex_at.size != n:
            return False
        if n == 0:
            return self.template.size == 0
        if self.template.size != int(self.hex_at[-1]) + len(_PAD):
            return False
        data = self.template.data
        for i in sorted({0, n - 1, *range(0, n, max(1, n // samples))}):
            r = int(self.order[i])
            if not 0 <= r < n:
                return False
            want = f"{names[r]}{_tail(dtypes[r], shapes[r])}".encode()  # (its digits: whatever was hashed last)
            start = int(self.hex_at[i - 1]) + len(_PAD) if i else 0
            end = int(self.hex_at[i])
            if end - start != len(want) or bytes(data[start:end]) != want or data[end + 16] != 10:
                return False
        return True

    def digest(self, fps: np.ndarray) -> str:
        """The state fingerprint with ``fps`` (uint64, in the records' order as given). With the compiled kernels,
        the lines are hashed a window at a time, each copied into one small buffer with its digits written in:
        the lines are only read (a cache's, mapped from its file, stay the file's pages), and no fresh copy of
        them (~10 MB at 140,000 tensors: more in page faults than the digits cost) is made."""
        k = cpu_kernels()
        if k is not None and self.order.size:
            fps = np.ascontiguousarray(fps, np.uint64)
            cuts, begins, size = self._windows()
            scratch = np.empty(size, np.uint8)
            h = xxhash.xxh3_64()
            template, hex_at, order = self.template, self.hex_at, self.order
            for j0, j1, b, e in zip(cuts, cuts[1:], begins, begins[1:]):
                buf = scratch[: e - b]
                buf[:] = template[b:e]
                k.state_hex(buf, hex_at[j0:j1] - b, fps, order[j0:j1])
                h.update(buf.data)
            return h.hexdigest()
        buf = self.template.copy()
        if self.order.size:
            nibbles = fps[self.order].astype(">u8").view(np.uint8).reshape(-1, 8)
            high, low = _HEX[nibbles >> 4], _HEX[nibbles & 15]
            at = self.hex_at
            for k in range(8):  # column by column: no index array of every digit (fresh pages cost)
                buf[at + 2 * k] = high[:, k]
                buf[at + 2 * k + 1] = low[:, k]
        return xxhash.xxh3_64_hexdigest(buf.data)

    def _windows(self) -> tuple[list[int], list[int], int]:
        """The lines cut into windows of about ``_WINDOW`` bytes at line ends: the first line of each (and the
        count), the byte where each starts (and the end), and the largest window's bytes (made once)."""
        got = self.__dict__.get("_cuts")
        if got is None:
            ends = self.hex_at + len(_PAD)
            total = int(ends[-1])
            cuts = np.unique(np.r_[0, np.searchsorted(ends, np.arange(_WINDOW, total, _WINDOW), side="right"),
                                   ends.size]).tolist()
            begins = [int(ends[j - 1]) if j else 0 for j in cuts]
            got = self._cuts = (cuts, begins, max(e - b for b, e in zip(begins, begins[1:])))
        return got


_WINDOW = 1 << 18  # bytes of state lines hashed at a time (StateLines.digest)


def _tail(dtype: str, shape) -> str:
    """What follows a tensor's name on its state line, before its 16 hex digits (one spelling of the line for
    :func:`state_fingerprint` and :class:`StateLines`)."""
    return f"\x00{dtype}\x00{','.join(map(str, map(int, shape)))}\x00"


def _ascending(names) -> bool:
    """Whether ``names`` are in sorted order already (a codec's columns are): no sort to make."""
    return all(map(le, names, islice(names, 1, None)))


_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_PAD = "0" * 16 + "\n"
_LINES: list[tuple[tuple, tuple, tuple, StateLines]] = []  # the last few layouts' lines, by their columns


def state_fingerprint_columns(names, dtypes, shapes, fps: np.ndarray) -> str:
    """:func:`state_fingerprint` of records given as columns (sequences of names, dtype names, shapes; ``fps``
    uint64), the layout's :class:`StateLines` kept for the next call with the same layout (a stream's states
    keep theirs step after step; comparing the columns with the last ones costs ~1 ms at 70,000 tensors)."""
    names, dtypes, shapes = tuple(names), tuple(dtypes), tuple(map(tuple, shapes))
    for k, (a, b, c, lines) in enumerate(_LINES):
        if a == names and b == dtypes and c == shapes:
            if k:
                _LINES.insert(0, _LINES.pop(k))
            return lines.digest(fps)
    lines = StateLines(names, dtypes, shapes)
    _LINES.insert(0, (names, dtypes, shapes, lines))
    del _LINES[3:]
    return lines.digest(fps)


def _first(record):
    return record[0]


def fingerprint_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Full fingerprints of every tensor in a state dict."""
    return {name: tensor_fingerprint(t) for name, t in tensors.items()}


def state_fingerprint_of(tensors: Mapping[str, torch.Tensor], fps: Mapping[str, int] | None = None) -> str:
    fps = fps if fps is not None else fingerprint_state(tensors)
    records = getattr(tensors, "records", None)  # a mapped file's HostState: its header's records, no pass over it
    if records is not None:
        return state_fingerprint((name, dtype, shape, fps[name]) for name, dtype, shape in records())
    return state_fingerprint(
        (name, dtype_info(t.dtype).name, tuple(t.shape), fps[name]) for name, t in tensors.items()
    )


class NameIndex:
    """A fixed list of tensor names and each one's row, made once per layout and shared by every
    :class:`FingerprintTable` of it. :meth:`rows` maps another list of names (a step's table, a patch plan) to
    rows, remembering the last few lists it was asked for (kept, not copied: a list mapped is not changed after):
    a step of a 1%-changed AdamW state lists every tensor, in the same order, step after step."""

    __slots__ = ("names", "index", "_memo", "_all")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.index = dict(zip(names, range(len(names))))
        if len(self.index) != len(names):
            raise ValueError("a name is listed twice")
        self._memo: list[tuple[list[str], np.ndarray]] = []  # (names, rows), the latest last
        self._all: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.names)

    def rows(self, names: list[str]) -> np.ndarray | None:
        """The rows of ``names`` (int64, read-only), or None if one is not here."""
        if names is self.names:
            return self._every()
        for known, rows in self._memo:
            if known is names:
                return rows
        for known, rows in self._memo:  # the same names in another list (the next step's table): compared, not hashed
            if len(known) == len(names) and known == names:
                self._memo = [*self._memo[-3:], (names, rows)]
                return rows
        if len(names) == len(self.names) and names == self.names:
            rows = self._every()
        else:
            try:
                rows = np.fromiter(map(self.index.__getitem__, names), np.int64, len(names))
            except KeyError:
                return None
            rows.flags.writeable = False
        self._memo = [*self._memo[-3:], (names, rows)]  # (strong references: an id is never reused)
        return rows

    def _every(self) -> np.ndarray:
        if self._all is None:
            self._all = np.arange(len(self.names), dtype=np.int64)
            self._all.flags.writeable = False
        return self._all


class FingerprintTable(Mapping):
    """The fingerprints of a layout's tensors as one uint64 array in the rows of a :class:`NameIndex`: a mapping
    name -> int for every reader, and arrays for the hot paths (a step of 140,000 tensors reads and writes them
    with no Python int per tensor: :meth:`take`, :meth:`replaced`). Immutable: a change makes a new table."""

    __slots__ = ("names", "values")

    def __init__(self, names: NameIndex, values: np.ndarray) -> None:
        if values.dtype != np.uint64 or values.shape != (len(names),):
            raise ValueError("a fingerprint table holds one uint64 per name")
        values.flags.writeable = False
        self.names = names
        self.values = values

    @classmethod
    def of(cls, names: NameIndex, fps: Mapping[str, int]) -> FingerprintTable | None:
        """``fps`` (a mapping of exactly these names) as a table; None if it names others."""
        if type(fps) is cls and fps.names is names:
            return fps
        if len(fps) != len(names):
            return None
        try:
            return cls(names, np.fromiter(map(fps.__getitem__, names.names), np.uint64, len(names)))
        except (KeyError, OverflowError, TypeError, ValueError):  # another name, or not a 64-bit fingerprint
            return None

    def __getitem__(self, name: str) -> int:
        return int(self.values[self.names.index[name]])

    def __contains__(self, name) -> bool:
        return name in self.names.index

    def __iter__(self):
        return iter(self.names.names)

    def __len__(self) -> int:
        return len(self.names.names)

    def take(self, names: list[str]) -> np.ndarray | None:
        """The fingerprints of ``names`` (uint64), or None if one is not here."""
        if names is self.names.names:
            return self.values
        rows = self.names.rows(names)
        return None if rows is None else self.values[rows]

    def replaced(self, rows: np.ndarray, values: np.ndarray) -> FingerprintTable:
        """A table with ``values`` at ``rows`` (the others kept)."""
        out = self.values.copy()
        out[rows] = values
        return FingerprintTable(self.names, out)
