"""GPU check (``make gpu-check``, under 8 minutes on one CUDA device): the CUDA half of deltasync, end to end.

Parts (``--parts``, all by default, in this order):

* ``tests``: the Triton kernels' self-check, then the ``gpu`` tests (the files that carry the marker).
* ``bench``: diff (compare + compaction: Triton, torch, ``diff_chunk`` to the host, the publisher's
  ``diff_states``), patch (Triton, and ``apply_prepared`` of a whole delta) and fingerprint GB/s, each as a
  fraction of the device's ``copy_`` measured in the same run.
* ``hf``: a live Hugging Face model (``Qwen2ForCausalLM`` from a config, random weights: no download) on the
  device follows a published stream through ``ThreadedSubscriber`` while it generates: its trainer (fp32
  masters + AdamW on the device) publishes each step's bf16 state from the device (the publisher diffs the
  CUDA tensors there; its reference copy stays there), the live model generates between applies, and each
  apply's pause is timed. At the end its weights and logits equal the trainer's last state bit for bit.

``--device cpu`` is the rehearsal (here, no GPU): the same flows on CPU tensors, small, with the core's CUDA
code paths and Triton kernels run by Triton's interpreter (``TRITON_INTERPRET=1``,
``kernels.triton_on_cpu``) where triton is installed. Its figures are not speeds; it proves the script runs.

Without ``--device``, a machine with no CUDA device (or no triton) exits with status 2 and says so.

**On a GPU machine without network** (``/work/.library/device/README.md`` here): it has torch, triton,
numba, transformers, safetensors, aiohttp, uvloop and xxhash, not zstandard, blake3, cryptography or obstore.
``make gpu-wheels`` (here, with network) downloads those wheels for CPython 3.12 / manylinux x86-64 into
``.whl/`` (git-ignored: carry it); there ``make gpu-check GPU_PY=python3`` installs them into a scratch
directory and this tree editable (no dependencies, no index), and runs this script with the scratch directory
on ``PYTHONPATH``. Without make: ``python3 -m pip install -q --no-index --no-deps --target /tmp/ds-site
.whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . &&
PYTHONPATH=/tmp/ds-site timeout 480 python3 benchmarks/gpu_check.py``. (Editable, not a copy in the scratch
directory: run from this tree, a copy's ``deltasync`` would be shadowed by ``./deltasync``, which lacks the
``client``/``server``/``cli`` subpackages the install maps in.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("tests", "bench", "hf")
REPORT: list[str] = []  # what --out writes: each part's result, as markdown


def _timed(fn, sync, n: int = 5) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def torch_device(name: str):
    import torch

    return torch.device(name)


def _sync(dev):
    import torch

    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


# -- tests -------------------------------------------------------------------------------------------

def run_tests(dev, rehearsal: bool) -> int:
    from deltasync import kernels
    from deltasync.kernels import gpu

    t0 = time.perf_counter()
    routed = kernels.on_host(torch_device("cpu")) is False
    kernels.triton_on_cpu(False)  # its reference (lanes_sum on the host) must not be the Triton path itself
    try:
        gpu.self_check(dev, n=20_011 if rehearsal else 300_007)
    finally:
        if routed:
            kernels.triton_on_cpu(True)
    print(f"Triton self-check passed on {dev.type} ({time.perf_counter() - t0:.1f} s)", flush=True)
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    if not files:  # pytest given no file would collect the whole suite
        print("gpu tests: no test file carries the gpu marker", flush=True)
        return 1
    # only the files with gpu tests: the others import test-only packages a bare GPU machine lacks
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(run.stdout, end="", flush=True)
    rc = run.returncode
    summary = next((ln.strip("= ") for ln in reversed(run.stdout.splitlines()) if ln.strip()), "")
    print(f"gpu tests ({', '.join(files)}): exit status {rc}" + (" (they skip without CUDA)" if rehearsal else ""),
          flush=True)
    REPORT.append(f"- Triton self-check ({'interpreted' if rehearsal else dev.type}): passed. `gpu` tests "
                  f"({len(files)} files): {summary} (exit status {rc}).")
    return 0 if rc in (0, 5) and rehearsal else rc


# -- bench -------------------------------------------------------------------------------------------

def bench(dev, gib: float) -> str:
    import torch

    from deltasync.apply import apply_prepared, prepare_delta
    from deltasync.codec import EncodeOptions, diff_chunk, diff_states, encode_diff
    from deltasync.dtypes import word_view
    from deltasync.fingerprint import fingerprint_state, tensor_fingerprint
    from deltasync.kernels import gpu

    sync = _sync(dev)
    n = int(gib * (1 << 30)) // 2
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU rehearsal (interpreted Triton: not a speed)"
    rows = [f"device: {name}; state {n * 2 / 2**30:.3g} GiB bf16", "",
            "| loop | unchanged | GB/s | of `copy_` |", "|---|---|---|---|"]
    dst = torch.empty_like(a)
    t_copy = _timed(lambda: dst.copy_(a), sync)
    copy_bw = 2 * a.numel() * 2 / t_copy / 1e9  # read + write
    rows.append(f"| `copy_` (read + write) | - | {copy_bw:.3g} | 1.00 |")
    nbytes = a.numel() * 2

    def row(label, unchanged, moved, t):
        rows.append(f"| {label} | {unchanged} | {moved / t / 1e9:.3g} | {moved / t / 1e9 / copy_bw:.2f} |")

    for unchanged in (0.99, 0.95):
        b = a.clone()
        wb = word_view(b)
        sel = torch.rand(n, device=dev, generator=g) > unchanged
        wb[sel] += 1
        wa = word_view(a)
        u = f"{unchanged:.0%}"
        row("compare + compaction (Triton)", u, 2 * nbytes, _timed(lambda: gpu.changed_positions(wa, wb), sync))
        row("compare + compaction (torch)", u, 2 * nbytes, _timed(lambda: torch.nonzero(wa != wb), sync))
        row("diff_chunk (to host)", u, 2 * nbytes, _timed(lambda: diff_chunk(wa, wb, 0, wa.numel(), 2), sync))
        pos = gpu.changed_positions(wa, wb)
        vals = wb.index_select(0, pos) - wa.index_select(0, pos)
        raw = torch.zeros(pos.numel(), dtype=torch.bool, device=dev)
        live = wa.clone()
        moved = pos.numel() * (8 + 2 + 1 + 2 * 2 + 2)
        row(f"patch (Triton), {pos.numel():,} changes (bytes moved)", u, moved,
            _timed(lambda: gpu.patch_words(live, pos, raw, vals), sync))  # re-applies steps: speed only
        # the whole paths, on up to 512 MiB of it: the publisher's diff of a state of 8 tensors (reference
        # patched in place), then decode + apply of that delta on the device, verified (state bytes over time)
        m = min(n, 1 << 28) // 8
        parts = {f"t{i}": a[i * m:(i + 1) * m].clone() for i in range(8)}
        newer = {k: b[i * m:(i + 1) * m].clone() for i, k in enumerate(parts)}
        sub_bytes = 8 * m * 2
        fps = fingerprint_state(parts)
        ref = {k: t.clone() for k, t in parts.items()}

        def publish_diff():
            for k in ref:
                ref[k].copy_(parts[k])
            return diff_states(ref, newer, base_fps=fps, update_old=True)

        t_restore = _timed(lambda: [ref[k].copy_(parts[k]) for k in ref], sync)
        row(f"publisher's diff_states (update_old), {sub_bytes / 2**20:.3g} MiB", u, 2 * sub_bytes,
            max(_timed(publish_diff, sync, 3) - t_restore, 1e-9))
        enc = encode_diff(publish_diff(), model="m", version=2, parent=1, options=EncodeOptions())
        prepared = prepare_delta(enc.manifest, enc.blobs)
        target = {k: t.clone() for k, t in parts.items()}

        def apply_once():
            for k in target:
                target[k].copy_(parts[k])
            apply_prepared(target, prepared, fps)

        t_apply = max(_timed(apply_once, sync, 3) - t_restore, 1e-9)
        assert all(torch.equal(word_view(target[k]), word_view(newer[k])) for k in target), "apply on the device"
        row(f"apply_prepared, verified, {sub_bytes / 2**20:.3g} MiB (state bytes)", u, sub_bytes, t_apply)
    row("fingerprint (Triton lane sums)", "-", nbytes, _timed(lambda: tensor_fingerprint(a), sync))
    return "\n".join(rows) + "\n"


# -- hf ----------------------------------------------------------------------------------------------

def follow_hf(dev, steps: int, big: bool, profile: Path | None = None) -> str:
    """A live transformers model on ``dev`` follows its trainer's stream while it generates. ``profile``: a
    folder for cProfile's tables of the applies (the pauses) and of the publishes (what held the trainer)."""
    import cProfile
    import pstats

    import torch
    import transformers

    from deltasync.cli.cluster import LocalCluster
    from deltasync.client.hf import hf_applier
    from deltasync.client.publisher import Publisher
    from deltasync.client.subscriber import ThreadedSubscriber

    if big:  # ~135 M parameters: 270 MB of bf16 weights
        shape = dict(vocab_size=32_000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=8)
    else:
        shape = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    config = transformers.Qwen2Config(**shape, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    trainer = transformers.Qwen2ForCausalLM(config).to(dev)  # fp32 masters
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5 if big else 3e-3)
    saver = transformers.Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).to(dev)
    torch.manual_seed(99)  # random: everything it holds comes from the stream
    live = transformers.Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).to(dev).eval()
    applier = hf_applier(live)
    vocab = shape["vocab_size"]
    data = torch.randint(0, vocab, (4, 64 if big else 12), generator=torch.Generator().manual_seed(1)).to(dev)
    prompt = torch.tensor([[1, 2, 3, 4]], device=dev)
    sync = _sync(dev)

    def bf16_state():
        saver.load_state_dict(trainer.state_dict())
        return {n: t.detach() for n, t in saver.state_dict().items() if n != "lm_head.weight"}  # as save_pretrained

    pauses, blocking, sizes, steps_log = [], [], [], []
    profs = {"apply": cProfile.Profile(), "publish": cProfile.Profile()} if profile is not None else None

    def profiled(kind, fn, *a):
        if profs is None:
            return fn(*a)
        profs[kind].enable()
        try:
            return fn(*a)
        finally:
            sync()
            profs[kind].disable()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(tmp)
        try:
            cluster.start_origin()
            with Publisher(cluster.origin, "gpu-check", cluster.token, keyframe_every=0) as pub, \
                    ThreadedSubscriber(cluster.origin, "gpu-check", applier, use_squash=False) as sub:
                for step in range(steps + 1):
                    if step:
                        loss = trainer(input_ids=data, labels=data).loss
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                    state = bf16_state()
                    pending = (pub.publish(step, state) if not step else
                               profiled("publish", pub.publish, step, state))  # step 0: the keyframe
                    blocking.append(pending.blocking_s)
                    if step == 0:
                        ref_devices = {t.device.type for t in pub.served.values()}
                        assert ref_devices == {dev.type}, f"the publisher's reference is on {ref_devices}"
                    deadline = time.monotonic() + 120
                    tokens = 0
                    while not any(v == step for _, v in sub.ready_steps()):  # serving while the step arrives
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"step {step} did not arrive in 120 s (subscriber {sub.status})")
                        with torch.no_grad():
                            live.generate(prompt, max_new_tokens=4, do_sample=False)
                        tokens += 4
                    sync()
                    t0 = time.perf_counter()
                    version = (sub.apply_pending() if not step else
                               profiled("apply", sub.apply_pending))  # the pause: the engine's thread patches in place
                    sync()
                    if step:
                        pauses.append(time.perf_counter() - t0)
                    assert version == step, f"applied v{version}, expected v{step}"
                    line = (f"step {step}: generated {tokens} tokens while it arrived; applied in "
                            f"{(time.perf_counter() - t0) * 1e3:.1f} ms; publish() held the trainer "
                            f"{pending.blocking_s * 1e3:.1f} ms")
                    print("  " + line, flush=True)
                    steps_log.append(line)
                pub.flush(60)
                sizes = [r.blob_bytes for r in pub.results]
        finally:
            cluster.close()
    if profs is not None:
        profile.mkdir(parents=True, exist_ok=True)
        for kind, prof in profs.items():
            with open(profile / f"{kind}.txt", "w") as f:
                for order in ("cumulative", "tottime"):
                    pstats.Stats(prof, stream=f).sort_stats(order).print_stats(45)
    final = bf16_state()
    got = {n: t for n, t in live.state_dict().items() if n != "lm_head.weight"}
    for n, t in final.items():
        assert torch.equal(t.view(torch.int16), got[n].view(torch.int16)), f"{n} differs from the trainer's state"
    with torch.no_grad():
        a, b = live(input_ids=data).logits, saver(input_ids=data).logits
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "logits differ"
        assert torch.equal(live.generate(prompt, max_new_tokens=8, do_sample=False),
                           saver.generate(prompt, max_new_tokens=8, do_sample=False)), "generations differ"
    params = sum(t.numel() for t in final.values())
    pauses_ms = sorted(p * 1e3 for p in pauses)
    deltas = sizes[1:] if len(sizes) > 1 else sizes
    summary = (f"hf: Qwen2ForCausalLM ({params:,} parameters, bf16) on {dev.type} followed {steps} steps "
            f"bit-exactly while generating; apply pause per step: median {pauses_ms[len(pauses_ms) // 2]:.1f} ms, "
            f"max {pauses_ms[-1]:.1f} ms; publish() held the trainer: median "
            f"{sorted(blocking[1:])[len(blocking[1:]) // 2] * 1e3:.1f} ms (diff on {dev.type}); delta blobs median "
            f"{sorted(deltas)[len(deltas) // 2] / 1e3:.1f} kB")
    REPORT.extend(["- " + summary, "", "  " + "; ".join(steps_log)])
    return summary


