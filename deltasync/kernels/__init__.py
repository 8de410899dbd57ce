"""Compiled kernels for the codec's hot loops, and the one switch between them and the reference.

Two implementations of the same loops, bit for bit equal (``tests/core/test_core_kernels.py``):

* ``"numba"`` (default when numba imports): :mod:`deltasync.kernels.cpu`, ``@njit(nogil=True,
  cache=True)`` loops, O(1) compiled work per changed word; callers run chunks on their own
  executor's threads (the GIL is released), the core starts no thread.
* ``"reference"``: today's numpy/torch code (``deltasync.positions``, ``deltasync.values``,
  ``deltasync.fingerprint``), the specification the kernels are tested against.

CUDA tensors take the Triton kernels of :mod:`deltasync.kernels.gpu` when triton imports
(else torch), whatever the selection. :func:`triton_on_cpu` (tests only) sends CPU tensors down those
paths, for Triton's interpreter (``tests/core/test_triton_kernels.py``).

**The switch.** :func:`select` (``"numba"``, ``"reference"`` or ``"auto"``) is the only way to
change the selection; the core never reads the environment: the CLI calls
``select(os.environ.get("DELTASYNC_KERNELS", "auto"))``. :func:`active` names the selection.

**API** (numpy arrays of unsigned words, int64 positions; each function dispatches on the
selection and returns exactly what its reference returns):

=============================================  ===============================================
``diff_words(o, n, start, word_size,           changed words of a chunk: (positions, old, new,
update_old=False)``                            fingerprint change); ``codec.diff_chunk`` on CPU
``diff_span(o, n, first, last, word_size,      changed words of a span of a tensor, and the lanes
want_lanes=, update_old=)``                    sum of its old words, one pass (numba only)
``diff_jobs(spans, word_size, ...)``           ``diff_span`` of many tensors' spans in one call (numba only)
``changes_from_words(positions, old, new,      ``values.changes_from_words``
is_float=)``
``encode_values(changes)`` /                   ``values.encode_values`` / ``decode_values``
``decode_values(positions, sym, tok, ext,
raw, word_size)``
``encode_gaps`` / ``decode_gaps`` /            ``positions.*``
``encode_bitmap`` / ``decode_bitmap``
``apply_changes_np(words, changes)``           ``values.apply_changes_np``
``patch_words(words, changes, word_size)``     in-place patch of a live tensor's words: (old
                                               words, fingerprint change read back) (apply.py)
``lanes_sum_np(lanes, offset)``                ``fingerprint.lanes_sum`` of host lanes
``copy_lanes_sum_np(dst, src, offset)``        ``dst[:] = src`` and the ``lanes_sum`` of it, one pass
``fingerprint_delta_np(positions, old, new,    ``fingerprint.fingerprint_delta`` on the host
word_size)``
``patch_chunk(words, changes, word_size)``     ``patch_words`` in one prefetching pass (apply.py)
``patch_jobs(jobs, like, old, fpds, w)``       ``patch_chunk`` of many tensors' chunks in one call (apply.py)
``unpatch_jobs(jobs, old, offsets, w)``        ``patch_jobs`` undone: its old words written back, last job first
``gather_words`` / ``scatter_words``           ``out[:] = words[pos]`` / ``words[pos] = src`` (the
                                               ``--out`` journal, undo records)
``journal_gather(words, pos, start, stop,      a sparse chunk's ``--out`` undo record in one pass:
rel, old)``                                    uint32 offsets and old words (tests/client/test_tail_journal.py)
=============================================  ===============================================

The ans chunks' whole-blob decode is :func:`deltasync.entropy.decode_ans_chunks` (it calls the compiled
kernel itself: this package imports none of its callers). The one-pass patch and gather/scatter are tested in ``tests/core/test_kernels_apply.py``.
"""

from __future__ import annotations

import threading

import numpy as np

