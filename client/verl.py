"""deltasync as a verl checkpoint engine (verl 0.9's ``verl.checkpoint_engine``), registered as ``deltasync``.

Select it in verl's config (importing this module registers it; verl imports it on every worker first)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=deltasync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=deltasync.client.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.origin=http://origin:8700
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.urls=[http://relay:8701]
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.model=policy
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.key_hex=...   # or signing_key / verify_key
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.token=...     # the trainer's write token

verl builds the engine on both sides with ``CheckpointEngineRegistry.new(backend, bucket_size=...,
[is_master=...], **engine_kwargs)`` (verl/workers/engine_workers.py, verl/checkpoint_engine/base.py 0.9.1):

* **Actor** (``is_master``: trainer rank 0): ``send_weights(weights, global_steps)`` consumes verl's full-tensor
  generator (every trainer rank must: materializing a tensor is a collective) and, on rank 0, publishes the state
  (cast to ``dtype``) through the in-process :class:`~deltasync.client.publisher.Publisher` as version
  ``global_steps``, waiting for its commit. Returns verl's per-sync metrics (bytes, times).
* **Rollout** (each ``CheckpointEngineWorker``): ``receive_weights(global_steps)`` follows the stream with a
  :class:`~deltasync.client.subscriber.ThreadedSubscriber` into a host mirror of the model (built from the stream's
  head manifest on the first call; downloads and decoding run in the background between syncs), waits (bounded,
  ``timeout``) until ``global_steps`` is applied and verified, and yields the tensors the update changed (the
  first call: all of them) as ``(name, tensor)`` pairs, verl's ``named_tensors`` wire format: the server adapter
  loads them through the engine's own loader (``update_weights_from_ipc``), so only changed tensors cross the last
  hop, and the network carries sparse deltas through relays.
* ``prepare`` / ``build_topology`` / ``init_process_group`` / ``finalize``: no process group between trainer and
  rollout (the origin and relays are the transport): empty metadata, no topology arguments, no-ops.

The host mirror costs one copy of the model in host memory per rollout worker; it is what lets verl's loader
receive plain full tensors. (Patching an engine's weights in place, as the vLLM backend does, would need verl's
rollout adapters to hand the engine to the checkpoint engine; verl 0.9.1's contract does not.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from deltasync.errors import NotFoundError
from deltasync.errors import UpstreamTimeout as SyncTimeout

log = logging.getLogger("deltasync.client.verl")

BACKEND = "deltasync"


async def _aiter(weights):
    """verl hands a generator or an async generator."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


