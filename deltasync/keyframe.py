"""Keyframes: a whole state as safetensors shards, so any tool can open them.

Each shard is one blob holding whole tensors (a tensor larger than the shard
size gets a shard of its own). Dtypes safetensors cannot name (complex32,
complex128, float8_e8m0fnu, float4_e2m1fn_x2) are stored as a ``U8`` tensor of
shape ``[*shape, element_size]`` and the real dtype in the shard's metadata under
``deltasync.dtype.<name>``; :func:`load_shard` restores them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import json
import struct

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
import torch

from .blob import blob_id
from .codec import Encoded
from .dtypes import dtype_info
from .errors import BaseMismatchError, FormatError, IntegrityError
from .fingerprint import fp_hex, state_fingerprint, tensor_fingerprint
from .manifest import BlobRef, ChunkRef, Manifest, TensorRecord

DEFAULT_SHARD_BYTES = 256 << 20
DTYPE_META_PREFIX = "deltasync.dtype."  # shard metadata key prefix naming an exotic dtype
_META_PREFIX = DTYPE_META_PREFIX
_NATIVE = {
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "bfloat16",
    "float32", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "complex64",
}


def _storable(name: str, t: torch.Tensor, meta: dict[str, str]) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    info = dtype_info(t.dtype)
    if info.name in _NATIVE:
        return t
    meta[_META_PREFIX + name] = info.name
    return t.reshape(-1).view(torch.uint8).reshape(*t.shape, info.element_size)


def save_shard(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    meta = dict(metadata or {})
    data = {n: _storable(n, t, meta) for n, t in tensors.items()}
    return save_safetensors(data, metadata=meta or None)


def load_shard(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors shard, exotic dtypes restored. Malformed input raises FormatError."""
    meta = _read_metadata(data)
    try:
        tensors = load_safetensors(bytes(data))
    except Exception as e:  # safetensors raises SafetensorError and others on bad input
        raise FormatError(f"not a valid safetensors shard: {type(e).__name__}: {e}") from None
    return {name: restore_dtype(name, t, meta) for name, t in tensors.items()}


def restore_dtype(name: str, t: torch.Tensor, meta: dict[str, str], *, where: str = "") -> torch.Tensor:
    """A tensor as read from safetensors, turned back into its exotic dtype if the metadata names one."""
    real = meta.get(DTYPE_META_PREFIX + name)
    if real is None:
        return t
    info = dtype_info(real)
    if t.dtype != torch.uint8 or t.dim() == 0 or t.shape[-1] != info.element_size:
        raise FormatError(f"{where}{name}: stored as {t.dtype} {tuple(t.shape)}, cannot be {real}")
    if t.numel() == 0:
        return torch.empty(t.shape[:-1], dtype=info.torch_dtype)
    return t.contiguous().view(info.torch_dtype).reshape(t.shape[:-1])


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
    with torch.no_grad():
        for name, src in state.items():
            tensors[name].copy_(src)
    if verify:
        for name in state:
            got = tensor_fingerprint(tensors[name])
            if got != fps[name]:
                raise IntegrityError(f"{name}: fingerprint {fp_hex(got)} after copying keyframe v{version}, expected "
                                     f"{fp_hex(fps[name])}: the device memory is not what was written (resync)")
    return dict(fps)


def _read_metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise FormatError(f"safetensors data of {len(data)} bytes is shorter than its 8-byte header length")
    (n,) = struct.unpack_from("<Q", data)
    if n > len(data) - 8:
        raise FormatError(f"safetensors header of {n} bytes runs past the end ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise FormatError("safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise FormatError("safetensors header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise FormatError("safetensors __metadata__ is not an object")
    return {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, str)}


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
