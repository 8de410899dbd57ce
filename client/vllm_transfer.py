"""deltasync as a vLLM weight-transfer backend (vLLM 0.32's ``vllm.distributed.weight_transfer``), both sides.

The inference side needs one flag and nothing else of ours (the package's ``vllm.general_plugins`` entry point,
:mod:`deltasync.client.vllm_plugin`, registers the name)::

    llm = LLM(model=ckpt_v0, tensor_parallel_size=2, weight_transfer_config={"backend": "deltasync"})
    # or: VLLM_SERVER_DEV_MODE=1 vllm serve ckpt_v0 --weight-transfer-config '{"backend": "deltasync"}'
    llm.init_weight_transfer_engine({"init_info": {"urls": ["http://relay:8701"], "model": "policy",
                                                   "key_hex": KEY_HEX, "version": 0}})
    # every step, after the trainer published version N:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": N, "timeout": 60}})   # waits until N is ready on every rank
    llm.finish_weight_update(str(N))                                      # vLLM records N: get_weight_version()
    llm.reset_prefix_cache()                                              # the caller's job offline (see below)

Over HTTP (``VLLM_SERVER_DEV_MODE=1``) the same calls are ``POST /init_weight_transfer_engine {"init_info": ...}``,
``POST /pause``, ``POST /start_weight_update``, ``POST /update_weights {"update_info": {"version": N}}``,
``POST /finish_weight_update {"weight_version": "N"}``, ``POST /resume``; ``GET /weight_info`` says N.

The worker side, :class:`DeltaSyncWeightTransferEngine` (one per rank, built by vLLM after the model loads), runs on
the machinery of the worker extension (:mod:`deltasync.client.vllm`): each rank's layout map checked against its
own layer objects, a ``ThreadedSubscriber`` per rank downloading and decoding between updates in the background,
:class:`~deltasync.client.sharded.ShardedApplier` patching the rank's shards with every rank committing or every
rank rolling back, the CPU backend's packed layers packed again after a patch.

* ``init_info``: ``urls`` (a list, or a comma-separated string), ``model`` (the stream), ``key_hex`` (a shared
  HMAC key) or ``verify_key`` (a path on the inference host: an Ed25519 public key PEM, several comma-separated
  for a key set, or an HMAC key file), ``version`` (the version the engine was loaded from: checked against the
  signed manifest, not fetched), ``draft_model`` / ``draft_version`` (a speculative draft model's own stream),
  and any other Subscriber option (``scrub_every``, ``max_ready``, ``download_concurrency``, ``read_token``,
  ``use_squash``, ``tied_copy``, ``stacked_experts``, ...; an unknown name is refused, naming the accepted ones).
* ``update_info``: ``version`` N, ``timeout`` (seconds, default 60). ``update_weights`` waits, bounded, until
  every rank has N downloaded and decoded, then applies the steps up to N (never past it) on every rank or on
  none; the ranks decide together to give up, so all raise the same :class:`~deltasync.errors.UpstreamTimeout`
  (naming the live version and the subscriber's last error). N already live: nothing to do. N older than the
  live version: refused (a stream only moves forward).
* ``start_weight_update`` / ``finish_weight_update``: bookkeeping only (the weights are patched in place;
  vLLM's layerwise reload is not used). vLLM itself records the version string passed to
  ``finish_weight_update(weight_version)`` and serves it as ``get_weight_version()`` / ``GET /weight_info``.
* ``start_draft_weight_update`` (vLLM 0.32 has it): the session's update goes to the speculative draft model,
  following its own stream (``draft_model`` in ``init_info``). vLLM hands a backend the draft model only when
  that session starts, so the draft's subscriber starts at the first draft session and prefetches in the
  background from then on.

The prefix cache: its cached KV blocks were computed by the old weights. It lives in vLLM's scheduler (the engine
core process); a worker-side backend has no path to it, so the caller drops it: over HTTP ``POST /pause``
(``clear_cache`` is on by default: in-flight requests drained, prefix cache dropped) before ``start_weight_update``
and ``POST /resume`` after ``finish_weight_update``; offline ``llm.reset_prefix_cache()`` after
``finish_weight_update``. :class:`DeltaSyncTrainerEngine` does both through its client.

The trainer side, :class:`DeltaSyncTrainerEngine` (``WeightTransferTrainerFactory.trainer_init(
DeltaSyncTrainerInitInfo(...), client=...)``): ``send_weights(state)`` publishes the state through the in-process
:class:`~deltasync.client.publisher.Publisher` (a delta, diffed against the last published state; sharded
trainers: every rank publishes its own tensors and rank 0 commits the merged manifest) and drives the servers
through a ``VLLMWeightSyncClient``: vLLM's ``HTTPVLLMWeightSyncClient`` (or :class:`HTTPClient`, which adds
``/pause`` and ``/resume``) or :class:`LLMClient` over an in-process ``vllm.LLM``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine, WeightSource,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo, materialize_full_tensor)

from deltasync.errors import ApplyError, UnsupportedError
from deltasync.errors import UpstreamTimeout as SyncTimeout

log = logging.getLogger("deltasync.client.vllm_transfer")

BACKEND = "deltasync"
DEFAULT_UPDATE_TIMEOUT = 60.0

# Subscriber options init_info may carry beside the named fields (JSON-typed: the HTTP route passes JSON)
_RANK_OPTIONS = {"tied_copy", "stacked_experts"}
_SET_BY_US = {"urls", "model", "target", "key", "verifier", "version", "on_event", "on_applied", "ssl", "timeouts",
              "self", "auto"}


def _subscriber_options() -> set[str]:
    from deltasync.client.subscriber import Subscriber

    return {n for n in inspect.signature(Subscriber.__init__).parameters if n not in _SET_BY_US} | _RANK_OPTIONS


# -- the inference side ------------------------------------------------------------------------------------------

@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    """``init_info`` of the ``deltasync`` backend (see the module docstring)."""

    urls: list[str] | str
    model: str
    key_hex: str | None = None
    verify_key: str | None = None
    version: int | None = None
    draft_model: str | None = None
    draft_version: int | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the other Subscriber options


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of the ``deltasync`` backend: the version to make live, and how long to wait for it."""

    version: int
    timeout: float = DEFAULT_UPDATE_TIMEOUT


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    """One rank's deltasync backend (see the module docstring)."""

    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        from deltasync.client import vllm as dsv
        from deltasync.client.vllm_cpu import pack_hook_installed

        self._dsv = dsv
        self.on_cpu = torch.device(device).type == "cpu"
        if self.on_cpu:
            mode = vllm_config.compilation_config.mode
            if int(getattr(mode, "value", mode) or 0) != 0:
                raise UnsupportedError(
                    f"weight transfer backend 'deltasync': vLLM on CPU compiles the model (compilation mode {mode}); "
                    "the packed weights are baked into the graph and could not be updated. Start the engine with "
                    "enforce_eager=True (vllm serve --enforce-eager)")
            if not pack_hook_installed():
                raise UnsupportedError(
                    "weight transfer backend 'deltasync': the CPU weight-keeping hook is not installed (vLLM did not "
                    "run deltasync's vllm.general_plugins entry point: is VLLM_PLUGINS leaving out 'deltasync'?)")
        self._info: DeltaSyncInitInfo | None = None
        self._target = None  # deltasync.client.vllm._RankSync
        self._draft = None
        self._session: str | None = None  # "target" | "draft" between start and finish
        self._t_start = 0.0
        self.updates = 0
        self.last_update_s = 0.0  # inside update_weights on this rank: the wait and the apply
        self.last_wait_s = 0.0  # of which waiting for the version to be ready on every rank
        self.last_session_s = 0.0  # start_weight_update to finish_weight_update

    # -- parsing ----------------------------------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> DeltaSyncInitInfo:
        known = {f.name for f in dataclasses.fields(DeltaSyncInitInfo)} - {"options"}
        accepted = _subscriber_options()
        options = dict(init_dict.get("options") or {})
        for k, v in init_dict.items():
            if k in known or k == "options":
                continue
            options[k] = v
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise ValueError(f"deltasync init_info: unknown option(s) {unknown}; accepted: "
                             f"{sorted(known)} and the Subscriber options {sorted(accepted)}")
        missing = [k for k in ("urls", "model") if not init_dict.get(k)]
        if missing:
            raise ValueError(f"deltasync init_info needs {missing} (e.g. {{\"urls\": [\"http://relay:8701\"], "
                             "\"model\": \"policy\", \"key_hex\": ..., \"version\": 0}})")
        return DeltaSyncInitInfo(**{k: init_dict[k] for k in known if k in init_dict}, options=options)

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaSyncUpdateInfo:
        try:
            info = DeltaSyncUpdateInfo(**update_dict)
            return DeltaSyncUpdateInfo(version=int(info.version), timeout=float(info.timeout))
        except (TypeError, ValueError) as e:
            raise ValueError(f"deltasync update_info must be {{\"version\": N, \"timeout\": seconds}} "
                             f"(found {update_dict!r}): {e}") from None

    # -- the lifecycle ----------------------------------------------------------------------------------------
    def _facts(self) -> tuple[object, int, int]:
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        return g.cpu_group, g.world_size, g.rank_in_group

    def _rank_sync(self, model, model_config, stream: str, version: int | None):
        dsv = self._dsv
        info = self._info
        assert info is not None
        group, world, rank = self._facts()
        options = dsv._options(dict(info.options))
        options["version"] = version
        sync = dsv._RankSync(model, model_config.hf_config, dsv._urls(info.urls), stream,
                             dsv._key(info.key_hex, info.verify_key), options, group=group, world=world, rank=rank,
                             on_cpu=self.on_cpu, checkpoint=model_config.model)
        sync.sub.start()
        return sync

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        if self._target is not None:
            raise RuntimeError("deltasync: init_weight_transfer_engine was already called on this engine; call "
                               "shutdown_weight_transfer_engine first")
        self._info = init_info
        self._target = self._rank_sync(self._default_model, self._default_model_config, init_info.model,
                                       init_info.version)
        _, world, rank = self._facts()
        log.info("deltasync: rank %d/%d follows %r on %s from v%s (%d tensors)", rank, world, init_info.model,
                 init_info.urls, init_info.version, len(self._target.layout.stream))

    def start_weight_update(self) -> None:
        if self._target is None:
            raise RuntimeError("deltasync: call init_weight_transfer_engine({'init_info': {'urls': [...], 'model': "
                               "...}}) before start_weight_update")
        draft = self.model is not self._default_model
        if draft and self._draft is None:
            info = self._info
            if not info.draft_model:
                raise UnsupportedError("deltasync: start_draft_weight_update needs the draft model's own stream: "
                                       "pass draft_model (and draft_version) in init_info")
            self._draft = self._rank_sync(self.model, self.model_config, info.draft_model, info.draft_version)
        self._session = "draft" if draft else "target"
        self._t_start = time.perf_counter()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":  # the patches were issued on the device's stream
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        if self._session is None:
            raise RuntimeError("deltasync: update_weights outside a session: call start_weight_update first")
        sync = self._draft if self._session == "draft" else self._target
        want = update_info.version
        t0 = time.perf_counter()
        live = sync.sub.version
        if live is not None and live > want:
            raise ApplyError(f"deltasync {sync.stream}: v{want} requested but v{live} is live; a stream only moves "
                             "forward (publish a newer version instead)")
        deadline = time.monotonic() + update_info.timeout
        waited = 0.0
        while True:
            late_now = time.monotonic() > deadline
            v, late = sync.apply(deadline_passed=late_now, up_to=want)
            if v is not None and v >= want:
                break
            if late:  # decided together: every rank gives up in the same round
                raise SyncTimeout(f"deltasync {sync.stream}: at v{v} after {update_info.timeout:g} s waiting for v{want} "
                                  f"to be ready on every rank (last error: {sync.sub.status.last_error})")
            time.sleep(0.02)
            waited = time.perf_counter() - t0
        self.updates += 1
        self.last_update_s = time.perf_counter() - t0
        self.last_wait_s = waited
        st = sync.sub.status
        log.info("deltasync %s: v%d live on this rank (update_weights %.4f s, of which waiting %.4f s; verify %s; "
                 "%d bytes received so far)", sync.stream, v, self.last_update_s, waited, st.verify, st.bytes_received)

    def finish_weight_update(self) -> None:
        self.last_session_s = time.perf_counter() - self._t_start
        self._session = None

    def shutdown(self) -> None:
        for sync in (self._draft, self._target):
            if sync is not None:
                sync.close()
        self._target = self._draft = self._info = None
        self._session = None

    # -- for tests and metrics (``llm.collective_rpc(rank_status)``) ----------------------------------------------
    def status(self) -> dict:
        if self._target is None:
            return {"started": False}
        s = self._target.status()
        s.update(started=True, updates=self.updates, last_update_s=self.last_update_s, last_wait_s=self.last_wait_s,
                 last_session_s=self.last_session_s)
        if self._draft is not None:
            s["draft"] = self._draft.status()
        return s


