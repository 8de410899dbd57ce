"""Version manifests: what a version contains, where its bytes are, who signed it.

A manifest is canonical JSON (docs/FORMAT.md, "manifest"). ``Manifest.to_json``
writes it, ``parse_manifest`` reads it back and rejects anything malformed with a
FormatError. ``sign`` takes a :class:`~deltasync.signing.Signer`, ``verify_signature``
and ``parse_manifest(verifier=...)`` a :class:`~deltasync.signing.Verifier`; both sign
the canonical encoding of every field but the signature and the key id (a hint naming
the key; the signature is what binds). A raw ``bytes`` key is still accepted wherever
one was (wrapped into HMAC-SHA256).

Format 2 (this build writes it) adds a cryptographic digest per blob
(``BlobRef.digest``, deltasync.digest; ``with_digests`` fills them) and the signer's
``key_id``. A manifest signed with a public key (Ed25519) must carry a digest of every
blob, and a public-key verifier accepts only format 2; format 1 is still read, but only
unsigned or HMAC-signed (docs/FORMAT.md §5).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .blob import check_blob_id
from .digest import DEFAULT_DIGEST, blob_digest, parse_digest
from .dtypes import dtype_info, word_count
from .errors import DeltaSyncError, FormatError, SignatureError
from .lazytuple import LazyDict, LazyTuple
from .signing import Ed25519Signer, Signer, Verifier, as_signer, as_verifier, is_public_key, load_key
from .tensortable import ChunkRef, TableColumns, TensorRecord, fp_values, new_record, pack_table, unpack_table

__all__ = [
    "BlobRef", "ChunkRef", "FORMAT_VERSION", "KINDS", "Manifest", "TensorRecord", "load_key", "parse_manifest",
]

FORMAT_VERSION = 3
#: manifest formats this build reads (1: no digests, no key id; only unsigned or HMAC-signed is accepted;
#: 3: the tensor records as a compressed binary table, deltas listing only the tensors they change)
READ_FORMATS = (1, 2, 3)
KINDS = ("keyframe", "delta")
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FP_RE = re.compile(r"^[0-9a-f]{16}$")

#: a model ``M``'s periodic keyframes go to the side stream ``M.kf`` under the same version numbers
#: (docs/PROTOCOL.md); the rule lives here, for the publishers, the subscribers and the servers' token scopes
SIDE_SUFFIX = ".kf"


def keyframe_stream(model: str) -> str:
    """The side stream holding ``model``'s periodic keyframes."""
    name = model + SIDE_SUFFIX
    if not MODEL_RE.match(name):
        raise ValueError(f"model name {model!r} is too long for a keyframe side stream ({name!r})")
    return name


def main_stream(name: str) -> str:
    """The stream ``name`` belongs to: ``M`` for its side keyframe stream ``M.kf``, else ``name`` itself."""
    return name[: -len(SIDE_SUFFIX)] if name.endswith(SIDE_SUFFIX) else name


def is_side_stream(name: str) -> bool:
    return name.endswith(SIDE_SUFFIX)

_SIG_RE = re.compile(r"^[a-z0-9-]{1,32}:[0-9a-f]{16,256}$")
_KEY_ID_RE = re.compile(r"^[A-Za-z0-9._:,-]{1,256}$")
CODING_META = "deltasync.coding"  # meta key naming a delta's coding (deltasync.conditioned)
MAX_VERSION = (1 << 63) - 1
MAX_MANIFEST_BYTES = 256 << 20

