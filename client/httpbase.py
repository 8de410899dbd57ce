"""What the client's two HTTP faces share, without importing aiohttp: :class:`Timeouts` (every wait),
:class:`HeadInfo` (a head answer) and :func:`is_outage` (the one rule of which failures are a server's, to
fail over or retry, and which are answers). ``client/http.py`` (aiohttp: subscribers, the sidecar, the
in-process publisher) and ``client/plainhttp.py`` (the ``publish`` command's few requests to a plain-HTTP
origin) both use them, with ``deltasync.retry``'s loops and ``deltasync.errors``' tree."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from deltasync.errors import AuthError, DeltaSyncError, IntegrityError, UpstreamError
from deltasync.retry import DEFAULT_MIN_RATE, DEFAULT_RATE_GRACE, Pace

#: a blob PUT's model: the origin hints a large upload to relays only for a model the token may publish
MODEL_HEADER = "X-Deltasync-Model"

#: the transport failures every client has (the aiohttp client adds its own exception classes)
NETWORK_ERRORS: tuple[type[BaseException], ...] = (asyncio.TimeoutError, OSError)


def is_outage(e: BaseException, network: tuple[type[BaseException], ...] = NETWORK_ERRORS) -> bool:
    """A server's failure (try the next URL / try again), as opposed to an answer such as a 4xx:
    the network (``network``), 5xx or 429, refused credentials, bytes that fail our check."""
    if isinstance(e, network):
        return True
    if isinstance(e, IntegrityError) and e.status is None:
        return True  # corrupt bytes we caught, not a server's 4xx answer
    return isinstance(e, DeltaSyncError) and (e.http_status >= 500 or isinstance(e, AuthError))


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Every wait the client makes, in seconds; none is unbounded."""

    connect: float = 5.0  # TCP connect
    read: float = 30.0  # silence on an open connection (headers or body)
    request: float = 300.0  # one whole request, body included
    poll: float = 20.0  # long-poll duration asked of the server (?wait=)
    cooldown: float = 5.0  # a URL that failed is skipped this long (doubling per failure in a row, up to a minute)
    ttfb: float = 10.0  # a request's status line (time to first byte); a long-poll gets poll + this
    hedge_after: float | None = 2.0  # a read with no answer yet after this long also asks the next URL (None: never)
    #: every body (and a blob answer's headers) must average this many bytes/s once ``rate_grace`` has passed
    #: (``deltasync.retry.Pace``): a source that drips is failed over mid-body however often it sends a byte
    min_rate: float = DEFAULT_MIN_RATE
    rate_grace: float = DEFAULT_RATE_GRACE

    def __post_init__(self) -> None:
        for name in ("connect", "read", "request", "poll", "cooldown", "ttfb", "min_rate", "rate_grace"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Timeouts.{name} must be a positive number of seconds, found {getattr(self, name)!r}")
        if self.hedge_after is not None and not self.hedge_after > 0:
            raise ValueError(f"Timeouts.hedge_after must be positive seconds or None, found {self.hedge_after!r}")

    def pace(self, start: float, what: str = "the body") -> Pace:
        """The minimum rate of a transfer that began at ``start`` (loop time)."""
        return Pace(min_rate=self.min_rate, grace=self.rate_grace, start=start, what=what)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadInfo:
    """What ``GET /v1/models/{m}/head`` says. The server answers with the head version's manifest
    itself (``body``; parse and verify it with ``deltasync.manifest.parse_manifest``); after a
    long-poll that timed out (204) only ``version`` is known and ``body`` is None."""

    model: str
    version: int
    kind: str | None = None
    bytes: int | None = None
    body: bytes | None = None
    url: str = ""
    #: what the read's parse/check returned for ``body`` (the driver: the verified Manifest), else None
    checked: object = None

    @staticmethod
    def from_body(body: bytes, *, model: str, url: str = "") -> HeadInfo:
        """The head answer's summary; UpstreamError (that source's fault) for anything but a JSON object
        with a non-negative integer ``version`` and, when ``blobs`` is given, non-negative integer sizes."""
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: crafted deep nesting ([[[[...)
            raise UpstreamError(f"{url}: head answer is not JSON (or nested too deep): {body[:200]!r}") from None
        version = obj.get("version") if isinstance(obj, dict) else None
        if not _count(version):
            raise UpstreamError(f"{url}: head answer {body[:200]!r} has no non-negative integer 'version'")
        if "model" in obj and obj["model"] != model:  # another chain's manifest, however well signed (TUF's
            raise UpstreamError(f"{url + ': ' if url else ''}asked for the head of {model!r}, the answer is "  # fast-forward,
                                f"{str(obj['model'])[:100]!r} v{version}")  # wrong installation)
        blobs = obj.get("blobs")
        size = None
        if isinstance(blobs, list):
            sizes = [b.get("size", 0) for b in blobs if isinstance(b, dict)]
            if not all(_count(s) for s in sizes):
                raise UpstreamError(f"{url}: head answer for v{version} has a blob size that is not a "
                                    f"non-negative integer: {body[:200]!r}")
            size = sum(sizes)
        kind = obj.get("kind") if isinstance(obj.get("kind"), str) else None
        return HeadInfo(model=model, version=version, kind=kind, bytes=size, body=body, url=url)


def _count(v: object) -> bool:
    """A JSON value usable as a version or a size: an int (not a bool) >= 0."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
