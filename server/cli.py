"""``deltasync origin`` and ``deltasync relay``: run a server until SIGTERM/SIGINT.

``register(subparsers)`` adds both subcommands to the project's CLI;
``python -m deltasync.server.cli origin|relay ...`` runs them standalone. The
server logs one line per significant event to stderr, among them
``listening on http://HOST:PORT`` once it accepts connections (with
``--listen HOST:0`` the port is the one the OS picked).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import re
import signal
import sys
import tempfile
from pathlib import Path

from aiohttp import web

from deltasync.errors import DeltaSyncError
from deltasync.keyfiles import verifier_from_options
from deltasync.cli.run import run_command
from deltasync.manifest import load_key

from .app import build_app
from .config import BucketSettings, ServerConfig, Timeouts
from .http.connections import ConnectionGuard, GuardedRunner, ServerLimits
from .http.tokens import TokenTable
from .storage.bucketlayout import is_bucket_url, parse_bucket_url

log = logging.getLogger("deltasync.server")

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``64M``, ``10GiB``, ``1T`` (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"size must be bytes with an optional K/M/G/T suffix, found {text!r}")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) * _UNITS[unit]


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"--listen takes HOST:PORT, found {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def parse_parent(text: str) -> str:
    if text.startswith(("s3://", "bucket+")):
        try:
            parse_bucket_url(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text.rstrip("/")
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", text):
        raise argparse.ArgumentTypeError(f"--parent takes a URL like http://host:port (or a bucket, "
                                         f"s3://BUCKET/PREFIX or bucket+https://host/prefix), found {text!r}")
    return text.rstrip("/")


def parse_store(text: str) -> Path | str:
    """A directory, or a bucket ``s3://BUCKET/PREFIX`` (kept as text)."""
    if text.startswith("s3://"):
        try:
            parse_bucket_url(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text.rstrip("/")
    return Path(text)


def parse_endpoint(text: str) -> str:
    if not re.match(r"^https?://[^/\s]+/?$", text):
        raise argparse.ArgumentTypeError(f"--s3-endpoint takes a URL like https://host:port, found {text!r}")
    return text.rstrip("/")


def _bucket_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--s3-endpoint", type=parse_endpoint, default=None, metavar="URL",
                   help="S3 API endpoint of s3:// buckets (MinIO, R2, GCS interop...); default AWS S3. Credentials "
                        "and region come from the AWS_* variables and ~/.aws files")
    p.add_argument("--bucket-poll", type=float, default=None, metavar="S",
                   help="seconds between polls of a bucket's heads.json (relay: bucket parents, default 1; "
                        "origin: versions other origins committed, default 2)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, type=parse_listen, metavar="HOST:PORT",
                   help="address to serve on (port 0: any free port, logged at start)")
    p.add_argument("--verify-key", action="append", type=Path, default=[], metavar="PEM",
                   help="the publisher's Ed25519 public key (PEM); every manifest and blob digest must verify. "
                        "Repeat for rotation (any listed key is accepted)")
    p.add_argument("--key-file", type=Path,
                   help="shared HMAC key (hex), closed deployments only: its holders can also sign; when given, "
                        "every manifest must verify with it")
    p.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve https with this certificate chain")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--retention", type=int, default=16, metavar="N",
                   help="pin the blobs of each model's newest N versions (and newest keyframe); default 16")
    p.add_argument("--heartbeat", type=float, default=10.0, metavar="S", help="event-stream keepalive period")
    p.add_argument("--read-timeout", type=float, default=30.0, metavar="S",
                   help="silence from a parent before it counts as dead")
    p.add_argument("--write-timeout", type=float, default=60.0, metavar="S",
                   help="a child that accepts no bytes for this long is cut off")
    p.add_argument("--max-wait", type=float, default=60.0, metavar="S", help="longest long-poll a client may ask for")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (tests and benchmarks only: not crash-safe)")
    p.add_argument("--ttfb-timeout", type=float, default=10.0, metavar="S",
                   help="a parent that sends no status line for S seconds is failed over (default 10)")
    p.add_argument("--hedge-after", type=float, default=2.0, metavar="S",
                   help="a manifest read from a parent with no answer after S seconds also asks the next parent "
                        "(default 2; 0: never)")
    p.add_argument("--idle-timeout", type=float, default=15.0, metavar="S",
                   help="close a connection with no request in progress, or with headers half sent, after S "
                        "seconds (default 15)")
    p.add_argument("--body-timeout", type=float, default=10.0, metavar="S",
                   help="cut an upload that sends nothing for S seconds (default 10)")
    p.add_argument("--min-upload-rate", type=parse_size, default=64 << 10, metavar="BYTES",
                   help="cut an upload averaging under BYTES per second after a 5 s grace (default 64K; 0: no minimum)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="most connections held at once; over it the oldest idle one is closed (default: the "
                        "descriptor limit less 64)")
    p.add_argument("--max-connections-per-client", type=int, default=512, metavar="N",
                   help="most connections from one client address (default 512; 0: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="on SIGTERM, cut what is still running after S seconds (default 5)")
    p.add_argument("--squash-seconds", type=float, default=None, metavar="S",
                   help="longest one squashed catch-up build may run (default 120)")
    p.add_argument("--squash-max-bytes", type=parse_size, default=None, metavar="BYTES",
                   help="largest squashed delta (blob bytes) one build may make, and chain bytes it may read "
                        "(default 16G)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def register(subparsers) -> None:
    """Add the ``origin`` and ``relay`` subcommands to an argparse subparsers object."""
    o = subparsers.add_parser("origin", help="run the origin: takes the publisher's writes, stores them durably",
                              description="Run the origin server (root of the relay tree).")
    _common(o)
    o.add_argument("--store", required=True, type=parse_store, metavar="DIR|s3://BUCKET/PREFIX",
                   help="store directory, or a bucket (versions live there; origins are then stateless)")
    _bucket_options(o)
    o.add_argument("--s3-scratch", type=Path, default=None, metavar="DIR",
                   help="bucket store: local directory for uploads in flight and the read cache (default: a "
                        "fresh temporary directory; emptied at start)")
    o.add_argument("--s3-cache-size", type=parse_size, default=1 << 30, metavar="BYTES",
                   help="bucket store: local read cache budget (default 1G)")
    o.add_argument("--s3-conditional", choices=["auto", "yes", "no"], default="auto",
                   help="bucket store: does the server honour If-None-Match on PUT? auto probes at start; without "
                        "it only one origin may write (writer lease)")
    o.add_argument("--s3-lease-ttl", type=float, default=30.0, metavar="S",
                   help="bucket store without conditional writes: writer lease lifetime (a dead origin is replaced "
                        "after at most this long)")
    o.add_argument("--gc-interval", type=float, default=600.0, metavar="S",
                   help="bucket store: seconds between sweeps of orphaned blobs (0: never)")
    o.add_argument("--gc-grace", type=float, default=3600.0, metavar="S",
                   help="bucket store: blobs no manifest names are deleted once older than this")
    o.add_argument("--token-file", required=True, type=Path, metavar="F",
                   help="bearer tokens: one token (publish and read everything), or lines 'publish|read MODEL "
                        "TOKEN' (scoped per model; any read line makes reads need a token). docs/PROTOCOL.md")
    o.add_argument("--max-blob-size", type=parse_size, default=4 << 30, metavar="BYTES",
                   help="largest blob upload accepted (default 4G)")
    o.set_defaults(func=run_origin)

    r = subparsers.add_parser("relay", help="run a relay: caches and serves what its parents have",
                              description="Run a relay server (a cache tier of the tree).")
    _common(r)
    r.add_argument("--parent", required=True, action="append", type=parse_parent, metavar="URL",
                   help="parent base URL; repeat for fallbacks, most preferred first")
    r.add_argument("--cache", required=True, type=Path, metavar="DIR", help="cache directory")
    _bucket_options(r)
    r.add_argument("--cache-size", type=parse_size, default=None, metavar="BYTES",
                   help="blob cache budget (K/M/G/T suffixes); default unbounded")
    r.add_argument("--token-file", type=Path, metavar="F",
                   help="read tokens its children must send (lines 'read MODEL TOKEN'); default: reads are open")
    r.add_argument("--read-token-file", type=Path, metavar="F", help="the read token this relay sends its parents")
    r.add_argument("--ca-file", type=Path, metavar="PEM", help="trust only these CAs for https parents")
    r.add_argument("--min-rate", type=parse_size, default=64 << 10, metavar="BYTES",
                   help="a parent whose body (blob or manifest) averages under BYTES per second after "
                        "--rate-grace is failed over mid-body, the blob resumed from the next parent (default 64K)")
    r.add_argument("--rate-grace", type=float, default=10.0, metavar="S",
                   help="seconds a parent's body may take before --min-rate applies (default 10)")
    r.add_argument("--no-hinted-fetch", action="store_true",
                   help="fetch a blob only when a version names it or a child asks, not when the parent hints "
                        "that it is receiving it (an upload in progress)")
    r.set_defaults(func=run_relay)


def _timeouts(args) -> Timeouts:
    return Timeouts(read=args.read_timeout, write=args.write_timeout, max_wait=args.max_wait,
                    heartbeat=args.heartbeat, ttfb=args.ttfb_timeout, hedge_after=args.hedge_after or None,
                    shutdown=args.shutdown_timeout,
                    **({"min_rate": args.min_rate, "rate_grace": args.rate_grace} if hasattr(args, "min_rate") else {}))


def _limits(args) -> dict:
    """The ServerConfig fields that bound clients (``limits``) and squash builds (``squash_budget``)."""
    limits = ServerLimits(idle_timeout=args.idle_timeout, body_timeout=args.body_timeout,
                          min_upload_rate=args.min_upload_rate, max_connections=args.max_connections,
                          max_connections_per_client=args.max_connections_per_client)
    squash = None
    if args.squash_seconds is not None or args.squash_max_bytes is not None:
        squash = (120.0 if args.squash_seconds is None else args.squash_seconds,
                  16 << 30 if args.squash_max_bytes is None else args.squash_max_bytes)
    return {"limits": limits, "squash_budget": squash}


def _key(args) -> bytes | None:
    if args.key_file and args.verify_key:
        raise DeltaSyncError("give --verify-key (public keys) or --key-file (HMAC), not both")
    return load_key(args.key_file.read_text()) if args.key_file else None


def _trust(args) -> dict:
    """The verify key(s), the HMAC key and the TLS files of a server's options, as ServerConfig fields."""
    hmac = _key(args)
    if hmac is not None and args.verify_key:
        raise ValueError("give --verify-key (public keys) or --key-file (HMAC), not both")
    return {"verifier": verifier_from_options(args.verify_key) if args.verify_key else hmac,
            "tls_cert": args.tls_cert, "tls_key": args.tls_key}


def _tokens(path: Path | None) -> TokenTable | None:
    return None if path is None else TokenTable.parse(path.read_text(), where=f"token file {path}")


def _read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    token = path.read_text().strip()
    if not token:
        raise DeltaSyncError(f"read token file {path} is empty")
    return token


def run_origin(args) -> int:
    try:
        tokens = _tokens(args.token_file)
        store_dir, bucket = args.store, None
        if isinstance(args.store, str):  # a bucket
            bucket = BucketSettings(url=args.store, cache_size=args.s3_cache_size,
                                    conditional={"auto": None, "yes": True, "no": False}[args.s3_conditional],
                                    lease_ttl=args.s3_lease_ttl,
                                    poll=2.0 if args.bucket_poll is None else args.bucket_poll,
                                    gc_interval=args.gc_interval, gc_grace=args.gc_grace)
            store_dir = args.s3_scratch or Path(tempfile.mkdtemp(prefix="deltasync-scratch-"))
        config = ServerConfig(role="origin", host=args.listen[0], port=args.listen[1], store_dir=store_dir,
                              tokens=tokens, **_trust(args), retention=args.retention,
                              max_blob_size=args.max_blob_size, fsync=not args.no_fsync, timeouts=_timeouts(args),
                              store_kind="s3" if bucket else "disk", bucket=bucket, s3_endpoint=args.s3_endpoint,
                              **_limits(args))
    except (OSError, ValueError, DeltaSyncError) as e:
        print(f"deltasync origin: {e}", file=sys.stderr)
        return 2
    return serve(config, log_level=args.log_level)


def run_relay(args) -> int:
    try:
        config = ServerConfig(role="relay", host=args.listen[0], port=args.listen[1], store_dir=args.cache,
                              parents=tuple(args.parent), cache_size=args.cache_size, **_trust(args),
                              tokens=_tokens(args.token_file), read_token=_read_token(args.read_token_file),
                              ca_file=args.ca_file,
                              retention=args.retention, fsync=not args.no_fsync, timeouts=_timeouts(args),
                              s3_endpoint=args.s3_endpoint,
                              bucket_poll=1.0 if args.bucket_poll is None else args.bucket_poll,
                              hinted_fetch=not args.no_hinted_fetch, **_limits(args))
    except (OSError, ValueError, DeltaSyncError) as e:
        print(f"deltasync relay: {e}", file=sys.stderr)
        return 2
    return serve(config, log_level=args.log_level)


def _tune_malloc() -> None:
    """Keep freed heap memory for reuse instead of returning it to the kernel at once.

    Every piece of a blob read from a socket is a fresh bytes object of up to 256 KiB;
    with glibc's defaults the heap top is trimmed and regrown all the time, and the
    page faults of regrowing cost a relay ~15% of its CPU per byte forwarded. Keeping
    up to 64 MiB (bounded) at the top of the heap removes that churn.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD: pieces come from the heap, not fresh mmaps
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def serve(config: ServerConfig, *, log_level: str = "INFO") -> int:
    """Run the server on uvloop until SIGTERM or SIGINT; returns the exit code."""
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _tune_malloc()
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop) if hasattr(asyncio, "Runner") else None
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        uvloop = None
        runner = None
    if runner is not None:
        with runner:
            return runner.run(_serve(config))
    if uvloop is not None:  # pragma: no cover - Python 3.10
        uvloop.install()
    return asyncio.run(_serve(config))


async def _serve(config: ServerConfig) -> int:
    if any(is_bucket_url(p) for p in config.parents):
        from .parents.bucketparent import bucket_parents  # obstore is loaded only by servers that use a bucket

        t = config.timeouts
        async with bucket_parents(config.parents, endpoint=config.s3_endpoint, poll_interval=config.bucket_poll,
                                  heartbeat=t.heartbeat, read_timeout=t.read, write_timeout=t.write) as parents:
            return await _serve_app(dataclasses.replace(config, parents=parents), shown_parents=config.parents)
    return await _serve_app(config, shown_parents=config.parents)


async def _serve_app(config: ServerConfig, *, shown_parents: tuple[str, ...]) -> int:
    app = build_app(config)
    guard = ConnectionGuard(config.limits)
    runner = GuardedRunner(app, guard, handle_signals=False, access_log=None,
                           shutdown_timeout=max(0.1, config.timeouts.shutdown - 1.0), lingering_time=0.5)
    try:
        await runner.setup()
    except (OSError, DeltaSyncError) as e:
        log.error("cannot start: %s", e)
        return 1
    ssl_context = None
    if config.tls_cert is not None:
        from deltasync.tls import server_ssl_context
        try:
            ssl_context = server_ssl_context(config.tls_cert, config.tls_key)
        except DeltaSyncError as e:
            log.error("cannot start: %s", e)
            await runner.cleanup()
            return 1
    site = web.TCPSite(runner, config.host, config.port, backlog=1024, reuse_address=True, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e)
        await runner.cleanup()
        return 1
    host, port = runner.addresses[0][:2]
    shown = f"[{host}]" if ":" in host else host
    extra = f", parents {', '.join(shown_parents)}" if shown_parents else ""
    store = config.bucket.url if config.bucket is not None else config.store_dir
    scheme = "https" if ssl_context is not None else "http"
    log.info("%s listening on %s://%s:%d (store %s%s)", config.role, scheme, shown, port, store, extra)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    # whatever is still open when the budget is nearly spent is cut (a reader that stopped reading, an upload)
    budget = config.timeouts.shutdown
    cut = loop.call_later(max(budget * 0.5, budget - 1.5), lambda: guard.abort_all())
    try:
        async with asyncio.timeout(max(budget * 0.8, budget - 0.5)):  # the interpreter's exit takes the rest
            await runner.cleanup()
    except TimeoutError:
        log.warning("shutdown ran over %.0f s; exiting anyway", config.timeouts.shutdown)
    finally:
        cut.cancel()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltasync", description="deltasync origin and relay servers")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    return run_command(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