# Sane limits (docs/FORMAT.md §5.1 "Limits"): checked by parse_manifest before anything allocates or loops,
# so a manifest that is signed but crafted (or corrupt) cannot make a reader allocate terabytes or spin.
#: elements of one tensor (16 Gi: a 256k × 64k embedding)
MAX_TENSOR_ELEMENTS = 1 << 34
#: elements of the whole state (1 Ti: a trillion-parameter model)
MAX_STATE_ELEMENTS = 1 << 40
#: bytes of the whole state (dtype element size × elements, summed over tensors: 4 TiB)
MAX_STATE_BYTES = 1 << 42
#: one dimension of a shape
MAX_DIM = 1 << 34
#: dimensions of a shape
MAX_DIMS = 16
#: tensors in a manifest
MAX_TENSORS = 1 << 20
#: blobs in a manifest
MAX_BLOBS = 1 << 20
#: bytes of one blob, and of all blobs of a manifest together
MAX_BLOB_BYTES = 1 << 40
MAX_TOTAL_BLOB_BYTES = 1 << 43
#: chunk references of one manifest (all tensors together), and a delta chunk's index within its blob
MAX_CHUNKS = 1 << 24
MAX_CHUNK_INDEX = (1 << 32) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class BlobRef:
    id: str
    size: int
    digest: str | None = None  # "blake3:<64 hex>" | "sha256:<64 hex>" (format 2), covered by the signature

    def to_obj(self, format: int = FORMAT_VERSION) -> dict:
        if format < 2:
            return {"id": self.id, "size": self.size}
        return {"id": self.id, "size": self.size, "digest": self.digest}


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
    # Built in memory as format 2 (every tensor, both fingerprints): what writers and sharded parts compose;
    # ``compact()`` turns it into format 3, what is committed and sent (docs/FORMAT.md §5.3).
    format: int = 2
    key_id: str | None = None  # the signer's key id (format 2); not covered by the signature, a hint

    # -- views -------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    @property
    def raw_bytes(self) -> int:
        return sum(dtype_info(t.dtype).element_size * _numel(t.shape) for t in self.tensors)

    @property
    def changed_words(self) -> int:
        known = getattr(self.tensors, "changed_words", None)  # LazyRecords: without making them
        return known if known is not None else sum(t.changed for t in self.tensors)

    @property
    def coding(self) -> str:
        """How the delta's changes are coded: ``base-free`` (relays squash it) or ``base-conditioned``
        (decoding needs the base: docs/FORMAT.md §4.4), from ``meta["deltasync.coding"]`` (signed with it)."""
        return self.meta.get(CODING_META, "base-free")

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
            "meta": dict(self.meta), "blobs": [b.to_obj(self.format) for b in self.blobs],
        }
        if self.format >= 3:
            obj["table"] = _packed_table(self)
        else:
            obj["tensors"] = [t.to_obj() for t in self.tensors]
        if with_signature:
            obj["signature"] = self.signature
            if self.format >= 2:
                obj["key_id"] = self.key_id
        return obj

    def canonical_bytes(self) -> bytes:
        """The bytes a signature covers: every field but the signature, canonical JSON."""
        return _canonical(self.to_obj(with_signature=False))

    def to_json(self) -> bytes:
        return _canonical(self.to_obj())

    def compact(self) -> Manifest:
        """This manifest in format 3 (docs/FORMAT.md §5.3), what is committed and sent: the tensor records as
        a compressed binary table; a delta lists only the tensors it changes (the signed ``state_fp_before``
        and ``state_fp`` cover the others), without per-tensor ``fp_before``, its chunk spans in the table
        instead of ``meta``. A changed manifest loses its signature; a format-3 one is returned as it is."""
        if self.format >= 3:
            return self
        packed = _packed_compact(self)
        if packed is not None:
            return packed
        meta = self.meta
        tensors = self.tensors
        if self.kind == "delta":
            spans = {k[len(SPANS_META_PREFIX):]: v for k, v in meta.items() if k.startswith(SPANS_META_PREFIX)}
            meta = {k: v for k, v in meta.items() if not k.startswith(SPANS_META_PREFIX)}
            out = []
            for t in tensors:
                if not t.chunks and t.changed == 0:
                    continue  # unchanged: covered by the state fingerprints
                chunks = t.chunks
                if chunks and chunks[0].start is None:
                    given = parse_spans(spans.get(t.name), len(chunks), t.words)
                    if given is not None:
                        chunks = tuple(replace(c, start=a, stop=b) for c, (a, b) in zip(chunks, given))
                out.append(new_record(t.name, t.dtype, t.shape, None, t.fp_after, t.changed, chunks))
            tensors = tuple(out)
        return replace(self, tensors=tensors, meta=meta, format=3, signature=None, key_id=None)

    @property
    def has_digests(self) -> bool:
        """Every blob carries a cryptographic digest."""
        return all(b.digest is not None for b in self.blobs)

    def with_digests(self, blobs, alg: str = DEFAULT_DIGEST) -> Manifest:
        """This manifest (as format 2) with a digest of every blob, computed from ``blobs`` (id -> bytes);
        blobs that already carry one keep it. A changed manifest loses its old signature."""
        refs = []
        for b in self.blobs:
            if b.digest is None:
                if b.id not in blobs:
                    raise FormatError(f"{self.model} v{self.version}: blob {b.id} is not in hand to digest")
                b = replace(b, digest=blob_digest(blobs[b.id], alg))
            refs.append(b)
        out = replace(self, blobs=tuple(refs), format=max(self.format, 2))
        return out if out == self else replace(out, signature=None, key_id=None)

    def sign(self, signer: Signer | bytes) -> Manifest:
        """This manifest with ``signer``'s signature (a raw ``bytes`` key signs with HMAC-SHA256) and key id.
        A public-key signer needs a digest of every blob first (``with_digests``)."""
        signer = as_signer(signer)
        kid = getattr(signer, "key_id", None)
        if isinstance(signer, Ed25519Signer) and not (self.format >= 2 and self.has_digests):
            raise FormatError(f"{self.model} v{self.version}: a public-key signature needs a digest of every blob "
                              "(Manifest.with_digests(blobs) first)")
        signed = replace(self, key_id=kid if self.format >= 2 and isinstance(kid, str) else None)
        return replace(signed, signature=signer.sign(self.canonical_bytes()))

    def verify_signature(self, verifier: Verifier | bytes) -> None:
        """Raise SignatureError unless ``verifier`` accepts the signature (a raw ``bytes`` key: HMAC-SHA256).
        A public-key verifier also needs format 2 with a digest of every blob (what makes the blobs' bytes
        part of what is signed)."""
        where = f"{self.model} v{self.version}"
        if self.signature is None:
            raise SignatureError(f"{where}: manifest is unsigned but a key is configured")
        v = as_verifier(verifier)
        if is_public_key(v):
            if self.format < 2:
                raise SignatureError(f"{where}: manifest format {self.format} has no blob digests; a public-key "
                                     "verifier accepts only format 2 (republish with this version of deltasync)")
            if not self.has_digests:
                raise SignatureError(f"{where}: manifest lacks a digest for some blobs; a public-key verifier "
                                     "refuses it (the blobs' bytes would not be covered by the signature)")
        try:
            verify_as = getattr(v, "verify_as", None)
            if self.key_id is not None and verify_as is not None:  # a key set: the member the manifest names
                verify_as(self.key_id, self.canonical_bytes(), self.signature)
            else:
                v.verify(self.canonical_bytes(), self.signature)
            held = getattr(v, "key_ids", None)
            if held is None and isinstance(getattr(v, "key_id", None), str):
                held = frozenset((v.key_id,))
            if self.key_id is not None and held is not None and self.key_id not in held:
                # the key id is not signed: one that names another key than the one that verified is tampered
                raise SignatureError(f"names key {self.key_id} but verifies with {sorted(held)} (key id altered)")
        except SignatureError as e:
            raise SignatureError(f"{where}: manifest {e}") from None


