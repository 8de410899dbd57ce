"""Serving-format streams beside a bf16 stream: one trainer, fleets serving FP8 or INT4.

``Publisher(..., serve=["fp8-block", "int4"])`` publishes, with every version of ``M``, the state in each
serving format (:mod:`deltasync.quant`: bit-identical to the quantized checkpoint vLLM loads) as a stream of
its own: ``M.fp8`` (fp8-block) and ``M.int4`` (int4), each with its own chain, keyframes (``M.fp8.kf``),
budget and signature. Their manifests' ``meta`` name the format (FORMAT.md §11)::

    deltasync.serving_format   "fp8-block" | "int4"
    deltasync.serves           the bf16 stream it is derived from ("M")
    deltasync.quantization     the checkpoint's quantization_config (canonical JSON): what engines load
    deltasync.serving_ignore   the format's ignore list (JSON): which tensors the stream carries unquantized

Each serving stream is a :class:`~deltasync.client.publisher.Publisher` of its own fed the derived state
(:class:`deltasync.quant.ServingDeriver`: only tensors whose bf16 words changed are requantized), so deltas
over the quantized words (fp8: 1-byte words; packed INT4: int32 words) and their scales go through the codec's
ordinary paths, and ``budget=`` caps each serving delta too. Thread-safety: the publisher's (one caller).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import torch

from deltasync.quant import ServingDeriver, ServingFormat

#: stream-name suffix per format
SUFFIXES = {"fp8-block": "fp8", "int4": "int4"}

FORMAT_META = "deltasync.serving_format"
SERVES_META = "deltasync.serves"
QUANT_META = "deltasync.quantization"
IGNORE_META = "deltasync.serving_ignore"


def serving_model(model: str, fmt: ServingFormat | str) -> str:
    """The stream name of ``model`` in serving format ``fmt`` (``policy`` -> ``policy.fp8``)."""
    name = fmt.name if isinstance(fmt, ServingFormat) else fmt
    if name not in SUFFIXES:
        raise ValueError(f"serving format {name!r}: known formats are {', '.join(SUFFIXES)}")
    return f"{model}.{SUFFIXES[name]}"


def serving_meta(model: str, fmt: ServingFormat) -> dict[str, str]:
    return {FORMAT_META: fmt.name, SERVES_META: model,
            QUANT_META: json.dumps(fmt.quantization_config(), sort_keys=True, separators=(",", ":")),
            IGNORE_META: json.dumps(list(fmt.ignore), separators=(",", ":"))}


def format_of(meta: Mapping[str, str]) -> ServingFormat | None:
    """The serving format a manifest's ``meta`` declares (None: a plain stream)."""
    name = meta.get(FORMAT_META)
    if name is None:
        return None
    cfg = json.loads(meta.get(QUANT_META, "{}"))
    ignore = tuple(json.loads(meta[IGNORE_META])) if IGNORE_META in meta else ServingFormat(name=name).ignore
    if name == "fp8-block":
        return ServingFormat(name=name, block=tuple(cfg.get("weight_block_size", (128, 128))), ignore=ignore)
    group = cfg.get("config_groups", {}).get("group_0", {}).get("weights", {}).get("group_size", 32)
    return ServingFormat(name=name, group=int(group), ignore=ignore)


class ServingStreams:
    """The serving-format streams of one publisher: a deriver and a child publisher per format."""

    def __init__(self, model: str, formats: Sequence[ServingFormat | str],
                 make_publisher: Callable[[str], object]) -> None:
        self.streams: list[tuple[ServingFormat, ServingDeriver, object, dict[str, str]]] = []
        seen = set()
        for f in formats:
            fmt = f if isinstance(f, ServingFormat) else ServingFormat(name=f)
            name = serving_model(model, fmt)
            if name in seen:
                raise ValueError(f"serving format {fmt.name} listed twice")
            seen.add(name)
            self.streams.append((fmt, ServingDeriver(fmt), make_publisher(name), serving_meta(model, fmt)))

    @property
    def publishers(self) -> dict[str, object]:
        """Stream name -> its Publisher."""
        return {p.model: p for _, _, p, _ in self.streams}

    def publish(self, step: int, tensors: Mapping[str, torch.Tensor], *, keyframe: bool,
                meta: Mapping[str, str] | None) -> dict[str, object]:
        """Derive and publish every serving stream's version ``step``; stream name -> PendingVersion."""
        out = {}
        with torch.no_grad():
            for _, deriver, pub, fmeta in self.streams:
                state = deriver.derive(tensors)
                out[pub.model] = pub.publish(step, state, keyframe=keyframe, meta={**(meta or {}), **fmeta})
        return out

    def flush(self, timeout: float | None = None) -> None:
        for _, _, pub, _ in self.streams:
            pub.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        first: BaseException | None = None
        for _, _, pub, _ in self.streams:
            try:
                pub.close(timeout)
            except BaseException as e:  # close every child; raise the first failure
                first = first or e
        if first is not None:
            raise first