def rank_status(worker) -> dict:
    """The deltasync backend's status on one rank: ``llm.collective_rpc(rank_status)``. vLLM 0.32 sends a function
    to its workers only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickle); without it the same facts are logged
    by each rank after every update (logger ``deltasync.client.vllm_transfer``)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, DeltaSyncWeightTransferEngine):
        raise RuntimeError(f"this worker's weight transfer engine is {type(engine).__name__}, not deltasync's")
    return engine.status()


def rank_fingerprints(worker, draft: bool = False) -> dict[str, str]:
    """Engine name -> fingerprint of this rank's live tensor (the unpacked copy on CPU; ``draft``: of the speculative
    draft model): ``llm.collective_rpc(rank_fingerprints)`` (as :func:`rank_status`)."""
    from deltasync.client.vllm_cpu import live_tensors
    from deltasync.fingerprint import fp_hex, tensor_fingerprint

    model = worker.get_draft_model() if draft else worker.get_model()
    return {n: fp_hex(tensor_fingerprint(l.tensor)) for n, l in live_tensors(model).items()}


# -- the trainer side --------------------------------------------------------------------------------------------

class LLMClient:
    """A ``VLLMWeightSyncClient`` over an in-process ``vllm.LLM`` (its methods take ``{"init_info": ...}`` /
    ``{"update_info": ...}`` requests; the protocol passes the inner dicts). ``resume`` drops the prefix cache."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def pause(self) -> None:  # offline: nothing generates while the caller's thread is here
        pass

    def resume(self) -> None:
        self.llm.reset_prefix_cache()

    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


