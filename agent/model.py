"""Llama-family decoder in MindSpore primitives that exist on CPU, GPU and Ascend.

One forward serves any mix of prefill chunks and decodes as one flat list of tokens (the TND layout
of MindSpore's Ascend paged-attention ops): row-independent ops run once over all tokens, and each
token attends over its own sequence's paged context, read from a flat per-layer KV cache by block
table. New K/V rows are written with ``ops.scatter_update`` by slot, which is
O(tokens) — every other write form copies the whole cache each step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from agent.native import custom_ops
from agent.projections import embedding, lm_head, projection_arrays

NEG_INF = -1e9  # finite, so fully masked padding rows give garbage instead of NaN
# MindSpore CPU's MatMul is fastest with [in, out] weights for few rows and with [out, in] weights
# (transpose_b) for many: ~2.5x either way. Graphs of at least this many tokens use the latter.
TRANSPOSED_MIN_ROWS = 96


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

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies, with Llama-3 style frequency scaling when configured."""
    dim = cfg.head_dim
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
    return inv


def rope_tables(cfg: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_position, head_dim] in the rotate-half (Hugging Face) layout."""
    ang = np.outer(np.arange(cfg.max_position, dtype=np.float64), rope_inv_freq(cfg))
    ang = np.concatenate([ang, ang], axis=-1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class LlamaModel(nn.Cell):
    """Weights are Hugging Face-named numpy arrays (``model.layers.0.self_attn.q_proj.weight``...):
    float32, or agent.quant.Int8Rows where the file held int8. ``int8``: projections and LM head run
    as W8A8 (agent/kernels/linear_int8.cpp), smoothed by the activation ``ranges`` of agent.calibrate
    when given, one scale per at most ``int8_group`` inputs (agent.quant.group_for); norms, rope, attention,
    KV cache and logits stay fp32."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, Any], num_slots: int, block_size: int,
                 native_lib: str | None = None, int8: bool = False,
                 ranges: dict[str, list[np.ndarray]] | None = None, int8_group: int = 64):
        super().__init__()
        self.cfg = cfg
        self.block_size = block_size
        self.num_slots = num_slots
        h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = h * hd, kv * hd
        self.group = h // kv
        self.scale = 1.0 / math.sqrt(hd)
        self.native = native_lib is not None
        self.int8 = int8
        if int8 and not self.native:
            raise ValueError("model_dtype int8 needs the native kernels (a C++ compiler, LLM_SERVING_NATIVE not 0, "
                             "a CPU device); the plain-MindSpore path runs float32 only")

        def param(name: str, arr: np.ndarray) -> Parameter:
            return Parameter(Tensor(np.ascontiguousarray(arr, dtype=np.float32)), name=name, requires_grad=False)

        w = weights
        self.embed = param("embed", embedding(w))
        head, norm_gain = lm_head(cfg, w, int8, ranges, int8_group)
        if int8:
            self.lm_head = Parameter(Tensor(head.q), name="lm_head", requires_grad=False)
            self.lm_head_s = param("lm_head_s", head.scale)
            self.lm_head_g = param("lm_head_g", norm_gain)
        else:
            # The final norm's gain folded into the head (see agent/projections). MindSpore's MatMul:
            # [vocab, hidden] with transpose_b, 1.6-2.5x faster than [hidden, vocab] at every batch.
            # oneDNN: [hidden, vocab], 2.4x faster than that at one row, 0.9x at 64.
            head = head * norm_gain[None, :]
            self.lm_head = param("lm_head", head.T if self.native else head)
        cos, sin = rope_tables(cfg)
        self.cos_table = param("cos_table", cos)
        self.sin_table = param("sin_table", sin)
        half = hd // 2
        rot = np.zeros((hd, hd), np.float32)  # x @ rot == concat(-x2, x1): rotate-half as one matmul
        rot[np.arange(half) + half, np.arange(half)] = -1.0
        rot[np.arange(half), np.arange(half) + half] = 1.0
        self.rotate = param("rotate_half", rot)
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()
        if self.native:  # agent/kernels, when built
            for name, op in custom_ops(native_lib, self.q_size, kv, hd).items():
                setattr(self, name, op)
            self.eps = param("rms_eps", np.array([cfg.rms_eps], np.float32))

        kc, vc = [], []
        for i in range(cfg.num_layers):
            kc.append(param(f"k_cache{i}", np.zeros((num_slots, kv, hd), np.float32)))
            vc.append(param(f"v_cache{i}", np.zeros((num_slots, kv, hd), np.float32)))
        self.k_cache = ms.ParameterTuple(kc)
        self.v_cache = ms.ParameterTuple(vc)
        tuples: dict[str, list[Parameter]] = {f"{n}{x}": [] for n in ("qkv", "o", "gate_up", "down")
                                              for x in ("", "_t", "_s", "_g")}
        for name, arr in projection_arrays(cfg, w, self.scale, int8, ranges, int8_group, not self.native):
            tuples[name].append(Parameter(Tensor(np.ascontiguousarray(arr)), name=f"{name}{len(tuples[name])}",
                                          requires_grad=False))
        for name, params in tuples.items():
            setattr(self, name, ms.ParameterTuple(params))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the loaded weights (KV cache not counted)."""
        return sum(p.nbytes for p in self.get_parameters() if not p.name.startswith(("k_cache", "v_cache")))

    def _linear(self, x: Tensor, proj: tuple, i: int, wide: bool) -> Tensor:
        """x @ layer i's weight of one projection; proj = (weights, [out, in] copies, int8 scales, int8 input factors)."""
        ws, ws_t, scales, gains = proj
        if self.int8:
            return self.linear_i8_op(x, ws[i], scales[i], gains[i])
        if self.native:
            return self.linear_op(x, ws[i])
        return self.matmul_t(x, ws_t[i]) if wide else ops.matmul(x, ws[i])

    def _add_norm_linear(self, x: Tensor, delta: Tensor, proj: tuple, i: int, wide: bool) -> tuple:
        """The residual add, the RMSNorm after it and the projection that norm feeds: (x + delta,
        rms(x + delta) @ w). int8: one op (the norm runs in the kernel's quantisation pass), a
        dispatch less per norm."""
        if self.int8:
            ws, _, scales, gains = proj
            return self.add_rms_linear_i8_op(x, delta, self.eps, ws[i], scales[i], gains[i])
        x, h = self._add_rms(x, delta)
        return x, self._linear(h, proj, i, wide)

    def _swiglu_linear(self, gu: Tensor, proj: tuple, i: int, wide: bool) -> Tensor:
        if self.int8:
            ws, _, scales, gains = proj
            return self.swiglu_linear_i8_op(gu, ws[i], scales[i], gains[i])
        return self._linear(self._swiglu(gu), proj, i, wide)

    def _rms(self, x: Tensor) -> Tensor:
        """RMS normalisation; the gain lives in the next weight."""
        if self.native:
            return self.rms_op(x, self.eps)
        return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.cfg.rms_eps)

    def _add_rms(self, x: Tensor, delta: Tensor) -> tuple:
        """The residual add and the RMSNorm after it: (x + delta, rms(x + delta))."""
        if self.native:
            return self.add_rms_op(x, delta, self.eps)
        x = x + delta
        return x, self._rms(x)

    def _rope_split(self, qkv: Tensor, pos: Tensor, cos: Tensor, sin: Tensor) -> tuple:
        """Rotary embedding on the query and key heads of the fused projection; q [n, H, hd], k/v [n, kv, hd]."""
        cfg = self.cfg
        n, kv, hd = qkv.shape[0], cfg.num_kv_heads, cfg.head_dim
        if self.native:
            q, k, v = self.rope_op(qkv, self.cos_table, self.sin_table, pos)
            return q.reshape(n, cfg.num_heads, hd), k, v
        qk, v = ops.split(qkv, (self.q_size + self.kv_size, self.kv_size), 1)
        qk = qk.reshape(n, cfg.num_heads + kv, hd)  # rope on q and k heads at once
        qk = qk * cos + ops.matmul(qk.reshape(-1, hd), self.rotate).reshape(n, -1, hd) * sin
        q, k = ops.split(qk, (cfg.num_heads, kv), 1)
        return q, k, v.reshape(n, kv, hd)

    def _swiglu(self, gu: Tensor) -> Tensor:
        if self.native:
            return self.swiglu_op(gu)
        gate, up = ops.split(gu, self.cfg.intermediate_size, 1)
        return ops.silu(gate) * up

    def _gathered_attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, token_slots: Tensor,
                            bias: Tensor) -> Tensor:
        """Plain-MindSpore fallback: every token gathers a copy of its sequence's context (slower
        than the native kernel, same result). q [T, H, hd]; token_slots [T, C]; bias [T, 1, 1, C]."""
        n, ctx = token_slots.shape
        kv, hd, grp = self.cfg.num_kv_heads, self.cfg.head_dim, self.group
        flat = token_slots.reshape(-1)
        k_t = ops.gather(k_cache, flat, 0).reshape(n, ctx, kv, hd).transpose(0, 2, 3, 1)  # [T, kv, hd, C]
        v_h = ops.gather(v_cache, flat, 0).reshape(n, ctx, kv, hd).transpose(0, 2, 1, 3)  # [T, kv, C, hd]
        probs = ops.softmax(self.bmm(q.reshape(n, kv, grp, hd), k_t) + bias, -1)
        return self.bmm(probs, v_h).reshape(n, kv * grp * hd)

    def construct(self, tokens: Tensor, positions: Tensor, slots: Tensor, token_rows: Tensor,
                  block_tables: Tensor, logit_rows: Tensor) -> Tensor:
        """One token-packed step (decode rows and prefill chunks in any mix): tokens, positions,
        slots and token_rows (each token's sequence) [T] int32; block_tables [R, W] int32 with W
        fixed by max_model_len, so no shape depends on context length; logit_rows [S] int32 indices
        into T of the tokens that sample. Returns logits [S, vocab] and their log-sum-exp [S] (for
        log-probabilities without a second pass over the vocabulary)."""
        cfg = self.cfg
        n = tokens.shape[0]
        rows = block_tables.shape[0]
        hd = cfg.head_dim
        ctx = block_tables.shape[1] * self.block_size

        cos = ops.gather(self.cos_table, positions, 0).reshape(n, 1, hd)
        sin = ops.gather(self.sin_table, positions, 0).reshape(n, 1, hd)
        # Cache slot of every context position of every sequence, in position order.
        offs = ops.arange(self.block_size, dtype=ms.int32)
        ctx_slots = (block_tables.reshape(rows, -1, 1) * self.block_size + offs).reshape(rows, ctx)
        if not self.native:
            token_slots = ops.gather(ctx_slots, token_rows, 0)  # [T, C]
            visible = ops.arange(ctx, dtype=ms.int32).reshape(1, ctx) <= positions.reshape(n, 1)
            bias = ops.select(visible, ops.zeros_like(visible, dtype=ms.float32),
                              ops.full_like(visible, NEG_INF, dtype=ms.float32)).reshape(n, 1, 1, ctx)
        wide = n >= TRANSPOSED_MIN_ROWS
        qkv_p = (self.qkv, self.qkv_t, self.qkv_s, self.qkv_g)
        o_p = (self.o, self.o_t, self.o_s, self.o_g)
        gate_up_p = (self.gate_up, self.gate_up_t, self.gate_up_s, self.gate_up_g)
        down_p = (self.down, self.down_t, self.down_s, self.down_g)
        x = ops.gather(self.embed, tokens, 0)
        qkv = self._linear(self._rms(x), qkv_p, 0, wide)
        delta = x  # each layer's MLP output; graph mode wants it bound before the loop that assigns it
        for i in range(cfg.num_layers):
            q, k, v = self._rope_split(qkv, positions, cos, sin)
            k_cache = ops.scatter_update(self.k_cache[i], slots, k)
            v_cache = ops.scatter_update(self.v_cache[i], slots, v)
            if self.native:
                attn = self.paged_attention(q.reshape(n, -1), k_cache, v_cache, ctx_slots, token_rows, positions)
            else:
                attn = self._gathered_attention(q, k_cache, v_cache, token_slots, bias)
            x, gu = self._add_norm_linear(x, self._linear(attn, o_p, i, wide), gate_up_p, i, wide)
            delta = self._swiglu_linear(gu, down_p, i, wide)
            if i + 1 < cfg.num_layers:
                x, qkv = self._add_norm_linear(x, delta, qkv_p, i + 1, wide)
        x, h = self._add_rms(x, delta)
        # h is the final norm of every token (its gain folded into lm_head); only sampling tokens go on.
        last = ops.gather(h, logit_rows, 0)
        if self.int8:
            logits = self.linear_i8_op(last, self.lm_head, self.lm_head_s, self.lm_head_g)
        else:
            logits = self.linear_op(last, self.lm_head) if self.native else self.matmul_t(last, self.lm_head)
        peak = logits.max(-1, keepdims=True)
        lse = ops.log(ops.exp(logits - peak).sum(-1)) + peak.reshape(-1)
        return logits, lse
