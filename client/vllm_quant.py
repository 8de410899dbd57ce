"""vLLM serving FP8 block or INT4 weights: what the worker extension patches, and how it becomes what runs.

A quantized linear layer in vLLM 0.32.0 is loaded in the checkpoint's layout (``Fp8LinearMethod.create_weights``:
``weight`` float8_e4m3fn [N, K] + ``weight_scale_inv`` float32 [N/128, K/128]; ``CompressedTensorsWNA16``:
``weight_packed`` int32 [N, K/8] + ``weight_scale`` [N, K/group] + ``weight_shape``), fused and TP-sharded by
the layers' weight loaders exactly as the bf16 weights are, and then rewritten by its quant method's
``process_weights_after_loading`` into whatever its kernel reads. On CPU that is a lot: the FP8 block kernel
(``CPUFp8BlockScaledMMKernel``) VNNI-prepacks the weight (``convert_weight_packed``); the INT4 kernel
(``CPUWNA16LinearKernel``) transposes, repacks to output-packed words in 16-channel blocks or, on AMX (w4a8),
to uint8 blocks with float32 scales and invented zero points. None of that can be patched position by position.

So, as for the CPU backend's packed bf16 weights (client/vllm.py), the extension keeps what the loader made:
:func:`install_quant_hooks` wraps ``Fp8LinearMethod.process_weights_after_loading`` and
``CompressedTensorsLinearMethod.process_weights_after_loading`` so that, for an engine that syncs through
deltasync, a copy of each layer's loaded tensors is kept first (``layer._deltasync_loaded``). Those copies are
what the stream patches (the serving layout map, :func:`deltasync.quantlayout.serving_layout`, places the
quantized checkpoint tensors in them as vLLM's loaders do), and after an apply every changed layer is run
through vLLM's own ``process_weights_after_loading`` again (:func:`reprocess`: on a scratch copy of the layer
holding copies of the patched tensors), its results copied into the live parameters in place. The live
parameters therefore hold exactly what vLLM's loader makes of that step's quantized checkpoint. Cost: the
loaded tensors stay resident (about 1x the quantized weights) and a changed layer is re-processed whole.

``weight_shape`` (INT4) is a checkpoint constant vLLM's kernels never read: the map keeps the stream's copy in
small tensors of its own (:data:`deltasync.quantlayout.CONST_PREFIX`) and the engine's parameter is left alone;
the zero points the AMX path invents are outputs of ``process_weights_after_loading``, rewritten with it. An INT4
layer's bias is kept with its words (the AMX path turns it to float32 in place): the stream patches the loaded bf16
copy and the re-processing makes the float32 one.

MoE experts the same way: ``Fp8MoEMethod`` (block-quantized: ``w13_weight`` float8_e4m3fn [E, 2I/tp, H] +
``w13_weight_scale_inv`` float32 [E, 2I/tp/128, H/128], ``w2_weight`` [E, H, I/tp] + its scales) and
``CompressedTensorsWNA16MoEMethod`` (INT4 symmetric groups: ``w13_weight_packed`` int32 [E, 2I/tp, H/8] +
``w13_weight_scale`` [E, 2I/tp, H/group], ``w2_...``), filled by ``FusedMoE.weight_loader`` from per-expert
checkpoint tensors (``experts.{e}.gate_proj.weight`` + ``_scale_inv`` / ``_packed`` + ``_scale``) at the bf16
experts' places (gate rows first, then up; TP shards of the intermediate dim; local experts under EP): their
loaded tensors are kept by a hook on the method's ``process_weights_after_loading``, placed by the bf16 expert
pieces (client/vllm_layout.py) scaled down by the block or the packing, and after an apply the layer is processed
again and the method's kernel rebuilt from the live parameters. The per-expert ``w13_weight_shape`` constants
are left alone, as ``weight_shape`` is.

Not mapped (fail closed, naming the parameter): MoE experts with biases, FP8 MoE scales vLLM refines to a finer
block (an intermediate size per rank not a multiple of the block), stacked-expert streams
(``experts.gate_up_proj``: 3-D, no quantized layout), other quant methods and schemes.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections import OrderedDict

import torch

from deltasync.errors import UnsupportedError

log = logging.getLogger("deltasync.client.vllm_quant")

#: per quant method: the loaded tensors kept (the ones the stream feeds), and the rest of its parameters
_FP8_KEPT = ("weight", "weight_scale_inv")
_INT4_KEPT = ("weight_packed", "weight_scale")
_INT4_OTHERS = ("weight_shape", "weight_zero_point")
# checkpoint constants the kernels do not read: never written back
_CONSTANTS = ("weight_shape", "w13_weight_shape", "w2_weight_shape")
#: MoE experts (``Fp8MoEMethod``, block-quantized): the stacked loaded tensors kept, per fused projection
_FP8_MOE_KEPT = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
#: MoE experts (``CompressedTensorsWNA16MoEMethod``, INT4 pack-quantized): the packed words and group scales
_INT4_MOE_KEPT = ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")
_MOE_WEIGHTS = ("w13_weight", "w2_weight")
_MOE_METHODS = ("Fp8MoEMethod", "CompressedTensorsWNA16MoEMethod")

_ORIGINALS: dict[type, object] = {}


def _kind(layer) -> str | None:
    """"fp8-block" | "int4" | None (not a quantized layer this module knows)."""
    qm = getattr(layer, "quant_method", None)
    name = type(qm).__name__ if qm is not None else ""
    if name == "Fp8LinearMethod" and getattr(qm, "block_quant", False):
        return "fp8-block"
    biased = getattr(getattr(qm, "moe", None), "has_bias", False)
    if name == "Fp8MoEMethod" and getattr(qm, "block_quant", False) and not biased:
        # the experts in the checkpoint's own blocks (no scales refined to a finer block for the TP shard)
        return "fp8-block" if getattr(qm, "weight_scale_refine", None) is None else None
    if (name == "CompressedTensorsWNA16MoEMethod" and getattr(qm, "symmetric", False) and not biased
            and getattr(qm, "num_bits", 0) == 4 and getattr(qm, "strategy", None) == "group"
            and getattr(qm, "group_size", 0) > 0
            and getattr(getattr(qm, "wna16_backend", None), "name", "") != "ZEN_CPU"):  # zentorch repacks in place
        return "int4"
    if name == "CompressedTensorsLinearMethod" and type(getattr(layer, "scheme", None)).__name__ == "CompressedTensorsWNA16":
        scheme = layer.scheme
        if getattr(scheme, "symmetric", True) and getattr(scheme, "pack_factor", 8) == 8 and scheme.group_size > 0:
            return "int4"
    return None


def _is_moe(layer) -> bool:
    return type(getattr(layer, "quant_method", None)).__name__ in _MOE_METHODS


def _kept_names(kind: str, layer=None) -> tuple[str, ...]:
    if layer is not None and _is_moe(layer):
        return _FP8_MOE_KEPT if kind == "fp8-block" else _INT4_MOE_KEPT
    return _FP8_KEPT if kind == "fp8-block" else _INT4_KEPT


def keeps_weights() -> bool:
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


def install_quant_hooks() -> bool:
    """Wrap the two quant methods' ``process_weights_after_loading`` so an engine syncing through deltasync keeps
    each quantized layer's loaded tensors (idempotent; never imports vLLM itself)."""
    if "vllm" not in sys.modules:
        return False
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsLinearMethod)
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 import (  # noqa: E501
            CompressedTensorsWNA16MoEMethod)
        from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod
    except ImportError:  # pragma: no cover - a vLLM without them has nothing here to keep
        return False
    for cls in (Fp8LinearMethod, CompressedTensorsLinearMethod, Fp8MoEMethod, CompressedTensorsWNA16MoEMethod):
        if cls in _ORIGINALS or getattr(cls.process_weights_after_loading, "_deltasync", False):
            continue
        original = cls.process_weights_after_loading

        def keeping(self, layer, _original=original):
            kind = _kind(layer)
            if kind is not None and keeps_weights() and not hasattr(layer, "_deltasync_loaded"):
                kept = {}
                names = _kept_names(kind, layer)
                if kind == "int4" and not _is_moe(layer) and getattr(layer, "bias", None) is not None:
                    names += ("bias",)  # the CPU INT4 kernel turns it to float32 in place: patch the loaded copy
                for n in names:
                    p = getattr(layer, n)
                    if p.is_meta:
                        break
                    kept[n] = (p, p.detach().clone())
                else:
                    object.__setattr__(layer, "_deltasync_loaded", kept)
                    object.__setattr__(layer, "_deltasync_quant", kind)
                    if _is_moe(layer):  # what processing adds (CPU INT4 MoE: zero points) is not an input of it
                        object.__setattr__(layer, "_deltasync_load_names", tuple(layer._parameters))
            return _original(self, layer)

        keeping._deltasync = True
        cls.process_weights_after_loading = keeping
        _ORIGINALS[cls] = original
    return True


