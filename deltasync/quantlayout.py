"""Layout maps of serving-format streams: a bf16 :class:`~deltasync.layout.RankLayout` carried over to the
quantized tensors the engine loads (:mod:`deltasync.quant`).

Pure: plain data in and out. An engine's weight loader puts a quantized checkpoint's tensors where it puts the
bf16 ones (vLLM 0.32.0: ``Fp8LinearMethod.create_weights`` / ``CompressedTensorsWNA16.create_weights`` give the
weight, the block scales and the packed words ``output_dim=0`` / ``input_dim=1`` and the same fused offsets and
TP shards as the bf16 weight, scaled down by the block or the packing), so every region of a quantized weight
becomes regions of its parts:

``fp8-block``  ``X.weight`` (float8_e4m3fn): the bf16 weight's boxes as they are; ``X.weight_scale_inv``
               (float32): the same boxes in blocks (rows / 128, columns / 128). A box must start on a block
               boundary on both sides and span whole blocks, or end where both tensors end (the last, partial
               block: vLLM's ``validate_fp8_block_shape`` refuses the other cases too).
``int4``       ``X.weight_packed`` (int32): columns / 8; ``X.weight_scale`` (the weight's dtype): columns / group.
               ``X.weight_shape`` (int64 ``[rows, cols]``) is a constant of the checkpoint: vLLM loads it into a
               parameter its kernels never read (the CPU, Marlin and Machete kernels take the shape from the
               layer), so the map keeps each stream ``weight_shape`` in a small tensor of its own on every rank,
               named ``CONST_PREFIX + stream name`` (counted by rank 0): the signed fingerprints cover it, and
               the engine's own ``weight_shape`` parameters are left out of the map (:data:`ENGINE_CONSTANTS`).

A bf16 region that the format leaves unquantized (embeddings, ``lm_head``, norms, routers) is kept as it is.
An engine parameter fed by quantized and unquantized stream tensors at once, or a box that cuts a block or a
packed word, raises :class:`~deltasync.errors.UnsupportedError`: the map fails closed.
"""

from __future__ import annotations

from .errors import UnsupportedError
from .layout import RankLayout, Region
from .quant import INT4_PACK, ServingFormat

CONST_PREFIX = "deltasync.const:"
#: engine parameter suffixes that are checkpoint constants the map does not feed (see the module docstring)
ENGINE_CONSTANTS = (".weight_shape",)


