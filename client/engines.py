"""Engine parameters checked against a layout map before anything is patched.

**Start here for engines:** :mod:`deltasync.layout` (layout maps from engine facts: vLLM and SGLang
naming of dense and MoE models, TP/EP shards, padded vocab, replicated KV heads, tied weights) and
:class:`deltasync.client.sharded.ShardedApplier` (the Applier seam for one rank of a TP/EP group:
blob selection, O(changed) patching, one vote, all-or-nothing over the group). This module holds
:func:`check_engine_params`, which checks an engine's live parameters against a map before anything
is patched (fails closed on FP8 weights fed a non-FP8 stream and on weights the map does not know);
:mod:`deltasync.client.sglang` and :mod:`deltasync.client.hf` wire them into SGLang and Hugging Face
models. Nothing here imports an engine. (The earlier single-purpose helpers, ``fused_target`` and the
``TPShardApplier``, are gone: the layout maps and ``ShardedApplier`` do their work, and only tests used them.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deltasync.dtypes import dtype_info
from deltasync.errors import BaseMismatchError


def check_engine_params(layout, params: Mapping[str, torch.Tensor]) -> None:
    """Fail closed before anything is patched: every engine parameter is one the layout map feeds, in the
    dtype and shape the map expects. Raises UnsupportedError naming the first FP8 parameter of an
    FP8-serving engine fed a non-FP8 stream, or the first parameter the map does not know (a quantization
    scale, a packed or transposed weight); BaseMismatchError for a shape the facts do not explain."""
    from deltasync.errors import UnsupportedError

    for name, t in params.items():
        want = layout.params.get(name)
        have = dtype_info(t.dtype).name
        if have.startswith("float8") and (want is None or not want[0].startswith("float8")):
            stream = want[0] if want else next(iter(layout.stream.values()))[0]
            raise UnsupportedError(
                f"engine parameter {name!r} is {have}: this engine serves FP8 weights and the stream is {stream}; "
                "an in-place update needs the stream in the engine's serving format (FP8 with its scales: "
                "Publisher(serve=['fp8-block']) publishes one, which vLLM's worker extension follows; this engine's "
                "glue maps bf16 streams only), or serve the model unquantized")
    for name, t in params.items():
        if name in layout.tied_params:
            continue
        want = layout.params.get(name)
        if want is None:
            raise UnsupportedError(f"engine parameter {name!r} is not in the layout map (a quantization scale, a "
                                   "packed or transposed weight, or a layer the map does not cover); refusing to "
                                   "patch an engine some of whose weights would stay stale")
        if tuple(t.shape) != tuple(want[1]) or dtype_info(t.dtype).name != want[0]:
            raise BaseMismatchError(f"{name}: the engine holds {dtype_info(t.dtype).name} {tuple(t.shape)}, the map "
                                    f"expects {want[0]} {tuple(want[1])} (check TP size, heads, kv heads, vocab)")
    missing = [n for n in layout.params if n not in params]
    if missing:
        raise BaseMismatchError(f"the layout map expects engine parameter {missing[0]!r}, which the engine lacks")