def bf16_view(mod, pname: str) -> tuple[str, tuple[int, ...]] | None:
    """A quantized layer's parameter as the bf16 layout map sees it: ``("weight", unquantized shape)`` for the
    weight itself, None for what derives from it (scales, packed words' companions, constants). Raises
    UnsupportedError for a quantized layer this module does not map (or whose loaded tensors were not kept)."""
    kind = getattr(mod, "_deltasync_quant", None)
    if kind is None:
        qm = type(getattr(mod, "quant_method", None)).__name__
        raise UnsupportedError(
            f"{pname} of a {type(mod).__name__}: quantized ({qm}{'' if _kind(mod) else ', not FP8 block / INT4 pack-quantized'}); "
            "deltasync patches FP8 block (fp8 with weight_block_size) and compressed-tensors INT4 pack-quantized "
            "linear layers and MoE experts (without biases; FP8 MoE in whole checkpoint blocks per rank) whose loaded "
            "tensors the extension kept (pass worker_extension_cls to LLM(...))")
    loaded = mod._deltasync_loaded
    if _is_moe(mod):  # stacked experts [E, 2I/tp, H] / [E, H, I/tp]: placed by vllm_layout's expert pieces
        if kind == "fp8-block" and pname in _MOE_WEIGHTS:
            return pname, tuple(loaded[pname][1].shape)
        if kind == "int4" and pname in ("w13_weight_packed", "w2_weight_packed"):
            e, rows, words = loaded[pname][1].shape
            return pname[: -len("_packed")], (e, rows, words * 8)
        if pname in ("w13_weight_scale_inv", "w2_weight_scale_inv", "w13_weight_scale", "w2_weight_scale",
                     "w13_weight_shape", "w2_weight_shape", "w13_weight_zero_point", "w2_weight_zero_point"):
            return None
        raise UnsupportedError(f"{pname}: a parameter of {kind} MoE experts the serving layout map does not know")
    if pname == "bias":  # unquantized, placed as it is
        return "bias", tuple(mod.bias.shape)
    if kind == "fp8-block":
        if pname == "weight":
            return "weight", tuple(loaded["weight"][1].shape)
        if pname == "weight_scale_inv":
            return None
    else:
        if pname == "weight_packed":
            rows, words = loaded["weight_packed"][1].shape
            return "weight", (rows, words * 8)
        if pname in ("weight_scale",) + _INT4_OTHERS:
            return None
    raise UnsupportedError(f"{pname}: a parameter of a {kind} layer the serving layout map does not know")


