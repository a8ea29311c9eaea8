"""The decoder's projection matrices as the model runs them, from Hugging Face-named weights.

Fused: one matrix for Q|K|V and one for gate|up, so each is one GEMM. The attention scale is folded
into the query rows (rope is linear), or into the q norm's gain where the family has one. Q|K|V
biases, q/k norms and the output norms' gains go into each layer's prologue (`layer_prologues`). fp32: each RMSNorm gain is folded into the columns of the
matrix after it. int8: the gains stay apart (quantised weights keep their own values) and the
kernel applies them where it quantises the activations, together with the smoothing factors of
agent/model/calibrate.py (float weights only: a file's int8 rows are used as stored).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from agent.model.blocks import BlockRows
from agent.model.quant import CHANNEL, Int8Rows, concat, quantize, smoothing
from agent.model_config import ModelConfig, Weights
from common.config import QUANT_GROUP_SIZE

if TYPE_CHECKING:
    from agent.model.lora import LoraSlots

def _layer_mats(w: Weights, i: int) -> dict[str, list[Any]]:
    p = f"model.layers.{i}."
    return {"qkv": [w[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")],
            "o": [w[p + "self_attn.o_proj.weight"]],
            "gate_up": [w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]],
            "down": [w[p + "mlp.down_proj.weight"]]}


def _gains(cfg: ModelConfig, w: Weights, i: int) -> dict[str, np.ndarray]:
    """The gain of the norm before each projection (ones where none is)."""
    p = f"model.layers.{i}."
    mlp_norm = "pre_feedforward_layernorm" if cfg.family.sandwich_norms else "post_attention_layernorm"
    return {"qkv": w[p + "input_layernorm.weight"], "o": np.ones(cfg.num_heads * cfg.head_dim, np.float32),
            "gate_up": w[p + mlp_norm + ".weight"], "down": np.ones(cfg.intermediate_size, np.float32)}


def _float(m: Any) -> np.ndarray:
    return m.dequantize() if isinstance(m, (Int8Rows, BlockRows)) else m


def row_scale(cfg: ModelConfig, attn_scale: float) -> float:
    """The factor the query rows take: the attention scale, unless a q norm follows the projection
    (it would undo the factor, and its eps would not be scaled: the scale goes in its gain)."""
    return 1.0 if cfg.family.qk_norm else attn_scale


PROLOGUE_SCALARS = 4  # after the gains: q/k norm eps, sliding window, rope table row offset and rows


def post_gain_offset(cfg: ModelConfig) -> int:
    """Where a layer prologue's output-norm gains start (agent/kernels/prologue.h)."""
    return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 2 * cfg.head_dim + PROLOGUE_SCALARS