# -- main --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="cpu: the rehearsal (same flows, small, Triton interpreted); default: cuda, or exit 2")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ap.add_argument("--gib", type=float, default=None, help="bench state size (default 2 on cuda, 0.0005 on cpu)")
    ap.add_argument("--steps", type=int, default=None, help="hf: published steps (default 10 on cuda, 3 on cpu)")
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the results as markdown here (BENCHMARKS.md's GPU section: benchmarks/run.py "
                         "includes benchmarks/results/gpu_check.md)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="hf: write cProfile tables of the applies and publishes (steps 1+) into this folder")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(unknown)}")
    rehearsal = args.device == "cpu"
    if rehearsal:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    try:
        import torch
    except ImportError:
        print("gpu-check: torch does not import", file=sys.stderr)
        return 2
    if not rehearsal and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); run `make gpu-check` on a "
              "machine with an NVIDIA GPU and a CUDA build of torch (or rehearse: --device cpu)", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        if not rehearsal:
            print("gpu-check: triton does not import; pip install triton (it ships with CUDA builds of torch)",
                  file=sys.stderr)
            return 2
        print("gpu-check rehearsal: triton does not import; the core's CUDA paths run their torch fallbacks")
    from deltasync import kernels

    dev = torch.device("cpu" if rehearsal else "cuda")
    if rehearsal and "triton" in sys.modules:
        kernels.select("reference")
        kernels.triton_on_cpu(True)
    t_start = time.perf_counter()
    failed = []
    for part in parts:  # each part runs even when one before it failed: one lease shows every failure
        t0 = time.perf_counter()
        print(f"== {part}", flush=True)
        try:
            if part == "tests":
                if run_tests(dev, rehearsal):
                    failed.append(part)
            elif part == "bench":
                table = bench(dev, args.gib if args.gib is not None else (0.0005 if rehearsal else 2.0))
                print(table, flush=True)
                REPORT.extend(["", table])
            elif part == "hf":
                try:
                    import transformers  # noqa: F401
                except ImportError:
                    print("hf: transformers does not import" + (" (the rehearsal skips it; `pip install transformers`)"
                                                                if rehearsal else ""), flush=True)
                    if not rehearsal:
                        failed.append(part)
                    continue
                print(follow_hf(dev, args.steps if args.steps is not None else (3 if rehearsal else 10), not rehearsal,
                            args.profile), flush=True)
        except Exception:
            traceback.print_exc()
            failed.append(part)
        print(f"== {part}: {time.perf_counter() - t0:.1f} s{' FAILED' if part in failed else ''}", flush=True)
    rc = 1 if failed else 0
    if args.out is not None:
        import platform

        import triton

        gpu_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "no GPU (rehearsal on CPU)"
        head = [f"`make gpu-check`{' (rehearsal: --device cpu)' if rehearsal else ''}, "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {gpu_name}; {os.cpu_count()} CPUs; Python "
                f"{platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}. Parts "
                f"{', '.join(parts)}: " + (f"failed: {', '.join(failed)}" if failed else "all passed") +
                f", {time.perf_counter() - t_start:.0f} s.", ""]
        args.out.write_text("\n".join(head + REPORT).rstrip() + "\n")
    print(f"gpu-check {'rehearsal ' if rehearsal else ''}done in {time.perf_counter() - t_start:.1f} s, "
          f"exit status {rc}" + (f" (failed: {', '.join(failed)})" if failed else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