def live_tensors(mod, mname: str) -> dict[str, torch.Tensor] | None:
    """Engine name -> the kept loaded tensor to patch, for a quantized layer (None for any other module)."""
    if getattr(mod, "_deltasync_quant", None) is None:
        return None
    out = {f"{mname}.{n}": t for n, (_, t) in mod._deltasync_loaded.items()}
    if getattr(mod, "bias", None) is not None and "bias" not in mod._deltasync_loaded:
        out[f"{mname}.bias"] = mod.bias.detach()
    return out


def quantized_weights(model: torch.nn.Module) -> set[str]:
    """The bf16-map names (``X.weight``; MoE experts ``X.w13_weight``, ``X.w2_weight``) of the model's kept
    quantized layers."""
    out = set()
    for m, mod in model.named_modules():
        if getattr(mod, "_deltasync_quant", None):
            out.update(f"{m}.{n}" for n in (_MOE_WEIGHTS if _is_moe(mod) else ("weight",)))
    return out


def serving_format(hf_config, model: torch.nn.Module):
    """The ServingFormat the engine loaded (from ``hf_config.quantization_config``), or None for an engine that
    serves no quantized layer this module maps."""
    from deltasync.quant import ServingFormat

    kinds = {getattr(m, "_deltasync_quant", None) for m in model.modules()} - {None}
    if not kinds:
        return None
    if len(kinds) > 1:
        raise UnsupportedError(f"the engine mixes quantized layouts {sorted(kinds)}; one serving format a stream")
    kind = kinds.pop()
    cfg = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)
    if kind == "fp8-block":
        block = tuple(cfg.get("weight_block_size") or (128, 128))
        return ServingFormat(name="fp8-block", block=(int(block[0]), int(block[1])))
    group = next((g.get("weights", {}).get("group_size") for g in (cfg.get("config_groups") or {}).values()), 32)
    return ServingFormat(name="int4", group=int(group or 32))


