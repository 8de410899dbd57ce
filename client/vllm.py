"""deltasync inside vLLM: a worker extension whose ranks patch their own (fused, sharded) weights.

Three rooms: this module (the worker extension and the driver-side helpers), :mod:`deltasync.client.vllm_layout`
(the rank's layout map read from vLLM's layer objects) and :mod:`deltasync.client.vllm_cpu` (the CPU backend's
packing hooks and the tensors a rank patches); FP8 / INT4 layers: :mod:`deltasync.client.vllm_quant`.

::

    llm = LLM(model=ckpt_dir, tensor_parallel_size=2, enforce_eager=True,
              worker_extension_cls="deltasync.client.vllm.DeltaSyncWorkerExtension")
    start(llm, ["http://relay:8701"], "policy", key_hex=KEY_HEX, version=0)  # every rank subscribes
    while serving:
        outs = llm.generate(batch, params)        # generation runs on the live weights
        apply_update(llm)                         # between batches: every ready version, all ranks or none
    wait_update(llm, 12, timeout=60)              # or: until v12 is live

The worker methods (called through ``collective_rpc``; names prefixed ``deltasync_`` so they never
collide with a worker attribute such as ``rank``): ``deltasync_start(urls, model, key_hex=None,
verify_key=None, **options)``, ``deltasync_apply()``, ``deltasync_wait(version, timeout, draft_version=None)``,
``deltasync_status()``, ``deltasync_stop()``, and ``deltasync_load_checkpoint(path)`` (vLLM's own
loader reading an HF checkpoint into the live model: the reference the tests compare against, and a
full-reload fallback). The driver-side helpers :func:`start`, :func:`apply_update`,
:func:`wait_update` call them and reset vLLM's prefix cache after the weights changed (the
cached KV blocks were computed by the old weights; only the scheduler, not a worker, can drop them).

Each rank builds its layout map from its own model (:func:`vllm_layout`: the engine's facts, read
from the layer objects of vLLM 0.32.0 — ``QKVParallelLinear`` heads/KV heads/replicas,
``MergedColumnParallelLinear.output_sizes``, ``RowParallelLinear.input_size_per_partition``,
``VocabParallelEmbedding.shard_indices``, ``RoutedExperts`` ``w13_weight``/``w2_weight`` with its
``expert_map_manager`` — the arithmetic of their ``weight_loader`` methods in
``vllm/model_executor/layers/linear.py``, ``vocab_parallel_embedding.py`` and
``fused_moe/routed_experts.py``). A parameter the map does not recognise fails closed
(:class:`~deltasync.errors.UnsupportedError` naming it).

Each rank patches its own shards through :class:`deltasync.client.sharded.ShardedApplier` over
the rank's :class:`deltasync.layout.RankLayout` (built from the model's config and the rank's TP
place by :func:`deltasync.layout.vllm_layout`, and checked against the map read from the rank's own
layer objects: any disagreement fails closed). Positions outside the rank's shard are dropped, no
full trainer tensor is built, each rank fetches only the blobs holding changes in its shard, the
ranks' partial fingerprints are combined over vLLM's TP group (gloo on CPU, the engine's group on
CUDA) and checked against the signed manifest, and every rank commits or every rank rolls back.
Before applying, the ranks agree (one all-reduce) on the newest version every rank has ready and on
the list of steps up to it, so the same steps are staged on every rank.

CPU backend: vLLM repacks unquantized linear weights after loading
(``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` in
``vllm/model_executor/layers/utils.py``): ``layer.weight`` becomes an empty tensor and a packed copy
(oneDNN handle or sgl-kernel packed tensor, captured in ``layer.cpu_linear``) is what runs. Importing
this module in a worker (vLLM resolves ``worker_extension_cls`` before loading the model) wraps that
function so it first keeps a reference to the unpacked weight (and the bias before its fp32 copy):
those are what deltasync patches, and after an apply only the layers whose tensors changed are
packed again. MoE experts likewise: ``CPUUnquantizedExperts.process_weights_after_loading`` prepacks
``w13_weight``/``w2_weight`` in place of the loaded ones; the extension keeps a copy of the loaded
weights and prepacks the changed layers again into the live parameters (:func:`install_cpu_moe_hook`;
it also requests the AMX tile state vLLM's MoE kernel uses without asking, :func:`request_amx`).
Cost: the unpacked weights stay resident (about 2x linear-weight host memory). The
packed copy is baked into a compiled graph, so on CPU the extension requires ``enforce_eager=True``
(refused otherwise). On CUDA the weights are used as they are and patched in place (CUDA graphs
keep pointing at the same memory).

Generation is paused around an apply by construction: ``collective_rpc`` runs between engine steps
(the engine core's busy loop handles it; no forward pass overlaps it). The OpenAI server: start it
with ``--worker-extension-cls deltasync.client.vllm.DeltaSyncWorkerExtension`` and
``VLLM_SERVER_DEV_MODE=1``; then ``POST /collective_rpc {"method": "deltasync_apply"}`` and
``POST /reset_prefix_cache`` (``POST /pause`` / ``/resume`` around them to drain requests first).
See docs/ENGINES.md.

A speculative draft model (``model_runner.drafter.model``) shares the target's tensors where vLLM
shares them (EAGLE's embeddings/lm_head: patched with the target); a draft with weights of its own
follows its own stream: ``deltasync_start(..., draft_model="policy-draft")``.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict

import torch

from deltasync.errors import ApplyError, UnsupportedError

from . import vllm_cpu as _cpu
from . import vllm_quant as _quant
from .vllm_cpu import (EXTENSION, install_cpu_moe_hook, install_cpu_pack_hook, live_tensors as _live_tensors, repack,
                       repack_experts, request_amx)
from .vllm_layout import Piece, rank_layout as _rank_layout, stacked_experts_in as _stacked_experts_in, vllm_layout

log = logging.getLogger("deltasync.client.vllm")

# Importing this module in a worker (vLLM resolves worker_extension_cls before loading the model) wraps vLLM's CPU
# packing so the unpacked weights are kept (client/vllm_cpu.py), and the quantized layers' loaded tensors
install_cpu_pack_hook()
install_cpu_moe_hook()
request_amx()
_quant.install_quant_hooks()  # FP8 block / INT4 layers: their loaded tensors kept (client/vllm_quant.py)


def checkpoint_files_published(files: Sequence[str]) -> None:
    """Refuse, before anything is loaded, a checkpoint file a subscriber is writing a delta into (its header's
    ``deltasync.state_fp`` says "patching": docs/CLIENT.md, the rule for readers of a ``subscribe --out`` file).
    Raises IntegrityError naming the file and the fix."""
    from deltasync.tensorfile import MappedTensorFile, check_published

    for f in files:
        with MappedTensorFile(f) as mf:
            check_published(mf.metadata, f)


# -- the worker extension --------------------------------------------------------------------------------------

def _key(key_hex: str | None, verify_key: str | None):
    from deltasync.manifest import load_key

    if key_hex and verify_key:
        raise ValueError("give key_hex or verify_key (a key file), not both")
    if verify_key:  # an Ed25519 public key (PEM; several comma-separated: a key set) or a legacy HMAC hex file
        from deltasync.keyfiles import verifier_from_options
        paths = [p.strip() for p in str(verify_key).split(",") if p.strip()]
        if b"PUBLIC KEY" in open(paths[0], "rb").read():
            return verifier_from_options(paths)
        with open(verify_key) as f:
            return load_key(f.read())
    return load_key(key_hex) if key_hex else None


def _urls(urls) -> list[str]:
    if isinstance(urls, str):  # the OpenAI server's /collective_rpc passes strings only
        return [u.strip() for u in urls.split(",") if u.strip()]
    return list(urls)


_FLOAT_OPTIONS = {"squash_timeout"}
_INT_OPTIONS = {"version", "scrub_every", "max_ready", "download_concurrency", "max_refetch", "squash_min_chain"}


def _options(options: Mapping[str, object]) -> dict[str, object]:
    out = dict(options)
    for k, v in options.items():
        if isinstance(v, str):
            if k in _INT_OPTIONS:
                out[k] = None if v.lower() == "none" else int(v)
            elif k in _FLOAT_OPTIONS:
                out[k] = float(v)
            elif k in ("use_squash", "auto", "tied_copy", "stacked_experts"):
                out[k] = v.lower() in ("1", "true", "yes")
    return out


class _RankSync:
    """One rank's subscriber over a ShardedApplier, plus what turns its applies into running weights."""

    def __init__(self, model: torch.nn.Module, hf_config, urls: list[str], stream: str, key: bytes | None,
                 options: dict[str, object], *, group, world: int, rank: int, on_cpu: bool,
                 checkpoint: str | None = None) -> None:
        from deltasync.client.sharded import ShardedApplier
        from deltasync.client.subscriber import ThreadedSubscriber

        self.stream = stream
        self.group = group
        self.world = world
        self.on_cpu = on_cpu
        self.live = _live_tensors(model)
        dtype = next(iter(self.live.values())).tensor.dtype
        tied_copy = bool(options.pop("tied_copy", True))
        stacked = options.pop("stacked_experts", None)
        if stacked is None:
            stacked = _stacked_experts_in(checkpoint)
        self.stacked_experts = bool(stacked)
        t0 = time.perf_counter()
        self.layout = _rank_layout(model, hf_config, dtype, rank, world, tied_copy=tied_copy,
                                   stacked_experts=self.stacked_experts)
        params = {n: l.tensor for n, l in self.live.items()}
        self.serving_format = _quant.serving_format(hf_config, model)
        if self.serving_format is not None:  # the stream is the engine's serving format (deltasync.quantlayout)
            from deltasync.quantlayout import serving_layout

            self.layout = serving_layout(self.layout, self.serving_format,
                                         quantized_params=_quant.quantized_weights(model))
            params.update(_quant.constants(self.layout))
        self.applier = ShardedApplier(self.layout, params, group=group if world > 1 else None)
        self.map_build_s = time.perf_counter() - t0  # the layout map, its cross-check and its offset tables, once
        self.mode = "sharded"
        options.setdefault("use_squash", world == 1)  # the ranks' steps must match one to one
        # kept tensor -> its version when its layer was last packed
        self._packed_seen = {id(l.tensor): l.tensor._version for l in self.live.values() if l.layer is not None}
        self.sub = ThreadedSubscriber(urls, stream, self.applier, verifier=key, **options)
        self.version = options.get("version")
        self.last_apply_s = self.last_repack_s = 0.0
        self.applies = 0
        self.repacked = 0
        self.needed_bytes = 0

    def _allreduce_max(self, values: list[int]) -> list[int]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def apply(self, *, deadline_passed: bool = False, up_to: int | None = None) -> tuple[int | None, bool]:
        """Apply, on every rank together, the ready steps every rank has (none past ``up_to``); returns (live
        version, any rank late)."""
        t0 = time.perf_counter()
        steps = self.sub.ready_steps()
        if up_to is not None:
            steps = [s for s in steps if s[1] <= up_to]
        live = self.sub.version
        newest = steps[-1][1] if steps else (live if live is not None else -1)
        # one all-reduce: min of the newest ready version (as -max of -v), late flag, and a digest of the step list
        up_to_neg, late = self._allreduce_max([-newest, int(deadline_passed)])
        up_to = -up_to_neg
        mine = [s for s in steps if s[1] <= up_to]
        digest = zlib.crc32(repr(mine).encode())
        lo_neg, hi = self._allreduce_max([-digest, digest])
        if -lo_neg != hi or not mine:
            return self.sub.version, bool(late)  # nothing every rank has, or the ranks' steps differ: wait
        before = self.sub.version
        v = self.sub.apply_pending(up_to=up_to)
        t1 = time.perf_counter()
        self._repack_changed()
        if v != before:
            self.applies += 1
            self.last_apply_s = time.perf_counter() - t0
            self.last_repack_s = time.perf_counter() - t1
            self.needed_bytes = getattr(self.applier, "last_needed_bytes", 0)
        self.version = v
        return v, bool(late)

    def _repack_changed(self) -> int:
        """Pack again (CPU) every layer one of whose kept tensors changed since it was last packed."""
        changed = {id(l.layer): l.layer for l in self.live.values()
                   if l.layer is not None and l.tensor._version != self._packed_seen.get(id(l.tensor))
                   and (self.on_cpu or hasattr(l.layer, "_deltasync_quant"))}
        for layer in changed.values():
            if hasattr(layer, "_deltasync_quant"):  # vLLM's own processing of the patched loaded tensors
                _quant.reprocess(layer)
            elif hasattr(layer, "_deltasync_moe_isa"):
                repack_experts(layer)
            else:
                repack(layer)
        for l in self.live.values():
            if l.layer is not None and id(l.layer) in changed:
                self._packed_seen[id(l.tensor)] = l.tensor._version
        self.repacked += len(changed)
        return len(changed)

    def status(self) -> dict:
        s = asdict(self.sub.status)
        s.update(engine_version=self.sub.version, mode=self.mode, last_apply_s=self.last_apply_s,
                 last_repack_s=self.last_repack_s, map_build_s=self.map_build_s, stream_tensors=len(self.layout.stream),
                 engine_applies=self.applies, repacked_layers=self.repacked, needed_bytes=self.needed_bytes)
        return s

    def close(self) -> None:
        self.sub.close()


class DeltaSyncWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); methods run on every rank through
    ``collective_rpc``. See the module docstring."""

    # -- helpers (prefixed: the worker class must not already have these names) --
    def _deltasync_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _deltasync_facts(self) -> tuple[object, int, int, bool]:
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.platforms import current_platform

        g = get_tp_group()
        return g.cpu_group, g.world_size, g.rank_in_group, current_platform.is_cpu()

    def deltasync_start(self, urls, model: str, key_hex: str | None = None, verify_key: str | None = None,
                        **options) -> dict:
        """Start following ``model`` on ``urls`` (a list, or a comma-separated string); ``options`` go to the
        Subscriber (``version=N``: the engine was loaded from version N's checkpoint, checked, not fetched)."""
        if getattr(self, "_deltasync", None) is not None:
            raise RuntimeError("deltasync_start: already started on this rank; call deltasync_stop first")
        group, world, rank, on_cpu = self._deltasync_facts()
        if on_cpu:
            mode = self.vllm_config.compilation_config.mode
            if int(getattr(mode, "value", mode) or 0) != 0:
                raise UnsupportedError(
                    f"vLLM on CPU compiles the model (compilation mode {mode}); the packed weights are baked into the "
                    "graph and could not be updated. Start the LLM with enforce_eager=True")
            if not _cpu.pack_hook_installed():
                raise UnsupportedError("the CPU pack hook is not installed; pass worker_extension_cls to LLM(...)")
        options = _options(options)
        draft_stream = options.pop("draft_model", None)
        key = _key(key_hex, verify_key)
        urls = _urls(urls)
        mcfg = self.vllm_config.model_config
        main = draft = None
        try:  # a start that fails (a wrong key, no draft model) leaves the rank not started: it may start again
            main = _RankSync(self._deltasync_model(), mcfg.hf_config, urls, model, key, dict(options), group=group,
                             world=world, rank=rank, on_cpu=on_cpu, checkpoint=mcfg.model)
            if draft_stream:
                dmodel = getattr(getattr(self.model_runner, "drafter", None), "model", None)
                if dmodel is None:
                    raise UnsupportedError(f"draft_model={draft_stream!r}: no speculative draft model is loaded on "
                                           "this rank")
                dcfg = self.vllm_config.speculative_config.draft_model_config
                draft = _RankSync(dmodel, dcfg.hf_config, urls, draft_stream, key, dict(options), group=group,
                                  world=world, rank=rank, on_cpu=on_cpu, checkpoint=dcfg.model)
            main.sub.start()
            if draft is not None:
                draft.sub.start()
        except BaseException:
            for sync in (main, draft):
                if sync is not None:
                    sync.close()
            raise
        self._deltasync, self._deltasync_draft = main, draft
        return {"rank": rank, "world": world, "mode": self._deltasync.mode, "tensors": len(self._deltasync.layout.stream)}

    def deltasync_apply(self) -> int | None:
        """Apply every version ready on every rank (all ranks or none); returns the live version."""
        sync = self._deltasync_require()
        v, _ = sync.apply()
        if self._deltasync_draft is not None:
            self._deltasync_draft.apply()
        return v

    def deltasync_wait(self, version, timeout=60.0, draft_version=None) -> int:
        """Apply until ``version`` (or newer) is live on every rank (and, with a draft model following its own
        stream, ``draft_version`` on the draft); raises SyncTimeout after ``timeout`` s."""
        from deltasync.errors import UpstreamTimeout as SyncTimeout

        sync = self._deltasync_require()
        draft = self._deltasync_draft
        version, timeout = int(version), float(timeout)
        want_draft = None if draft_version is None or draft is None else int(draft_version)
        deadline = time.monotonic() + timeout
        while True:
            late_now = time.monotonic() > deadline
            v, late = sync.apply(deadline_passed=late_now)
            dv = None
            if draft is not None:
                dv, dlate = draft.apply(deadline_passed=late_now)
                late = late or dlate
            if v is not None and v >= version and (want_draft is None or (dv is not None and dv >= want_draft)):
                return v
            if late:  # decided together: every rank leaves on the same round
                raise SyncTimeout(f"{sync.stream}: at v{v} (draft: v{dv}) after {timeout:.0f} s waiting for v{version}"
                                  f"{'' if want_draft is None else f' (draft v{want_draft})'} "
                                  f"(last error: {sync.sub.status.last_error})")
            time.sleep(0.02)

    def deltasync_status(self) -> dict:
        sync = self._deltasync_require()
        s = sync.status()
        if self._deltasync_draft is not None:
            s["draft"] = self._deltasync_draft.status()
        return s

    def deltasync_stop(self) -> None:
        for sync in (getattr(self, "_deltasync", None), getattr(self, "_deltasync_draft", None)):
            if sync is not None:
                sync.close()
        self._deltasync = self._deltasync_draft = None

    def deltasync_load_checkpoint(self, path: str) -> int:
        """vLLM's own loader (``model.load_weights``) reads the HF safetensors under ``path`` into the live model
        (into the kept unpacked weights on CPU, then every packed layer is rebuilt). Returns the tensors loaded.
        The subscriber's tracked fingerprints are not touched: load the version it is at, or stop it first."""
        import glob
        import os

        from safetensors.torch import load_file

        model = self._deltasync_model()
        packed = [m for m in model.modules() if hasattr(m, "_deltasync_weight")]
        for m in packed:
            m.weight = m._deltasync_weight
            if m._deltasync_bias is not None:
                m.bias.data = m._deltasync_bias
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        checkpoint_files_published(files)  # a `subscribe --out` file caught mid-apply is refused, nothing loaded
        weights: list[tuple[str, torch.Tensor]] = []
        for f in files:
            weights.extend(load_file(f).items())
        with torch.no_grad():
            loaded = model.load_weights(weights)
            _cpu.pack_after_load(model, packed)
        return len(loaded) if loaded is not None else len(weights)

    def deltasync_layout(self) -> dict[str, list[dict]]:
        """Engine name -> the trainer pieces this rank holds (the layout map, as plain data)."""
        sync = getattr(self, "_deltasync", None)
        stacked = (sync.stacked_experts if sync is not None
                   else _stacked_experts_in(self.vllm_config.model_config.model))
        out: dict[str, list[dict]] = {}
        for ps in vllm_layout(self._deltasync_model(), stacked_experts=stacked).values():
            for p in ps:
                out.setdefault(p.engine, []).append(asdict(p))
        return out

    def deltasync_fingerprints(self, draft=False, packed=False) -> dict[str, str]:
        """Engine name -> fingerprint of this rank's live tensor (the unpacked copy on CPU): for tests and audits.
        ``draft=True``: of the speculative draft model's tensors instead. ``packed=True``: of every parameter as the
        model holds it (on CPU the packed MoE experts the kernel runs; a packed linear layer's emptied weight is
        left out)."""
        from deltasync.fingerprint import fp_hex, tensor_fingerprint

        model = self._deltasync_model()
        if draft:
            model = getattr(getattr(self.model_runner, "drafter", None), "model", None)
            if model is None:
                raise UnsupportedError("deltasync_fingerprints(draft=True): no speculative draft model is loaded")
        if packed:
            return {n: fp_hex(tensor_fingerprint(p.detach())) for n, p in model.named_parameters() if p.numel()}
        return {n: fp_hex(tensor_fingerprint(l.tensor)) for n, l in _live_tensors(model).items()}

    def _deltasync_require(self) -> _RankSync:
        sync = getattr(self, "_deltasync", None)
        if sync is None:
            raise RuntimeError("deltasync is not started on this rank: call collective_rpc('deltasync_start', ...) first")
        return sync


# -- the driver's side (the process holding the LLM) ---------------------------------------------------------

def _one(results: Sequence, what: str):
    values = set(results)
    if len(values) != 1:
        raise ApplyError(f"{what}: the ranks disagree ({list(results)}); the engine must not serve until they agree")
    return results[0]


def start(llm, urls: str | Sequence[str], model: str, *, key_hex: str | None = None, verify_key: str | None = None,
          **options) -> list[dict]:
    """``deltasync_start`` on every rank of ``llm`` (a ``vllm.LLM`` built with ``worker_extension_cls=EXTENSION``)."""
    return llm.collective_rpc("deltasync_start", kwargs=dict(urls=list(_urls(urls)), model=model, key_hex=key_hex,
                                                            verify_key=verify_key, **options))


def apply_update(llm) -> int | None:
    """Apply every ready version on every rank; reset the prefix cache if the weights changed."""
    before = getattr(llm, "_deltasync_version", None)
    v = _one(llm.collective_rpc("deltasync_apply"), "deltasync_apply")
    if v != before:
        llm.reset_prefix_cache()
        llm._deltasync_version = v
    return v


def wait_update(llm, version: int, timeout: float = 60.0, *, draft_version: int | None = None) -> int:
    """Apply until ``version`` is live on every rank (and ``draft_version`` on a draft model following its own
    stream), then reset the prefix cache."""
    kw = {"version": version, "timeout": timeout}
    if draft_version is not None:
        kw["draft_version"] = draft_version
    v = _one(llm.collective_rpc("deltasync_wait", kwargs=kw), "deltasync_wait")
    if v != getattr(llm, "_deltasync_version", None):
        llm.reset_prefix_cache()
        llm._deltasync_version = v
    return v


def status(llm) -> list[dict]:
    return llm.collective_rpc("deltasync_status")


__all__ = ["EXTENSION", "DeltaSyncWorkerExtension", "Piece", "apply_update", "install_cpu_moe_hook",
           "install_cpu_pack_hook", "repack", "repack_experts", "request_amx", "start", "status", "vllm_layout",
           "wait_update"]
