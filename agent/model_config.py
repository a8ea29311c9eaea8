"""The model's config: its shape, its family and the math they fix (rope tables, attention scale).
At the bottom of agent/: every part of the model takes a ModelConfig, nothing below it imports one."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Weights = Mapping[str, Any]  # Hugging Face-named tensors: float32 arrays, or agent.model.quant.Int8Rows for
# projections a file held as int8 (GGUF Q8_0)


@dataclass(frozen=True)
class Family:
    """What a family adds to the decoder layer (RMSNorm, SwiGLU, rotate-half rope, GQA); the families
    we serve are agent.weights.families.FAMILIES."""
    name: str = "llama"
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before rope (Qwen3)
    sandwich_norms: bool = False  # RMSNorm on the attention's and the MLP's outputs too; the MLP's input norm
    # is then `pre_feedforward_layernorm` (Gemma 3)
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_offset: float = 0.0  # added to every RMSNorm weight a Hugging Face file holds (Gemma: x * (1 + w));
    # GGUF files hold it added
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    tied_by_default: bool = False  # transformers' default `tie_word_embeddings` (a saved config omits defaults)


LLAMA = Family()


@dataclass
class ModelConfig:
    """A decoder's shape and math, read from config.json (agent.weights.families.hf_config), a GGUF
    header (agent.weights.gguf) or a MindFormers YAML (agent.weights.load)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position: int = 4096
    bos_token_id: int | None = 1
    eos_token_ids: list[int] = field(default_factory=lambda: [2])
    family: Family = LLAMA  # what the family adds to the decoder layer
    attn_scale: float = 0.0  # the attention's scale (0: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (0: none); empty: no layer has one
    sliding_rope_theta: float = 0.0  # the sliding layers' own rope base, unscaled (Gemma 3); 0: the global rope
    rope_freq_factors: tuple[float, ...] | None = None  # per-frequency divisors (GGUF `rope_freqs`: Llama 3's scaling)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens (0: it sees its whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_table(self, layer: int) -> int:
        """Which of `rope_tables`' tables layer `layer` takes: 1 (the sliding layers' own) or 0."""
        return int(bool(self.sliding_rope_theta and self.window(layer)))

    @property
    def scale(self) -> float:
        """The attention's scale on q.k."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)


def rope_inv_freq(cfg: ModelConfig, table: int = 0) -> np.ndarray:
    """Inverse frequencies of rope table `table` (ModelConfig.rope_table): the global one, with Llama-3
    style or linear scaling when configured; 1: the sliding layers' own base, unscaled."""
    dim = cfg.head_dim
    if table:
        return 1.0 / (cfg.sliding_rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "llama3":
        factor = sc["factor"]
        low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_ctx = sc.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / sc["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    if cfg.rope_freq_factors is not None:
        inv = inv / np.asarray(cfg.rope_freq_factors, np.float64)
    return inv


def rope_tables(cfg: ModelConfig, dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [tables x max_position, head_dim] in the rotate-half (Hugging Face) layout: the
    global table, then (sliding_rope_theta) the sliding layers' own."""
    tables = range(2 if cfg.sliding_rope_theta else 1)
    ang = np.concatenate([np.outer(np.arange(cfg.max_position, dtype=np.float64), rope_inv_freq(cfg, t))
                          for t in tables])
    ang = np.concatenate([ang, ang], axis=-1)
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
