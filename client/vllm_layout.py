"""A vLLM rank's layout map read from its own layer objects (vLLM 0.32.0), and the rank's RankLayout checked
against it: the room of :mod:`deltasync.client.vllm` that knows how vLLM shards a checkpoint's tensors.

:func:`vllm_layout` reads the engine's facts from the layer objects (``QKVParallelLinear`` heads/KV heads/replicas,
``MergedColumnParallelLinear.output_sizes``, ``RowParallelLinear.input_size_per_partition``,
``VocabParallelEmbedding.shard_indices``, ``RoutedExperts`` ``w13_weight``/``w2_weight`` with its
``expert_map_manager``: the arithmetic of their ``weight_loader`` methods); :func:`rank_layout` builds the rank's
:class:`deltasync.layout.RankLayout` from the model's config and checks the two agree (any disagreement fails
closed). No vLLM import: the layer objects are read by their attributes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from deltasync.errors import UnsupportedError

from . import vllm_quant as _quant

__all__ = ["Piece", "rank_layout", "stacked_experts_in", "vllm_layout"]


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


def rank_layout(model: torch.nn.Module, hf_config, dtype: torch.dtype, rank: int, world: int, *,
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


def stacked_experts_in(checkpoint: str | None) -> bool:
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
