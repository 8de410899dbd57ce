"""``deltasync publish``, ``deltasync subscribe`` and ``deltasync sidecar``.

``register(subparsers)`` adds them to the project's CLI (``cli/main.py``);
``python -m deltasync.client.cli COMMAND ...`` runs them standalone. Every command
takes ``--quiet``. Trust (docs/THREAT_MODEL.md): ``publish``/``sidecar`` sign with
``--signing-key`` (Ed25519 private key, PEM; ``deltasync keygen``), ``subscribe`` verifies
with ``--verify-key`` (the public key; repeatable for rotation) and refuses any manifest or
blob that does not verify; ``--key-file`` (a shared HMAC secret, hex) is the closed-deployment
alternative. ``--ca-file`` trusts a CA for https URLs; ``--read-token-file`` sends a read
token (origins and relays that require one). Exit codes:
0 success, 1 an error (printed on stderr), 2 bad usage, 130 interrupted.

Start-up: this module imports only argparse and the error tree; each command imports what it runs.
``publish`` from files (``--base``, or the first keyframe; no ``--budget``) reads the states as numpy
words over their memory maps (``MappedTensorFile.host``) and never imports torch; to a plain-HTTP origin,
a ``--base`` delta or a keyframe does not import aiohttp either (``client/plainhttp.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from deltasync.cli.options import blob_format_option
from deltasync.cli.run import run_command, settle_heap, small_pages
from deltasync.errors import BaseMismatchError, DeltaSyncError


if TYPE_CHECKING:  # each command imports what it runs: the parser (and `publish` from files) never loads torch
    import torch

    from deltasync.signing import Verifier

log = logging.getLogger("deltasync.client.cli")
timeline = logging.getLogger("deltasync.timeline")  # time.monotonic() stamps: benchmarks/step_timeline.py

META_MODEL = "deltasync.model"
META_VERSION = "deltasync.version"
META_STATE_FP = "deltasync.state_fp"


def _say(args, text: str) -> None:
    if not args.quiet:
        print(text, flush=True)


def _read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise DeltaSyncError(f"token file {path} is empty")
    return token


def _signer(args):
    from deltasync.keyfiles import signer_from_options

    return signer_from_options(getattr(args, "signing_key", None), args.key_file)


def _verifier(args, signer=None) -> Verifier | None:
    """The command's Verifier: --verify-key, else the signer's own public half, else --key-file."""
    from deltasync.keyfiles import verifier_from_options

    if getattr(args, "verify_key", None):
        return verifier_from_options(args.verify_key, None if getattr(args, "signing_key", None) else args.key_file)
    if signer is not None and hasattr(signer, "verifier"):
        return signer.verifier()
    return verifier_from_options((), args.key_file)


def _ssl(args):
    from deltasync.tls import client_ssl_context

    return client_ssl_context(getattr(args, "ca_file", None))


def _read_token_of(args) -> str | None:
    path = getattr(args, "read_token_file", None)
    return _read_token(path) if path else None


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def _setup_logging(args) -> None:
    level = logging.ERROR if args.quiet else (logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# -- publish ---------------------------------------------------------------------------------------

async def _head_state(url: str, model: str, verifier: Verifier | None, like: dict[str, torch.Tensor], timeout: float,
                      *, ssl=None, token: str | None = None):
    """The head version's state, rebuilt from the servers into tensors shaped like ``like``;
    None when the origin has no version or the layout differs."""
    import torch

    from .http import HttpClient
    from .subscriber import Subscriber

    client = HttpClient([url], ssl=ssl, read_token=token)
    try:
        head = await client.get_head(model)
    finally:
        await client.close()
    if head is None:
        return None
    target = {n: torch.empty_like(t) for n, t in like.items()}
    sub = Subscriber([url], model, target, verifier=verifier, use_squash=True, ssl=ssl, read_token=token)
    await sub.start()
    try:
        v = await sub.sync(timeout)
    except DeltaSyncError as e:
        log.warning("cannot rebuild %s v%s from the origin (%s); publishing a keyframe", model, head.version, e)
        return head.version, None
    finally:
        await sub.close()
    return v, (target, sub.fps)


def _policy(args):
    """The budget options of a command (None: a lossless stream)."""
    if getattr(args, "budget", None) is None:
        return None
    from deltasync.budget import BudgetPolicy
    try:
        return BudgetPolicy(bytes=args.budget, max_owed_steps=args.max_owed_steps, step_bits=args.step_bits)
    except ValueError as e:
        raise DeltaSyncError(f"bad budget options: {e}") from None


def _served_base(args, budgeter):
    """The served view kept in --state-dir, if it is the origin's head: (version, tensors, fps)."""
    if budgeter is None or not args.state_dir:
        return None
    from .http import HttpClient
    from .served import load_served

    async def head():
        async with HttpClient([args.origin], ssl=_ssl(args), read_token=_read_token(args.token_file)) as h:
            return await h.get_head(args.model)
    from deltasync.manifest import parse_manifest
    h = asyncio.run(head())
    if h is None:
        return None
    got = load_served(Path(args.state_dir) / "served.safetensors", args.model, h.version,
                      parse_manifest(h.body, verifier=_verifier(args, _signer(args))).state_fp, budgeter)
    return None if got is None else (h.version, got[0], got[1])


