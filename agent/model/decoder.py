"""The decoder (Llama, and what each family of agent.weights.families adds) in MindSpore primitives
that exist on CPU, GPU and Ascend.

One forward serves any mix of prefill chunks and decodes as one flat list of tokens (the TND layout
of MindSpore's Ascend paged-attention ops): row-independent ops run once over all tokens, and each
token attends over its own sequence's paged context, read from a flat per-layer KV cache by block
table. New K/V rows are written in place by slot (agent.model.attention), which is O(tokens): every
other write form copies the whole cache each step.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from agent.model.backend import Backend
from agent.model.blocks import type_counts
from agent.model.params import KV_DTYPES, param, zeros_param
from agent.model.linear import LayerWeights
from agent.model.fusion import layer_prologues, post_gain_offset, row_scale
from agent.model.lora import LoraExpand, b_stacks
from agent.model_config import ModelConfig, rope_tables
from common.memory import kv_head_bytes


class DecoderModel(nn.Cell):
    """Weights are Hugging Face-named numpy arrays (``model.layers.0.self_attn.q_proj.weight``...):
    float32, or agent.model.quant.Int8Rows where the file held int8. `backend` (agent.model.backend.Backend) picks
    the projections' format, the KV cache's dtype and the kernels once; norms, rope, attention and
    logits compute in fp32."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Any], num_slots: int, block_size: int,
                 backend: Backend | None = None):
        super().__init__()
        backend = backend or Backend()
        self.cfg, self.block_size, self.num_slots = cfg, block_size, num_slots
        self.kv_dtype = backend.kv_dtype  # the cache as stored (common.memory.KV_DTYPES)
        k = backend.kernels(cfg)
        self.norms = backend.norms(cfg, k)
        self.attn = backend.attention(cfg, block_size, k)
        attn_scale = cfg.scale
        self.embedding, tied = backend.embedding(cfg, weights, k)
        proj = backend.projections(cfg, weights, attn_scale, self.norms, k, tied if cfg.tie_word_embeddings else None)
        self.qkv, self.o, self.gate_up, self.down, self.head = (proj[n] for n in ("qkv", "o", "gate_up", "down", "head"))
        self.comm = backend.collectives(cfg, k)  # tensor parallel: partial sums and vocabulary shards combined
        # LoRA: each projection's output then carries every slot's x·A too (agent.model.lora)
        self.lora = LoraExpand(b_stacks(backend.lora, cfg, row_scale(cfg, attn_scale)), cfg) if backend.lora else None
        self.stack_op = backend.stack_op(cfg, k)  # every decoder layer in one op, or None: four a layer
        self.one_op_stack = self.stack_op is not None
        prologues = LayerWeights("prologue", cfg.num_layers, self.one_op_stack)  # agent.model.fusion.layer_prologues
        for i, pro in enumerate(layer_prologues(cfg, weights, attn_scale)):
            prologues.add(i, (pro,))
        self.prologue = prologues.parameters()[0]
        self.post_gains = post_gain_offset(cfg)  # where a prologue's output-norm gains start (sandwich norms)
        cos, sin = rope_tables(cfg)
        self.cos_table, self.sin_table = param("cos_table", cos), param("sin_table", sin)
        row = kv_head_bytes(cfg.head_dim, backend.kv_dtype) // np.dtype(KV_DTYPES[backend.kv_dtype]).itemsize
        shape, kv_type = self.attn.cache_shape(num_slots, cfg.num_kv_heads, row), KV_DTYPES[backend.kv_dtype]
        # The caches' pages are faulted in at load, as vLLM allocates its cache (the pool fits: common.memory
        # planned it). Left to their first writes, a fresh server zeroed 2 MiB pages inside its first
        # steps (docs/perf-notes.md).
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
        head = {id(p) for p in self.head.get_parameters()}  # a tied gguf head reads the embedding's blocks
        return sum(p.nbytes for p in self.get_parameters() if id(p) in head or not any(s in p.name for s in skip))

    def block_types(self) -> str:
        """model_dtype gguf: how many tensors of each block type the projections and head hold ('' otherwise)."""
        kinds = [t for p in (self.qkv, self.o, self.gate_up, self.down, self.head) if hasattr(p, "block_types")
                 for t in p.block_types()]
        return type_counts(kinds) if kinds else ""

    @property
    def kv_cache_bytes(self) -> int:
        return sum(p.nbytes for p in self.get_parameters() if "_cache" in p.name)

    def construct(self, tokens: Tensor, positions: Tensor, slots: Tensor, token_rows: Tensor,
                  block_tables: Tensor, logit_rows: Tensor, lora_mask: Tensor | None = None) -> Tensor:
        """One token-packed step (decode rows and prefill chunks in any mix): tokens, positions,
        slots and token_rows (each token's sequence) [T] int32; block_tables [R, W] int32 with W
        fixed by max_model_len, so no shape depends on context length; logit_rows [S] int32 indices
        into T of the tokens that sample. Returns logits [S, vocab] and their log-sum-exp [S] (for
        log-probabilities without a second pass over the vocabulary). With LoRA, `lora_mask` [T, slots]:
        each token's adapter slot, one-hot (zeros: the base model)."""
        c = self.attn.context(positions, token_rows, block_tables, self.cos_table, self.sin_table)
        x = self.embedding(tokens)
        if self.one_op_stack and self.lora is None:
            h = self.stack_op(x, *self.attn.shared(c, slots), self.norms.eps, self.k_cache, self.v_cache, self.prologue,
                              *self.qkv.every_layer(), *self.o.every_layer(), *self.gate_up.every_layer(),
                              *self.down.every_layer())
        elif self.one_op_stack:
            h = self.stack_op(x, *self.attn.shared(c, slots), self.norms.eps, self.k_cache, self.v_cache, self.prologue,
                              *self.qkv.every_layer(), *self.o.every_layer(), *self.gate_up.every_layer(),
                              *self.down.every_layer(), lora_mask, *self.lora.inputs())
        else:
            h = self.four_op_layers(x, c, slots, lora_mask)
        # h is the final norm of every token (its gain folded into the head); only sampling tokens go on.
        logits = self.comm.gather(self.head.linear(ops.gather(h, logit_rows, 0), 0))
        return logits, self.norms.logsumexp(logits)

    def four_op_layers(self, x: Tensor, c: tuple, slots: Tensor, m: Tensor | None) -> Tensor:
        """The decoder layers as four ops each, where no stack op runs them: the final norm of the
        last layer's output (`m`: the LoRA mask, as `construct` takes it)."""
        qkv = self.adapted(self.qkv.linear(self.norms.rms(x), 0), "qkv", 0, m)
        delta = x  # each layer's MLP output; graph mode wants it bound before the loop that assigns it
        h, g = self.cfg.hidden_size, self.post_gains
        for i in range(self.cfg.num_layers):
            attn = self.comm.reduce(self.adapted(self.o.attention_linear(self.attn, qkv, c, slots, self.k_cache[i],
                                                                         self.v_cache[i], self.prologue[i], i), "o", i, m))
            if self.cfg.family.sandwich_norms:
                attn = self.norms.rms_gain(attn, self.prologue[i][g:g + h])
            x, gu = self.gate_up.add_norm_linear(x, attn, i)
            gu = self.adapted(gu, "gate_up", i, m)
            delta = self.comm.reduce(self.adapted(self.down.swiglu_linear(gu, i), "down", i, m))
            if self.cfg.family.sandwich_norms:
                delta = self.norms.rms_gain(delta, self.prologue[i][g + h:g + 2 * h])
            if i + 1 < self.cfg.num_layers:
                x, qkv = self.qkv.add_norm_linear(x, delta, i + 1)
                qkv = self.adapted(qkv, "qkv", i + 1, m)
        return self.norms.add_rms(x, delta)[1]

    def adapted(self, y: Tensor, kind: str, i: int, m: Tensor | None) -> Tensor:
        """A projection's output with its LoRA expand (as it is without adapters)."""
        if self.lora is None:
            return y
        return self.lora.expand(y, kind, i, m)