def _http_client_base():
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    return HTTPVLLMWeightSyncClient


class HTTPClient(_http_client_base()):
    """vLLM's ``HTTPVLLMWeightSyncClient`` plus ``/pause`` (draining, prefix cache dropped), ``/resume``,
    ``/start_draft_weight_update`` and ``GET /weight_info`` (needs ``VLLM_SERVER_DEV_MODE=1`` on the server)."""

    def __init__(self, base_url: str, timeout: float = 300, *, pause_mode: str = "wait") -> None:
        super().__init__(base_url, timeout)
        self.pause_mode = pause_mode

    def pause(self) -> None:
        import requests

        r = requests.post(f"{self.base_url}/pause", params={"mode": self.pause_mode, "clear_cache": "true"},
                          timeout=self.timeout)
        r.raise_for_status()

    def resume(self) -> None:
        self._post("resume")

    def start_draft_weight_update(self) -> None:
        self._post("start_draft_weight_update")

    def get_weight_version(self) -> str:
        import requests

        r = requests.get(f"{self.base_url}/weight_info", timeout=self.timeout)
        r.raise_for_status()
        return r.json()["weight_version"]


@dataclass
class DeltaSyncTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the ``deltasync`` backend.

    ``origin``: the origin the Publisher writes to (``token``: its bearer token); ``model``: the stream;
    ``urls``: what the inference servers subscribe to (relays; default ``[origin]``); signing: ``key_hex`` (a
    shared HMAC key, also sent to the servers) or ``signing_key`` (this host's path of an Ed25519 private key PEM;
    the servers get ``verify_key``, their path of the public half); ``version``: the version the servers were
    loaded from (sent as init_info's ``version``); ``dtype``: the serving dtype every tensor is cast to before
    publishing (None: as given); ``world``: trainer ranks that each hold part of the state (every rank publishes
    its own tensors, names unique across ranks; rank 0 merges and commits; ``gather`` collects the ranks' parts
    on rank 0, default ``torch.distributed.gather_object``); ``pause``: pause generation around each update
    (the client's ``pause``/``resume``, which also drop the prefix cache); ``worker_options``: other Subscriber
    options for the servers' init_info; ``publisher_options``: keyword arguments of ``Publisher``.
    """

    backend: ClassVar[str] = BACKEND

    origin: str = ""
    model: str = ""
    token: str | None = None
    urls: list[str] | None = None
    key_hex: str | None = None
    signing_key: str | None = None
    verify_key: str | None = None
    version: int = 0
    dtype: str | None = "bfloat16"
    timeout: float = 120.0
    keyframe_every: int = 20
    world: int = 1
    pause: bool = True
    gather: Callable[[bytes], list[bytes] | None] | None = None
    worker_options: dict[str, Any] = field(default_factory=dict)
    publisher_options: dict[str, Any] = field(default_factory=dict)

    def worker_init_info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"urls": list(self.urls or [self.origin]), "model": self.model, "version": self.version,
                               **self.worker_options}
        if self.key_hex:
            out["key_hex"] = self.key_hex
        if self.verify_key:
            out["verify_key"] = self.verify_key
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SendReport:
    """One ``send_weights`` round."""

    version: int
    kind: str  # "keyframe" | "delta"
    blob_bytes: int  # the version's blobs on the wire
    blocking_s: float  # publish() on the trainer's thread (the diff)
    publish_s: float  # until the version was committed on the origin
    pause_s: float  # pause .. start, update, finish .. resume, as the trainer saw it (0 on non-sender ranks)


def _gather_object(data: bytes, world: int) -> list[bytes] | None:
    import torch.distributed as dist

    out = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(data, out, dst=0)
    return out


class DeltaSyncTrainerEngine(TrainerWeightTransferEngine[DeltaSyncTrainerInitInfo]):
    """Publishes each round through deltasync and drives the inference servers through vLLM's control plane."""

    init_info_cls = DeltaSyncTrainerInitInfo

    def __init__(self, *, client, source: WeightSource | None = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info: DeltaSyncTrainerInitInfo | None = None
        self.publisher = None
        self.servers_started = False  # init_weight_transfer_engine sent (after the first version was committed)
        self._warned = False
        self.reports: list[SendReport] = []

    @classmethod
    def trainer_init(cls, init_info: DeltaSyncTrainerInitInfo, *, client, source: WeightSource | None = None):
        from deltasync.client.publisher import Publisher

        if not init_info.origin or not init_info.model:
            raise ValueError("DeltaSyncTrainerInitInfo needs origin= (the origin's URL) and model= (the stream)")
        if init_info.key_hex and init_info.signing_key:
            raise ValueError("give key_hex (HMAC) or signing_key (Ed25519), not both")
        if init_info.signing_key and not init_info.verify_key:
            raise ValueError("signing_key given without verify_key: the servers need the public half's path")
        key = None
        if init_info.key_hex:
            from deltasync.signing import load_key

            key = load_key(init_info.key_hex)
        elif init_info.signing_key:
            from deltasync.signing import load_signing_key

            with open(init_info.signing_key, "rb") as f:
                key = load_signing_key(f.read())
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        opts = {"keyframe_every": init_info.keyframe_every, **init_info.publisher_options}
        if init_info.world > 1:
            opts["commit"] = False
        self.publisher = Publisher(init_info.origin, init_info.model, init_info.token, key, **opts)
        if source is not None:  # the servers' starting version first: they check their weights against it
            self.send_weights()
        return self

    def _state(self, state) -> dict[str, torch.Tensor]:
        if state is None:
            if self.source is None:
                raise ValueError("send_weights() without a state needs a WeightSource at trainer_init(source=...)")
            state = {n: t for n, t in self.source if t is not None}
        elif isinstance(state, torch.nn.Module):
            state = state.state_dict()
        dtype = getattr(torch, self.info.dtype) if self.info.dtype else None
        return {n: (materialize_full_tensor(t).detach().to(dtype) if dtype is not None
                    else materialize_full_tensor(t).detach()).contiguous() for n, t in state.items()}

    def send_weights(self, state: Mapping[str, torch.Tensor] | torch.nn.Module | None = None, *,
                     version: int | None = None) -> SendReport:
        """Publish ``state`` (default: the trainer_init source) as ``version`` (default: the last published + 1;
        the first call: init_info's ``version``, the weights the servers were loaded from) and make every server
        serve it: pause, ``start_weight_update``, ``update_weights({"version": v})``, ``finish_weight_update(str(v))``,
        resume. The first call also sends the servers ``init_weight_transfer_engine`` (after that version is
        committed: they check their weights against it); trainer_init makes that call itself when given a
        ``source``. Every trainer rank calls it."""
        info = self.info
        t0 = time.perf_counter()
        pub = self.publisher
        if version is None:
            version = info.version if pub.version is None else pub.version + 1
        pending = pub.publish(version, self._state(state))
        if info.world > 1:
            part = pending.part(info.timeout)
            parts = (info.gather or (lambda b: _gather_object(b, info.world)))(part.to_bytes())
            if info.rank == 0:
                from deltasync.client.publisher import Part

                manifest = pub.commit([Part.from_bytes(p) for p in parts], timeout=info.timeout)
                blob_bytes = sum(b.size for b in manifest.blobs)
            else:
                blob_bytes = 0
            kind = pending.kind
        else:
            result = pending.result(info.timeout)
            blob_bytes, kind = result.blob_bytes, result.kind
        publish_s = time.perf_counter() - t0
        pause_s = 0.0
        if self.is_sender and not self.servers_started:
            # the servers were loaded from init_info's version: they start following once it is on the origin
            self.client.init_weight_transfer_engine(info.worker_init_info())
            self.servers_started = True
        if self.is_sender:
            c = self.client
            pause = getattr(c, "pause", None) if info.pause else None
            resume = getattr(c, "resume", None) if info.pause else None
            if info.pause and (pause is None or resume is None) and not self._warned:
                self._warned = True
                log.warning("deltasync: the client has no pause/resume: generation is not paused around the update "
                            "and the prefix cache is not dropped (use deltasync.client.vllm_transfer.HTTPClient)")
            t1 = time.perf_counter()
            if pause is not None:
                pause()
            try:
                c.start_weight_update()
                c.update_weights({"version": version, "timeout": info.timeout})
                c.finish_weight_update(str(version))
            finally:
                if resume is not None:
                    resume()
            pause_s = time.perf_counter() - t1
        report = SendReport(version=version, kind=kind, blob_bytes=blob_bytes, blocking_s=pending.blocking_s,
                            publish_s=publish_s, pause_s=pause_s)
        self.reports.append(report)
        return report

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


def _register_trainer_side() -> None:
    """A trainer process that never starts an engine never runs vLLM's plugins; building a
    :class:`DeltaSyncTrainerInitInfo` imports this module, which registers the trainer side here (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "DeltaSyncTrainerEngine")
    except ValueError:  # already registered (the entry point, by the same module path)
        pass


_register_trainer_side()

__all__ = ["BACKEND", "DeltaSyncInitInfo", "DeltaSyncTrainerEngine", "DeltaSyncTrainerInitInfo", "DeltaSyncUpdateInfo",
           "DeltaSyncWeightTransferEngine", "HTTPClient", "LLMClient", "SendReport", "rank_fingerprints",
           "rank_status"]
