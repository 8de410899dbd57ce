"""Version manifests: what a version contains, where its bytes are, who signed it.

A manifest is canonical JSON (docs/FORMAT.md, "manifest"). ``Manifest.to_json``
writes it, ``parse_manifest`` reads it back and rejects anything malformed with a
FormatError. ``sign`` takes a :class:`~deltasync.signing.Signer`, ``verify_signature``
and ``parse_manifest(verifier=...)`` a :class:`~deltasync.signing.Verifier`; both sign
the canonical encoding of every field but the signature itself. A raw ``bytes`` key is
still accepted wherever one was (wrapped into HMAC-SHA256).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from .blob import check_blob_id
from .dtypes import dtype_info, word_count
from .errors import DeltaSyncError, FormatError, SignatureError
from .signing import Signer, Verifier, as_signer, as_verifier, load_key

__all__ = [
    "BlobRef", "ChunkRef", "FORMAT_VERSION", "KINDS", "Manifest", "TensorRecord", "load_key", "parse_manifest",
]

FORMAT_VERSION = 1
KINDS = ("keyframe", "delta")
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FP_RE = re.compile(r"^[0-9a-f]{16}$")
_SIG_RE = re.compile(r"^[a-z0-9-]{1,32}:[0-9a-f]{16,256}$")
MAX_VERSION = (1 << 63) - 1
MAX_MANIFEST_BYTES = 256 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkRef:
    """Where one piece of a tensor's encoding lives: a blob and, inside it, a chunk
    index (delta) or a tensor key (keyframe shard)."""

    blob: str
    index: int | None = None
    key: str | None = None

    def to_obj(self) -> dict:
        return {"blob": self.blob, "index": self.index} if self.key is None else {"blob": self.blob, "key": self.key}


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    fp_before: str | None  # 16 hex digits; None in keyframes
    fp_after: str
    changed: int  # words the delta writes (keyframes: all words); a squash may count a word put back to its base value
    chunks: tuple[ChunkRef, ...] = ()

    @property
    def words(self) -> int:
        return word_count(self.shape, dtype_info(self.dtype))

    def to_obj(self) -> dict:
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
            "fp_before": self.fp_before, "fp_after": self.fp_after, "changed": self.changed,
            "chunks": [c.to_obj() for c in self.chunks],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class BlobRef:
    id: str
    size: int

    def to_obj(self) -> dict:
        return {"id": self.id, "size": self.size}


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    model: str
    version: int
    parent: int | None  # None for keyframes
    kind: str
    tensors: tuple[TensorRecord, ...]
    blobs: tuple[BlobRef, ...]
    state_fp: str
    state_fp_before: str | None = None
    meta: dict[str, str] = field(default_factory=dict)
    signature: str | None = None
    format: int = FORMAT_VERSION

    # -- views -------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    @property
    def raw_bytes(self) -> int:
        return sum(dtype_info(t.dtype).element_size * _numel(t.shape) for t in self.tensors)

    @property
    def changed_words(self) -> int:
        return sum(t.changed for t in self.tensors)

    def tensor(self, name: str) -> TensorRecord:
        for t in self.tensors:
            if t.name == name:
                return t
        from .errors import NotFoundError
        raise NotFoundError(f"{self.model} v{self.version} has no tensor {name!r}")

    # -- encoding ------------------------------------------------------------------
    def to_obj(self, *, with_signature: bool = True) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "format": self.format, "model": self.model, "version": self.version, "parent": self.parent,
            "kind": self.kind, "state_fp_before": self.state_fp_before, "state_fp": self.state_fp,
            "meta": dict(self.meta), "tensors": [t.to_obj() for t in self.tensors],
            "blobs": [b.to_obj() for b in self.blobs],
        }
        if with_signature:
            obj["signature"] = self.signature
        return obj

    def canonical_bytes(self) -> bytes:
        """The bytes a signature covers: every field but the signature, canonical JSON."""
        return _canonical(self.to_obj(with_signature=False))

    def to_json(self) -> bytes:
        return _canonical(self.to_obj())

    def sign(self, signer: Signer | bytes) -> Manifest:
        """This manifest with ``signer``'s signature (a raw ``bytes`` key signs with HMAC-SHA256)."""
        return replace(self, signature=as_signer(signer).sign(self.canonical_bytes()))

    def verify_signature(self, verifier: Verifier | bytes) -> None:
        """Raise SignatureError unless ``verifier`` accepts the signature (a raw ``bytes`` key: HMAC-SHA256)."""
        if self.signature is None:
            raise SignatureError(f"{self.model} v{self.version}: manifest is unsigned but a key is configured")
        try:
            as_verifier(verifier).verify(self.canonical_bytes(), self.signature)
        except SignatureError as e:
            raise SignatureError(f"{self.model} v{self.version}: manifest {e}") from None


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- parsing ------------------------------------------------------------------------

