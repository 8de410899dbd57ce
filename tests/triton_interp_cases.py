"""The core's CUDA kernel paths on CPU tensors under Triton's interpreter, against the CPU reference.

Run by ``tests/core/test_triton_kernels.py`` as ``python tests/triton_interp_cases.py [--long] CASE...`` in a
process started with ``TRITON_INTERPRET=1`` (the interpreter is chosen when triton is imported, so it
cannot be switched on inside pytest's process). Prints one JSON line per case: ``{"case", "ok", "checks",
"seconds", "error"}``.

Each case runs a kernel path twice on the same inputs and compares bit for bit (integer views, so NaN
payloads, -0.0 and fp8 compare exactly):

* the reference: ``kernels.select("reference")``, CPU tensors on the host paths (numpy/torch);
* the CUDA path: ``kernels.triton_on_cpu()``, which sends CPU tensors down the code the core runs for a
  CUDA tensor (compare on the device, then ``deltasync.kernels.gpu``'s Triton kernels, interpreted).

The cases: the three kernels alone (compare + compaction, patch, lane-block sums) on odd sizes and tile
edges; then, per codec dtype, the core paths that reach them on CUDA: fingerprints (full, range, copy),
``diff_chunk`` (with ``update_old``) and ``diff_device_words`` (a tensor's chunks at once), ``encode_delta``
(the blobs and the manifest), the publisher's ``Reference.diff_and_update`` + ``encode_diff``, ``apply_delta`` (in place, dense and sparse chunks,
non-contiguous live tensors) and its rollback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

if os.environ.get("TRITON_INTERPRET") != "1":  # before anything imports triton
    sys.exit("run with TRITON_INTERPRET=1 (Triton's interpreter runs kernels on CPU tensors)")

import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")

from deltasync import kernels
from deltasync.dtypes import DTYPES, numpy_word_dtype

kernels.triton_on_cpu(True)  # fails here, loudly, where triton does not import
kernels.triton_on_cpu(False)
from deltasync.kernels import gpu  # noqa: E402

CALLS: dict[str, int] = {}  # Triton entry points called by the case running (so that none passes on torch alone)


def _counted(name: str) -> None:
    fn = getattr(gpu, name)

    def counted(*args, **kwargs):
        CALLS[name] = CALLS.get(name, 0) + 1
        return fn(*args, **kwargs)

    setattr(gpu, name, counted)  # the core calls them as attributes of the module


for _name in ("changed_positions", "patch_words", "lane_block_sums"):
    _counted(_name)

LONG = "--long" in sys.argv
#: word counts: 0, 1, either side of a 64-word block and of the kernels' 1024-word tile, and odd sizes
SIZES = (0, 1, 63, 64, 65, 1023, 1024, 1025, 4097) + ((65_537,) if LONG else ())
#: element counts of the tensors in the whole-path cases (every codec dtype)
TENSOR_SIZES = (1, 63, 65, 4097) + ((17_001,) if LONG else ())  # 17,001 words of 4+ bytes: past a 2**16-lane block
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
PATTERNS = ("none", "first", "last", "sparse", "edges", "all")


class Checks:
    def __init__(self) -> None:
        self.count = 0

    def eq(self, a, b, what: str) -> None:
        self.count += 1
        if isinstance(a, torch.Tensor):
            ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bytes_of(a) == bytes_of(b)
        elif isinstance(a, np.ndarray):
            ok = isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        else:
            ok = a == b
        if not ok:
            raise AssertionError(f"{what}: the CUDA path differs from the reference")


def bytes_of(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


class reference:
    """Within: the CPU reference (numpy/torch host paths)."""

    def __enter__(self):
        kernels.triton_on_cpu(False)
        kernels.select("reference")

    def __exit__(self, *exc):
        return False


class cuda_path:
    """Within: CPU tensors take the core's CUDA paths and the Triton kernels (interpreted)."""

    def __enter__(self):
        kernels.select("reference")
        kernels.triton_on_cpu(True)

    def __exit__(self, *exc):
        kernels.triton_on_cpu(False)
        return False


