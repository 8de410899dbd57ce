"""The bucket layout (docs/FORMAT.md §10): object names, the heads object and bucket URLs, no I/O.

Under the store's prefix::

    deltasync-bucket.json                      marker: {"format": "deltasync-bucket", "version": 1}
    heads.json                                 every model's newest committed version (polled by followers)
    blobs/ab/ab01...ef                         a blob, named by its id (xxh3-128 of its bytes, 32 hex)
    models/<model>/<version:020d>.json         a committed manifest (canonical JSON), written last
    lease.json                                 the writer lease (only on servers without conditional writes)

A version exists exactly when its manifest object exists; the manifest is written
after every blob it names, with ``If-None-Match: *`` where the server honours it.
``heads.json`` is a hint that is never behind by more than the commit in flight:
followers poll it and then list ``models/<model>/`` after their own head, so a
version is found even if a heads update was lost.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import urlparse

from deltasync.blob import BLOB_ID_RE, check_blob_id
from deltasync.errors import FormatError
from deltasync.manifest import MAX_VERSION, MODEL_RE

MARKER = "deltasync-bucket.json"
MARKER_BODY = b'{"format":"deltasync-bucket","version":1}\n'
HEADS = "heads.json"
LEASE = "lease.json"
BLOBS = "blobs/"
MODELS = "models/"
_MANIFEST_RE = re.compile(r"^models/([^/]+)/([0-9]{20})\.json$")


def blob_key(blob_id: str) -> str:
    check_blob_id(blob_id)
    return f"{BLOBS}{blob_id[:2]}/{blob_id}"


def model_prefix(model: str) -> str:
    if not MODEL_RE.match(model):
        raise FormatError(f"model name {model!r} must match {MODEL_RE.pattern}")
    return f"{MODELS}{model}/"


def manifest_key(model: str, version: int) -> str:
    if not 0 <= version <= MAX_VERSION:
        raise FormatError(f"version must be 0..{MAX_VERSION}, found {version}")
    return f"{model_prefix(model)}{version:020d}.json"


def parse_blob_key(key: str) -> str | None:
    """The blob id a key under blobs/ names, or None for anything else."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "blobs" and BLOB_ID_RE.match(parts[2]) and parts[2][:2] == parts[1]:
        return parts[2]
    return None


def parse_manifest_key(key: str) -> tuple[str, int] | None:
    """(model, version) a key under models/ names, or None for anything else."""
    m = _MANIFEST_RE.match(key)
    if not m or not MODEL_RE.match(m.group(1)):
        return None
    return m.group(1), int(m.group(2))


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadEntry:
    version: int
    kind: str
    state_fp: str


def encode_heads(heads: dict[str, HeadEntry]) -> bytes:
    body = {"format": "deltasync-heads", "version": 1,
            "models": {m: {"version": e.version, "kind": e.kind, "state_fp": e.state_fp}
                       for m, e in sorted(heads.items())}}
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def decode_heads(data: bytes) -> dict[str, HeadEntry]:
    """The heads object; FormatError for anything that is not one."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"heads.json is not JSON: {e}") from None
    if not isinstance(body, dict) or body.get("format") != "deltasync-heads" or body.get("version") != 1:
        raise FormatError("heads.json is not a deltasync-heads version 1 object")
    models = body.get("models")
    if not isinstance(models, dict):
        raise FormatError("heads.json has no models object")
    out: dict[str, HeadEntry] = {}
    for name, e in models.items():
        if not (isinstance(name, str) and MODEL_RE.match(name) and isinstance(e, dict)):
            raise FormatError(f"heads.json has a bad entry for {name!r}")
        v, kind, fp = e.get("version"), e.get("kind"), e.get("state_fp")
        if not (isinstance(v, int) and 0 <= v <= MAX_VERSION and isinstance(kind, str) and isinstance(fp, str)):
            raise FormatError(f"heads.json entry for {name!r} needs version, kind and state_fp")
        out[name] = HeadEntry(version=v, kind=kind, state_fp=fp)
    return out


def merge_heads(current: dict[str, HeadEntry], model: str, entry: HeadEntry) -> dict[str, HeadEntry] | None:
    """``current`` with ``model`` moved to ``entry``; None if it already is there or newer."""
    have = current.get(model)
    if have is not None and have.version >= entry.version:
        return None
    return {**current, model: entry}


# -- where a bucket store is --------------------------------------------------------------------

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,62}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketLocation:
    """Where a deltasync bucket store lives: ``s3://BUCKET/PREFIX`` (plus an endpoint) or a plain
    HTTPS base URL (``bucket+https://host/prefix``: read-only, anonymous GETs)."""

    bucket: str | None  # None for a plain-URL bucket
    prefix: str  # no leading or trailing slash; "" for the bucket's root
    endpoint: str | None = None  # S3 API endpoint; None: AWS itself (region from the environment)
    url: str | None = None  # plain base URL (read-only)

    @property
    def display(self) -> str:
        if self.url is not None:
            return f"bucket+{self.url}"
        where = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{where} at {self.endpoint}" if self.endpoint else where


def is_bucket_url(text: str) -> bool:
    return text.startswith("s3://") or text.startswith("bucket+http://") or text.startswith("bucket+https://")


def parse_bucket_url(text: str, *, endpoint: str | None = None) -> BucketLocation:
    """``s3://BUCKET[/PREFIX]`` or ``bucket+https://HOST[/PREFIX]``; ValueError says what is wrong."""
    if text.startswith("bucket+"):
        url = text[len("bucket+"):].rstrip("/")
        u = urlparse(url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ValueError(f"a plain bucket URL looks like bucket+https://host/prefix, found {text!r}")
        return BucketLocation(bucket=None, prefix="", url=url)
    if not text.startswith("s3://"):
        raise ValueError(f"a bucket store is named s3://BUCKET/PREFIX, found {text!r}")
    bucket, _, prefix = text[len("s3://"):].partition("/")
    if not _BUCKET_RE.match(bucket):
        raise ValueError(f"{bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, '.', '-')")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"prefix {prefix!r} has an empty, '.' or '..' segment")
    if endpoint is not None and not re.match(r"^https?://[^/\s]+/?$", endpoint):
        raise ValueError(f"--s3-endpoint takes a URL like https://host:port, found {endpoint!r}")
    return BucketLocation(bucket=bucket, prefix=prefix, endpoint=endpoint.rstrip("/") if endpoint else None)