async def _publish_files(args, token: str, signer, verifier: Verifier | None, state, base, base_error) -> int | None:
    """Publish from files, O(changed): a keyframe streamed shard by shard when the origin has no version
    (or ``--base`` is not its head and ``--keyframe-on-mismatch`` says so), else a delta against ``--base``.
    None: no ``--base`` and the origin has a head (the caller rebuilds the head state from the servers).
    ``base``: the mapped ``--base`` file's host words (None: no ``--base``, or ``base_error`` says why it could
    not be mapped; that is raised only if the origin has a head to diff against).

    With ``--base`` of the state's layout, the compare pass starts first (it needs only the two maps) and
    runs on the pool while the HTTP client is imported and the origin's head is read; its result is
    checked against that head before anything is encoded or sent."""
    from .filepublish import compare_pool, start_compare

    options = None
    if base is not None:  # the codec (and numba with it, ~0.2 s) only for a delta: a keyframe needs neither yet
        from deltasync.codec import EncodeOptions, same_layout

        options = EncodeOptions(coding=args.coding, format=args.blob_format)
    async with contextlib.AsyncExitStack() as stack:
        pool = stack.enter_context(compare_pool())
        compared = None
        if base is not None and same_layout(base, state):
            compared = start_compare(base, state, options=options, executor=pool)
            timeline.debug("mono=%.6f publish-compare-started", time.monotonic())
            stack.push_async_callback(_settled, compared)  # before the pool and the maps close
        return await _publish_files_to(args, token, signer, verifier, state, base, base_error, compared, pool, options)


def _plain_origin(url: str) -> bool:
    """Whether ``publish`` reads the head and sends a delta through ``client/plainhttp.py`` (a plain-HTTP origin;
    ``DELTASYNC_PUBLISH_HTTP=aiohttp`` sends everything through aiohttp, as before)."""
    from .plainhttp import supports

    return supports(url) and os.environ.get("DELTASYNC_PUBLISH_HTTP", "").lower() != "aiohttp"


def _http_client_for(urls: list[str]):
    """``client.http.HttpClient``, importing aiohttp for talking to ``urls``.

    aiohttp builds two default TLS contexts when it is imported, loading the system's CA store into each
    (~0.09 CPU-s of a cold ``publish``). When no URL is https they are never used (plain HTTP, and a
    publish talks to its origin only), so while aiohttp is imported here they are built without the store:
    ``ssl.SSLContext.load_default_certs`` and ``set_default_verify_paths`` do nothing for that moment and are
    put back right after (contexts made later are as usual). With any https URL, or aiohttp already
    imported, it is a plain import."""
    if "aiohttp" in sys.modules or any(u.lower().startswith("https:") for u in urls):
        from .http import HttpClient

        return HttpClient
    import ssl

    cls = ssl.SSLContext
    names = ("load_default_certs", "set_default_verify_paths")
    own = {n: cls.__dict__[n] for n in names if n in cls.__dict__}
    cls.load_default_certs = lambda self, purpose=None: None
    cls.set_default_verify_paths = lambda self: None
    try:
        from .http import HttpClient
    finally:
        for n in names:
            if n in own:
                setattr(cls, n, own[n])
            else:
                delattr(cls, n)
    return HttpClient


async def _settled(fut: asyncio.Future) -> None:
    """Wait for a compare pass that was not used (an error, or no head to diff against) to end."""
    await asyncio.wait([fut])
    if not fut.cancelled():
        fut.exception()  # retrieved: its error, if any, is not the command's


