"""Offline commands: diff, replay, squash, inspect, verify (files only, no network), and compile-kernels.

``diff`` reads both files as :class:`~deltasync.dtypes.HostTensor` words over their maps and never
imports torch (``tests/cli/test_diff_cli.py``); the other commands import what they need when they run."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from deltasync.dtypes import dtype_info
from deltasync.errors import ChainError
from deltasync.signing import HmacSigner, HmacVerifier

from deltasync.keyfiles import read_key_file, signer_from_file, verifier_from_file
from .options import blob_format_option
from .progress import Progress, say


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def register(sub) -> None:
    p = sub.add_parser("diff", help="write one self-contained delta file from two safetensors states")
    p.add_argument("old", help="base state (.safetensors)")
    p.add_argument("new", help="target state (.safetensors)")
    p.add_argument("-o", "--out", required=True, help="delta file to write")
    p.add_argument("--model", default=None,
                   help="model stream name (default: OLD's deltasync.model metadata, else 'model')")
    p.add_argument("--parent", type=int, default=None,
                   help="version number of OLD (default: its deltasync.version metadata, e.g. a `subscribe --out` "
                        "file's; else the last number in both file names when NEW's is larger, as the sidecar "
                        "numbers checkpoints: step1 -> step2 is v1 -> v2; else 0)")
    p.add_argument("--version", type=int,
                   help="version number of NEW (default: its deltasync.version metadata; else from the file names "
                        "as above; else parent+1)")
    p.add_argument("--key-file", help="sign the manifest with this hex key")
    p.add_argument("--chunk-words", type=int, default=None, help="words per chunk (default: the codec's, 2**20)")
    p.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    # the same choices, default and meaning as `publish --coding` (client/cli.py; tests/cli/test_diff_coding.py pins it)
    p.add_argument("--coding", choices=("base-free", "base-conditioned"), default="base-free",
                   help="how the delta is coded: base-free (default; squash composes it) or base-conditioned "
                        "(~30%% smaller on AdamW steps; decoding reads each changed chunk of the base, so replay "
                        "decodes it but squash refuses it; docs/FORMAT.md §4.4)")
    blob_format_option(p)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads comparing and coding chunks (default: one per core)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("replay", help="apply a chain of delta files to a base state, verifying every fingerprint")
    p.add_argument("base")
    p.add_argument("deltas", nargs="+")
    p.add_argument("-o", "--out", required=True, help="state to write (.safetensors); nothing is written on error")
    p.add_argument("--key-file", help="refuse deltas whose signature does not verify with this key")
    p.add_argument("--verify", choices=("incremental", "full"), default="incremental")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("squash", help="compose a chain of delta files into one")
    p.add_argument("deltas", nargs="+")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--key-file", help="verify inputs and sign the result with this key")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_squash)

    p = sub.add_parser("inspect", help="per-tensor table of a delta file or a safetensors state")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="is STATE exactly the delta's target (or base with --base)?")
    p.add_argument("state")
    p.add_argument("delta")
    p.add_argument("--base", action="store_true", help="check against the delta's base instead of its target")
    p.add_argument("--key-file")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("compile-kernels",
                       help="compile the CPU kernels into numba's on-disk cache (once per install: ~1 min here; "
                            "later processes only load them)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_compile_kernels)


def cmd_compile_kernels(args) -> int:
    """:func:`deltasync.precompile.compile_kernels`, one line per dtype; where numba's cache is."""
    from deltasync import kernels
    from deltasync.precompile import cache_dirs, compile_kernels

    if kernels.cpu_kernels() is None:
        say(args, f"nothing to compile: the {kernels.active()} kernels are selected (DELTASYNC_KERNELS)")
        return 0
    where = cache_dirs()
    if not where:
        print("deltasync compile-kernels: error: numba has no writeable cache directory here (the package's "
              "__pycache__ is read-only): set NUMBA_CACHE_DIR to a directory the processes that run deltasync can "
              "write, here and in their environment", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    done = compile_kernels(None if args.quiet else (lambda line: say(args, line)))
    say(args, f"compiled kernels ready for {done} dtypes in {time.perf_counter() - t0:.1f} s "
              f"(numba's cache: {', '.join(where)})")
    return 0


META_MODEL, META_VERSION = "deltasync.model", "deltasync.version"  # a `subscribe --out` file's header (FileTarget)


def _name_step(path: str) -> int | None:
    """The last number in a file's name, as the sidecar numbers checkpoints (``client/checkpoints.py``)."""
    m = re.search(r"(\d+)(?!.*\d)", os.path.basename(path).removesuffix(".safetensors"))
    return int(m.group(1)) if m else None


def _meta_version(meta: dict[str, str]) -> int | None:
    v = meta.get(META_VERSION) or ""
    return int(v) if v.isdigit() else None


def diff_numbers(args, old_meta: dict[str, str], new_meta: dict[str, str]) -> tuple[int, int, str]:
    """(parent, version, model) of ``deltasync diff``: the flags; else the files' own ``deltasync.version``
    metadata; else, when neither flag nor metadata numbers either file, the last numbers in the two file
    names if NEW's is larger (step1 -> step2: v1 -> v2, so diffs of consecutive checkpoints chain); else
    parent 0 and version parent+1. A delta that would not go forward is refused, naming the flags."""
    model = args.model or old_meta.get(META_MODEL) or new_meta.get(META_MODEL) or "model"
    meta_p, meta_v = _meta_version(old_meta), _meta_version(new_meta)
    parent, version = args.parent, args.version
    if parent is None and version is None and meta_p is None and meta_v is None:
        a, b = _name_step(args.old), _name_step(args.new)
        if a is not None and b is not None and b > a:
            return a, b, model
    parent = parent if parent is not None else meta_p if meta_p is not None else 0
    version = version if version is not None else meta_v if meta_v is not None else parent + 1
    if version <= parent:
        raise ChainError(f"diff {args.old} -> {args.new} would go from v{parent} to v{version}; pass the numbers: "
                         f"--parent P (the version OLD holds) and --version V (greater than P)")
    return parent, version, model


def connect_chain(paths: list[str], manifests: list, note=None) -> list:
    """The delta files ``paths`` as one chain: each must start from the state the previous one ends at
    (state fingerprints). Files numbered on their own (``diff`` of two files without version numbers
    writes v0 -> v1) whose states connect are renumbered after the first; ``note(line)`` says so. A
    break raises ChainError naming the files and the flags that number them."""
    from dataclasses import replace

    out = [manifests[0]]
    for path, m in zip(paths[1:], manifests[1:]):
        prev, prev_path = out[-1], paths[len(out) - 1]
        if m.model != prev.model:
            raise ChainError(f"{path}: model {m.model!r}, the chain ({prev_path}) is {prev.model!r}")
        if m.kind != "delta":
            raise ChainError(f"{path}: a {m.kind}, not a delta; only deltas chain")
        if m.state_fp_before != prev.state_fp:
            raise ChainError(
                f"chain breaks: {path} (v{m.parent}->v{m.version}) starts from state {m.state_fp_before}, but "
                f"{prev_path} (v{prev.parent}->v{prev.version}) ends at state {prev.state_fp}: not consecutive "
                f"steps (a gap, the wrong order, or another run); give the files in order, each diffed from "
                f"the state the previous one ends at (deltasync diff --parent P --version V numbers them)")
        if m.parent != prev.version:
            span = m.version - m.parent
            renumbered = replace(m, parent=prev.version, version=prev.version + span, signature=None, key_id=None)
            if note is not None:
                note(f"{path}: v{m.parent}->v{m.version} renumbered v{renumbered.parent}->v{renumbered.version} "
                     f"(its base state is {prev_path}'s result)")
            m = renumbered
        out.append(m)
    return out


def cmd_diff(args) -> int:
    """Both files as :class:`~deltasync.dtypes.HostTensor` words over their maps (no torch, nothing copied
    whole); the same ``diff_span`` kernel and pool as ``publish --base``; the same bytes as ``encode_delta``
    of the files' torch tensors.

    Start-up: the files are mapped before the codec (and numba) is imported and their pages entered into the
    maps on a thread (``MappedTensorFile.prefault``, GIL released) while the main thread imports: the compare
    then takes no page fault. (A warm-up thread as ``publish``'s measured no gain here: nothing else runs
    while the kernels load, and on a small pair the command waited for the thread's own tiny delta.)"""

    from deltasync.client.cli import prefault_on_thread
    from deltasync.cli.run import settle_heap
    from deltasync.tensorfile import MappedTensorFile, check_published

    t0 = time.perf_counter()
    prog = Progress("diff", quiet=args.quiet)
    threads = max(args.threads, 1)
    with MappedTensorFile(args.old) as of, MappedTensorFile(args.new) as nf:
        for f, path in ((of, args.old), (nf, args.new)):  # a `subscribe --out` file caught mid-apply: refused
            check_published(f.metadata, str(path))
        parent, version, model = diff_numbers(args, of.metadata, nf.metadata)
        old, new = of.host, nf.host
        settle_heap()  # the maps' entries and views live on: out of the cyclic collector's way
        prefaulting = prefault_on_thread((of, nf))
        try:
            from deltasync.codec import EncodeOptions, encode_delta

            raw = _nbytes(new)
            options = EncodeOptions(level=args.level, coding=args.coding, format=args.blob_format, **({} if args.chunk_words is None else
                                                          {"chunk_words": args.chunk_words}))
            with ThreadPoolExecutor(threads, thread_name_prefix="deltasync-diff") as pool:  # kernels release the GIL
                enc = encode_delta(old, new, model=model, version=version, parent=parent,
                                   options=options, progress=prog.update, executor=pool if threads > 1 else None)
        finally:
            prefaulting.join()  # before the maps close
        del old, new
    prog.done()
    from deltasync.deltafile import write_delta_file

    words = sum(t.words for t in enc.manifest.tensors)
    count = len(enc.manifest.tensors)
    manifest = enc.manifest.compact()  # format 3 (docs/FORMAT.md §5.3)
    signer = signer_from_file(args.key_file)
    if signer is not None:
        manifest = manifest.sign(signer)
    size = write_delta_file(args.out, manifest, enc.blobs)
    dt = time.perf_counter() - t0
    say(args, f"{args.out}: {model!r} v{parent}->v{version}, {count} tensors, "
              f"{manifest.changed_words:,} of {words:,} words changed "
              f"({100 * manifest.changed_words / max(words, 1):.3f}%), {size:,} bytes, ratio {raw / max(size, 1):.1f}x "
              f"vs {raw:,} raw bytes, {manifest.coding} coding, {dt:.2f} s")
    return 0


def cmd_replay(args) -> int:
    from deltasync.deltafile import read_delta_file

    from deltasync.apply import apply_delta
    from deltasync.fingerprint import fingerprint_state
    from deltasync.tensorfile import read_state_file, write_state_file

    verifier = verifier_from_file(args.key_file)
    state = read_state_file(args.base)
    fps = fingerprint_state(state)
    prev = None
    prog = Progress("replay", quiet=args.quiet)
    for i, path in enumerate(args.deltas):
        df = read_delta_file(path, verifier=verifier)
        m = df.manifest
        if prev is not None:  # the files' states must connect; files numbered on their own are renumbered
            m = connect_chain([args.deltas[i - 1], path], [prev, m], note=lambda line: say(args, line))[1]
        fps = apply_delta(state, m, df.blobs, fps, verify=args.verify)
        prev = m
        prog.update(i + 1, len(args.deltas))
    prog.done()
    size = write_state_file(args.out, state)
    say(args, f"{args.out}: v{prev.version} of {prev.model!r}, {len(state)} tensors, {size:,} bytes, "
              f"state {prev.state_fp} verified")
    return 0


def cmd_squash(args) -> int:
    from deltasync.deltafile import read_delta_file, write_delta_file

    from deltasync.squash import squash_chain

    key = read_key_file(args.key_file)  # one shared HMAC secret: verifies the inputs, signs the result
    verifier, signer = (None, None) if key is None else (HmacVerifier(key), HmacSigner(key))
    files = [read_delta_file(p, verifier=verifier) for p in args.deltas]
    blobs: dict[str, bytes] = {}
    for f in files:
        blobs.update(f.blobs)
    chain = connect_chain(list(args.deltas), [f.manifest for f in files], note=lambda line: say(args, line))
    enc = squash_chain(chain, blobs.__getitem__)
    manifest = enc.manifest.sign(signer) if signer is not None else enc.manifest
    size = write_delta_file(args.out, manifest, enc.blobs)
    total_in = sum(f.manifest.total_bytes for f in files)
    say(args, f"{args.out}: v{manifest.parent}->v{manifest.version}, {manifest.changed_words:,} changed words, "
              f"{size:,} bytes (chain was {total_in:,} bytes of blobs)")
    return 0


def _chunk_raw_bytes(version: int, rec: dict) -> int:
    from deltasync.codec import chunk_bytes

    return chunk_bytes(version, rec, dtype_info(rec["dtype"]).word_size)


def inspect_delta(path: str) -> dict:
    from deltasync.deltafile import read_delta_file

    from deltasync.blob import BlobReader
    from deltasync.budget import budget_of, residual_of

    df = read_delta_file(path)
    m = df.manifest
    per_tensor: dict[str, dict] = {t.name: {"modes": {}, "bytes": 0.0} for t in m.tensors}
    if m.kind == "delta":
        for ref in m.blobs:
            reader = BlobReader(df.blobs[ref.id])
            raws = [_chunk_raw_bytes(reader.version, c) for c in reader.chunks]
            total = sum(raws) or 1
            for c, r in zip(reader.chunks, raws):
                info = per_tensor[c["tensor"]]
                info["modes"][c["mode"]] = info["modes"].get(c["mode"], 0) + 1
                info["bytes"] += ref.size * r / total
    rows = []
    for t in m.tensors:
        info = dtype_info(t.dtype)
        raw = info.element_size * math.prod(t.shape)
        rows.append({
            "name": t.name, "dtype": t.dtype, "shape": list(t.shape), "changed": t.changed, "words": t.words,
            "changed_pct": 100.0 * t.changed / max(t.words, 1),
            "encoding": ",".join(f"{k}:{v}" for k, v in sorted(per_tensor[t.name]["modes"].items())) or
                        ("keyframe" if m.kind == "keyframe" else "-"),
            "bytes": round(per_tensor[t.name]["bytes"]) if m.kind == "delta" else raw,
            "raw_bytes": raw, "fp_before": t.fp_before, "fp_after": t.fp_after,
        })
    return {"type": "delta-file", "model": m.model, "version": m.version, "parent": m.parent, "kind": m.kind,
            "coding": m.coding if m.kind == "delta" else None, "signed": m.signature is not None, "state_fp_before": m.state_fp_before, "state_fp": m.state_fp,
            "blobs": len(m.blobs), "bytes": m.total_bytes, "raw_bytes": m.raw_bytes,
            "changed_words": m.changed_words, "tensors": rows,
            "budget": budget_of(m), "residual": residual_of(m)}


def inspect_state(path: str) -> dict:
    from deltasync.fingerprint import fingerprint_state, fp_hex, state_fingerprint_of
    from deltasync.tensorfile import read_state_file

    state = read_state_file(path)
    fps = fingerprint_state(state)
    rows = [{"name": n, "dtype": dtype_info(t.dtype).name, "shape": list(t.shape),
             "bytes": t.numel() * t.element_size(), "fingerprint": fp_hex(fps[n])} for n, t in sorted(state.items())]
    return {"type": "safetensors", "tensors": rows, "bytes": sum(r["bytes"] for r in rows),
            "state_fp": state_fingerprint_of(state, fps)}


def cmd_inspect(args) -> int:
    from deltasync.deltafile import MAGIC as DELTA_MAGIC

    with open(args.file, "rb") as f:
        magic = f.read(8)
    info = inspect_delta(args.file) if magic == DELTA_MAGIC else inspect_state(args.file)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    if info["type"] == "safetensors":
        w = max([len(r["name"]) for r in info["tensors"]] + [6])
        print(f"{'tensor':<{w}}  {'dtype':<16} {'shape':<20} {'bytes':>14}  fingerprint")
        for r in info["tensors"]:
            print(f"{r['name']:<{w}}  {r['dtype']:<16} {str(tuple(r['shape'])):<20} {r['bytes']:>14,}  {r['fingerprint']}")
        print(f"total: {len(info['tensors'])} tensors, {info['bytes']:,} bytes, state fingerprint {info['state_fp']}")
        return 0
    w = max([len(r["name"]) for r in info["tensors"]] + [6])
    print(f"{info['kind']} {info['model']!r} v{info['parent']}->v{info['version']}" if info["kind"] == "delta"
          else f"keyframe {info['model']!r} v{info['version']}",
          f"({'signed' if info['signed'] else 'unsigned'}, {info['blobs']} blobs"
          + (f", {info['coding']} coding)" if info["coding"] else ")"))
    print(f"{'tensor':<{w}}  {'dtype':<16} {'shape':<20} {'changed%':>9} {'encoding':<18} {'bytes':>12}")
    for r in info["tensors"]:
        print(f"{r['name']:<{w}}  {r['dtype']:<16} {str(tuple(r['shape'])):<20} {r['changed_pct']:>8.3f}% "
              f"{r['encoding']:<18} {r['bytes']:>12,}")
    words = sum(r["words"] for r in info["tensors"])
    print(f"total: {len(info['tensors'])} tensors, {info['changed_words']:,}/{words:,} words changed "
          f"({100 * info['changed_words'] / max(words, 1):.3f}%), {info['bytes']:,} bytes for {info['raw_bytes']:,} raw "
          f"({info['raw_bytes'] / max(info['bytes'], 1):.1f}x), state {info['state_fp']}")
    if info["budget"] is not None:
        print(_budget_line(info["budget"], info["residual"]))
    return 0


def _budget_line(budget: int, r: dict | None) -> str:
    """The budget and residual summary of a version of a budgeted stream (docs/FORMAT.md §9)."""
    if not r:
        return f"budgeted stream: budget {budget:,} bytes/delta (no residual summary)"
    words = max(r.get("words", 0), 1)
    owed_bytes = r.get("owed_bytes", -1)
    return (f"budgeted stream: budget {budget:,} bytes/delta; owed after this version: {r.get('owed', 0):,} words "
            f"({100 * r.get('owed', 0) / words:.3f}%), "
            + (f"{owed_bytes:,} bytes" if owed_bytes >= 0 else "bytes not measured")
            + f"; residual max {r.get('max_ulps', 0)} ULPs, max relative {r.get('max_rel', 0):.3g}, "
              f"max age {r.get('max_age', 0)}/{r.get('max_owed_steps', '?')} versions, {r.get('late', 0)} late; "
              f"sent {r.get('sent', 0):,} words ({r.get('quantized', 0):,} rounded), "
              f"whole residual would have cost {r.get('full_bytes', 0):,} bytes")


def cmd_verify(args) -> int:
    from deltasync.deltafile import read_delta_file

    from deltasync.fingerprint import fingerprint_state, fp_hex
    from deltasync.tensorfile import read_state_file

    df = read_delta_file(args.delta, verifier=verifier_from_file(args.key_file))
    m = df.manifest
    if args.base and m.kind != "delta":
        raise ChainError(f"{args.delta} is a keyframe: it has no base")
    state = read_state_file(args.state)
    fps = fingerprint_state(state)
    want_version = m.parent if args.base else m.version
    bad = []
    for t in m.tensors:
        want = t.fp_before if args.base else t.fp_after
        have = state.get(t.name)
        if have is None:
            bad.append(f"{t.name}: missing")
        elif dtype_info(have.dtype).name != t.dtype or tuple(have.shape) != t.shape:
            bad.append(f"{t.name}: {dtype_info(have.dtype).name} {tuple(have.shape)}, expected {t.dtype} {t.shape}")
        elif want is not None and fp_hex(fps[t.name]) != want:
            bad.append(f"{t.name}: fingerprint {fp_hex(fps[t.name])}, expected {want}")
    if m.format >= 3 and m.kind == "delta":
        # format 3 lists only the tensors the delta changes: the state fingerprint covers the rest
        from deltasync.fingerprint import state_fingerprint_of

        want_fp = m.state_fp_before if args.base else m.state_fp
        have_fp = state_fingerprint_of(state, fps)
        if not bad and have_fp != want_fp:
            bad.append(f"state fingerprint {have_fp}, expected {want_fp} (a tensor the delta does not change "
                       "differs, or the tensor set does)")
    else:
        extra = sorted(set(state) - {t.name for t in m.tensors})
        bad += [f"{n}: not in v{want_version}" for n in extra]
    if bad:
        print(f"MISMATCH: {args.state} is not v{want_version} of {m.model!r}; {len(bad)} tensor(s) differ:")
        for line in bad[:20]:
            print("  " + line)
        return 1
    say(args, f"OK: {args.state} is exactly v{want_version} of {m.model!r} "
              f"(state {m.state_fp_before if args.base else m.state_fp})")
    return 0
