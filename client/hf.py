"""A live Hugging Face model (any ``nn.Module`` with checkpoint names) as an Applier.

``hf_applier(model)`` maps every parameter and persistent buffer to the stream tensor of its
state-dict name (:func:`deltasync.layout.hf_layout`, single rank). Tied parameters are found by
shared memory (``lm_head.weight`` is ``model.embed_tokens.weight`` when ``tie_word_embeddings``):
Hugging Face checkpoint files omit the tied copy, so by default the stream is expected without it
and the shared memory is patched once through the primary; pass ``stream=`` (the stream's tensor
names, e.g. from its first manifest) when the stream carries the copy too, then it is an alias
whose changes must equal the primary's.

    sub = ThreadedSubscriber(urls, "policy", hf_applier(model), verifier=key)

Patch between ``generate`` calls (``sub.apply_pending()``); the module's memory changes in place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deltasync.client.sharded import GroupComm, ShardedApplier
from deltasync.dtypes import dtype_info
from deltasync.layout import hf_layout


def tied_parameters(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> earlier name with the very same memory (same storage, offset, shape, strides)."""
    seen: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
    return tied


def hf_applier(model: torch.nn.Module, *, stream: Iterable[str] | None = None) -> ShardedApplier:
    """Applier over ``model``'s state-dict tensors (parameters and persistent buffers), tied weights recognised."""
    tensors = {n: t.detach() for n, t in model.state_dict(keep_vars=True).items()}
    tied = tied_parameters(tensors)
    layout = hf_layout({n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in tensors.items()},
                       stream=stream, tied=tied)
    return ShardedApplier(layout, tensors, comm=GroupComm(local=True))
