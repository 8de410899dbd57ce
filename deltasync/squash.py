"""Squash a chain of deltas v→v+1→…→v+k into one delta v→v+k, without the model.

Changes compose position by position (:mod:`deltasync.values`): two steps add
(modulo the word width; a sum of zero drops the position), a step after a raw
word moves that word, and a raw word replaces whatever came before. The result
applied to v equals applying the chain in order, bit for bit; its fingerprints
are the chain's first ``fp_before`` and last ``fp_after``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .codec import ChunkPacker, EncodeOptions, Encoded, chunk_ranges, decode_blob
from .dtypes import dtype_info, numpy_word_dtype
from .errors import ChainError
from .manifest import BlobRef, Manifest, TensorRecord
from .values import Changes


def compose_changes(first: Changes, second: Changes) -> Changes:
    """Changes equal to applying ``first`` then ``second``."""
    if len(first) == 0:
        return second
    if len(second) == 0:
        return first
    union = np.union1d(first.positions, second.positions)
    raw = np.zeros(union.size, dtype=np.bool_)
    values = np.zeros(union.size, dtype=first.values.dtype)
    present = np.zeros(union.size, dtype=np.bool_)
    ia = np.searchsorted(union, first.positions)
    raw[ia], values[ia], present[ia] = first.raw, first.values, True
    ib = np.searchsorted(union, second.positions)
    prev_present, prev_val = present[ib], values[ib]
    with np.errstate(over="ignore"):
        summed = np.where(prev_present, prev_val + second.values, second.values)
    values[ib] = np.where(second.raw, second.values, summed)
    raw[ib] = second.raw | (prev_present & raw[ib])
    keep = raw | (values != 0)
    return Changes(positions=union[keep], raw=raw[keep], values=values[keep])


def check_chain(manifests: Sequence[Manifest]) -> None:
    if not manifests:
        raise ChainError("nothing to squash: the chain is empty")
    for m in manifests:
        if m.kind != "delta":
            raise ChainError(f"v{m.version} is a {m.kind}; only deltas squash")
        if m.model != manifests[0].model:
            raise ChainError(f"chain mixes models {manifests[0].model!r} and {m.model!r}")
    for a, b in zip(manifests, manifests[1:]):
        if b.parent != a.version:
            raise ChainError(f"chain breaks: v{b.version} has parent v{b.parent}, not v{a.version}")
        if b.state_fp_before != a.state_fp:
            raise ChainError(f"chain breaks: v{b.version}'s base state is not v{a.version}'s result")


def squash_chain(manifests: Sequence[Manifest], get_blob: Callable[[str], bytes], *, options: EncodeOptions | None = None) -> Encoded:
    """One delta from ``manifests[0].parent`` to ``manifests[-1].version``; unsigned."""
    check_chain(manifests)
    options = options or EncodeOptions()
    first, last = manifests[0], manifests[-1]
    per_tensor: dict[str, Changes] = {}
    for m in manifests:
        for ref in m.blobs:
            for patch in decode_blob(get_blob(ref.id)):
                prev = per_tensor.get(patch.tensor)
                ch = patch.as_changes()
                per_tensor[patch.tensor] = ch if prev is None else compose_changes(prev, ch)
    # decode_blob yields a blob's chunks in order, and a version's blobs are in tensor order,
    # so composing blob by blob applies each version's chunks once and versions in sequence.
    packer = ChunkPacker(options)
    tensors = []
    for rec0 in first.tensors:
        rec = last.tensor(rec0.name)
        info = dtype_info(rec.dtype)
        ch = per_tensor.get(rec.name)
        count = 0
        if ch is not None and len(ch):
            for s, e in chunk_ranges(rec.words, options.chunk_words):
                lo, hi = np.searchsorted(ch.positions, [s, e])
                if hi > lo:
                    part = Changes(positions=ch.positions[lo:hi], raw=ch.raw[lo:hi],
                                   values=ch.values[lo:hi].astype(numpy_word_dtype(info.word_size), copy=False))
                    packer.add(rec.name, info, s, e, part)
                    count += int(hi - lo)
        tensors.append((rec0, rec, count))
    packer.close_blob()
    records = tuple(
        TensorRecord(name=r.name, dtype=r.dtype, shape=r.shape, fp_before=r0.fp_before, fp_after=r.fp_after,
                     changed=count, chunks=tuple(packer.refs.get(r.name, ())))
        for r0, r, count in tensors
    )
    manifest = Manifest(
        model=first.model, version=last.version, parent=first.parent, kind="delta", tensors=records,
        blobs=tuple(BlobRef(id=b, size=len(packer.blobs[b])) for b in packer.order),
        state_fp=last.state_fp, state_fp_before=first.state_fp_before,
        meta={"squashed": f"{first.parent}..{last.version}"},
    )
    return Encoded(manifest=manifest, blobs=packer.blobs)
