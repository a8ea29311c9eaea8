"""Independent float64 NumPy Llama forward (dense causal attention, no cache) used as ground truth."""
from __future__ import annotations

import numpy as np


def random_weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, i_sz, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def mat(o: int, n: int) -> np.ndarray:
        return (rng.standard_normal((o, n)) / np.sqrt(n)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, d)).astype(np.float32),
         "model.norm.weight": norm(d), "lm_head.weight": mat(cfg.vocab_size, d)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(cfg.num_heads * hd, d)
        w[p + "self_attn.k_proj.weight"] = mat(cfg.num_kv_heads * hd, d)
        w[p + "self_attn.v_proj.weight"] = mat(cfg.num_kv_heads * hd, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, cfg.num_heads * hd)
        w[p + "mlp.gate_proj.weight"] = mat(i_sz, d)
        w[p + "mlp.up_proj.weight"] = mat(i_sz, d)
        w[p + "mlp.down_proj.weight"] = mat(d, i_sz)
    return w


def reference_logits(cfg, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), vocab] for every position of one sequence."""
    from agent.model_config import rope_inv_freq  # the frequency formula is config math, shared on purpose

    f = {k: v.astype(np.float64) for k, v in w.items()}
    n, hd, h, kv = len(tokens), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    ang = np.outer(np.arange(n), rope_inv_freq(cfg))
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(x: np.ndarray) -> np.ndarray:  # x [n, heads, hd], rotate-half layout
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * g

    x = f["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((n, n), bool))
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        hs = rms(x, f[p + "input_layernorm.weight"])
        q = rope((hs @ f[p + "self_attn.q_proj.weight"].T).reshape(n, h, hd))
        k = rope((hs @ f[p + "self_attn.k_proj.weight"].T).reshape(n, kv, hd))
        v = (hs @ f[p + "self_attn.v_proj.weight"].T).reshape(n, kv, hd)
        k = np.repeat(k, h // kv, axis=1)
        v = np.repeat(v, h // kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(causal[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(n, h * hd)
        x = x + o @ f[p + "self_attn.o_proj.weight"].T
        hs = rms(x, f[p + "post_attention_layernorm.weight"])
        g = hs @ f[p + "mlp.gate_proj.weight"].T
        u = hs @ f[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ f[p + "mlp.down_proj.weight"].T
    head = f.get("lm_head.weight", f["model.embed_tokens.weight"])
    if cfg.tie_word_embeddings:
        head = f["model.embed_tokens.weight"]
    return rms(x, f["model.norm.weight"]) @ head.T