SPANS_META_PREFIX = "deltasync.spans."  # format 2: meta["deltasync.spans.<tensor>"] = "s0:e0,s1:e1,..." (§5.1)

_TABLES: list[tuple[tuple, tuple, str, str]] = []  # (tensors, blobs, kind, packed table): the last few, by identity


def _packed_table(m: Manifest) -> str:
    """The base64 text of ``m``'s compressed tensor table, packed once per (tensors, blobs, kind): signing and
    sending a manifest encode it twice or more."""
    if isinstance(m.tensors, (_Unread, _Packed)):  # a parsed table's text, as received
        return m.tensors.table
    for tensors, blobs, kind, text in _TABLES:
        if tensors is m.tensors and blobs is m.blobs and kind == m.kind:
            return text
    text = base64.b64encode(pack_table(m.tensors, m.kind, [b.id for b in m.blobs])).decode()
    _remember_table(m, text)
    return text


def _remember_table(m: Manifest, text: str) -> None:
    """A parsed manifest's table text, as received: what its signature covers (verifying it, or serving and
    forwarding it, then packs nothing: ~0.3 s a manifest at 70,000 tensors). Its records were read from this
    very text, so it is their packing."""
    _TABLES.insert(0, (m.tensors, m.blobs, m.kind, text))
    del _TABLES[4:]


#: (format-2 tensors, blob ids, format-3 meta, table text): what a writer holding its records as columns (the codec's
#: flat encoder) packed for the format-3 form of the delta it built, by the identity of that delta's records;
#: ``compact()`` then makes no record and packs nothing (~0.15 s at 70,000 tensors). The last few.
_COMPACT: list[tuple[tuple, tuple, dict, dict, str]] = []


