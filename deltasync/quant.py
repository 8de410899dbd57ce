"""Serving formats: the quantized state an engine loads, derived from the trainer's bf16 state.

Two formats, each bit-identical to the checkpoint its users make today (``tests/quant_reference.py`` runs
the references in the engine venv and the tests compare bit for bit):

``fp8-block``  DeepSeek-V3 / vLLM block FP8: every quantized ``X.weight`` becomes ``float8_e4m3fn`` and gains
               ``X.weight_scale_inv`` (float32, one per 128x128 block, ``ceil(rows/128) x ceil(cols/128)``):
               vLLM's ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``, DeepGEMM's reference): block
               amax of ``|w|`` in float32, clamped to 1e-4, ``s = amax / 448``, ``q = fp8(w * (1 / s))``.
               The checkpoint's ``quantization_config`` is vLLM's ``fp8`` method with ``weight_block_size``.
``int4``       compressed-tensors ``pack-quantized`` (Kimi-K2-Thinking): symmetric INT4 in groups of 32 along
               the input dimension; ``X.weight`` becomes ``X.weight_packed`` (int32, 8 values a word, the
               first value in the low nibble, each stored as ``q + 8``), ``X.weight_scale`` (bfloat16,
               ``rows x cols/32``) and ``X.weight_shape`` (int64 ``[rows, cols]``). Scales and values follow
               compressed-tensors' ``calculate_qparams`` / ``quantize`` / ``pack_to_int32`` in the weight's
               own dtype: ``s = max(|min(g, 0)|, |max(g, 0)|) / 7.5`` (a zero scale becomes bf16's eps),
               ``q = clamp(round(w / s), -8, 7)``.

Which tensors stay as they are follows the checkpoint's quantization config: only 2-D ``*.weight`` tensors
of modules not in ``ignore`` are quantized. ``ignore`` entries are compressed-tensors' (``re:`` + a regular
expression matched from the start of the module name) or module names matched at a component boundary
(``lm_head`` matches ``lm_head``, ``mlp.gate`` matches ``model.layers.3.mlp.gate`` but not ``mlp.gate_proj``).
:data:`DEFAULT_IGNORE` keeps embeddings, ``lm_head`` and MoE routers (``mlp.gate``, ``shared_expert_gate``)
in bf16; norms and biases are 1-D and never quantized.

Pure torch: no engine import, no I/O. Quantizing is a pass over the whole tensor; :func:`serving_state`
quantizes every tensor, :class:`ServingDeriver` (what the publisher uses) only the tensors whose bf16 words
changed since the last call, so a step costs O(changed tensors).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .errors import UnsupportedError

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: vLLM's get_fp8_min_max() off ROCm
FP8_SCALE_FLOOR = 1e-4  # per_block_cast_to_fp8's clamp of the block amax
INT4_BITS = 4
INT4_PACK = 32 // INT4_BITS  # values per int32 word

DEFAULT_IGNORE: tuple[str, ...] = ("lm_head", "re:.*embed_tokens$", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServingFormat:
    """A serving format and its parameters; ``name`` is what ``--serve-format`` takes and manifests carry."""

    name: str  # "fp8-block" | "int4"
    block: tuple[int, int] = (128, 128)  # fp8-block: rows x cols of one scale's block
    group: int = 32  # int4: values per scale along the input dimension
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    _patterns: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise UnsupportedError(f"serving format {self.name!r}: known formats are {', '.join(FORMATS)}")
        if self.name == "int4" and (self.group <= 0 or self.group % INT4_PACK):
            raise UnsupportedError(f"int4 group size {self.group}: must be a positive multiple of {INT4_PACK}")
        if self.name == "fp8-block" and (min(self.block) <= 0):
            raise UnsupportedError(f"fp8-block block {self.block}: both sides must be positive")
        pats = tuple(re.compile(e[3:]) if e.startswith("re:") else e for e in self.ignore)
        object.__setattr__(self, "_patterns", pats)

    def quantizes(self, name: str, shape: Iterable[int]) -> bool:
        """Whether trainer tensor ``name`` of ``shape`` is quantized (else it is carried as it is)."""
        if not name.endswith(".weight") or len(tuple(shape)) != 2:
            return False
        module = name[: -len(".weight")]
        for p in self._patterns:
            if isinstance(p, str):
                if module == p or module.endswith("." + p):
                    return False
            elif p.match(module):
                return False
        return True

    def quantization_config(self) -> dict:
        """The ``quantization_config`` of a Hugging Face ``config.json`` for a checkpoint in this format."""
        if self.name == "fp8-block":
            return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": list(self.block),
                    "modules_to_not_convert": [e for e in self.ignore if not e.startswith("re:")]}
        return {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": INT4_BITS, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": self.group, "dynamic": False, "actorder": None, "observer": "minmax",
                            "block_structure": None, "observer_kwargs": {}}}},
            "ignore": list(self.ignore), "kv_cache_scheme": None,
        }


FORMATS = ("fp8-block", "int4")


# -- FP8 block ---------------------------------------------------------------------------------------------------

def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight float8_e4m3fn, weight_scale_inv float32)`` of a 2-D weight: vLLM's ``per_block_cast_to_fp8``
    op for op (pad to whole blocks with zeros, float32 block amax clamped to 1e-4, ``s = amax / 448``,
    ``fp8(w * (1 / s))``)."""
    if w.dim() != 2:
        raise UnsupportedError(f"fp8-block quantizes 2-D weights, got shape {tuple(w.shape)}")
    m, n = w.shape
    bm, bn = block
    pm, pn = -(-m // bm) * bm, -(-n // bn) * bn
    padded = torch.zeros((pm, pn), dtype=w.dtype, device=w.device)
    padded[:m, :n] = w
    view = padded.view(-1, bm, pn // bn, bn)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(FP8_SCALE_FLOOR)
    sf = amax / FP8_MAX
    q = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
    return q.view_as(padded)[:m, :n].contiguous(), sf.view(view.size(0), view.size(2))


def fp8_block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float32 ``q * s`` per block (for checks and reports; engines do this in their kernels)."""
    m, n = q.shape
    s = scale_inv.repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :n]
    return q.float() * s


# -- INT4 pack-quantized (compressed-tensors) --------------------------------------------------------------------

def int4_group_quantize(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 in [-8, 7], scale in w's dtype)`` of a 2-D weight, grouped along the last dimension:
    compressed-tensors' min-max ``calculate_qparams`` (symmetric) and ``quantize`` in the weight's dtype."""
    if w.dim() != 2 or w.shape[1] % group:
        raise UnsupportedError(f"int4 quantizes 2-D weights whose columns are a multiple of {group}, "
                               f"got shape {tuple(w.shape)}")
    g = w.unflatten(-1, (w.shape[1] // group, group))
    mn = torch.amin(g, dim=-1)
    mx = torch.amax(g, dim=-1)
    mn = torch.min(mn, torch.zeros_like(mn))
    mx = torch.max(mx, torch.zeros_like(mx))
    scale = torch.max(torch.abs(mn), torch.abs(mx)) / (float(2 ** INT4_BITS - 1) / 2)
    eps = torch.finfo(scale.dtype).eps
    scale = torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype, device=scale.device), scale)
    scaled = g / scale.unsqueeze(-1)
    q = torch.round(torch.clamp(scaled, -(2 ** (INT4_BITS - 1)), 2 ** (INT4_BITS - 1) - 1))
    return q.to(w.dtype).to(torch.int8).flatten(start_dim=-2), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` (4 bits, packed along dim 1): ``q + 8`` as nibbles, value ``i`` of
    a word at bits ``4i``."""
    rows, cols = q.shape
    v = (q + (1 << (INT4_BITS - 1))).to(torch.uint8)
    padded = -(-cols // INT4_PACK) * INT4_PACK
    if padded != cols:
        v = torch.nn.functional.pad(v, (0, padded - cols))
    words = v.view(rows, padded // INT4_PACK, INT4_PACK).to(torch.int32)
    shifts = torch.arange(INT4_PACK, device=q.device, dtype=torch.int32) * INT4_BITS
    return (words << shifts).sum(dim=2, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int8 values of :func:`pack_int4`'s words (the first ``cols`` of each row)."""
    shifts = torch.arange(INT4_PACK, device=packed.device, dtype=torch.int32) * INT4_BITS
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nib.flatten(start_dim=-2)[:, :cols] - (1 << (INT4_BITS - 1))).to(torch.int8)


def int4_pack_quantize(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weight_packed int32, weight_scale, weight_shape int64)`` of a 2-D weight, as compressed-tensors'
    ``PackedQuantizationCompressor.compress`` writes them."""
    q, scale = int4_group_quantize(w, group)
    return pack_int4(q), scale, torch.tensor(tuple(w.shape), dtype=torch.int64)


# -- whole states ------------------------------------------------------------------------------------------------

def serving_names(fmt: ServingFormat, name: str, shape: Iterable[int]) -> tuple[str, ...]:
    """The serving-state names trainer tensor ``name`` becomes (itself when it is not quantized)."""
    if not fmt.quantizes(name, shape):
        return (name,)
    base = name[: -len(".weight")]
    if fmt.name == "fp8-block":
        return (name, base + ".weight_scale_inv")
    return (base + ".weight_packed", base + ".weight_scale", base + ".weight_shape")


def quantize_tensor(fmt: ServingFormat, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Trainer tensor ``name`` in the serving format: ``{serving name: tensor}``; an unquantized tensor is
    returned as it is (the same object)."""
    names = serving_names(fmt, name, t.shape)
    if len(names) == 1:
        return {name: t}
    if fmt.name == "fp8-block":
        return dict(zip(names, fp8_block_quantize(t, fmt.block)))
    return dict(zip(names, int4_pack_quantize(t, fmt.group)))


def serving_state(state: Mapping[str, torch.Tensor], fmt: ServingFormat) -> dict[str, torch.Tensor]:
    """The whole serving-format state of a trainer state (what the quantized checkpoint holds)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        out.update(quantize_tensor(fmt, name, t))
    return out


def _words(t: torch.Tensor) -> torch.Tensor:
    """An integer view of a tensor's words (NaN and -0.0 compare as bits)."""
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


class ServingDeriver:
    """The serving state of successive trainer states, requantizing only the tensors that changed.

    ``derive(state)`` returns the serving state (a dict whose quantized tensors the deriver owns and updates in
    place between calls; unquantized tensors are the caller's own objects). Tensors are compared word for word
    with a copy of their previous value (one compare pass over the quantized tensors per call, no quantizing of
    a tensor whose words did not change). Not thread-safe: one caller at a time.
    """

    def __init__(self, fmt: ServingFormat) -> None:
        self.fmt = fmt
        self._last: dict[str, torch.Tensor] = {}  # trainer name -> copy of the words last quantized
        self._out: dict[str, torch.Tensor] = {}
        self.requantized = 0  # tensors requantized by the last call

    def derive(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.requantized = 0
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            names = serving_names(self.fmt, name, t.shape)
            if len(names) == 1:
                out[name] = t
                continue
            last = self._last.get(name)
            if last is None or last.shape != t.shape or last.dtype != t.dtype or not torch.equal(
                    _words(last), _words(t)):
                self._last[name] = t.detach().clone()
                fresh = quantize_tensor(self.fmt, name, t.detach())
                for n, q in fresh.items():
                    have = self._out.get(n)
                    if have is not None and have.shape == q.shape and have.dtype == q.dtype:
                        have.copy_(q)
                    else:
                        self._out[n] = q
                self.requantized += 1
            for n in names:
                out[n] = self._out[n]
        return out
