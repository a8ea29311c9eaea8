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
    cos_all, sin_all = rope_tables(cfg)
    norm = lambda t, g: t / np.sqrt((t * t).mean(-1, keepdims=True) + cfg.rms_eps) * g  # noqa: E731
    causal = np.triu(np.full((n, n), -np.inf, np.float32), 1)
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("qkv", "o", "gate_up", "down", "head")}
    x = f32("model.embed_tokens.weight")[np.asarray(ids)]
    if cfg.embed_scale:
        x = x * np.float32(np.sqrt(cfg.hidden_size))
    mlp_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        start = cfg.rope_table(i) * cfg.max_position
        cos, sin = cos_all[start:start + n, None, :], sin_all[start:start + n, None, :]
        rope = lambda t: t * cos + np.concatenate([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa: E731
        a = norm(x, w[p + "input_layernorm.weight"])
        out["qkv"].append(np.abs(a).max(0))
        q, k, v = (_head_proj(cfg, w, f32, p, name, a, heads) for name, heads in (("q", h), ("k", kv), ("v", kv)))
        k, v = np.repeat(rope(k), h // kv, 1), np.repeat(v, h // kv, 1)
        s = np.einsum("qhd,khd->hqk", rope(q), k) * cfg.scale + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        att = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(n, h * hd)
        out["o"].append(np.abs(att).max(0))
        delta = att @ f32(p + "self_attn.o_proj.weight").T
        x = x + (norm(delta, w[p + "post_attention_layernorm.weight"]) if cfg.sandwich_norms else delta)
        a = norm(x, w[p + mlp_norm + ".weight"])
        out["gate_up"].append(np.abs(a).max(0))
        gate, up = a @ f32(p + "mlp.gate_proj.weight").T, a @ f32(p + "mlp.up_proj.weight").T
        act = _activation(cfg, gate) * up
        out["down"].append(np.abs(act).max(0))
        delta = act @ f32(p + "mlp.down_proj.weight").T
        x = x + (norm(delta, w[p + "post_feedforward_layernorm.weight"]) if cfg.sandwich_norms else delta)
    out["head"].append(np.abs(norm(x, w["model.norm.weight"])).max(0))
    return out


def _head_proj(cfg: LlamaConfig, w: dict[str, Any], f32: Any, p: str, name: str, a: np.ndarray,
               heads: int) -> np.ndarray:
    """One of q, k, v [n, heads, hd]: the projection, its bias and (q, k) its head norm where the family has them."""
    y = a @ f32(p + f"self_attn.{name}_proj.weight").T
    if cfg.qkv_bias:
        y = y + w[p + f"self_attn.{name}_proj.bias"]
    y = y.reshape(len(a), heads, cfg.head_dim)
    if cfg.qk_norm and name != "v":
        g = w[p + f"self_attn.{name}_norm.weight"]
        y = y / np.sqrt((y * y).mean(-1, keepdims=True) + cfg.rms_eps) * g
    return y


def _activation(cfg: LlamaConfig, gate: np.ndarray) -> np.ndarray:
    if cfg.activation == "gelu_tanh":
        return 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
    return gate / (1 + np.exp(-gate))
