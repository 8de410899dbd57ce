"""One version published from files (``deltasync publish``), in memory O(changed).

The two files are memory maps (:class:`~deltasync.tensorfile.MappedTensorFile`): what is read
is page cache, not anonymous memory, and nothing is copied whole.

* :func:`publish_delta`: the state diffed tensor by tensor, chunk by chunk against a local base
  that holds the origin's head (the caller checks that with :func:`check_base_file`), never
  touching either file (``diff_states(update_old=False)``); only the sparse changes and the
  encoded blobs live in memory.
* :func:`publish_keyframe`: the state streamed as safetensors shards of at most
  ``shard_bytes`` (a tensor larger than that gets its own shard): each shard is built with one
  copy of its tensors (:func:`~deltasync.tensorfile.shard_bytes`), hashed, uploaded and dropped
  before the next but one is built.

The manifest goes last, signed by the caller's signer, as ``Publisher`` does.

States here are :class:`~deltasync.dtypes.HostTensor` words over the mapped files
(``MappedTensorFile.host``) or CPU torch tensors; with HostTensors nothing imports torch, so
``deltasync publish`` from files starts in a fraction of a second. A keyframe of HostTensors is
sent without building its shards (:func:`shard_pieces`): each shard is its header plus
memoryviews of the mapped tensors, and its blob id, digest and tensor fingerprints are computed
in one pass over those bytes, slice by slice while they are in cache.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from deltasync.blob import blob_id
from deltasync.digest import DigestHasher, blob_digest
from deltasync.dtypes import HostTensor, dtype_info
from deltasync.errors import BaseMismatchError
from deltasync.fingerprint import (fingerprint_from_lane_sums, fp_hex, host_lanes, host_lanes_sum, state_fingerprint,
                                   state_fingerprint_of, tensor_fingerprint)
from deltasync.manifest import BlobRef, ChunkRef, Manifest, TensorRecord
from deltasync.signing import Signer
from deltasync.tensorfile import build_header

if TYPE_CHECKING:  # .http and .upload import aiohttp (~0.25 s): loaded when a function here first sends
    import torch

    from deltasync.codec import EncodeOptions, StateDiff

    from .http import HttpClient

__all__ = ["FILE_SHARD_BYTES", "HASH_SLICE_BYTES", "Published", "ShardPieces", "check_base_file", "compare_pool",
           "publish_delta", "publish_keyframe", "shard_fingerprints", "shard_pieces", "start_compare"]

timeline = logging.getLogger("deltasync.timeline")  # time.monotonic() stamps (``DELTASYNC_TIMELINE=1``)

FILE_SHARD_BYTES = 64 << 20  # keyframe shards from files: peak memory is about two of them (none for HostTensors)
#: a keyframe shard's passes (hashes, then fingerprints) go this much at a time: a few calls per shard, each of which
#: releases the GIL; in 1 MiB slices the first shard's hashes waited on the GIL for every slice while numba was
#: imported on the warm-up thread (0.11 s for a 64 MiB shard against 0.03 s alone; in 8 MiB slices 0.045 s)
HASH_SLICE_BYTES = 8 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Published:
    manifest: Manifest  # as committed (signed)
    blob_bytes: int
    raw_bytes: int
    changed: int


def _pool() -> ThreadPoolExecutor:
    """Worker threads for the full passes over a state (compare, fingerprint): one per core, at most 4."""
    return ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="deltasync-publish")


def compare_pool() -> ThreadPoolExecutor:
    """The pool :func:`start_compare` and :func:`publish_delta` share (the caller shuts it down)."""
    return _pool()


def start_compare(base: Mapping[str, torch.Tensor | HostTensor], state: Mapping[str, torch.Tensor | HostTensor], *,
                  options: EncodeOptions | None = None, executor: Executor) -> asyncio.Future[StateDiff]:
    """Start the compare pass of a delta (``diff_states(update_old=False)``, the base's fingerprints out of the
    same pass) on ``executor``'s threads; needs a running loop. It needs only the two maps, so ``deltasync
    publish --base`` starts it before it imports the HTTP client and asks the origin for its head; nothing
    is sent until :func:`publish_delta` has checked the result against that head."""
    from deltasync.codec import EncodeOptions, diff_states, same_layout  # a delta's: numba's import (~0.2 s)

    if not same_layout(base, state):
        raise BaseMismatchError("the state's tensors differ from the base's (names, dtypes or shapes): publish a keyframe")
    chunk_words = (options or EncodeOptions()).chunk_words
    return asyncio.get_running_loop().run_in_executor(
        None, lambda: diff_states(base, state, chunk_words=chunk_words, update_old=False, executor=executor))


def _raw(state: Mapping[str, torch.Tensor | HostTensor]) -> int:
    nbytes = getattr(state, "nbytes", None)  # a mapped file's HostState knows its data's size
    return nbytes if isinstance(nbytes, int) else sum(t.numel() * t.element_size() for t in state.values())


def check_base_file(base: Mapping[str, torch.Tensor | HostTensor], head: Manifest, *, where: str) -> dict[str, int]:
    """The base's fingerprints when it is exactly ``head``'s state; BaseMismatchError naming both
    state fingerprints otherwise (one full read of the base, on the page cache)."""
    with _pool() as pool:
        fps = {n: tensor_fingerprint(t, executor=pool) for n, t in base.items()}
    _check_base(base, fps, head, where=where)
    return fps


def _check_base(base: Mapping[str, torch.Tensor | HostTensor], fps: Mapping[str, int], head: Manifest, *,
                where: str, have: str | None = None) -> None:
    """BaseMismatchError unless ``base`` with ``fps`` (its state fingerprint: ``have``, where known) is ``head``'s
    state."""
    have = state_fingerprint_of(base, fps) if have is None else have
    if have != head.state_fp:
        raise BaseMismatchError(
            f"{where} has state fingerprint {have}, the origin's head {head.model} v{head.version} has "
            f"{head.state_fp}: it is not the state the head was published from")


async def publish_delta(client: HttpClient, *, model: str, version: int, parent: int,
                        base: Mapping[str, torch.Tensor | HostTensor], state: Mapping[str, torch.Tensor | HostTensor],
                        base_fps: Mapping[str, int] | None = None, head: Manifest | None = None,
                        where: str = "the base", signer: Signer | None, options: EncodeOptions | None = None,
                        meta: Mapping[str, str] | None = None, concurrency: int = 4,
                        compared: Awaitable[StateDiff] | None = None, executor: Executor | None = None) -> Published:
    """Diff ``state`` against ``base`` (v``parent``) and publish it as v``version``.

    ``base_fps``: the base's fingerprints, already checked (:func:`check_base_file`). Without them,
    ``head`` (the origin's head manifest) is required: the base's fingerprints come out of the compare
    pass (``diff_states(base_fps=None)``) and the base's state fingerprint is checked against the head's
    before anything is encoded or uploaded (BaseMismatchError naming ``where``, nothing sent).
    ``compared``: that compare pass, already started (:func:`start_compare`, on ``executor``, which then
    also codes the chunks); it is checked against ``head`` the same way."""
    from deltasync.codec import EncodeOptions, diff_states, encode_diff, same_layout

    if not same_layout(base, state):
        raise BaseMismatchError("the state's tensors differ from the base's (names, dtypes or shapes): publish a keyframe")
    if base_fps is None and head is None:
        raise ValueError("publish_delta needs the base's checked fingerprints (base_fps) or the head to check it against")
    if compared is not None and (head is None or executor is None):
        raise ValueError("publish_delta(compared=) needs the head to check the compared base against, and its executor")
    from .upload import commit_manifest, upload_blobs

    options = options or EncodeOptions()
    loop = asyncio.get_running_loop()
    own = executor is None
    pool = _pool() if own else executor  # chunks compared and coded on two threads (the kernels release the GIL)
    try:
        if compared is not None:
            diff = await compared
        else:
            diff = await loop.run_in_executor(None, lambda: diff_states(base, state, base_fps=base_fps,
                                                                        chunk_words=options.chunk_words,
                                                                        update_old=False, executor=pool))
        timeline.debug("mono=%.6f publish-compared", time.monotonic())
        if base_fps is None:
            flat = getattr(diff, "flat", None)  # a columnar diff hashes its state fingerprints once (for the encode)
            have = flat.state_fps()[0] if flat is not None else None
            _check_base(base, diff.fps_before, head, where=where, have=have)
            timeline.debug("mono=%.6f publish-checked", time.monotonic())
        enc = await loop.run_in_executor(None, lambda: encode_diff(diff, model=model, version=version, parent=parent,
                                                                   options=options, meta=dict(meta or {}), base=base,
                                                                   executor=pool))
    finally:
        if own:
            pool.shutdown()
    del diff
    timeline.debug("mono=%.6f publish-encoded", time.monotonic())
    manifest = enc.manifest.with_digests(enc.blobs) if signer is not None else enc.manifest  # signed: every digest
    timeline.debug("mono=%.6f publish-digests", time.monotonic())
    await upload_blobs(client, enc.blobs, concurrency=concurrency, model=model)
    timeline.debug("mono=%.6f publish-uploaded", time.monotonic())
    signed = await commit_manifest(client, manifest, key=signer)
    timeline.debug("mono=%.6f publish-committed v%d", time.monotonic(), version)
    return Published(manifest=signed, blob_bytes=enc.manifest.total_bytes, raw_bytes=_raw(state),
                     changed=enc.manifest.changed_words)


def _groups(state: Mapping[str, torch.Tensor | HostTensor], shard_bytes_: int) -> list[list[str]]:
    shards: list[list[str]] = []
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if not shards or (size + nbytes > shard_bytes_ and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPieces:
    """A keyframe shard of HostTensors, not built: ``pieces`` (header, then each tensor's bytes as a
    memoryview of its words) concatenate to exactly what :func:`~deltasync.tensorfile.shard_bytes` makes."""

    id: str  # blob id (xxh3-128 of the concatenation)
    size: int
    digest: str | None  # ALG:HEX when asked for
    pieces: tuple[memoryview, ...]


def shard_pieces(tensors: Mapping[str, HostTensor], *, digest: bool, slice_bytes: int = HASH_SLICE_BYTES) -> ShardPieces:
    """The shard of ``tensors`` as pieces, with its blob id and digest (``digest=True``) from one pass over its
    bytes, ``slice_bytes`` at a time. Copies nothing, and needs no compiled kernel (the fingerprints are
    :func:`shard_fingerprints`'s)."""
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    header, offsets = build_header(layout)
    order = sorted(tensors, key=lambda n: offsets[n])
    xh = xxhash.xxh3_128()
    dh = DigestHasher() if digest else None
    xh.update(header)
    if dh is not None:
        dh.update(header)
    pieces = [memoryview(header)]
    for name in order:
        for _, _, piece in _slices(tensors[name], slice_bytes):
            xh.update(piece)
            if dh is not None:
                dh.update(piece)
        words = tensors[name].words
        pieces.append(memoryview(words).cast("B") if words.size else memoryview(b""))
    size = sum(len(p) for p in pieces)
    return ShardPieces(id=xh.hexdigest(), size=size, digest=dh.digest() if dh is not None else None,
                       pieces=tuple(pieces))


def shard_fingerprints(tensors: Mapping[str, HostTensor], *, slice_bytes: int = HASH_SLICE_BYTES) -> dict[str, int]:
    """Each tensor's fingerprint, its lanes summed ``slice_bytes`` at a time."""
    return {name: fingerprint_from_lane_sums([host_lanes_sum(lanes, at) for at, lanes, _ in _slices(t, slice_bytes)],
                                             host_lanes(t).size)
            for name, t in tensors.items()}


def _slices(t: HostTensor, slice_bytes: int):
    """``(first lane, lanes, bytes)`` of a tensor's consecutive slices of about ``slice_bytes``."""
    lanes = host_lanes(t)
    raw = memoryview(t.words).cast("B") if t.words.size else memoryview(b"")
    per = max(1, slice_bytes // lanes.itemsize)
    for at in range(0, lanes.size, per):
        yield at, lanes[at : at + per], raw[at * lanes.itemsize : (at + per) * lanes.itemsize]


async def _publish_pieces(client: HttpClient, state: Mapping[str, HostTensor], groups: list[list[str]], *,
                          model: str, digest: bool, fps: dict[str, int], where: dict[str, str], refs: list[BlobRef],
                          concurrency: int = 2) -> None:
    """Hash the shards on a pool (GIL released by the hashers and kernels) while the ones already hashed
    upload; nothing is copied, so memory is the mapped file's pages. The fingerprints are summed apart, after
    the hashes on the same pool: an upload needs only its shard's id, so the first one starts without waiting
    for the compiled kernels (numba's import, ~0.2 s of a cold ``publish``, on the warm-up thread)."""
    loop = asyncio.get_running_loop()
    sem = asyncio.Semaphore(max(1, concurrency))
    with _pool() as pool:
        hashed = [loop.run_in_executor(pool, lambda g=g: shard_pieces({n: state[n] for n in g}, digest=digest))
                  for g in groups]
        summed = [loop.run_in_executor(pool, lambda g=g: shard_fingerprints({n: state[n] for n in g}))
                  for g in groups]

        async def send(k: int) -> ShardPieces:
            sp = await hashed[k]
            async with sem:
                await client.put_blob(sp.id, sp.pieces, model=model)  # the pieces as they are, never joined
            return sp

        try:
            done = await asyncio.gather(*(send(k) for k in range(len(groups))))
            sums = await asyncio.gather(*summed)
        finally:
            for f in (*hashed, *summed):
                f.cancel()
    for group, sp, got in zip(groups, done, sums):
        refs.append(BlobRef(id=sp.id, size=sp.size, digest=sp.digest))
        for n in group:
            fps.setdefault(n, got[n])
            where[n] = sp.id


async def publish_keyframe(client: HttpClient, *, model: str, version: int,
                           state: Mapping[str, torch.Tensor | HostTensor], signer: Signer | None,
                           fps: Mapping[str, int] | None = None, shard_bytes_: int = FILE_SHARD_BYTES,
                           meta: Mapping[str, str] | None = None, commit: bool = True) -> Published:
    """Publish ``state`` as keyframe v``version`` of ``model``: HostTensors (a mapped file) as pieces of the
    file, never copied (:func:`shard_pieces`); torch tensors one shard in memory at a time (plus the one
    uploading). ``commit=False``: upload the blobs only; the caller commits ``manifest`` (unsigned, with the
    blobs' digests when a ``signer`` is given: ``commit_manifest(client, manifest, key=signer)``)."""
    loop = asyncio.get_running_loop()
    fps = dict(fps) if fps is not None else {}
    where: dict[str, str] = {}
    refs: list[BlobRef] = []

    groups = _groups(state, shard_bytes_)
    if all(isinstance(t, HostTensor) for t in state.values()):
        await _publish_pieces(client, state, groups, model=model, digest=signer is not None, fps=fps, where=where, refs=refs)
        return await _keyframe_manifest(client, model=model, version=version, state=state, signer=signer, fps=fps,
                                        where=where, refs=refs, meta=meta, commit=commit)
    from deltasync.tensorfile import shard_bytes
    # two shard buffers, reused in turn: one is built while the other uploads (no fresh allocation, and no
    # first-touch page faults, per shard); each tensor is fingerprinted in the pass that copies it
    size = max((sum(state[n].numel() * state[n].element_size() for n in g) for g in groups), default=0)
    buffers = [bytearray(size + (64 << 10)), bytearray(size + (64 << 10))] if len(groups) > 1 else [None]

    def build(k: int, group: list[str]) -> tuple[str, bytearray | memoryview, str | None]:
        got: dict[str, int] = {}
        data = shard_bytes({n: state[n] for n in group}, fps=got, into=buffers[k % len(buffers)])
        for n in group:
            fps.setdefault(n, got[n])
        return blob_id(data), data, (blob_digest(data) if signer is not None else None)

    uploading: asyncio.Task | None = None
    try:
        for k, group in enumerate(groups):
            bid, data, digest = await loop.run_in_executor(None, build, k, group)  # overlaps the previous upload
            if uploading is not None:
                await uploading
            uploading = asyncio.ensure_future(client.put_blob(bid, data, model=model))
            refs.append(BlobRef(id=bid, size=len(data), digest=digest))
            for n in group:
                where[n] = bid
            del data
        if uploading is not None:
            await uploading
    finally:
        if uploading is not None and not uploading.done():
            uploading.cancel()
    return await _keyframe_manifest(client, model=model, version=version, state=state, signer=signer, fps=fps,
                                    where=where, refs=refs, meta=meta, commit=commit)


async def _keyframe_manifest(client: HttpClient, *, model: str, version: int, state, signer: Signer | None,
                             fps: Mapping[str, int], where: Mapping[str, str], refs: list[BlobRef],
                             meta: Mapping[str, str] | None, commit: bool) -> Published:
    names = sorted(state)
    tensors = tuple(
        TensorRecord(name=n, dtype=dtype_info(state[n].dtype).name, shape=tuple(state[n].shape), fp_before=None,
                     fp_after=fp_hex(fps[n]), changed=state[n].numel() * dtype_info(state[n].dtype).words_per_element,
                     chunks=(ChunkRef(blob=where[n], key=n),))
        for n in names)
    manifest = Manifest(model=model, version=version, parent=None, kind="keyframe", tensors=tensors, blobs=tuple(refs),
                        state_fp=state_fingerprint((t.name, t.dtype, t.shape, fps[t.name]) for t in tensors),
                        meta=dict(meta or {}))
    if commit:
        from .upload import commit_manifest

        manifest = await commit_manifest(client, manifest, key=signer)
        timeline.debug("mono=%.6f publish-committed v%d", time.monotonic(), version)
    return Published(manifest=manifest, blob_bytes=manifest.total_bytes, raw_bytes=_raw(state),
                     changed=manifest.changed_words)
