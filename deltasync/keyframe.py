"""Keyframes: a whole state as safetensors shards, so any tool can open them.

Each shard is one blob holding whole tensors (a tensor larger than the shard
size gets a shard of its own). The bytes of a shard are written and read by
:mod:`deltasync.tensorfile` (exotic dtypes as tagged ``U8`` tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .blob import blob_id
from .codec import Encoded
from .dtypes import dtype_info
from .errors import BaseMismatchError, FormatError, IntegrityError
from .fingerprint import copy_fingerprint, fp_hex, state_fingerprint, tensor_fingerprint
from .manifest import BlobRef, ChunkRef, Manifest, TensorRecord
from .tensorfile import load_shard, save_shard  # shard bytes live there; re-exported for keyframe users

__all__ = ["DEFAULT_SHARD_BYTES", "apply_keyframe", "copy_state", "encode_keyframe", "load_keyframe", "load_shard",
           "save_shard"]

DEFAULT_SHARD_BYTES = 256 << 20


def copy_state(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], fps: dict[str, int], *,
               version: int, verify: bool = True) -> dict[str, int]:
    """Copy a checked keyframe state into live tensors of the same layout; with ``verify``, re-fingerprint
    each written tensor on its device. Layout mismatches raise BaseMismatchError before anything is written."""
    if set(tensors) != set(state):
        raise BaseMismatchError(
            f"keyframe v{version} has tensors {sorted(set(state) - set(tensors))[:5]} the target lacks "
            f"and lacks {sorted(set(tensors) - set(state))[:5]}; is the target the same model?")
    for name, src in state.items():
        dst = tensors[name]
        if dst.dtype != src.dtype or tuple(dst.shape) != tuple(src.shape):
            raise BaseMismatchError(f"{name}: target is {dst.dtype} {tuple(dst.shape)}, keyframe has {src.dtype} {tuple(src.shape)}")
    if not verify:
        with torch.no_grad():
            for name, src in state.items():
                tensors[name].copy_(src)
        return dict(fps)
    for name, src in state.items():
        got = copy_fingerprint(tensors[name], src)  # one pass where the compiled kernels run; else copy_ + scrub
        if got != fps[name]:
            raise IntegrityError(f"{name}: fingerprint {fp_hex(got)} after copying keyframe v{version}, expected "
                                 f"{fp_hex(fps[name])}: the device memory is not what was written (resync)")
    return dict(fps)


def encode_keyframe(
    state: Mapping[str, torch.Tensor],
    *,
    model: str,
    version: int,
    fps: Mapping[str, int] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    meta: Mapping[str, str] | None = None,
) -> Encoded:
    """A keyframe manifest and its safetensors shard blobs."""
    names = sorted(state)
    fps = dict(fps) if fps is not None else {n: tensor_fingerprint(state[n]) for n in names}
    shards: list[list[str]] = []
    size = 0
    for name in names:
        nbytes = state[name].numel() * state[name].element_size()
        if not shards or (size + nbytes > shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    blobs: dict[str, bytes] = {}
    order: list[str] = []
    where: dict[str, str] = {}
    for group in shards:
        data = save_shard({n: state[n] for n in group})
        bid = blob_id(data)
        blobs[bid] = data
        order.append(bid)
        for n in group:
            where[n] = bid
    tensors = tuple(
        TensorRecord(name=n, dtype=dtype_info(state[n].dtype).name, shape=tuple(state[n].shape), fp_before=None,
                     fp_after=fp_hex(fps[n]), changed=state[n].numel() * dtype_info(state[n].dtype).words_per_element,
                     chunks=(ChunkRef(blob=where[n], key=n),))
        for n in names
    )
    manifest = Manifest(
        model=model, version=version, parent=None, kind="keyframe", tensors=tensors,
        blobs=tuple(BlobRef(id=b, size=len(blobs[b])) for b in order),
        state_fp=state_fingerprint((t.name, t.dtype, t.shape, fps[t.name]) for t in tensors),
        meta=dict(meta or {}),
    )
    return Encoded(manifest=manifest, blobs=blobs, fps=fps)


def load_keyframe(manifest: Manifest, blobs: Mapping[str, bytes] | Callable[[str], bytes]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Host tensors of a keyframe, every fingerprint checked. Returns (state, fps)."""
    if manifest.kind != "keyframe":
        raise FormatError(f"v{manifest.version} is a {manifest.kind}, not a keyframe")
    from .apply import get_blob

    shards: dict[str, dict[str, torch.Tensor]] = {}
    for ref in manifest.blobs:
        shards[ref.id] = load_shard(get_blob(blobs, ref.id, ref.size))
    state: dict[str, torch.Tensor] = {}
    fps: dict[str, int] = {}
    for rec in manifest.tensors:
        ref = rec.chunks[0]
        t = shards[ref.blob].get(ref.key)
        if t is None:
            raise FormatError(f"{rec.name}: not in shard {ref.blob}")
        if dtype_info(t.dtype).name != rec.dtype or tuple(t.shape) != rec.shape:
            raise FormatError(f"{rec.name}: shard holds {t.dtype} {tuple(t.shape)}, manifest says {rec.dtype} {rec.shape}")
        fp = tensor_fingerprint(t)
        if fp_hex(fp) != rec.fp_after:
            raise IntegrityError(f"{rec.name}: keyframe tensor fingerprint {fp_hex(fp)} != manifest {rec.fp_after}")
        state[rec.name] = t
        fps[rec.name] = fp
    return state, fps


def apply_keyframe(target, manifest: Manifest, blobs, *, verify: str = "full") -> dict[str, int]:
    """Copy a keyframe into live tensors. Everything is decoded and checked on the host first, so a bad
    keyframe never touches the target; ``verify="full"`` re-fingerprints the written tensors on their device."""
    from .apply import live_tensors

    state, fps = load_keyframe(manifest, blobs)
    return copy_state(live_tensors(target), state, fps, version=manifest.version, verify=verify == "full")