def _scale_box(box, factors, full_src, full_dst, what: str, other=None, full_other=None):
    """``box`` ((start, length) per dim) divided by ``factors`` on its last dims; ``other``: the paired box on the
    other tensor (same lengths), checked the same way. Returns the divided box."""
    out = list(box[: len(box) - len(factors)])
    lead = len(box) - len(factors)
    for i, f in enumerate(factors):
        s, n = box[lead + i]
        if f == 1:
            out.append((s, n))
            continue
        ends = s + n == full_src[lead + i]
        if other is not None:
            so, _ = other[lead + i]
            ends = ends and so + n == full_other[lead + i]
            if so % f:
                raise UnsupportedError(f"{what}: its box starts at {so} in dim {lead + i}, not on a {f}-boundary")
        if s % f or (n % f and not ends):
            raise UnsupportedError(f"{what}: its box ({s}, {n}) in dim {lead + i} cuts a block of {f}; "
                                   "the engine's quantized layout cannot be patched from whole blocks of the stream")
        out.append((s // f, -(-n // f)))
    return tuple(out)


def _divided(shape, factors) -> tuple[int, ...]:
    lead = len(shape) - len(factors)
    return tuple(shape[:lead]) + tuple(-(-d // f) for d, f in zip(shape[lead:], factors))


def serving_layout(layout: RankLayout, fmt: ServingFormat, *, quantized_params=None) -> RankLayout:
    """``layout`` (a rank's map of the bf16 stream) for the stream in serving format ``fmt``.

    ``quantized_params``: the engine parameters (bf16 names) the engine actually holds quantized (an engine
    knows; vLLM skips layers its quantization config leaves out); by default those whose stream tensors
    ``fmt`` quantizes. The stream tensors feeding them are the quantized ones."""
    if fmt.name == "fp8-block":
        parts = (("", "float8_e4m3fn", (1, 1)), ("_scale_inv", "float32", fmt.block))
    else:
        parts = (("_packed", "int32", (1, INT4_PACK)), ("_scale", None, (1, fmt.group)))
    by_param: dict[str, list[Region]] = {}
    for r in layout.regions:
        by_param.setdefault(r.param, []).append(r)
    if quantized_params is None:
        quantized = {n for n, (_, shape) in layout.stream.items() if fmt.quantizes(n, shape)}
    else:
        quantized = {r.source for r in layout.regions if r.param in quantized_params}
        bad = sorted(n for n in quantized if not (n.endswith(".weight") and len(layout.stream[n][1]) == 2))
        if bad:
            raise UnsupportedError(f"{bad[0]}: the engine holds it quantized, but only 2-D weights have a "
                                   f"{fmt.name} layout")
    stream: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, (dt, shape) in layout.stream.items():
        if name not in quantized:
            stream[name] = (dt, shape)
            continue
        base = name[: -len(".weight")] + ".weight"
        for suffix, sdt, factors in parts:
            stream[base + suffix] = (sdt or dt, _divided(shape, factors))
        if fmt.name == "int4":
            stream[name[: -len(".weight")] + ".weight_shape"] = ("int64", (2,))
    params: dict[str, tuple[str, tuple[int, ...]]] = {}
    regions: list[Region] = []
    for pname, (pdt, pshape) in layout.params.items():
        rs = by_param.get(pname, [])
        kinds = {r.source in quantized for r in rs}
        if kinds != {True}:
            if True in kinds:
                raise UnsupportedError(f"engine parameter {pname!r} is fed by quantized and unquantized stream "
                                       f"tensors ({sorted({r.source for r in rs})[:4]}); not a layout {fmt.name} has")
            params[pname] = (pdt, pshape)
            regions.extend(rs)
            continue
        for suffix, sdt, factors in parts:
            params[pname + suffix] = (sdt or pdt, _divided(pshape, factors))
            for r in rs:
                src_full = layout.stream[r.source][1]
                what = f"{pname}{suffix} <- {r.source}"
                src = _scale_box(r.src, factors, src_full, pshape[len(r.dst_index):], what,
                                 other=r.dst, full_other=pshape[len(r.dst_index):])
                dst = _scale_box(r.dst, factors, pshape[len(r.dst_index):], src_full, what)
                source = r.source[: -len(".weight")] + ".weight" + suffix
                regions.append(Region(source=source, param=pname + suffix, src=src, dst=dst,
                                      dst_index=r.dst_index, counted=r.counted))
    if fmt.name == "int4":
        for name in sorted(quantized):
            const = name[: -len(".weight")] + ".weight_shape"
            params[CONST_PREFIX + const] = ("int64", (2,))
            regions.append(Region(source=const, param=CONST_PREFIX + const, src=((0, 2),), dst=((0, 2),),
                                  counted=layout.rank == 0))
    tied = {a: b for a, b in layout.tied_params.items() if a in params and b in params}
    out = RankLayout(stream=stream, params=params, regions=tuple(regions), aliases=dict(layout.aliases),
                     tied_params=tied, rank=layout.rank, world=layout.world)
    out.check()
    return out


def constant_values(layout: RankLayout) -> dict[str, tuple[int, ...]]:
    """The values of the map's constant tensors (``CONST_PREFIX`` params): each ``weight_shape`` is its stream
    weight's full ``[rows, cols]``."""
    out = {}
    for p in layout.params:
        if p.startswith(CONST_PREFIX):
            base = p[len(CONST_PREFIX): -len(".weight_shape")]
            rows, words = layout.stream[base + ".weight_packed"][1]
            out[p] = (rows, words * INT4_PACK)
    return out