def parse_manifest(data: bytes | str | dict, *, verifier: Verifier | bytes | None = None,
                   key: bytes | None = None) -> Manifest:
    """Parse and validate a manifest; with ``verifier``, also verify its signature (SignatureError).
    ``key`` is the older spelling of ``verifier`` for a raw HMAC key."""
    if key is not None:
        if verifier is not None:
            raise TypeError("parse_manifest: pass verifier= or key=, not both")
        verifier = key
    if isinstance(data, dict):
        obj = data
    else:
        if len(data) > MAX_MANIFEST_BYTES:
            raise FormatError(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise FormatError(f"manifest is not valid JSON: {e}") from None
    try:
        m = _from_obj(obj)
    except DeltaSyncError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"manifest is malformed: {type(e).__name__}: {e}") from None
    if verifier is not None:
        m.verify_signature(verifier)
    return m


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise FormatError(f"manifest: {what}")


def _int(x: Any, what: str, lo: int = 0, hi: int = MAX_VERSION) -> int:
    _expect(isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi, f"{what} must be an integer in [{lo}, {hi}], found {x!r}")
    return x


def _fp(x: Any, what: str, optional: bool = False) -> str | None:
    if x is None and optional:
        return None
    _expect(isinstance(x, str) and bool(_FP_RE.match(x)), f"{what} must be 16 lowercase hex digits, found {x!r}")
    return x


_TOP = {"format", "model", "version", "parent", "kind", "state_fp_before", "state_fp", "meta", "tensors", "blobs", "signature"}