def constants(layout) -> dict[str, torch.Tensor]:
    """The map's constant tensors (INT4 ``weight_shape``), made from the layout: what the checkpoint holds."""
    from deltasync.quantlayout import constant_values

    return {n: torch.tensor(v, dtype=torch.int64) for n, v in constant_values(layout).items()}


def reprocess(layer: torch.nn.Module) -> None:
    """Run vLLM's ``process_weights_after_loading`` for ``layer`` on copies of its kept (patched) loaded tensors,
    and copy what it makes into the live parameters, in place. Raises ApplyError if a result's shape or dtype is
    not the live parameter's (nothing of the layer is written then)."""
    from deltasync.errors import ApplyError

    kept = layer._deltasync_loaded
    live = {n: p for n, p in layer.named_parameters(recurse=False)}
    scratch = copy.copy(layer)  # a new module object: its own __dict__; parameter and buffer dicts copied below
    scratch._parameters = OrderedDict(layer._parameters)
    load_names = getattr(layer, "_deltasync_load_names", None)
    if load_names is not None:  # the layer as the loader left it: without the parameters processing made
        scratch._parameters = OrderedDict((n, p) for n, p in layer._parameters.items() if n in load_names)
    scratch._buffers = OrderedDict(layer._buffers)
    saved = {}
    try:
        for n, (param, loaded) in kept.items():
            saved[n] = param.data
            param.data = loaded.clone()  # the loader's Parameter object (its vLLM attributes), the patched words
            scratch._parameters[n] = param
        with torch.no_grad():
            layer.quant_method.process_weights_after_loading(scratch)
        made = {n: getattr(scratch, n).detach() for n in live if isinstance(getattr(scratch, n, None), torch.Tensor)}
    finally:
        for n, data in saved.items():
            kept[n][0].data = data
    for n, p in live.items():
        t = made.get(n)
        if n in _CONSTANTS:
            continue
        if t is None or t.shape != p.shape or t.dtype != p.dtype:
            raise ApplyError(f"{n} of a {layer._deltasync_quant} layer: vLLM's processing made "
                             f"{None if t is None else (t.dtype, tuple(t.shape))}, the live parameter is "
                             f"{p.dtype} {tuple(p.shape)}; the engine's runtime layout changed — reload the checkpoint")
    with torch.no_grad():
        for n, p in live.items():
            if n in made and n not in _CONSTANTS and made[n].data_ptr() != p.data_ptr():
                p.data.copy_(made[n])
    if _is_moe(layer):
        # the scratch's processing built the method's kernel (its quant config holds the scale tensors it read):
        # build it again from the live parameters, as the engine's own load left it
        qm = layer.quant_method
        rebuild = getattr(qm, "_init_moe_kernel", None) or getattr(qm, "_setup_kernel", None)
        if rebuild is not None:
            rebuild(layer)


__all__ = ["bf16_view", "constants", "install_quant_hooks", "live_tensors", "quantized_weights", "reprocess",
           "serving_format"]