def changed_at(n: int, pattern: str, rng) -> np.ndarray:
    if n == 0 or pattern == "none":
        return np.zeros(0, np.int64)
    if pattern == "first":
        return np.array([0])
    if pattern == "last":
        return np.array([n - 1])
    if pattern == "all":
        return np.arange(n)
    if pattern == "edges":  # both sides of 64-word blocks and 1024-word tiles
        return np.unique(np.clip([0, 62, 63, 64, 65, 1022, 1023, 1024, 1025, 2047, 2048, n - 1], 0, n - 1))
    return np.flatnonzero(rng.random(n) < 0.03)


def random_words(rng, n: int, w: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(n * w), dtype=numpy_word_dtype(w)).copy()


# -- the kernels alone ---------------------------------------------------------------------------------

def case_changed_positions(c: Checks) -> None:
    rng = np.random.default_rng(1)
    for w, sdt in SIGNED.items():
        for n in SIZES:
            for pattern in PATTERNS:
                o = random_words(rng, n + 5, w)
                nw = o.copy()
                at = changed_at(n, pattern, rng) + 5
                nw[at] ^= numpy_word_dtype(w).type(1 << (8 * w - 1)) if w > 1 else np.uint8(0x80)
                ot = torch.from_numpy(o.view(f"i{w}"))[5:]  # a view at an offset, as diff_chunk passes chunks
                nt = torch.from_numpy(nw.view(f"i{w}"))[5:]
                ref = torch.nonzero(ot != nt).squeeze(1)
                c.eq(ref, gpu.changed_positions(ot, nt), f"changed_positions int{8 * w} n={n} {pattern}")


def case_patch_words(c: Checks) -> None:
    rng = np.random.default_rng(2)
    for w, sdt in SIGNED.items():
        for n in SIZES:
            for pattern in PATTERNS:
                for raw_kind in ("steps", "raw", "mixed"):
                    pos = torch.from_numpy(changed_at(n, pattern, rng).astype(np.int64))
                    live = torch.from_numpy(random_words(rng, n, w).view(f"i{w}"))
                    if n:
                        live[-1] = torch.iinfo(sdt).max  # a step past the top wraps
                    vals = torch.from_numpy(random_words(rng, pos.numel(), w).view(f"i{w}"))
                    raw = {"steps": torch.zeros(pos.numel(), dtype=torch.bool),
                           "raw": torch.ones(pos.numel(), dtype=torch.bool),
                           "mixed": torch.arange(pos.numel()) % 3 == 0}[raw_kind]
                    expect = live.clone()
                    old_ref = expect.index_select(0, pos)
                    expect.index_copy_(0, pos, torch.where(raw, vals, old_ref + vals).to(sdt))
                    got = live.clone()
                    old = gpu.patch_words(got, pos, raw, vals)
                    c.eq(old_ref, old, f"patch_words old words int{8 * w} n={n} {pattern} {raw_kind}")
                    c.eq(expect, got, f"patch_words result int{8 * w} n={n} {pattern} {raw_kind}")


def case_lane_block_sums(c: Checks) -> None:
    from deltasync.fingerprint import lanes_sum
    from deltasync.kernels.fpkeys import BLOCK, block_keys, table_on

    rng = np.random.default_rng(3)
    sizes = (1, 63, 65, 4097, BLOCK - 1, BLOCK, BLOCK + 1) + ((3 * BLOCK + 5,) if LONG else ())
    for lane_dt, w in ((torch.int8, 1), (torch.int16, 2)):
        for n in sizes:
            for fill in ("random", "ones"):  # all bits set: the lane must be widened unsigned
                lanes = torch.from_numpy(random_words(rng, n, w).view(f"i{w}"))
                if fill == "ones":
                    lanes.fill_(-1)
                sums = gpu.lane_block_sums(lanes, table_on(lanes.device))
                keys = block_keys(torch.arange(sums.numel(), dtype=torch.int64))
                got = int((sums * keys).sum().item()) & ((1 << 64) - 1)
                with reference():
                    c.eq(lanes_sum(lanes, 0), got, f"lane_block_sums {lane_dt} n={n} {fill}")


# -- the core's CUDA paths, every codec dtype -------------------------------------------------------

