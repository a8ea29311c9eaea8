"""Llama-family decoder in MindSpore primitives that exist on CPU, GPU and Ascend.

One forward serves any mix of prefill chunks and decodes as one flat list of tokens (the TND layout
of MindSpore's Ascend paged-attention ops): row-independent ops run once over all tokens, and each
token attends over its own sequence's paged context, read from a flat per-layer KV cache by block
table. New K/V rows are written in place by slot (agent.attention), which is O(tokens): every
other write form copies the whole cache each step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from agent.backend import Backend
from agent.layers import KV_DTYPES, param, zeros_param
from agent.linear import LayerWeights
from agent.projections import embedding, layer_prologues, post_gain_offset
from common.memory import kv_head_bytes


@dataclass
class LlamaConfig:
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
    family: str = "llama"  # agent.families: the family's name; what it adds to the Llama layer follows
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before rope (Qwen3)
    sandwich_norms: bool = False  # RMSNorm on the attention's and MLP's outputs too; the MLP's input norm is
    # then `pre_feedforward_layernorm` (Gemma 3)
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
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


def rope_inv_freq(cfg: LlamaConfig, table: int = 0) -> np.ndarray:
    """Inverse frequencies of rope table `table` (LlamaConfig.rope_table): the global one, with Llama-3
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


