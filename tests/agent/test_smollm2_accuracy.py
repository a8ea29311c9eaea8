"""SmolLM2-135M's accuracy in each reduced dtype against its own float32 (tools/eval_quant.py:
perplexity over the shipped ~5000-token corpus, top-token agreement at every position, greedy
continuations): the real-weight half of the dtype checks, whose kernels tests/agent/test_int8.py and
test_half_precision.py check against exact arithmetic and float64. Run once, on this CPU as it is
(the LLM_SERVING_MAX_ISA pass of tools/test.sh runs the kernels, not these)."""
from __future__ import annotations

from agent.model.quant import CHANNEL
from tests.helpers import channel_refused_here


def test_smollm2_bf16_tracks_fp32(smollm2_fp32_eval):
    """Perplexity on the shipped corpus within 1% of fp32 (measured bf16 +0.14%), greedy
    continuations agreeing in their first 4 tokens for >= 80% of prompts, and the weights' bytes
    near half (embeddings stay fp32), bf16 weights and KV. float16 (11 significant bits to bf16's 8)
    is checked on the tiny model against float64 (test_half_precision.py, VARIANTS) and on SmolLM2 by
    `python -m tools.eval_quant --dtype float16` (docs/benchmarks.md, accuracy)."""
    from tools.eval_quant import agreement, evaluate

    base = smollm2_fp32_eval
    half = evaluate("smollm2", "bfloat16", 4)
    assert abs(half["perplexity"] / base["perplexity"] - 1) < 0.01
    assert agreement(base["greedy"], half["greedy"]) >= 0.8
    assert half["weight_bytes"] < 0.65 * base["weight_bytes"]


def test_smollm2_int8_tracks_fp32(smollm2_fp32_eval):
    """int8 as served by default: int8 weights in groups (`auto` without AVX512-VNNI) over the int8
    KV cache. Perplexity on the shipped corpus (~5000 tokens) within 1% of fp32 (measured +0.55%
    ± 0.14%, Zen 3; the weights alone over a float16 cache +0.67%, the cache alone on fp32 weights
    +0.22%) and the same top token as fp32 at >= 95.5% of the positions (96.3%). Greedy 4-token
    continuations of 24 prompts (eval_quant's table) swung between 75% and 96% with the order of
    one float sum between builds: too few samples to assert on."""
    from tools.eval_quant import evaluate, top1_agreement

    base = smollm2_fp32_eval
    int8 = evaluate("smollm2", "int8", 4, group=72, kv="int8")
    assert int8["dtype"] == "int8 (group <= 72), int8 KV"
    assert int8["perplexity"] / base["perplexity"] - 1 < 0.01
    assert top1_agreement(base["top"], int8["top"]) >= 0.955
    assert int8["weight_bytes"] < 0.45 * base["weight_bytes"]


def test_smollm2_int8_per_channel_tracks_fp32(smollm2_fp32_eval):
    """quant_group_size -1 (`auto` with AVX512-VNNI or AMX): per-channel weights and per-token activations on
    oneDNN's int8 matmul, the down projection in groups. Perplexity within 1% of fp32 (measured
    +0.29% ± 0.22% with the int8 cache, Zen 4) and the same top token at >= 92% of the positions
    (93.7%: one scale per token rounds more coarsely than one per 72 inputs)."""
    from tools.eval_quant import evaluate, top1_agreement

    if channel_refused_here():
        return
    base = smollm2_fp32_eval
    int8 = evaluate("smollm2", "int8", 4, group=CHANNEL, kv="float16")
    assert "per channel" in int8["dtype"]
    assert int8["perplexity"] / base["perplexity"] - 1 < 0.01
    assert top1_agreement(base["top"], int8["top"]) >= 0.92


def test_smollm2_gguf_as_stored_tracks_its_dequantised_fp32(smollm2_fp32_eval):
    """model_dtype gguf: the packaged Q4_1 file's blocks as stored (its Q8_0 embedding, tied to the LM
    head, too), int8 activations per 32 inputs, bfloat16 KV. float32 here is the same file dequantised,
    so this is the cost of running the blocks as stored: perplexity within 1% (measured +0.30% ± 0.11%,
    Zen 3), the same top token at >= 96% of the positions (97.4%), and the file's bytes held (94 MiB
    against float32's 622)."""
    from common.memory import model_shape
    from common.model_files import resolve_model
    from tools.eval_quant import evaluate, top1_agreement

    base = smollm2_fp32_eval
    stored = evaluate("smollm2", "gguf", 4)
    assert stored["dtype"] == "gguf, bfloat16 KV"
    assert stored["perplexity"] / base["perplexity"] - 1 < 0.01
    assert top1_agreement(base["top"], stored["top"]) >= 0.96
    assert stored["weight_bytes"] <= 1.05 * model_shape(resolve_model("smollm2")).stored_bytes