async def _publish_files_to(args, token: str, signer, verifier: Verifier | None, state, base, base_error, compared, pool,
                            options) -> int | None:
    from deltasync.manifest import parse_manifest

    from .filepublish import check_base_file, publish_delta, publish_keyframe
    from .streams import keyframe_stream

    async with contextlib.AsyncExitStack() as stack:
        # a plain-HTTP origin is spoken to without aiohttp (client/plainhttp.py: its import alone is ~0.1 s of the
        # command's start, and ~0.25 CPU-s in the middle of a delta's compare pass): the head, a delta, a keyframe
        # (the pieces of the mapped file, never joined)
        if _plain_origin(args.origin):
            from .plainhttp import PlainOrigin

            client = await stack.enter_async_context(PlainOrigin(args.origin, token=token, read_token=token))
        else:
            client = await stack.enter_async_context(
                _http_client_for([args.origin])([args.origin], token=token, ssl=_ssl(args), read_token=token))

        try:
            head = await client.get_head(args.model)
        except DeltaSyncError as e:
            raise DeltaSyncError(f"cannot read {args.model}'s head from {args.origin}: {e}") from e
        timeline.debug("mono=%.6f publish-head", time.monotonic())
        if head is None and args.base:
            _say(args, f"the origin has no version of {args.model}; publishing a keyframe (--base is not used)")
        if head is not None and not args.base:
            return None
        step = args.step if args.step is not None else (0 if head is None else head.version + 1)
        if head is not None and step <= head.version:
            print(f"deltasync publish: error: step {step} is not after the origin's head v{head.version}", file=sys.stderr)
            return 1
        delta = False
        side_error = None
        if head is not None:
            m = parse_manifest(head.body, verifier=verifier, records=None)  # its version and state fingerprints: no table
            where = f"--base {args.base}"
            if base_error is not None:
                raise base_error
            try:
                if compared is None:  # no delta; a wrong base is still an error
                    check_base_file(base, m, where=where)
                    _say(args, f"{args.state} holds other tensors than v{head.version} (names, dtypes or "
                               "shapes); publishing a keyframe")
                else:  # the base is checked against the head in the compare pass, before anything is sent
                    res = await publish_delta(client, model=args.model, version=step, parent=head.version,
                                              base=base, state=state, head=m, where=where, signer=signer,
                                              options=options, compared=compared, executor=pool)
                    delta = True
            except BaseMismatchError as e:
                if not args.keyframe_on_mismatch:
                    raise BaseMismatchError(f"{e}; pass the file v{head.version} was published from (e.g. the "
                                            "last `subscribe --out` file), or --keyframe-on-mismatch to publish "
                                            "a keyframe instead") from None
                _say(args, f"{e}; publishing a keyframe (--keyframe-on-mismatch)")
        if not delta:
            res = await publish_keyframe(client, model=args.model, version=step, state=state,
                                         signer=signer)
            side = 0
        else:
            side = 0
            if args.keyframe:
                try:
                    side = (await publish_keyframe(client, model=keyframe_stream(args.model),
                                                   version=step, state=state, signer=signer)).blob_bytes
                except DeltaSyncError as e:
                    side_error = f"{type(e).__name__}: {e}"
    args.published_version = step
    pct = 100.0 * res.blob_bytes / max(res.raw_bytes, 1)
    extra = f" + side keyframe {_mb(side)}" if side else ""
    _say(args, f"published {args.model} v{step}: {res.manifest.kind}, {_mb(res.blob_bytes)} ({pct:.2f}% of "
               f"{_mb(res.raw_bytes)}){extra}, {res.changed:,} words changed")
    _side_failed(args, step, side_error)
    return 0


