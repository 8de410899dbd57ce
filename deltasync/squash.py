"""Squash a chain of deltas v→v+1→…→v+k into one delta v→v+k, without the model.

Changes compose position by position (:mod:`deltasync.values`): two steps add
(modulo the word width; a sum of zero drops the position), a step after a raw
word moves that word, and a raw word replaces whatever came before. The result
applied to v equals applying the chain in order, bit for bit; its fingerprints
are the chain's first ``fp_before`` and last ``fp_after``.

A chain in the base-conditioned coding (docs/FORMAT.md §4.4: decoding needs the base) or the history coding
(§4.5: decoding needs the deltas before, and a squashed delta would leave the history its successors were
coded with) is refused with :class:`~deltasync.errors.UnsupportedError` before any blob is read; subscribers
walk such chains.

Work is bounded (:class:`SquashBudget`): the words read from the chain's blobs, the changed
words held, the output bytes and the wall time each have a cap, checked between steps; going
over raises :class:`~deltasync.errors.TooLargeError` (413) saying which cap and what to do. A
chain whose blobs name tensors, dtypes or word ranges its manifests do not list is a
:class:`~deltasync.errors.IntegrityError` (422). The packing walks only the chunks that hold
changes, so a (crafted) huge shape with few changes costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .blob import blob_version
from .codec import ChunkPacker, EncodeOptions, Encoded, decode_blob
from .dtypes import dtype_info, numpy_word_dtype
from .errors import ChainError, IntegrityError, TooLargeError, UnsupportedError
from .manifest import BlobRef, Manifest, TensorRecord
from .values import Changes

#: default caps of one squash (docs/FORMAT.md §5.1 "Limits")
MAX_SQUASH_CHAIN_BYTES = 16 << 30  # blob bytes read from the chain
MAX_SQUASH_WORDS = 1 << 31  # changed words decoded from the chain, and held after composing
MAX_SQUASH_OUTPUT_BYTES = 16 << 30  # bytes of the squashed blobs
MAX_SQUASH_SECONDS = 120.0  # wall time of one build


@dataclass(frozen=True, slots=True, kw_only=True)
class SquashBudget:
    """The most work one squash may do; each cap going over raises TooLargeError."""

    chain_bytes: int = MAX_SQUASH_CHAIN_BYTES
    words: int = MAX_SQUASH_WORDS
    output_bytes: int = MAX_SQUASH_OUTPUT_BYTES
    seconds: float = MAX_SQUASH_SECONDS


class _Meter:
    def __init__(self, budget: SquashBudget, what: str) -> None:
        self.budget = budget
        self.what = what
        self.deadline = time.monotonic() + budget.seconds

    def over(self, cap: str, found: int | float, limit: int | float) -> TooLargeError:
        return TooLargeError(f"squash {self.what}: {cap} {found} is over the limit of {limit}; "
                             "fetch the chain version by version (or from a keyframe) instead")

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.over("time (s)", round(time.monotonic() - self.deadline + self.budget.seconds, 2),
                            self.budget.seconds)


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
        if m.coding != "base-free":
            why = ("decoding it needs the stream's history, so it cannot be squashed" if m.coding == "history" else
                   "decoding it needs the base model, so it cannot be squashed without the model")
            raise UnsupportedError(f"{m.model} v{m.version} uses the {m.coding} coding: {why}; fetch the chain "
                                   "version by version")
        if m.model != manifests[0].model:
            raise ChainError(f"chain mixes models {manifests[0].model!r} and {m.model!r}")
    for a, b in zip(manifests, manifests[1:]):
        if b.parent != a.version:
            raise ChainError(f"chain breaks: v{b.version} has parent v{b.parent}, not v{a.version}")
        if b.state_fp_before != a.state_fp:
            raise ChainError(f"chain breaks: v{b.version}'s base state is not v{a.version}'s result")


def squash_chain(manifests: Sequence[Manifest], get_blob: Callable[[str], bytes], *, options: EncodeOptions | None = None,
                 budget: SquashBudget | None = None) -> Encoded:
    """One delta from ``manifests[0].parent`` to ``manifests[-1].version``; unsigned. Without ``options``
    it is written in the newest blob format found in the chain (docs/FORMAT.md §4.2).
    TooLargeError past any cap of ``budget``; IntegrityError if a blob disagrees with its manifest."""
    check_chain(manifests)
    budget = budget or SquashBudget()
    first, last = manifests[0], manifests[-1]
    meter = _Meter(budget, f"{first.model} v{first.parent}→v{last.version}")
    chain_bytes = sum(m.total_bytes for m in manifests)
    if chain_bytes > budget.chain_bytes:
        raise meter.over("chain bytes", chain_bytes, budget.chain_bytes)
    words_read = 0
    newest = 1  # the newest blob format in the chain
    per_tensor: dict[str, Changes] = {}
    first_records = {t.name: t for t in first.tensors}
    for m in manifests:
        layout = {t.name: t for t in m.tensors}
        for ref in m.blobs:
            meter.tick()
            data = get_blob(ref.id)
            if len(data) != ref.size:
                raise IntegrityError(f"v{m.version}: blob {ref.id} is {len(data)} bytes, its manifest says {ref.size}")
            version = blob_version(data)
            newest = max(newest, version)
            if version == 3:  # a base- or history-conditioned blob under a manifest that does not say so
                raise UnsupportedError(f"v{m.version}: blob {ref.id} is blob format 3 (the base-conditioned or history "
                                       "coding), which cannot be squashed without the model or the stream's history; "
                                       "fetch the chain version by version")
            for patch in decode_blob(data):
                rec = layout.get(patch.tensor)
                if rec is None or rec.dtype != patch.dtype or patch.stop > rec.words:
                    raise IntegrityError(f"v{m.version}: blob {ref.id} patches {patch.tensor!r}[{patch.start}:{patch.stop}] "
                                         f"({patch.dtype}), which v{m.version}'s manifest does not list")
                words_read += patch.count
                if words_read > budget.words:
                    raise meter.over("changed words read", words_read, budget.words)
                prev = per_tensor.get(patch.tensor)
                ch = patch.as_changes()
                per_tensor[patch.tensor] = ch if prev is None else compose_changes(prev, ch)
                meter.tick()
    if options is None:  # never newer than the chain: subscribers that read the chain read its squash
        options = EncodeOptions(format=newest)
    # decode_blob yields a blob's chunks in order, and a version's blobs are in tensor order,
    # so composing blob by blob applies each version's chunks once and versions in sequence.
    packer = ChunkPacker(options)
    tensors = []
    # every tensor any version lists (format 3 lists only what a version changes), its latest record
    latest: dict[str, TensorRecord] = {}
    for m in manifests:
        for t in m.tensors:
            prev = latest.get(t.name)
            if prev is not None and (prev.dtype, prev.shape) != (t.dtype, t.shape):
                raise IntegrityError(f"{t.name}: v{m.version} lists it as {t.dtype} {t.shape}, an earlier version of "
                                     f"the chain as {prev.dtype} {prev.shape}")
            latest[t.name] = t
    compact = any(m.format >= 3 for m in manifests)
    for name in sorted(latest):
        rec = latest[name]
        rec0 = first_records.get(name, rec)
        info = dtype_info(rec.dtype)
        ch = per_tensor.get(rec.name)
        count = 0
        if ch is not None and len(ch) and int(ch.positions[-1]) >= rec.words:
            raise IntegrityError(f"{rec.name}: the chain changes word {int(ch.positions[-1])}, past the {rec.words} words "
                                 f"v{last.version}'s manifest gives it")
        if ch is not None and len(ch):
            cw = options.chunk_words
            # only the chunks holding changes: never a loop over every chunk of a (possibly huge) shape
            for k in np.unique(ch.positions // cw).tolist():
                meter.tick()
                s, e = k * cw, min((k + 1) * cw, rec.words)
                lo, hi = np.searchsorted(ch.positions, [s, e])
                if hi > lo:
                    part = Changes(positions=ch.positions[lo:hi], raw=ch.raw[lo:hi],
                                   values=ch.values[lo:hi].astype(numpy_word_dtype(info.word_size), copy=False))
                    packer.add(rec.name, info, s, e, part)
                    count += int(hi - lo)
                    out = sum(len(b) for b in packer.blobs.values())
                    if out > budget.output_bytes:
                        raise meter.over("output bytes", out, budget.output_bytes)
        tensors.append((rec0, rec, count))
    packer.close_blob()
    out = sum(len(b) for b in packer.blobs.values())
    if out > budget.output_bytes:
        raise meter.over("output bytes", out, budget.output_bytes)
    records = tuple(
        TensorRecord(name=r.name, dtype=r.dtype, shape=r.shape, fp_before=None if compact else r0.fp_before,
                     fp_after=r.fp_after, changed=count, chunks=tuple(packer.refs.get(r.name, ())))
        for r0, r, count in tensors
        if not compact or count
    )
    manifest = Manifest(
        model=first.model, version=last.version, parent=first.parent, kind="delta", tensors=records,
        blobs=tuple(BlobRef(id=b, size=len(packer.blobs[b])) for b in packer.order),
        state_fp=last.state_fp, state_fp_before=first.state_fp_before,
        meta={"squashed": f"{first.parent}..{last.version}"},
    )
    # a chain in format 3 squashes into format 3 (tensors the chain put back as they were are left out)
    return Encoded(manifest=manifest.compact() if compact else manifest, blobs=packer.blobs)
