"""What a server is told at start: its role, where it listens, stores and fetches, and its limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .http.connections import ServerLimits
from deltasync.retry import DEFAULT_MIN_RATE, DEFAULT_RATE_GRACE, Pace
from deltasync.signing import Verifier

from .http.tokens import TokenTable

ROLES = ("origin", "relay")
STORES = ("disk", "memory", "s3")


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Every wait a server makes, in seconds. None of them is unbounded."""

    connect: float = 5.0  # TCP connect to a parent
    read: float = 30.0  # silence on a parent connection (headers or body) before it counts as dead
    write: float = 60.0  # a child that accepts no bytes for this long is cut off
    first_byte: float = 60.0  # a reader waiting for a blob that is being fetched
    ttfb: float = 10.0  # a parent's status line (time to first byte); event streams and long waits excepted
    hedge_after: float | None = 2.0  # a manifest read with no answer after this long also asks the next parent
    max_wait: float = 60.0  # the longest long-poll a client may ask for (?wait=)
    heartbeat: float = 10.0  # SSE comment sent this often so followers can tell a live parent from a dead one
    parent_cooldown: float = 5.0  # a parent that failed is skipped this long while others are tried
    shutdown: float = 5.0  # requests still running this long after SIGTERM are cut
    #: a parent's body (blob or manifest) must average this many bytes/s once ``rate_grace`` seconds have
    #: passed (``deltasync.retry.Pace``); one that drips is failed over, a blob resumed from the next parent
    min_rate: float = DEFAULT_MIN_RATE
    rate_grace: float = DEFAULT_RATE_GRACE

    def pace(self, start: float, what: str) -> Pace:
        return Pace(min_rate=self.min_rate, grace=self.rate_grace, start=start, what=what)


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketSettings:
    """An origin's bucket store (server/storage/s3store.py); ``store_dir`` is then its local scratch directory."""

    url: str  # s3://BUCKET/PREFIX
    cache_size: int = 1 << 30  # local read cache of blobs, bytes
    conditional: bool | None = None  # does the server honour If-None-Match? None: probe at start
    lease_ttl: float = 30.0  # writer lease, where there are no conditional writes
    poll: float = 2.0  # seconds between polls for versions other origins committed
    gc_interval: float = 600.0  # seconds between orphan sweeps (0: never)
    gc_grace: float = 3600.0  # an unreferenced blob younger than this is kept (a publish in flight)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    role: str  # "origin" | "relay"
    host: str
    port: int
    store_dir: Path | None  # the disk store's directory (unused by the memory store)
    token: str | None = None  # origin: bearer token for writes
    # what manifests (and blob digests) must verify with: the publisher's public key(s) (--verify-key), or the HMAC
    # secret of a closed deployment (--key-file, raw bytes), which also signs the squashes; None: nothing is verified
    verifier: Verifier | bytes | None = None
    tokens: TokenTable | None = None  # scoped tokens (--token-file); origin default: TokenTable.single(token)
    read_token: str | None = None  # relay: sent to its parents (--read-token-file)
    tls_cert: Path | None = None  # serve https with this certificate chain (PEM) ...
    tls_key: Path | None = None  # ... and key (PEM)
    ca_file: Path | None = None  # relay: trust only these CAs for https parents (PEM)
    parents: tuple[str, ...] = ()  # relay: base URLs, most preferred first
    cache_size: int | None = None  # byte budget for blobs; None = unbounded
    retention: int = 16  # newest versions per model whose blobs are pinned
    max_blob_size: int = 4 << 30  # PUT bodies larger than this are refused (413)
    max_manifest_size: int = 64 << 20
    max_squash_chain: int = 1024  # longest chain a squashed catch-up delta may cover
    sse_queue: int = 1024  # events buffered per SSE client before it is dropped as too slow
    fsync: bool = True
    store_kind: str = "disk"  # "disk" | "memory" (tests: nothing survives a restart) | "s3"
    bucket: BucketSettings | None = None  # the s3 store's bucket (origin), see BucketSettings
    bucket_poll: float = 1.0  # relay: seconds between polls of a bucket parent's heads.json
    hinted_fetch: bool = True  # relay: fetch a blob the parent hints it is receiving (server/parents/prefetch.py)
    s3_endpoint: str | None = None  # S3 API endpoint of s3:// stores and parents (None: AWS)
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: ServerLimits = field(default_factory=ServerLimits)  # what clients may hold (server/http/connections.py)
    squash_budget: tuple[float, int] | None = None  # (seconds, output bytes) of one squash build; None: defaults

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, found {self.role!r}")
        if self.role == "origin" and not (self.token or self.tokens):
            raise ValueError("an origin needs a bearer token for writes (--token-file)")
        if self.role == "relay" and not self.parents:
            raise ValueError("a relay needs at least one --parent URL")
        if self.store_kind not in STORES:
            raise ValueError(f"store_kind must be one of {STORES}, found {self.store_kind!r}")
        if self.store_kind == "s3" and (self.bucket is None or self.store_dir is None):
            raise ValueError("the s3 store needs a bucket (--store s3://BUCKET/PREFIX) and a scratch directory")
        if self.store_kind == "disk" and self.store_dir is None:
            raise ValueError("the disk store needs a directory (--store)")
        if self.retention < 1:
            raise ValueError("retention must be at least 1 version")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")

    @property
    def squash_signer(self) -> bytes | None:
        """The HMAC secret a closed deployment's squashes are signed with; None with public keys (a relay cannot
        sign: subscribers then take squashes only where a state fingerprint proves them) or no key."""
        return self.verifier if isinstance(self.verifier, bytes) else None

    @property
    def token_table(self) -> TokenTable | None:
        if self.tokens is not None:
            return self.tokens
        return TokenTable.single(self.token) if self.token else None

    @property
    def is_origin(self) -> bool:
        return self.role == "origin"