def random_tensor(rng, name: str, n: int) -> torch.Tensor:
    info = DTYPES[name]
    raw = np.frombuffer(rng.bytes(n * info.element_size), np.uint8).copy()
    if name == "bool":
        raw &= 1
    return torch.from_numpy(raw).view(info.torch_dtype)


def changed_tensor(rng, t: torch.Tensor, pattern: str) -> torch.Tensor:
    """A copy of ``t`` with the words of ``pattern`` changed: ULP-like steps, rewrites, or (all) new words."""
    info = DTYPES[str(t.dtype).removeprefix("torch.")]
    words = t.contiguous().reshape(-1).view(torch.uint8).numpy().view(numpy_word_dtype(info.word_size)).copy()
    at = changed_at(words.size, pattern, rng)
    if info.name == "bool":
        words[at] ^= 1
    elif pattern == "all":
        words = random_words(rng, words.size, info.word_size)
    elif at.size:
        with np.errstate(over="ignore"):
            step = np.where(rng.random(at.size) < 0.5, 1, -1).astype(np.int64).astype(words.dtype)
            words[at] = np.where(rng.random(at.size) < 0.8, words[at] + step, ~words[at])
    return torch.from_numpy(words.view(np.uint8).copy()).view(t.dtype).reshape(t.shape)