def _publish_serving(args) -> int:
    """``--serve-format``: once ``args.model`` v``step`` is live, the same state in each serving format as its own
    stream (``MODEL.fp8``, ``MODEL.int4``: client/serving.py), version ``step`` too. A delta against the stream's
    head when the head is the base's serving state (``--base`` quantized the same way, checked against the head's
    signed state fingerprint; without ``--base`` the head rebuilt from the servers), else a keyframe. Exit 1 if a
    serving stream fails (the bf16 version is live: said on stderr)."""
    from deltasync.codec import EncodeOptions
    from deltasync.fingerprint import fingerprint_state, state_fingerprint_of
    from deltasync.manifest import parse_manifest
    from deltasync.quant import ServingDeriver, ServingFormat
    from deltasync.tensorfile import MappedTensorFile

    from .http import HttpClient
    from .publisher import Publisher
    from .serving import serving_meta, serving_model

    step = args.published_version
    token = _read_token(args.token_file)
    signer = _signer(args)
    verifier = _verifier(args, signer)

    async def head_of(name: str):
        async with HttpClient([args.origin], token=token, ssl=_ssl(args), read_token=token) as h:
            return await h.get_head(name)

    failed = []
    with MappedTensorFile(args.state) as state_file, contextlib.ExitStack() as stack:
        state = state_file.tensors
        base_state = stack.enter_context(MappedTensorFile(args.base)).tensors if args.base else None
        for name_ in args.serve_format:
            fmt = ServingFormat(name=name_)
            name = serving_model(args.model, fmt)
            try:
                deriver = ServingDeriver(fmt)
                head = asyncio.run(asyncio.wait_for(head_of(name), args.timeout))
                base = None
                if head is not None and head.version >= step:
                    raise DeltaSyncError(f"the origin already has {name} v{head.version}")
                if head is not None and base_state is not None:
                    # the base's serving state, copied: the deriver updates its tensors in place on the next call
                    qbase = {n: t.clone() for n, t in deriver.derive(base_state).items()}
                    fps = fingerprint_state(qbase)
                    want = parse_manifest(head.body, verifier=verifier).state_fp
                    if state_fingerprint_of(qbase, fps) == want:
                        base = (head.version, qbase, fps)
                    else:
                        _say(args, f"{args.base} in {fmt.name} is not {name} v{head.version}; publishing a keyframe")
                qnew = deriver.derive(state)
                if head is not None and base_state is None:
                    got = asyncio.run(_head_state(args.origin, name, verifier, qnew, args.timeout, ssl=_ssl(args),
                                                  token=token))
                    if got is not None and got[1] is not None:
                        base = (got[0], got[1][0], got[1][1])
                pub = Publisher(args.origin, name, token, signer, keyframe_every=0, base=base, check_origin=False,
                                ssl=_ssl(args), options=EncodeOptions(coding=args.coding, format=args.blob_format))
                try:
                    res = pub.publish(step, qnew, keyframe=False, meta=serving_meta(args.model, fmt)).result(args.timeout)
                    pub.flush(args.timeout)
                finally:
                    pub.close()
                _say(args, f"published {name} v{res.version}: {res.kind}, {_mb(res.blob_bytes)} ({fmt.name}), "
                           f"{res.changed:,} words changed")
            except (DeltaSyncError, OSError, ValueError, TimeoutError) as e:
                failed.append(name)
                print(f"deltasync publish: error: {name} v{step} was not published ({type(e).__name__}: {e}); "
                      f"{args.model} v{step} is live", file=sys.stderr, flush=True)
    return 1 if failed else 0


def _side_failed(args, version: int, error: str | None) -> None:
    """The version is live but its side keyframe was not committed: say both (stderr, even with --quiet)."""
    if error is None:
        return
    print(f"deltasync publish: warning: {args.model} v{version} is live, but its side keyframe "
          f"{args.model}.kf v{version} was not committed ({error}); subscribers still get v{version} (from an "
          f"older keyframe and the chain). The origin deletes the uploaded side blobs after its orphan grace.",
          file=sys.stderr, flush=True)


def _warm_up_kernels() -> threading.Thread:
    """Start getting the compiled kernels ready (numba's import and runtime: ``kernels.warm_up``) on a thread of
    its own, so that it overlaps reading the options, keys and files instead of delaying the first compare.
    (Loading the delta's own kernels there too, by coding a tiny delta of the state's dtypes while the compare
    runs, measured no gain: 6% slower in 12 interleaved pairs on this 2-core machine; nor for the columnar
    kernels of a 70k-tensor delta, coded from the command's start: within the noise, 6 pairs.)"""

    def warm() -> None:
        try:
            from deltasync import kernels

            kernels.warm_up()
        except Exception as e:  # the first kernel call meets the same problem and reports it
            log.debug("kernel warm-up failed: %s: %s", type(e).__name__, e)

    t = threading.Thread(target=warm, name="deltasync-warm-up", daemon=True)
    t.start()
    return t


def cmd_publish(args) -> int:
    if args.base:
        small_pages()  # a delta's diff and encode: fresh arrays written sparsely (before any thread imports numpy)
    warming = _warm_up_kernels()
    try:
        rc = _cmd_publish(args)
        if rc == 0 and args.serve_format:
            rc = _publish_serving(args)
        return rc
    finally:
        if warming.is_alive():
            warming.join(60)  # an early error return: not while the thread is inside an import (interpreter exit)


def prefault_on_thread(files, stamp: str | None = None) -> threading.Thread:
    """The mapped files' pages entered into the maps' page tables on a thread (``MappedTensorFile.prefault``:
    the GIL is released), while the main thread imports the codec: the compare pass then takes no page fault.
    ``publish`` and ``diff`` use it; join the thread before the maps close. ``stamp``: a timeline stamp when done."""

    def run() -> None:
        for f in files:
            f.prefault()
        if stamp:
            timeline.debug("mono=%.6f %s", time.monotonic(), stamp)

    t = threading.Thread(target=run, name="deltasync-prefault", daemon=True)
    t.start()
    return t


