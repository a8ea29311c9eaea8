"""Rotary embedding and paged attention over the flat per-layer KV cache, as two interchangeable
parameter-free cells: `NativeAttention` (agent/kernels: reads K/V straight from the cache by slot)
and `PlainAttention` (MindSpore primitives, any device: every token gathers a copy of its
sequence's context, ~8 kernels per layer, same result; tokens in chunks that bound that copy).

Both take a step's `context(...)` once. Per layer, rope on the fused Q|K|V projection, its keys and
values written into the layer's cache, attention over the cache: `PlainAttention.rope_attention`,
or on the native path one op with the output projection after it, whose inputs
`NativeAttention.inputs` lays out (agent.model.norms). Rope tables are the model's parameters, passed in
through the context.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops
from agent.model_config import ModelConfig

NEG_INF = -1e9  # finite, so fully masked padding rows give garbage instead of NaN
# Bytes of gathered K and V one chunk of query tokens may hold in the plain path: tokens are taken
# in chunks of GATHER_BYTES / (context x kv x head_dim x 8), so a step's memory does not grow with
# max_model_len x tokens (a 512-token step of a 4096-context 7B model gathered 34 GB at once).
GATHER_BYTES = 64 << 20


def context_slots(block_tables: Tensor, block_size: int) -> Tensor:
    """Cache slot of every context position of every sequence, in position order: [R, W * block_size]."""
    rows = block_tables.shape[0]
    offs = ops.arange(block_size, dtype=ms.int32)
    return (block_tables.reshape(rows, -1, 1) * block_size + offs).reshape(rows, -1)


class NativeAttention(nn.Cell):
    """Rope (split into q, k, v on the way) and paged attention reading the cache by slot
    (agent/kernels/paged_attention.cpp), in the op of the projection after them: no gathered K/V
    copy, mask or permutes."""

    head_major = False  # the cache's layout (cache_shape), as a KV hand-over reads its blocks

    def __init__(self, cfg: ModelConfig, block_size: int, k: dict[str, Any]):
        super().__init__()
        self.block_size = block_size

    @staticmethod
    def cache_shape(slots: int, kv: int, row: int) -> tuple[int, ...]:
        return slots, kv, row

    def context(self, positions: Tensor, token_rows: Tensor, block_tables: Tensor, cos_table: Tensor,
                sin_table: Tensor) -> tuple:
        return positions, context_slots(block_tables, self.block_size), token_rows, cos_table, sin_table

    def inputs(self, qkv: Tensor, c: tuple, slots: Tensor, k_cache: Tensor, v_cache: Tensor, pro: Tensor) -> tuple:
        """The attention inputs of agent/kernels/fused.cpp's RopeAttention, in its order."""
        return qkv, c[3], c[4], c[0], slots, k_cache, v_cache, c[1], c[2], pro

    def shared(self, c: tuple, slots: Tensor) -> tuple:
        """The inputs every layer's attention shares, in agent/kernels/decoder_stack.cpp's order:
        cos and sin tables, positions, slots, context slots, token rows."""
        return c[3], c[4], c[0], slots, c[1], c[2]