def states(seed: int, pattern: str) -> tuple[dict, dict]:
    """Old and new states: tensors of every codec dtype in odd sizes, and a 2-D one ("matrix")."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for i, name in enumerate(sorted(DTYPES)):  # two sizes a dtype (every size in the long run)
        for n in TENSOR_SIZES if LONG else (TENSOR_SIZES[i % 4], TENSOR_SIZES[(i + 2) % 4]):
            key = f"{name}.{n}"
            old[key] = random_tensor(rng, name, n)
            new[key] = changed_tensor(rng, old[key], pattern)
    old["matrix"] = random_tensor(rng, "bfloat16", 65 * 63).reshape(65, 63)  # a live copy of it is non-contiguous
    new["matrix"] = changed_tensor(rng, old["matrix"], pattern)
    return old, new


def clone_state(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def case_fingerprints(c: Checks) -> None:
    from deltasync.fingerprint import copy_fingerprint, tensor_fingerprint, words_range_delta

    old, new = states(4, "sparse")
    for key, t in old.items():
        with reference():
            ref = tensor_fingerprint(t)
        with cuda_path():
            got = tensor_fingerprint(t)
            dst = torch.empty_like(t)
            copied = copy_fingerprint(dst, new[key])
        c.eq(ref, got, f"tensor_fingerprint {key}")
        with reference():
            c.eq(tensor_fingerprint(new[key]), copied, f"copy_fingerprint {key}")
        c.eq(new[key], dst, f"copy_fingerprint copy {key}")
    rng = np.random.default_rng(5)
    for w in (1, 2, 4, 8):  # ranges that start off a 2**16-lane block and cross one
        n = (1 << 17) // max(w // 2, 1) + 7
        a = torch.from_numpy(random_words(rng, n, w).view(f"i{w}"))
        b = torch.from_numpy(random_words(rng, n, w).view(f"i{w}"))
        for start, stop in ((0, n), (1, n), (n // 3, n - 1), (n - 5, n)):
            with reference():
                ref = words_range_delta(a[start:stop], b[start:stop], start, w)
            with cuda_path():
                got = words_range_delta(a[start:stop], b[start:stop], start, w)
            c.eq(ref, got, f"words_range_delta w={w} [{start}, {stop})")
        with reference():
            ref = tensor_fingerprint(a)
        with cuda_path():
            c.eq(ref, tensor_fingerprint(a), f"tensor_fingerprint words w={w} n={n}")


def case_diff_chunk(c: Checks) -> None:
    from deltasync.codec import diff_chunk, diff_device_words
    from deltasync.dtypes import host_words, word_view

    rng = np.random.default_rng(6)
    for w in (1, 2, 4, 8):
        for n in SIZES[1:] if LONG else (1, 63, 65, 1025, 4097):
            for pattern in PATTERNS:
                base = torch.from_numpy(random_words(rng, n, w).view(f"i{w}"))
                nxt = changed_tensor(rng, base, pattern)
                for start, stop, update_old in ((0, n, False), (n // 3, n, True)):
                    ref_old = base.clone()
                    with reference():
                        ref, ref_fpd = diff_chunk(host_words(ref_old), host_words(nxt), start, stop, w,
                                                  update_old=update_old)
                    dev_old = base.clone()
                    with cuda_path():
                        got, fpd = diff_chunk(word_view(dev_old), word_view(nxt), start, stop, w,
                                              update_old=update_old)
                    what = f"diff_chunk w={w} n={n} {pattern} [{start}, {stop}) update_old={update_old}"
                    c.eq(ref is None, got is None, what + " (found nothing)")
                    c.eq(ref_fpd, fpd, what + " fingerprint change")
                    if ref is not None:
                        for field in ("start", "stop", "positions", "old", "new"):
                            c.eq(getattr(ref, field), getattr(got, field), f"{what} {field}")
                    c.eq(ref_old, dev_old, what + " reference copy")
                # the whole tensor's chunks at once (diff_states on a device): the chunks' diffs, their summed
                # fingerprint change and the reference copy, as chunk by chunk on the host
                ranges = [r for r in ((0, n // 3), (n // 3, n - n // 5), (n - n // 5, n)) if r[1] > r[0]]
                ref_old, dev_old = base.clone(), base.clone()
                with reference():
                    refs = [diff_chunk(host_words(ref_old), host_words(nxt), s, e, w, update_old=True) for s, e in ranges]
                with cuda_path():
                    got, fpd = diff_device_words(word_view(dev_old), word_view(nxt), ranges, w, update_old=True)
                what = f"diff_device_words w={w} n={n} {pattern} {ranges}"
                want = [r for r, _ in refs if r is not None]
                c.eq(len(want), len(got), what + " chunks")
                for ref, g in zip(want, got):
                    for field in ("start", "stop", "positions", "old", "new"):
                        c.eq(getattr(ref, field), getattr(g, field), f"{what} {field}")
                c.eq(sum(f for _, f in refs) & ((1 << 64) - 1), fpd & ((1 << 64) - 1), what + " fingerprint change")
                c.eq(ref_old, dev_old, what + " reference copy")


def encoded(old, new, options, base_fps=None):
    """The delta old -> new, encoded on the CPU reference."""
    from deltasync.codec import encode_delta

    with reference():
        return encode_delta(old, new, model="m", version=2, parent=1, options=options, base_fps=base_fps)


def encoded_pair(old, new, options, base_fps=None):
    """(on the CPU reference, on the CUDA path); ``base_fps`` None: each computes the old fingerprints."""
    from deltasync.codec import encode_delta

    with cuda_path():
        got = encode_delta(old, new, model="m", version=2, parent=1, options=options, base_fps=base_fps)
    return encoded(old, new, options, base_fps), got


def _options():
    from deltasync.codec import EncodeOptions

    return (("small chunks", EncodeOptions(chunk_words=1000, blob_target=1 << 14)),
            ("one chunk", EncodeOptions()),
            ("base-conditioned", EncodeOptions(chunk_words=1000, format=3, coding="base-conditioned")))


def case_encode(c: Checks) -> None:
    from deltasync.fingerprint import fingerprint_state
    wanted = {"none": ("small chunks",), "sparse": ("small chunks", "one chunk", "base-conditioned"),
              "edges": ("small chunks",), "all": ("small chunks", "base-conditioned")}
    for pattern, labels in wanted.items():
        old, new = states(7, pattern)
        with reference():
            fps = fingerprint_state(old)
        for label, options in _options():
            if label not in labels and not LONG:
                continue
            # the old fingerprints on the device once a state (also a publisher's first step); then given
            ref, got = encoded_pair(old, new, options, None if label == "small chunks" else fps)
            c.eq(ref.manifest.to_json(), got.manifest.to_json(), f"encode_delta manifest {pattern} {label}")
            c.eq(ref.blobs, got.blobs, f"encode_delta blobs {pattern} {label}")


def case_publish(c: Checks) -> None:
    """The publisher's step on the device: diff against the reference copy, patching it in place."""
    from deltasync.client.reference import Reference
    from deltasync.codec import encode_diff

    for pattern in ("none", "sparse", "all"):
        old, new = states(8, pattern)
        out = []
        for mode in (reference, cuda_path):
            with mode():
                ref = Reference(old)
                ptrs = {k: t.data_ptr() for k, t in ref.tensors.items()}
                diff = ref.diff_and_update(new, chunk_words=1000)
                enc = encode_diff(diff, model="m", version=2, parent=1)
                out.append((diff, enc, dict(ref.fps), {k: t.clone() for k, t in ref.tensors.items()}))
                c.eq(ptrs, {k: t.data_ptr() for k, t in ref.tensors.items()}, f"publish {pattern}: patched in place")
        (d0, e0, f0, t0), (d1, e1, f1, t1) = out
        c.eq(d0.fps_before, d1.fps_before, f"publish {pattern} fps before")
        c.eq(d0.fps_after, d1.fps_after, f"publish {pattern} fps after")
        c.eq(e0.manifest.to_json(), e1.manifest.to_json(), f"publish {pattern} manifest")
        c.eq(e0.blobs, e1.blobs, f"publish {pattern} blobs")
        for k in new:
            c.eq(t0[k], t1[k], f"publish {pattern} reference copy {k}")
            c.eq(new[k], t1[k], f"publish {pattern} reference copy equals the new state {k}")


