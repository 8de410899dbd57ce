"""``subscribe --out``: a safetensors file that follows a stream, as a library (the command is a thin shell over it).

:func:`follow_file` runs the four phases of a file subscriber:

1. **recovery**: a run killed mid-apply left an undo journal: the file goes back to exactly the version before,
   before anything reads it (:func:`deltasync.client.filetarget.recover`); temporary files of a killed run go;
2. **the file as found**: a file this stream wrote resumes at its version; anything else is replaced;
3. **the first version**, for a new file: the highest head any source can prove (a long-poll while the model has
   none yet), streamed into a new file shard by shard when it is a keyframe or has a side keyframe at the same
   state (:func:`stream_keyframe`), renamed into place only once complete and verified;
4. **the apply loop**: a :class:`~deltasync.client.subscriber.Subscriber` patches the file in place, journaled,
   until ``until`` (or, with ``once``, the newest version a source proves when it starts), a signal or the
   deadline; a signal or the deadline mid-apply rolls the step back (:mod:`deltasync.client.interrupt`).

The outcome is a :class:`FileOutcome` (an exit status, the version the file holds, a message), so the command
and tests read the same thing; progress lines go to ``FileOptions.say``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deltasync.errors import ApplyInterrupted, DeltaSyncError, NotFoundError

from .interrupt import Interrupt

if TYPE_CHECKING:
    import ssl as ssl_module

    from deltasync.manifest import Manifest
    from deltasync.signing import Verifier

    from .filetarget import FileTarget
    from .http import HttpClient, Timeouts

__all__ = ["FileOptions", "FileOutcome", "follow_file", "stream_keyframe"]

log = logging.getLogger("deltasync.client.fileout")
timeline = logging.getLogger("deltasync.timeline")  # time.monotonic() stamps: benchmarks/step_timeline.py

#: a keyframe's shards received side by side (each into its own place in the new file)
KEYFRAME_SHARDS_AT_ONCE = 8


@dataclass(frozen=True, kw_only=True)
class FileOptions:
    """What a file subscriber follows and how (the command's options, parsed)."""

    sources: Sequence[str]  # base URLs, most preferred first
    model: str
    out: Path
    timeouts: Timeouts
    verifier: Verifier | bytes | None = None  # what every manifest must verify with
    once: bool = False  # end at the newest version a source proves at start
    until: int | None = None  # end once the file holds this version (or newer)
    timeout: float = 0.0  # seconds, for messages: the bound ``deadline`` was computed from
    deadline: float | None = None  # time.monotonic() past which the run ends (an apply in progress rolls back)
    scrub_every: int = 0
    ssl: ssl_module.SSLContext | None = None
    read_token: str | None = None
    exit_now: bool = False  # a signal with nothing in progress: status 130 (the command exits at once) else 0
    say: Callable[[str], None] = lambda text: None  # progress lines
    # runs once each version is downloaded, decoded and checked, just before it is written (tests die there)
    on_applied: Callable[[int], None] | None = None


@dataclass(frozen=True, kw_only=True)
class FileOutcome:
    status: int  # 0 done, 1 an error or the deadline, 130 a signal
    version: int | None  # what the file holds
    message: str | None = None  # for the error stream when status != 0 (or a signal's note)


def _recover(opts: FileOptions) -> None:
    from deltasync.atomic import remove_temp_files

    from .filetarget import recover

    opts.out.parent.mkdir(parents=True, exist_ok=True)
    remove_temp_files(opts.out)  # a killed earlier run's; only one subscriber writes a file
    rolled = recover(opts.out)  # an apply cut short: F back to exactly the old version, before anything reads it
    if rolled is not None:
        opts.say(f"{opts.out}: rolled back the unfinished v{rolled.get('to')} to v{rolled.get('from')} (undo journal)")


def _existing(opts: FileOptions) -> FileTarget | None:
    """The file as found: a FileTarget resuming at its version, or None (absent, unreadable, another stream's)."""
    from .filetarget import FileTarget

    if not opts.out.exists():
        return None
    try:
        target = FileTarget(opts.out, opts.model, before_write=opts.on_applied)
    except (DeltaSyncError, OSError) as e:
        opts.say(f"{opts.out}: unreadable ({e}); resyncing from a keyframe")
        return None
    if target.version is None:
        opts.say(f"{opts.out}: not a {opts.model} file written by deltasync subscribe; resyncing")
        target.close()
        return None
    opts.say(f"{opts.out}: holds {opts.model} v{target.version}; resuming")
    return target


async def _first_head(opts: FileOptions, client: HttpClient):
    """The highest head any source proves; without ``once``, waits (long-polls) while the model has none yet."""
    deadline = opts.deadline if opts.deadline is not None else time.monotonic() + opts.timeout
    head = await client.highest_head(opts.model)  # not an old head one source replays
    while head is None and not opts.once and (left := deadline - time.monotonic()) > 0:
        # the model has no version yet: wait for the first, woken by its commit (a long-poll; a server of an
        # older build refuses after=-1: then ask again every 0.25 s)
        try:
            head = await client.get_head(opts.model, after=-1, wait=min(left, opts.timeouts.poll))
        except DeltaSyncError as e:
            log.debug("long-poll for the first version refused (%s); polling", e)
            await asyncio.sleep(0.25)
            head = await client.get_head(opts.model)
        else:
            if head is not None and head.body is None:  # the long-poll ran out (204)
                head = None
    return head


async def _first_version(opts: FileOptions) -> FileTarget:
    """A new file at the first version: laid out from the head (or its first keyframe), streamed in when a
    keyframe is at hand; nothing is written until that keyframe is complete and verified."""
    from deltasync.manifest import parse_manifest, record_columns

    from .filetarget import FileTarget, KeyframeWriter
    from .http import HttpClient

    # a head that does not parse or verify is that source's fault: the next source is tried
    client = HttpClient(list(opts.sources), timeouts=opts.timeouts, ssl=opts.ssl, read_token=opts.read_token,
                        check_manifest=lambda body: parse_manifest(body, verifier=opts.verifier))
    warm = asyncio.get_running_loop().run_in_executor(None, KeyframeWriter.warm)  # while nothing arrives yet
    try:
        head = await _first_head(opts, client)
        timeline.debug("mono=%.6f kf-seen", time.monotonic())
        await warm
        if head is None:
            raise NotFoundError(f"{opts.model}: no version on {', '.join(opts.sources)}")
        m = parse_manifest(head.body, verifier=opts.verifier)
        # the layout of a keyframe, or of a format-2 delta (every tensor listed); a format-3 delta lists only
        # what it changes: the file is then laid out by the first keyframe it receives
        whole = m.kind == "keyframe" or m.format < 3
        layout = None
        if whole:  # from a parsed table's columns: no record made (~0.15 s at 70,000 tensors)
            names, dtypes, shapes, _ = record_columns(m)
            layout = dict(zip(names, zip(dtypes, shapes)))
        target = FileTarget(opts.out, opts.model, layout=layout, before_write=opts.on_applied, open_existing=False,
                            layout_from_keyframe=not whole)
        await stream_keyframe(client, target, m, opts)
        return target
    finally:
        await client.close()


async def stream_keyframe(client: HttpClient, target: FileTarget, head: Manifest, opts: FileOptions) -> None:
    """The first version streamed into ``target``'s new file, its shards side by side, when ``head`` is a keyframe
    or has a side keyframe (``M.kf``, same state fingerprint): in memory, each shard's header and a 1 MiB buffer.
    Otherwise (or on any error: logged) the subscriber catches up the usual way, a keyframe then deltas."""
    from deltasync.manifest import keyframe_stream, parse_manifest

    from .filetarget import KeyframeWriter

    kf = head if head.kind == "keyframe" else None
    if kf is None:
        try:
            side = parse_manifest(await client.get_manifest(keyframe_stream(opts.model), head.version),
                                  verifier=opts.verifier)
        except DeltaSyncError:
            return
        if side.kind != "keyframe" or side.state_fp != head.state_fp:
            return
        kf = side
    loop = asyncio.get_running_loop()
    try:
        w = KeyframeWriter(target, kf, version=head.version)
    except DeltaSyncError as e:
        log.warning("cannot stream keyframe v%s into %s (%s); catching up the usual way", head.version, opts.out, e)
        return
    timeline.debug("mono=%.6f kf-head v%d %d", time.monotonic(), head.version, len(kf.blobs))
    slots = asyncio.Semaphore(KEYFRAME_SHARDS_AT_ONCE)

    async def shard(ref) -> None:  # received straight into the new file (no copy of it in memory)
        async with slots:
            sink = w.shard_sink(ref.size)
            timeline.debug("mono=%.6f kf-blob-start %s", time.monotonic(), ref.id)
            await client.receive_blob(ref.id, ref.size, sink, digest=ref.digest)
            timeline.debug("mono=%.6f kf-blob-end %s", time.monotonic(), ref.id)
            w.add_received(sink)

    try:
        # every shard at once: a relay fetching the keyframe cold pulls its shards side by side, and each is
        # followed cut-through as it arrives (one after another, the first shard would end only when the relay's
        # last did, and every other shard's receive would start after it)
        tasks = [asyncio.ensure_future(shard(ref)) for ref in kf.blobs]
        try:
            await asyncio.gather(*tasks)
        finally:  # the first failure ends the others (their bytes are discarded with the file)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await loop.run_in_executor(None, w.commit)
        timeline.debug("mono=%.6f kf-committed", time.monotonic())
    except BaseException as e:
        w.abort()
        if not isinstance(e, DeltaSyncError):
            raise
        log.warning("streaming keyframe v%s into %s failed (%s); catching up the usual way", head.version, opts.out, e)
        return
    opts.say(f"{opts.model} v{head.version} -> {opts.out} (keyframe, streamed)")


def _warm(target: FileTarget) -> None:
    try:
        target.warm()
        timeline.debug("mono=%.6f warmed cpu=%.3f", time.monotonic(), time.process_time())
    except Exception:  # only a head start: the first delta loads what is missing
        log.debug("loading the delta kernels ahead failed", exc_info=True)


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


async def follow_file(opts: FileOptions) -> FileOutcome:
    """Run a file subscriber (the module docstring's four phases) to its end: ``until`` or ``once``'s goal
    reached, a signal (SIGTERM/SIGINT: an apply in progress is rolled back), or the deadline."""
    from .subscriber import Subscriber, SyncEvent

    _recover(opts)
    target = _existing(opts)
    fresh = target is None  # the first version is streamed in below
    if target is None:
        target = await _first_version(opts)
        gc.freeze()  # the keyframe's records and the file's layout (~10**6 objects at 70k tensors) live on
    version = target.version  # None, or the keyframe just streamed in (the subscriber scans it once)
    if fresh and opts.until is not None and version is not None and version >= opts.until:
        target.close()  # until V, and the keyframe just streamed in (verified, renamed into place) is V: done
        timeline.debug("mono=%.6f closed", time.monotonic())
        return FileOutcome(status=0, version=version)

    def on_event(ev: SyncEvent) -> None:
        if ev.kind in ("rollback", "refetch", "resync", "scrub", "error"):
            opts.say(f"{ev.kind} v{ev.version}: {ev.detail}")

    sub = Subscriber(list(opts.sources), opts.model, target, verifier=opts.verifier, version=version,
                     timeouts=opts.timeouts, scrub_every=opts.scrub_every, on_event=on_event, ssl=opts.ssl,
                     read_token=opts.read_token)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # a signal sets the flag at once (Python runs the handler between two bytecodes of a running apply, which
    # holds the loop's thread) and wakes the loop; the apply sees it (or the deadline) at its next check, rolls
    # back and raises ApplyInterrupted (client/interrupt.py)
    interrupt = Interrupt(deadline=opts.deadline)
    interrupt.install(lambda: loop.call_soon_threadsafe(stop.set))
    target.check = interrupt.check
    try:
        await sub.start()
        timeline.debug("mono=%.6f subscriber-started cpu=%.3f", time.monotonic(), time.process_time())
        # Everything imported and opened so far (torch, numba, the file's map: ~10**6 objects) lives as long as
        # the process: out of the cyclic GC's sight, a step no longer pays full collections over it (they were
        # half of a `--out` process's CPU from a step's manifest to exit, the collection at exit included).
        gc.freeze()
        return await _apply_loop(opts, sub, target, version, stop, interrupt)
    finally:
        await sub.close()
        timeline.debug("mono=%.6f subscriber-closed cpu=%.3f", time.monotonic(), time.process_time())
        target.close()
        timeline.debug("mono=%.6f closed cpu=%.3f", time.monotonic(), time.process_time())


async def _apply_loop(opts: FileOptions, sub, target: FileTarget, version: int | None, stop: asyncio.Event,
                      interrupt: Interrupt) -> FileOutcome:
    written = version
    goal = opts.until
    if opts.once:
        # the newest version any listed source can prove (signed): never done at an older one another replays
        h = await sub.client.highest_head(opts.model)
        if h is None:
            raise NotFoundError(f"{opts.model}: no version on {', '.join(opts.sources)}")
        goal = h.version
    if not opts.once and (goal is None or written is None or written < goal):
        # load the delta kernels while waiting for the next version (~0.05 CPU-s the first delta would pay);
        # a daemon thread: never waited for, and numba's compiler lock orders it with a real apply
        threading.Thread(target=_warm, args=(target,), name="deltasync-warm", daemon=True).start()
    changed = sub.driver.changed  # set on every step the driver delivers (and every apply result)
    while not stop.is_set():
        changed.clear()  # before looking: a step delivered from here on sets it again
        if len(sub.queue):
            timeline.debug("mono=%.6f apply-start cpu=%.3f", time.monotonic(), time.process_time())
        try:
            v = sub.apply_pending()  # patches the file in place (FileTarget), journaled
        except ApplyInterrupted as e:
            why = interrupt.why or "--timeout"
            return FileOutcome(status=130 if interrupt.signalled else 1, version=sub.version,
                               message=f"{why}: the apply in progress was stopped and rolled back ({e}); "
                                       f"{opts.out} holds v{sub.version}")
        if v is not None and v != written:
            # (nothing frozen here: an object alive now that dies later in a reference cycle would never be freed;
            # a step's decoded changes, ~10 bytes a changed word, stayed for the life of the process that way)
            written = v
            timeline.debug("mono=%.6f applied v%d cpu=%.3f", time.monotonic(), v, time.process_time())
            st = sub.status
            opts.say(f"{opts.model} v{v} -> {opts.out} (lag {st.lag}, {megabytes(st.bytes_received)} received, "
                     f"verify {st.verify})")
        if goal is not None and written is not None and written >= goal:
            return FileOutcome(status=0, version=written)
        if opts.deadline is not None and time.monotonic() > opts.deadline:
            return FileOutcome(status=1, version=written,
                               message=f"error: still at v{written} after {opts.timeout:.0f}s (wanted v{goal}; "
                                       f"last error: {sub.status.last_error})")
        # woken by the next delivered step or a signal; the 1 s bound only re-checks the deadline
        waits = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    if interrupt.signalled:
        opts.say(f"{interrupt.why}: stopping; {opts.out} holds v{written} (no apply was in progress)")
        return FileOutcome(status=130 if opts.exit_now else 0, version=written)
    return FileOutcome(status=0, version=written)
