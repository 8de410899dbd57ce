"""Server counters and gauges, rendered in the Prometheus text format (version 0.0.4).

One ``Metrics`` object per server, held in the app (no global registry). Counters
only go up; gauges are set or computed when scraped. Every series is named
``deltasync_*`` and documented in docs/PROTOCOL.md ("Metrics").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

_COUNTERS: dict[str, str] = {
    "bytes_in": "Blob bytes received (uploads and upstream fetches).",
    "bytes_out": "Blob bytes sent to clients and children.",
    "blob_requests": "GET/HEAD requests for blobs.",
    "cache_hits": "Blob requests served from a complete blob on disk.",
    "cache_misses": "Blob requests for a blob not complete on disk (served cut-through or fetched).",
    "coalesced": "Blob requests that joined a fetch already in flight instead of starting one.",
    "upstream_fetches": "Blob fetches started from a parent (one per missing blob, however many readers).",
    "upstream_requests": "HTTP requests for blob bytes sent to parents (fetches plus Range resumes).",
    "upstream_resumes": "Blob fetches resumed with a Range request after a failure.",
    "upstream_failovers": "Times a parent failed and the next parent was tried.",
    "hash_failures": "Blobs whose bytes did not hash to their id (discarded and refetched, or refused).",
    "corrupt_dropped": "Stored blobs found corrupt on disk when rehashed before serving (dropped, refetched).",
    "manifest_fetches": "Manifests fetched from a parent.",
    "versions": "Versions committed (origin) or announced (relay).",
    "uploads": "Blobs stored by PUT.",
    "upload_rejections": "PUT requests refused (any reason).",
    "evictions": "Blobs evicted to stay within the cache size budget.",
    "evicted_bytes": "Bytes evicted to stay within the cache size budget.",
    "squash_builds": "Squashed catch-up deltas built.",
    "squash_hits": "Squashed catch-up deltas served from the cache.",
    "send_aborts": "Blob responses aborted (client too slow or gone, upstream failed mid-stream).",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Gauge:
    name: str
    help: str
    read: Callable[[], list[tuple[dict[str, str], float]]]


class Metrics:
    """Named counters plus gauges read at scrape time. Not thread-safe: use from the loop."""

    def __init__(self, *, role: str) -> None:
        self.role = role
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._gauges: list[Gauge] = []

    def inc(self, name: str, n: int = 1) -> None:
        self._counts[name] += n

    def get(self, name: str) -> int:
        return self._counts[name]

    def add_gauge(self, name: str, help: str, read: Callable[[], list[tuple[dict[str, str], float]]]) -> None:
        self._gauges.append(Gauge(name=name, help=help, read=read))

    def render(self) -> str:
        lines: list[str] = []
        for name, help_text in _COUNTERS.items():
            full = f"deltasync_{name}_total"
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter", f"{full} {self._counts[name]}"]
        lines += ["# HELP deltasync_info Server role.", "# TYPE deltasync_info gauge",
                  f'deltasync_info{{role="{self.role}"}} 1']
        for g in self._gauges:
            full = f"deltasync_{g.name}"
            lines += [f"# HELP {full} {g.help}", f"# TYPE {full} gauge"]
            for labels, value in g.read():
                lines.append(f"{full}{_labels(labels)} {_num(value)}")
        return "\n".join(lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def parse_metrics(text: str) -> dict[str, float]:
    """Read Prometheus text back into ``{"name{labels}": value}`` (for tests and benchmarks)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out