class PlainAttention(nn.Cell):
    """`kv_dtype` float16: the cache holds float16 keys and values, scores and the weighted sum run
    in float16 MatMuls, the softmax in float32."""
    head_major = True  # the cache's layout (cache_shape), as a KV hand-over reads its blocks

    def __init__(self, cfg: ModelConfig, block_size: int, kv_dtype: str = "float32"):
        super().__init__()
        self.block_size = block_size
        self.kv_type = ms.float16 if kv_dtype == "float16" else ms.float32
        self.heads, self.kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.width, self.qk_norm, self.qk_eps = self.q_size + 2 * self.kv_size, cfg.family.qk_norm, cfg.rms_eps
        # one mask per distinct sliding window (0: the whole context), each layer's picked by index
        self.windows = sorted({cfg.window(i) for i in range(cfg.num_layers)})
        self.mask_of = [self.windows.index(cfg.window(i)) for i in range(cfg.num_layers)]
        # one cos/sin gather per rope table the layers take (agent.model_config.rope_tables)
        self.tables = sorted({cfg.rope_table(i) for i in range(cfg.num_layers)})
        self.table_of = [self.tables.index(cfg.rope_table(i)) for i in range(cfg.num_layers)]
        self.max_position = cfg.max_position
        half = self.hd // 2
        rot = np.zeros((self.hd, self.hd), np.float32)  # x @ rot == concat(-x2, x1): rotate-half as one matmul
        rot[np.arange(half) + half, np.arange(half)] = -1.0
        rot[np.arange(half), np.arange(half) + half] = 1.0
        self.rotate = Tensor(rot)
        self.bmm, self.bmm_t = ops.BatchMatMul(), ops.BatchMatMul(transpose_b=True)

    @staticmethod
    def cache_shape(slots: int, kv: int, row: int) -> tuple[int, ...]:
        """Head-major: a gather along the slots gives each head's context contiguous (`_attend`)."""
        return kv, slots, row

    def context(self, positions: Tensor, token_rows: Tensor, block_tables: Tensor, cos_table: Tensor,
                sin_table: Tensor) -> tuple:
        """cos/sin of every token [n, 1, hd] (one pair per rope table in `tables`), each token's context
        slots [n, C] and its mask biases [n, 1, 1, C], one per sliding window in `windows`."""
        n = positions.shape[0]
        ctx_slots = context_slots(block_tables, self.block_size)
        ctx = ctx_slots.shape[1]
        token_slots = ops.gather(ctx_slots, token_rows, 0)
        at = ops.arange(ctx, dtype=ms.int32).reshape(1, ctx)
        biases = []
        for window in self.windows:
            visible = at <= positions.reshape(n, 1)
            if window:
                visible = ops.logical_and(visible, at > positions.reshape(n, 1) - window)
            biases.append(ops.select(visible, ops.zeros_like(visible, dtype=ms.float32),
                                     ops.full_like(visible, NEG_INF, dtype=ms.float32)).reshape(n, 1, 1, ctx))
        rows = [positions + t * self.max_position for t in self.tables]
        cos = tuple(ops.gather(cos_table, r, 0).reshape(n, 1, self.hd) for r in rows)
        sin = tuple(ops.gather(sin_table, r, 0).reshape(n, 1, self.hd) for r in rows)
        return cos, sin, token_slots, tuple(biases)

    def rope_attention(self, qkv: Tensor, c: tuple, slots: Tensor, k_cache: Tensor, v_cache: Tensor,
                       pro: Tensor, layer: int) -> Tensor:
        """`pro`: the layer's prologue (agent.model.fusion.layer_prologues), applied before rope;
        `layer` picks its rope table and its sliding window's mask."""
        t = self.table_of[layer]
        q, k_cache, v_cache = self._rope_write(self._prologue(qkv, pro), c[0][t], c[1][t], slots, k_cache, v_cache)
        return self._attention(q, k_cache, v_cache, c[2], c[3][self.mask_of[layer]])

    def _prologue(self, qkv: Tensor, pro: Tensor) -> Tensor:
        """The Q|K|V bias, then (where the family has it) RMSNorm over each q and k head."""
        qkv = qkv + pro[:self.width]
        if not self.qk_norm:
            return qkv
        n, hd = qkv.shape[0], self.hd
        q, k, v = ops.split(qkv, (self.q_size, self.kv_size, self.kv_size), 1)
        q, k = q.reshape(n, self.heads, hd), k.reshape(n, self.kv, hd)
        q = q * ops.rsqrt(ops.mean(q * q, -1, keep_dims=True) + self.qk_eps) * pro[self.width:self.width + hd]
        k = k * ops.rsqrt(ops.mean(k * k, -1, keep_dims=True) + self.qk_eps) * pro[self.width + hd:self.width + 2 * hd]
        return ops.concat((q.reshape(n, -1), k.reshape(n, -1), v), 1)

    def _rope_write(self, qkv: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, k_cache: Tensor,
                    v_cache: Tensor) -> tuple:
        """Rope on the query and key heads at once: (q [n, H, hd], the updated caches). Keys and values
        are scattered into the caches by slot: O(tokens), where every other write form copies the
        whole cache; attention reads what the scatters return (read back from the Parameters, a long-context
        step held far more memory: docs/perf-notes.md)."""
        n, hd = qkv.shape[0], self.hd
        qk, v = ops.split(qkv, (self.q_size + self.kv_size, self.kv_size), 1)
        qk = qk.reshape(n, self.heads + self.kv, hd)
        qk = qk * cos + ops.matmul(qk.reshape(-1, hd), self.rotate).reshape(n, -1, hd) * sin
        q, k = ops.split(qk, (self.heads, self.kv), 1)
        # (head, slot) of every head of every token: the caches are head-major [kv, slots, hd]
        at = ops.stack((ops.arange(self.kv, dtype=ms.int32).reshape(self.kv, 1).broadcast_to((self.kv, n)),
                        slots.reshape(1, n).broadcast_to((self.kv, n))), -1)
        return (q, ops.scatter_nd_update(k_cache, at, ops.cast(k.transpose(1, 0, 2), self.kv_type)),
                ops.scatter_nd_update(v_cache, at, ops.cast(v.reshape(n, self.kv, hd).transpose(1, 0, 2), self.kv_type)))

    def _attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, token_slots: Tensor, bias: Tensor) -> Tensor:
        """Chunks of tokens one after another (each waits for the last: MindSpore then reuses one
        chunk's gathered K/V for the next, where independent chunks each kept their own)."""
        n, ctx = token_slots.shape
        chunk = max(1, GATHER_BYTES // (ctx * self.kv * self.hd * 8))
        q = q.reshape(n, -1)
        parts: list[Tensor] = []
        for s in range(0, n, chunk):  # static shapes: unrolled when the graph is built
            slots = token_slots[s:s + chunk] if not parts else ops.depend(token_slots[s:s + chunk], parts[-1])
            parts.append(self._attend(q[s:s + chunk], k_cache, v_cache, slots, bias[s:s + chunk]))
        return parts[0] if len(parts) == 1 else ops.concat(parts, 0)

    def _attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, token_slots: Tensor, bias: Tensor) -> Tensor:
        """Gathered along the slots of the head-major caches, K and V come out as [kv, T, C, hd]:
        the MatMuls take them as they are (a transposed copy of each was kept for the graph's life)."""
        n, ctx = token_slots.shape
        kv, hd, grp = self.kv, self.hd, self.heads // self.kv
        flat = token_slots.reshape(-1)
        k = ops.gather(k_cache, flat, 1).reshape(kv, n, ctx, hd)
        v = ops.gather(v_cache, flat, 1).reshape(kv, n, ctx, hd)
        qh = ops.cast(q.reshape(n, kv, grp, hd).transpose(1, 0, 2, 3), self.kv_type)  # [kv, T, grp, hd]
        scores = ops.cast(self.bmm_t(qh, k), ms.float32)  # [kv, T, grp, C]
        probs = ops.cast(ops.softmax(scores + bias.reshape(1, n, 1, ctx), -1), self.kv_type)
        return ops.cast(self.bmm(probs, v), ms.float32).transpose(1, 0, 2, 3).reshape(n, kv * grp * hd)
