"""The sidecar: publish every safetensors checkpoint a trainer drops into a folder.

For any trainer (no code change): it writes ``step-N.safetensors`` files (atomically,
or followed by a marker file, :mod:`deltasync.client.checkpoints`); the sidecar
publishes each new complete checkpoint in step order as a delta against the previous
one, diffing the two files through ``mmap`` (``deltasync.codec.encode_delta`` reads
both files' pages; nothing is copied into the sidecar's memory but the changes).
The first checkpoint (and one whose tensor layout changed) goes out as a keyframe;
every ``keyframe_every`` steps a keyframe also goes to the side stream. Both keyframes are
streamed from the checkpoint's mapped pages (``filepublish.publish_keyframe``: each shard
is its header plus views of the file), so the sidecar holds no copy of the state, and
they are committed only if the file did not change while it was read.

Restart-safe: after each commit it writes its state (last step, that checkpoint's
file stamp and fingerprints) atomically to ``.deltasync-sidecar.json`` in the folder.
On restart it resumes from there, deltas included, provided the origin's head is that
step and the file is unchanged; otherwise it starts over with a keyframe. A checkpoint
the origin already holds (a crash after the commit, before the state was saved) is
recognised by its state fingerprint and not sent again.

A checkpoint that is truncated or unreadable is reported and skipped (never
published), and not retried unless the file changes. With ``delete_published`` a
checkpoint is deleted once its successor is published (it is no longer a base).

With ``budget`` (bytes per delta, or a :class:`deltasync.budget.BudgetPolicy`) the base is
not the previous checkpoint but the *served view*, kept in memory and saved after each
commit beside the state file (``.deltasync-sidecar.served.safetensors`` by default, with
the owed ledger in ``...safetensors.owed``);
each checkpoint ships what of its residual fits the budget (docs/CLIENT.md, "Budgeted
streams"). The residual drains as later checkpoints arrive (a trainer that stopped
changing may keep writing the same weights). A failed upload, or a served view file that
does not match the origin's head on restart, makes the next checkpoint a keyframe.

With ``serve`` (e.g. ``["fp8-block", "int4"]``) each published checkpoint is also published in those serving
formats, as the streams ``M.fp8`` / ``M.int4`` (client/serving.py, docs/FORMAT.md §11): quantized from the mapped
file (only the tensors that changed are requantized), each an in-process publisher of its own. They keep no
resume state: after a restart each goes on with a keyframe at the next checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deltasync.atomic import write_atomic
from deltasync.budget import Budgeter, BudgetPlan, BudgetPolicy
from deltasync.codec import EncodeOptions, diff_states, encode_delta, encode_diff, state_layout
from deltasync.conditioned import CODING_HISTORY
from deltasync.history import CODING_AUTO, REBUILD_MAX, StateHistory, default_coding, history_meta
from deltasync.errors import ChainError, DeltaSyncError, NotFoundError
from deltasync.fingerprint import fingerprint_state, fp_hex, state_fingerprint_of, tensor_fingerprint
from deltasync.keyframe import encode_keyframe
from deltasync.manifest import parse_manifest
from deltasync.signing import Signer, as_signer

from .checkpoints import Checkpoint, CheckpointError, MappedCheckpoint, find_checkpoints
from .served import load_served, save_served
from .filepublish import publish_keyframe
from .historychain import take_in_chain
from .http import HttpClient, Timeouts
from .streams import keyframe_stream
from .upload import commit_manifest, upload_version

log = logging.getLogger("deltasync.client.sidecar")

STATE_NAME = ".deltasync-sidecar.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class SidecarEvent:
    """One thing the sidecar did: ``kind`` is published, served (the serving-format streams of a published
    checkpoint), skipped, adopted, deleted or error."""

    kind: str
    step: int | None
    path: str
    detail: str = ""
    bytes: int = 0
    raw_bytes: int = 0


class Sidecar:
    """Publishes checkpoints from ``watch_dir`` to ``origin`` (see the module docstring)."""

    def __init__(self, watch_dir: str | os.PathLike, origin: str, model: str, token: str,
                 signer: Signer | bytes | None = None, *,
                 keyframe_every: int = 20, delete_published: bool = False, marker: str | None = None,
                 poll: float = 1.0, state_file: str | os.PathLike | None = None,
                 on_event: Callable[[SidecarEvent], None] | None = None,
                 budget: int | BudgetPolicy | None = None, ssl=None, coding: str = "auto",
                 blob_format: int = 4, serve: tuple[str, ...] | list[str] = ()) -> None:
        self._auto_coding = coding == CODING_AUTO  # revisited at the first checkpoint (its tensor count)
        if coding == CODING_AUTO:  # history when signed with Ed25519 on a lossless stream, else base-free
            coding = default_coding(signer, budget=budget)
        if coding != "base-free" and budget is not None:
            raise ValueError(f"the {coding} coding and a budget exclude each other (use coding base-free)")
        self.dir = Path(watch_dir)
        self.model = model
        self.side_model = keyframe_stream(model)
        self.signer = as_signer(signer)  # a raw key (bytes) signs with HMAC-SHA256
        self.keyframe_every = keyframe_every
        self.delete_published = delete_published
        self.marker = marker
        self.poll = poll
        self.state_path = Path(state_file) if state_file else self.dir / STATE_NAME
        self.options = EncodeOptions(coding=coding, format=blob_format)  # docs/FORMAT.md §4.4, §4.6
        self.client = HttpClient([origin], token=token, timeouts=Timeouts(), ssl=ssl, read_token=token)
        self.on_event = on_event
        # the history coding (docs/FORMAT.md §4.5): the positions the deltas since the last keyframe (or since
        # this run's first version) changed; the step's diff, taken in once the step is committed
        self.history: StateHistory | None = None
        self._history_diff = None
        # resumable state
        self.version: int | None = None
        self.last_keyframe: int | None = None
        self.base: Checkpoint | None = None
        self.base_fps: dict[str, int] | None = None
        self.skipped: dict[str, tuple[int, int]] = {}
        self._resumed = False
        # budgeted streams: the served view (what subscribers hold) and its owed ledger
        self.budget = BudgetPolicy(bytes=budget) if isinstance(budget, int) else budget
        self.budgeter = Budgeter(self.budget) if self.budget is not None else None
        self.served: dict | None = None
        self.served_fps: dict[str, int] | None = None
        self.served_path = self.state_path.with_suffix(".served.safetensors")  # one per state file
        self._pending = None  # (plan or None, keyframe state or None) of the version being uploaded
        # serving-format streams (client/serving.py): each published checkpoint, quantized, as M.fp8 / M.int4. They
        # keep no resume state: after a restart each starts again with a keyframe at the next checkpoint.
        self.serving = None
        if serve:
            from .publisher import Publisher
            from .serving import ServingStreams

            self.serving = ServingStreams(model, serve, lambda name: Publisher(
                origin, name, token, self.signer, keyframe_every=keyframe_every, budget=budget, ssl=ssl,
                options=EncodeOptions(coding=coding, format=blob_format)))

    # -- state file ----------------------------------------------------------------------------
    def _save_state(self) -> None:
        obj = {
            "model": self.model, "version": self.version, "last_keyframe": self.last_keyframe,
            "base": None if self.base is None else {"path": self.base.path.name, "step": self.base.step,
                                                    "size": self.base.size, "mtime_ns": self.base.mtime_ns},
            "fps": None if self.base_fps is None else {n: fp_hex(v) for n, v in sorted(self.base_fps.items())},
            "skipped": {k: list(v) for k, v in self.skipped.items()},
        }
        write_atomic(self.state_path, json.dumps(obj, indent=1, sort_keys=True).encode())

    def _load_state(self) -> dict | None:
        try:
            obj = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("sidecar state %s is unreadable (%s); starting over with a keyframe", self.state_path, e)
            return None
        if not isinstance(obj, dict) or obj.get("model") != self.model:
            log.warning("sidecar state %s is for another model; starting over", self.state_path)
            return None
        return obj

    async def resume(self) -> None:
        """Pick up where a previous run left off (called once by ``run``/``scan``)."""
        self._resumed = True
        head = await self.client.get_head(self.model)
        head_v = head.version if head is not None else None
        if self.budgeter is not None and head is not None:
            got = await asyncio.to_thread(load_served, self.served_path, self.model, head.version,
                                          parse_manifest(head.body).state_fp, self.budgeter)
            if got is not None:
                self.served, self.served_fps = got
        obj = self._load_state()
        if obj is None:
            self.version = head_v
            return
        self.skipped = {k: (int(v[0]), int(v[1])) for k, v in (obj.get("skipped") or {}).items()}
        self.last_keyframe = obj.get("last_keyframe")
        saved = obj.get("version")
        base = obj.get("base")
        self.version = head_v
        if saved is None or head_v != saved or not base:
            if head_v != saved:
                log.warning("origin head is v%s but this sidecar last published v%s; the next checkpoint goes out "
                            "as a keyframe", head_v, saved)
            return
        path = self.dir / base["path"]
        try:
            st = path.stat()
        except FileNotFoundError:
            log.warning("base checkpoint %s is gone; the next checkpoint goes out as a keyframe", path)
            return
        if (st.st_size, st.st_mtime_ns) != (base["size"], base["mtime_ns"]):
            log.warning("base checkpoint %s changed since it was published; next goes out as a keyframe", path)
            return
        self.base = Checkpoint(step=base["step"], path=path, size=st.st_size, mtime_ns=st.st_mtime_ns)
        self.base_fps = {n: int(v, 16) for n, v in (obj.get("fps") or {}).items()}
        log.info("resuming %s after v%s (base %s)", self.model, saved, path.name)

    # -- one pass --------------------------------------------------------------------------------
    def _emit(self, ev: SidecarEvent) -> None:
        (log.error if ev.kind == "error" else log.warning if ev.kind == "skipped" else log.info)(
            "%s step %s %s: %s", ev.kind, ev.step, ev.path, ev.detail)
        if self.on_event is not None:
            self.on_event(ev)

    async def scan(self) -> list[SidecarEvent]:
        """Publish every new complete checkpoint, oldest first; returns what happened."""
        if not self._resumed:
            await self.resume()
        events: list[SidecarEvent] = []

        def note(ev: SidecarEvent) -> None:
            events.append(ev)
            self._emit(ev)

        for ck in find_checkpoints(self.dir, marker=self.marker):
            if self.version is not None and ck.step <= self.version:
                continue
            if self.skipped.get(ck.path.name) == ck.stamp:
                continue
            try:
                ev = await self._publish(ck)
            except CheckpointError as e:
                self.skipped[ck.path.name] = ck.stamp
                self._save_state()
                note(SidecarEvent(kind="skipped", step=ck.step, path=str(ck.path), detail=str(e)))
                continue
            note(ev)
            if self.serving is not None and ev.kind == "published":
                note(await asyncio.to_thread(self._publish_serving, ck))
            if self.delete_published:
                for old in find_checkpoints(self.dir, marker=self.marker):
                    if old.step < ck.step and old.path.name not in self.skipped:
                        self._delete(old)
                        note(SidecarEvent(kind="deleted", step=old.step, path=str(old.path)))
        return events

    def _publish_serving(self, ck: Checkpoint) -> SidecarEvent:
        """The checkpoint in every serving format, published and committed (its tensors read from the mapped file:
        the deriver keeps what it quantized, the serving publishers their own reference copies)."""
        with MappedCheckpoint(ck.path) as new:
            pending = self.serving.publish(ck.step, new.tensors, keyframe=False, meta={"source": ck.path.name})
            done = {name: p.result(self.client.timeouts.request * 4) for name, p in pending.items()}
        detail = ", ".join(f"{n} {r.kind} {r.blob_bytes} bytes" for n, r in done.items())
        return SidecarEvent(kind="served", step=ck.step, path=str(ck.path), detail=detail,
                            bytes=sum(r.blob_bytes for r in done.values()), raw_bytes=sum(r.raw_bytes for r in done.values()))

    def _delete(self, ck: Checkpoint) -> None:
        for p in (ck.path, Path(str(ck.path) + self.marker) if self.marker else None):
            if p is not None:
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass

    async def _publish(self, ck: Checkpoint) -> SidecarEvent:
        new = MappedCheckpoint(ck.path)
        old = None
        try:
            if self.base is not None and self.version is not None and self.base_fps is not None:
                try:
                    old = MappedCheckpoint(self.base.path)
                except CheckpointError as e:
                    log.warning("base %s unreadable (%s); publishing a keyframe", self.base.path, e)
            if self._auto_coding and self.options.coding == CODING_HISTORY and default_coding(
                    self.signer, budget=None, tensors=len(new.tensors)) != CODING_HISTORY:
                self.options = dataclasses.replace(self.options, coding="base-free")  # too many tensors: columnar
            if old is not None and self.options.coding == CODING_HISTORY and (
                    self.history is None or self.history.version != self.version):
                self.history = await self._resume_history(old)
            main, side, fps = await asyncio.to_thread(self._encode, ck, new, old)
            if main is None:  # a keyframe: streamed from the mapped file while it is open
                return await self._upload(ck, None, None, None, new)
            return await self._upload(ck, main, side, fps, new)
        finally:
            new.close()
            if old is not None:
                old.close()

    async def _resume_history(self, base: MappedCheckpoint) -> StateHistory:
        """The history at this sidecar's version after a restart: rebuilt from the origin's deltas since the one the
        stream's head was coded with (at most ``REBUILD_MAX``), else an empty one since the head (subscribers take
        that from theirs: a later ``since`` only leaves older changes out)."""
        layout, version = state_layout(base.tensors), self.version
        fresh = StateHistory(layout, since=version)
        if self.last_keyframe == version:
            return fresh
        try:
            head = parse_manifest(await self.client.get_manifest(self.model, version))
            since, depth = history_meta(head) if head.kind == "delta" and head.coding == CODING_HISTORY else (version, 0)
        except (DeltaSyncError, ValueError) as e:
            log.info("%s: no history to resume from v%s (%s); starting one", self.model, version, e)
            return fresh
        if not 0 < version - since <= REBUILD_MAX or depth != fresh.depth:
            return fresh

        async def fetch(v: int):
            m = parse_manifest(await self.client.get_manifest(self.model, v))
            blobs = {r.id: await self.client.get_blob(r.id, r.size) for r in m.blobs}
            return m, blobs, None

        history = StateHistory(layout, since=since, depth=depth)
        why = await take_in_chain(history, version, fetch)
        if why is not None:
            log.info("%s: cannot rebuild the history at v%s (%s); starting one", self.model, version, why)
            return fresh
        log.info("%s: resumed the history of the deltas since v%d at v%d", self.model, since, version)
        return history

    def _encode(self, ck: Checkpoint, new: MappedCheckpoint, old: MappedCheckpoint | None):
        """The delta (``main``) and the budgeted stream's side keyframe (``side``, its served view), encoded in
        memory: both O(changed) but the side keyframe. ``main`` None: the version is a keyframe, and a side
        keyframe of the plain stream is ``side`` :data:`_STREAM`: both are streamed from the file at upload
        (:func:`~deltasync.client.filepublish.publish_keyframe`: the file's own pages, never copied)."""
        # runs in a worker thread: the encoding reads every page of both files
        main = side = None
        plan = None
        try:
            if self.budgeter is not None:
                if self.served is not None and self.version is not None:
                    diff = diff_states(self.served, new.tensors, base_fps=self.served_fps,
                                       chunk_words=self.options.chunk_words)
                    plan = self.budgeter.plan(diff, model=self.model, version=ck.step, parent=self.version,
                                              options=self.options, meta={"source": ck.path.name})
                    main = plan.encoded
            elif old is not None and self.options.coding == CODING_HISTORY:
                diff = diff_states(old.tensors, new.tensors, base_fps=self.base_fps, chunk_words=self.options.chunk_words)
                main = encode_diff(diff, model=self.model, version=ck.step, parent=self.version, options=self.options,
                                   meta={"source": ck.path.name}, history=self.history)
                self._history_diff = diff
            elif old is not None:
                main = encode_delta(old.tensors, new.tensors, model=self.model, version=ck.step, parent=self.version,
                                    base_fps=self.base_fps, options=self.options, meta={"source": ck.path.name})
        except ChainError as e:
            log.info("%s: %s; publishing a keyframe", ck.path.name, e)
            main = None
        except (OSError, ValueError, RuntimeError) as e:  # an I/O error reading a mapped page, ...
            raise CheckpointError(f"{ck.path}: unreadable while diffing ({type(e).__name__}: {e})") from None
        if main is None:
            if self.budgeter is not None:
                self._pending = (None, {n: t.clone() for n, t in new.tensors.items()})
            return None, None, None
        try:
            if self.keyframe_every and (self.last_keyframe is None or ck.step - self.last_keyframe >= self.keyframe_every):
                # a budgeted stream's side keyframe is of the served view after this delta (in memory)
                side = (encode_keyframe(self._served_after(plan), model=self.side_model, version=ck.step,
                                        fps=main.fps, meta={"source": ck.path.name}) if plan is not None else _STREAM)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{ck.path}: unreadable ({type(e).__name__}: {e})") from None
        fps = main.fps if main.fps else fingerprint_state(new.tensors)
        _check_stamp(ck)
        if self.budgeter is not None:
            self._pending = (plan, None)
        return main, side, fps

    def _served_after(self, plan: BudgetPlan) -> dict:
        """The served view after ``plan`` (a copy: the live one moves only once the version is committed)."""
        out = {n: t.clone() for n, t in self.served.items()}
        _patch(out, plan)
        return out

    def _commit_served(self, fps: dict[str, int]) -> None:
        plan, keyframe_state = self._pending
        self._pending = None
        if plan is None:
            self.served = keyframe_state
            self.budgeter.reset()
        else:
            _patch(self.served, plan)
            self.budgeter.commit(plan)
        self.served_fps = dict(fps)
        save_served(self.served_path, self.served, self.model, self.version, self.budgeter)

    async def _upload(self, ck: Checkpoint, main, side, fps: dict[str, int] | None,
                      new: MappedCheckpoint) -> SidecarEvent:
        try:
            return await self._upload_version(ck, main, side, fps, new)
        except BaseException:
            if self.budgeter is not None:  # the served view is unknown now: start over with a keyframe
                self.served = self.served_fps = self._pending = None
            raise

    async def _existing(self, step: int):
        """The manifest the origin already holds for ``step``, or None."""
        try:
            return parse_manifest(await self.client.get_manifest(self.model, step))
        except NotFoundError:
            return None

    async def _stream_keyframe(self, ck: Checkpoint, new: MappedCheckpoint, *, model: str,
                               fps: dict[str, int] | None = None):
        """A keyframe of the checkpoint straight from its mapped pages (shards are pieces of the file: no copy
        of the state in memory), committed only if the file did not change while it was read."""
        meta = {"source": ck.path.name}
        if self.budgeter is not None and model == self.model:
            meta.update(self.budgeter.keyframe_meta(sum(t.numel() for t in new.tensors.values())))
        try:
            pub = await publish_keyframe(self.client, model=model, version=ck.step, state=new.host,
                                         signer=self.signer, fps=fps, meta=meta, commit=False)
        except (OSError, ValueError, RuntimeError) as e:  # an I/O error reading a mapped page, ...
            raise CheckpointError(f"{ck.path}: unreadable ({type(e).__name__}: {e})") from None
        _check_stamp(ck)
        return await commit_manifest(self.client, pub.manifest, key=self.signer)

    async def _upload_version(self, ck: Checkpoint, main, side, fps: dict[str, int] | None,
                              new: MappedCheckpoint) -> SidecarEvent:
        existing = await self._existing(ck.step)
        if main is None:  # a keyframe
            if existing is not None:
                fps = await asyncio.to_thread(lambda: {n: tensor_fingerprint(t) for n, t in new.host.items()})
                state_fp = state_fingerprint_of(new.host, fps)
            else:
                manifest = await self._stream_keyframe(ck, new, model=self.model)
                fps = {t.name: int(t.fp_after, 16) for t in manifest.tensors}
                state_fp = manifest.state_fp
        else:
            manifest, state_fp = main.manifest, main.manifest.state_fp
        if existing is not None:
            if existing.state_fp != state_fp:
                raise DeltaSyncError(f"the origin already holds a different {self.model} v{ck.step}; not publishing {ck.path}")
            kind = "adopted"  # committed by an earlier run that died before saving its state
            manifest = existing
        else:
            if main is not None:
                await upload_version(self.client, main.manifest, main.blobs, key=self.signer)
            kind = "published"
        side_bytes = 0
        if side is _STREAM:
            try:
                side_bytes = (await self._stream_keyframe(ck, new, model=self.side_model, fps=fps)).total_bytes
            except CheckpointError as e:  # the version is live; its side keyframe waits for the next turn
                log.warning("%s v%s is live but its side keyframe was not committed: %s", self.model, ck.step, e)
                side = None
        elif side is not None:
            await upload_version(self.client, side.manifest, side.blobs, key=self.signer)
            side_bytes = side.manifest.total_bytes
        if manifest.kind == "keyframe" or side is not None:
            self.last_keyframe = ck.step
        if self.options.coding == CODING_HISTORY:
            diff, self._history_diff = self._history_diff, None
            if kind == "published" and diff is not None and side is None and self.history is not None:
                self.history.advance_diff(ck.step, diff)
            else:  # a keyframe (late joiners start there) or a version of an earlier run: empty since here
                self.history = StateHistory(state_layout(new.tensors), since=ck.step)
        self.version = ck.step
        self.base = ck
        self.base_fps = dict(fps)
        if self.budgeter is not None:
            await asyncio.to_thread(self._commit_served, fps)
        self._save_state()
        raw = manifest.raw_bytes
        detail = f"{manifest.kind} v{ck.step}, {manifest.total_bytes} bytes ({raw} raw)" + (
            f" + side keyframe {side_bytes} bytes" if side is not None else "")
        return SidecarEvent(kind=kind, step=ck.step, path=str(ck.path), detail=detail,
                            bytes=manifest.total_bytes + side_bytes, raw_bytes=raw)

    async def close(self) -> None:
        await self.client.close()
        if self.serving is not None:
            await asyncio.to_thread(self.serving.close, self.client.timeouts.request * 4)

    # -- the daemon -------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None, *, once: bool = False) -> None:
        """Scan every ``poll`` seconds until ``stop`` is set (or after one scan with ``once``).
        Transport errors are reported and retried at the next scan; nothing is skipped for them."""
        stop = stop or asyncio.Event()
        try:
            while True:
                try:
                    await self.scan()
                except DeltaSyncError as e:
                    self._emit(SidecarEvent(kind="error", step=None, path=str(self.dir), detail=str(e)))
                    if once:
                        raise
                if once or stop.is_set():
                    return
                try:
                    await asyncio.wait_for(stop.wait(), self.poll)
                except asyncio.TimeoutError:
                    pass
                if stop.is_set():
                    return
        finally:
            await self.close()


#: ``_encode``'s mark for a side keyframe streamed from the checkpoint's file at upload
_STREAM = object()


def _check_stamp(ck: Checkpoint) -> None:
    """The checkpoint must not have changed under us while we read it."""
    try:
        st = ck.path.stat()
    except FileNotFoundError:
        raise CheckpointError(f"{ck.path}: removed while it was being published") from None
    if (st.st_size, st.st_mtime_ns) != ck.stamp:
        raise CheckpointError(f"{ck.path}: changed while it was being published")


def _patch(state: dict, plan: BudgetPlan) -> None:
    """Write the words a budgeted delta ships into a served view (host tensors)."""
    from deltasync.dtypes import word_view
    for name, chunks in plan.sent.chunks.items():
        words = word_view(state[name])
        for c in chunks:
            words[torch.from_numpy(c.positions)] = torch.from_numpy(c.new.view(f"i{c.new.dtype.itemsize}"))