from ..errors import FormatError
from .cache import load_cached_directly
from .fpkeys import T_NP

_MASK64 = (1 << 64) - 1
_CHOICES = ("auto", "numba", "reference")
_selected: str | None = None  # resolved lazily: numba when it imports
_cpu = None


def select(name: str = "auto", *, lazy: bool = False) -> str:
    """Choose the CPU kernels: ``"numba"``, ``"reference"`` or ``"auto"`` (numba when it imports).
    Returns the resolved name; asking for numba where it does not import raises ImportError.
    ``lazy=True`` with ``"auto"`` defers the choice (and numba's import) to the first kernel call."""
    global _selected, _cpu
    name = (name or "auto").strip().lower()
    if name not in _CHOICES:
        raise ValueError(f"kernels must be one of {_CHOICES}, found {name!r} (DELTASYNC_KERNELS?)")
    if name == "auto" and lazy:  # resolved at the first kernel call: a server never imports numba
        _selected, _cpu = None, None
        return name
    if name == "reference":
        _selected, _cpu = "reference", None
        return _selected
    try:
        from . import cpu as mod
    except ImportError:
        if name == "numba":
            raise ImportError("DELTASYNC_KERNELS=numba but numba does not import; pip install numba, "
                              "or select 'reference'") from None
        _selected, _cpu = "reference", None
        return _selected
    load_cached_directly(vars(mod))
    _selected, _cpu = "numba", mod
    return _selected


def active() -> str:
    if _selected is None:
        select("auto")
    return _selected


def cpu_kernels():
    """The numba kernel module when selected, else None (use the reference)."""
    if _selected is None:
        select("auto")
    return _cpu


_gpu = False  # not yet imported
_triton_on_cpu = False  # tests only (triton_on_cpu)


def triton_on_cpu(on: bool = True) -> None:
    """Tests only: CPU torch tensors take the core's CUDA paths (compared on their device, only the sparse
    result to the host, and the Triton kernels of :mod:`deltasync.kernels.gpu`), in a process started with
    ``TRITON_INTERPRET=1``, where Triton's interpreter runs the kernels on CPU tensors
    (``tests/core/test_triton_kernels.py``). Select ``"reference"`` too, or the compiled CPU kernels take those
    tensors first. Raises ImportError where triton does not import."""
    global _triton_on_cpu, _gpu
    if on:
        from . import gpu as mod

        if mod.triton is None:
            raise ImportError("triton_on_cpu needs triton (pip install triton)")
        _gpu = mod
    _triton_on_cpu = bool(on)


def on_host(device) -> bool:
    """Whether the core treats tensors on ``device`` as host memory (numpy words, the CPU kernels): the CPU,
    unless :func:`triton_on_cpu` routes it to the CUDA paths."""
    return device.type == "cpu" and not _triton_on_cpu


def gpu_kernels(t):
    """:mod:`deltasync.kernels.gpu` for a tensor on CUDA when triton imports, else None (torch)."""
    global _gpu
    if t.device.type != "cuda" and not (_triton_on_cpu and t.device.type == "cpu"):
        return None
    if _gpu is False:
        try:
            from . import gpu as mod
        except ImportError:
            mod = None
        _gpu = mod if mod is not None and mod.triton is not None else None
    return _gpu


def _table() -> np.ndarray:
    return T_NP


_local = threading.local()
_BUFFER_WORDS = 1 << 16