def table_columns(m: Manifest) -> TableColumns | None:
    """The checked columns of a parsed format-3 manifest's table (a reader that works on arrays takes them
    without a record made), or None (another manifest: its records). Columns let go (:func:`release_columns`) are
    made again from the table."""
    if not isinstance(m.tensors, _Packed):
        return None
    t = m.tensors
    cols = t.__dict__.get("columns")
    if cols is None and t.__dict__.get("released"):
        cols = t.columns = _table_records(t.table, t.kind, list(t.blob_ids), build="columns")
        del t.released
    return cols


def release_columns(m: Manifest) -> None:
    """Let go of a parsed format-3 manifest's checked columns (made again from its table if asked for): a
    subscriber keeps the manifests of the versions it applied for a while (catch-up plans walk them), and at
    70,000 tensors the columns of each (its names, the decompressed table their arrays view) are ~15 MB, its
    table's text ~1.2 MB. Nothing happens to any other manifest."""
    t = m.tensors
    if isinstance(t, _Packed) and t.__dict__.pop("columns", None) is not None:
        t.released = True


def record_names(m: Manifest) -> list[str]:
    """The names of ``m``'s records, in their order (a parsed format-3 manifest's columns: no record made)."""
    cols = table_columns(m)
    return cols.names if cols is not None else [t.name for t in m.tensors]


def record_columns(m: Manifest) -> tuple[list[str], list[str], list[tuple[int, ...]], np.ndarray]:
    """Names, dtype names, shapes and fingerprints after (uint64) of ``m``'s records, in their order: from a parsed
    format-3 manifest's columns (no record made), else from its records. FormatError if a fingerprint is not 16
    hex digits (a manifest built in memory; a parsed one is checked)."""
    cols = table_columns(m)
    if cols is not None:
        return cols.names, cols.dtypes(), cols.shapes(), cols.fps
    records = m.tensors
    fps = fp_values([t.fp_after for t in records])
    if fps is None:
        raise FormatError(f"{m.model} v{m.version}: a fingerprint is not 16 hex digits")
    return ([t.name for t in records], [t.dtype for t in records],
            [s if type(s := t.shape) is tuple else tuple(s) for t in records], fps)


def remember_compact(tensors: tuple, blob_ids: tuple[str, ...], meta2: dict[str, str], meta: dict[str, str],
                     table: bytes) -> None:
    """Record that the delta whose format-2 records are ``tensors`` (this very tuple) and whose blob list is
    ``blob_ids`` (its meta: ``meta2``) compacts to a manifest with ``meta`` and the packed tensor table ``table``:
    what :meth:`Manifest.compact` would make of it, made by the caller from columns (tests hold the two equal)."""
    _COMPACT.insert(0, (tensors, tuple(blob_ids), meta2, dict(meta), base64.b64encode(table).decode()))
    del _COMPACT[4:]


def _packed_compact(m: Manifest) -> Manifest | None:
    if m.kind != "delta":
        return None
    for tensors, ids, meta2, meta, text in _COMPACT:
        if tensors is m.tensors:
            if ids != tuple(b.id for b in m.blobs) or (m.meta is not meta2 and meta != {
                    k: v for k, v in m.meta.items() if not k.startswith(SPANS_META_PREFIX)}):
                return None  # changed since: compacted record by record
            records = _Packed()
            records.table, records.kind, records.blob_ids = text, m.kind, ids
            return replace(m, tensors=records, meta=dict(meta), format=3, signature=None, key_id=None)
    return None


def parse_spans(text: str | None, count: int, words: int) -> list[tuple[int, int]] | None:
    """A format-2 span entry, or None where it is missing or unusable (docs/FORMAT.md §5.1: ignored)."""
    if not text:
        return None
    try:
        spans = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError:
        return None
    if len(spans) != count or any(len(sp) != 2 for sp in spans):
        return None
    last = 0
    for a, b in spans:
        if not last <= a < b <= words:
            return None
        last = b
    return spans


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- parsing ------------------------------------------------------------------------