def case_apply(c: Checks) -> None:
    from deltasync.apply import apply_delta
    from deltasync.fingerprint import fingerprint_state

    for pattern in ("sparse", "edges", "all"):
        old, new = states(9, pattern)
        with reference():
            fps_old = fingerprint_state(old)  # what a subscriber tracks (the full recompute: case_fingerprints)
        for label, options in _options():
            enc = encoded(old, new, options)
            results = []
            for mode in (reference, cuda_path):
                with mode():
                    live = clone_state(old)
                    live["matrix"] = old["matrix"].t().contiguous().t()  # same shape, non-contiguous
                    ptrs = {k: t.data_ptr() for k, t in live.items()}
                    fps = apply_delta(live, enc.manifest, enc.blobs, fps_old)
                    c.eq(ptrs, {k: t.data_ptr() for k, t in live.items()}, f"apply {pattern} {label}: in place")
                    results.append((fps, live))
            (f0, l0), (f1, l1) = results
            c.eq(f0, f1, f"apply {pattern} {label} fingerprints")
            for k in new:
                c.eq(l0[k].contiguous(), l1[k].contiguous(), f"apply {pattern} {label} {k}")
                c.eq(new[k], l1[k].contiguous(), f"apply {pattern} {label} new {k}")


def case_rollback(c: Checks) -> None:
    """A wrong fingerprint on the last tensor, or a position outside a tensor: every tensor patched by
    the Triton path is restored from the old words it returned."""
    from deltasync.apply import apply_delta
    from deltasync.errors import DeltaSyncError
    from deltasync.fingerprint import fingerprint_state

    old, new = states(10, "sparse")
    enc = encoded(old, new, _options()[0][1])
    last = sorted(t.name for t in enc.manifest.tensors)[-1]
    tensors = tuple(dataclasses.replace(t, fp_after=f"{int(t.fp_after, 16) ^ 1:016x}") if t.name == last else t
                    for t in enc.manifest.tensors)
    bad = dataclasses.replace(enc.manifest, tensors=tensors)
    with cuda_path():
        live = clone_state(old)
        try:
            apply_delta(live, bad, enc.blobs, fingerprint_state(live))
        except DeltaSyncError:
            pass
        else:
            raise AssertionError("a wrong fp_after was applied")
    for k in old:
        c.eq(old[k], live[k], f"rollback restores {k}")


CASES = {name.removeprefix("case_"): fn for name, fn in globals().items() if name.startswith("case_")}


def main(argv: list[str]) -> int:
    names = [a for a in argv if not a.startswith("--")] or list(CASES)
    for name in names:
        checks = Checks()
        CALLS.clear()
        t0 = time.perf_counter()
        error = None
        try:
            CASES[name](checks)
        except Exception:
            error = traceback.format_exc(limit=8)
        finally:
            kernels.triton_on_cpu(False)
        print(json.dumps({"case": name, "ok": error is None, "checks": checks.count,
                          "seconds": round(time.perf_counter() - t0, 2), "triton_calls": dict(CALLS),
                          "error": error}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