def _buffer() -> np.ndarray:
    """This thread's reused index buffer (a fresh big allocation per chunk costs page faults)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = np.empty(_BUFFER_WORDS + 64, np.int64)
    return buf


def _per(word_size: int) -> int:
    return 0 if word_size == 1 else word_size // 2


# -- compare ---------------------------------------------------------------------------------------

def diff_words(o: np.ndarray, n: np.ndarray, start: int, word_size: int, update_old: bool = False):
    """(positions, old, new, fingerprint change) of the words that differ between ``o`` and ``n``
    (unsigned word arrays of one chunk starting at ``start``); None when nothing changed."""
    k = cpu_kernels()
    if k is not None:
        buf = _buffer()
        parts = []
        at = 0
        while at < o.size:
            count, at = k.compare_words(o, n, buf, at)
            if count:
                parts.append(buf[:count].copy())
        if not parts:
            return None
        rel = parts[0] if len(parts) == 1 else np.concatenate(parts)
        pos, ow, nw, fpd = k.gather_changes(o, n, rel, start, _per(word_size), _table())
        if update_old:
            o[pos - start] = nw
        return pos, ow, nw, int(fpd)
    import torch

    from .fpkeys import fingerprint_delta_torch as fingerprint_delta

    rel = np.flatnonzero(o != n)
    if rel.size == 0:
        return None
    sdt = np.dtype(f"i{word_size}")
    ow, nw = o[rel], n[rel]
    p = rel + start
    fpd = fingerprint_delta(torch.from_numpy(p), torch.from_numpy(ow.view(sdt)), torch.from_numpy(nw.view(sdt)),
                            word_size)
    if update_old:
        o[rel] = nw
    return p, ow, nw, fpd


# -- K: whole spans ---------------------------------------------------------------------------------

_DUMMY: dict[np.dtype, np.ndarray] = {}  # the kernel's write target when it writes nothing (o may be read-only)


_SAMPLES = 1024  # words a span of at least _SAMPLE_SPAN is sampled at to size diff_span's outputs
_SAMPLE_SPAN = 1 << 20


def _estimated_changes(o: np.ndarray, n: np.ndarray, first: int, last: int) -> int:
    """Output room for ``diff_span`` over [first, last): from the changed share of ``_SAMPLES`` evenly spaced
    words for a long span (with a margin, so that it rarely grows: each doubling copies the outputs and
    faults in fresh pages), ``length / 128`` for a short one."""
    length = last - first
    if length < _SAMPLE_SPAN:
        return max(1024, length // 128)
    step = length // _SAMPLES
    changed = int(np.count_nonzero(o[first:last:step] != n[first:last:step]))
    return 1024 + (length * (changed + 4) * 5) // (4 * _SAMPLES)


def diff_span(o: np.ndarray, n: np.ndarray, first: int, last: int, word_size: int, *, want_lanes: bool = False,
              update_old: bool = False, cap: int = 0):
    """Numba only: the changed words of ``o``/``n`` (one tensor's whole unsigned word arrays) in
    [first, last), in one pass: (positions, old, new, fingerprint change, lanes sum of the old words or
    None). Arrays are trimmed to the count (copied when the buffer was over twice that)."""
    k = cpu_kernels()
    ol = o if word_size <= 2 else o.view(np.uint16)
    if cap <= 0:
        cap = _estimated_changes(o, n, first, last)
    if update_old:
        dst = o
    else:
        dst = _DUMMY.get(o.dtype)
        if dst is None:
            dst = _DUMMY[o.dtype] = np.zeros(1, o.dtype)
    pos, ow, nw, count, fpd, total = k.diff_span(o, n, ol, dst, first, last, _per(word_size), _table(), want_lanes,
                                                 update_old, cap)
    if pos.size > 2 * count + 1024:
        pos, ow, nw = pos[:count].copy(), ow[:count].copy(), nw[:count].copy()
    else:
        pos, ow, nw = pos[:count], ow[:count], nw[:count]
    return pos, ow, nw, int(fpd), int(total) if want_lanes else None


_DIFF_ROOM = 1024  # diff_jobs's first output room: one entry per this many words (it grows by projection)


def diff_jobs(spans: list[tuple[np.ndarray, np.ndarray, int, int]], word_size: int, *, want_lanes: bool = False,
              update_old: bool = False):
    """Numba only: :func:`diff_span` of many spans ``(o, n, first, last)`` (whole unsigned word arrays of
    tensors of one word size, C-contiguous; with ``update_old`` ``o`` is written) in one compiled call:
    [(positions, old, new, fingerprint change, lanes sum of the old words or None)] per span, views of
    shared arrays."""
    if not spans:
        return []
    if not all(o.flags.c_contiguous and n.flags.c_contiguous and o.dtype == n.dtype == spans[0][0].dtype
               and (o.flags.writeable or not update_old)
               for o, n, _, _ in spans):  # addressed words must be plain (and writeable) arrays: one call per span then
        return [diff_span(o, n, a, b, word_size, want_lanes=want_lanes, update_old=update_old) for o, n, a, b in spans]
    k = cpu_kernels()
    like = np.empty(0, spans[0][0].dtype)
    lane_like = like if word_size <= 2 else np.empty(0, np.uint16)
    addr = k.address
    jobs = np.array([(addr(o), addr(n), o.size, first, last) for o, n, first, last in spans],
                    dtype=np.int64).reshape(-1, 5)
    cap = 1024 + int((jobs[:, 4] - jobs[:, 3]).sum()) // _DIFF_ROOM
    pos, ow, nw, offsets, fpds, totals = k.diff_jobs(jobs, like, lane_like, _table(), _per(word_size), want_lanes,
                                                     update_old, cap)
    found = int(offsets[-1])
    if pos.size > 2 * found + 4096:  # mostly unused room: keep only what was found
        pos, ow, nw = pos[:found].copy(), ow[:found].copy(), nw[:found].copy()
    out = []
    bounds = offsets.tolist()
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        out.append((pos[a:b], ow[a:b], nw[a:b], int(fpds[j]), int(totals[j]) if want_lanes else None))
    return out


# -- values ----------------------------------------------------------------------------------------

def changes_from_words(positions: np.ndarray, old: np.ndarray, new: np.ndarray, *, is_float: bool):
    from ..values import Changes, _raw_limit, changes_from_words as ref

    k = cpu_kernels()
    if k is None:
        return ref(positions, old, new, is_float=is_float)
    raw, values = k.changes_from_words(old, new, _raw_limit(old.dtype.itemsize * 8), bool(is_float))
    return Changes(positions=positions, raw=raw, values=values)


def encode_values(changes):
    from ..values import encode_values as ref

    k = cpu_kernels()
    if k is None:
        return ref(changes)
    packed, tokens, ext, raw, err = k.encode_values(np.ascontiguousarray(changes.raw),
                                                    np.ascontiguousarray(changes.values))
    if err:
        raise ValueError("a zero step is not a change")
    return packed, tokens, ext, raw


_VALUE_ERRORS = {
    1: "values: symbol bytes do not match the change count (found {d} bytes)",
    2: "values: padding symbols must be 0",
    3: "values: symbol 3 is reserved",
    4: "values: {d} changes need a token, found another number of tokens",
    5: "values: token {d} is reserved",
    6: "values: {d} raw tokens but another number of raw words",
    7: "varint stream: expected {d} values (truncated or corrupt)",
    8: "varint stream: a value is longer than 10 bytes",
    9: "values: a step larger than the word",
    20: "gap stream: expected another number of gaps, found {d}",
    21: "gap stream: a gap leaves the chunk",
    22: "gap stream: position {d} outside the chunk",
    30: "bitmap: wrong byte count for the chunk (found {d} bytes)",
    31: "bitmap: bits set past the end of the chunk",
    32: "bitmap: expected another number of set bits, found {d}",
}


def _raise(code: int, detail: int) -> None:
    raise FormatError(_VALUE_ERRORS.get(int(code), "malformed chunk streams (code {c})").format(d=int(detail), c=code))


def decode_values(positions, packed, tokens, ext, raw_words, word_size: int):
    from ..dtypes import numpy_word_dtype
    from ..values import Changes, decode_values as ref

    k = cpu_kernels()
    if k is None:
        return ref(positions, packed, tokens, ext, raw_words, word_size)
    wdt = numpy_word_dtype(word_size)
    raw, values, err, detail = k.decode_values(np.ascontiguousarray(packed, np.uint8),
                                               np.ascontiguousarray(tokens, np.uint8),
                                               np.ascontiguousarray(ext, np.uint8),
                                               np.ascontiguousarray(raw_words, wdt), positions.size, word_size * 8)
    if err:
        _raise(err, detail)
    return Changes(positions=positions, raw=raw, values=values)


def apply_changes_np(words: np.ndarray, changes) -> None:
    from ..values import apply_changes_np as ref

    k = cpu_kernels()
    if k is None or not words.flags.writeable:
        return ref(words, changes)
    if changes.positions.size and (changes.positions.min() < 0 or changes.positions.max() >= words.size):
        raise IndexError(f"change positions leave an array of {words.size} words")
    k.apply_changes(words, changes.positions, changes.raw, changes.values.astype(words.dtype, copy=False))


# -- positions -------------------------------------------------------------------------------------

def encode_gaps(positions: np.ndarray):
    from ..positions import encode_gaps as ref

    k = cpu_kernels()
    return ref(positions) if k is None else k.encode_gaps(np.ascontiguousarray(positions, np.int64))


def decode_gaps(small, big, count: int, length: int) -> np.ndarray:
    from ..positions import decode_gaps as ref

    k = cpu_kernels()
    if k is None:
        return ref(small, big, count, length)
    out, err, detail = k.decode_gaps(np.ascontiguousarray(small, np.uint8), np.ascontiguousarray(big, np.uint8),
                                     count, length)
    if err:
        _raise(err, detail)
    return out


def encode_bitmap(positions: np.ndarray, length: int) -> np.ndarray:
    from ..positions import encode_bitmap as ref

    k = cpu_kernels()
    return ref(positions, length) if k is None else k.encode_bitmap(np.ascontiguousarray(positions, np.int64), length)


def decode_bitmap(packed, count: int, length: int) -> np.ndarray:
    from ..positions import decode_bitmap as ref

    k = cpu_kernels()
    if k is None:
        return ref(packed, count, length)
    out, err, detail = k.decode_bitmap(np.ascontiguousarray(packed, np.uint8), count, length)
    if err:
        _raise(err, detail)
    return out


# -- patching and fingerprints -----------------------------------------------------------------------

def patch_words(words: np.ndarray, changes, word_size: int):
    """Patch a live tensor's unsigned host words in place with the numba kernel:
    (old words for undo, fingerprint change computed from the words read back). Numba only:
    the reference patch is the torch code in ``deltasync.apply``."""
    k = cpu_kernels()
    if k is None:
        raise RuntimeError("patch_words needs the numba kernels")
    old, fpd, bad = k.patch_words(words, changes.positions, changes.raw,
                                  changes.values.astype(words.dtype, copy=False), _per(word_size), _table())
    if bad >= 0:  # nothing was written; the apply loop turns this into an ApplyError and rolls back
        raise IndexError(f"change position {int(changes.positions[bad])} is outside a tensor of {words.size} words")
    return old, int(fpd)


def copy_range_delta(dst: np.ndarray, src: np.ndarray, start: int, word_size: int) -> int:
    """``dst[:] = src`` (a dense chunk at word ``start``) and the fingerprint change. Numba only."""
    return int(cpu_kernels().copy_range_delta(dst, src, start, _per(word_size), _table()))


def lanes_sum_np(lanes: np.ndarray, offset: int) -> int:
    """sum_i lane_i * K(offset + i) mod 2**64 over unsigned uint8/uint16 host lanes. Numba only."""
    return int(cpu_kernels().lanes_sum(lanes, offset, _table()))


def copy_lanes_sum_np(dst: np.ndarray, src: np.ndarray, offset: int) -> int:
    """``dst[:] = src`` over unsigned uint8/uint16 host lanes and their ``lanes_sum`` (one pass). Numba only."""
    return int(cpu_kernels().copy_lanes_sum(dst, src, offset, _table()))


def fingerprint_delta_np(positions: np.ndarray, old: np.ndarray, new: np.ndarray, word_size: int) -> int:
    """Fingerprint change of words at ``positions`` going from ``old`` to ``new`` (unsigned host words)."""
    k = cpu_kernels()
    if k is None:
        import torch

        from .fpkeys import fingerprint_delta_torch as fingerprint_delta

        sdt = np.dtype(f"i{word_size}")
        return fingerprint_delta(torch.from_numpy(positions), torch.from_numpy(old.view(sdt)),
                                 torch.from_numpy(new.view(sdt)), word_size)
    return int(k.fingerprint_delta(positions, old, new, _per(word_size), _table())) & _MASK64


# -- A: whole-chunk decode, fused patch, journal gather ------------------------------------------------

def patch_chunk(words: np.ndarray, changes, word_size: int):
    """:func:`patch_words` in one pass (the compiled kernel ``patch_chunk``): (old words, fingerprint change
    from the words read back). Numba only; raises IndexError, writing nothing, on a position out of range."""
    k = cpu_kernels()
    if k is None:
        raise RuntimeError("patch_chunk needs the numba kernels")
    old = np.empty(changes.positions.size, words.dtype)
    fpd, bad = k.patch_chunk(words, changes.positions, changes.raw, changes.values.astype(words.dtype, copy=False),
                             old, _per(word_size), _table())
    if bad >= 0:
        raise IndexError(f"change position {int(changes.positions[bad])} is outside a tensor of {words.size} words")
    return old, int(fpd)


def patch_jobs(jobs: np.ndarray, like: np.ndarray, old: np.ndarray, fpds: np.ndarray, word_size: int) -> tuple[int, int]:
    """:func:`patch_chunk` of many chunks in one compiled call (``cpu.patch_jobs``: rows of addresses, see there):
    (-1, 0), or (job, index) of the first out-of-range position (that job and later ones wrote nothing). Numba only."""
    j, k = cpu_kernels().patch_jobs(jobs, like, old, fpds, _per(word_size), _table())
    return int(j), int(k)


def unpatch_jobs(jobs: np.ndarray, old: np.ndarray, offsets: np.ndarray, word_size: int) -> None:
    """Undo :func:`patch_jobs`: the same jobs run again, last first, each writing its old words back (``old``, job
    after job from ``offsets[j]``, as :func:`patch_jobs` left them) as raw values. Their positions were checked
    when they ran. Numba only."""
    if jobs.shape[0] == 0:
        return
    back = jobs[::-1].copy()
    ones = np.ones(max(int(jobs[:, 5].max()), 1), dtype=np.uint8)
    back[:, 3] = ones.ctypes.data
    back[:, 4] = (old.ctypes.data + offsets[:-1] * word_size)[::-1]
    patch_jobs(back, old[:0], np.empty(old.size, old.dtype), np.zeros(back.shape[0], np.uint64), word_size)


def gather_words(words: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = words[positions]`` (positions in range: the caller checks); compiled when selected."""
    k = cpu_kernels()
    if k is None:
        np.take(words, positions, out=out)
    else:
        k.gather_words(words, positions, out)


def scatter_words(words: np.ndarray, positions: np.ndarray, src: np.ndarray) -> None:
    """``words[positions] = src``; compiled when selected."""
    k = cpu_kernels()
    if k is None:
        words[positions] = src
    else:
        k.scatter_words(words, positions, src)


# -- P: a command's cold start -------------------------------------------------------------------

_warmed = False
_warm_lock = threading.Lock()


def warm_up() -> str:
    """Get the selected CPU kernels ready to run, so that their first call costs only loading its cached code.

    For a command's start (``deltasync publish`` runs it on a thread of its own while it reads its options,
    keys and files): resolves the selection (imports numba when it is chosen) and initialises numba's runtime
    and code generator, which the first kernel call would otherwise do under numba's compile lock. numba's
    registries are not loaded (see :func:`_load_cached`). Idempotent and thread-safe; returns :func:`active`."""
    global _warmed
    name = active()
    with _warm_lock:
        if _warmed or name != "numba":
            _warmed = True
            return name
        from numba.core.compiler_lock import global_compiler_lock
        from numba.core.registry import cpu_target
        from numba.core.runtime import rtsys

        with global_compiler_lock:
            rtsys.initialize(cpu_target.target_context)
        _warmed = True
    return name


# -- Q: the --out undo journal ---------------------------------------------------------------------

REL_MAX = 1 << 32  # a chunk's words: its journal record's offsets are uint32


def journal_gather(words: np.ndarray, positions: np.ndarray, start: int, stop: int, rel: np.ndarray,
                   old: np.ndarray) -> int:
    """A sparse chunk's undo record: ``rel[:] = positions - start`` (uint32) and ``old[:] = words[positions]``,
    one compiled pass when selected. Returns the index of the first position outside ``[start, stop)`` or -1
    (``rel``/``old`` are then unfinished). ``stop <= words.size``, ``stop - start <= REL_MAX``: the caller's."""
    if stop > words.size or stop - start > REL_MAX:
        raise ValueError(f"journal_gather: chunk [{start}:{stop}] of {words.size} words")
    k = cpu_kernels()
    if k is not None:
        return int(k.journal_gather(words, positions, start, stop, rel, old))
    bad = np.flatnonzero((positions < start) | (positions >= stop))
    if bad.size:
        return int(bad[0])
    np.subtract(positions, start, out=rel, casting="unsafe")
    np.take(words, positions, out=old)
    return -1


def journal_columns(words: np.ndarray, flat: np.ndarray, at: np.ndarray, counts: np.ndarray, starts: np.ndarray,
                    stops: np.ndarray, first: np.ndarray, rel: np.ndarray, old: np.ndarray) -> tuple[int, int]:
    """Many sparse chunks' undo records in one pass (jrnl03's group of one word size): for chunk row ``j``, its
    changes ``flat[at[j] : at[j] + counts[j]]`` give ``rel = p - starts[j]`` (uint32) and ``old = words[first[j] +
    p]``, row after row. Returns (-1, 0), or (row, index) of the first change outside its ``[starts, stops)``
    (``rel``/``old`` are then unfinished). ``first + stops <= words.size`` and ``stops - starts <= REL_MAX`` per
    row: the caller's; the rows' ranges of ``flat`` are checked here. Compiled when selected
    (:mod:`deltasync.kernels.journal`)."""
    if at.size and (int((at + counts).max()) > flat.size or int(at.min()) < 0):
        raise ValueError("journal_columns: a chunk's changes leave the flat positions")
    if int(counts.sum()) > min(rel.size, old.size):
        raise ValueError("journal_columns: the output is shorter than the changes")
    if cpu_kernels() is not None:
        from . import journal

        j, k = journal.journal_columns(words, flat, at, counts, starts, stops, first, rel, old)
        return int(j), int(k)
    n = int(counts.sum())
    ends = np.cumsum(counts)
    pos = flat[np.arange(n, dtype=np.int64) + np.repeat(at - (ends - counts), counts)].astype(np.int64)
    begin = np.repeat(starts, counts)
    bad = np.flatnonzero((pos < begin) | (pos >= np.repeat(stops, counts)))
    if bad.size:
        j = int(np.searchsorted(ends, int(bad[0]), side="right"))
        return j, int(bad[0]) - int(ends[j] - counts[j])
    np.subtract(pos, begin, out=rel[:n], casting="unsafe")
    np.take(words, pos + np.repeat(first, counts), out=old[:n])
    return -1, 0
