"""Server counters and gauges, exposed through ``prometheus_client`` (text format 0.0.4).

One ``Metrics`` object per server, with its own ``CollectorRegistry`` (never the
process-wide default one: two servers in one process do not share a counter).
Counters only go up; gauges are computed when scraped. Both reach the registry
through one collector that yields ``CounterMetricFamily``/``GaugeMetricFamily`` at
scrape time, so ``inc`` on the hot path is a dict update and no ``*_created``
series appear. Every series is named ``deltasync_*`` and documented in
docs/PROTOCOL.md ("Metrics").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

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
    "uploads_direct": "Uploads whose body was received straight into one buffer (large bodies over plain TCP).",
    "upload_rejections": "PUT requests refused (any reason).",
    "evictions": "Blobs evicted to stay within the cache size budget.",
    "evicted_bytes": "Bytes evicted to stay within the cache size budget.",
    "squash_builds": "Squashed catch-up deltas built.",
    "squash_hits": "Squashed catch-up deltas served from the cache.",
    "send_aborts": "Blob responses aborted (client too slow or gone, upstream failed mid-stream).",
    "storage_errors": "Blob fetches that our own disk could not hold (answered 507; the parent is not blamed).",
    "negative_hits": "Blob requests answered 404 from the negative cache (no parent had it moments ago).",
    "hinted_fetches": "Blob fetches a relay started on its parent's upload hint, before a version named the blob.",
    "hinted_cancelled": "Hinted fetches a relay cancelled to make room for a blob a version or a reader wanted.",
    "hints_refused": "Upload hints a relay did not act on: over its share of the cache (HINT_SHARE), or too many.",
    "upload_reads": "Blob requests an origin answered from an upload still arriving (cut-through).",
    "uploads_unhinted": "Large uploads an origin did not hint: no X-Deltasync-Model, or a model the token may not "
                        "publish.",
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
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def inc(self, name: str, n: int = 1) -> None:
        self._counts[name] += n

    def get(self, name: str) -> int:
        return self._counts[name]

    def add_gauge(self, name: str, help: str, read: Callable[[], list[tuple[dict[str, str], float]]]) -> None:
        self._gauges.append(Gauge(name=name, help=help, read=read))

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def families(self) -> Iterator[Metric]:
        for name, help_text in _COUNTERS.items():
            yield CounterMetricFamily(f"deltasync_{name}", help_text, value=self._counts[name])
        info = GaugeMetricFamily("deltasync_info", "Server role.", labels=["role"])
        info.add_metric([self.role], 1)
        yield info
        for g in self._gauges:
            samples = g.read()
            names = sorted({k for labels, _ in samples for k in labels})
            fam = GaugeMetricFamily(f"deltasync_{g.name}", g.help, labels=names)
            for labels, value in samples:
                fam.add_metric([labels.get(k, "") for k in names], value)
            yield fam


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()


def parse_metrics(text: str) -> dict[str, float]:
    """Read Prometheus text back into ``{"name{labels}": value}`` (labels sorted, values escaped as
    in the text format; for tests and benchmarks)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name + _labels(sample.labels)] = sample.value
    return out


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
