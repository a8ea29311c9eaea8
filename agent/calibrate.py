"""Activation ranges for int8 smoothing (SmoothQuant, Xiao et al. 2023), from a float32 NumPy forward
over a short calibration text.

A few input channels of every projection carry most of the activation magnitude; quantised per
token as they come, they leave the other channels a handful of int8 steps. Smoothing divides each
channel by s = max|x|^0.5 / max|w|^0.5 (agent.quant.smoothing) and multiplies the weight column by s (the kernel applies 1/s
with the norm gain, so it costs nothing per step). Measured on SmolLM2 (tools/eval_quant.py):
perplexity +5.0% without, +0.45% with; calibrating on random token ids instead of text: +3.1%.
The calibration text is not the evaluation corpus.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from agent.model import LlamaConfig, rope_tables

CALIBRATION_TEXT = """\
User: Can you explain how a refrigerator keeps food cold?
Assistant: A refrigerator moves heat from the inside to the outside. A liquid called a refrigerant
evaporates in pipes inside the cabinet, absorbing heat, and a compressor then squeezes the vapour
so that it releases that heat through the coils at the back.
def merge_sorted(a, b):
    result, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i]); i += 1
        else:
            result.append(b[j]); j += 1
    return result + a[i:] + b[j:]
The committee met on Tuesday, 14 March, to discuss the budget for the coming year. Three members
argued that the museum should open on Sundays; the treasurer warned that heating costs had risen by
twelve per cent. In the end they agreed to a trial of six months.
Q: What is the boiling point of water in Fahrenheit? A: 212 degrees.
Les montagnes étaient couvertes de neige, et le village dormait encore quand le train arriva.
Mountains, rivers and forests cover most of the island, which has fewer than ten thousand people.
"""


def activation_ranges(cfg: LlamaConfig, w: dict[str, Any], ids: list[int]) -> dict[str, list[np.ndarray]]:
    """Per projection ("qkv", "o", "gate_up", "down", per layer; "head", once): the largest |value|
    of each input channel over the calibration tokens, norm gains applied (as the kernel sees them)."""
    def f32(name: str) -> np.ndarray:
        m = w[name]
        return m.dequantize() if hasattr(m, "dequantize") else m

    ids = ids[:cfg.max_position]  # a byte-level vocabulary spends ~1000 tokens on the text
    n, h, kv, hd = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = (t[:n, None, :] for t in rope_tables(cfg))
    rope = lambda t: t * cos + np.concatenate([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa: E731
    norm = lambda t, g: t / np.sqrt((t * t).mean(-1, keepdims=True) + cfg.rms_eps) * g  # noqa: E731
    causal = np.triu(np.full((n, n), -np.inf, np.float32), 1)
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("qkv", "o", "gate_up", "down", "head")}
    x = f32("model.embed_tokens.weight")[np.asarray(ids)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = norm(x, w[p + "input_layernorm.weight"])
        out["qkv"].append(np.abs(a).max(0))
        q = rope((a @ f32(p + "self_attn.q_proj.weight").T).reshape(n, h, hd))
        k = np.repeat(rope((a @ f32(p + "self_attn.k_proj.weight").T).reshape(n, kv, hd)), h // kv, 1)
        v = np.repeat((a @ f32(p + "self_attn.v_proj.weight").T).reshape(n, kv, hd), h // kv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        att = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(n, h * hd)
        out["o"].append(np.abs(att).max(0))
        x = x + att @ f32(p + "self_attn.o_proj.weight").T
        a = norm(x, w[p + "post_attention_layernorm.weight"])
        out["gate_up"].append(np.abs(a).max(0))
        gate, up = a @ f32(p + "mlp.gate_proj.weight").T, a @ f32(p + "mlp.up_proj.weight").T
        act = gate / (1 + np.exp(-gate)) * up
        out["down"].append(np.abs(act).max(0))
        x = x + act @ f32(p + "mlp.down_proj.weight").T
    out["head"].append(np.abs(norm(x, w["model.norm.weight"])).max(0))
    return out

