"""Compile every CPU kernel into numba's on-disk cache, before the first process needs it.

The kernels (:mod:`deltasync.kernels.cpu`, :mod:`deltasync.kernels.rans`, :mod:`deltasync.conditioned`) are
``cache=True`` numba functions: each signature is compiled once, at its first call, and written to
numba's cache (``__pycache__`` beside the module, or ``NUMBA_CACHE_DIR``); every later process loads
the machine code. Compiling them all takes ~1 CPU-minute here. On a fresh install that cost fell on the
first processes to run: in a fresh clone's first ``make demo`` the trainer's first publish was blocked
6.2 s and the subscribers sat at v0 for 16 steps. :func:`compile_kernels` pays it once, up front
(``deltasync compile-kernels``; the Makefile's set-up and the Dockerfile run it).

It runs the flows the commands and the library run, on small states of every dtype the codec codes
(one per word width would miss signatures that differ by the element type a caller's view carries):
a publisher's compare and encode in both codings (and format 1, and a budgeted plan), from torch tensors
and from a file's host words, at three densities (sparse, medium, most of a chunk); a subscriber's decode,
patch and rollback; a relay's squash; the fingerprints of a keyframe received into a file; the ``--out``
undo journal's gather. With every signature cached already it only loads them (~1 s in all). ``tests/core/test_precompile.py`` checks, in an empty cache,
that the CLI's publish, subscribe, squash and diff compile nothing after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from . import kernels
from .apply import apply_prepared, prepare_delta
from .budget import BudgetPolicy, Budgeter
from .codec import EncodeOptions, diff_ranks, diff_states, encode_diff
from .errors import IntegrityError
from .dtypes import HostTensor, dtype_info, host_words, numpy_word_dtype, signed_word_dtype
from .fingerprint import (StateLines, copy_fingerprint, host_lanes, host_lanes_sum, lane_bits, lanes_sum, run_lane_sums,
                          tensor_fingerprint)
from .squash import squash_chain

#: every dtype name the codec codes word by word (bool has no random words to draw; complex types share
#: their word width's plain dtype)
DTYPES = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
          "int8", "uint8", "int16", "int32", "int64")
WORDS = 1 << 14  # per tensor; the codec's chunks are larger, so each tensor is one chunk
#: changed words per 1000: sparse (positions as gaps), medium (the ans steps), most (a rewritten chunk)
DENSITIES = (2, 40, 700)


def compile_kernels(report: Callable[[str], None] | None = None) -> int:
    """Run every kernel once per signature the commands use; returns the number of dtypes done.
    ``report`` gets one line per dtype (the CLI prints them: a cold compile takes ~1 min on 2 cores).
    A no-op (returns 0) where the compiled kernels are not selected (``DELTASYNC_KERNELS=reference``)."""
    if kernels.cpu_kernels() is None:
        return 0
    names = [n for n in DTYPES if _known(n)]
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        _dtype_flows(name)
        if report is not None:
            report(f"[{i + 1}/{len(names)}] {name}: {time.perf_counter() - t0:.1f} s")
    _rank_map_flow()
    lines, fps = StateLines(["a", "b"], ["bfloat16"] * 2, [(WORDS,), (1,)]), np.arange(2, dtype=np.uint64)
    lines.digest(fps)  # the state fingerprint's digits: of a diff's fingerprints
    fps.flags.writeable = False
    lines.digest(fps)  # and of a FingerprintTable's (read-only)
    _header_flow()
    return len(names)


def _header_flow() -> None:
    """A safetensors header of as many entries as take the compiled entries kernel (a first ``subscribe --out`` of
    a seed-scale model builds its file's header with it)."""
    from .tensorfile import ENTRIES_KERNEL_MIN, build_header

    build_header({f"t{i:05d}": ("bfloat16", (2, 3)) for i in range(ENTRIES_KERNEL_MIN)}, {"k": "v"}, align=4096)


def _rank_map_flow() -> None:
    """The engine ranks' placement kernel (deltasync.rankmap; one signature), so an engine's first apply
    does not compile it (~0.4 s seen inside vLLM's pause)."""
    from .layout import RankLayout, Region
    from .rankmap import RankMap

    lay = RankLayout(stream={"a": ("bfloat16", (2, 4))}, params={"p": ("bfloat16", (2, 2))},
                     regions=(Region(source="a", param="p", src=((0, 2), (2, 2)), dst=((0, 2), (0, 2))),))
    RankMap.compile(lay)._placements(np.zeros(1, np.int64), np.zeros(1, np.int64), lay)


def cache_dirs() -> list[str]:
    """Where numba keeps the compiled kernels (one directory per module that defines some); empty where
    numba found no writeable cache location and compiles in memory, once per process."""
    from . import conditioned
    from .kernels import rans

    k = kernels.cpu_kernels()
    if k is None:
        return []
    out = []
    for fn in (k.lanes_sum, rans.chunk_symbols, conditioned.chunk_ranks):
        path = getattr(getattr(fn, "_cache", None), "_cache_path", None)  # numba's NullCache has none
        if path is not None and path not in out:
            out.append(path)
    return out


def _known(name: str) -> bool:
    try:
        dtype_info(name)
    except Exception:  # noqa: BLE001 - a dtype this torch lacks (older torch: no float8)
        return False
    return True


def _states(name: str) -> list[dict[str, torch.Tensor]]:
    """Four versions of a small state of ``name`` tensors, each step at every density of :data:`DENSITIES`."""
    info = dtype_info(name)
    g = torch.Generator().manual_seed(0)
    sdt = signed_word_dtype(info.word_size)
    lo, hi = (-(1 << 6), 1 << 6) if info.word_size == 1 else (-(1 << 13), 1 << 13)
    first = {f"d{d}": torch.randint(lo, hi, (WORDS,), generator=g, dtype=torch.int64).to(sdt) for d in DENSITIES}
    out = [first]
    for _ in range(3):
        nxt = {}
        for key, w in out[-1].items():
            w = w.clone()
            per_mille = int(key[1:])
            idx = torch.randperm(WORDS, generator=g)[: WORDS * per_mille // 1000]
            w[idx[::2]] += 1  # ULP steps
            w[idx[1::2]] = torch.randint(lo, hi, (idx[1::2].numel(),), generator=g, dtype=torch.int64).to(sdt)
            nxt[key] = w
        out.append(nxt)
    return [{k: w.view(info.torch_dtype) for k, w in s.items()} for s in out]


def _host(state: dict[str, torch.Tensor]) -> dict[str, HostTensor]:
    """The state as a file's host words (``publish --base`` reads mapped files this way, without torch)."""
    return {k: HostTensor(dtype=dtype_info(t.dtype).name, shape=tuple(t.shape), words=host_words(t).copy())
            for k, t in state.items()}


def _dtype_flows(name: str) -> None:
    info = dtype_info(name)
    states = _states(name)
    free, conditioned = EncodeOptions(), EncodeOptions(coding="base-conditioned")
    # the in-process publisher: a reference state patched in place as it diffs (torch tensors)
    ref = {k: t.clone() for k, t in states[0].items()}
    deltas = []
    for v in (1, 2):
        diff = diff_states(ref, states[v], update_old=True)
        deltas.append(encode_diff(diff, model="warm", version=v, parent=v - 1, options=free))
    # publish --base: two mapped files' host words; the base-conditioned coding from host words and from tensors
    old, new = states[2], states[3]
    diff = diff_states(_host(old), _host(new))
    encode_diff(diff, model="warm", version=3, parent=2, options=free)
    conditioned_delta = encode_diff(diff, model="warm", version=3, parent=2, options=conditioned,
                                    ranks=diff_ranks(diff, _host(old)))
    encode_diff(diff_states(old, new), model="warm", version=3, parent=2, options=conditioned, base=old)
    # publish --base of a state of many tensors: the columnar path's kernels (taken from FLAT_MIN tensors up)
    from . import columnar

    least, columnar.FLAT_MIN = columnar.FLAT_MIN, 0
    try:
        encode_diff(diff_states(_host(old), _host(new)), model="warm", version=3, parent=2, options=free)
    finally:
        columnar.FLAT_MIN = least
    # format 1 (still read), and a budgeted stream's plan (quantized steps)
    legacy = encode_diff(diff_states(states[0], states[1]), model="warm", version=1, parent=0,
                         options=EncodeOptions(format=1))
    Budgeter(BudgetPolicy(bytes=4096, step_bits=2)).plan(diff_states(states[0], states[1]), model="warm",
                                                          version=1, parent=0)
    # a subscriber's decode and patch, every coding, both verify modes, and a rollback
    target = {k: t.clone() for k, t in states[0].items()}
    apply_prepared({k: t.clone() for k, t in states[0].items()}, prepare_delta(legacy.manifest, legacy.blobs))
    for enc, verify in zip(deltas, ("incremental", "full")):
        apply_prepared(target, prepare_delta(enc.manifest, enc.blobs), verify=verify)
    apply_prepared(target, prepare_delta(conditioned_delta.manifest, conditioned_delta.blobs))
    bad = {k: t.clone() for k, t in states[0].items()}
    fps = {k: tensor_fingerprint(t) for k, t in bad.items()}
    for t in bad.values():
        t.view(signed_word_dtype(info.word_size)).bitwise_xor_(1)  # not what the fingerprints say
    try:
        apply_prepared(bad, prepare_delta(deltas[0].manifest, deltas[0].blobs), fps)
    except IntegrityError:
        pass  # rolled back
    else:
        raise RuntimeError(f"compile_kernels: a {name} delta applied to a damaged base was not refused")
    # a relay's squash of a chain (base-free)
    blobs = {bid: data for enc in deltas for bid, data in enc.blobs.items()}
    squash_chain([enc.manifest for enc in deltas], blobs.__getitem__)
    # fingerprints: of a state, and of a keyframe copied into a file's map as it lands
    for t in states[3].values():
        tensor_fingerprint(t)
        copy_fingerprint(torch.empty_like(t), t)
        copy_fingerprint(torch.empty_like(t), host_words(t).view(np.uint8))  # a received shard's bytes
        host_lanes_sum(host_lanes(_host({"t": t})["t"]), 0)
        raw = host_words(t).view(np.uint8)  # a received keyframe shard's run of tensors (subscribe --out)
        one = np.ones(1, dtype=np.int64)
        run_lane_sums(raw, 0, raw.size, one * 0, one * raw.size, one * (1 if info.word_size == 1 else 2), one * 0,
                      np.zeros(1, np.uint64), 0, np.empty(raw.size // 2 + 1, np.uint16))
    lanes_sum(torch.zeros(8, dtype=torch.int16 if lane_bits(info.torch_dtype) == 16 else torch.int8), 0)
    _word_kernels(info.word_size, info.is_float)


def _word_kernels(word_size: int, is_float: bool) -> None:
    """The kernels' entry points that the flows above reach only on some paths (a chunk compared alone, a live
    tensor patched word by word, a dense chunk, the ``--out`` journal), on unsigned host words of one width."""
    g = np.random.default_rng(0)
    wdt = numpy_word_dtype(word_size)
    o = g.integers(0, 1 << min(16, 8 * word_size), WORDS).astype(wdt)
    n = o.copy()
    n[::37] += 1
    found = kernels.diff_words(o.copy(), n, 0, word_size, update_old=True)
    for update_old in (False, True):
        kernels.diff_span(o.copy(), n, 0, WORDS, word_size, want_lanes=True, update_old=update_old)
    pos, ow, nw, _ = found
    changes = kernels.changes_from_words(pos, ow, nw, is_float=is_float)
    kernels.patch_words(o.copy(), changes, word_size)
    kernels.apply_changes_np(o.copy(), changes)
    kernels.copy_range_delta(o.copy()[:64], n[:64], 0, word_size)
    kernels.gather_words(o, pos, np.empty(pos.size, wdt))
    kernels.scatter_words(o.copy(), pos, ow)
    # subscribe --out's undo journal: the old words at the changed positions, chunk by chunk and as columns (jrnl03)
    kernels.journal_gather(o, pos, 0, WORDS, np.empty(pos.size, "<u4"), np.empty(pos.size, wdt))
    row = np.zeros(1, dtype=np.int64)
    whole = o.view()
    whole.flags.writeable = False  # the mapped file's words, read through its read-only buffer
    kernels.journal_columns(whole, pos, row, row + pos.size, row, row + WORDS, row, np.empty(pos.size, "<u4"),
                            np.empty(pos.size, wdt))
