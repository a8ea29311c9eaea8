"""The decoder's projection matrices as the model runs them, from Hugging Face-named weights.

Fused: one matrix for Q|K|V and one for gate|up, so each is one GEMM. The attention scale is folded
into the query rows (rope is linear), or into the q norm's gain where the family has one. Q|K|V
biases and q/k norms go into each layer's attention prologue (`attention_prologues`). fp32: each RMSNorm gain is folded into the columns of the
matrix after it. int8: the gains stay apart (quantised weights keep their own values) and the
kernel applies them where it quantises the activations, together with the smoothing factors of
agent/calibrate (float weights only: a file's int8 rows are used as stored).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np

from agent.quant import Int8Rows, concat, quantize, smoothing
from common.config import QUANT_GROUP_SIZE

Weights = Mapping[str, Any]  # float32 arrays, or Int8Rows for tensors a file held as int8


def _layer_mats(w: Weights, i: int) -> dict[str, list[Any]]:
    p = f"model.layers.{i}."
    return {"qkv": [w[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")],
            "o": [w[p + "self_attn.o_proj.weight"]],
            "gate_up": [w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]],
            "down": [w[p + "mlp.down_proj.weight"]]}


def _gains(w: Weights, i: int, width: int, inner: int) -> dict[str, np.ndarray]:
    p = f"model.layers.{i}."
    return {"qkv": w[p + "input_layernorm.weight"], "o": np.ones(width, np.float32),
            "gate_up": w[p + "post_attention_layernorm.weight"], "down": np.ones(inner, np.float32)}


def _float(m: Any) -> np.ndarray:
    return m.dequantize() if isinstance(m, Int8Rows) else m


def row_scale(cfg: Any, attn_scale: float) -> float:
    """The factor the query rows take: the attention scale, unless a q norm follows the projection
    (it would undo the factor, and its eps would not be scaled: the scale goes in its gain)."""
    return 1.0 if cfg.qk_norm else attn_scale


def attention_prologues(cfg: Any, w: Weights, attn_scale: float) -> Iterator[np.ndarray]:
    """Per layer, what agent/kernels/fused.cpp's RopeCache applies to Q|K|V before rope, as one
    float32 array: the bias (zeros where the family has none; the query's scaled as its rows are),
    the q and k heads' RMSNorm gains (the attention scale in q's) and that norm's eps (0: none);
    then the layer's sliding window (0: none), which the attention reads."""
    hd, q_width = cfg.head_dim, cfg.num_heads * cfg.head_dim
    width = q_width + 2 * cfg.num_kv_heads * hd
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.self_attn."
        out = np.zeros(width + 2 * hd + 2, np.float32)
        if cfg.qkv_bias:
            out[:width] = np.concatenate([w[p + f"{n}_proj.bias"] for n in "qkv"])
            out[:q_width] *= row_scale(cfg, attn_scale)
        if cfg.qk_norm:
            out[width:width + hd] = np.asarray(w[p + "q_norm.weight"], np.float32) * attn_scale
            out[width + hd:width + 2 * hd] = w[p + "k_norm.weight"]
            out[-2] = cfg.rms_eps
        out[-1] = cfg.window(i)
        yield out


def fp32_projections(cfg: Any, w: Weights, attn_scale: float) -> Iterator[dict[str, np.ndarray]]:
    """Per layer (one at a time: a large model never holds a second full copy), each projection's
    [out, in] float32 matrix, gains and attention scale folded in."""
    attn_scale = row_scale(cfg, attn_scale)
    for i in range(cfg.num_layers):
        gains = _gains(w, i, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
        out = {}
        for name, parts in _layer_mats(w, i).items():
            mat = np.concatenate([_float(m) for m in parts], axis=0)
            if name == "qkv":
                mat[:cfg.num_heads * cfg.head_dim] *= attn_scale
            out[name] = mat * gains[name][None, :]
        yield out


def _int8(parts: list[Any], gain: np.ndarray, act_max: np.ndarray | None,
          group: int) -> tuple[list[Int8Rows], np.ndarray]:
    """Quantised rows of the matrices sharing one input, and the per-channel factor the kernel
    multiplies that input by: the norm gain, divided by the smoothing factor when smoothed."""
    gain = np.asarray(gain, np.float32)
    stored = [m for m in parts if isinstance(m, Int8Rows)]
    if stored:  # used as stored; float neighbours take their group size (one GEMM needs one)
        return [m if isinstance(m, Int8Rows) else quantize(m, stored[0].group, exact=True) for m in parts], gain
    if act_max is None:
        return [quantize(m, group) for m in parts], gain
    s = smoothing(act_max, np.max([np.abs(m).max(0) for m in parts], axis=0))
    return [quantize(m * s[None, :], group) for m in parts], gain / s


def int8_projections(cfg: Any, w: Weights, attn_scale: float, ranges: dict[str, list[np.ndarray]] | None,
                     group: int) -> Iterator[dict[str, tuple[Int8Rows, np.ndarray]]]:
    """Per layer, each projection's (int8 rows, input factor); `ranges` from agent.calibrate
    (None: no smoothing); `group`: at most this many inputs per weight and activation scale
    (agent.quant.group_for)."""
    attn_scale = row_scale(cfg, attn_scale)
    for i in range(cfg.num_layers):
        gains = _gains(w, i, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
        out = {}
        for name, parts in _layer_mats(w, i).items():
            rows, factor = _int8(parts, gains[name], ranges[name][i] if ranges else None, group)
            if name == "qkv":
                rows[0] = rows[0].scaled(attn_scale)
            out[name] = (concat(rows), factor)
        yield out


def lm_head(cfg: Any, w: Weights, int8: bool, ranges: dict[str, list[np.ndarray]] | None = None,
            group: int = QUANT_GROUP_SIZE) -> tuple[Any, np.ndarray]:
    """The output projection [vocab, hidden] (the embedding when tied) and its input factor (the
    final norm gain; with int8, over the smoothing factor)."""
    head = w.get("lm_head.weight")
    if head is None or cfg.tie_word_embeddings:
        head = w["model.embed_tokens.weight"]
    gain = np.asarray(w["model.norm.weight"], np.float32)
    if not int8:
        return _float(head), gain
    rows, factor = _int8([head], gain, ranges["head"][0] if ranges else None, group)
    return rows[0], factor


def embedding(w: Weights) -> np.ndarray:
    return _float(w["model.embed_tokens.weight"])