@CheckpointEngineRegistry.register(BACKEND)
class DeltaSyncCheckpointEngine(CheckpointEngine):
    """See the module docstring. ``engine_kwargs``: ``origin`` and ``token`` (actor), ``urls`` (rollout; default
    ``[origin]``), ``model``, ``key_hex`` (HMAC, both sides) or ``signing_key`` (actor: Ed25519 private key PEM path)
    / ``verify_key`` (rollout: public key path), ``dtype`` (serving dtype; None: as given), ``keyframe_every``,
    ``timeout`` (seconds a sync may wait), ``subscriber_options`` / ``publisher_options`` (keyword arguments)."""

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, is_master: bool = False, *, model: str = "policy",
                 origin: str | None = None, token: str | None = None, urls: list[str] | str | None = None,
                 key_hex: str | None = None, signing_key: str | None = None, verify_key: str | None = None,
                 dtype: str | None = "bfloat16", keyframe_every: int = 20, timeout: float = 300.0,
                 subscriber_options: dict[str, Any] | None = None,
                 publisher_options: dict[str, Any] | None = None) -> None:
        if key_hex and (signing_key or verify_key):
            raise ValueError("deltasync checkpoint engine: give key_hex (HMAC) or signing_key/verify_key, not both")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.model = model
        self.origin = origin
        self.token = token
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        self.urls = list(urls) if urls else ([origin] if origin else [])
        self.key_hex, self.signing_key, self.verify_key = key_hex, signing_key, verify_key
        self.dtype = getattr(torch, dtype) if dtype else None
        self.keyframe_every = keyframe_every
        self.timeout = float(timeout)
        self.subscriber_options = dict(subscriber_options or {})
        self.publisher_options = dict(publisher_options or {})
        self.publisher = None
        self.sub = None
        self.mirror: dict[str, torch.Tensor] | None = None
        self._seen: dict[str, int | None] = {}  # mirror tensor -> its fingerprint when last yielded

    # -- topology: none (the origin and the relays carry the bytes) ---------------------------------------------
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        return {}, {}

    def init_process_group(self, **kwargs) -> None:
        pass

    def finalize(self) -> None:
        pass

    # -- the actor's side -----------------------------------------------------------------------------------------
    def _signer(self):
        if self.key_hex:
            from deltasync.signing import load_key

            return load_key(self.key_hex)
        if self.signing_key:
            from deltasync.signing import load_signing_key

            with open(self.signing_key, "rb") as f:
                return load_signing_key(f.read())
        return None

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None):
        t0 = time.perf_counter()
        state: dict[str, torch.Tensor] = {}
        async for name, t in _aiter(weights):  # every rank iterates: a full tensor is a collective
            if self.is_master:
                t = t.detach()
                state[name] = (t.to(self.dtype) if self.dtype is not None else t).to("cpu", copy=True).contiguous()
        if not self.is_master:
            return {}
        if self.publisher is None:
            from deltasync.client.publisher import Publisher

            if not self.origin:
                raise ValueError("deltasync checkpoint engine: the actor needs engine_kwargs origin= (and token=)")
            self.publisher = Publisher(self.origin, self.model, self.token, self._signer(),
                                       keyframe_every=self.keyframe_every, **self.publisher_options)
        pub = self.publisher
        version = int(global_steps) if global_steps is not None else (0 if pub.version is None else pub.version + 1)
        gathered = time.perf_counter() - t0
        result = pub.publish(version, state).result(self.timeout)
        return {"deltasync/version": version, "deltasync/blob_bytes": result.blob_bytes,
                "deltasync/gather_s": gathered, "deltasync/publish_blocking_s": result.blocking_s,
                "deltasync/publish_s": time.perf_counter() - t0 - gathered}

    # -- the rollout's side ---------------------------------------------------------------------------------------
    def _verifier(self):
        if self.key_hex:
            from deltasync.signing import load_key

            return load_key(self.key_hex)
        if self.verify_key:
            from deltasync.signing import load_verify_key

            with open(self.verify_key, "rb") as f:
                return load_verify_key(f.read())
        return None

    def _start_following(self) -> None:
        """The host mirror, laid out as the stream's head manifest says, and its subscriber (fetching a keyframe)."""
        from deltasync.client.http import HttpClient
        from deltasync.client.loop import LoopThread
        from deltasync.client.streams import stream_layout
        from deltasync.client.subscriber import ThreadedSubscriber
        from deltasync.dtypes import dtype_info
        from deltasync.manifest import parse_manifest

        if not self.urls:
            raise ValueError("deltasync checkpoint engine: the rollout needs engine_kwargs urls= (or origin=)")
        key = self._verifier()
        io = LoopThread("deltasync-verl-head")
        try:
            async def layout():
                client = HttpClient(self.urls)
                try:
                    deadline = time.monotonic() + self.timeout
                    while True:
                        h = await client.highest_head(self.model)
                        if h is not None and h.body is not None:
                            # a format-3 delta lists only what it changes: the layout comes from a keyframe
                            return await stream_layout(client, self.model, parse_manifest(h.body, verifier=key), key)
                        if time.monotonic() > deadline:
                            raise NotFoundError(f"{self.model}: no version on {', '.join(self.urls)} after "
                                                f"{self.timeout:g} s")
                        await asyncio.sleep(0.25)
                finally:
                    await client.close()

            shapes = io.run(layout(), self.timeout + 30)
        finally:
            io.close()
        self.mirror = {n: torch.zeros(shape, dtype=dtype_info(dt).torch_dtype) for n, (dt, shape) in shapes.items()}
        self.sub = ThreadedSubscriber(self.urls, self.model, self.mirror, verifier=key, **self.subscriber_options)
        self.sub.start()

    def _wait(self, global_steps: int | None) -> int:
        want = None if global_steps is None else int(global_steps)
        deadline = time.monotonic() + self.timeout
        while True:
            v = self.sub.apply_pending(up_to=want)
            if v is not None and (want is None or v >= want):
                return v
            if time.monotonic() > deadline:
                raise SyncTimeout(f"deltasync {self.model}: at v{v} after {self.timeout:g} s waiting for "
                                  f"v{want if want is not None else '(any)'} (last error: {self.sub.status.last_error})")
            time.sleep(0.02)

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        loop = asyncio.get_running_loop()
        if self.sub is None:
            await loop.run_in_executor(None, self._start_following)
        v = await loop.run_in_executor(None, self._wait, global_steps)
        # the subscriber's per-tensor fingerprints (kept incrementally, verified against the signed manifest) say
        # which tensors this sync changed
        fps = dict(self.sub.subscriber.live.fps or {})
        changed = [n for n in self.mirror if n not in self._seen or self._seen[n] != fps.get(n)]
        log.info("deltasync %s: v%d; %d of %d tensors changed since the last sync", self.model, v, len(changed),
                 len(self.mirror))
        for n in changed:
            self._seen[n] = fps.get(n)
            yield n, self.mirror[n]

    def shutdown(self) -> None:
        if self.sub is not None:
            self.sub.close()
            self.sub = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


__all__ = ["BACKEND", "DeltaSyncCheckpointEngine"]