def layer_prologues(cfg: ModelConfig, w: Weights, attn_scale: float) -> Iterator[np.ndarray]:
    """Per layer, one float32 array (agent/kernels/prologue.h's layout) of what the layer adds to the
    Llama layer: the Q|K|V bias that agent/kernels/fused.cpp's RopeCache adds before rope (zeros
    where the family has none; the query's scaled as its rows are), the q and k heads' RMSNorm gains
    (the attention scale in q's) and that norm's eps (0: none); the layer's sliding window (0:
    none), which the attention reads; its rows of the stacked rope tables; then, for sandwich-norm
    families, the gains of the norms on the attention's and the MLP's outputs."""
    hd, q_width = cfg.head_dim, cfg.num_heads * cfg.head_dim
    width = q_width + 2 * cfg.num_kv_heads * hd
    start = post_gain_offset(cfg)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out = np.zeros(start + (2 * cfg.hidden_size if cfg.family.sandwich_norms else 0), np.float32)
        if cfg.family.qkv_bias:
            out[:width] = np.concatenate([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            out[:q_width] *= row_scale(cfg, attn_scale)
        if cfg.family.qk_norm:
            out[width:width + hd] = np.asarray(w[p + "self_attn.q_norm.weight"], np.float32) * attn_scale
            out[width + hd:width + 2 * hd] = w[p + "self_attn.k_norm.weight"]
            out[width + 2 * hd] = cfg.rms_eps
        table = cfg.rope_table(i)
        out[width + 2 * hd + 1:start] = cfg.window(i), table * cfg.max_position, cfg.max_position
        if cfg.family.sandwich_norms:
            out[start:] = np.concatenate([w[p + n + ".weight"] for n in ("post_attention_layernorm",
                                                                          "post_feedforward_layernorm")])
        yield out


def fp32_projections(cfg: ModelConfig, w: Weights, attn_scale: float, lora: LoraSlots | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Per layer (one at a time: a large model never holds a second full copy), each projection's
    [out, in] float32 matrix, gains and attention scale folded in; `lora` (agent.model.lora.LoraSlots):
    its adapters' A rows after the matrix's own, the gain folded into them alike."""
    attn_scale = row_scale(cfg, attn_scale)
    for i in range(cfg.num_layers):
        gains = _gains(cfg, w, i)
        out = {}
        for name, parts in _layer_mats(w, i).items():
            mat = np.concatenate([_float(m) for m in parts], axis=0)
            if name == "qkv":
                mat[:cfg.num_heads * cfg.head_dim] *= attn_scale
            if lora is not None:
                mat = np.concatenate([mat, lora.a_rows(i, name, mat.shape[1])])
                lora.gains[(i, name)] = np.asarray(gains[name], np.float32)
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


def kind_group(name: str, group: int) -> int:
    """The int8 group of projection kind `name` under quant_group_size `group`. Per channel (CHANNEL),
    the MLP's down projection keeps groups: its input (after SwiGLU) has the outliers one scale per
    token cannot hold: every kind per channel, at any SmoothQuant strength, was less accurate
    (docs/perf-notes.md)."""
    return QUANT_GROUP_SIZE if group == CHANNEL and name == "down" else group


def int8_projections(cfg: ModelConfig, w: Weights, attn_scale: float, ranges: dict[str, list[np.ndarray]] | None,
                     group: int, lora: LoraSlots | None = None) -> Iterator[dict[str, tuple]]:
    """Per layer, each projection's (int8 rows, input factor); `ranges` from agent.model.calibrate
    (None: no smoothing); `group`: at most this many inputs per weight and activation scale
    (agent.model.quant.group_for), or CHANNEL (kind_group). `lora` (agent.model.lora.LoraSlots): a
    third item, its adapters' A rows in float32 with the norm's gain folded in (the kernel applies
    them to the input before it is smoothed and quantised)."""
    attn_scale = row_scale(cfg, attn_scale)
    for i in range(cfg.num_layers):
        gains = _gains(cfg, w, i)
        out = {}
        for name, parts in _layer_mats(w, i).items():
            rows, factor = _int8(parts, gains[name], ranges[name][i] if ranges else None, kind_group(name, group))
            if name == "qkv":
                rows[0] = rows[0].scaled(attn_scale)
            out[name] = (concat(rows), factor)
            if lora is not None:
                gain = lora.gains[(i, name)] = np.asarray(gains[name], np.float32)
                a = lora.a_rows(i, name, gain.shape[0])[:lora.extra(name, padded=False)]
                out[name] += (a * gain[None, :],)
        yield out


def gguf_projections(cfg: ModelConfig, w: Weights, attn_scale: float) -> Iterator[dict[str, tuple]]:
    """Per layer, each projection's (blocks of its tensors as stored, each tensor's row factor, the
    norm gain in front): the attention scale stays a factor on the query rows, the gain one on the
    input, so the blocks are used as the file has them."""
    attn_scale = row_scale(cfg, attn_scale)
    for i in range(cfg.num_layers):
        gains = _gains(cfg, w, i)
        yield {name: (parts, [attn_scale if name == "qkv" and j == 0 else 1.0 for j in range(len(parts))], gains[name])
               for name, parts in _layer_mats(w, i).items()}


def lm_head(cfg: ModelConfig, w: Weights, int8: bool, ranges: dict[str, list[np.ndarray]] | None = None,
            group: int = QUANT_GROUP_SIZE, embed: np.ndarray | None = None) -> tuple[Any, np.ndarray]:
    """The output projection [vocab, hidden] (the embedding when tied: `embed` where the caller has it
    read, a 262k vocabulary's is seconds to dequantise) and its input factor (the final norm gain;
    with int8, over the smoothing factor)."""
    head = w.get("lm_head.weight")
    if head is None or cfg.tie_word_embeddings:
        head = embed if embed is not None else w["model.embed_tokens.weight"]
    gain = np.asarray(w["model.norm.weight"], np.float32)
    if not int8:
        return _float(head), gain
    rows, factor = _int8([head], gain, ranges["head"][0] if ranges else None, group)
    return rows[0], factor


def embedding(w: Weights) -> np.ndarray:
    return _float(w["model.embed_tokens.weight"])