def _cmd_publish(args) -> int:
    _setup_logging(args)
    if os.environ.get("DELTASYNC_TIMELINE"):  # this command's stamps (benchmarks/step_timeline.py)
        timeline.setLevel(logging.DEBUG)
        timeline.debug("mono=%.6f publish-start", time.monotonic())
    # the command ends when it returns: every upload and the commit are awaited (and the Publisher closed)
    # first, so run_command may skip the interpreter's teardown (cli/run.py: ``exit_now``)
    args.exit_now = True
    token = _read_token(args.token_file)
    signer = _signer(args)
    verifier = _verifier(args, signer)
    policy = _policy(args)
    if policy is not None and not args.state_dir:
        print("deltasync publish: error: --budget needs --state-dir (where the served view is kept)", file=sys.stderr)
        return 2
    if policy is not None and args.base:
        print("deltasync publish: error: --base and --budget exclude each other (a budgeted stream's base is the "
              "served view kept in --state-dir)", file=sys.stderr)
        return 2
    if policy is not None and args.coding != "base-free":
        print(f"deltasync publish: error: --coding {args.coding} and --budget exclude each other", file=sys.stderr)
        return 2
    if args.keyframe_on_mismatch and not args.base:
        print("deltasync publish: error: --keyframe-on-mismatch needs --base", file=sys.stderr)
        return 2
    if args.serve_format and policy is not None:
        print("deltasync publish: error: --serve-format and --budget exclude each other here (budgeted serving "
              "streams: the sidecar's --serve-format or the in-process Publisher(serve=...))", file=sys.stderr)
        return 2
    if args.serve_format and len(set(args.serve_format)) != len(args.serve_format):
        print("deltasync publish: error: a --serve-format is listed twice", file=sys.stderr)
        return 2
    from deltasync.tensorfile import MappedTensorFile, check_published

    state_file = MappedTensorFile(args.state)
    check_published(state_file.metadata, args.state)  # a `subscribe --out` file caught mid-apply: refused
    if policy is None:
        base_file = base_error = None
        if args.base:
            try:
                base_file = MappedTensorFile(args.base)
                check_published(base_file.metadata, args.base)
            except (OSError, DeltaSyncError) as e:  # raised only if the origin has a head to diff against
                base_error = e
        for f in (base_file, state_file):
            if f is not None:
                f.host  # the maps' header entries and views, made now: long-lived, out of the collector's way
        settle_heap()
        prefaulting = prefault_on_thread([f for f in (base_file, state_file) if f is not None], "publish-prefaulted")
        try:
            done = asyncio.run(asyncio.wait_for(
                _publish_files(args, token, signer, verifier, state_file.host,
                               base_file.host if base_file is not None else None, base_error), args.timeout))
        finally:
            prefaulting.join()  # before the maps may close
            if base_file is not None:
                base_file.close()
        if done is not None:
            return done
        log.info("no --base: rebuilding %s's head state from %s to diff against (pass --base to skip that)",
                 args.model, args.origin)
    state = state_file.tensors  # torch from here on (the head rebuilt from the servers, or a budget)
    from deltasync.budget import Budgeter
    from deltasync.codec import EncodeOptions

    from .publisher import Publisher
    from .served import save_served

    budgeter = Budgeter(policy) if policy is not None else None
    base = _served_base(args, budgeter)
    head_v = base[0] if base is not None else None
    try:
        got = None if base is not None else asyncio.run(_head_state(args.origin, args.model, verifier, state, args.timeout,
                                                                     ssl=_ssl(args), token=token))
    except DeltaSyncError as e:
        raise DeltaSyncError(f"cannot read {args.model}'s head from {args.origin}: {e}") from e
    if got is not None:
        head_v, rebuilt = got
        if rebuilt is not None:
            base = (head_v, rebuilt[0], rebuilt[1])
    step = args.step if args.step is not None else (0 if head_v is None else head_v + 1)
    if head_v is not None and step <= head_v:
        print(f"deltasync publish: error: step {step} is not after the origin's head v{head_v}", file=sys.stderr)
        return 1
    if base is None and head_v is not None:
        _say(args, f"origin has v{head_v} but its state could not be rebuilt here; publishing a keyframe")
    pub = Publisher(args.origin, args.model, token, signer, keyframe_every=0, base=base, check_origin=False,
                    budget=policy, ssl=_ssl(args), options=EncodeOptions(coding=args.coding, format=args.blob_format))
    if budgeter is not None and pub.budgeter is not None:
        pub.budgeter.load_ledger(budgeter.ledger_state())  # what the served view in --state-dir still owes
    try:
        pending = pub.publish(step, state, keyframe=args.keyframe and base is not None)
        res = pending.result(args.timeout)
        pub.flush(args.timeout)
        if policy is not None:
            Path(args.state_dir).mkdir(parents=True, exist_ok=True)
            save_served(Path(args.state_dir) / "served.safetensors", pub.served, args.model, res.version, pub.budgeter)
    finally:
        pub.close()
    args.published_version = res.version
    pct = 100.0 * res.blob_bytes / max(res.raw_bytes, 1)
    side = f" + side keyframe {_mb(res.side_bytes)}" if res.side_keyframe else ""
    _say(args, f"published {args.model} v{res.version}: {res.kind}, {_mb(res.blob_bytes)} ({pct:.2f}% of "
               f"{_mb(res.raw_bytes)}){side}, {res.changed:,} words changed")
    _side_failed(args, res.version, res.side_error)
    r = res.residual
    if r is not None:
        _say(args, f"budget {r.budget:,} bytes: sent {r.wire_bytes:,}; still owed {r.owed:,} words "
                   f"({100 * r.owed_fraction:.2f}%, {r.owed_bytes:,} bytes), max {r.max_ulps} ULPs, max age {r.max_age}")
    return 0