def _from_obj(obj: Any) -> Manifest:
    _expect(isinstance(obj, dict), "top level must be an object")
    _expect(set(obj) == _TOP, f"fields must be exactly {sorted(_TOP)}, found {sorted(obj)}")
    fmt = _int(obj["format"], "format")
    if fmt != FORMAT_VERSION:
        from .errors import UnsupportedError
        raise UnsupportedError(f"manifest format {fmt} is not supported (this build reads {FORMAT_VERSION})")
    model = obj["model"]
    _expect(isinstance(model, str) and bool(MODEL_RE.match(model)), f"model name {model!r} must match {MODEL_RE.pattern}")
    version = _int(obj["version"], "version")
    kind = obj["kind"]
    _expect(kind in KINDS, f"kind must be one of {KINDS}, found {kind!r}")
    parent = obj["parent"]
    if kind == "keyframe":
        _expect(parent is None, "a keyframe has no parent")
        _expect(obj["state_fp_before"] is None, "a keyframe has no state_fp_before")
    else:
        parent = _int(parent, "parent")
        _expect(parent < version, f"parent {parent} must be older than version {version}")
    state_fp = _fp(obj["state_fp"], "state_fp")
    state_fp_before = _fp(obj["state_fp_before"], "state_fp_before", optional=True)
    _expect(kind == "keyframe" or state_fp_before is not None, "a delta needs state_fp_before")
    meta = obj["meta"]
    _expect(isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()), "meta must map strings to strings")
    sig = obj["signature"]
    _expect(sig is None or (isinstance(sig, str) and bool(_SIG_RE.match(sig))),
            "signature must be null or 'ALG:HEX' (e.g. hmac-sha256:<64 hex digits>)")

    blobs_obj = obj["blobs"]
    _expect(isinstance(blobs_obj, list), "blobs must be a list")
    blobs = []
    for b in blobs_obj:
        _expect(isinstance(b, dict) and set(b) == {"id", "size"}, "each blob is {id, size}")
        blobs.append(BlobRef(id=check_blob_id(b["id"]), size=_int(b["size"], "blob size", hi=1 << 48)))
    ids = {b.id for b in blobs}
    _expect(len(ids) == len(blobs), "blob ids must be unique")

    tensors_obj = obj["tensors"]
    _expect(isinstance(tensors_obj, list), "tensors must be a list")
    tensors = []
    names: set[str] = set()
    for t in tensors_obj:
        _expect(isinstance(t, dict) and set(t) == {"name", "dtype", "shape", "fp_before", "fp_after", "changed", "chunks"},
                "each tensor is {name, dtype, shape, fp_before, fp_after, changed, chunks}")
        name = t["name"]
        _expect(isinstance(name, str) and 0 < len(name) <= 1024, f"tensor name {name!r} must be a non-empty string")
        _expect(name not in names, f"tensor {name!r} listed twice")
        names.add(name)
        info = dtype_info(t["dtype"]) if isinstance(t["dtype"], str) else _expect(False, "dtype must be a string")
        shape = t["shape"]
        _expect(isinstance(shape, list) and len(shape) <= 16, f"{name}: shape must be a list of at most 16 dims")
        shape_t = tuple(_int(s, f"{name}: dimension", hi=1 << 48) for s in shape)
        words = word_count(shape_t, info)
        changed = _int(t["changed"], f"{name}: changed", hi=words)
        chunks = []
        _expect(isinstance(t["chunks"], list), f"{name}: chunks must be a list")
        for c in t["chunks"]:
            _expect(isinstance(c, dict) and "blob" in c, f"{name}: each chunk names its blob")
            _expect(c["blob"] in ids, f"{name}: chunk refers to blob {c['blob']!r} not in the blob list")
            if kind == "delta":
                _expect(set(c) == {"blob", "index"}, f"{name}: a delta chunk is {{blob, index}}")
                chunks.append(ChunkRef(blob=c["blob"], index=_int(c["index"], f"{name}: chunk index", hi=1 << 32)))
            else:
                _expect(set(c) == {"blob", "key"} and isinstance(c["key"], str), f"{name}: a keyframe chunk is {{blob, key}}")
                chunks.append(ChunkRef(blob=c["blob"], key=c["key"]))
        fp_before = _fp(t["fp_before"], f"{name}: fp_before", optional=kind == "keyframe")
        _expect(kind == "delta" or fp_before is None, f"{name}: keyframe tensors have no fp_before")
        fp_after = _fp(t["fp_after"], f"{name}: fp_after")
        if kind == "delta" and changed == 0:
            _expect(fp_before == fp_after and not chunks, f"{name}: an unchanged tensor keeps its fingerprint and has no chunks")
        if kind == "keyframe":
            _expect(len(chunks) == 1, f"{name}: a keyframe tensor lives in exactly one shard")
        tensors.append(TensorRecord(name=name, dtype=info.name, shape=shape_t, fp_before=fp_before,
                                    fp_after=fp_after, changed=changed, chunks=tuple(chunks)))
    _expect([t.name for t in tensors] == sorted(names), "tensors must be sorted by name")
    return Manifest(model=model, version=version, parent=parent, kind=kind, tensors=tuple(tensors),
                    blobs=tuple(blobs), state_fp=state_fp, state_fp_before=state_fp_before, meta=meta,
                    signature=sig, format=fmt)