def rope_tables(cfg: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [tables x max_position, head_dim] in the rotate-half (Hugging Face) layout: the
    global table, then (sliding_rope_theta) the sliding layers' own."""
    tables = range(2 if cfg.sliding_rope_theta else 1)
    ang = np.concatenate([np.outer(np.arange(cfg.max_position, dtype=np.float64), rope_inv_freq(cfg, t))
                          for t in tables])
    ang = np.concatenate([ang, ang], axis=-1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class LlamaModel(nn.Cell):
    """Weights are Hugging Face-named numpy arrays (``model.layers.0.self_attn.q_proj.weight``...):
    float32, or agent.quant.Int8Rows where the file held int8. `backend` (agent.layers.Backend) picks
    the projections' format, the KV cache's dtype and the kernels once; norms, rope, attention and
    logits compute in fp32."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, Any], num_slots: int, block_size: int,
                 backend: Backend | None = None):
        super().__init__()
        backend = backend or Backend()
        self.cfg, self.block_size, self.num_slots = cfg, block_size, num_slots
        k = backend.kernels(cfg)
        self.norms = backend.norms(cfg, k)
        self.attn = backend.attention(cfg, block_size, k)
        attn_scale = cfg.scale
        embed = embedding(weights).astype(np.float32, copy=False)
        proj = backend.projections(cfg, weights, attn_scale, self.norms, k, embed if cfg.tie_word_embeddings else None)
        self.qkv, self.o, self.gate_up, self.down, self.head = (proj[n] for n in ("qkv", "o", "gate_up", "down", "head"))
        self.comm = backend.collectives(cfg, k)  # tensor parallel: partial sums and vocabulary shards combined
        self.stack_op = backend.stack_op(cfg, k)  # every decoder layer in one op, or None: four a layer
        self.one_op_stack = self.stack_op is not None
        prologues = LayerWeights("prologue", cfg.num_layers, self.one_op_stack)  # agent.projections.layer_prologues
        for i, pro in enumerate(layer_prologues(cfg, weights, attn_scale)):
            prologues.add(i, (pro,))
        self.prologue = prologues.parameters()[0]
        self.post_gains = post_gain_offset(cfg)  # where a prologue's output-norm gains start (sandwich norms)
        self.embed = param("embed", embed * np.float32(math.sqrt(cfg.hidden_size)) if cfg.embed_scale else embed)
        cos, sin = rope_tables(cfg)
        self.cos_table, self.sin_table = param("cos_table", cos), param("sin_table", sin)
        row = kv_head_bytes(cfg.head_dim, backend.kv_dtype) // np.dtype(KV_DTYPES[backend.kv_dtype]).itemsize
        shape, kv_type = self.attn.cache_shape(num_slots, cfg.num_kv_heads, row), KV_DTYPES[backend.kv_dtype]
        # The caches' pages are faulted in at load, as vLLM allocates its cache (the pool fits: common.memory
        # planned it). Left to their first writes, a fresh server zeroed 2 MiB pages inside its first
        # steps: 1.5% of a 64-row decode step's samples (SmolLM2 int8, Zen 4).
        cache = lambda name, dims: zeros_param(name, dims, kv_type, populate=True)  # noqa: E731
        if self.one_op_stack:  # every layer's cache in one Parameter, as the stack op takes them
            self.k_cache, self.v_cache = (cache(f"{kv}_cache", (cfg.num_layers, *shape)) for kv in "kv")
        else:
            self.k_cache, self.v_cache = (ms.ParameterTuple([cache(f"{kv}_cache{i}", shape) for i in range(cfg.num_layers)])
                                          for kv in "kv")

    @property
    def weight_bytes(self) -> int:
        """Bytes of the loaded weights (KV cache not counted)."""
        return sum(p.nbytes for p in self.get_parameters() if "_cache" not in p.name)

    @property
    def streamed_bytes(self) -> int:
        """Weight bytes every decode step reads: all but the embedding table (one row per token)
        and the rope tables."""
        skip = ("embed", "cos_table", "sin_table", "_cache")
        return sum(p.nbytes for p in self.get_parameters() if not any(s in p.name for s in skip))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(p.nbytes for p in self.get_parameters() if "_cache" in p.name)

    def construct(self, tokens: Tensor, positions: Tensor, slots: Tensor, token_rows: Tensor,
                  block_tables: Tensor, logit_rows: Tensor) -> Tensor:
        """One token-packed step (decode rows and prefill chunks in any mix): tokens, positions,
        slots and token_rows (each token's sequence) [T] int32; block_tables [R, W] int32 with W
        fixed by max_model_len, so no shape depends on context length; logit_rows [S] int32 indices
        into T of the tokens that sample. Returns logits [S, vocab] and their log-sum-exp [S] (for
        log-probabilities without a second pass over the vocabulary)."""
        c = self.attn.context(positions, token_rows, block_tables, self.cos_table, self.sin_table)
        x = ops.gather(self.embed, tokens, 0)
        if self.one_op_stack:
            h = self.stack_op(x, *self.attn.shared(c, slots), self.norms.eps, self.k_cache, self.v_cache, self.prologue,
                              *self.qkv.every_layer(), *self.o.every_layer(), *self.gate_up.every_layer(),
                              *self.down.every_layer())
        else:
            h = self.four_op_layers(x, c, slots)
        # h is the final norm of every token (its gain folded into the head); only sampling tokens go on.
        logits = self.comm.gather(self.head.linear(ops.gather(h, logit_rows, 0), 0))
        return logits, self.norms.logsumexp(logits)

    def four_op_layers(self, x: Tensor, c: tuple, slots: Tensor) -> Tensor:
        """The decoder layers as four ops each, where no stack op runs them: the final norm of the
        last layer's output."""
        qkv = self.qkv.linear(self.norms.rms(x), 0)
        delta = x  # each layer's MLP output; graph mode wants it bound before the loop that assigns it
        h, g = self.cfg.hidden_size, self.post_gains
        for i in range(self.cfg.num_layers):
            attn = self.comm.reduce(self.o.attention_linear(self.attn, qkv, c, slots, self.k_cache[i],
                                                            self.v_cache[i], self.prologue[i], i))
            if self.cfg.sandwich_norms:
                attn = self.norms.rms_gain(attn, self.prologue[i][g:g + h])
            x, gu = self.gate_up.add_norm_linear(x, attn, i)
            delta = self.comm.reduce(self.down.swiglu_linear(gu, i))
            if self.cfg.sandwich_norms:
                delta = self.norms.rms_gain(delta, self.prologue[i][g + h:g + 2 * h])
            if i + 1 < self.cfg.num_layers:
                x, qkv = self.qkv.add_norm_linear(x, delta, i + 1)
        return self.norms.add_rms(x, delta)[1]