# -- subscribe -------------------------------------------------------------------------------------

def _file_options(args, verifier: Verifier | None, on_applied: Callable[[int], None] | None):
    from .fileout import FileOptions
    from .http import Timeouts

    timeouts = Timeouts(poll=args.poll, connect=args.connect_timeout, ttfb=args.ttfb_timeout, read=args.read_timeout,
                        hedge_after=args.hedge_after or None, min_rate=args.min_rate, rate_grace=args.rate_grace)
    return FileOptions(sources=list(args.sources), model=args.model, out=Path(args.out), timeouts=timeouts,
                       verifier=verifier, once=args.once, until=args.until, timeout=args.timeout,
                       deadline=args.deadline, scrub_every=args.scrub_every, ssl=_ssl(args),
                       read_token=_read_token_of(args), exit_now=args.exit_now, say=lambda text: _say(args, text),
                       on_applied=on_applied)


async def _subscribe(args, verifier: Verifier | None, on_applied: Callable[[int], None] | None) -> int:
    from .fileout import follow_file

    outcome = await follow_file(_file_options(args, verifier, on_applied))
    if outcome.message is not None:
        if outcome.status:
            print(f"deltasync subscribe: {outcome.message}", file=sys.stderr)
        else:
            _say(args, outcome.message)
    return outcome.status


def cmd_subscribe(args, *, on_applied: Callable[[int], None] | None = None) -> int:
    """``deltasync subscribe``. ``on_applied(version)``, for programs that embed the command, runs once
    each version is downloaded, decoded and checked, just before it is written into the file (tests use it
    to die there: the file is then still the version before, untouched)."""
    _setup_logging(args)
    small_pages()  # its applies: fresh arrays written sparsely
    if args.once and args.until is not None:
        print("deltasync subscribe: error: --once and --until exclude each other", file=sys.stderr)
        return 2
    if args.signing_key:
        print("deltasync subscribe: error: a subscriber holds no signing key; give the public key (--verify-key)",
              file=sys.stderr)
        return 2
    if os.environ.get("DELTASYNC_TIMELINE"):  # benchmarks/step_timeline.py: this process's critical-path stamps
        timeline.setLevel(logging.DEBUG)
        timeline.debug("mono=%.6f sub-start", time.monotonic())
    # --once/--until end the process: once the file is written and closed, run_command may skip the
    # interpreter's teardown (see cli/run.py: ``exit_now``)
    args.exit_now = args.once or args.until is not None
    # --timeout bounds the whole command with --once/--until: the first keyframe's stream and every read too
    args.deadline = time.monotonic() + args.timeout if args.exit_now else None
    return asyncio.run(_bounded_subscribe(args, _verifier(args), on_applied))


async def _bounded_subscribe(args, verifier: Verifier | None, on_applied: Callable[[int], None] | None) -> int:
    """``_subscribe`` within the command's deadline (``--once``/``--until``): the main loop reports a miss with the
    last error; this bound, a second later, ends whatever part was still waiting then (a keyframe's stream, a
    head read) with the same exit status."""
    if args.deadline is None:
        return await _subscribe(args, verifier, on_applied)
    try:
        async with asyncio.timeout(max(0.0, args.deadline - time.monotonic()) + 1.0):
            return await _subscribe(args, verifier, on_applied)
    except TimeoutError:
        print(f"deltasync subscribe: error: not done after {args.timeout:.0f}s (--timeout)", file=sys.stderr)
        return 1


# -- sidecar ----------------------------------------------------------------------------------------