class _Unread(tuple):
    """The tensor records of a format-3 manifest parsed with ``records=False``: not read. An empty tuple that
    keeps the table's text (what the manifest's signature covers, and what it is sent with); any use of its
    records raises."""

    table: str  # the table's text, as received

    def _unread(self, *_):
        raise RuntimeError("this manifest was parsed without its tensor records (parse_manifest(records=False))")

    __iter__ = __len__ = __getitem__ = __contains__ = _unread


class _Packed(LazyTuple):
    """The tensor records of a format-3 manifest, made from its table when first used: a parsed manifest's (its
    checked columns kept: :func:`table_columns`), or one compacted from a table packed from columns
    (:func:`remember_compact`)."""

    table: str  # the table's text, as received (what the manifest's signature covers)
    kind: str
    blob_ids: tuple[str, ...]

    def _build(self) -> tuple[TensorRecord, ...]:
        columns = self.__dict__.get("columns")
        return columns.records() if columns is not None else _table_records(self.table, self.kind,
                                                                            list(self.blob_ids))


class LazyRecords(LazyTuple):
    """Format-2 tensor records a writer holding them as columns makes only if they are used (the codec's flat
    encoder: a publish compacts, signs and sends the format-3 form it packed from the same columns, and makes
    none; ~0.07 s at 70,000 tensors). ``changed_words``: their ``changed`` summed, known without them."""

    changed_words: int

    @classmethod
    def of(cls, build: Callable[[], tuple[TensorRecord, ...]], changed_words: int) -> LazyRecords:
        out = cls()
        out.build, out.changed_words = build, changed_words
        return out

    def _build(self) -> tuple[TensorRecord, ...]:
        return self.__dict__["build"]()


class LazyMeta(LazyDict):
    """A format-2 manifest's meta whose per-tensor span entries (``deltasync.spans.<name>``) are added when first
    needed: any read of the whole mapping, or of a span key, adds them (~0.03 s at 70,000 tensors, which a publish
    that compacts never needs). Reads of other keys answer from what is there. A dict in every other way
    (:class:`~deltasync.lazytuple.LazyDict`: serialize ``dict(meta)``, as :meth:`Manifest.to_obj` does)."""

    def __init__(self, meta: Mapping[str, str], spans: Callable[[], Iterable[tuple[str, str]]]) -> None:
        super().__init__(meta)
        self._pending = lambda d: dict.update(d, spans())

    def _for(self, key) -> None:
        if self._pending is not None and (not isinstance(key, str) or key.startswith(SPANS_META_PREFIX)):
            self._full()


def parse_manifest(data: bytes | str | dict, *, verifier: Verifier | bytes | None = None,
                   records: bool | None = True) -> Manifest:
    """Parse and validate a manifest; with ``verifier`` (public key(s), or a raw HMAC secret), also verify its
    signature (SignatureError). ``records=False``: a format-3 manifest's tensor table is checked as always but
    no record is made (0.3 s at 70,000 tensors): for a caller that needs the manifest's fields, not its records
    (an origin committing a version); its ``tensors`` raise on use. ``records=None``: its fields only, the
    table kept as text and neither decoded nor checked (~0.1 s of a 70,000-tensor ``publish --base``): for a
    caller that uses none of the table and trusts the fields through the signature it verifies (a publisher
    reading the origin's head for its version and state fingerprint); its ``tensors`` raise on use."""
    if isinstance(data, dict):
        obj = data
    else:
        if len(data) > MAX_MANIFEST_BYTES:
            raise FormatError(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
        raw = data.encode() if isinstance(data, str) else bytes(data)
        want = _DEPTH[records]
        for body, depth, m, table in _PARSED:
            if body == raw and depth >= want:
                if table is not None:
                    _remember_table(m, table)  # what its signature covers, should the few remembered have moved on
                if verifier is not None:
                    m.verify_signature(verifier)
                return m
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, RecursionError, ValueError) as e:
            # ValueError besides JSONDecodeError: Python's int-from-str digit limit (a 5000-digit number)
            raise FormatError(f"manifest is not valid JSON: {str(e)[:200]}") from None
    try:
        m = _from_obj(obj, records)
    except DeltaSyncError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
        raise FormatError(f"manifest is malformed: {type(e).__name__}: {str(e)[:200]}") from None
    if verifier is not None:
        m.verify_signature(verifier)
    if not isinstance(data, dict):
        _PARSED.insert(0, (raw, _DEPTH[records], m, obj.get("table") if m.format >= 3 else None))
        del _PARSED[3:]  # a 70k-tensor manifest with its records is ~30 MB of objects
    return m


