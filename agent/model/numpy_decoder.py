"""The decoder in NumPy, read top to bottom: one sequence, dense causal attention, every family's flag
in view (agent.model_config.Family). It is the readable twin of agent/model/decoder.py, which runs
the same math fused, quantised and packed into MindSpore ops; int8 calibration runs it to see each
projection's inputs (agent/model/calibrate.py). tests/reference.py stays an independent float64
Llama for the tests, and transformers' fixtures check this one for every family."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from agent.model_config import ModelConfig, Weights, rope_tables

Tap = Callable[[str, np.ndarray], None]  # (projection kind: qkv, o, gate_up, down, head; its input [n, in])


class NumpyDecoder:
    def __init__(self, cfg: ModelConfig, weights: Weights, dtype: Any = np.float64, tap: Tap | None = None):
        self.cfg, self.w, self.dtype = cfg, weights, dtype
        self.tap = tap or (lambda kind, a: None)
        self.cos, self.sin = rope_tables(cfg, dtype)

    def mat(self, name: str) -> np.ndarray:
        """A projection's matrix [out, in] (int8 rows dequantised)."""
        m = self.w[name]
        return (m.dequantize() if hasattr(m, "dequantize") else m).astype(self.dtype, copy=False)

    def norm(self, t: np.ndarray, name: str) -> np.ndarray:
        """RMSNorm with the file's gain (a Gemma file's (1 + w) was added to it at load)."""
        g = self.w[name].astype(self.dtype, copy=False)
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + self.cfg.rms_eps) * g

    def forward(self, ids: list[int], logits: bool = True) -> np.ndarray:
        """Logits [n, vocab] at every position of `ids`; `logits=False`: the final norm's output."""
        cfg, fam = self.cfg, self.cfg.family
        x = self.mat("model.embed_tokens.weight")[np.asarray(ids)]
        if fam.embed_scale:  # Gemma
            x = x * self.dtype(np.sqrt(cfg.hidden_size))
        mlp_norm = "pre_feedforward_layernorm" if fam.sandwich_norms else "post_attention_layernorm"
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            delta = self.attention(i, self.norm(x, p + "input_layernorm.weight"))
            x = x + (self.norm(delta, p + "post_attention_layernorm.weight") if fam.sandwich_norms else delta)
            delta = self.mlp(p, self.norm(x, p + mlp_norm + ".weight"))
            x = x + (self.norm(delta, p + "post_feedforward_layernorm.weight") if fam.sandwich_norms else delta)
        h = self.norm(x, "model.norm.weight")
        self.tap("head", h)
        if not logits:
            return h
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        return h @ self.mat(head).T

    def attention(self, i: int, a: np.ndarray) -> np.ndarray:
        """Layer i's attention on its normed input `a` [n, hidden]: its o_proj's output."""
        cfg, p = self.cfg, f"model.layers.{i}."
        n, h, kv, hd = len(a), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.tap("qkv", a)
        q, k, v = (self.heads(p, name, a, heads) for name, heads in (("q", h), ("k", kv), ("v", kv)))
        start = cfg.rope_table(i) * cfg.max_position  # sliding layers may have their own rope base
        cos, sin = self.cos[start:start + n, None, :], self.sin[start:start + n, None, :]
        rope = lambda t: t * cos + np.concatenate([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa: E731
        k, v = np.repeat(rope(k), h // kv, 1), np.repeat(v, h // kv, 1)  # GQA
        s = np.einsum("qhd,khd->hqk", rope(q), k) * cfg.scale + self.mask(n, cfg.window(i))
        s = np.exp(s - s.max(-1, keepdims=True))
        att = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(n, h * hd)
        self.tap("o", att)
        return att @ self.mat(p + "self_attn.o_proj.weight").T

    def heads(self, p: str, name: str, a: np.ndarray, heads: int) -> np.ndarray:
        """One of q, k, v [n, heads, hd]: the projection, its bias (Qwen2) and, for q and k, its head
        norm (Qwen3, Gemma 3)."""
        y = a @ self.mat(p + f"self_attn.{name}_proj.weight").T
        if self.cfg.family.qkv_bias:
            y = y + self.w[p + f"self_attn.{name}_proj.bias"].astype(self.dtype, copy=False)
        y = y.reshape(len(a), heads, self.cfg.head_dim)
        if self.cfg.family.qk_norm and name != "v":
            y = self.norm(y, p + f"self_attn.{name}_norm.weight")
        return y

    def mask(self, n: int, window: int) -> np.ndarray:
        """0 where a query may attend (causal; within `window` tokens on a sliding layer), else -inf."""
        q, k = np.arange(n)[:, None], np.arange(n)[None, :]
        allowed = (k <= q) & ((q - k < window) if window else True)
        return np.where(allowed, 0.0, -np.inf).astype(self.dtype)

    def mlp(self, p: str, a: np.ndarray) -> np.ndarray:
        """The gated MLP on its normed input: SwiGLU, or GeGLU with tanh GELU (Gemma 3)."""
        self.tap("gate_up", a)
        gate, up = a @ self.mat(p + "mlp.gate_proj.weight").T, a @ self.mat(p + "mlp.up_proj.weight").T
        if self.cfg.family.activation == "gelu_tanh":
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
        else:
            act = gate / (1 + np.exp(-gate)) * up
        self.tap("down", act)
        return act @ self.mat(p + "mlp.down_proj.weight").T