def cmd_sidecar(args) -> int:
    from .sidecar import Sidecar, SidecarEvent

    _setup_logging(args)
    token = _read_token(args.token_file)
    signer = _signer(args)
    if not Path(args.watch).is_dir():
        print(f"deltasync sidecar: error: {args.watch} is not a directory", file=sys.stderr)
        return 1

    def on_event(ev: SidecarEvent) -> None:
        if ev.kind in ("skipped", "error"):
            print(f"deltasync sidecar: {ev.kind} {ev.path}: {ev.detail}", file=sys.stderr, flush=True)
        else:
            _say(args, f"{ev.kind} {Path(ev.path).name}" + (f": {ev.detail}" if ev.detail else ""))

    car = Sidecar(args.watch, args.origin, args.model, token, signer, keyframe_every=args.keyframe_every,
                  delete_published=args.delete_published, marker=args.marker, poll=args.poll,
                  state_file=args.state_file, on_event=on_event, budget=_policy(args), ssl=_ssl(args),
                  coding=args.coding, blob_format=args.blob_format, serve=tuple(args.serve_format or ()))

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await car.run(stop, once=args.once)
        return 0

    return asyncio.run(main())


# -- wiring ---------------------------------------------------------------------------------------------

def _sources(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="M", help="model stream name")
    p.add_argument("--key-file", metavar="F",
                   help="shared HMAC key (hex), closed deployments only: whoever holds it can sign")
    p.add_argument("--signing-key", metavar="PEM",
                   help="publish/sidecar: the Ed25519 private key that signs versions (deltasync keygen)")
    p.add_argument("--verify-key", action="append", default=[], metavar="PEM",
                   help="the publisher's Ed25519 public key; manifests and blobs must verify (repeat: key set)")
    p.add_argument("--ca-file", metavar="PEM", help="trust only these CAs for https URLs (default: system store)")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing but errors")


def _serve_format_option(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--serve-format", action="append", choices=("fp8-block", "int4"), metavar="FMT", help=help)


def _coding_option(p: argparse.ArgumentParser, *, history: bool = False) -> None:
    if not history:  # one command, one version: it keeps no history of the deltas before
        p.add_argument("--coding", choices=("base-free", "base-conditioned"), default="base-free",
                       help="how deltas are coded: base-free (default; relays squash chains) or base-conditioned "
                            "(~30%% smaller on AdamW steps; decoding reads each changed chunk of the base, and relays "
                            "cannot squash the stream: subscribers walk its chain; docs/FORMAT.md §4.4); the "
                            "history coding needs a publisher that keeps running: `deltasync sidecar`")
    else:
        p.add_argument("--coding", choices=("auto", "base-free", "base-conditioned", "history"), default="auto",
                       help="how deltas are coded: history (positions modelled by the deltas since the last "
                            "keyframe, which this sidecar and every subscriber keep: ~15-25%% smaller once a few "
                            "deltas are out, O(changed) at both ends; relays cannot squash it; docs/FORMAT.md §4.5), "
                            "base-free (relays squash chains for late joiners) or base-conditioned (§4.4); auto "
                            "(default): history with --signing-key (Ed25519: relays cannot sign a squash anyway) "
                            "and no --budget, else base-free")
    blob_format_option(p)



def _budget_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=int, metavar="BYTES",
                   help="cap each delta at BYTES on the wire (manifest + blobs); what does not fit is owed and sent "
                        "first later (default: lossless)")
    p.add_argument("--max-owed-steps", type=int, default=8, metavar="K",
                   help="with --budget: a word owed K versions in a row is sent next, ahead of any rank (default 8)")
    p.add_argument("--step-bits", type=int, default=0, metavar="B",
                   help="with --budget: round steps that do not fit to B significant bits (default 0: exact)")