_DEPTH = {None: 0, False: 1, True: 2}  # how far a parse went: fields only, the table checked, its records made

#: (body, _DEPTH of its parse, manifest, table text): the last three manifests parsed, by their exact bytes. A
#: subscriber reads one body more than once (its source's check, its driver, its target: 0.35 s each at 70k tensors);
#: a manifest is a pure function of its bytes and immutable, so a body parsed again is the same manifest, and
#: its signature is verified again against whatever verifier is asked (cheap: its table's text is remembered).
_PARSED: list[tuple[bytes, bool, "Manifest", str | None]] = []


def _table_records(text: Any, kind: str, blob_ids: list[str], build: bool | str = True):
    """Format 3: the records of the base64 table, checked (docs/FORMAT.md §5.3), every chunk of every blob
    referenced at most once (a delta's chunk index is checked against the blob when it is decoded).
    ``build=False``: checked the same, no records made (None); ``"columns"``: its :class:`TableColumns`."""
    import sys

    _expect(isinstance(text, str), "table must be a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise FormatError("manifest: table is not base64") from None
    return unpack_table(raw, kind, blob_ids, limits=sys.modules[__name__], build=build)  # None: build=False


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise FormatError(f"manifest: {what}")


def _int(x: Any, what: str, lo: int = 0, hi: int = MAX_VERSION) -> int:
    if not (isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi):
        # never repr a huge int: str() of one past 4300 digits raises ValueError
        shown = (f"an integer of about {x.bit_length()} bits" if isinstance(x, int) and x.bit_length() > 64
                 else repr(x)[:80])
        raise FormatError(f"manifest: {what} must be an integer in [{lo}, {hi}], found {shown}")
    return x


def _fp(x: Any, what: str, optional: bool = False) -> str | None:
    if x is None and optional:
        return None
    _expect(isinstance(x, str) and bool(_FP_RE.match(x)), f"{what} must be 16 lowercase hex digits, found {x!r}")
    return x


_TOP = {"format", "model", "version", "parent", "kind", "state_fp_before", "state_fp", "meta", "tensors", "blobs", "signature"}
_TOP2 = _TOP | {"key_id"}
_TOP3 = (_TOP2 - {"tensors"}) | {"table"}


def _from_obj(obj: Any, records: bool | None = True) -> Manifest:
    _expect(isinstance(obj, dict), "top level must be an object")
    _expect("format" in obj, f"fields must be exactly {sorted(_TOP2)}, found {sorted(obj)}")
    fmt = _int(obj["format"], "format")
    if fmt not in READ_FORMATS:
        from .errors import UnsupportedError
        raise UnsupportedError(f"manifest format {fmt} is not supported (this build reads {list(READ_FORMATS)}); "
                               "upgrade deltasync")
    top = _TOP3 if fmt >= 3 else _TOP2 if fmt >= 2 else _TOP
    _expect(set(obj) == top, f"fields must be exactly {sorted(top)}, found {sorted(obj)}")
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
            "signature must be null or 'ALG:HEX' (e.g. ed25519:<128 hex digits>)")
    key_id = obj.get("key_id")
    _expect(key_id is None or (isinstance(key_id, str) and bool(_KEY_ID_RE.match(key_id))),
            f"key_id must be null or a key id like 'ed25519:<16 hex>', found {str(key_id)[:80]!r}")
    _expect(key_id is None or sig is not None, "key_id without a signature")

    blobs_obj = obj["blobs"]
    _expect(isinstance(blobs_obj, list), "blobs must be a list")
    _expect(len(blobs_obj) <= MAX_BLOBS, f"a manifest lists at most {MAX_BLOBS} blobs, found {len(blobs_obj)}")
    blobs = []
    blob_keys = ({"id", "size"}, {"id", "size", "digest"}) if fmt >= 2 else ({"id", "size"},)
    for b in blobs_obj:  # format 2: "digest" may be left out (= null)
        _expect(isinstance(b, dict) and set(b) in blob_keys,
                "each blob is {id, size, digest}" if fmt >= 2 else "each blob is {id, size}")
        digest = b.get("digest")
        if digest is not None:
            parse_digest(digest)
        blobs.append(BlobRef(id=check_blob_id(b["id"]), size=_int(b["size"], "blob size", hi=MAX_BLOB_BYTES),
                             digest=digest))
    ids = {b.id for b in blobs}
    _expect(len(ids) == len(blobs), "blob ids must be unique")
    total_blob = sum(b.size for b in blobs)
    _expect(total_blob <= MAX_TOTAL_BLOB_BYTES,
            f"blobs total {total_blob} bytes, over the {MAX_TOTAL_BLOB_BYTES}-byte limit")

    if fmt >= 3:
        if records:  # checked whole; the records made when first used (a subscriber's step reads the columns)
            tensors = _Packed()
            tensors.table, tensors.kind, tensors.blob_ids = obj["table"], kind, tuple(b.id for b in blobs)
            tensors.columns = _table_records(obj["table"], kind, list(tensors.blob_ids), build="columns")
        else:
            if records is None:  # fields only: the text is what the signature covers
                _expect(isinstance(obj["table"], str), "table must be a string")
            else:
                _table_records(obj["table"], kind, [b.id for b in blobs], build=False)  # checked all the same
            tensors = _Unread()
            tensors.table = obj["table"]
        m = Manifest(model=model, version=version, parent=parent, kind=kind, tensors=tensors,
                     blobs=tuple(blobs), state_fp=state_fp, state_fp_before=state_fp_before, meta=meta,
                     signature=sig, format=fmt, key_id=key_id)
        _remember_table(m, obj["table"])
        return m
    tensors_obj = obj["tensors"]
    _expect(isinstance(tensors_obj, list), "tensors must be a list")
    _expect(len(tensors_obj) <= MAX_TENSORS, f"a manifest lists at most {MAX_TENSORS} tensors, found {len(tensors_obj)}")
    tensors = []
    names: set[str] = set()
    state_elements = state_bytes = n_chunks = 0
    for t in tensors_obj:
        _expect(isinstance(t, dict) and set(t) == {"name", "dtype", "shape", "fp_before", "fp_after", "changed", "chunks"},
                "each tensor is {name, dtype, shape, fp_before, fp_after, changed, chunks}")
        name = t["name"]
        _expect(isinstance(name, str) and 0 < len(name) <= 1024, f"tensor name {name!r} must be a non-empty string")
        _expect(name not in names, f"tensor {name!r} listed twice")
        names.add(name)
        info = dtype_info(t["dtype"]) if isinstance(t["dtype"], str) else _expect(False, "dtype must be a string")
        shape = t["shape"]
        _expect(isinstance(shape, list) and len(shape) <= MAX_DIMS, f"{name}: shape must be a list of at most {MAX_DIMS} dims")
        shape_t = tuple(_int(s, f"{name}: dimension", hi=MAX_DIM) for s in shape)
        elements = _numel(shape_t)
        _expect(elements <= MAX_TENSOR_ELEMENTS,
                f"{name}: shape {list(shape_t)} has {elements} elements, over the {MAX_TENSOR_ELEMENTS}-element limit per tensor")
        state_elements += elements
        state_bytes += elements * info.element_size
        _expect(state_elements <= MAX_STATE_ELEMENTS,
                f"the tensors total over {MAX_STATE_ELEMENTS} elements (the limit per state), at {name!r}")
        _expect(state_bytes <= MAX_STATE_BYTES,
                f"the tensors total over {MAX_STATE_BYTES} bytes (the limit per state), at {name!r}")
        words = word_count(shape_t, info)
        changed = _int(t["changed"], f"{name}: changed", hi=words)
        chunks = []
        _expect(isinstance(t["chunks"], list), f"{name}: chunks must be a list")
        n_chunks += len(t["chunks"])
        _expect(n_chunks <= MAX_CHUNKS, f"a manifest holds at most {MAX_CHUNKS} chunk references, at {name!r}")
        for c in t["chunks"]:
            _expect(isinstance(c, dict) and "blob" in c, f"{name}: each chunk names its blob")
            _expect(c["blob"] in ids, f"{name}: chunk refers to blob {c['blob']!r} not in the blob list")
            if kind == "delta":
                _expect(set(c) == {"blob", "index"}, f"{name}: a delta chunk is {{blob, index}}")
                chunks.append(ChunkRef(blob=c["blob"], index=_int(c["index"], f"{name}: chunk index", hi=MAX_CHUNK_INDEX)))
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
                    signature=sig, format=fmt, key_id=key_id)