def register(subparsers) -> None:
    """Add ``publish``, ``subscribe`` and ``sidecar`` to an argparse subparsers object."""
    p = subparsers.add_parser("publish", help="publish one state file to the origin (a delta when it can)",
                              description="Publish one safetensors state as the next version: a delta against "
                                          "--base (a local file holding the origin's head), or against the head "
                                          "rebuilt from the servers without --base; else a keyframe.")
    p.add_argument("--origin", required=True, metavar="URL", help="origin server URL")
    p.add_argument("--token-file", required=True, metavar="F", help="file holding the origin's bearer token")
    _sources(p)
    p.add_argument("state", metavar="STATE.safetensors", help="the state to publish")
    p.add_argument("--step", type=int, metavar="N", help="version number (default: the origin's head + 1, or 0)")
    p.add_argument("--keyframe", action="store_true", help="also publish a keyframe of this state (side stream)")
    p.add_argument("--base", metavar="PREV.safetensors",
                   help="the state the origin's head holds (e.g. the previous checkpoint, or a `subscribe --out` "
                        "file): the delta is diffed against it, mapped, without downloading the model; its state "
                        "fingerprint must equal the head's")
    p.add_argument("--keyframe-on-mismatch", action="store_true",
                   help="with --base: when the base is not the origin's head, publish a keyframe instead of failing")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="give up after S seconds (default 600)")
    _budget_options(p)
    _coding_option(p)
    p.add_argument("--state-dir", metavar="DIR", help="with --budget: where the served view and what it owes are kept")
    _serve_format_option(p, "also publish the state in this serving format once MODEL's version is live, as the "
                            "stream MODEL.fp8 (fp8-block: DeepSeek/vLLM FP8 blocks) or MODEL.int4 (compressed-"
                            "tensors INT4 pack-quantized), a delta against its head when --base (quantized the "
                            "same way) or the rebuilt head is that head; repeatable")
    p.set_defaults(func=cmd_publish)

    s = subparsers.add_parser("subscribe", help="keep a safetensors file in sync with a model stream",
                              description="Follow a model stream through relays and keep a safetensors file at its "
                                          "head (patched in place behind an undo journal after each verified version: always one "
                                          "published version, even after a kill; see docs/CLIENT.md).")
    s.add_argument("--from", dest="sources", required=True, action="append", metavar="URL",
                   help="relay or origin URL; repeat for fallbacks, nearest first")
    _sources(s)
    s.add_argument("--out", required=True, metavar="FILE.safetensors", help="the file to keep in sync")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--once", action="store_true", help="catch up to the current head, write, exit 0")
    g.add_argument("--until", type=int, metavar="VERSION", help="exit 0 once VERSION (or newer) is written")
    s.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="with --once/--until: exit 1 if not there after S seconds (default 300)")
    s.add_argument("--poll", type=float, default=20.0, metavar="S", help="long-poll duration (default 20)")
    s.add_argument("--connect-timeout", type=float, default=5.0, metavar="S", help="TCP connect limit (default 5)")
    s.add_argument("--ttfb-timeout", type=float, default=10.0, metavar="S",
                   help="a source that sends no status line for S seconds is failed over (default 10; long-polls "
                        "get --poll plus this)")
    s.add_argument("--read-timeout", type=float, default=30.0, metavar="S",
                   help="silence on a connection that has answered before it counts as dead (default 30)")
    s.add_argument("--hedge-after", type=float, default=2.0, metavar="S",
                   help="a read with no answer after S seconds also asks the next --from in parallel (default 2; "
                        "0: never)")
    s.add_argument("--min-rate", type=float, default=64 << 10, metavar="BYTES_PER_S",
                   help="a source whose body (blob, manifest, head) averages under this many bytes per second once "
                        "--rate-grace has passed is failed over mid-body: the rest comes from the next --from "
                        "(default 65536)")
    s.add_argument("--rate-grace", type=float, default=10.0, metavar="S",
                   help="seconds a body may take before --min-rate applies (default 10)")
    s.add_argument("--read-token-file", metavar="F", help="file holding a read token (servers that require one)")
    s.add_argument("--scrub-every", type=int, default=0, metavar="N",
                   help="re-fingerprint every tensor every N applies (default: never; incremental checks always run)")
    s.set_defaults(func=cmd_subscribe)

    c = subparsers.add_parser("sidecar", help="publish every checkpoint a trainer writes into a folder",
                              description="Watch a folder for safetensors checkpoints (step number in the name; "
                                          "complete once renamed into place, or once a marker file exists) and "
                                          "publish each as a delta against the previous one.")
    c.add_argument("--watch", required=True, metavar="DIR", help="folder the trainer writes checkpoints into")
    c.add_argument("--origin", required=True, metavar="URL", help="origin server URL")
    c.add_argument("--token-file", required=True, metavar="F", help="file holding the origin's bearer token")
    _sources(c)
    c.add_argument("--keyframe-every", type=int, default=20, metavar="K", help="side keyframe every K steps (0: never)")
    c.add_argument("--delete-published", action="store_true",
                   help="delete a checkpoint once its successor is published")
    c.add_argument("--marker", metavar="SUFFIX",
                   help="a checkpoint counts only once NAME+SUFFIX exists (e.g. .done); default: any renamed file")
    c.add_argument("--poll", type=float, default=1.0, metavar="S", help="scan the folder every S seconds")
    c.add_argument("--state-file", metavar="F", help="where to keep resume state (default DIR/.deltasync-sidecar.json)")
    c.add_argument("--once", action="store_true", help="publish what is there now, then exit")
    _serve_format_option(c, "also publish each checkpoint in this serving format, as the stream MODEL.fp8 "
                            "(fp8-block: DeepSeek/vLLM FP8 blocks) or MODEL.int4 (compressed-tensors INT4 "
                            "pack-quantized); repeatable")
    _budget_options(c)
    _coding_option(c, history=True)
    c.set_defaults(func=cmd_sidecar)


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser: ``publish``, ``subscribe`` and ``sidecar``."""
    parser = argparse.ArgumentParser(prog="deltasync", description="deltasync publish / subscribe / sidecar")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
